"""Offline tests of libdsec's Connect transport against a fake server."""

import _path  # noqa: F401
import asyncio
import base64
import io
import os
import socket
import tarfile
import tempfile
import threading
import time
import unittest

import libdsec
from libdsec import errors
from fakeconnect import FakeServer, b64
from fakedsecd import FakeDsecd


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class AddrTest(unittest.TestCase):
    def test_resolve(self):
        cases = [
            ("unix:///run/x.sock", ("unix", "/run/x.sock")),
            ("http://127.0.0.1:8675", ("tcp", ("127.0.0.1", 8675))),
            ("http://localhost:9/", ("tcp", ("localhost", 9))),
            ("127.0.0.1:1", ("tcp", ("127.0.0.1", 1))),
            ("[::1]:80", ("tcp", ("::1", 80))),
            ("https://x:1", ("tls", ("x", 1))),
        ]
        for addr, want in cases:
            with self.subTest(addr=addr):
                self.assertEqual(libdsec.resolve_addr(addr), want)
        for bad in ("unix://", "ftp://x:1", "nohost", "a:1,b:2"):
            with self.subTest(addr=bad):
                with self.assertRaises(errors.InvalidArgument):
                    libdsec.resolve_addr(bad)

    def test_default_and_env(self):
        old = os.environ.pop("DSEC_ADDR", None)
        try:
            self.assertEqual(libdsec.resolve_addr(None), ("unix", "/var/lib/dsec/dsecd.sock"))
            os.environ["DSEC_ADDR"] = "127.0.0.1:7"
            self.assertEqual(libdsec.resolve_addr(None), ("tcp", ("127.0.0.1", 7)))
        finally:
            os.environ.pop("DSEC_ADDR", None)
            if old is not None:
                os.environ["DSEC_ADDR"] = old


class ErrorMappingTest(unittest.TestCase):
    def test_from_code(self):
        cases = [
            ("not_found", "sandbox sb-x: not found", errors.NotFound),
            ("invalid_argument", "bad", errors.InvalidArgument),
            ("unauthenticated", "who", errors.Unauthenticated),
            ("resource_exhausted", "full", errors.Overloaded),
            ("unavailable", "down", errors.Unavailable),
            ("deadline_exceeded", "slow", errors.Timeout),
            ("failed_precondition", "sandbox sb-n-1 is stopped (oom): OOM-killed at 256 MiB", errors.SandboxGone),
            ("failed_precondition", "sandbox sb-n-1 is STATE_FAILED: agent lost", errors.SandboxGone),
            ("failed_precondition", "sandbox sb-n-1 is still being created", errors.FailedPrecondition),
            ("internal", "boom", errors.Internal),
            ("weird", "?", errors.DsecError),
        ]
        for code, msg, cls in cases:
            with self.subTest(code=code, msg=msg):
                e = errors.from_code(code, msg)
                self.assertIs(type(e), cls)
                self.assertEqual(e.message, msg)
        e = errors.from_code("failed_precondition", "sandbox sb-n-1 is stopped (oom): x")
        self.assertEqual((e.sandbox_id, e.state, e.reason), ("sb-n-1", "stopped", "oom"))
        self.assertIs(type(errors.from_code("deadline_exceeded", "x", creating=True)), errors.StartupTimeout)
        e = errors.from_code("unavailable", "busy", retry_after=2.0)
        self.assertIsInstance(e, errors.Overloaded)
        self.assertEqual(e.retry_after, 2.0)
        self.assertIsInstance(errors.Timeout("x"), TimeoutError)
        self.assertIsInstance(errors.Unavailable("x"), ConnectionError)


class FakeTestCase(unittest.TestCase):
    def setUp(self):
        self.srv = FakeServer()
        self.addCleanup(self.srv.close)

    def client(self, **kw):
        return libdsec.AsyncClient(self.srv.addr, **kw)


