"""Lifecycle events through libdsec: listed from a cursor, followed.

Runs against an apiserver with a hollow edge that the Go test
TestEventsPython (internal/apiserver) starts, named by DSEC_TEST_EVENTS_ADDR
and DSEC_TEST_EVENTS_TOKEN (a runner of project a); skips without them.
"""

import _path  # noqa: F401
import asyncio
import os
import time
import unittest

import libdsec
from libdsec import errors

ADDR = os.environ.get("DSEC_TEST_EVENTS_ADDR")
TOKEN = os.environ.get("DSEC_TEST_EVENTS_TOKEN")
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


if __name__ == "__main__":
    unittest.main()
