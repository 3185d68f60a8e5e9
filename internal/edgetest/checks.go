package edgetest

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/sandboxid"
)

// testLifecycle: create, get, list, a token's idempotence through Create
// and CreateMany, pause and resume twice each, delete twice, and the ended
// sandbox's state.
func testLifecycle(t *testing.T, e *edge) {
	ctx := t.Context()
	token := "edgetest#0@" + e.node
	sb := e.create(ctx, token)
	got, err := e.get(ctx, sb.GetId())
	if err != nil || got.GetId() != sb.GetId() || got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("Get %s: %v, %v; want it running", sb.GetId(), got, err)
	}
	if ids := e.live(ctx); !slices.Equal(ids, []string{sb.GetId()}) {
		t.Fatalf("List: %v, want [%s]", ids, sb.GetId())
	}
	testMetricsHistory(t, e, sb.GetId())

	again := e.create(ctx, token)
	if again.GetId() != sb.GetId() {
		t.Fatalf("Create with token %q again made %s; want %s, the first's", token, again.GetId(), sb.GetId())
	}
	second := "edgetest#1@" + e.node
	many, err := e.h.CreateMany(ctx, connect.NewRequest(&edgev1.CreateManyRequest{Spec: e.spec(), CreateTokens: []string{token, second}}))
	if err != nil {
		t.Fatalf("CreateMany: %v", err)
	}
	res := many.Msg.GetResults()
	if len(res) != 2 || res[0].GetSandbox().GetId() != sb.GetId() || res[1].GetSandbox().GetId() == "" || res[1].GetSandbox().GetId() == sb.GetId() {
		t.Fatalf("CreateMany of the first token and a new one: %v; want %s and a new sandbox", res, sb.GetId())
	}
	other := res[1].GetSandbox().GetId()
	if ids := e.live(ctx); len(ids) != 2 {
		t.Fatalf("List after CreateMany: %v, want %s and %s", ids, sb.GetId(), other)
	}

	testFork(t, e, other, 2)

	// Pause and Resume, each twice: the second says it was already done.
	for i, want := range []bool{false, true} {
		resp, err := e.h.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: other}))
		if err != nil {
			t.Fatalf("Pause %d: %v", i+1, err)
		}
		if resp.Msg.GetSandbox().GetState() != dsecv1.State_STATE_PAUSED || resp.Msg.GetAlreadyPaused() != want {
			t.Fatalf("Pause %d: state %v, already_paused %v; want paused, %v", i+1, resp.Msg.GetSandbox().GetState(), resp.Msg.GetAlreadyPaused(), want)
		}
	}
	for i, want := range []bool{false, true} {
		resp, err := e.h.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: other}))
		if err != nil {
			t.Fatalf("Resume %d: %v", i+1, err)
		}
		if resp.Msg.GetSandbox().GetState() != dsecv1.State_STATE_RUNNING || resp.Msg.GetAlreadyRunning() != want {
			t.Fatalf("Resume %d: state %v, already_running %v; want running, %v", i+1, resp.Msg.GetSandbox().GetState(), resp.Msg.GetAlreadyRunning(), want)
		}
	}

	// Delete is idempotent; the ended sandbox is stopped, gone, and refuses
	// what needs it live.
	for i := range 2 {
		if err := e.delete(ctx, other); err != nil {
			t.Fatalf("Delete %s, call %d: %v", other, i+1, err)
		}
	}
	if got, err := e.get(ctx, other); err == nil && got.GetState() != dsecv1.State_STATE_STOPPED {
		t.Errorf("Get of a deleted sandbox: state %v, want stopped (or NotFound)", got.GetState())
	} else if err != nil {
		wantKind(t, "Get of a deleted sandbox", err, errdefs.ErrNotFound)
	}
	gone, err := e.h.Gone(ctx, connect.NewRequest(&edgev1.GoneRequest{Ids: []string{sb.GetId(), other}}))
	if err != nil || !slices.Equal(gone.Msg.GetIds(), []string{other}) {
		t.Errorf("Gone of a live and a deleted sandbox: %v, %v; want [%s]", gone.Msg.GetIds(), err, other)
	}
	_, err = e.h.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: other}))
	wantKind(t, "Pause of a deleted sandbox", err, errdefs.ErrFailedPrecondition)
	if ids := e.live(ctx); !slices.Equal(ids, []string{sb.GetId()}) {
		t.Errorf("List after a delete: %v, want [%s]", ids, sb.GetId())
	}
}