class UnaryTest(FakeTestCase):
    def test_request_shape_and_reply(self):
        def get(call):
            call.reply({"id": call.msg["id"], "state": "STATE_RUNNING", "createdUnixMs": "1700000000000",
                        "spec": {"labels": {"a": "b"}}})
        self.srv.route("Get", get)

        async def main():
            async with self.client() as c:
                sb = await c.get("sb-n-1", timeout=7)
                return sb
        sb = run(main())
        self.assertEqual((sb.id, sb.state, sb.labels), ("sb-n-1", "running", {"a": "b"}))
        req = self.srv.requests[0]
        self.assertEqual(req.path, "/dsec.v1.SandboxService/Get")
        self.assertEqual(req.headers["Content-Type"], "application/json")
        self.assertEqual(req.headers["Connect-Protocol-Version"], "1")
        ms = int(req.headers["Connect-Timeout-Ms"])
        self.assertTrue(6000 < ms <= 7000, ms)
        self.assertEqual(req.msg, {"id": "sb-n-1"})

    def test_errors_are_typed(self):
        cases = [
            ("not_found", errors.NotFound),
            ("invalid_argument", errors.InvalidArgument),
            ("unauthenticated", errors.Unauthenticated),
            ("resource_exhausted", errors.Overloaded),
        ]
        for code, cls in cases:
            with self.subTest(code=code):
                self.srv.route("Get", lambda call, code=code: call.error(code, "msg of " + code))

                async def main():
                    async with self.client() as c:
                        await c.get("sb-n-1", timeout=5)
                with self.assertRaises(cls) as cm:
                    run(main())
                self.assertEqual(cm.exception.message, "msg of " + code)

    def test_overloaded_retry_after(self):
        self.srv.route("Create", lambda call: call.error("resource_exhausted", "node full",
                                                          extra_headers={"Retry-After": "3"}))

        async def main():
            async with self.client() as c:
                await c.create("busybox:test", timeout=5)
        with self.assertRaises(errors.Overloaded) as cm:
            run(main())
        self.assertEqual(cm.exception.retry_after, 3.0)
        self.assertEqual(len(self.srv.requests), 1)  # not retried: the caller decides

    def test_non_json_http_error(self):
        def handler(call):
            h = call.h
            h.send_response(502)
            h.send_header("Content-Length", "3")
            h.end_headers()
            h.wfile.write(b"bad")
        self.srv.route("Stat", handler)

        async def main():
            async with self.client() as c:
                await c.sandbox("sb-n-1").stat("/x", timeout=0.5)
        with self.assertRaises(errors.Unavailable):
            run(main())

    def test_deadline(self):
        ev = threading.Event()
        self.addCleanup(ev.set)
        self.srv.route("Get", lambda call: ev.wait(10))

        async def main():
            async with self.client() as c:
                await c.get("sb-n-1", timeout=0.5)
        t0 = time.monotonic()
        with self.assertRaises(errors.Timeout):
            run(main())
        self.assertLess(time.monotonic() - t0, 3)

    def test_keep_alive_reuses_connections(self):
        self.srv.route("Get", lambda call: call.reply({"id": call.msg["id"]}))

        async def main():
            async with self.client() as c:
                for i in range(20):
                    await c.get(f"sb-n-{i}")
        run(main())
        self.assertEqual(self.srv.connections, 1)

    def test_stale_connection_is_replaced(self):
        self.srv.route("Get", lambda call: call.reply({"id": call.msg["id"]}))
        state = {"n": 0}

        def write(call):  # closes the connection after answering, without saying so
            state["n"] += 1
            call.reply({"written": "1"})
            call.drop()
        self.srv.route("WriteFile", write)

        async def main():
            async with self.client() as c:
                sb = c.sandbox("sb-n-1")
                await sb.write_file("/a", b"x")
                await asyncio.sleep(0.1)
                await sb.write_file("/b", b"y")
        run(main())
        self.assertEqual(state["n"], 2)


