// Package backendtest is the conformance suite every backend.Runtime runs,
// fakes included: call Run from the implementation's tests with a
// constructor of runtimes over a root directory. It checks the lifecycle
// the interface documents (start, reach the agent, status, list, delete,
// idempotency, error kinds, a daemon restart, concurrency) and, where the
// runtime's Features claim them, pause and snapshot support.
//
// The suite reaches each agent through the runtime's dialer with package
// agentclient and pings it: the agent a runtime starts must serve the
// agent protocol (the real dsec-agent, or the fake's in-process one), and
// the connections a dialer opens must end when the agent does (the edge
// learns of a dead agent from its watch connection's end).
package backendtest

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/agent/execwire"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// NewFunc returns a new runtime over root, not yet Init'ed. The suite calls
// it with a fresh empty root per test, and again with the same root to play
// a restarted daemon: the second runtime must find what the first made.
// The suite deletes every sandbox and tears the runtime down itself when
// the test ends; what NewFunc registers with t.Cleanup must not be needed
// for that (an instance opened midway has its cleanups run first).
type NewFunc func(t *testing.T, root string) backend.Runtime

// answerWithin bounds how long a started agent may take to answer.
const answerWithin = 15 * time.Second

// Run runs the suite. layers are the read-only layers every sandbox starts
// on (bottom first), a root file system the runtime's agent runs in, each
// described with what the runtime needs of it (DirLayers for mounted
// dirs); runtimes that start nothing may get nil.
func Run(t *testing.T, layers []backend.Layer, newRuntime NewFunc) {
	tests := []struct {
		name string
		fn   func(t *testing.T, n *node)
	}{
		{"Features", testFeatures},
		{"Lifecycle", testLifecycle},
		{"DeleteIsIdempotent", testDeleteIdempotent},
		{"UnknownID", testUnknownID},
		{"StartExistingID", testStartExisting},
		{"InvalidSpecs", testInvalidSpecs},
		{"Restart", testRestart},
		{"ConcurrentStarts", testConcurrentStarts},
		{"Pause", testPause},
		{"Capture", testCapture},
		{"Usage", testUsage},
	}
	if len(layers) == 0 {
		layers = DirLayers("/nonexistent-lower")
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			n := &node{t: t, root: root, layers: layers, newRuntime: newRuntime}
			n.rt = n.open()
			// Registered after newRuntime's own cleanups, so it runs first.
			t.Cleanup(n.cleanup)
			tc.fn(t, n)
		})
	}
}

// DirLayers describes dirs (bottom first) as layers of plain trees
// mounted there, as the edge hands a runtime layers extracted from tars.
func DirLayers(dirs ...string) []backend.Layer {
	layers := make([]backend.Layer, len(dirs))
	for i, d := range dirs {
		layers[i] = backend.Layer{Digest: fmt.Sprintf("sha256:dir%d", i), FSType: backend.FSTypeDir, Dir: d}
	}
	return layers
}

// node is one root under test and the runtime instances opened over it.
type node struct {
	t          *testing.T
	root       string
	layers     []backend.Layer
	newRuntime NewFunc
	rt         backend.Runtime // the current instance
	mu         sync.Mutex      // guards started
	started    []string        // every ID a Start was tried with
	clients    []agentclient.Client
}

// open makes and inits a new runtime instance over the node's root.
func (n *node) open() backend.Runtime {
	n.t.Helper()
	rt := n.newRuntime(n.t, n.root)
	if err := rt.Init(context.Background()); err != nil {
		n.t.Fatalf("Init: %v", err)
	}
	return rt
}

// cleanup deletes whatever the test left, even when it failed, then tears
// the runtime down and checks that nothing is left.
func (n *node) cleanup() {
	t, ctx := n.t, context.Background()
	for _, c := range n.clients {
		c.Close()
	}
	n.mu.Lock()
	ids := slices.Clone(n.started)
	n.mu.Unlock()
	listed, err := n.rt.List(ctx)
	if err != nil {
		t.Errorf("cleanup: List: %v", err)
	}
	for _, id := range append(ids, listed...) {
		if p, ok := n.rt.(backend.Pauser); ok && n.rt.Features().Pause {
			_ = p.Thaw(ctx, id) // a check that failed midway may leave it frozen
		}
		if err := n.rt.Delete(ctx, id); err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("cleanup: Delete %s: %v", id, err)
		}
	}
	if left, err := n.rt.List(ctx); err != nil || len(left) > 0 {
		t.Errorf("cleanup: after deleting everything List = %v, %v", left, err)
	}
	if err := n.rt.Teardown(ctx); err != nil {
		t.Errorf("cleanup: Teardown: %v", err)
	}
}

