package backendtest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"dsec.dev/dsec/internal/agent/execwire"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

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
// status, list, a second Start of the ID is refused (AlreadyExists) and
// leaves the sandbox alone, delete, gone, the watch ended, and Delete
// again, or of an ID never started, succeeds.
func testLifecycle(t *testing.T, n *node) {
	s := n.spec("life")
	sb := n.startSandbox(s)
	watched := make(chan error, 1)
	go func() { watched <- sb.c.Watch(context.Background()) }()
	n.running(s.ID)
	if ids := n.list(); !slices.Contains(ids, s.ID) {
		t.Errorf("List = %v, want %s in it", ids, s.ID)
	}
	again, err := n.rt.Channel(s.ID)
	if err != nil {
		t.Fatalf("Channel %s: %v", s.ID, err)
	}
	n.answers(s.ID, again)
	if _, err := n.rt.Start(context.Background(), s); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("second Start of %s: %v, want already exists", s.ID, err)
	}
	n.running(s.ID)
	n.answers(s.ID, sb.dial)
	if !n.o.NoCommands {
		if got := sb.must(t, "echo hello; hostname"); got != "hello\n"+s.Hostname {
			t.Errorf("echo hello; hostname: %q, want hello and %s", got, s.Hostname)
		}
	}
	select {
	case err := <-watched:
		t.Fatalf("the watch of a running agent ended: %v", err)
	default:
	}
	n.delete(s.ID)
	n.gone(s.ID)
	n.silent(s.ID, "after Delete", sb.dial)
	select {
	case err := <-watched:
		if errors.Is(err, execwire.ErrNotWatched) {
			t.Errorf("the agent holds no watch connection: %v", err)
		}
	case <-time.After(n.o.boot()):
		t.Errorf("the watch of %s did not end within %s of its Delete", s.ID, n.o.boot())
	}
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
// makes, inits while sandboxes run and lists, inspects, reaches, meters,
// resumes and deletes what the first started, paused (where Features say
// Pause) or not; and once more with a sandbox the second instance started.
func testRestart(t *testing.T, n *node) {
	ctx := context.Background()
	a, b := n.spec("restart-a"), n.spec("restart-b")
	sa, sbb := n.startSandbox(a), n.startSandbox(b)
	if !n.o.NoCommands {
		sa.must(t, "echo a > /root/mark")
		sbb.must(t, "echo b > /root/mark")
	}
	paused := n.pauser() != nil
	if paused {
		if _, err := n.pauser().Pause(ctx, b.ID, false); err != nil {
			t.Fatalf("Pause %s: %v", b.ID, err)
		}
	}
	n.rt = n.open()
	ids := n.list()
	for _, id := range []string{a.ID, b.ID} {
		if !slices.Contains(ids, id) {
			t.Errorf("List after a restart = %v, want %s in it", ids, id)
		}
		n.running(id)
		if m, ok := n.rt.(backend.Meter); ok {
			if u, err := m.Usage(ctx, id); err != nil || u.MemoryLimit != a.MemoryBytes {
				t.Errorf("Usage of %s after a restart = %+v, %v; want its memory limit %d", id, u, err, a.MemoryBytes)
			}
		}
	}
	dialA, err := n.rt.Channel(a.ID)
	if err != nil {
		t.Fatalf("Channel %s after a restart: %v", a.ID, err)
	}
	sa = &sandbox{n: n, spec: a, dial: dialA, c: n.answers(a.ID, dialA)}
	dialB, err := n.rt.Channel(b.ID)
	if err != nil {
		t.Fatalf("Channel %s after a restart: %v", b.ID, err)
	}
	if paused {
		n.frozen(t, b.ID, true)
		n.silent(b.ID, "paused, after a restart", dialB)
		if _, err := n.pauser().Resume(ctx, b.ID, true); err != nil {
			t.Fatalf("Resume %s after a restart: %v", b.ID, err)
		}
		n.frozen(t, b.ID, false)
	}
	sbb = &sandbox{n: n, spec: b, dial: dialB, c: n.answers(b.ID, dialB)}
	if !n.o.NoCommands {
		if got := sa.must(t, "cat /root/mark"); got != "a" {
			t.Errorf("%s after a restart: /root/mark = %q, want a", a.ID, got)
		}
		if got := sbb.must(t, "cat /root/mark"); got != "b" {
			t.Errorf("%s after a pause and a restart: /root/mark = %q, want b", b.ID, got)
		}
	}
	n.delete(a.ID)
	n.gone(a.ID)
	n.running(b.ID)

	c := n.spec("restart-c")
	n.startSandbox(c)
	if paused {
		if _, err := n.pauser().Pause(ctx, c.ID, true); err != nil {
			t.Fatalf("Pause %s: %v", c.ID, err)
		}
	}
	n.rt = n.open()
	for _, id := range []string{b.ID, c.ID} {
		n.running(id)
		n.delete(id) // c paused: deleted like any other
		n.gone(id)
	}
	if p := n.pauser(); p != nil {
		if err := p.Freeze(ctx, c.ID); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Freeze of a deleted sandbox: %v, want not found", err)
		}
	}
}

// testConcurrentStarts: Starts of different IDs at once all succeed and
// each agent answers; Deletes at once all succeed.
func testConcurrentStarts(t *testing.T, n *node) {
	const k = 3
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
