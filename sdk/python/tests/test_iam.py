"""libdsec's IAM calls against a real apiserver: projects, quotas,
principals, role bindings, tokens (an agent's chain revoked), escalations
refused, the audit trail.

The Go test TestIAMPython (internal/apiserver) runs this module against an
apiserver on SQLite and one on PostgreSQL, with DSEC_TEST_IAM_ADDR and
DSEC_TEST_IAM_TOKEN (the root's admin) set and three audit records seeded
(see iam_test.go); run alone, without them, it skips.
"""

import _path  # noqa: F401
import asyncio
import io
import json
import os
import time
import unittest

import libdsec
from libdsec import errors

ADDR = os.environ.get("DSEC_TEST_IAM_ADDR", "")
TOKEN = os.environ.get("DSEC_TEST_IAM_TOKEN", "")


@unittest.skipUnless(ADDR and TOKEN, "run by TestIAMPython (internal/apiserver), which sets DSEC_TEST_IAM_ADDR")
class IAMTest(unittest.TestCase):
    def client(self, token):
        c = libdsec.Client(ADDR, token=token)
        self.addCleanup(c.close)
        return c

    def test_surface(self):
        admin = self.client(TOKEN)
        for p in ("py", "py/run-1", "py/run-2", "py-other"):
            self.assertEqual(admin.create_project(p).path, p)
        with self.assertRaises(errors.AlreadyExists):
            admin.create_project("py")
        self.assertEqual(admin.project("/py/run-1").depth, 2)
        self.assertEqual([p.path for p in admin.projects("py")], ["py/run-1", "py/run-2"])
        self.assertIn("py/run-2", [p.path for p in admin.projects("/", subtree=True)])

        # Quotas carved from the parent's.
        admin.set_quota("py", "sandboxes", 10)
        admin.set_quota("py/run-1", "sandboxes", 6)
        with self.assertRaises(errors.Overloaded) as cm:
            admin.set_quota("py/run-2", "sandboxes", 6)
        self.assertIn("project py holds 10 sandboxes and would hand down 12", str(cm.exception))
        qs = admin.quota("py")
        self.assertEqual([q.project for q in qs], ["py", "py/run-1", "py/run-2"])
        self.assertEqual((qs[0].item("sandboxes").limit, qs[0].item("sandboxes").used), (10, 0))
        self.assertIsNone(qs[2].item("memory_mb").limit)
        admin.set_quota("py/run-1", "sandboxes", None)
        self.assertIsNone(admin.quota("py")[1].item("sandboxes").limit)

        # Principals and bindings.
        h = admin.create_principal("py-harness", kind="service", project="py")
        self.assertEqual((h.kind, h.project), ("service", "py"))
        admin.create_principal("py-carol", project="py-other")
        admin.grant("py-harness", "py", libdsec.ADMIN)
        self.assertEqual([(b.project, b.role) for b in admin.bindings("py-harness")], [("py", "admin")])
        self.assertEqual([p.name for p in admin.principals("py")], ["py-harness"])

        # The harness's token, and a sub-agent's narrower one it mints.
        htok, hinfo = admin.create_token(principal="py-harness", project="py", role=libdsec.ADMIN, ttl_s=3600)
        self.assertTrue(hinfo.parent and hinfo.expires > time.time())
        harness = self.client(htok)
        self.assertEqual([p.path for p in harness.projects()], ["py/run-1", "py/run-2"])
        # Without a project, a principal is at home in the token's.
        self.assertEqual(harness.create_principal("py-agent", kind="service").project, "py")
        harness.delete_principal("py-agent")
        stok, sinfo = harness.create_token(project="py/run-1", role=libdsec.RUNNER, ttl_s=600)
        self.assertEqual((sinfo.parent, sinfo.principal, sinfo.project, sinfo.role),
                         (hinfo.id, "py-harness", "py/run-1", "runner"))
        sub = self.client(stok)
        self.assertEqual(sub.projects(), [])

        # Escalations, each refused, nothing changed.
        refusals = [
            ("sub-agent mints", lambda: sub.create_token(role="viewer", ttl_s=60), errors.PermissionDenied, "needs admin"),
            ("sub-agent grants", lambda: sub.grant("py-harness", "py/run-1", "viewer"), errors.PermissionDenied, "needs admin"),
            ("sub-agent sets a quota", lambda: sub.set_quota("py/run-1", "sandboxes", 1), errors.PermissionDenied, "needs admin"),
            ("sub-agent reads its parent", lambda: sub.project("py"), errors.NotFound, "project py does not exist"),
            ("harness outlives its token", lambda: harness.create_token(role="runner", ttl_s=7200), errors.PermissionDenied, "outlive"),
            ("harness mints without expiry", lambda: harness.create_token(role="runner"), errors.PermissionDenied, "outlive"),
            ("harness grants on the root", lambda: harness.grant("py-harness", "/", "admin"), errors.PermissionDenied, "grant on project /"),
            ("harness raises its own quota", lambda: harness.set_quota("py", "sandboxes", 1000), errors.PermissionDenied, "under its own"),
            ("harness reads another project", lambda: harness.project("py-other"), errors.NotFound, "project py-other does not exist"),
            ("harness queries another project's audit", lambda: harness.audit(project="py-other"), errors.NotFound, "does not exist"),
            ("harness lists carol's tokens", lambda: harness.tokens("py-carol"), errors.NotFound, "py-carol"),
            ("a forged token", lambda: self.client("dsec_forged").projects(), errors.Unauthenticated, ""),
        ]
        for name, call, kind, words in refusals:
            with self.subTest(name):
                with self.assertRaises(kind) as cm:
                    call()
                self.assertIn(words, str(cm.exception))
        self.assertEqual([(b.project, b.role) for b in admin.bindings("py-harness")], [("py", "admin")])
        self.assertEqual(admin.quota("py")[0].item("sandboxes").limit, 10)

        # Tokens listed without secrets; revoking the harness's revokes the
        # sub-agent's, which stops working within the cache's window.
        toks = harness.tokens()
        self.assertEqual([t.id for t in toks], [hinfo.id, sinfo.id])
        self.assertNotIn(stok, repr(toks))
        self.assertEqual(harness.revoke_token(hinfo.id), 2)
        deadline = time.monotonic() + 60
        while True:
            try:
                sub.projects()
            except errors.Unauthenticated:
                break
            self.assertLess(time.monotonic(), deadline, "the sub-agent's token works a minute after the revocation")
            time.sleep(0.1)
        self.assertTrue(all(t.revoked for t in admin.tokens("py-harness")))

        admin.delete_principal("py-carol")
        admin.delete_principal("py-harness")
        with self.assertRaises(errors.FailedPrecondition):
            admin.delete_project("py")
        for p in ("py/run-1", "py/run-2", "py", "py-other"):
            admin.delete_project(p)
        with self.assertRaises(errors.NotFound):
            admin.project("py")

    def test_audit(self):
        # TestIAMPython seeded: audit-a (project aud, an hour ago), audit-b
        # (aud/x, 30 minutes ago, by bob, permission_denied) and audit-c
        # (elsewhere, 10 minutes ago).
        admin = self.client(TOKEN)
        recs = admin.audit(project="aud")
        self.assertEqual([r.object for r in recs], ["audit-a", "audit-b"])
        self.assertEqual((recs[1].principal, recs[1].code, recs[1].project), ("bob", "permission_denied", "aud/x"))
        self.assertEqual([r.object for r in admin.audit(project="aud", since=time.time() - 40 * 60)], ["audit-b"])
        self.assertEqual([r.object for r in admin.audit(project="/", principal="bob")], ["audit-b"])
        out = io.BytesIO()
        n = admin.export_audit(out, project="/", since=time.time() - 2 * 3600)
        lines = [json.loads(l) for l in out.getvalue().splitlines()]
        self.assertEqual(n, len(lines))
        self.assertEqual([l["object"] for l in lines if l.get("object", "").startswith("audit-")],
                         ["audit-a", "audit-b", "audit-c"])

        async def aexport():
            async with libdsec.AsyncClient(ADDR, token=TOKEN) as ac:
                buf = io.BytesIO()
                await ac.export_audit(buf, project="aud", limit=1)
                return buf.getvalue()
        self.assertEqual(json.loads(asyncio.run(aexport()))["object"], "audit-a")


if __name__ == "__main__":
    unittest.main()