var seq struct {
	sync.Mutex
	n int
}

// spec returns a valid spec of a new ID and remembers the ID for cleanup.
func (n *node) spec(name string) backend.Spec {
	seq.Lock()
	seq.n++
	id := fmt.Sprintf("rtt-%s-%d", name, seq.n)
	seq.Unlock()
	n.remember(id)
	return backend.Spec{
		ID:          id,
		Layers:      n.layers,
		DiskBytes:   64 << 20,
		CPUs:        0.5,
		MemoryBytes: 256 << 20,
		Pids:        256,
		Hostname:    id,
		LogPath:     filepath.Join(n.root, id+".log"),
	}
}

func (n *node) remember(id string) {
	n.mu.Lock()
	n.started = append(n.started, id)
	n.mu.Unlock()
}

// start starts s and returns its dialer.
func (n *node) start(s backend.Spec) backend.Dialer {
	n.t.Helper()
	dial, err := n.rt.Start(context.Background(), s)
	if err != nil {
		n.t.Fatalf("Start %s: %v", s.ID, err)
	}
	if dial == nil {
		n.t.Fatalf("Start %s returned no dialer", s.ID)
	}
	return dial
}

// client is an agent client over dial, closed when the test ends.
func (n *node) client(dial backend.Dialer) agentclient.Client {
	c := agentclient.New(dial)
	n.mu.Lock()
	n.clients = append(n.clients, c)
	n.mu.Unlock()
	return c
}

