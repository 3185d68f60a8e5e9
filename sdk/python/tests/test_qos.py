"""qos= in create, create_many and set_warm_pool, on the wire (against the
fake server), and an unknown class refused locally."""

import _path  # noqa: F401
import unittest

import libdsec
from libdsec import errors
from fakedsecd import FakeDsecd


class QoSTest(unittest.TestCase):
    def setUp(self):
        self.fake = FakeDsecd()
        self.addCleanup(self.fake.close)

    def specs(self, method="Create"):
        return [r.msg["spec"] for r in self.fake.server.requests if r.method == method]

    def test_on_the_wire(self):
        with libdsec.Client(self.fake.addr) as c:
            c.create("busybox:test")
            c.create("busybox:test", qos="best_effort")
            c.create_many(2, "busybox:test", qos="latency")
            c.set_warm_pool("busybox:test", 1, qos="best_effort")
        self.assertEqual([s.get("qos") for s in self.specs()], [None, "best_effort", "latency"])
        self.assertEqual(self.specs("SetWarmPool")[0]["qos"], "best_effort")

    def test_unknown_is_refused_locally(self):
        with libdsec.Client(self.fake.addr) as c:
            with self.assertRaises(errors.InvalidArgument) as cm:
                c.create("busybox:test", qos="idle")
        self.assertIn("latency, best_effort", str(cm.exception))
        self.assertEqual(self.specs(), [])


if __name__ == "__main__":
    unittest.main()
