"""The demo's grader, shipped in the toolkit layer (and laid pristine into
each clean room by the demo's grade): runs a project's unittest suite
in-process and writes counts as JSON to the path given and to stdout, and
the reward, passed / total, to $DSEC_REWARD_FILE when dsec's grade names
one, so the reward never depends on what the tests print."""

import os

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
    reward = result["passed"] / result["total"] if result["total"] and not result["load_error"] else 0.0
    if os.environ.get("DSEC_REWARD_FILE"):
        with open(os.environ["DSEC_REWARD_FILE"], "w") as f:
            f.write(f"{reward}\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
