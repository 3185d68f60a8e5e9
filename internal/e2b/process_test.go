package e2b

import (
	"errors"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	processpb "dsec.dev/dsec/api/gen/e2b/process"
)

func TestEndEvent(t *testing.T) {
	for _, tc := range []struct {
		name string
		exit *dsecv1.ExecExited
		want *processpb.ProcessEvent_EndEvent
	}{
		{"ok", &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK},
			&processpb.ProcessEvent_EndEvent{Exited: true, Status: "exit status 0"}},
		{"nonzero", &dsecv1.ExecExited{ExitCode: 3, Status: dsecv1.ExitStatus_EXIT_STATUS_NONZERO, Message: "exited with code 3"},
			&processpb.ProcessEvent_EndEvent{ExitCode: 3, Exited: true, Status: "exit status 3", Error: proto.String("exit status 3")}},
		{"killed", &dsecv1.ExecExited{ExitCode: -1, Signal: 9, Status: dsecv1.ExitStatus_EXIT_STATUS_KILLED},
			&processpb.ProcessEvent_EndEvent{ExitCode: -1, Status: "signal: killed", Error: proto.String("signal: killed")}},
		{"terminated", &dsecv1.ExecExited{ExitCode: -1, Signal: 15, Status: dsecv1.ExitStatus_EXIT_STATUS_KILLED},
			&processpb.ProcessEvent_EndEvent{ExitCode: -1, Status: "signal: terminated", Error: proto.String("signal: terminated")}},
		{"timeout", &dsecv1.ExecExited{ExitCode: -1, Signal: 9, Status: dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT, Message: "killed at its timeout of 1s"},
			&processpb.ProcessEvent_EndEvent{ExitCode: -1, Status: "signal: killed", Error: proto.String("signal: killed (killed at its timeout of 1s)")}},
		{"oom child", &dsecv1.ExecExited{ExitCode: 137, Status: dsecv1.ExitStatus_EXIT_STATUS_OOM, Message: "a process it started was killed by the OOM killer"},
			&processpb.ProcessEvent_EndEvent{ExitCode: 137, Exited: true, Status: "exit status 137",
				Error: proto.String("exit status 137 (a process it started was killed by the OOM killer)")}},
		{"odd signal", &dsecv1.ExecExited{ExitCode: -1, Signal: 40, Status: dsecv1.ExitStatus_EXIT_STATUS_KILLED},
			&processpb.ProcessEvent_EndEvent{ExitCode: -1, Status: "signal: signal 40", Error: proto.String("signal: signal 40")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := endEvent(tc.exit).GetEnd()
			if d := cmp.Diff(tc.want, got, protocmp.Transform()); d != "" {
				t.Fatalf("end (-want +got):\n%s", d)
			}
		})
	}
}

func TestRequestTimeout(t *testing.T) {
	for _, tc := range []struct {
		header string
		want   time.Duration
		bad    bool
	}{
		{"", 0, false},
		{"0", 0, false},
		{"60000", time.Minute, false},
		{"-1", 0, true},
		{"soon", 0, true},
	} {
		h := http.Header{}
		if tc.header != "" {
			h.Set("Connect-Timeout-Ms", tc.header)
		}
		got, err := requestTimeout(h)
		if got != tc.want || (err != nil) != tc.bad {
			t.Errorf("Connect-Timeout-Ms %q: %v, %v", tc.header, got, err)
		}
	}
}

func TestExecRequest(t *testing.T) {
	cwd := "work"
	m := &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", "echo hi"},
		Envs: map[string]string{"A": "b"}, Cwd: &cwd}, Tag: proto.String("t")}
	got := execRequest(target{ID: "sb-1"}, m, 2*time.Second)
	want := &dsecv1.ExecRequest{SandboxId: "sb-1", Argv: []string{"/bin/bash", "-l", "-c", "echo hi"}, Env: map[string]string{"A": "b"},
		Cwd: "/home/user/work", User: "user", KeepStdinOpen: true, TimeoutSeconds: 2, Background: true, Tag: "t"}
	if d := cmp.Diff(want, got, protocmp.Transform()); d != "" {
		t.Fatalf("exec request (-want +got):\n%s", d)
	}
	m.Stdin = proto.Bool(false)
	m.Process.Cwd = nil
	got = execRequest(target{ID: "sb-1", User: "root"}, m, 0)
	if got.KeepStdinOpen || got.Cwd != "" || got.User != "root" || got.TimeoutSeconds != 0 {
		t.Fatalf("stdin false, no cwd, root: %v", got)
	}
}

// fakeStream is an exec stream of canned events.
type fakeStream struct {
	evs []*dsecv1.ExecEvent
	cur *dsecv1.ExecEvent
}

func (f *fakeStream) Receive() bool {
	if len(f.evs) == 0 {
		return false
	}
	f.cur, f.evs = f.evs[0], f.evs[1:]
	return true
}

func (f *fakeStream) Msg() *dsecv1.ExecEvent { return f.cur }

