"""The demo's grader, shipped in the toolkit layer: runs a project's unittest
suite in-process and writes counts as JSON to the path given, so the reward
never depends on what the tests print."""

import json
import sys
import unittest


def main():
    project, out = sys.argv[1], sys.argv[2]
    sys.path.insert(0, project)
    result = {"passed": 0, "failed": 0, "errors": 0, "total": 0, "load_error": ""}
    try:
        suite = unittest.defaultTestLoader.discover(project + "/tests", top_level_dir=project)
        run = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite)
        result["total"] = run.testsRun
        result["failed"] = len(run.failures)
        result["errors"] = len(run.errors)
        result["passed"] = run.testsRun - len(run.failures) - len(run.errors)
    except Exception as exc:  # a patch that breaks import still gets graded
        result["load_error"] = repr(exc)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
