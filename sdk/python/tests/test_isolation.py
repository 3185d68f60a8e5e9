"""isolation= in create, create_many, set_warm_pool and the run_* helpers,
sync and async, on the wire and back (against the fake server)."""

import _path  # noqa: F401
import asyncio
import unittest

import libdsec
from libdsec import errors
from fakedsecd import FakeDsecd


class IsolationTest(unittest.TestCase):
    def setUp(self):
        self.fake = FakeDsecd()
        self.addCleanup(self.fake.close)

    def specs(self, method="Create"):
        return [r.msg["spec"] for r in self.fake.server.requests if r.method == method]

    def test_async_create_and_helpers(self):
        async def main():
            async with libdsec.AsyncClient(self.fake.addr) as c:
                plain = await c.create("busybox:test")
                gv = await c.create("busybox:test", isolation="gvisor")
                vms = await c.create_many(2, "busybox:test", isolation="microvm")
                helped = [await c.run_container("busybox:test"), await c.run_gvisor("busybox:test"),
                          await c.run_microvm("busybox:test", memory_mb=512)]
                return [plain, gv] + vms + helped
        sbs = asyncio.run(asyncio.wait_for(main(), 30))
        self.assertEqual([s.get("isolation") for s in self.specs()],
                         [None, "ISOLATION_GVISOR", "ISOLATION_MICROVM", "ISOLATION_CONTAINER",
                          "ISOLATION_GVISOR", "ISOLATION_MICROVM"])
        self.assertEqual([sb.isolation for sb in sbs],
                         ["container", "gvisor", "microvm", "microvm", "container", "gvisor", "microvm"])
        self.assertEqual(self.specs()[-1]["memoryMb"], "512")

    def test_sync_create_pool_and_helpers(self):
        with libdsec.Client(self.fake.addr) as c:
            sb = c.create("busybox:test", isolation="gvisor")
            self.assertEqual(sb.isolation, "gvisor")
            self.assertEqual([s.isolation for s in c.create_many(2, "busybox:test", isolation="gvisor")],
                             ["gvisor", "gvisor"])
            self.assertEqual(c.run_microvm("busybox:test").isolation, "microvm")
            c.set_warm_pool("busybox:test", 1, isolation="microvm")
        self.assertEqual([s.get("isolation") for s in self.specs()],
                         ["ISOLATION_GVISOR", "ISOLATION_GVISOR", "ISOLATION_MICROVM"])
        self.assertEqual(self.specs("SetWarmPool")[0]["isolation"], "ISOLATION_MICROVM")

    def test_unknown_isolation_is_refused_locally(self):
        with libdsec.Client(self.fake.addr) as c:
            with self.assertRaises(errors.InvalidArgument) as cm:
                c.create("busybox:test", isolation="firecracker")
        self.assertIn("container, gvisor, microvm", str(cm.exception))
        self.assertEqual(self.specs(), [])

    def test_paper_run_microvm(self):
        from libdsec.compat import DSecClient, DSecMicroVMRunArgs, DSecGVisorRunArgs

        async def main():
            client = DSecClient(self.fake.addr); await client.open()
            vm = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox:test", memory_limit_mb=1024))
            gv = await client.run_gvisor(DSecGVisorRunArgs(container_image="busybox:test"))
            await vm.stop(); await gv.stop()
            await client.close()
        asyncio.run(asyncio.wait_for(main(), 30))
        self.assertEqual([(s["isolation"], s.get("memoryMb")) for s in self.specs()],
                         [("ISOLATION_MICROVM", "1024"), ("ISOLATION_GVISOR", None)])


class NodesTest(unittest.TestCase):
    def test_nodes(self):
        from fakeconnect import FakeServer
        srv = FakeServer()
        self.addCleanup(srv.close)
        node = {"name": "n1", "healthy": True, "kinds": [
            {"isolation": "ISOLATION_CONTAINER", "profile": "BACKEND_CONTAINER"},
            {"isolation": "ISOLATION_GVISOR", "profile": "BACKEND_CONTAINER", "accelerator": "systrap"}],
            "missing": {"microvm": "no QEMU"}}
        srv.route("GetServerInfo", lambda call: call.reply({"name": "api", "nodes": [node]}))
        with libdsec.Client(srv.addr) as c:
            self.assertEqual(c.nodes(), [node])
        self.assertEqual(srv.requests[0].path, "/dsec.v1.SandboxService/GetServerInfo")


if __name__ == "__main__":
    unittest.main()
