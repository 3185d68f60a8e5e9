// Package backendtest is the conformance suite every backend.Runtime runs,
// fakes included: call Run from the implementation's tests with Options
// saying what differs for it. It checks
//
//   - the lifecycle the interface documents (start, reach the agent,
//     status, list, delete, idempotency, error kinds, concurrent starts);
//   - a daemon restart: a second instance over the same configuration, Init
//     called again, lists, reaches, meters, resumes and deletes what the
//     first started, running or paused;
//   - the limits of a Spec: memory (a process allocating past MemoryBytes is
//     OOM-killed and the agent lives on), pids (forks stop at Pids), disk
//     (writes past DiskBytes fail with ENOSPC or EDQUOT, and Usage sees the
//     writable layer full), CPU (CPUs caps the time a busy sandbox gets,
//     measured as a ratio of its CPU time to the wall time in the run);
//   - the network contract of Features.Network: with it, a sandbox started
//     in a network namespace the suite makes reaches a test host beside it
//     and reads the spec's resolv.conf, one started without has loopback
//     only, and a namespace that does not exist fails the Start; without
//     it, a spec that names a namespace or a resolv.conf is refused with
//     errdefs.ErrNotSupported;
//   - where Features say Pause: freeze and thaw, pause with and without
//     reclaim, a process's memory and a /dev/shm file kept across a pause
//     and a restart, exec after Resume;
//   - where Features say Snapshot: Capture, its error kinds, what a capture
//     holds (a file written, a file deleted as overlayfs's whiteout);
//   - where the runtime is a Meter: Usage's limits, memory and disk in use,
//     CPU time, and NotFound for a sandbox it does not know.
//
// The suite reaches each agent through the runtime's dialer with package
// agentclient: the agent a runtime starts must serve the agent protocol
// (the real dsec-agent, or the fake's in-process one), and the connections
// a dialer opens must end when the agent does (the edge learns of a dead
// agent from its watch connection's end). Checks that run commands need a
// root file system with busybox (sh and its applets on PATH) and the real
// agent at Options.AgentPath; a runtime whose agent runs no commands says
// so (Options.NoCommands) and those checks skip.
//
// Sandboxes are shared where the contract allows (the limits' checks run
// one after the other in one sandbox, the memory check last), so a backend
// whose sandboxes take seconds to boot runs about ten boots in all.
package backendtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// NewFunc returns a new runtime over root, not yet Init'ed. The suite calls
// it with a fresh empty root per group of checks, and again with the same
// root to play a restarted daemon: the second runtime must find what the
// first made. The suite deletes every sandbox and tears the runtime down
// itself when the group ends; what NewFunc registers with t.Cleanup must not
// be needed for that (an instance opened midway has its cleanups run first).
type NewFunc func(t *testing.T, root string) backend.Runtime

// Options is what differs between the backends the suite runs against.
type Options struct {
	// New makes the runtimes under test.
	New NewFunc
	// Layers are the read-only layers every sandbox starts on (bottom
	// first), each described with what the runtime needs of it (DirLayers
	// for mounted dirs): a root file system the runtime's agent runs in,
	// with busybox unless NoCommands. Runtimes that start nothing may leave
	// it nil.
	Layers []backend.Layer
	// Boot bounds how long a started sandbox's agent may take to answer
	// its first ping, and a dead one to be seen dead; 0 means 15 s. A VM
	// under TCG needs its boot time and some.
	Boot time.Duration
	// Parallel is how many groups of checks run at once; 0 means 1. Each
	// group has a root and runtime instances of its own, so more than one
	// is for runtimes whose instances over different roots do not share
	// host state one's Teardown removes.
	Parallel int
	// NoCommands says the runtime's agent runs no commands (package fake's
	// answers Ping and holds watch connections, nothing else): the checks
	// that run commands in a sandbox skip, saying so. Every backend that
	// starts a real agent runs them.
	NoCommands bool
	// AgentPath is the agent binary's path inside a sandbox; "" means
	// /.dsec/bin/dsec-agent. The memory and pause checks run its
	// hold-memory mode.
	AgentPath string
	// Deviations are the differences from the contract a backend documents;
	// the suite checks the documented behaviour in their place.
	Deviations Deviations
}

// Deviations are documented differences from the contract. Each names the
// backend documentation that states it.
type Deviations struct {
	// OOMKillsSandbox: a sandbox that runs out of Spec.MemoryBytes dies
	// whole, agent included, instead of losing only the process that
	// allocated. gVisor: the limit is on the host cgroup of the sentry and
	// the gofer, and the host's OOM killer kills the sentry (docs/gvisor.md).
	// The suite checks that the sandbox then stops running, that Status
	// counts the OOM kill and names its memory in Reason (what the edge
	// fails it with: REASON_OOM), and that Delete removes it.
	OOMKillsSandbox bool
	// StatfsNoLimit: statfs of / inside a sandbox reports the file system
	// that holds its writable layer, not its disk limit (gVisor: the
	// agent's statfs answer needs the host's qgroup file, which the sentry
	// does not show). The suite checks the size is no more than
	// Usage.DiskSize instead.
	StatfsNoLimit bool
	// OwnResolvConf: a networked sandbox's /etc/resolv.conf is the
	// runtime's own, not Spec.ResolvConf. microvm: the guest names
	// vmnet.DNSAddr, which the sandbox's namespace hands to the edge's
	// resolver (package microvm's doc). The suite checks that it names a
	// nameserver.
	OwnResolvConf bool
}