class RetryTest(FakeTestCase):
    def test_create_retries_with_same_key(self):
        attempts = []

        def create(call):
            attempts.append(call.msg["idempotencyKey"])
            if len(attempts) < 3:
                call.drop()
                return
            call.reply({"sandboxes": [{"id": "sb-n-1", "state": "STATE_RUNNING"}]})
        self.srv.route("Create", create)

        async def main():
            async with self.client() as c:
                return await c.create("busybox:test", memory_mb=256, labels={"job": "j"}, timeout=10)
        sb = run(main())
        self.assertEqual(sb.id, "sb-n-1")
        self.assertEqual(len(attempts), 3)
        self.assertEqual(len(set(attempts)), 1)
        msg = self.srv.requests[0].msg
        self.assertEqual(msg["spec"]["environment"], "busybox:test")
        self.assertEqual(msg["spec"]["memoryMb"], "256")  # int64 as a JSON string
        self.assertEqual(msg["spec"]["labels"], {"job": "j"})
        self.assertEqual(msg["count"], 1)

    def test_create_keys_differ_between_calls(self):
        fake = FakeDsecd()
        self.addCleanup(fake.close)

        async def main():
            async with libdsec.AsyncClient(fake.addr) as c:
                return [await c.create("e") for _ in range(2)]
        a, b = run(main())
        self.assertNotEqual(a.id, b.id)
        keys = [r.msg["idempotencyKey"] for r in fake.server.requests if r.method == "Create"]
        self.assertEqual(len(set(keys)), 2)

    def test_get_retried_on_unavailable(self):
        n = []

        def get(call):
            n.append(1)
            if len(n) == 1:
                call.error("unavailable", "restarting")
            else:
                call.reply({"id": "sb-n-1"})
        self.srv.route("Get", get)

        async def main():
            async with self.client() as c:
                return await c.get("sb-n-1", timeout=5)
        self.assertEqual(run(main()).id, "sb-n-1")
        self.assertEqual(len(n), 2)

    def test_exec_not_retried(self):
        n = []

        def ex(call):
            n.append(1)
            call.drop()
        self.srv.route("Exec", ex)

        async def main():
            async with self.client() as c:
                await c.sandbox("sb-n-1").exec("touch /x", timeout=5)
        with self.assertRaises(errors.Unavailable):
            run(main())
        self.assertEqual(len(n), 1)

    def test_write_not_retried(self):
        n = []

        def w(call):
            n.append(1)
            call.error("unavailable", "agent channel lost")
        self.srv.route("WriteFile", w)

        async def main():
            async with self.client() as c:
                await c.sandbox("sb-n-1").write_file("/x", b"1", timeout=5)
        with self.assertRaises(errors.Unavailable):
            run(main())
        self.assertEqual(len(n), 1)

    def test_connection_refused(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()

        async def main():
            async with libdsec.AsyncClient(f"127.0.0.1:{port}") as c:
                await c.get("sb-n-1", timeout=2)
        t0 = time.monotonic()
        with self.assertRaises(errors.Unavailable):
            run(main())
        self.assertLess(time.monotonic() - t0, 4)


class StreamTest(FakeTestCase):
    def exec_route(self, events, end=None):
        def ex(call):
            for e in events:
                call.send(e)
            call.end(end)
        self.srv.route("Exec", ex)

    def test_exec_result(self):
        self.exec_route([
            {"started": {"processId": "p1", "pid": 7}},
            {"keepalive": True},
            {"stdout": b64("hel")}, {"stderr": b64("warn\n")}, {"stdout": b64("lo\n\xff")},
            {"exited": {"exitCode": 3, "status": "EXIT_STATUS_NONZERO", "durationSeconds": 0.25, "stdoutBytes": "8"}},
        ])
        seen = []

        async def main():
            async with self.client() as c:
                return await c.sandbox("sb-n-1").exec(["sh", "-c", "x"], timeout=9, cwd="/w", env={"A": "1"},
                                                      stdin="in", on_stdout=seen.append)
        r = run(main())
        self.assertEqual((r.exit_code, r.status, r.duration_s, r.truncated), (3, "nonzero", 0.25, False))
        self.assertEqual(r.stdout_bytes, "hello\n\xff".encode())
        self.assertEqual(r.stdout, "hello\n\u00ff")
        self.assertEqual(r.stderr, "warn\n")
        self.assertEqual((r.process_id, r.pid), ("p1", 7))
        self.assertEqual(tuple(r), (3, r.stdout, "warn\n"))
        self.assertEqual(b"".join(seen), r.stdout_bytes)
        req = self.srv.requests[0]
        self.assertEqual(req.headers["Content-Type"], "application/connect+json")
        self.assertEqual(req.msg, {"sandboxId": "sb-n-1", "argv": ["sh", "-c", "x"], "timeoutSeconds": 9.0,
                                   "cwd": "/w", "env": {"A": "1"}, "stdin": b64("in")})
        self.assertTrue(9000 < int(req.headers["Connect-Timeout-Ms"]) <= 9000 + 15000)

    def test_statuses_and_check(self):
        for status, want in [("EXIT_STATUS_OK", "ok"), ("EXIT_STATUS_TIMEOUT", "timeout"),
                             ("EXIT_STATUS_OOM", "oom"), ("EXIT_STATUS_KILLED", "killed"),
                             ("EXIT_STATUS_START_ERROR", "sandbox_error")]:
            with self.subTest(status=status):
                code = 0 if want == "ok" else -1
                self.exec_route([{"exited": {"exitCode": code, "status": status}}])

                async def main(check):
                    async with self.client() as c:
                        return await c.sandbox("sb-n-1").exec("x", check=check)
                self.assertEqual(run(main(False)).status, want)
                if want != "ok":
                    with self.assertRaises(errors.CommandFailed) as cm:
                        run(main(True))
                    self.assertEqual(cm.exception.result.status, want)

    def test_stream_error_is_typed(self):
        self.exec_route([{"started": {"processId": "p1"}}],
                        end={"code": "failed_precondition", "message": "sandbox sb-n-1 is failed (oom): OOM"})

        async def main():
            async with self.client() as c:
                await c.sandbox("sb-n-1").exec("x")
        with self.assertRaises(errors.SandboxGone) as cm:
            run(main())
        self.assertEqual(cm.exception.reason, "oom")

    def test_exec_stream_events(self):
        self.exec_route([{"started": {"processId": "p1", "pid": 7}}, {"stdout": b64("a")},
                         {"stderr": b64("b")}, {"exited": {"status": "EXIT_STATUS_OK"}}])

        async def main():
            async with self.client() as c:
                return [ev async for ev in c.sandbox("sb-n-1").exec_stream("x")]
        evs = run(main())
        self.assertEqual([e.type for e in evs], ["started", "stdout", "stderr", "exited"])
        self.assertEqual(evs[1].data, b"a")
        self.assertEqual(evs[-1].result.stdout, "a")

    def test_output_dropped(self):
        # A result that lacks output the command wrote is raised, with it.
        events = [{"started": {"processId": "p1"}}, {"stdout": b64("head")},
                  {"dropped": {"bytes": "10"}}, {"stdout": b64("tail")},
                  {"exited": {"status": "EXIT_STATUS_OK", "stdoutTruncated": True, "stdoutBytes": "18"}}]

        def send(call):
            for e in events:
                call.send(e)
            call.end()
        self.srv.route("Exec", send)
        self.srv.route("Attach", send)

        async def main(how):
            async with self.client() as c:
                sb = c.sandbox("sb-n-1")
                if how == "exec_stream":
                    evs = []
                    try:
                        async for ev in sb.exec_stream("x"):
                            evs.append(ev)
                    except errors.OutputDropped as e:
                        return evs, e
                    return evs, None
                call = {"exec": lambda: sb.exec("x"), "wait": lambda: sb.job("p1").wait(),
                        "output": lambda: sb.job("p1").output()}[how]
                try:
                    return await call(), None
                except errors.OutputDropped as e:
                    return None, e
        for how in ("exec", "wait", "output"):
            with self.subTest(how=how):
                r, e = run(main(how))
                self.assertIsNone(r)
                self.assertIn("10 bytes of stdout", str(e))
                self.assertEqual((e.result.stdout, e.result.truncated, e.result.stdout_dropped, e.result.stderr_dropped),
                                 ("headtail", True, 10, 0))
        evs, e = run(main("exec_stream"))
        self.assertEqual([ev.type for ev in evs], ["started", "stdout", "dropped", "stdout", "exited"])
        self.assertEqual((evs[2].stream, evs[2].dropped), ("stdout", 10))
        self.assertIsInstance(e, errors.OutputDropped)

    def test_server_killed_mid_stream(self):
        def ex(call):
            call.send({"started": {"processId": "p1"}})
            call.send({"stdout": b64("partial")})
            call.drop()
        self.srv.route("Exec", ex)

        async def main():
            async with self.client() as c:
                await c.sandbox("sb-n-1").exec("sleep 100", timeout=3)
        t0 = time.monotonic()
        with self.assertRaises(errors.Unavailable):
            run(main())
        self.assertLess(time.monotonic() - t0, 3)

    def test_stalled_stream_times_out(self):
        ev = threading.Event()
        self.addCleanup(ev.set)

        def ex(call):
            call.send({"started": {"processId": "p1"}})
            ev.wait(30)
        self.srv.route("Exec", ex)

        async def main():
            async with self.client() as c:
                await c.sandbox("sb-n-1").exec("sleep 100", timeout=0.2)
        libdsec._aio.EXEC_GRACE, old = 0.3, libdsec._aio.EXEC_GRACE
        try:
            t0 = time.monotonic()
            with self.assertRaises(errors.Timeout):
                run(main())
            self.assertLess(time.monotonic() - t0, 3)
        finally:
            libdsec._aio.EXEC_GRACE = old

    def test_spawn_and_wait(self):
        def ex(call):
            assert call.msg["background"] is True and call.msg["tag"] == "train"
            call.send({"started": {"processId": "p9", "pid": 99, "tag": "train"}})
            time.sleep(0.2)  # the client hangs up; a background process lives on
        self.srv.route("Exec", ex)
        attaches = []

        def attach(call):
            attaches.append(call.msg)
            if len(attaches) == 1:
                call.drop()  # the daemon restarts while we wait
                return
            call.send({"started": {"processId": "p9", "pid": 99}})
            call.send({"stdout": b64("done\n")})
            call.send({"exited": {"status": "EXIT_STATUS_OK", "durationSeconds": 1.5}})
            call.end()
        self.srv.route("Attach", attach)
        self.srv.route("Signal", lambda call: call.reply({}))

        async def main():
            async with self.client() as c:
                job = await c.sandbox("sb-n-1").spawn("python train.py", tag="train")
                self.assertEqual((job.process_id, job.pid, job.tag), ("p9", 99, "train"))
                r = await job.wait(timeout=10)
                await job.kill()
                return r
        r = run(main())
        self.assertEqual((r.stdout, r.status), ("done\n", "ok"))
        self.assertEqual(attaches[-1], {"sandboxId": "sb-n-1", "processId": "p9"})
        sig = [q for q in self.srv.requests if q.method == "Signal"][0]
        self.assertEqual(sig.msg, {"sandboxId": "sb-n-1", "processId": "p9"})

    def test_job_output_while_running(self):
        # A job that prints without pause: output() must return what it has
        # so far at once (it once waited for a quiet moment that never came).
        stop = threading.Event()
        self.addCleanup(stop.set)

        def attach(call):
            call.send({"started": {"processId": "p1", "pid": 5, "tag": "t"}})
            call.send({"stdout": b64("so far\n")})
            if call.msg.get("noFollow"):
                call.end()
                return
            while not stop.wait(0.05):
                try:
                    call.send({"stdout": b64("more\n")})
                except OSError:
                    return
        self.srv.route("Attach", attach)

        async def main():
            async with self.client() as c:
                job = c.sandbox("sb-n-1").job(tag="t")
                return job, await job.output(timeout=10)
        t0 = time.monotonic()
        job, r = run(main())
        self.assertLess(time.monotonic() - t0, 5)
        self.assertEqual((r.status, r.exit_code, r.stdout, r.process_id), ("running", -1, "so far\n", "p1"))
        self.assertEqual(job.process_id, "p1")
        att = [q for q in self.srv.requests if q.method == "Attach"][-1]
        self.assertEqual(att.msg, {"sandboxId": "sb-n-1", "tag": "t", "noFollow": True})

    def test_job_output_after_exit(self):
        def attach(call):
            call.send({"started": {"processId": "p1", "pid": 5}})
            call.send({"stdout": b64("all\n")})
            call.send({"exited": {"exitCode": 3, "status": "EXIT_STATUS_NONZERO"}})
            call.end()
        self.srv.route("Attach", attach)

        async def main():
            async with self.client() as c:
                return await c.sandbox("sb-n-1").job("p1").output()
        r = run(main())
        self.assertEqual((r.status, r.exit_code, r.stdout), ("nonzero", 3, "all\n"))

    def test_session_run(self):
        def run_route(call):
            call.send({"stdout": b64(call.msg["command"])})
            call.send({"exited": {"status": "EXIT_STATUS_OK"}})
            call.end()
        self.srv.route("SessionRun", run_route)
        self.srv.route("SessionInterrupt", lambda call: call.reply({}))
        self.srv.route("SessionClose", lambda call: call.reply({}))

        async def main():
            async with self.client() as c:
                async with c.sandbox("sb-n-1").session("main") as s:
                    r = await s.run("cd /tmp", timeout=5)
                    await s.interrupt()
                    return r
        self.assertEqual(run(main()).stdout, "cd /tmp")
        methods = [q.method for q in self.srv.requests]
        self.assertEqual(methods, ["SessionRun", "SessionInterrupt", "SessionClose"])
        self.assertEqual(self.srv.requests[0].msg["session"], "main")

    def test_download_extracts_safely(self):
        def tar_of(entries):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tf:
                for name, data in entries:
                    ti = tarfile.TarInfo(name)
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
            return buf.getvalue()
        good = tar_of([("d/a.txt", b"A" * 100000), ("b.txt", b"B")])
        evil = tar_of([("../escape.txt", b"x")])
        payload = {"good": good, "evil": evil}

        def dl(call):
            data = payload[call.msg["path"]]
            for i in range(0, len(data), 30000):
                call.send({"data": b64(data[i:i + 30000])})
            call.end()
        self.srv.route("Download", dl)
        with tempfile.TemporaryDirectory() as d:
            async def main(path, dest):
                async with self.client() as c:
                    return await c.sandbox("sb-n-1").download(path, dest)
            names = run(main("good", os.path.join(d, "out")))
            self.assertEqual(sorted(names), ["b.txt", "d/a.txt"])
            with open(os.path.join(d, "out", "d", "a.txt"), "rb") as f:
                self.assertEqual(f.read(), b"A" * 100000)
            with self.assertRaises(errors.InvalidArgument):
                run(main("evil", os.path.join(d, "out2")))
            self.assertFalse(os.path.exists(os.path.join(d, "escape.txt")))

    def test_upload_sends_tar(self):
        got = {}

        def up(call):
            data = base64.b64decode(call.msg["tar"])
            with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                for m in tf.getmembers():
                    if m.isfile():
                        got[m.name] = tf.extractfile(m).read()
            call.reply({"files": str(len(got)), "bytes": "3"})
        self.srv.route("Upload", up)
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "sub"))
            for p, b in (("x.py", b"x=1"), ("sub/y", b"yy")):
                with open(os.path.join(d, p), "wb") as f:
                    f.write(b)

            async def main():
                async with self.client() as c:
                    return await c.sandbox("sb-n-1").upload(d, "/work")
            self.assertEqual(run(main()), 2)
        self.assertEqual(got, {"x.py": b"x=1", "sub/y": b"yy"})
        self.assertEqual(self.srv.requests[0].msg["path"], "/work")