// ping asks the agent once, waiting at most d.
func ping(c agentclient.Client, d time.Duration) (*agentv1.PingResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	resp, err := c.Ping(ctx, connect.NewRequest(&agentv1.PingRequest{}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// answers waits until the agent behind dial answers a ping.
func (n *node) answers(id string, dial backend.Dialer) {
	n.t.Helper()
	c := n.client(dial)
	deadline := time.Now().Add(answerWithin)
	for {
		_, err := ping(c, time.Second)
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("agent of %s did not answer within %s: %v", id, answerWithin, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// silent checks that the agent behind dial does not answer now.
func (n *node) silent(id, why string, dial backend.Dialer) {
	n.t.Helper()
	if _, err := ping(n.client(dial), 300*time.Millisecond); err == nil {
		n.t.Errorf("agent of %s answered %s", id, why)
	}
}

func (n *node) running(id string) backend.Status {
	n.t.Helper()
	st, err := n.rt.Status(context.Background(), id)
	if err != nil {
		n.t.Fatalf("Status %s: %v", id, err)
	}
	if !st.Running || st.Pid <= 0 {
		n.t.Fatalf("Status %s = %+v, want running with a pid", id, st)
	}
	return st
}

// gone checks that the runtime no longer knows id.
func (n *node) gone(id string) {
	n.t.Helper()
	ctx := context.Background()
	if st, err := n.rt.Status(ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
		n.t.Errorf("Status of deleted %s = %+v, %v; want not found", id, st, err)
	}
	if ids := n.list(); slices.Contains(ids, id) {
		n.t.Errorf("List after Delete of %s = %v", id, ids)
	}
	if _, err := n.rt.Channel(id); !errors.Is(err, errdefs.ErrNotFound) {
		n.t.Errorf("Channel of deleted %s: %v, want not found", id, err)
	}
}

func (n *node) list() []string {
	n.t.Helper()
	ids, err := n.rt.List(context.Background())
	if err != nil {
		n.t.Fatalf("List: %v", err)
	}
	return ids
}

func (n *node) delete(id string) {
	n.t.Helper()
	if err := n.rt.Delete(context.Background(), id); err != nil {
		n.t.Fatalf("Delete %s: %v", id, err)
	}
}

// testFeatures: a runtime implements the interfaces of what it claims.
func testFeatures(t *testing.T, n *node) {
	f := n.rt.Features()
	if _, ok := n.rt.(backend.Pauser); f.Pause && !ok {
		t.Errorf("Features say Pause, but %T is no backend.Pauser", n.rt)
	}
	if _, ok := n.rt.(backend.Snapshotter); f.Snapshot && !ok {
		t.Errorf("Features say Snapshot, but %T is no backend.Snapshotter", n.rt)
	}
	if f.Snapshot && !f.Pause {
		t.Errorf("Features say Snapshot without Pause: a capture needs the sandbox frozen")
	}
	if n.rt.Features() != f {
		t.Errorf("Features changed between calls")
	}
}

// testLifecycle: start, the agent answers and holds a watch connection,
// status, list, delete, gone, and the watch ended.
func testLifecycle(t *testing.T, n *node) {
	s := n.spec("life")
	dial := n.start(s)
	n.answers(s.ID, dial)
	watched := make(chan error, 1)
	go func() { watched <- n.client(dial).Watch(context.Background()) }()
	n.running(s.ID)
	if ids := n.list(); !slices.Contains(ids, s.ID) {
		t.Errorf("List = %v, want %s in it", ids, s.ID)
	}
	again, err := n.rt.Channel(s.ID)
	if err != nil {
		t.Fatalf("Channel %s: %v", s.ID, err)
	}
	n.answers(s.ID, again)
	select {
	case err := <-watched:
		t.Fatalf("the watch of a running agent ended: %v", err)
	default:
	}
	n.delete(s.ID)
	n.gone(s.ID)
	n.silent(s.ID, "after Delete", dial)
	select {
	case err := <-watched:
		if errors.Is(err, execwire.ErrNotWatched) {
			t.Errorf("the agent holds no watch connection: %v", err)
		}
	case <-time.After(answerWithin):
		t.Errorf("the watch of %s did not end within %s of its Delete", s.ID, answerWithin)
	}
}

// testDeleteIdempotent: a second Delete, and one of an ID never started,
// succeed.
func testDeleteIdempotent(t *testing.T, n *node) {
	s := n.spec("twice")
	n.answers(s.ID, n.start(s))
	n.delete(s.ID)
	n.delete(s.ID)
	n.gone(s.ID)
	n.delete("rtt-never-started")
}

// testUnknownID: Status and Channel of an ID the runtime never saw are
// not found; List of an empty runtime is empty.
func testUnknownID(t *testing.T, n *node) {
	if ids := n.list(); len(ids) != 0 {
		t.Errorf("List of a new runtime = %v", ids)
	}
	for _, id := range []string{"rtt-unknown", "../bad"} {
		if st, err := n.rt.Status(context.Background(), id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Status %q = %+v, %v; want not found", id, st, err)
		}
		if _, err := n.rt.Channel(id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Channel %q: %v, want not found", id, err)
		}
	}
}

// testStartExisting: a Start of an ID in use is refused with
// AlreadyExists and leaves the running sandbox alone.
func testStartExisting(t *testing.T, n *node) {
	s := n.spec("dup")
	dial := n.start(s)
	n.answers(s.ID, dial)
	if _, err := n.rt.Start(context.Background(), s); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("second Start of %s: %v, want already exists", s.ID, err)
	}
	n.running(s.ID)
	n.answers(s.ID, dial)
}

// testInvalidSpecs: specs no runtime can start are refused with
// InvalidArgument and leave nothing behind.
func testInvalidSpecs(t *testing.T, n *node) {
	for _, tc := range []struct {
		name string
		edit func(*backend.Spec)
	}{
		{"empty id", func(s *backend.Spec) { s.ID = "" }},
		{"id with a slash", func(s *backend.Spec) { s.ID = "../escape" }},
		{"id too long", func(s *backend.Spec) { s.ID = strings.Repeat("x", 200) }},
		{"no layer", func(s *backend.Spec) { s.Layers = nil }},
		{"relative layer dir", func(s *backend.Spec) { s.Layers = DirLayers("layers/base") }},
		{"relative layer file", func(s *backend.Spec) {
			s.Layers = []backend.Layer{{Digest: "sha256:00", File: "layers/base.erofs", FSType: backend.FSTypeEROFS}}
		}},
		{"unknown layer type", func(s *backend.Spec) {
			s.Layers = []backend.Layer{{Digest: "sha256:00", Dir: "/layers/base", FSType: "ext2"}}
		}},
		{"layer without file or dir", func(s *backend.Spec) {
			s.Layers = []backend.Layer{{Digest: "sha256:00", FSType: backend.FSTypeEROFS}}
		}},
		{"no log path", func(s *backend.Spec) { s.LogPath = "" }},
		{"negative memory", func(s *backend.Spec) { s.MemoryBytes = -1 }},
		{"negative cpus", func(s *backend.Spec) { s.CPUs = -0.5 }},
		{"negative disk", func(s *backend.Spec) { s.DiskBytes = -1 }},
		{"negative pids", func(s *backend.Spec) { s.Pids = -1 }},
		{"hostname too long", func(s *backend.Spec) { s.Hostname = strings.Repeat("h", 65) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := n.spec("bad")
			tc.edit(&s)
			n.remember(s.ID)
			if _, err := n.rt.Start(context.Background(), s); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Start: %v, want invalid argument", err)
			}
		})
	}
	if ids := n.list(); len(ids) != 0 {
		t.Errorf("refused starts left %v", ids)
	}
}

// testRestart: a new runtime over the same root, as a restarted daemon
// makes, inits while sandboxes run and lists, inspects, reaches and
// deletes what the first started.
func testRestart(t *testing.T, n *node) {
	a, b := n.spec("restart-a"), n.spec("restart-b")
	n.answers(a.ID, n.start(a))
	n.answers(b.ID, n.start(b))
	n.rt = n.open()
	n.running(a.ID)
	ids := n.list()
	for _, id := range []string{a.ID, b.ID} {
		if !slices.Contains(ids, id) {
			t.Errorf("List after a restart = %v, want %s in it", ids, id)
		}
		dial, err := n.rt.Channel(id)
		if err != nil {
			t.Fatalf("Channel %s after a restart: %v", id, err)
		}
		n.answers(id, dial)
	}
	n.delete(a.ID)
	n.gone(a.ID)
	n.running(b.ID)
	// And once more, with a sandbox the second instance started.
	c := n.spec("restart-c")
	n.answers(c.ID, n.start(c))
	n.rt = n.open()
	for _, id := range []string{b.ID, c.ID} {
		n.running(id)
		n.delete(id)
		n.gone(id)
	}
}

// testConcurrentStarts: Starts of different IDs at once all succeed and
// each agent answers.
func testConcurrentStarts(t *testing.T, n *node) {
	const k = 4
	specs := make([]backend.Spec, k)
	dials := make([]backend.Dialer, k)
	errs := make([]error, k)
	for i := range specs {
		specs[i] = n.spec(fmt.Sprintf("conc%d", i))
	}
	var wg sync.WaitGroup
	for i := range specs {
		wg.Go(func() { dials[i], errs[i] = n.rt.Start(context.Background(), specs[i]) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("concurrent Start %s: %v", specs[i].ID, err)
		}
	}
	for i, s := range specs {
		n.answers(s.ID, dials[i])
		n.running(s.ID)
	}
	ids := n.list()
	for _, s := range specs {
		if !slices.Contains(ids, s.ID) {
			t.Errorf("List = %v, want %s in it", ids, s.ID)
		}
	}
	for _, s := range specs {
		wg.Go(func() {
			if err := n.rt.Delete(context.Background(), s.ID); err != nil {
				t.Errorf("concurrent Delete %s: %v", s.ID, err)
			}
		})
	}
	wg.Wait()
	for _, s := range specs {
		n.gone(s.ID)
	}
}

// testPause: where the runtime can pause, a frozen sandbox's agent does not
// answer until thawed, a pause survives a restart, and a frozen sandbox
// can be deleted. A runtime that cannot pause says so (the edge refuses
// pauses of its sandboxes).
func testPause(t *testing.T, n *node) {
	if !n.rt.Features().Pause {
		t.Skipf("%T cannot pause (Features)", n.rt)
	}
	ctx := context.Background()
	p := n.rt.(backend.Pauser)
	s := n.spec("pause")
	dial := n.start(s)
	n.answers(s.ID, dial)

	if err := p.Freeze(ctx, s.ID); err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	if frozen, err := p.Frozen(ctx, s.ID); err != nil || !frozen {
		t.Fatalf("Frozen after Freeze = %v, %v", frozen, err)
	}
	n.silent(s.ID, "while frozen", dial)
	if err := p.Thaw(ctx, s.ID); err != nil {
		t.Fatalf("Thaw: %v", err)
	}
	if frozen, err := p.Frozen(ctx, s.ID); err != nil || frozen {
		t.Fatalf("Frozen after Thaw = %v, %v", frozen, err)
	}
	n.answers(s.ID, dial)

	if _, err := p.Pause(ctx, s.ID, true); err != nil {
		t.Fatalf("Pause with reclaim: %v", err)
	}
	n.rt = n.open()
	p = n.rt.(backend.Pauser)
	if frozen, err := p.Frozen(ctx, s.ID); err != nil || !frozen {
		t.Fatalf("Frozen after a pause and a restart = %v, %v", frozen, err)
	}
	// Paused is running to the edge; a microVM paused to disk has no
	// process, so no pid.
	if st, err := n.rt.Status(ctx, s.ID); err != nil || !st.Running {
		t.Fatalf("Status after a pause and a restart = %+v, %v; want running", st, err)
	}
	if _, err := p.Resume(ctx, s.ID, true); err != nil {
		t.Fatalf("Resume with prefetch: %v", err)
	}
	n.answers(s.ID, dial)

	// A paused sandbox is deleted like any other.
	if _, err := p.Pause(ctx, s.ID, false); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	n.delete(s.ID)
	n.gone(s.ID)
	if err := p.Freeze(ctx, s.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Freeze of a deleted sandbox: %v, want not found", err)
	}
}

// testCapture: where Features say Snapshot, a frozen sandbox's writable
// layer is captured into a directory of its own, which Remove deletes; a
// second capture of a name in use is refused (AlreadyExists) and leaves the
// first alone; an unknown sandbox is NotFound and a bad name
// InvalidArgument; a capture an earlier instance left is gone once a new
// one is Init'ed; the sandbox answers again once thawed.
func testCapture(t *testing.T, n *node) {
	if !n.rt.Features().Snapshot {
		t.Skipf("%T has no snapshots (Features)", n.rt)
	}
	ctx := context.Background()
	p, sn := n.rt.(backend.Pauser), n.rt.(backend.Snapshotter)
	s := n.spec("capture")
	dial := n.start(s)
	n.answers(s.ID, dial)

	if err := p.Freeze(ctx, s.ID); err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	tree, err := sn.Capture(ctx, s.ID, "one")
	if err != nil {
		t.Fatalf("Capture of a frozen sandbox: %v", err)
	}
	if fi, err := os.Stat(tree.Dir); err != nil || !fi.IsDir() {
		t.Errorf("the capture's dir %s: %v, want a directory", tree.Dir, err)
	}
	if _, err := sn.Capture(ctx, s.ID, "one"); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("Capture of a name in use: %v, want already exists", err)
	}
	if _, err := os.Stat(tree.Dir); err != nil {
		t.Errorf("the first capture after a refused second: %v", err)
	}
	left, err := sn.Capture(ctx, s.ID, "left")
	if err != nil {
		t.Fatalf("Capture under a second name: %v", err)
	}
	if err := p.Thaw(ctx, s.ID); err != nil {
		t.Fatalf("Thaw: %v", err)
	}
	n.answers(s.ID, dial)
	if err := tree.Remove(); err != nil {
		t.Errorf("Remove the capture: %v", err)
	}
	if _, err := os.Stat(tree.Dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the capture's dir after Remove: %v, want not found", err)
	}
	if _, err := sn.Capture(ctx, "rtt-unknown", "one"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Capture of an unknown sandbox: %v, want not found", err)
	}
	if _, err := sn.Capture(ctx, s.ID, "../x"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Capture named ../x: %v, want invalid argument", err)
	}

	n.rt = n.open()
	if _, err := os.Stat(left.Dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a capture an earlier instance left, after Init: %v, want gone", err)
	}
	n.running(s.ID)
	n.delete(s.ID)
	n.gone(s.ID)
}

// testUsage: a runtime that meters its sandboxes (a Meter) reports a
// running one's memory and disk limits as its spec set them and some
// memory in use, and NotFound once it is deleted or for an ID it never
// started.
func testUsage(t *testing.T, n *node) {
	m, ok := n.rt.(backend.Meter)
	if !ok {
		t.Skipf("%T does not meter its sandboxes (no Meter)", n.rt)
	}
	ctx := context.Background()
	s := n.spec("usage")
	n.answers(s.ID, n.start(s))
	u, err := m.Usage(ctx, s.ID)
	if err != nil {
		t.Fatalf("Usage: %v", err)
	}
	if u.MemoryLimit != s.MemoryBytes {
		t.Errorf("Usage's memory limit = %d, want the spec's %d", u.MemoryLimit, s.MemoryBytes)
	}
	if u.DiskLimit != s.DiskBytes {
		t.Errorf("Usage's disk limit = %d, want the spec's %d", u.DiskLimit, s.DiskBytes)
	}
	if u.MemoryBytes <= 0 {
		t.Errorf("Usage's memory = %d with the agent running, want more than 0", u.MemoryBytes)
	}
	n.delete(s.ID)
	if _, err := m.Usage(ctx, s.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Usage of a deleted sandbox: %v, want not found", err)
	}
	if _, err := m.Usage(ctx, "rtt-unknown"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Usage of an unknown sandbox: %v, want not found", err)
	}
}
