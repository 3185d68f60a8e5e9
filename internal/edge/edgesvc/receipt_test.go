package edgesvc

import (
	"fmt"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TestExecLog: the log answers a sandbox's newest exec of a command, keeps
// the last execsPerSandbox of each sandbox and the execSandboxes sandboxes
// that ran one most recently, and forgets a deleted sandbox's.
func TestExecLog(t *testing.T) {
	var l execLog
	grader, other := commandKey([]string{"sh", "-c", "pytest"}), commandKey([]string{"sh", "-c", "kill -9 -1"})
	exit := func(code int32) *dsecv1.ExecExited { return &dsecv1.ExecExited{ExitCode: code} }
	l.add("sb-a", grader, exit(1))
	l.add("sb-a", grader, exit(0))
	l.add("sb-a", other, exit(0))
	if x, ok := l.last("sb-a", grader); !ok || x.GetExitCode() != 0 {
		t.Errorf("last grader of sb-a: %v %v, want exit 0", x, ok)
	}
	if _, ok := l.last("sb-b", grader); ok {
		t.Error("sb-b ran no grader, yet the log has one")
	}
	for i := range execsPerSandbox {
		l.add("sb-a", other, exit(int32(i)))
	}
	if _, ok := l.last("sb-a", grader); ok {
		t.Errorf("the grader outlived %d later execs of sb-a", execsPerSandbox)
	}
	l.add("sb-a", grader, exit(0))
	l.forget("sb-a")
	if _, ok := l.last("sb-a", grader); ok {
		t.Error("a forgotten sandbox's exec is still known")
	}
	for i := range execSandboxes + 1 {
		l.add(fmt.Sprintf("sb-%d", i), grader, exit(0))
	}
	if _, ok := l.last("sb-0", grader); ok || len(l.execs) != execSandboxes || len(l.order) != execSandboxes {
		t.Errorf("the log holds %d sandboxes (%d ordered), the oldest kept %v; want %d, the oldest gone", len(l.execs), len(l.order), ok, execSandboxes)
	}
}
