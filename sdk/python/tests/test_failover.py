"""Offline tests of address lists, failover, the bearer token and https,
against two fake servers on loopback."""

import _path  # noqa: F401
import asyncio
import os
import socket
import ssl
import tempfile
import unittest

import libdsec
from libdsec import _transport, errors
from fakeconnect import CERT, FakeServer, b64

LAYERS = "dsec.v1.LayerService"
TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")  # a small tree to upload

EXITED = {"exited": {"exitCode": 0, "status": "EXIT_STATUS_OK"}}


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def closed_addr():
    """A loopback address nothing listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def _stream(*events):
    def fn(call):
        for e in events:
            call.send(e)
        call.end()
    return fn


def _exec(call):
    call.send({"started": {"processId": "p1", "pid": 7}})
    if not call.msg.get("background"):
        call.send({"stdout": b64("hi\n")})
        call.send(EXITED)
    call.end()


def serve_everything(srv):
    """Route every call the SDK makes on srv to a plausible answer."""
    unary = {
        "Create": {"sandboxes": [{"id": "sb-n-1", "state": "STATE_RUNNING"}]},
        "Get": {"id": "sb-n-1", "state": "STATE_RUNNING"}, "List": {}, "Delete": {},
        "WriteStdin": {}, "Signal": {}, "ListProcesses": {"processes": [{"processId": "p1", "running": True}]},
        "SessionInterrupt": {}, "SessionClose": {}, "ReadFile": {"data": b64("content")},
        "WriteFile": {"written": "1"}, "ListDir": {}, "Stat": {"info": {"name": "x"}}, "Remove": {},
        "MakeDir": {}, "Upload": {"files": "1"}, "SetNetworkRules": {}, "NetworkLog": {},
        "SetWarmPool": {"key": "k", "size": 1}, "ListWarmPools": {},
    }
    for m, answer in unary.items():
        srv.route(m, lambda call, a=answer: call.reply(a))
    for m, answer in {"ImportLayer": {"refs": ["b:1"]}, "ListLayers": {}, "ListEnvironments": {},
                      "LayerStats": {}}.items():
        srv.route(m, lambda call, a=answer: call.reply(a), service=LAYERS)
    srv.route("Exec", _exec)
    srv.route("Attach", _stream({"started": {"processId": "p1"}}, EXITED))
    srv.route("SessionRun", _stream(EXITED))
    srv.route("Download", _stream({"data": b64("tar")}))
    srv.route("ImportImage", _stream({"done": True}), service=LAYERS)
    srv.route("UploadLayer", _stream({"digest": "sha256:" + "0" * 64}), service=LAYERS)


async def _exec_stream(c):
    return [e async for e in c.sandbox("sb-n-1").exec_stream("x")]


# Each kind of call, with the method it sends first, and whether it may be
# sent again once a server had it.
EVERY_CALL = [
    ("Create", True, lambda c: c.create("e")),
    ("Get", True, lambda c: c.get("sb-n-1")),
    ("List", True, lambda c: c.list()),
    ("Delete", True, lambda c: c.delete("sb-n-1")),
    ("Exec", False, lambda c: c.sandbox("sb-n-1").exec("echo hi")),
    ("Exec", False, _exec_stream),
    ("Exec", False, lambda c: c.sandbox("sb-n-1").spawn("sleep 1")),
    ("Attach", True, lambda c: c.sandbox("sb-n-1").job("p1").wait(timeout=5)),
    ("Attach", True, lambda c: c.sandbox("sb-n-1").job("p1").output()),
    ("WriteStdin", False, lambda c: c.sandbox("sb-n-1").job("p1").write_stdin(b"x", close=True)),
    ("Signal", False, lambda c: c.sandbox("sb-n-1").job("p1").kill()),
    ("ListProcesses", True, lambda c: c.sandbox("sb-n-1").processes()),
    ("SessionRun", False, lambda c: c.sandbox("sb-n-1").session("s").run("cd /")),
    ("SessionInterrupt", False, lambda c: c.sandbox("sb-n-1").session("s").interrupt()),
    ("SessionClose", False, lambda c: c.sandbox("sb-n-1").session("s").close()),
    ("ReadFile", True, lambda c: c.sandbox("sb-n-1").read_file("/x")),
    ("WriteFile", False, lambda c: c.sandbox("sb-n-1").write_file("/x", b"1")),
    ("ListDir", True, lambda c: c.sandbox("sb-n-1").list_dir("/")),
    ("Stat", True, lambda c: c.sandbox("sb-n-1").stat("/x")),
    ("Remove", True, lambda c: c.sandbox("sb-n-1").remove("/x")),
    ("MakeDir", True, lambda c: c.sandbox("sb-n-1").mkdir("/d")),
    ("Upload", False, lambda c: c.sandbox("sb-n-1").upload_bytes({"a": "1"}, "/d")),
    ("Download", True, lambda c: c.sandbox("sb-n-1").download_tar("/d")),
    ("SetNetworkRules", True, lambda c: c.sandbox("sb-n-1").set_network_rules({"pypi": True})),
    ("NetworkLog", True, lambda c: c.sandbox("sb-n-1").network_log()),
    ("SetWarmPool", True, lambda c: c.set_warm_pool("e", 1)),
    ("ListWarmPools", True, lambda c: c.warm_pools()),
    ("ImportLayer", False, lambda c: c.import_layer("b:1", "/x")),
    ("ListLayers", True, lambda c: c.list_layers()),
    ("ListEnvironments", True, lambda c: c.list_environments()),
    ("LayerStats", True, lambda c: c.layer_stats()),
    ("ImportImage", False, lambda c: c.import_image("i:1", "oci:/x")),
    ("UploadLayer", False, lambda c: c.import_layer("b:1", TESTDATA, upload=True)),
]


class EnvTestCase(unittest.TestCase):
    """Keeps $DSEC_TOKEN, $DSEC_TOKEN_FILE, $DSEC_CA_FILE and the node's
    token file out of the tests."""

    def setUp(self):
        self._env = {k: os.environ.pop(k, None) for k in ("DSEC_TOKEN", "DSEC_TOKEN_FILE", "DSEC_CA_FILE")}
        self._node = _transport.DEFAULT_TOKEN_FILE
        self.dir = tempfile.mkdtemp(prefix="libdsec-test-")
        _transport.DEFAULT_TOKEN_FILE = os.path.join(self.dir, "absent.token")
        self.addCleanup(self._restore)

    def _restore(self):
        _transport.DEFAULT_TOKEN_FILE = self._node
        for k, v in self._env.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)

    def server(self, **kw):
        srv = FakeServer(**kw)
        self.addCleanup(srv.close)
        return srv

    def write(self, name, data):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(data)
        return path


class FailoverTest(EnvTestCase):
    def test_before_a_server_every_call_goes_on(self):
        """The first address refuses connections: every call, Exec and the
        writes included, goes on to the second, and is sent there once."""
        srv = self.server()
        serve_everything(srv)

        async def main():
            async with libdsec.AsyncClient(closed_addr() + "," + srv.addr, timeout=5) as c:
                for i, (method, _, fn) in enumerate(EVERY_CALL):
                    with self.subTest(call=i, method=method):
                        c._t.cur = 0  # start each call on the closed address
                        before = len(srv.methods())
                        await fn(c)
                        self.assertEqual(srv.methods()[before:before + 1], [method])
                        self.assertEqual(c._t.cur, 1)
        run(main())

    def test_unavailable_answer(self):
        """A server answering Unavailable sends the calls that may repeat to
        the next address (a create with the same key); the others are not
        sent again."""
        first, second = self.server(), self.server()
        first.default = lambda call: call.error("unavailable", "apiserver is draining")
        serve_everything(second)

        async def main():
            async with libdsec.AsyncClient(first.addr + "," + second.addr, timeout=5) as c:
                for i, (method, again, fn) in enumerate(EVERY_CALL):
                    with self.subTest(call=i, method=method):
                        c._t.cur = 0
                        b1, b2 = len(first.methods()), len(second.methods())
                        if again:
                            await fn(c)
                            self.assertEqual(second.methods()[b2:b2 + 1], [method])
                        else:
                            with self.assertRaises(errors.Unavailable):
                                await fn(c)
                            self.assertEqual(second.methods()[b2:], [])
                        self.assertEqual(first.methods()[b1:b1 + 1], [method])
        run(main())
        keys = [[r.msg["idempotencyKey"] for r in s.requests if r.method == "Create"] for s in (first, second)]
        self.assertEqual(len(keys[0]), 1)
        self.assertEqual(keys[0], keys[1])

    def test_proxy_503_and_broken_connection(self):
        """A proxy's 502/503 with no Connect body, and a connection broken
        before the answer, send a call that may repeat to the next address."""
        proxy, second = self.server(), self.server()
        serve_everything(second)

        def bad_gateway(call):
            h = call.h
            h.send_response(502)
            h.send_header("Content-Length", "3")
            h.end_headers()
            h.wfile.write(b"bad")
        proxy.default = bad_gateway
        proxy.route("Get", lambda call: call.drop())

        async def main():
            async with libdsec.AsyncClient(proxy.addr + "," + second.addr, timeout=5) as c:
                await c.list_layers()
                c._t.cur = 0
                await c.sandbox("sb-n-1").download_tar("/")
                c._t.cur = 0
                await c.get("sb-n-1")
        run(main())
        self.assertEqual(proxy.methods(), ["ListLayers", "Download", "Get"])
        self.assertEqual(second.methods(), ["ListLayers", "Download", "Get"])

    def test_all_down(self):
        """With every address answering Unavailable, a call that may repeat
        tries each at once, then backs off, within max_retries; one that may
        not is sent once."""
        a, b = self.server(), self.server()
        for s in (a, b):
            s.default = lambda call: call.error("unavailable", "down")

        async def main():
            async with libdsec.AsyncClient(a.addr + "," + b.addr, timeout=10) as c:
                c._t.max_retries = 3
                with self.assertRaises(errors.Unavailable):
                    await c.get("sb-n-1")
                self.assertEqual((len(a.methods()), len(b.methods())), (2, 2))
                with self.assertRaises(errors.Unavailable):
                    await c.sandbox("sb-n-1").write_file("/x", b"1")
                self.assertEqual(len(a.methods()) + len(b.methods()), 5)
        run(main())

    def test_none_reachable(self):
        async def main():
            async with libdsec.AsyncClient(closed_addr() + "," + closed_addr(), timeout=1) as c:
                await c.sandbox("sb-n-1").exec("true")
        with self.assertRaises(errors.Unavailable) as cm:
            run(main())
        self.assertIn("none of 2 apiservers could be reached", cm.exception.message)

    def test_address_lists(self):
        self.assertEqual(libdsec.resolve_addrs(" 127.0.0.1:1 , unix:///run/d.sock,https://h:443/api/ "),
                         [("tcp", ("127.0.0.1", 1)), ("unix", "/run/d.sock"), ("tls", ("h", 443))])
        t = _transport.Transport("http://127.0.0.1:1/api/")
        self.assertEqual(t.endpoints[0].prefix, "/api")
        for bad in ("127.0.0.1:1,,127.0.0.1:2", "127.0.0.1:1,ftp://x:1", "a:1,nohost"):
            with self.subTest(addr=bad):
                with self.assertRaises(errors.InvalidArgument):
                    libdsec.AsyncClient(bad)


class TokenTest(EnvTestCase):
    def calls(self, srv, **kw):
        async def main():
            async with libdsec.AsyncClient(srv.addr, timeout=5, **kw) as c:
                await c.get("sb-n-1")
                await c.sandbox("sb-n-1").exec("true")
                await c.sandbox("sb-n-1").download_tar("/")
        run(main())

    def test_sources_and_precedence(self):
        srv = self.server()
        serve_everything(srv)
        env_file = self.write("token", "from-file\n")
        node_file = self.write("admin.token", "from-node\n")
        cases = [
            ("option wins", {"token": "from-option"}, "from-env", env_file, node_file, "Bearer from-option"),
            ("env", {}, "from-env", env_file, node_file, "Bearer from-env"),
            ("env file", {}, None, env_file, node_file, "Bearer from-file"),
            ("node file", {}, None, None, node_file, "Bearer from-node"),
            ("none", {}, None, None, os.path.join(self.dir, "absent"), None),
        ]
        for name, kw, env, envf, node, want in cases:
            with self.subTest(name):
                for k, v in (("DSEC_TOKEN", env), ("DSEC_TOKEN_FILE", envf)):
                    os.environ.pop(k, None)
                    if v:
                        os.environ[k] = v
                _transport.DEFAULT_TOKEN_FILE = node
                before = len(srv.requests)
                self.calls(srv, **kw)
                got = srv.requests[before:]
                self.assertEqual([r.method for r in got], ["Get", "Exec", "Download"])
                for r in got:
                    self.assertEqual(r.headers.get("Authorization"), want, r.method)

    def test_bad_sources(self):
        os.environ["DSEC_TOKEN_FILE"] = os.path.join(self.dir, "absent")
        with self.assertRaises(errors.InvalidArgument) as cm:
            libdsec.AsyncClient("127.0.0.1:1")
        self.assertIn("$DSEC_TOKEN_FILE", cm.exception.message)
        os.environ.pop("DSEC_TOKEN_FILE")
        os.environ["DSEC_TOKEN"] = "two words"
        with self.assertRaises(errors.InvalidArgument) as cm:
            libdsec.Client("127.0.0.1:1")
        self.assertNotIn("two words", str(cm.exception))

    def test_unauthenticated(self):
        """Not retried, not failed over; the message says where the token
        came from, never the token."""
        first, second = self.server(), self.server()
        serve_everything(second)
        # The server echoes the header, token and all.
        first.default = lambda call: call.error("unauthenticated", "bad " + call.headers.get("Authorization", ""))
        for kw, env, want in [({"token": "s3cret-tok"}, None, "token from the token argument"),
                              ({}, "s3cret-tok", "token from $DSEC_TOKEN"),
                              ({}, None, "no token sent")]:
            with self.subTest(want):
                os.environ.pop("DSEC_TOKEN", None)
                if env:
                    os.environ["DSEC_TOKEN"] = env

                async def main(kw=kw):
                    async with libdsec.AsyncClient(first.addr + "," + second.addr, **kw) as c:
                        for call in (lambda: c.get("sb-n-1"), lambda: c.sandbox("sb-n-1").job("p1").wait()):
                            with self.assertRaises(errors.Unauthenticated) as cm:
                                await call()
                            e = cm.exception
                            self.assertIn(want, str(e))
                            self.assertEqual(e.token.startswith("token from"), want.startswith("token from"))
                            self.assertNotIn("s3cret", str(e) + e.message)
                run(main())
        self.assertEqual(len(first.methods()), 6)
        self.assertEqual(second.methods(), [])


class HTTPSTest(EnvTestCase):
    def test_verify_and_handshake_failover(self):
        srv = self.server(tls=True)
        serve_everything(srv)

        async def get(addr, **kw):
            async with libdsec.AsyncClient(addr, timeout=5, **kw) as c:
                return await c.get("sb-n-1")

        with self.assertRaises(errors.Unavailable) as cm:
            run(get(srv.addr))  # the system roots do not know the test's certificate
        self.assertIn("CERTIFICATE_VERIFY_FAILED", cm.exception.message)
        self.assertEqual(len(srv.requests), 0)  # and it is not tried again and again
        self.assertEqual(run(get(srv.addr, ca_file=CERT)).id, "sb-n-1")
        os.environ["DSEC_CA_FILE"] = CERT
        self.assertEqual(run(get(srv.addr)).id, "sb-n-1")

        # A plain HTTP server named https:// fails the handshake: on to the next.
        plain = self.server()
        serve_everything(plain)

        async def main():
            async with libdsec.AsyncClient("https://" + plain.addr + "," + srv.addr, timeout=5) as c:
                r = await c.sandbox("sb-n-1").exec("true")
                self.assertEqual(r.stdout, "hi\n")
        run(main())
        self.assertEqual(plain.methods(), [])

        os.environ["DSEC_CA_FILE"] = os.path.join(self.dir, "absent.pem")
        with self.assertRaises(errors.InvalidArgument):
            libdsec.AsyncClient(srv.addr)


if __name__ == "__main__":
    unittest.main()
