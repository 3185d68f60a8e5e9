"""An imitation of FnCallService on top of FakeServer, for offline tests.

It answers like a node's runner: "python" code really runs, with the
host's python3, in a fresh temporary directory (files written, fetch_files
read back, the run timeout applied); "cpp" never compiles; any other
language is InvalidArgument. RunCodeBatch runs its calls in parallel, as
the apiserver does, and records how many ran at once.
"""

import base64
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from fakeconnect import FakeServer

SERVICE = "dsec.v1.FnCallService"

LANGUAGES = [
    {"name": "python", "environment": "fncall:latest", "sourceFile": "tmp_code.py",
     "runArgv": ["python", "tmp_code.py"], "zygote": True},
    {"name": "cpp", "environment": "fncall:latest", "compiled": True, "sourceFile": "tmp_code.cpp",
     "compileArgv": ["g++", "-std=c++17", "tmp_code.cpp", "-o", "test", "-lpthread"], "runArgv": ["./test"]},
]


def b64(b):
    return base64.b64encode(b).decode()


class BadCall(Exception):
    pass


class FakeFnCall:
    def __init__(self):
        self.server = FakeServer()
        self.lock = threading.Lock()
        self.running = 0
        self.most_at_once = 0
        self.server.route("RunCode", self.run_code, service=SERVICE)
        self.server.route("RunCodeBatch", self.run_code_batch, service=SERVICE)
        self.server.route("ListLanguages", lambda c: c.reply({"languages": LANGUAGES}), service=SERVICE)

    @property
    def addr(self):
        return self.server.addr

    def close(self):
        self.server.close()

    def run_code(self, call):
        try:
            call.reply(self.run(call.msg))
        except BadCall as e:
            call.error("invalid_argument", str(e))

    def run_code_batch(self, call):
        def one(m):
            try:
                return self.run(m)
            except BadCall as e:
                return {"status": "RUN_STATUS_SANDBOX_ERROR", "message": str(e)}
        calls = call.msg.get("calls", [])
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(calls)))) as ex:
            call.reply({"results": list(ex.map(one, calls))})

    def run(self, m):
        lang = m.get("language", "")
        if lang == "cpp":
            return {"status": "RUN_STATUS_FAILED", "node": "fake",
                    "compileResult": {"status": "COMMAND_STATUS_FINISHED", "returnCode": 1,
                                      "stderr": b64(b"tmp_code.cpp:1:1: error: expected unqualified-id\n"),
                                      "executionTimeSeconds": 0.3}}
        if lang != "python":
            raise BadCall(f'language "{lang}" is not known here (known: cpp, python)')
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            return self._python(m)
        finally:
            with self.lock:
                self.running -= 1

    def _python(self, m):
        timeout = float(m.get("runTimeoutSeconds") or 10)
        with tempfile.TemporaryDirectory(prefix="fakefncall-") as d:
            for path, data in (m.get("files") or {}).items():
                p = os.path.join(d, path)
                os.makedirs(os.path.dirname(p), exist_ok=True)
                with open(p, "wb") as f:
                    f.write(base64.b64decode(data))
            with open(os.path.join(d, "tmp_code.py"), "w") as f:
                f.write(m.get("code", ""))
            t0 = time.monotonic()
            run = {}
            try:
                p = subprocess.run([sys.executable, "tmp_code.py"], cwd=d, input=base64.b64decode(m.get("stdin", "")),
                                   capture_output=True, timeout=timeout)
                run = {"status": "COMMAND_STATUS_FINISHED", "returnCode": p.returncode,
                       "stdout": b64(p.stdout), "stderr": b64(p.stderr)}
            except subprocess.TimeoutExpired as e:
                run = {"status": "COMMAND_STATUS_TIME_LIMIT_EXCEEDED", "stdout": b64(e.stdout or b""),
                       "stderr": b64(e.stderr or b"")}
            run["executionTimeSeconds"] = time.monotonic() - t0
            files = {}
            for path in m.get("fetchFiles") or []:
                p = os.path.join(d, path)
                if os.path.isfile(p):
                    with open(p, "rb") as f:
                        files[path] = b64(f.read())
        resp = {"runResult": run, "node": "fake", "container": "sb-fake-000001", "files": files,
                "status": "RUN_STATUS_SUCCESS" if run.get("returnCode") == 0 else "RUN_STATUS_FAILED"}
        for k in [k for k, v in resp["runResult"].items() if v in ("", 0) and k != "returnCode"]:
            del resp["runResult"][k]  # protojson leaves zero values out
        if not files:
            del resp["files"]
        return resp
