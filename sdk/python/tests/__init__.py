# Lets unittest import these tests as a package (-t sdk/python) as well as
# plain modules (-s sdk/python/tests); _path puts libdsec on sys.path.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402,F401
