"""Lifecycle events through libdsec: listed from a cursor, followed.

Runs against an apiserver with a hollow edge that the Go test
TestEventsPython (internal/apiserver) starts, named by DSEC_TEST_EVENTS_ADDR
and DSEC_TEST_EVENTS_TOKEN (a runner of project a); skips without them.
"""

import _path  # noqa: F401
import asyncio
import http.server
import hashlib
import hmac
import json
import os
import threading
import time
import unittest

import libdsec
from libdsec import errors

ADDR = os.environ.get("DSEC_TEST_EVENTS_ADDR")
TOKEN = os.environ.get("DSEC_TEST_EVENTS_TOKEN")
ADMIN = os.environ.get("DSEC_TEST_EVENTS_ADMIN_TOKEN")
LIFE = ["created", "paused", "resumed", "deleted"]


@unittest.skipUnless(ADDR and TOKEN, "needs DSEC_TEST_EVENTS_ADDR (go test ./internal/apiserver -run TestEventsPython)")
class EventsTest(unittest.TestCase):
    def setUp(self):
        self.c = libdsec.Client(ADDR, token=TOKEN)
        self.addCleanup(self.c.close)

    def life(self):
        sb = self.c.create("busybox")
        sb.pause()
        sb.resume()
        sb.delete()
        return sb.id

    def wait_kinds(self, sid):
        kinds = []
        for _ in range(200):
            evs, _ = self.c.events(sandbox_id=sid)
            kinds = [e.kind for e in evs]
            if len(kinds) >= len(LIFE):
                break
            time.sleep(0.05)
        self.assertEqual(kinds, LIFE)
        return evs

    def test_list_and_cursor(self):
        sid = self.life()
        evs = self.wait_kinds(sid)
        for e in evs:
            self.assertIsInstance(e, libdsec.Event)
            self.assertEqual((e.project, e.sandbox_id, e.node), ("a", sid, "n1"))
            self.assertGreater(e.at, 0)
        first, cur = self.c.events(sandbox_id=sid, limit=1)
        rest, end = self.c.events(sandbox_id=sid, after=cur)
        self.assertEqual([e.kind for e in first + rest], LIFE)
        self.assertEqual(end, evs[-1].id)
        paused, _ = self.c.events(sandbox_id=sid, kinds=["paused"])
        self.assertEqual([e.kind for e in paused], ["paused"])
        with self.assertRaises(errors.NotFound):
            self.c.events(project="b")

    def test_follow(self):
        sid = self.life()
        got = [e.kind for e in self.c.follow_events(sandbox_id=sid, limit=4, timeout=30)]
        self.assertEqual(got, LIFE)

        # A follower from now sees a new sandbox's life as it happens.
        _, cur = self.c.events()
        async def follow():
            async with libdsec.AsyncClient(ADDR, token=TOKEN) as ac:
                return [e async for e in ac.follow_events(after=cur, limit=4, timeout=30)]
        task_result = []

        async def main():
            t = asyncio.ensure_future(follow())
            await asyncio.sleep(0.3)
            await asyncio.get_running_loop().run_in_executor(None, self.life)
            task_result.extend(await t)
        asyncio.run(main())
        self.assertEqual([e.kind for e in task_result], LIFE)
        self.assertEqual(len({e.sandbox_id for e in task_result}), 1)

    def test_webhook(self):
        got = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                got.append((self.headers["Dsec-Signature"], body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        self.addCleanup(srv.shutdown)
        with libdsec.Client(ADDR, token=ADMIN) as admin:
            with self.assertRaises(errors.PermissionDenied):
                self.c.add_webhook(f"http://127.0.0.1:{srv.server_port}/hook")
            wh = admin.add_webhook(f"http://127.0.0.1:{srv.server_port}/hook", kinds=["created", "deleted"])
            self.assertTrue(wh.secret)
            self.assertEqual(wh.batch, 100)
            sid = self.life()
            for _ in range(400):
                if sum(len(libdsec.webhook_events(b)) for _, b in list(got)) >= 2:
                    break
                time.sleep(0.05)
            # Batched deliveries: {"webhook": ..., "events": [...]}, which
            # webhook_events reads, as it reads a single event's body.
            for _, b in got:
                self.assertEqual(json.loads(b)["webhook"], wh.id)
            bodies = [e for _, b in got for e in libdsec.webhook_events(b)]
            self.assertEqual([(e.kind, e.sandbox_id) for e in bodies], [("created", sid), ("deleted", sid)])
            self.assertTrue(all(e.at > time.time() - 600 and e.key for e in bodies))
            single = libdsec.webhook_events(json.dumps({"webhook": wh.id, "id": 7, "key": "n1/e/7",
                                                        "at": "2026-12-06T10:02:11.204Z", "kind": "created"}).encode())
            self.assertEqual([(e.id, e.kind) for e in single], [(7, "created")])
            for sig, body in got:
                self.assertTrue(libdsec.verify_webhook(wh.secret, sig, body))
                self.assertFalse(libdsec.verify_webhook(wh.secret, sig, body.replace(b"created", b"deleted", 1)
                                                        if b"created" in body else body + b" "))
                self.assertFalse(libdsec.verify_webhook("another", sig, body))
            ws = admin.webhooks()
            self.assertEqual([w.id for w in ws], [wh.id])
            self.assertEqual(ws[0].secret, "")
            for _ in range(100):
                if admin.webhooks()[0].delivered == bodies[-1].id:
                    break
                time.sleep(0.05)
            self.assertEqual(admin.webhooks()[0].delivered, bodies[-1].id)
            self.assertGreater(admin.webhooks()[0].last_ok, 0)
            # A rotation: the new secret once, the old one signing beside it
            # for the overlap; a header with both verifies with either.
            with self.assertRaises(errors.PermissionDenied):
                self.c.rotate_webhook_secret(wh.id)
            rot = admin.rotate_webhook_secret(wh.id, overlap=3600)
            self.assertTrue(rot.secret)
            self.assertNotEqual(rot.secret, wh.secret)
            self.assertGreater(rot.previous_secret_until, time.time() + 3500)
            self.assertGreater(admin.webhooks()[0].previous_secret_until, 0)
            ts, body = int(time.time()), b'{"id":1}'
            v1 = [hmac.new(s.encode(), str(ts).encode() + b"." + body, hashlib.sha256).hexdigest() for s in (rot.secret, wh.secret)]
            both = f"t={ts},v1={v1[0]},v1={v1[1]}"
            self.assertTrue(libdsec.verify_webhook(rot.secret, both, body))
            self.assertTrue(libdsec.verify_webhook(wh.secret, both, body))
            self.assertFalse(libdsec.verify_webhook("another", both, body))
            rot2 = admin.rotate_webhook_secret(wh.id, secret="s2", overlap=0)
            self.assertEqual(rot2.secret, "s2")
            self.assertEqual(rot2.previous_secret_until, 0)
            admin.remove_webhook(wh.id)
            self.assertEqual(admin.webhooks(), [])
            # A webhook of single events (the format before batches), and
            # a batch the server refuses.
            one = admin.add_webhook(f"http://127.0.0.1:{srv.server_port}/one", single=True)
            self.assertEqual((one.batch, admin.webhooks()[0].batch), (0, 0))
            # Changed in place: to batches, then kinds and its URL, its
            # cursor kept; what is not named stays.
            with self.assertRaises(errors.PermissionDenied):
                self.c.update_webhook(one.id, batch=100)
            up = admin.update_webhook(one.id, batch=100)
            self.assertEqual((up.id, up.batch, up.url, up.kinds, up.delivered, up.secret),
                             (one.id, 100, one.url, [], one.delivered, ""))
            up = admin.update_webhook(one.id, kinds=["deleted"], url=f"http://127.0.0.1:{srv.server_port}/two")
            self.assertEqual((up.batch, up.kinds, up.url), (100, ["deleted"], f"http://127.0.0.1:{srv.server_port}/two"))
            up = admin.update_webhook(one.id, kinds=[], single=True)
            self.assertEqual((up.batch, up.kinds), (0, []))
            self.assertEqual(admin.webhooks()[0].batch, 0)
            with self.assertRaises(errors.InvalidArgument):
                admin.update_webhook(one.id, batch=5000)
            with self.assertRaises(errors.NotFound):
                admin.update_webhook("wh-none", batch=10)
            admin.remove_webhook(one.id)
            with self.assertRaises(errors.InvalidArgument):
                admin.add_webhook(f"http://127.0.0.1:{srv.server_port}/hook", batch=5000)


if __name__ == "__main__":
    unittest.main()