// testMetricsHistory: Metrics with since answers the samples the edge
// kept of live sandbox id, each taken after since, oldest first (an edge
// that keeps none answers none; one that cannot measure refuses
// NotSupported), and none for a since still to come.
func testMetricsHistory(t *testing.T, e *edge, id string) {
	ctx := t.Context()
	for _, since := range []time.Time{time.Now().Add(-time.Hour), time.Now().Add(time.Hour)} {
		resp, err := e.h.Metrics(ctx, connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: id, SinceUnixMs: since.UnixMilli()}))
		if errors.Is(err, errdefs.ErrNotSupported) {
			return
		}
		if err != nil {
			t.Fatalf("Metrics of %s since %v: %v", id, since, err)
		}
		prev := since.UnixMilli()
		for _, s := range resp.Msg.GetSamples() {
			if s.GetTimeUnixMs() <= prev {
				t.Errorf("Metrics of %s since %v: sample at %d, after %d: want each after since, oldest first", id, since, s.GetTimeUnixMs(), prev)
			}
			prev = s.GetTimeUnixMs()
		}
		if since.After(time.Now()) && len(resp.Msg.GetSamples()) > 0 {
			t.Errorf("Metrics of %s since an hour to come: %d samples, want none", id, len(resp.Msg.GetSamples()))
		}
	}
}

// testFork forks sandbox id once, as Options.Fork says the edge does, the
// test having live sandboxes before it.
func testFork(t *testing.T, e *edge, id string, live int) {
	ctx := t.Context()
	resp, err := e.h.Fork(ctx, connect.NewRequest(&edgev1.ForkRequest{SandboxId: id, CreateTokens: []string{"edgetest-fork#0@" + e.node}}))
	switch e.o.Fork {
	case ForkUnsupported:
		wantKind(t, "Fork on an edge that cannot fork", err, errdefs.ErrNotSupported)
	case ForkRefused:
		wantKind(t, "Fork of a sandbox its runtime cannot fork", err, errdefs.ErrFailedPrecondition)
	case ForkMakes:
		if err != nil {
			t.Fatalf("Fork: %v", err)
		}
		res := resp.Msg.GetResults()
		if len(res) != 1 || res[0].GetErrorCode() != 0 || res[0].GetSandbox().GetId() == "" || res[0].GetSandbox().GetId() == id ||
			res[0].GetSandbox().GetState() != dsecv1.State_STATE_RUNNING || res[0].GetSandbox().GetNode() != e.node {
			t.Fatalf("Fork of %s with one token: %v; want one running child on %s", id, res, e.node)
		}
		if ids := e.live(ctx); len(ids) != live+1 {
			t.Fatalf("List after a Fork: %v, want %d sandboxes", ids, live+1)
		}
		if err := e.delete(ctx, res[0].GetSandbox().GetId()); err != nil {
			t.Fatal(err)
		}
		return
	}
	if ids := e.live(ctx); len(ids) != live {
		t.Fatalf("List after a refused Fork: %v, want %d sandboxes", ids, live)
	}
}

