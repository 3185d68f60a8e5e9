"""infra_fault: errors and results say whether the platform ended a call."""

import unittest

import _path  # noqa: F401
from libdsec import errors
from libdsec._aio import GradeResult
from libdsec._fncall import RunResult


class InfraFaultTest(unittest.TestCase):
    def test_errors(self):
        for code, message, want in [
            ("failed_precondition", "sandbox sb-n-1 is stopped (deleted): deleted", "sandbox_deleted"),
            ("failed_precondition", "sandbox sb-n-1 is stopped (ttl): ran out", "sandbox_ttl"),
            ("failed_precondition", "sandbox sb-n-1 is failed (node_lost): gone", "node_lost"),
            ("failed_precondition", "sandbox sb-n-1 is stopped (paused_too_long): kept", "preempted"),
            ("failed_precondition", "sandbox sb-n-1 is stopped (oom): OOM-killed", None),
            ("unavailable", "node n1 is unreachable", "edge_unreachable"),
            ("unavailable", "sandbox sb-n-1: agent channel: EOF", "agent_lost"),
            ("resource_exhausted", "node n1 is full", "admission_refused"),
            ("invalid_argument", "bad", None),
            ("not_found", "sandbox sb-n-1: not found", None),
        ]:
            self.assertEqual(errors.from_code(code, message).infra_fault, want, (code, message))
        self.assertEqual(errors.from_code("deadline_exceeded", "late", creating=True).infra_fault, "start_timeout")
        self.assertIsNone(errors.from_code("deadline_exceeded", "late").infra_fault)

    def test_results(self):
        self.assertEqual(errors.fault_of_enum("FAULT_NODE_MEMORY_PRESSURE"), "node_memory_pressure")
        self.assertEqual(errors.fault_of_enum(8), "sandbox_deleted")
        self.assertIsNone(errors.fault_of_enum(None))
        r = RunResult.from_json({"status": "RUN_STATUS_SANDBOX_ERROR", "fault": "FAULT_EDGE_UNREACHABLE"})
        self.assertEqual(r.infra_fault, "edge_unreachable")
        self.assertIsNone(RunResult.from_json({"status": "RUN_STATUS_SUCCESS"}).infra_fault)

    def test_grade_times(self):
        # protojson: int64 as strings, bools as bools; pooled and laid
        # stay bools, not 1 and 0.
        g = GradeResult._from({"reward": 1, "times": {"graderMs": "120", "rewardMs": "4", "pooled": True, "laid": True}})
        self.assertEqual(g.times, {"grader_ms": 120, "reward_ms": 4, "pooled": True, "laid": True})
        self.assertIs(g.times["pooled"], True)


if __name__ == "__main__":
    unittest.main()