class UploadLayerTest(FakeTestCase):
    """import_layer(upload=True) streams the archive: a header, pieces of at
    most UPLOAD_PIECE bytes, then the end marker."""

    def route(self, answer=None):
        def up(call):
            if answer:
                call.error(*answer)
                return
            call.send({"digest": "sha256:" + "a" * 64, "refs": [call.msg["header"]["ref"]]})
            call.end()
        self.srv.route("UploadLayer", up, service="dsec.v1.LayerService")

    def sent(self):
        call = self.srv.requests[-1]
        self.assertEqual(call.path, "/dsec.v1.LayerService/UploadLayer")
        self.assertEqual(call.headers.get("Transfer-Encoding"), "chunked")
        msgs = call.msgs
        self.assertEqual(msgs[-1], {"end": True})
        pieces = [base64.b64decode(m["data"]) for m in msgs[1:-1]]
        self.assertTrue(all(0 < len(p) <= libdsec._aio.UPLOAD_PIECE for p in pieces), [len(p) for p in pieces])
        return msgs[0]["header"], b"".join(pieces)

    def test_tree_and_archive(self):
        self.route()
        with tempfile.TemporaryDirectory() as d:
            tree = os.path.join(d, "tree")
            os.makedirs(os.path.join(tree, "sub"))
            big = os.urandom(5 << 19)  # 2.5 MiB: several pieces
            with open(os.path.join(tree, "sub", "big"), "wb") as f:
                f.write(big)
            with open(os.path.join(tree, "x"), "wb") as f:
                f.write(b"x")

            async def main(path):
                async with self.client() as c:
                    return await c.import_layer("up:1", path, kind="workspace", upload=True)
            layer = run(main(tree))
            self.assertEqual(layer["refs"], ["up:1"])
            header, archive = self.sent()
            self.assertEqual(header, {"ref": "up:1", "kind": "LAYER_KIND_WORKSPACE"})
            with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
                names = sorted(m.name for m in tf.getmembers())
                self.assertEqual(names, ["sub", "sub/big", "x"])
                self.assertEqual(tf.extractfile("sub/big").read(), big)

            # An archive file goes as it is, its size in the header.
            path = os.path.join(d, "layer.tar")
            with open(path, "wb") as f:
                f.write(archive)
            run(main(path))
            header, sent = self.sent()
            self.assertEqual((header["size"], sent), (str(len(archive)), archive))

    def test_refused(self):
        self.route(("resource_exhausted", "upload layer up:1: the archive is over the 64 MiB an upload may have (dsecd --max-upload-bytes)"))
        with tempfile.TemporaryDirectory() as d:
            async def main():
                async with self.client() as c:
                    return await c.import_layer("up:1", d, upload=True)
            with self.assertRaisesRegex(errors.DsecError, "--max-upload-bytes"):
                run(main())


    def test_refused_early(self):
        """A server refusing at the header, the rest unsent, is heard: the
        client stops sending once the answer is there, rather than break
        the connection with writes the server no longer reads."""
        self.route(("resource_exhausted", "upload layer up:1: the archive is over the 1 GiB an upload may have (dsecd --max-upload-bytes)"))
        self.srv.early("UploadLayer")
        with tempfile.TemporaryDirectory() as d:
            huge = os.path.join(d, "huge.tar")
            with open(huge, "wb") as f:
                f.truncate(64 << 20)

            async def main():
                async with self.client() as c:
                    for _ in range(3):
                        with self.assertRaisesRegex(errors.Overloaded, "--max-upload-bytes"):
                            await c.import_layer("up:1", huge, upload=True)
            run(main())