// testErrors: the error kinds of a sandbox the node never made and of
// malformed requests; none makes a sandbox.
func testErrors(t *testing.T, e *edge) {
	ctx := t.Context()
	unknown := sandboxid.New(e.node, 0, 0)
	_, err := e.get(ctx, unknown)
	wantKind(t, "Get of an unknown sandbox", err, errdefs.ErrNotFound)
	_, err = e.h.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: unknown}))
	wantKind(t, "Pause of an unknown sandbox", err, errdefs.ErrNotFound)
	_, err = e.h.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: unknown}))
	wantKind(t, "Resume of an unknown sandbox", err, errdefs.ErrNotFound)
	_, err = e.h.SetTimeout(ctx, connect.NewRequest(&dsecv1.SetTimeoutRequest{SandboxId: unknown, TimeoutSeconds: 60}))
	wantKind(t, "SetTimeout of an unknown sandbox", err, errdefs.ErrNotFound)
	_, err = e.h.EndPhase(ctx, connect.NewRequest(&dsecv1.EndPhaseRequest{SandboxId: unknown, Phase: dsecv1.Phase_PHASE_AGENT}))
	wantKind(t, "EndPhase of an unknown sandbox", err, errdefs.ErrNotFound)
	_, err = e.h.Metrics(ctx, connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: unknown}))
	wantKind(t, "Metrics of an unknown sandbox", err, errdefs.ErrNotFound)
	_, err = e.exec(ctx, unknown, "true")
	wantKind(t, "Exec in an unknown sandbox", err, errdefs.ErrNotFound)
	_, err = e.h.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: unknown, Path: "/etc/hostname"}))
	wantKind(t, "ReadFile in an unknown sandbox", err, errdefs.ErrNotFound)
	_, err = e.h.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: unknown, Name: "edgetest-snap"}))
	wantKind(t, "Snapshot of an unknown sandbox", err, errdefs.ErrNotFound)
	_, err = e.h.Fork(ctx, connect.NewRequest(&edgev1.ForkRequest{SandboxId: unknown, CreateTokens: []string{"edgetest-fork#1@" + e.node}}))
	if e.o.Fork == ForkUnsupported {
		wantKind(t, "Fork on an edge that cannot fork", err, errdefs.ErrNotSupported)
	} else {
		wantKind(t, "Fork of an unknown sandbox", err, errdefs.ErrNotFound)
	}
	_, err = e.h.Provenance(ctx, connect.NewRequest(&dsecv1.ProvenanceRequest{SandboxId: unknown}))
	wantKind(t, "Provenance of an unknown sandbox", err, errdefs.ErrNotFound)
	if err := e.delete(ctx, unknown); err != nil {
		t.Errorf("Delete of an unknown sandbox: %v, want nil (Delete is idempotent)", err)
	}
	gone, err := e.h.Gone(ctx, connect.NewRequest(&edgev1.GoneRequest{Ids: []string{unknown}}))
	if err != nil || !slices.Equal(gone.Msg.GetIds(), []string{unknown}) {
		t.Errorf("Gone of an unknown sandbox: %v, %v; want it", gone.Msg.GetIds(), err)
	}

	_, err = e.h.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: &dsecv1.SandboxSpec{}, CreateToken: "edgetest#bad@" + e.node}))
	wantKind(t, "Create without an environment", err, errdefs.ErrInvalidArgument)
	_, err = e.h.CreateMany(ctx, connect.NewRequest(&edgev1.CreateManyRequest{Spec: e.spec()}))
	wantKind(t, "CreateMany without create tokens", err, errdefs.ErrInvalidArgument)
	_, err = e.h.CreateMany(ctx, connect.NewRequest(&edgev1.CreateManyRequest{Spec: e.spec(), CreateTokens: []string{"a@" + e.node, "a@" + e.node}}))
	wantKind(t, "CreateMany with a token twice", err, errdefs.ErrInvalidArgument)
	_, err = e.exec(ctx, "", "true")
	wantKind(t, "Exec without a sandbox ID", err, errdefs.ErrInvalidArgument)
	_, err = e.h.Fork(ctx, connect.NewRequest(&edgev1.ForkRequest{CreateTokens: []string{"edgetest-fork#2@" + e.node}}))
	wantKind(t, "Fork without a sandbox ID", err, errdefs.ErrInvalidArgument)
	_, err = e.h.Fork(ctx, connect.NewRequest(&edgev1.ForkRequest{SandboxId: unknown}))
	wantKind(t, "Fork without create tokens", err, errdefs.ErrInvalidArgument)
	_, err = e.h.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{Path: "/tmp/x", Data: []byte("x")}))
	wantKind(t, "WriteFile without a sandbox ID", err, errdefs.ErrInvalidArgument)
	if ids := e.live(ctx); len(ids) != 0 {
		t.Errorf("malformed and unknown calls left sandboxes %v", ids)
	}
}

// testReap: Reap removes what a token made, keeps the IDs it is told to,
// and a create with a reaped token is refused.
func testReap(t *testing.T, e *edge) {
	ctx := t.Context()
	reaped, kept := "edgetest-reap#0@"+e.node, "edgetest-reap#1@"+e.node
	a, b := e.create(ctx, reaped), e.create(ctx, kept)
	resp, err := e.h.Reap(ctx, connect.NewRequest(&edgev1.ReapRequest{TokenPrefixes: []string{"edgetest-reap#"}, KeepIds: []string{b.GetId()}}))
	if err != nil {
		t.Fatalf("Reap: %v", err)
	}
	if !slices.Equal(resp.Msg.GetRemovedIds(), []string{a.GetId()}) {
		t.Fatalf("Reap removed %v, want [%s] (and %s kept)", resp.Msg.GetRemovedIds(), a.GetId(), b.GetId())
	}
	if ids := e.live(ctx); !slices.Equal(ids, []string{b.GetId()}) {
		t.Errorf("List after Reap: %v, want [%s]", ids, b.GetId())
	}
	_, err = e.h.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: e.spec(), CreateToken: reaped}))
	wantKind(t, "Create with a reaped token", err, errdefs.ErrFailedPrecondition)
}