func TestRelay(t *testing.T) {
	started := &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p-1", Pid: 42}}}
	out := func(s string) *dsecv1.ExecEvent {
		return &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte(s)}}
	}
	errOut := &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stderr{Stderr: []byte("e")}}
	keep := &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Keepalive{Keepalive: true}}
	exited := &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}}

	var got []string
	send := func(ev *processpb.ProcessEvent) error {
		switch e := ev.Event.(type) {
		case *processpb.ProcessEvent_Start:
			got = append(got, "start")
		case *processpb.ProcessEvent_Data:
			got = append(got, "data:"+string(e.Data.GetStdout())+string(e.Data.GetStderr()))
		case *processpb.ProcessEvent_Keepalive:
			got = append(got, "keepalive")
		case *processpb.ProcessEvent_End:
			got = append(got, "end:"+e.End.GetStatus())
		}
		return nil
	}
	onStart := func(*dsecv1.ExecStarted) error { return send(startEvent(42)) }

	ended, err := relay(&fakeStream{evs: []*dsecv1.ExecEvent{started, out("a"), keep, errOut, out("b"), exited}}, 2, onStart, send)
	if !ended || err != nil {
		t.Fatalf("relay: %v %v", ended, err)
	}
	if d := cmp.Diff([]string{"start", "keepalive", "data:b", "end:exit status 0"}, got); d != "" {
		t.Fatalf("events with 2 skipped (-want +got):\n%s", d)
	}

	got = nil
	startErr := &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{
		Status: dsecv1.ExitStatus_EXIT_STATUS_START_ERROR, Message: "chdir /nope: no such file or directory"}}}
	ended, err = relay(&fakeStream{evs: []*dsecv1.ExecEvent{startErr}}, 0, onStart, send)
	if ended || connect.CodeOf(err) != connect.CodeInvalidArgument || len(got) != 0 {
		t.Fatalf("start error: %v %v %v", ended, err, got)
	}

	ended, err = relay(&fakeStream{evs: []*dsecv1.ExecEvent{started, out("a")}}, 0, onStart, send)
	if ended || err != nil {
		t.Fatalf("cut stream: %v %v", ended, err)
	}

	boom := errors.New("client gone")
	_, err = relay(&fakeStream{evs: []*dsecv1.ExecEvent{started}}, 0, func(*dsecv1.ExecStarted) error { return boom }, send)
	if !errors.Is(err, boom) {
		t.Fatalf("send error: %v", err)
	}
}

func TestPick(t *testing.T) {
	now := time.UnixMilli(100_000)
	list := []*dsecv1.ProcessInfo{
		{ProcessId: "old", Pid: 7, Tag: "web", Exited: &dsecv1.ExecExited{DurationSeconds: 1}, StartedUnixMs: 10_000},
		{ProcessId: "late", Pid: 8, Tag: "job", Exited: &dsecv1.ExecExited{DurationSeconds: 1}, StartedUnixMs: 90_000},
		{ProcessId: "run", Pid: 7, Tag: "web", Running: true, StartedUnixMs: 50_000},
		{ProcessId: "run2", Pid: 9, Tag: "web", Running: true, StartedUnixMs: 60_000},
	}
	pid := func(p uint32) *processpb.ProcessSelector {
		return &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: p}}
	}
	tag := func(s string) *processpb.ProcessSelector {
		return &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Tag{Tag: s}}
	}
	for _, tc := range []struct {
		name   string
		sel    *processpb.ProcessSelector
		window time.Duration
		want   string
	}{
		{"pid running over exited", pid(7), exitedWithin, "run"},
		{"pid exited lately, running only", pid(8), 0, ""},
		{"pid exited lately", pid(8), exitedWithin, "late"},
		{"pid unknown", pid(99), exitedWithin, ""},
		{"tag newest running", tag("web"), 0, "run2"},
		{"tag exited lately", tag("job"), exitedWithin, "late"},
		{"empty tag", tag(""), exitedWithin, ""},
		{"no selector", &processpb.ProcessSelector{}, exitedWithin, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := pick(list, tc.sel, tc.window, now).GetProcessId(); got != tc.want {
				t.Fatalf("picked %q, want %q", got, tc.want)
			}
		})
	}
}

func TestProcTable(t *testing.T) {
	tb := newProcTable()
	asked := time.Now()
	tb.put("sb", &procEntry{id: "p-1", pid: 1, added: asked.Add(-time.Second)})
	tb.put("sb", &procEntry{id: "p-2", pid: 2, added: asked.Add(-time.Second)})
	tb.put("sb", &procEntry{id: "p-3", pid: 3, added: asked.Add(time.Second)}) // newer than the list
	tb.put("sb", &procEntry{id: "p-4", pid: 4, added: asked.Add(-time.Second), pty: newPTYSession(nil, func() {})})
	if tb.get("sb", 1).id != "p-1" || tb.byID("sb", "p-2").pid != 2 || tb.get("other", 1) != nil {
		t.Fatal("get and byID")
	}
	tb.prune("sb", map[string]bool{"p-2": true}, asked)
	if tb.get("sb", 1) != nil || tb.get("sb", 2) == nil || tb.get("sb", 3) == nil || tb.get("sb", 4) == nil {
		t.Fatal("prune drops only listed-as-gone entries older than the list, never terminals")
	}
	tb.drop("sb", 2, "p-other") // pid 2 is another process now: kept
	if tb.get("sb", 2) == nil {
		t.Fatal("drop of another process ID")
	}
	for _, e := range []struct {
		pid uint32
		id  string
	}{{2, "p-2"}, {3, "p-3"}, {4, "p-4"}} {
		tb.drop("sb", e.pid, e.id)
	}
	if len(tb.sbs) != 0 {
		t.Fatalf("an empty sandbox stays: %v", tb.sbs)
	}
	if tb.ptyLock("a") != tb.ptyLock("a") {
		t.Fatal("a sandbox's terminal lock changes")
	}
}

func TestConfigOf(t *testing.T) {
	p := &dsecv1.ProcessInfo{Argv: []string{"/bin/bash", "-c", "x"}}
	if c := configOf(nil, p); c.GetCmd() != "/bin/bash" || len(c.GetArgs()) != 2 {
		t.Fatalf("from argv: %v", c)
	}
	known := &processpb.ProcessConfig{Cmd: "/bin/sh", Envs: map[string]string{"A": "b"}}
	if c := configOf(&procEntry{config: known}, p); c != known {
		t.Fatalf("from the table: %v", c)
	}
}