func (o Options) boot() time.Duration {
	if o.Boot > 0 {
		return o.Boot
	}
	return 15 * time.Second
}

func (o Options) agentPath() string {
	if o.AgentPath != "" {
		return o.AgentPath
	}
	return "/.dsec/bin/dsec-agent"
}

// group is a set of checks run on one root.
type group struct {
	name string
	fn   func(t *testing.T, n *node)
}

// Run runs the suite.
func Run(t *testing.T, o Options) {
	if o.New == nil {
		t.Fatal("backendtest.Options.New is nil")
	}
	if len(o.Layers) == 0 {
		o.Layers = DirLayers("/nonexistent-lower")
	}
	groups := []group{
		{"Features", testFeatures},
		{"Lifecycle", testLifecycle},
		{"UnknownID", testUnknownID},
		{"InvalidSpecs", testInvalidSpecs},
		{"Restart", testRestart},
		{"ConcurrentStarts", testConcurrentStarts},
		{"Pause", testPause},
		{"Capture", testCapture},
		{"Limits", testLimits},
		{"Network", testNetwork},
	}
	sem := make(chan struct{}, max(o.Parallel, 1))
	for _, g := range groups {
		t.Run(g.name, func(t *testing.T) {
			if o.Parallel > 1 {
				t.Parallel() // the groups run once the caller's test returns
			}
			sem <- struct{}{}
			t.Cleanup(func() { <-sem })
			n := &node{t: t, root: t.TempDir(), o: o}
			n.rt = n.open()
			// Registered after New's own cleanups, so it runs first.
			t.Cleanup(n.cleanup)
			g.fn(t, n)
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
	t       *testing.T
	root    string
	o       Options
	rt      backend.Runtime // the current instance
	mu      sync.Mutex      // guards started and clients
	started []string        // every ID a Start was tried with
	clients []agentclient.Client
}

// open makes and inits a new runtime instance over the node's root.
func (n *node) open() backend.Runtime {
	n.t.Helper()
	rt := n.o.New(n.t, n.root)
	if err := rt.Init(context.Background()); err != nil {
		n.t.Fatalf("Init: %v", err)
	}
	return rt
}

// cleanup deletes whatever the group left, even when it failed, then tears
// the runtime down and checks that nothing is left.
func (n *node) cleanup() {
	t, ctx := n.t, context.Background()
	n.mu.Lock()
	ids := slices.Clone(n.started)
	for _, c := range n.clients {
		c.Close()
	}
	n.mu.Unlock()
	if t.Failed() {
		n.logTails(ids)
	}
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

// logTails logs the end of each sandbox's log (Spec.LogPath: the agent's
// output, a VM's console), for a group that failed.
func (n *node) logTails(ids []string) {
	for _, id := range ids {
		b, err := os.ReadFile(filepath.Join(n.root, id+".log"))
		if err != nil || len(b) == 0 {
			continue
		}
		n.t.Logf("the log of %s ends:\n%s", id, b[max(0, len(b)-2048):])
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
		Layers:      n.o.Layers,
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

// client is an agent client over dial, closed when the group ends.
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

// answers waits until the agent behind dial answers a ping, and returns a
// client of it.
func (n *node) answers(id string, dial backend.Dialer) agentclient.Client {
	n.t.Helper()
	c := n.client(dial)
	boot := n.o.boot()
	deadline := time.Now().Add(boot)
	for {
		_, err := ping(c, time.Second)
		if err == nil {
			return c
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("agent of %s did not answer within %s: %v", id, boot, err)
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
	// Paused is running to the edge; a sandbox paused to disk (a microVM's)
	// has no process, so no pid.
	if !st.Running || (st.Pid <= 0 && !n.paused(id)) {
		n.t.Fatalf("Status %s = %+v, want running with a pid", id, st)
	}
	return st
}

// paused reports whether the runtime pauses and says id is frozen.
func (n *node) paused(id string) bool {
	p := n.pauser()
	if p == nil {
		return false
	}
	frozen, err := p.Frozen(context.Background(), id)
	return err == nil && frozen
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

// needCommands skips t when the runtime's agent runs no commands.
func (n *node) needCommands(t *testing.T) {
	t.Helper()
	if n.o.NoCommands {
		t.Skip("the runtime's agent runs no commands (Options.NoCommands)")
	}
}

// pauser is the runtime as a Pauser, or nil where Features say no Pause.
func (n *node) pauser() backend.Pauser {
	if !n.rt.Features().Pause {
		return nil
	}
	return n.rt.(backend.Pauser)
}

// frozen checks what Frozen says of id.
func (n *node) frozen(t *testing.T, id string, want bool) {
	t.Helper()
	got, err := n.pauser().Frozen(context.Background(), id)
	if err != nil || got != want {
		t.Fatalf("Frozen %s = %v, %v; want %v", id, got, err, want)
	}
}

// waitFor polls cond until it holds or the deadline d passes.
func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
}