// testInside: the calls that run inside a sandbox, or their refusal where
// the edge runs nothing; a call to an ended sandbox says it ended.
func testInside(t *testing.T, e *edge) {
	ctx := t.Context()
	sb := e.create(ctx, "edgetest-inside#0@"+e.node)
	id := sb.GetId()
	if e.o.Deviations.NoAgent {
		_, err := e.exec(ctx, id, "true")
		wantKind(t, "Exec on an edge that runs nothing", err, errdefs.ErrNotSupported)
		_, err = e.h.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: "/etc/hostname"}))
		wantKind(t, "ReadFile on an edge that runs nothing", err, errdefs.ErrNotSupported)
		_, err = e.h.ListProcesses(ctx, connect.NewRequest(&dsecv1.ListProcessesRequest{SandboxId: id}))
		wantKind(t, "ListProcesses on an edge that runs nothing", err, errdefs.ErrNotSupported)
		_, err = e.h.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: "edgetest-snap"}))
		wantKind(t, "Snapshot on an edge that keeps no files", err, errdefs.ErrNotSupported)
	} else {
		r, err := e.exec(ctx, id, "echo hello; exit 3")
		if err != nil || r.stdout != "hello\n" || r.exited.GetExitCode() != 3 {
			t.Fatalf("Exec: stdout %q, exited %v, %v; want hello and code 3", r.stdout, r.exited, err)
		}
		if _, err := e.h.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: id, Path: "/tmp/edgetest", Data: []byte("data")})); err != nil {
			t.Fatalf("WriteFile: %v", err)
		}
		got, err := e.h.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: "/tmp/edgetest"}))
		if err != nil || string(got.Msg.GetData()) != "data" {
			t.Fatalf("ReadFile of what WriteFile wrote: %q, %v", got.Msg.GetData(), err)
		}
		_, err = e.h.Stat(ctx, connect.NewRequest(&dsecv1.StatRequest{SandboxId: id, Path: "/tmp/absent"}))
		wantKind(t, "Stat of a missing file", err, errdefs.ErrNotFound)
		testExecAfter(t, e, id)
		testSnapshot(t, e, id)
	}
	testProvenance(t, e, id)
	if err := e.delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	_, err := e.exec(ctx, id, "true")
	wantKind(t, "Exec in a deleted sandbox", err, errdefs.ErrFailedPrecondition)
	_, err = e.h.Provenance(ctx, connect.NewRequest(&dsecv1.ProvenanceRequest{SandboxId: id}))
	wantKind(t, "Provenance of a deleted sandbox", err, errdefs.ErrFailedPrecondition)
	_, err = e.h.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: "/etc/hostname"}))
	wantKind(t, "ReadFile in a deleted sandbox", err, errdefs.ErrFailedPrecondition)
}

// testExecAfter: an exec whose request asks for after steps (ExecAfter, a
// grade's grader) exits with them done: what its user left running is
// killed, and the file is read after the kill, or said missing.
func testExecAfter(t *testing.T, e *edge, id string) {
	ctx := t.Context()
	const user, file = "65534:65534", "/tmp/edgetest-after"
	if _, err := e.h.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: id, Path: file, Mode: 0o666})); err != nil {
		t.Fatalf("WriteFile: %v", err)
	}
	after := &dsecv1.ExecAfter{KillUser: true, ReadFile: file}
	r, err := e.execReq(ctx, &dsecv1.ExecRequest{SandboxId: id, User: user, After: after,
		Command: "echo 0.5 >" + file + "; sleep 600 >/dev/null 2>&1 & exit 0"})
	if err != nil || r.exited.GetExitCode() != 0 {
		t.Fatalf("Exec with after steps: exited %v, %v", r.exited, err)
	}
	if got := r.exited.GetAfter(); got == nil || string(got.GetFile()) != "0.5\n" || got.GetFileMissing() {
		t.Errorf("the exit's after steps: %v, want the file read back (0.5)", got)
	}
	r, err = e.execReq(ctx, &dsecv1.ExecRequest{SandboxId: id, Command: Running("sleep")})
	if err != nil || r.stdout != "none\n" {
		ps, _ := e.execReq(ctx, &dsecv1.ExecRequest{SandboxId: id, Command: `for d in /proc/[0-9]*; do echo $d $(grep -E "^(Name|State|Uid|PPid)" $d/status | tr "\n" " "); done`})
		t.Errorf("sleeps the command left running after the after steps' kill: %q, %v; want none; the sandbox's processes:\n%s", r.stdout, err, ps.stdout)
	}
	r, err = e.execReq(ctx, &dsecv1.ExecRequest{SandboxId: id, User: user, Command: "exit 3",
		After: &dsecv1.ExecAfter{ReadFile: "/tmp/edgetest-absent"}})
	if err != nil || r.exited.GetExitCode() != 3 || !r.exited.GetAfter().GetFileMissing() {
		t.Errorf("Exec reading a missing file after: exited %v, %v; want code 3, the file missing", r.exited, err)
	}
	if r, err := e.exec(ctx, id, "true"); err != nil || r.exited.GetAfter() != nil {
		t.Errorf("Exec without after steps: exited %v, %v; want no after", r.exited, err)
	}
}

