"""The Python blocks of docs/python.md compile (test_live runs them)."""

import _path  # noqa: F401
import os
import re
import unittest

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(_path.HERE))), "docs", "python.md")


def blocks():
    with open(DOC) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


class DocsTest(unittest.TestCase):
    def test_blocks_compile(self):
        bs = blocks()
        self.assertGreaterEqual(len(bs), 5)
        for i, b in enumerate(bs):
            with self.subTest(block=i):
                compile(b, f"docs/python.md block {i}", "exec")
