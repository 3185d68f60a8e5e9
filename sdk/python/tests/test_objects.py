"""libdsec's calls on the projects of layers and snapshots against a real
apiserver: a builder's layer and snapshot are its project's, a runner of
another project sees them only once shared, read-only.

The Go test TestObjectsPython (internal/apiserver) runs this module against
an apiserver on SQLite whose one node keeps layers in memory, with
DSEC_TEST_OBJ_ADDR and a token per principal (DSEC_TEST_OBJ_ADMIN,
DSEC_TEST_OBJ_BUILDER, DSEC_TEST_OBJ_RUNNER, DSEC_TEST_OBJ_RUN_BUILDER) set;
base:1 is the root's.
Run alone, without them, it skips.
"""

import _path  # noqa: F401
import os
import unittest

import libdsec
from libdsec import errors

ADDR = os.environ.get("DSEC_TEST_OBJ_ADDR", "")


@unittest.skipUnless(ADDR, "run by TestObjectsPython (internal/apiserver), which sets DSEC_TEST_OBJ_ADDR")
class ObjectsTest(unittest.TestCase):
    def client(self, who):
        c = libdsec.Client(ADDR, token=os.environ["DSEC_TEST_OBJ_" + who])
        self.addCleanup(c.close)
        return c

    def test_share(self):
        builder, runner = self.client("BUILDER"), self.client("RUNNER")
        run_builder = self.client("RUN_BUILDER")

        def refs(c):
            return sorted(r for l in c.list_layers() for r in l.get("refs", []))

        layer = builder.import_layer("pyenv:1", "/pyenv", kind="workspace")
        self.assertEqual(layer["project"], "build")
        with self.assertRaises(errors.PermissionDenied):
            runner.import_layer("pymine:1", "/x", kind="workspace")
        sb = builder.create("base:1+pyenv:1")
        info = sb.snapshot("pysnap", project="build")
        self.assertEqual(info["project"], "build")
        self.assertNotIn("pyenv:1", refs(runner))
        self.assertEqual(runner.list_snapshots(), [])
        with self.assertRaises(errors.NotFound):
            runner.create(info["environment"])
        with self.assertRaises(errors.NotFound):
            run_builder.share_snapshot("pysnap", "run")

        self.assertEqual(builder.share_layer("pyenv:1", "run"), ["run"])
        self.assertEqual(builder.share_snapshot("pysnap", "run"), ["run"])
        self.assertIn("pyenv:1", refs(runner))
        [shared] = [l for l in runner.list_layers() if "pyenv:1" in l.get("refs", [])]
        self.assertEqual((shared["project"], shared["sharedWith"]), ("build", ["run"]))
        mine = runner.create(info["environment"])
        self.assertTrue(mine.id)
        with self.assertRaises(errors.PermissionDenied):
            run_builder.remove_layer("pyenv:1")
        with self.assertRaises(errors.PermissionDenied):
            run_builder.delete_snapshot("pysnap")

        self.assertEqual(builder.unshare_snapshot("pysnap", "run"), [])
        self.assertEqual(builder.unshare_layer("pyenv:1", "run"), [])
        with self.assertRaises(errors.NotFound):
            runner.create(info["environment"])
        builder.delete_snapshot("pysnap")
        builder.remove_layer("pyenv:1")
        self.assertNotIn("pyenv:1", refs(builder))

    def test_delete_project_objects(self):
        admin, builder = self.client("ADMIN"), self.client("BUILDER")
        admin.create_project("build/pytask")
        builder.import_layer("pytask:1", "/pytask", kind="workspace", project="build/pytask")
        with self.assertRaises(errors.FailedPrecondition) as cm:
            admin.delete_project("build/pytask")
        self.assertIn("1 layer (pytask:1)", str(cm.exception))
        admin.delete_project("build/pytask", objects_to_parent=True)
        [layer] = [l for l in builder.list_layers() if "pytask:1" in l.get("refs", [])]
        self.assertEqual(layer["project"], "build")
        builder.remove_layer("pytask:1")


if __name__ == "__main__":
    unittest.main()
