package edgesvc

import (
	"fmt"
	"slices"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TestExecLog: the log answers a sandbox's newest exec of a command, keeps
// the last execsPerSandbox of each sandbox and the execSandboxes sandboxes
// acted on most recently, and forgets a deleted sandbox's.
func TestExecLog(t *testing.T) {
	var l execLog
	grader, other := commandKey([]string{"sh", "-c", "pytest"}), commandKey([]string{"sh", "-c", "kill -9 -1"})
	exit := func(code int32) *dsecv1.ExecExited { return &dsecv1.ExecExited{ExitCode: code} }
	run := func(id string, command [32]byte, code int32) {
		l.add(id, command, exit(code), l.act(id, "exec", "nobody"), "nobody", false)
	}
	run("sb-a", grader, 1)
	run("sb-a", grader, 0)
	run("sb-a", other, 0)
	if x, ok := l.last("sb-a", grader); !ok || x.exit.GetExitCode() != 0 || x.seq != 2 || x.user != "nobody" {
		t.Errorf("last grader of sb-a: %+v %v, want exit 0, call 2, as nobody", x, ok)
	}
	if _, ok := l.last("sb-b", grader); ok {
		t.Error("sb-b ran no grader, yet the log has one")
	}
	for i := range execsPerSandbox {
		run("sb-a", other, int32(i))
	}
	if _, ok := l.last("sb-a", grader); ok {
		t.Errorf("the grader outlived %d later execs of sb-a", execsPerSandbox)
	}
	run("sb-a", grader, 0)
	l.forget("sb-a")
	if _, ok := l.last("sb-a", grader); ok {
		t.Error("a forgotten sandbox's exec is still known")
	}
	for i := range execSandboxes + 1 {
		run(fmt.Sprintf("sb-%d", i), grader, 0)
	}
	if _, ok := l.last("sb-0", grader); ok || len(l.execs) != execSandboxes || len(l.order) != execSandboxes {
		t.Errorf("the log holds %d sandboxes (%d ordered), the oldest kept %v; want %d, the oldest gone", len(l.execs), len(l.order), ok, execSandboxes)
	}
}

// TestExecLogOthersSince: after a grader began, execs as its own user are
// not other calls; a file write, an exec as another user, or more calls
// than the log keeps are.
func TestExecLogOthersSince(t *testing.T) {
	var l execLog
	l.act("room", "write_file", "")
	g := l.act("room", "exec", "65534:65534")
	if got := l.othersSince("room", g, "65534:65534"); got != "" {
		t.Errorf("nothing after the grader: %q", got)
	}
	l.act("room", "exec", "65534:65534") // the kill of what it left
	if got := l.othersSince("room", g, "65534:65534"); got != "" {
		t.Errorf("an exec as the grader's user after it: %q, want none", got)
	}
	l.act("room", "exec", "root")
	if got := l.othersSince("room", g, "65534:65534"); got != `an exec as user "root"` {
		t.Errorf("an exec as root after the grader: %q", got)
	}
	g = l.act("room", "exec", "65534:65534")
	l.act("room", "write_file", "")
	if got := l.othersSince("room", g, "65534:65534"); got != "a call write_file" {
		t.Errorf("a write after the grader: %q", got)
	}
	g = l.act("room", "exec", "65534:65534")
	for range callsPerSandbox + 1 {
		l.act("room", "exec", "65534:65534")
	}
	if got := l.othersSince("room", g, "65534:65534"); got == "" {
		t.Errorf("more calls after the grader than the log keeps: none seen")
	}
	if got := l.othersSince("never-acted-on", 0, ""); got != "" {
		t.Errorf("a sandbox the node never saw: %q", got)
	}
}

// TestExecLogProvenance: the flags reported since a time, oldest first,
// the last provenancePerSandbox of them; flagNames names them as the SDK
// does.
func TestExecLogProvenance(t *testing.T) {
	var l execLog
	before := time.Now()
	l.reported("sb", []string{"tests_modified"})
	for range provenancePerSandbox {
		l.reported("sb", []string{})
	}
	if got := l.reportedSince("sb", before); len(got) != provenancePerSandbox || len(got[0].flags) != 0 {
		t.Errorf("reported since the start: %+v, want the last %d, none with flags", got, provenancePerSandbox)
	}
	if got := l.reportedSince("sb", time.Now().Add(time.Second)); len(got) != 0 {
		t.Errorf("reported since a second from now: %+v", got)
	}
	names := flagNames(&dsecv1.ProvenanceFlags{TestsModified: true, SyscallsDenied: true, FilesOutsideWorkspace: true})
	if want := []string{"files_outside_workspace", "tests_modified", "syscalls_denied"}; !slices.Equal(names, want) {
		t.Errorf("flagNames: %v, want %v", names, want)
	}
}