// Running is a shell command that prints how many processes named name
// run in the sandbox ("none" for 0): killed ones that wait for their
// parent to reap them (zombies) do not run.
func Running(name string) string {
	return `n=0; for s in /proc/[0-9]*/status; do grep -q "^Name:.` + name + `$" $s 2>/dev/null && ! grep -q "^State:.Z" $s 2>/dev/null && n=$((n+1)); done; ` +
		`[ $n = 0 ] && echo none || echo $n`
}

// testSnapshot: a snapshot of sandbox id is an environment whose sandboxes
// hold the files id wrote.
func testSnapshot(t *testing.T, e *edge, id string) {
	ctx := t.Context()
	if _, err := e.h.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: id, Path: "/srv/edgetest/kept", Data: []byte("kept"), MakeParents: true})); err != nil {
		t.Fatalf("WriteFile: %v", err)
	}
	resp, err := e.h.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: "edgetest-snap"}))
	if err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	info := resp.Msg
	if info.GetSourceSandbox() != id || info.GetEnvironment() == "" || info.GetNode() != e.node {
		t.Fatalf("Snapshot of %s: source %q, environment %q, node %q", id, info.GetSourceSandbox(), info.GetEnvironment(), info.GetNode())
	}
	spec := e.spec()
	spec.Environment = info.GetEnvironment()
	made, err := e.h.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec, CreateToken: "edgetest-snap#0@" + e.node}))
	if err != nil {
		t.Fatalf("Create from snapshot %s: %v", info.GetEnvironment(), err)
	}
	got, err := e.h.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: made.Msg.GetId(), Path: "/srv/edgetest/kept"}))
	if err != nil || string(got.Msg.GetData()) != "kept" {
		t.Errorf("a sandbox of the snapshot reads %q, %v; want what its source wrote", got.Msg.GetData(), err)
	}
	if err := e.delete(ctx, made.Msg.GetId()); err != nil {
		t.Fatal(err)
	}
	testSnapshotInclude(t, e, id)
}

// testSnapshotInclude: a snapshot with include keeps only those paths (a
// grade's capture, docs/grading.md), and leaves out its trusted paths
// whole.
func testSnapshotInclude(t *testing.T, e *edge, id string) {
	ctx := t.Context()
	if _, err := e.h.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: id, Path: "/srv/edgetest/tests/forged", Data: []byte("forged"), MakeParents: true})); err != nil {
		t.Fatalf("WriteFile: %v", err)
	}
	resp, err := e.h.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: "edgetest-include",
		Include: []string{"/srv/edgetest"}, Trusted: []string{"/srv/edgetest/tests"}}))
	if err != nil {
		t.Fatalf("Snapshot with include: %v", err)
	}
	if got := resp.Msg.GetIncluded(); !slices.Equal(got, []string{"/srv/edgetest"}) {
		t.Errorf("Snapshot with include: included %q, want [/srv/edgetest]", got)
	}
	if got := resp.Msg.GetCleared(); !slices.Equal(got, []string{"/srv/edgetest/tests"}) {
		t.Errorf("Snapshot with include: cleared %q, want [/srv/edgetest/tests]", got)
	}
	spec := e.spec()
	spec.Environment = resp.Msg.GetEnvironment()
	made, err := e.h.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec, CreateToken: "edgetest-include#0@" + e.node}))
	if err != nil {
		t.Fatalf("Create from snapshot %s: %v", spec.Environment, err)
	}
	defer e.delete(context.WithoutCancel(ctx), made.Msg.GetId())
	got, err := e.h.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: made.Msg.GetId(), Path: "/srv/edgetest/kept"}))
	if err != nil || string(got.Msg.GetData()) != "kept" {
		t.Errorf("an included path reads %q, %v; want what the source wrote", got.Msg.GetData(), err)
	}
	for _, p := range []string{"/tmp/edgetest", "/srv/edgetest/tests/forged"} {
		_, err := e.h.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: made.Msg.GetId(), Path: p}))
		wantKind(t, "ReadFile of "+p+", outside the include or trusted", err, errdefs.ErrNotFound)
	}
}