class NewUserTest(FakeTestCase):
    """The rough edges a new user hit, against the fake server."""

    def test_network_rules_must_be_booleans(self):
        async def main():
            async with self.client() as c:
                for bad in ({"pypi": "false"}, {"pypi": 0}, {"pypi": None}, {"github": True, "pypi": "no"}):
                    with self.subTest(rules=bad):
                        with self.assertRaisesRegex(errors.InvalidArgument, r"network rule 'pypi': want True or False"):
                            await c.create("b:1", network_rules=bad)
                        with self.assertRaisesRegex(errors.InvalidArgument, r"network rule 'pypi'"):
                            await c.sandbox("sb-n-1").set_network_rules(bad)
                        with self.assertRaisesRegex(errors.InvalidArgument, r"network rule 'pypi'"):
                            await c.set_warm_pool("b:1", 1, network_rules=bad)
        run(main())
        self.assertEqual(self.srv.requests, [], "a refused rule set was sent")

        self.srv.route("Create", lambda call: call.reply({"sandboxes": [
            {"id": "sb-n-1", "state": "STATE_RUNNING", "spec": call.msg["spec"]}]}))

        async def ok():
            async with self.client() as c:
                return await c.create("b:1", network_rules={"pypi": False, "github": True})
        run(ok())
        self.assertEqual(self.srv.requests[-1].msg["spec"]["networkRules"], {"pypi": False, "github": True})

    def test_create_warnings(self):
        warning = 'service "pypi" has no domains or CIDRs on this node; allowing it allows nothing'
        self.srv.route("Create", lambda call: call.reply({"sandboxes": [
            {"id": "sb-n-1", "state": "STATE_RUNNING", "warnings": [warning]}]}))

        async def main():
            async with self.client() as c:
                return await c.create("b:1", network_rules={"pypi": True})
        sb = run(main())
        self.assertEqual(sb.warnings, [warning])
        with libdsec.Client(self.srv.addr) as c:
            self.assertEqual(c.create("b:1", network_rules={"pypi": True}).warnings, [warning])
            self.assertEqual(c.sandbox("sb-n-2").warnings, [])

    def test_list_is_live_by_default(self):
        self.srv.route("List", lambda call: call.reply({"sandboxes": []}))

        async def main():
            async with self.client() as c:
                await c.list()
                await c.list(all=True)
                await c.list(states=["stopped"])
                with self.assertRaises(errors.InvalidArgument):
                    await c.list(states=["stopped"], all=True)
        run(main())
        self.assertEqual([q.msg for q in self.srv.requests],
                         [{}, {"all": True}, {"states": ["STATE_STOPPED"]}])

    def test_list_page_names_unreachable_nodes(self):
        # A cluster's apiserver that could not reach e2 says so beside the
        # page: its sandboxes are in neither the page nor the total.
        self.srv.route("List", lambda call: call.reply({"sandboxes": [{"id": "sb-e1-a"}], "total": 1,
                                                        "unreachableNodes": ["e2"]}))

        async def main():
            async with self.client() as c:
                return await c.list_page(page_size=10)
        page = run(main())
        self.assertEqual(([s.id for s in page.sandboxes], page.next_token, page.total, page.unreachable),
                         (["sb-e1-a"], "", 1, ["e2"]))
        with libdsec.Client(self.srv.addr) as c:
            page = c.list_page(page_size=10)
            # Callers that unpack three still can.
            sandboxes, next_token, total = page
            self.assertEqual(([s.id for s in sandboxes], next_token, total, page.unreachable),
                             (["sb-e1-a"], "", 1, ["e2"]))
            self.assertIsInstance(page.sandboxes[0], libdsec.Sandbox)
        self.srv.route("List", lambda call: call.reply({"sandboxes": [], "total": 0}))
        with libdsec.Client(self.srv.addr) as c:
            self.assertEqual(c.list_page().unreachable, [])


