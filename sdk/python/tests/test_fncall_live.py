"""run_code, run_tests, languages and `dsec fn run` against a real dsecd
with the fncall environment imported as fncall:latest.

The environment's tree is $DSEC_FNCALL_ENV_TREE, default
/var/cache/dsec/fncall-env (scripts/build-fncall-env.sh builds it). Skips
without root, a dsecd binary or the tree; fails instead under
DSEC_TEST_ROOT=1.
"""

import _path  # noqa: F401
import asyncio
import os
import subprocess
import tempfile
import unittest

import libdsec
from libdsec import errors
from daemon import Daemon, require

DEFAULT_TREE = "/var/cache/dsec/fncall-env"
D = None


def fncall_tree():
    tree = os.environ.get("DSEC_FNCALL_ENV_TREE") or DEFAULT_TREE
    require(os.path.exists(os.path.join(tree, "usr", "bin", "python3")),
            f"the fncall environment is not built at {tree} "
            f"(scripts/build-fncall-env.sh {tree}, or set DSEC_FNCALL_ENV_TREE)")
    return tree


def setUpModule():
    global D
    tree = fncall_tree()
    d = Daemon(extra_args=["--sandboxfusion-listen", "none"])
    require(os.path.exists(os.path.join(d.bin, "dsec")), f"no dsec binary in {d.bin} (run make build)")
    d.start()
    try:
        r = subprocess.run([os.path.join(d.bin, "dsec"), "--addr", d.addr, "layer", "import", "--kind", "base",
                            "--allow-setuid", "fncall:latest", tree], capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise AssertionError(f"dsec layer import fncall:latest: {r.stdout}{r.stderr}")
    except BaseException:
        d.stop()
        raise
    D = d


def tearDownModule():
    if D is not None:
        D.stop()


class FnCallLiveTest(unittest.TestCase):
    def setUp(self):
        self.c = libdsec.Client(D.addr)
        self.addCleanup(self.c.close)

    def test_print(self):
        r = self.c.run_code("python", "print(1)")
        self.assertEqual((r.status, r.stdout, r.return_code), ("success", "1\n", 0), r)
        self.assertTrue(r.ok)
        self.assertIsNone(r.compile)
        self.assertEqual(r.node, "py")
        self.assertTrue(r.container.startswith("sb-py-"), r.container)

    def test_wrong_program(self):
        r = self.c.run_code("python", "import sys\nprint('before')\nsys.exit(3)")
        self.assertEqual((r.status, r.return_code, r.stdout, r.run.status), ("failed", 3, "before\n", "finished"), r)
        r = self.c.run_code("python", "raise ValueError('boom')")
        self.assertEqual((r.status, r.return_code), ("failed", 1))
        self.assertIn("ValueError: boom", r.stderr)
        r = self.c.run_code("python", "import time\nprint('so far', flush=True)\ntime.sleep(30)", run_timeout=1)
        self.assertEqual((r.status, r.run.status, r.return_code, r.stdout), ("failed", "time_limit_exceeded", None, "so far\n"))

    def test_cpp(self):
        r = self.c.run_code("cpp", "#include <cstdio>\nint main(){int a,b;scanf(\"%d %d\",&a,&b);printf(\"%d\\n\",a+b);}",
                            stdin="2 3\n")
        self.assertEqual((r.status, r.stdout), ("success", "5\n"), r)
        self.assertEqual((r.compile.status, r.compile.return_code), ("finished", 0))
        r = self.c.run_code("cpp", "int main( { return 0; }")
        self.assertEqual(r.status, "failed")
        self.assertIsNone(r.run)
        self.assertEqual(r.compile.status, "finished")
        self.assertNotEqual(r.compile.return_code, 0)
        self.assertIn("error", r.compile.stderr)

    def test_files(self):
        r = self.c.run_code("python", "d = open('in/data.txt').read()\nopen('out.txt', 'w').write(d.upper())",
                            files={"in/data.txt": "abc"}, fetch_files=["out.txt", "nothere.txt"])
        self.assertTrue(r.ok, r)
        self.assertEqual(r.files, {"out.txt": b"ABC"})

    def test_run_tests_in_parallel(self):
        # Each case reports when it ran on stderr; stdout is the answer.
        code = ("import sys, time\nt0 = time.time()\ntime.sleep(1)\n"
                "print(sum(map(int, input().split())))\nprint(t0, time.time(), file=sys.stderr)")
        cases = [(f"{i} {i + 1}\n", f"{2 * i + 1}\n") for i in range(8)]

        async def main():
            async with libdsec.AsyncClient(D.addr) as c:
                return await c.run_tests("python", code, cases)
        rs = asyncio.run(main())
        self.assertEqual([r.passed for r in rs], [True] * 8, [(r.status, r.message, r.stdout, r.stderr) for r in rs])
        self.assertEqual([r.stdout for r in rs], [want for _, want in cases])
        spans = [tuple(map(float, r.stderr.split())) for r in rs]
        most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
        print(f"\nrun_tests: {most} of 8 cases ran at once", end=" ")
        self.assertGreater(most, 1, f"the cases ran one after another: {spans}")
        rs = self.c.run_tests("python", "print(sum(map(int, input().split())))", [("1 1", "3"), ("1 1", "2\n"), "5 5"])
        self.assertEqual([r.passed for r in rs], [False, True, None])

    def test_languages_and_errors(self):
        names = {lang.name for lang in self.c.languages()}
        self.assertTrue({"python", "cpp", "go", "java", "bash"} <= names, names)
        with self.assertRaises(errors.InvalidArgument):
            self.c.run_code("cobol", "x")
        r = self.c.run_code_batch([{"language": "python", "code": "print(2)"}, {"language": "cobol", "code": "x"}])
        self.assertEqual((r[0].stdout, r[1].status), ("2\n", "sandbox_error"))

    def test_cli_fn_run(self):
        with tempfile.TemporaryDirectory() as d:
            prog = os.path.join(d, "file.py")
            with open(prog, "w") as f:
                f.write("import sys\nx = input()\nprint(x[::-1])\nprint('to stderr', file=sys.stderr)\nsys.exit(int(x) % 7)\n")
            cli = os.path.join(D.bin, "dsec")
            r = subprocess.run([cli, "--addr", D.addr, "fn", "run", "--language", "python", prog],
                               input="1234\n", capture_output=True, text=True, timeout=120)
            self.assertEqual((r.returncode, r.stdout, r.stderr), (1234 % 7, "4321\n", "to stderr\n"))
            r = subprocess.run([cli, "--addr", D.addr, "fn", "run", "--language", "python", "-"],
                               input="print('from stdin')\n", capture_output=True, text=True, timeout=120)
            self.assertEqual((r.returncode, r.stdout), (0, "from stdin\n"), r.stderr)
            r = subprocess.run([cli, "--addr", D.addr, "fn", "run", "-l", "python", "--run-timeout", "1", "-"],
                               input="import time\ntime.sleep(30)\n", capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 124, r.stderr)
            r = subprocess.run([cli, "--addr", D.addr, "fn", "run", "-l", "cpp", "-"],
                               input="int main( {}\n", capture_output=True, text=True, timeout=120)
            self.assertEqual((r.returncode, r.stdout), (1, ""))
            self.assertIn("error", r.stderr)
            r = subprocess.run([cli, "--addr", D.addr, "fn", "languages"], capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("python", r.stdout)


if __name__ == "__main__":
    unittest.main()
