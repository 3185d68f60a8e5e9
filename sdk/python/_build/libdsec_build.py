"""The build backend of libdsec (PEP 517, and PEP 660 for editable installs).

libdsec needs only the standard library, and so does its build: this
backend writes the wheel and the sdist with zipfile and tarfile. pyproject.toml
names it with no build requirements, so pip's isolated build environment
installs nothing and ``pip install ./sdk/python`` works on a machine that
cannot reach a package index (setuptools, the usual backend, would have to be
fetched into that environment first).

The project's metadata is here; its version is ``__version__`` in
libdsec/__init__.py.
"""

import ast
import base64
import csv
import gzip
import hashlib
import io
import os
import tarfile
import zipfile

NAME = "libdsec"
SUMMARY = "Python client of dsec, the sandbox infrastructure for agentic RL"
REQUIRES_PYTHON = ">=3.10"
LICENSE = "Apache-2.0"
TAG = "py3-none-any"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, NAME)
# What an sdist carries besides the package: enough to build it again.
SDIST_EXTRA = ("pyproject.toml", "README.md", os.path.join("_build", "libdsec_build.py"))
# Archive entries get a fixed time, so a build of the same tree is the same
# bytes: 1980-01-01 (zip cannot say 1970).
ZIP_TIME = (1980, 1, 1, 0, 0, 0)
TAR_TIME = 315532800


def version():
    """__version__ of libdsec/__init__.py, read without importing libdsec."""
    with open(os.path.join(PACKAGE, "__init__.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("libdsec/__init__.py sets no __version__")


def metadata():
    """The core metadata (PKG-INFO, METADATA), the README as its description."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version()}\nSummary: {SUMMARY}\n"
            f"License: {LICENSE}\nRequires-Python: {REQUIRES_PYTHON}\n"
            f"Description-Content-Type: text/markdown\n\n{readme}")


def package_files():
    """The package's files (its modules and a py.typed marker), as paths
    relative to ROOT with / separators."""
    out = []
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py") or name == "py.typed":
                out.append(os.path.relpath(os.path.join(dirpath, name), ROOT).replace(os.sep, "/"))
    return out


def _read(rel):
    with open(os.path.join(ROOT, rel), "rb") as f:
        return f.read()


class _Wheel:
    """A wheel being written: files go in with their RECORD line."""

    def __init__(self, directory):
        self.dist_info = f"{NAME}-{version()}.dist-info"
        self.basename = f"{NAME}-{version()}-{TAG}.whl"
        self.zip = zipfile.ZipFile(os.path.join(directory, self.basename), "w", zipfile.ZIP_DEFLATED)
        self.record = []

    def add(self, arcname, data):
        info = zipfile.ZipInfo(arcname, date_time=ZIP_TIME)
        info.external_attr = 0o644 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zip.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.record.append((arcname, f"sha256={digest}", str(len(data))))

    def close(self):
        self.add(f"{self.dist_info}/METADATA", metadata().encode())
        self.add(f"{self.dist_info}/WHEEL", (f"Wheel-Version: 1.0\nGenerator: libdsec_build\n"
                                             f"Root-Is-Purelib: true\nTag: {TAG}\n").encode())
        self.add(f"{self.dist_info}/top_level.txt", f"{NAME}\n".encode())
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerows(self.record)
        w.writerow((f"{self.dist_info}/RECORD", "", ""))
        info = zipfile.ZipInfo(f"{self.dist_info}/RECORD", date_time=ZIP_TIME)
        info.external_attr = 0o644 << 16
        self.zip.writestr(info, buf.getvalue())
        self.zip.close()
        return self.basename


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    """PEP 517: a pure-Python wheel of the package."""
    wheel = _Wheel(wheel_directory)
    for rel in package_files():
        wheel.add(rel, _read(rel))
    return wheel.close()


# An editable install puts this module on the path through a .pth file: it
# finds libdsec in the source tree, and nothing else there (the tests, the
# benchmark script), as a path entry for the whole directory would.
_EDITABLE_FINDER = '''"""Finds libdsec in its source tree (an editable install of libdsec)."""
import importlib.util
import sys

_PACKAGE = {package!r}


class _Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "libdsec":
            return None
        return importlib.util.spec_from_file_location(
            name, _PACKAGE + "/__init__.py", submodule_search_locations=[_PACKAGE])


if _Finder not in sys.meta_path:
    sys.meta_path.append(_Finder)
'''


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """PEP 660: a wheel that imports libdsec from this source tree."""
    wheel = _Wheel(wheel_directory)
    wheel.add("_libdsec_editable.py", _EDITABLE_FINDER.format(package=PACKAGE).encode())
    wheel.add("_libdsec_editable.pth", b"import _libdsec_editable\n")
    return wheel.close()


def build_sdist(sdist_directory, config_settings=None):
    """PEP 517: the source tree an sdist needs to build the wheel again."""
    top = f"{NAME}-{version()}"
    basename = f"{top}.tar.gz"

    def add(tar, arcname, data):
        info = tarfile.TarInfo(f"{top}/{arcname}")
        info.size, info.mtime, info.mode = len(data), TAR_TIME, 0o644
        tar.addfile(info, io.BytesIO(data))

    with gzip.GzipFile(os.path.join(sdist_directory, basename), "wb", mtime=TAR_TIME) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            add(tar, "PKG-INFO", metadata().encode())
            for rel in [p.replace(os.sep, "/") for p in SDIST_EXTRA] + package_files():
                add(tar, rel, _read(rel))
    return basename
