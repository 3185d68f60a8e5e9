package trajectory

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/errdefs"
)

// fakeSource is a node of sandboxes and their network events.
type fakeSource struct {
	mu     sync.Mutex
	sbs    map[string]*dsecv1.Sandbox
	events map[string][]netpolicy.Event
}

func newSource() *fakeSource {
	return &fakeSource{sbs: map[string]*dsecv1.Sandbox{}, events: map[string][]netpolicy.Event{}}
}

func (f *fakeSource) add(id string, labels map[string]string, rules map[string]bool) {
	off := labels["off"] == "true"
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sbs[id] = &dsecv1.Sandbox{Id: id, Node: "n1", State: dsecv1.State_STATE_RUNNING,
		Spec: &dsecv1.SandboxSpec{Environment: "base:1", Labels: labels, NetworkRules: rules, NoTrajectory: off}}
}

func (f *fakeSource) remove(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.sbs, id)
}

func (f *fakeSource) event(id, verdict string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events[id] = append(f.events[id], netpolicy.Event{Time: time.Now(), SandboxID: id, Kind: "connect", Verdict: verdict,
		Proto: "tcp", Dest: netip.MustParseAddr("198.18.1.2"), Port: 80})
}

func (f *fakeSource) Get(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sbs[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	return sb, nil
}

func (f *fakeSource) NetworkLog(ctx context.Context, id string, since time.Time, limit int) ([]netpolicy.Event, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []netpolicy.Event
	for _, e := range f.events[id] {
		if e.Time.After(since) {
			out = append(out, e)
		}
	}
	return out, nil
}

func exec(r *Recorder, id, cmd string, stdout string, exit int32) {
	ctx := context.Background()
	s := r.Begin(ctx, id, "exec", &dsecv1.ExecRequest{SandboxId: id, Command: cmd})
	s.Event(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte(stdout)}})
	s.Event(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{ExitCode: exit}}})
	s.End(ctx, nil)
}

func parse(t *testing.T, data []byte) []Line {
	t.Helper()
	var out []Line
	for _, b := range bytes.Split(bytes.TrimSuffix(data, []byte("\n")), []byte("\n")) {
		var l Line
		if err := json.Unmarshal(b, &l); err != nil {
			t.Fatalf("line %q: %v", b, err)
		}
		out = append(out, l)
	}
	return out
}

func readAll(t *testing.T, r *Recorder, id string) *Read {
	t.Helper()
	rd, err := r.Read(context.Background(), id, 0, 0)
	if err != nil {
		t.Fatalf("read %s: %v", id, err)
	}
	return rd
}

// TestRecord: calls in order with their exits, outputs and hashes, the
// network events between them, an offset read, the end after Finish, the
// blob store's copy read once the node's is gone, a sandbox with
// recording off left out.
func TestRecord(t *testing.T) {
	ctx := context.Background()
	src := newSource()
	src.add("sb-1", map[string]string{"dsec.dev/project": "p1"}, map[string]bool{"pypi": true})
	src.add("sb-off", map[string]string{"off": "true"}, nil)
	blobs, err := blob.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{Dir: t.TempDir(), Blobs: blobs}, src)
	if err != nil {
		t.Fatal(err)
	}
	exec(r, "sb-1", "echo hi", "hi\n", 0)
	src.event("sb-1", "deny")
	exec(r, "sb-1", "false", "", 1)
	exec(r, "sb-off", "true", "", 0)
	first := readAll(t, r, "sb-1")
	lines := parse(t, first.Lines)
	var got []string
	for _, l := range lines {
		got = append(got, l.Type+":"+l.Call)
	}
	if want := "begin: call:exec net: call:exec"; fmt.Sprint(got) != "["+want+"]" {
		t.Errorf("lines %v, want [%s]", got, want)
	}
	hi := sha256.Sum256([]byte("hi\n"))
	if l := lines[1]; l.Stdout == nil || l.Stdout.Text != "hi\n" || l.Stdout.SHA256 != hex.EncodeToString(hi[:]) || *l.Exit != 0 {
		t.Errorf("the first exec: %+v", l)
	}
	if lines[0].Sandbox.Project != "p1" || first.Project != "p1" || first.Ended {
		t.Errorf("begin %+v, read %+v", lines[0].Sandbox, first)
	}
	if _, err := r.Read(ctx, "sb-off", 0, 0); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("a sandbox with recording off has a trajectory: %v", err)
	}

	src.event("sb-1", "allow")
	r.Finish(ctx, "sb-1", "deleted")
	src.remove("sb-1")
	r.Wait()
	done := readAll(t, r, "sb-1")
	rest, err := r.Read(ctx, "sb-1", first.NextOffset, 0)
	if err != nil {
		t.Fatal(err)
	}
	tail := parse(t, rest.Lines)
	if !done.Ended || len(tail) != 2 || tail[0].Type != TypeNet || tail[1].Type != TypeEnd || tail[1].End.Calls != 2 || tail[1].End.Net != 2 {
		t.Errorf("after Finish, from offset %d: %s", first.NextOffset, rest.Lines)
	}
	if err := os.Remove(r.path("sb-1")); err != nil {
		t.Fatal(err)
	}
	fromBlob := readAll(t, r, "sb-1")
	if fromBlob.SHA256 != done.SHA256 || !fromBlob.Ended {
		t.Errorf("the blob store's copy: sha %s ended %v, want %s", fromBlob.SHA256, fromBlob.Ended, done.SHA256)
	}
}

