package cli

import (
	"bytes"
	"errors"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TestFaultExits: the platform's faults exit 200 + the fault's number,
// from a command's exit, a call's result or an error that ended the call;
// the task's own ends keep their codes.
func TestFaultExits(t *testing.T) {
	code := func(err error) int {
		var ec *exitCode
		if errors.As(err, &ec) {
			return ec.code
		}
		return -1
	}
	if got := code(exitFor(&dsecv1.ExecExited{ExitCode: -1, Signal: 9, Status: dsecv1.ExitStatus_EXIT_STATUS_OOM,
		Fault: dsecv1.Fault_FAULT_NODE_MEMORY_PRESSURE})); got != 206 {
		t.Errorf("node memory pressure: exit %d, want 206", got)
	}
	if got := code(exitFor(&dsecv1.ExecExited{ExitCode: -1, Signal: 9, Status: dsecv1.ExitStatus_EXIT_STATUS_OOM})); got != 137 {
		t.Errorf("the task's OOM: exit %d, want 137", got)
	}
	if got := fnExit(&dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR, Fault: dsecv1.Fault_FAULT_AGENT_LOST}); got == nil || got.code != 209 {
		t.Errorf("a call's agent lost: %v, want exit 209", got)
	}
	if got := fnExit(&dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR}); got == nil || got.code != 125 {
		t.Errorf("a call's own sandbox error: %v, want exit 125", got)
	}
	for _, tc := range []struct {
		err  error
		want int
	}{
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox sb-n-1 is stopped (deleted): deleted")), 208},
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox sb-n-1 is stopped (ttl): ttl")), 207},
		{connect.NewError(connect.CodeUnavailable, errors.New("node n1: edge unreachable")), 202},
		{connect.NewError(connect.CodeResourceExhausted, errors.New("node n1 is full")), 204},
		{connect.NewError(connect.CodeNotFound, errors.New("sandbox sb-n-1: not found")), 1},
	} {
		var stderr bytes.Buffer
		a := &app{stderr: &stderr}
		if got := a.exit(tc.err, true); got != tc.want {
			t.Errorf("%v: exit %d, want %d (%s)", tc.err, got, tc.want, stderr.String())
		}
		if got := a.exit(tc.err, false); got != 1 {
			t.Errorf("%v from a command without fault exits: exit %d, want 1", tc.err, got)
		}
	}
}

// TestGradeSummary: dsec grade's last line names the grader's end in
// words (nonzero, not EXIT_STATUS_NONZERO) and every part's time.
func TestGradeSummary(t *testing.T) {
	r := &dsecv1.GradeResult{RewardSource: "exit",
		Exit:  &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_NONZERO, ExitCode: 1},
		Times: &dsecv1.GradeTimes{CaptureMs: 3, StartMs: 2, TestsMs: 4, GraderMs: 72, RewardMs: 5, ReceiptMs: 6, TotalMs: 95}}
	want := "dsec: grade of sb-a: nonzero (exit 1), reward from exit; capture 3 ms, start 2 ms, tests 4 ms, grader 72 ms, kill+reward 5 ms, receipt 6 ms, total 95 ms"
	if got := gradeSummary("sb-a", r); got != want {
		t.Errorf("gradeSummary:\n got %s\nwant %s", got, want)
	}
}