class ConcurrencyTest(unittest.TestCase):
    def test_200_sandboxes_from_one_loop(self):
        fake = FakeDsecd()
        self.addCleanup(fake.close)

        async def one(c, i):
            async with await c.create("busybox:test", labels={"batch": "b"}, timeout=30) as sb:
                r = await sb.exec(f"echo {i}", timeout=30)
                assert r.stdout == f"{i}\n", r
                await sb.write_file("/f", str(i))
                return i

        async def main():
            async with libdsec.AsyncClient(fake.addr) as c:
                got = await asyncio.gather(*(one(c, i) for i in range(200)))
                left = await c.list(labels={"batch": "b"}, states=["running"])
                return got, left
        got, left = run(main(), timeout=120)
        self.assertEqual(got, list(range(200)))
        self.assertEqual(left, [])
        self.assertEqual(fake.creates, 200)
        self.assertEqual([t for t in threading.enumerate() if t.name == "libdsec-loop"], [])


class UnixSocketTest(unittest.TestCase):
    def test_unix_socket(self):
        d = tempfile.mkdtemp()
        path = os.path.join(d, "d.sock")
        fake = FakeDsecd(unix_path=path)
        self.addCleanup(lambda: (fake.close(), os.rmdir(d)))

        async def main():
            async with libdsec.AsyncClient("unix://" + path) as c:
                sb = await c.create("busybox:test")
                r = await sb.exec(["echo", "over", "unix"])
                await c.reap()
                return r
        self.assertEqual(run(main()).stdout, "over unix\n")
        self.assertEqual(fake.server.requests[0].headers["Host"], "dsecd")


