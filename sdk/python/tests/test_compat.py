"""The paper's Listing 1, verbatim, runs on libdsec.compat (against the fake server)."""

import _path  # noqa: F401
import asyncio
import os
import unittest

from fakedsecd import FakeDsecd


async def listing_1():
    from libdsec.compat import DSecClient, DSecContainerRunArgs
    # --- Listing 1 (arXiv 2609.22978), unchanged ---
    client = DSecClient(); await client.open()
    args = DSecContainerRunArgs(container_image="registry.../sphinx-9658:official",
        memory_limit_mb=4096, cpu_cores_limit=4, ttl_running_stop=300,   # idle timeout
        network_rules={"npm": False, "pypi": True}, init_user="root")
    sandbox = await client.run_container(args, timeout=120)
    result = await sandbox.run_shell("echo hello world")
    await sandbox.stop()
    # --- end of Listing 1 ---
    await client.close()
    return result


class TopLevelNamesTest(unittest.TestCase):
    def test_paper_names_import_from_the_package(self):
        import libdsec
        import libdsec.compat
        from libdsec import DSecClient, DSecContainerRunArgs, DSecSandbox
        self.assertIs(DSecClient, libdsec.compat.DSecClient)
        self.assertIs(DSecContainerRunArgs, libdsec.compat.DSecContainerRunArgs)
        self.assertIs(DSecSandbox, libdsec.compat.DSecSandbox)
        for name in ("DSecClient", "DSecContainerRunArgs", "DSecSandbox"):
            self.assertIn(name, libdsec.__all__)


class Listing1Test(unittest.TestCase):
    def test_listing_1(self):
        fake = FakeDsecd()
        self.addCleanup(fake.close)
        old = os.environ.get("DSEC_ADDR")
        os.environ["DSEC_ADDR"] = fake.addr
        try:
            result = asyncio.run(asyncio.wait_for(listing_1(), 30))
        finally:
            if old is None:
                del os.environ["DSEC_ADDR"]
            else:
                os.environ["DSEC_ADDR"] = old
        self.assertEqual((result.exit_code, result.stdout), (0, "hello world\n"))
        create = [r for r in fake.server.requests if r.method == "Create"][0].msg
        self.assertEqual(create["spec"], {
            "environment": "registry.../sphinx-9658:official", "backend": "BACKEND_CONTAINER",
            "cpus": 4.0, "memoryMb": "4096", "idleTimeoutSeconds": "300", "user": "root",
            "networkRules": {"npm": False, "pypi": True}})
        self.assertEqual(create["waitSeconds"], "120")
        self.assertEqual([r.method for r in fake.server.requests], ["Create", "Exec", "Delete"])


if __name__ == "__main__":
    unittest.main()
