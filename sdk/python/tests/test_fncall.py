"""Offline tests of run_code, run_code_batch, run_tests and languages
against a fake FnCallService (fakefncall.py)."""

import _path  # noqa: F401
import asyncio
import base64
import unittest

import libdsec
from libdsec import errors
from fakeconnect import FakeServer
from fakefncall import SERVICE, FakeFnCall

REVERSE = "import sys\nprint(sys.stdin.read().strip()[::-1])\n"


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class FnCallTest(unittest.TestCase):
    def setUp(self):
        self.fake = FakeFnCall()
        self.addCleanup(self.fake.close)
        self.c = libdsec.Client(self.fake.addr)
        self.addCleanup(self.c.close)

    def test_request_shape(self):
        r = self.c.run_code("python", "open('out.txt','w').write(open('in/a.txt').read()*2)\n",
                            stdin=b"\x00in", files={"in/a.txt": "ab", "b.bin": b"\xff"},
                            fetch_files=["out.txt", "missing.txt"], compile_timeout=3, run_timeout=2.5,
                            memory_mb=256, cpus=0.5, network_rules={"pypi": True}, environment="fncall:1",
                            timeout=20)
        msg = self.fake.server.requests[0].msg
        self.assertEqual(self.fake.server.requests[0].path, f"/{SERVICE}/RunCode")
        self.assertEqual(msg, {
            "language": "python", "code": msg["code"], "stdin": base64.b64encode(b"\x00in").decode(),
            "files": {"in/a.txt": base64.b64encode(b"ab").decode(), "b.bin": base64.b64encode(b"\xff").decode()},
            "fetchFiles": ["out.txt", "missing.txt"], "compileTimeoutSeconds": 3.0, "runTimeoutSeconds": 2.5,
            "memoryMb": "256", "cpus": 0.5, "networkRules": {"pypi": True}, "environment": "fncall:1"})
        ms = int(self.fake.server.requests[0].headers["Connect-Timeout-Ms"])
        self.assertTrue(19000 < ms <= 20000, ms)
        self.assertTrue(r.ok, r)
        self.assertEqual(r.files, {"out.txt": b"abab"})
        # Nothing but the language and code when nothing else is asked.
        self.c.run_code("python", "pass")
        self.assertEqual(self.fake.server.requests[1].msg, {"language": "python", "code": "pass"})

    def test_default_deadline_covers_the_steps(self):
        self.c.run_code("python", "pass")
        self.c.run_code("python", "pass", compile_timeout=20, run_timeout=40)
        got = [int(r.headers["Connect-Timeout-Ms"]) for r in self.fake.server.requests]
        self.assertTrue(49000 < got[0] <= 50000, got)   # 10 + 10 + 30
        self.assertTrue(89000 < got[1] <= 90000, got)   # 20 + 40 + 30

    def test_results(self):
        r = self.c.run_code("python", "print(1)")
        self.assertEqual((r.status, r.ok, r.stdout, r.stderr, r.return_code), ("success", True, "1\n", "", 0))
        self.assertIsNone(r.compile)
        self.assertEqual((r.run.status, r.run.stdout_bytes, r.run.truncated), ("finished", b"1\n", False))
        self.assertGreater(r.run.execution_time, 0)
        self.assertEqual((r.node, r.container), ("fake", "sb-fake-000001"))

        r = self.c.run_code("python", "import sys\nsys.stdout.buffer.write(b'a\\xffb')\nsys.exit(3)")
        self.assertEqual((r.status, r.ok, r.return_code), ("failed", False, 3))
        self.assertEqual((r.run.stdout_bytes, r.stdout), (b"a\xffb", "a\ufffdb"))

        r = self.c.run_code("python", "import time\nprint('so far', flush=True)\ntime.sleep(5)", run_timeout=0.5)
        self.assertEqual((r.status, r.run.status, r.return_code, r.stdout), ("failed", "time_limit_exceeded", None, "so far\n"))

        r = self.c.run_code("cpp", "int main( {}")
        self.assertEqual(r.status, "failed")
        self.assertIsNone(r.run)
        self.assertEqual((r.compile.status, r.compile.return_code), ("finished", 1))
        self.assertIn("error:", r.compile.stderr)
        self.assertEqual((r.stdout, r.return_code), ("", None))

    def test_errors_are_typed(self):
        with self.assertRaises(errors.InvalidArgument) as cm:
            self.c.run_code("cobol", "x")
        self.assertIn('language "cobol"', cm.exception.message)
        for bad in ({"language": "", "code": "x"}, {"language": "python", "code": b"x"},
                    {"language": "python", "code": "x", "run_timeout": -1},
                    {"language": "python", "code": "x", "fetch_files": "out.txt"},
                    {"language": "python", "code": "x", "network_rules": {"pypi": "yes"}}):
            with self.subTest(call=bad):
                with self.assertRaises(errors.InvalidArgument):
                    self.c.run_code(**bad)
        self.assertEqual(len(self.fake.server.requests), 1)  # refused before sending

    def test_full_node_is_overloaded_and_not_retried(self):
        srv = FakeServer()
        self.addCleanup(srv.close)
        srv.route("RunCode", lambda call: call.error("resource_exhausted", "fncall queue full"), service=SERVICE)
        with libdsec.Client(srv.addr) as c:
            with self.assertRaises(errors.Overloaded):
                c.run_code("python", "pass")
        self.assertEqual(len(srv.requests), 1)

    def test_unavailable_retried_unless_network_rules(self):
        srv = FakeServer()
        self.addCleanup(srv.close)
        n = {"calls": 0}

        def flaky(call):
            n["calls"] += 1
            if n["calls"] % 2:
                call.error("unavailable", "no healthy node runs the fncall backend")
            else:
                call.reply({"status": "RUN_STATUS_SUCCESS", "runResult": {"status": "COMMAND_STATUS_FINISHED",
                                                                           "returnCode": 0}})
        srv.route("RunCode", flaky, service=SERVICE)
        with libdsec.Client(srv.addr) as c:
            self.assertTrue(c.run_code("python", "pass").ok)
            self.assertEqual(n["calls"], 2)
            with self.assertRaises(errors.Unavailable):
                c.run_code("python", "pass", network_rules={"pypi": True})
            self.assertEqual(n["calls"], 3)

    def test_batch_keeps_order(self):
        calls = [{"language": "python", "code": f"print({i})"} for i in range(5)]
        calls.append(libdsec.RunCode("python", REVERSE, stdin="abc"))
        calls.append({"language": "cobol", "code": "x"})
        rs = self.c.run_code_batch(calls)
        self.assertEqual([r.stdout for r in rs[:6]], ["0\n", "1\n", "2\n", "3\n", "4\n", "cba\n"])
        self.assertEqual(rs[6].status, "sandbox_error")
        self.assertIn("cobol", rs[6].message)
        self.assertEqual(self.fake.server.methods(), ["RunCodeBatch"])
        self.assertEqual(self.c.run_code_batch([]), [])
        with self.assertRaises(errors.InvalidArgument) as cm:
            self.c.run_code_batch([{"language": "python", "code": "x", "stdn": "typo"}])
        self.assertIn("stdn", cm.exception.message)

    def test_long_batch_goes_in_parts(self):
        import libdsec._aio as aio
        old = aio.MAX_BATCH
        aio.MAX_BATCH = 3
        self.addCleanup(setattr, aio, "MAX_BATCH", old)
        rs = self.c.run_code_batch([{"language": "python", "code": f"print({i})"} for i in range(7)])
        self.assertEqual([r.stdout for r in rs], [f"{i}\n" for i in range(7)])
        self.assertEqual(sorted(len(r.msg["calls"]) for r in self.fake.server.requests), [1, 3, 3])

    def test_run_tests(self):
        cases = [("abc", "cba"), ("xy\n", "yx\n\n"), ("ab", "ab"), ("  a", "a  \n"), ("q", None), "zz"]
        rs = self.c.run_tests("python", REVERSE, cases, run_timeout=5, memory_mb=128)
        self.assertEqual([r.passed for r in rs], [True, True, False, False, None, None])
        self.assertEqual([r.stdout for r in rs], ["cba\n", "yx\n", "ba\n", "a\n", "q\n", "zz\n"])
        calls = self.fake.server.requests[-1].msg["calls"]
        self.assertEqual([base64.b64decode(c["stdin"]) for c in calls], [b"abc", b"xy\n", b"ab", b"  a", b"q", b"zz"])
        self.assertTrue(all(c["runTimeoutSeconds"] == 5.0 and c["memoryMb"] == "128" for c in calls))
        # A program that fails does not pass, whatever it printed.
        rs = self.c.run_tests("python", "print('cba')\nraise SystemExit(1)", [("abc", "cba")])
        self.assertEqual((rs[0].status, rs[0].passed), ("failed", False))
        with self.assertRaises(errors.InvalidArgument):
            self.c.run_tests("python", REVERSE, "abc")
        with self.assertRaises(errors.InvalidArgument):
            self.c.run_tests("python", REVERSE, [("a", "b", "c")])
        with self.assertRaises(errors.InvalidArgument):
            self.c.run_tests("python", REVERSE, ["a"], stdin="b")

    def test_run_tests_in_parallel(self):
        code = "import time\ntime.sleep(0.5)\nprint(int(input()) * 2)"
        cases = [(str(i), str(2 * i)) for i in range(8)]

        async def main():
            async with libdsec.AsyncClient(self.fake.addr) as c:
                return await c.run_tests("python", code, cases)
        rs = run(main())
        self.assertTrue(all(r.passed for r in rs), rs)
        self.assertEqual(self.fake.most_at_once, 8)

    def test_languages(self):
        langs = self.c.languages()
        self.assertEqual([lang.name for lang in langs], ["python", "cpp"])
        py, cpp = langs
        self.assertEqual((py.compiled, py.zygote, py.run_argv, py.compile_argv), (False, True, ["python", "tmp_code.py"], []))
        self.assertEqual((cpp.compiled, cpp.source_file, cpp.environment), (True, "tmp_code.cpp", "fncall:latest"))


if __name__ == "__main__":
    unittest.main()
