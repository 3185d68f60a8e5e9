"""Starts a real dsecd for the live tests and tears it down afterwards.

The binaries come from $DSEC_BIN_DIR (default <repo>/bin). Without a dsecd
binary, or without root, the live tests skip; with DSEC_TEST_ROOT=1 (as CI
sets) they fail instead, so CI cannot pass by skipping.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
ENV = "busybox:test"


def bin_dir():
    return os.environ.get("DSEC_BIN_DIR") or os.path.join(REPO, "bin")


def require(cond, why):
    """Skip (or fail under DSEC_TEST_ROOT=1) when cond is false."""
    if cond:
        return
    if os.environ.get("DSEC_TEST_ROOT") == "1":
        raise AssertionError(f"required for the live tests under DSEC_TEST_ROOT=1: {why}")
    raise unittest.SkipTest(why)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def busybox_tree(dest):
    """A minimal base: busybox and its applets, /etc/passwd and /etc/group."""
    script = os.path.join(REPO, "scripts", "build-busybox-base.sh")
    if os.path.exists(script):
        subprocess.run([script, dest], check=True, capture_output=True, timeout=120)
        return
    for d in ("bin", "etc", "tmp", "root", "home", "proc", "sys", "dev"):
        os.makedirs(os.path.join(dest, d), exist_ok=True)
    os.chmod(os.path.join(dest, "tmp"), 0o1777)
    shutil.copy2("/bin/busybox", os.path.join(dest, "bin", "busybox"))
    out = subprocess.run(["/bin/busybox", "--list"], check=True, capture_output=True, text=True).stdout
    for applet in out.split():
        p = os.path.join(dest, "bin", applet)
        if applet != "busybox" and not os.path.lexists(p):
            os.symlink("busybox", p)
    with open(os.path.join(dest, "etc", "passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/sh\n")
    with open(os.path.join(dest, "etc", "group"), "w") as f:
        f.write("root:x:0:\nnogroup:x:65534:\n")


class Daemon:
    """One dsecd on a fresh root and loopback port."""

    def __init__(self, extra_args=()):
        self.extra_args = list(extra_args)
        self.bin = bin_dir()
        self.dsecd = os.path.join(self.bin, "dsecd")
        require(os.path.exists(self.dsecd), f"no dsecd binary at {self.dsecd} (run make build)")
        require(os.geteuid() == 0, "the live tests need root")
        require(shutil.which("runc") is not None, "runc is not installed")
        require(os.path.exists("/bin/busybox"), "busybox-static is not installed")
        self.root = tempfile.mkdtemp(prefix="dsec-pytest-root-")
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.unix_addr = "unix://" + os.path.join(self.root, "dsecd.sock")
        self.log_path = os.path.join(self.root, "dsecd.log")
        self.proc = None

    def start(self):
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.dsecd, "--root", self.root, "--listen", self.addr, "--node", "py", "--log-level", "debug",
             # Listing 1 asks for 4 cores; the test machines have 2.
             "--max-cpus", "8"] + self.extra_args,
            stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.wait_ready()

    def wait_ready(self, timeout=30):
        import asyncio
        import libdsec
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            # The TCP port needs the token dsecd writes at start; the
            # clients and the CLI of these tests read it from there.
            token_file = os.path.join(self.root, "admin.token")
            if not os.path.exists(token_file):
                time.sleep(0.05)
                continue
            os.environ["DSEC_TOKEN_FILE"] = token_file
            try:
                async def probe():
                    async with libdsec.AsyncClient(self.addr) as c:
                        await c.list_layers(timeout=1)
                asyncio.run(probe())
                return
            except Exception as e:  # not up yet
                last = e
                time.sleep(0.05)
        self.stop()
        raise AssertionError(f"dsecd did not become ready: {last}\n{self.log_tail()}")

    def import_base(self, ref=ENV):
        tree = tempfile.mkdtemp(prefix="dsec-pytest-base-")
        try:
            busybox_tree(tree)
            cli = os.path.join(self.bin, "dsec")
            if os.path.exists(cli):
                r = subprocess.run([cli, "--addr", self.addr, "layer", "import", "--kind", "base", ref, tree],
                                   capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    raise AssertionError(f"dsec layer import: {r.stdout}{r.stderr}")
            else:
                import libdsec
                with libdsec.Client(self.addr) as c:
                    c.import_layer(ref, tree, kind="base")
        finally:
            shutil.rmtree(tree, ignore_errors=True)

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self):
        """Kill the daemon, tear its node down, remove its root."""
        self.kill()
        if os.environ.get("DSEC_TOKEN_FILE", "").startswith(self.root):
            del os.environ["DSEC_TOKEN_FILE"]  # the tests after these run against fakes
        r = subprocess.run([self.dsecd, "teardown", "--root", self.root], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            sys.stderr.write(f"dsecd teardown: {r.stdout}{r.stderr}\n")
        shutil.rmtree(self.root, ignore_errors=True)
        return r.returncode == 0

    def log_tail(self, n=4096):
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""