class WarmPoolTest(FakeTestCase):
    def test_request_shape_and_reply(self):
        def set_pool(call):
            call.reply({"key": "k1", "node": "n1", "spec": dict(call.msg["spec"], cpus=1), "size": call.msg["size"],
                        "starting": call.msg["size"], "taken": "7", "missed": "2", "lastError": "boom"})
        self.srv.route("SetWarmPool", set_pool)
        self.srv.route("ListWarmPools", lambda call: call.reply({"pools": [
            {"key": "k1", "node": "n1", "spec": {"environment": "busybox:test"}, "size": 2, "ready": 1},
            {"key": "k2", "node": "n2", "spec": {"environment": "alpine:3"}},
        ]}))

        async def main():
            async with self.client() as c:
                p = await c.set_warm_pool("busybox:test", 2, memory_mb=256, env_vars={"A": "b"}, workdir="/w")
                return p, await c.warm_pools()
        p, pools = run(main())
        self.assertEqual(self.srv.requests[0].path, "/dsec.v1.SandboxService/SetWarmPool")
        self.assertEqual(self.srv.requests[0].msg, {"size": 2, "spec": {
            "environment": "busybox:test", "backend": "BACKEND_CONTAINER", "memoryMb": "256", "env": {"A": "b"},
            "workdir": "/w"}})
        self.assertEqual((p.key, p.node, p.environment, p.size, p.ready, p.starting, p.taken, p.missed, p.last_error),
                         ("k1", "n1", "busybox:test", 2, 0, 2, 7, 2, "boom"))
        self.assertEqual(p.spec["cpus"], 1)
        self.assertEqual([(q.key, q.node, q.environment, q.size, q.ready) for q in pools],
                         [("k1", "n1", "busybox:test", 2, 1), ("k2", "n2", "alpine:3", 0, 0)])

    def test_negative_size_is_refused_locally(self):
        async def main():
            async with self.client() as c:
                await c.set_warm_pool("busybox:test", -1)
        with self.assertRaises(errors.InvalidArgument):
            run(main())
        self.assertEqual(self.srv.requests, [])

    def test_pool_serves_creates_of_its_shape(self):
        fake = FakeDsecd()
        self.addCleanup(fake.close)
        with libdsec.Client(fake.addr) as c:
            p = c.set_warm_pool("busybox:test", 1, memory_mb=256)
            self.assertEqual((p.size, p.environment), (1, "busybox:test"))
            self.assertEqual([q.key for q in c.warm_pools()], [p.key])
            # Labels and lifetimes are not part of the shape.
            with c.create("busybox:test", memory_mb=256, labels={"k": "v"}, ttl_s=60) as sb:
                self.assertTrue(sb.from_warm_pool)
                self.assertTrue(c.get(sb.id).from_warm_pool)
                self.assertEqual(sb.exec("echo hi").stdout, "hi\n")
            with c.create("busybox:test", memory_mb=512) as other:
                self.assertFalse(other.from_warm_pool)
            self.assertEqual(c.warm_pools()[0].taken, 1)
            with self.assertRaises(errors.InvalidArgument):
                c.set_warm_pool("busybox:test", 1, network_rules={"pypi": True})
            self.assertEqual(c.set_warm_pool("busybox:test", 0, memory_mb=256).size, 0)
            self.assertEqual(c.warm_pools(), [])
            self.assertFalse(c.sandbox("sb-x").from_warm_pool)