// TestCaps: output past MaxOutput is hashed and counted, lines past
// MaxBytes are degraded, calls past twice it only counted, and the file
// stays within its bound; the end says what was dropped.
func TestCaps(t *testing.T) {
	ctx := context.Background()
	src := newSource()
	src.add("sb-1", nil, nil)
	const maxBytes = 8 << 10
	r, err := New(Config{Dir: t.TempDir(), MaxBytes: maxBytes, MaxOutput: 100}, src)
	if err != nil {
		t.Fatal(err)
	}
	big := bytes.Repeat([]byte("y\n"), 1<<20)
	exec(r, "sb-1", "yes", string(big), 0)
	for i := range 500 {
		exec(r, "sb-1", fmt.Sprint("echo ", i), "0123456789", 0)
	}
	r.Finish(ctx, "sb-1", "deleted")
	rd := readAll(t, r, "sb-1")
	if rd.Size > 2*maxBytes+1024 {
		t.Errorf("the trajectory takes %d bytes, bound %d", rd.Size, maxBytes)
	}
	lines := parse(t, rd.Lines)
	sum := sha256.Sum256(big)
	if o := lines[1].Stdout; o.Bytes != int64(len(big)) || len(o.Text) != 100 || !o.Truncated || o.SHA256 != hex.EncodeToString(sum[:]) {
		t.Errorf("the big output: %d bytes, %d kept, truncated %v", o.Bytes, len(o.Text), o.Truncated)
	}
	end := lines[len(lines)-1].End
	var degraded int64
	for _, l := range lines {
		if l.Degraded {
			degraded++
			if l.Stdout.Text != "" || l.Stdout.SHA256 == "" {
				t.Errorf("a degraded line: %+v", l.Stdout)
			}
		}
	}
	if degraded == 0 || end.Dropped.Degraded != degraded || end.Dropped.Calls == 0 || end.Calls+end.Dropped.Calls != 501 ||
		end.Dropped.OutputBytes < int64(len(big))-100 {
		t.Errorf("end %+v with %d degraded lines", end, degraded)
	}
}

// TestSweep: a trajectory left open by an earlier instance of the node,
// whose sandbox is gone, is ended; one past its retention is removed.
func TestSweep(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	src := newSource()
	src.add("sb-1", nil, nil)
	r, err := New(Config{Dir: dir, Retention: time.Hour}, src)
	if err != nil {
		t.Fatal(err)
	}
	exec(r, "sb-1", "true", "", 0)
	// The node restarts; the sandbox ends meanwhile.
	r.Close()
	src.remove("sb-1")
	r2, err := New(Config{Dir: dir, Retention: time.Hour}, src)
	if err != nil {
		t.Fatal(err)
	}
	r2.Sweep(ctx)
	rd := readAll(t, r2, "sb-1")
	lines := parse(t, rd.Lines)
	if !rd.Ended || lines[len(lines)-1].End.Reason != "gone" || lines[len(lines)-1].End.Calls != 1 || lines[len(lines)-1].Seq != 3 {
		t.Errorf("after the sweep: %s", rd.Lines)
	}
	old := time.Now().Add(-2 * time.Hour)
	if err := os.Chtimes(r2.path("sb-1"), old, old); err != nil {
		t.Fatal(err)
	}
	r2.Sweep(ctx)
	if _, err := r2.Read(ctx, "sb-1", 0, 0); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("a trajectory past its retention: %v", err)
	}
}