// testCancel: a keyed create whose caller is gone makes at most one
// sandbox, which a retry with its token returns; an exec whose context
// ends midway ends with that kind, its command gone, and the sandbox
// serves on.
func testCancel(t *testing.T, e *edge) {
	ctx := t.Context()
	token := "edgetest-cancel#0@" + e.node
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, err := e.h.Create(cancelled, connect.NewRequest(&edgev1.CreateRequest{Spec: e.spec(), CreateToken: token}))
	if err != nil && !ended(err) {
		t.Errorf("Create with a cancelled context: %v, want success or Canceled/DeadlineExceeded", err)
	}
	sb := e.create(ctx, token)
	if ids := e.live(ctx); !slices.Equal(ids, []string{sb.GetId()}) {
		t.Fatalf("a cancelled keyed create and its retry left %v, want [%s] alone", ids, sb.GetId())
	}
	if e.o.Deviations.NoAgent {
		return
	}
	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	_, err = e.exec(short, sb.GetId(), "sleep 67")
	if !ended(err) {
		t.Errorf("Exec past its context's deadline: %v, want Canceled or DeadlineExceeded", err)
	}
	// The foreground command dies with its call; wait for it, bounded.
	deadline := time.Now().Add(10 * time.Second)
	for {
		r, err := e.exec(ctx, sb.GetId(), "ps -o args | grep -c '^sleep 67' || true")
		if err != nil {
			t.Fatalf("Exec after a cancelled one: %v", err)
		}
		if strings.TrimSpace(r.stdout) == "0" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the cancelled exec's command still runs 10 s on (%s of them)", strings.TrimSpace(r.stdout))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ended says whether err is a context's end: cancelled (context.Canceled,
// as errdefs.FromConnect maps Connect's Canceled) or past its deadline
// (either kind of it).
func ended(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errdefs.ErrDeadlineExceeded)
}

// testProvenance: a relative provenance path is refused; the provenance of
// a sandbox names the file testInside wrote outside the workspace, where
// the edge runs sandboxes.
func testProvenance(t *testing.T, e *edge, id string) {
	ctx := t.Context()
	_, err := e.h.SetProvenancePaths(ctx, connect.NewRequest(&dsecv1.SetProvenancePathsRequest{
		SandboxId: id, Paths: &dsecv1.ProvenancePaths{Workspace: []string{"work"}}}))
	wantKind(t, "SetProvenancePaths with a relative path", err, errdefs.ErrInvalidArgument)
	if _, err := e.h.SetProvenancePaths(ctx, connect.NewRequest(&dsecv1.SetProvenancePathsRequest{
		SandboxId: id, Paths: &dsecv1.ProvenancePaths{Workspace: []string{"/work"}}})); err != nil {
		t.Fatalf("SetProvenancePaths: %v", err)
	}
	res, err := e.h.Provenance(ctx, connect.NewRequest(&dsecv1.ProvenanceRequest{SandboxId: id}))
	if err != nil {
		t.Fatalf("Provenance: %v", err)
	}
	p := res.Msg
	if e.o.Deviations.NoAgent {
		if len(p.GetFilesWritten()) != 0 || p.GetFlags().GetFilesOutsideWorkspace() {
			t.Errorf("Provenance on an edge that runs nothing: %v", p)
		}
		return
	}
	var found bool
	for _, f := range p.GetFilesWritten() {
		if f.GetPath() == "/tmp/edgetest" {
			found = f.GetChange() == "created" && !f.GetInWorkspace()
		}
	}
	if !found || !p.GetFlags().GetFilesOutsideWorkspace() || !slices.Equal(p.GetPaths().GetWorkspace(), []string{"/work"}) {
		t.Errorf("Provenance after a write of /tmp/edgetest with workspace /work: files %v, flags %v, paths %v; want it created outside the workspace",
			p.GetFilesWritten(), p.GetFlags(), p.GetPaths())
	}
}
