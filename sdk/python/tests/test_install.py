"""pip installs the SDK with no package index to fetch from: `pip install
./sdk/python` as docs/python.md says, pip's build isolation on, --no-index.
Its build backend (_build/libdsec_build.py) needs only the standard library.
pip must be there for the interpreter that runs the tests; without it these
tests skip, and under DSEC_TEST_ROOT=1 (CI) they fail."""

import _path  # noqa: F401
import os
import subprocess
import sys
import tempfile
import unittest

SDK = os.path.dirname(_path.HERE)
sys.path.insert(0, os.path.join(SDK, "_build"))
import libdsec_build  # noqa: E402


def pip_env():
    """The environment of a pip run that reads no configuration and asks
    nothing: only the command line decides where packages come from."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


class InstallTest(unittest.TestCase):
    def setUp(self):
        r = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
        if r.returncode != 0:
            why = f"pip is not installed for {sys.executable} (apt-get install python3-pip)"
            if os.environ.get("DSEC_TEST_ROOT") == "1":
                self.fail("required under DSEC_TEST_ROOT=1: " + why)
            self.skipTest(why)
        self.tmp = tempfile.TemporaryDirectory(prefix="libdsec-install-")
        self.addCleanup(self.tmp.cleanup)

    def pip(self, *args, python=None):
        cmd = [sys.executable, "-m", "pip"]
        if python:
            cmd += ["--python", python]
        cmd += ["install", "--no-index", "--no-cache-dir", *args]
        r = subprocess.run(cmd, env=pip_env(), capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, f"{' '.join(cmd)}:\n{r.stdout}{r.stderr}")

    def imported_from(self, python, env=None):
        """Where python, started outside the source tree, imports libdsec from,
        and the version it reports."""
        r = subprocess.run([python, "-s", "-c", "import libdsec, libdsec.errors; print(libdsec.__file__); print(libdsec.__version__)"],
                           cwd=self.tmp.name, env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        path, version = r.stdout.split()
        return path, version

    def check_installed(self, target):
        env = dict(os.environ, PYTHONPATH=target)
        path, version = self.imported_from(sys.executable, env)
        self.assertEqual(path, os.path.join(target, "libdsec", "__init__.py"))
        self.assertEqual(version, libdsec_build.version())
        want = sorted(os.path.relpath(p, "libdsec") for p in libdsec_build.package_files())
        got = sorted(n for n in os.listdir(os.path.join(target, "libdsec")) if n.endswith(".py"))
        self.assertEqual(got, want)
        dist = os.path.join(target, f"libdsec-{version}.dist-info", "METADATA")
        with open(dist) as f:
            meta = f.read()
        self.assertIn("Name: libdsec\n", meta)
        self.assertIn("Requires-Python: >=3.10\n", meta)

    def test_install_from_the_tree(self):
        target = os.path.join(self.tmp.name, "target")
        self.pip("--target", target, SDK)
        self.check_installed(target)

    def test_install_from_the_sdist(self):
        sdist = libdsec_build.build_sdist(self.tmp.name)
        target = os.path.join(self.tmp.name, "target")
        self.pip("--target", target, os.path.join(self.tmp.name, sdist))
        self.check_installed(target)

    def test_editable_install(self):
        venv = os.path.join(self.tmp.name, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
        python = os.path.join(venv, "bin", "python")
        self.pip("--editable", SDK, python=python)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        path, _ = self.imported_from(python, env)
        self.assertEqual(path, os.path.join(SDK, "libdsec", "__init__.py"))
        # Only libdsec: not the source tree's other top-level names.
        r = subprocess.run([python, "-c", "import tests"], cwd=self.tmp.name, env=env, capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0, "an editable install made the SDK's tests importable")


if __name__ == "__main__":
    unittest.main()