class SyncClientTest(unittest.TestCase):
    def test_sync_twin(self):
        fake = FakeDsecd()
        self.addCleanup(fake.close)
        with libdsec.Client(fake.addr) as c:
            with c.create("busybox:test", labels={"k": "v"}) as sb:
                r = sb.exec("echo hi")
                self.assertEqual((r.exit_code, r.stdout), (0, "hi\n"))
                r = sb.exec("exit 4")
                self.assertEqual((r.exit_code, r.status), (4, "nonzero"))
                with self.assertRaises(errors.CommandFailed):
                    sb.exec("exit 4", check=True)
                self.assertEqual([e.type for e in sb.exec_stream("echo x")], ["started", "stdout", "exited"])
                sb.write_file("/a", b"data")
                self.assertEqual(sb.read_file("/a"), b"data")
                with self.assertRaises(errors.NotFound):
                    sb.read_file("/missing")
                self.assertEqual([s.id for s in c.list(labels={"k": "v"})], [sb.id])
                sbs = c.create_many(3, "busybox:test", labels={"k": "w"})
                self.assertEqual(len({s.id for s in sbs}), 3)
                self.assertEqual(c.reap(labels={"k": "w"}), 3)
            with self.assertRaises(errors.SandboxGone):
                sb.exec("echo gone")


if __name__ == "__main__":
    unittest.main()
