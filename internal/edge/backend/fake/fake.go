// Package fake is a backend.Runtime that starts nothing, for tests
// of the edge above the runtime seam. Each sandbox is a small file under
// the runtime's root (so a new Runtime over the same root, as a restarted
// daemon makes, finds the sandboxes of the first), and its agent is an
// in-process Connect handler reached over net.Pipe connections through the
// dialer Start returns: it answers Ping, the call the edge makes at create
// and to check a sandbox, holds the edge's watch connections (package
// execwire) and refuses the rest as unimplemented. A frozen sandbox's agent
// does not answer; a killed or deleted one's connections end and new ones
// are refused, as real ones' are. It runs the conformance suite of package
// backendtest, which skips what needs commands run in a sandbox.
//
// What it honours of a Spec: its ID, validity and the rest are kept in the
// sandbox's file (Spec); the limits are not enforced, as nothing runs. With
// Features.Network (the default) a Start checks that NetnsPath, when set,
// is a network namespace (as joining it would), and without, it refuses a
// spec naming a NetnsPath or a ResolvConf with errdefs.ErrNotSupported, as
// every runtime must. It does not meter (no backend.Meter).
package fake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	"dsec.dev/dsec/api/gen/dsec/agent/v1/agentv1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/execwire"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
)

// Runtime is the fake. Its methods are safe for concurrent use. Close it
// when the test ends.
type Runtime struct {
	root     string
	features backend.Features
	srv      *http.Server
	ln       *pipeListener

	mu       sync.Mutex // serialises the state files and the hooks below
	failNext error
	hold     chan struct{}
	procs    int32
	pings    int
	execs    map[string]int // Exec calls by sandbox
	noWatch  bool
	// conns are the agents' ends of the open connections, by sandbox.
	conns map[string]map[*idConn]bool
}

var _ interface {
	backend.Runtime
	backend.Pauser
	backend.Snapshotter
} = (*Runtime)(nil)

// Option changes a new Runtime.
type Option func(*Runtime)

// WithFeatures makes the runtime claim f (by default it claims every
// feature). The methods stay; callers must not use what f leaves out.
func WithFeatures(f backend.Features) Option { return func(r *Runtime) { r.features = f } }

// WithoutWatch makes the agents refuse watch connections (they answer them
// as HTTP), as agents older than them do.
func WithoutWatch() Option { return func(r *Runtime) { r.noWatch = true } }

// New returns a runtime keeping its sandboxes under root.
func New(root string, opts ...Option) *Runtime {
	r := &Runtime{root: root, features: backend.Features{Pause: true, Snapshot: true, Network: true},
		ln:    &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})},
		conns: map[string]map[*idConn]bool{}}
	for _, o := range opts {
		o(r)
	}
	path, h := agentv1connect.NewAgentServiceHandler(&agent{rt: r})
	mux := http.NewServeMux()
	mux.Handle(path, h)
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	r.srv = &http.Server{Handler: mux, Protocols: protocols,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if pc, ok := c.(interface{ NetConn() net.Conn }); ok {
				c = pc.NetConn()
			}
			if ic, ok := c.(*idConn); ok {
				return context.WithValue(ctx, idKey{}, ic.id)
			}
			return ctx
		}}
	// Watch connections are held as the real agent holds them; the fake
	// has no framed exec, so a framed call's connection is counted and
	// closed, and the call fails.
	if r.noWatch {
		go r.srv.Serve(r.ln)
		return r
	}
	log := slog.New(slog.DiscardHandler)
	go r.srv.Serve(execwire.Split(r.ln, func(c net.Conn) {
		if ic, ok := c.(*idConn); ok {
			r.countExec(ic.id)
		}
		c.Close()
	}, log))
	return r
}

// Close stops the in-process agents of the dialers this Runtime returned.
// The sandboxes stay (another Runtime over the root serves them).
func (r *Runtime) Close() {
	r.srv.Close()
	r.ln.Close()
}

// state is one sandbox's file.
type state struct {
	Spec     backend.Spec
	Running  bool
	Frozen   bool
	OOMKills int64
}

func (r *Runtime) file(id string) string { return filepath.Join(r.root, id+".json") }

// load reads sandbox id's state; the caller holds r.mu.
func (r *Runtime) load(id string) (state, error) {
	var st state
	if !backend.ValidID(id) {
		return st, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	b, err := os.ReadFile(r.file(id))
	if errors.Is(err, fs.ErrNotExist) {
		return st, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(b, &st)
}

// store writes sandbox id's state; the caller holds r.mu.
func (r *Runtime) store(id string, st state) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	tmp := r.file(id) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, r.file(id))
}

// update changes sandbox id's state with f.
func (r *Runtime) update(id string, f func(*state)) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	st, err := r.load(id)
	if err != nil {
		return err
	}
	f(&st)
	return r.store(id, st)
}

func (r *Runtime) Features() backend.Features { return r.features }

// Init makes the root and removes the captures an earlier instance left.
func (r *Runtime) Init(ctx context.Context) error {
	dir := filepath.Join(r.root, "captures")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("make fake runtime root: %w", err)
	}
	des, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("read %s: %w", dir, err)
	}
	for _, de := range des {
		if err := snapshot.RemoveCapture(filepath.Join(dir, de.Name())); err != nil {
			return err
		}
	}
	return nil
}

func (r *Runtime) Teardown(ctx context.Context) error { return nil }

func (r *Runtime) Start(ctx context.Context, s backend.Spec) (backend.Dialer, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.failNext; err != nil {
		r.failNext = nil
		return nil, err
	}
	if _, err := r.load(s.ID); err == nil {
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, errdefs.ErrAlreadyExists)
	}
	if !r.features.Network && (s.NetnsPath != "" || s.ResolvConf != "") {
		return nil, fmt.Errorf("start sandbox %s: the runtime gives sandboxes no network (Features): %w", s.ID, errdefs.ErrNotSupported)
	}
	if s.NetnsPath != "" {
		if err := checkNetns(s.NetnsPath); err != nil {
			return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
		}
	}
	if err := os.MkdirAll(filepath.Join(r.root, "upper", s.ID), 0o755); err != nil {
		return nil, err
	}
	if err := r.store(s.ID, state{Spec: s, Running: true}); err != nil {
		return nil, err
	}
	return r.dialer(s.ID), nil
}

func (r *Runtime) Channel(id string) (backend.Dialer, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := r.load(id); err != nil {
		return nil, fmt.Errorf("agent channel: %w", err)
	}
	return r.dialer(id), nil
}

// dialer connects to sandbox id's in-process agent while it runs.
func (r *Runtime) dialer(id string) backend.Dialer {
	return func(ctx context.Context) (net.Conn, error) {
		r.mu.Lock()
		st, err := r.load(id)
		r.mu.Unlock()
		if err != nil || !st.Running {
			return nil, &net.OpError{Op: "dial", Net: "fake", Err: errors.New("connection refused")}
		}
		client, server := net.Pipe()
		ic := r.track(id, server)
		select {
		case r.ln.conns <- ic:
			return client, nil
		case <-r.ln.done:
			client.Close()
			ic.Close()
			return nil, &net.OpError{Op: "dial", Net: "fake", Err: net.ErrClosed}
		case <-ctx.Done():
			client.Close()
			ic.Close()
			return nil, ctx.Err()
		}
	}
}

// track registers the agent's end of a new connection to sandbox id, until
// it is closed.
func (r *Runtime) track(id string, server net.Conn) *idConn {
	ic := &idConn{Conn: server, id: id, rt: r}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.conns[id] == nil {
		r.conns[id] = map[*idConn]bool{}
	}
	r.conns[id][ic] = true
	return ic
}

// hangUp ends every connection to sandbox id's agent, as its exit does;
// the caller holds r.mu.
func (r *Runtime) hangUp(id string) {
	for ic := range r.conns[id] {
		ic.Conn.Close()
	}
	delete(r.conns, id)
}

func (r *Runtime) Status(ctx context.Context, id string) (backend.Status, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	st, err := r.load(id)
	if err != nil {
		return backend.Status{}, fmt.Errorf("status: %w", err)
	}
	out := backend.Status{Running: st.Running, OOMKills: st.OOMKills}
	if st.Running {
		out.Pid = os.Getpid()
	}
	return out, nil
}

func (r *Runtime) Delete(ctx context.Context, id string) error {
	if !backend.ValidID(id) {
		return fmt.Errorf("delete sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := os.RemoveAll(filepath.Join(r.root, "upper", id)); err != nil {
		return err
	}
	if err := os.Remove(r.file(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("delete sandbox %s: %w", id, err)
	}
	r.hangUp(id)
	return nil
}

func (r *Runtime) List(ctx context.Context) ([]string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ents, err := os.ReadDir(r.root)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	var ids []string
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".json"); ok && backend.ValidID(id) {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

func (r *Runtime) Pause(ctx context.Context, id string, reclaim bool) (backend.PauseStats, error) {
	r.wait()
	if err := r.Freeze(ctx, id); err != nil {
		return backend.PauseStats{}, err
	}
	return backend.PauseStats{Frozen: time.Millisecond, Resident: 100 << 20, Released: 95 << 20}, nil
}

func (r *Runtime) Resume(ctx context.Context, id string, prefetch bool) (backend.ResumeStats, error) {
	r.wait()
	return backend.ResumeStats{}, r.Thaw(ctx, id)
}

func (r *Runtime) Freeze(ctx context.Context, id string) error {
	return r.update(id, func(st *state) { st.Frozen = true })
}

func (r *Runtime) Thaw(ctx context.Context, id string) error {
	return r.update(id, func(st *state) { st.Frozen = false })
}

func (r *Runtime) Frozen(ctx context.Context, id string) (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	st, err := r.load(id)
	return st.Frozen, err
}

// Capture copies the sandbox's writable layer, a plain directory under the
// root, into the root's captures.
func (r *Runtime) Capture(ctx context.Context, id, name string) (*snapshot.Tree, error) {
	if !backend.ValidID(id) || !backend.ValidID(name) {
		return nil, fmt.Errorf("capture sandbox %q as %q: %w", id, name, errdefs.ErrInvalidArgument)
	}
	r.mu.Lock()
	_, err := r.load(id)
	r.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("capture %w", err)
	}
	return snapshot.Capture(ctx, filepath.Join(r.root, "upper", id), filepath.Join(r.root, "captures", id+"."+name))
}

// Test hooks.

// Kill makes sandbox id's agent die (oom: OOM-killed): it stays known, not
// running, its connections end and its channel refuses new ones.
func (r *Runtime) Kill(id string, oom bool) {
	r.update(id, func(st *state) {
		st.Running = false
		if oom {
			st.OOMKills++
		}
	})
	r.mu.Lock()
	r.hangUp(id)
	r.mu.Unlock()
}

// SetFrozen freezes or thaws sandbox id as an interrupted pause or resume
// would have left it.
func (r *Runtime) SetFrozen(id string, frozen bool) {
	r.update(id, func(st *state) { st.Frozen = frozen })
}

// FailNextStart makes the next Start fail with err, having made nothing.
func (r *Runtime) FailNextStart(err error) {
	r.mu.Lock()
	r.failNext = err
	r.mu.Unlock()
}

// Hold makes every Pause and Resume wait until release is called.
func (r *Runtime) Hold() (release func()) {
	h := make(chan struct{})
	r.mu.Lock()
	r.hold = h
	r.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			r.mu.Lock()
			r.hold = nil
			r.mu.Unlock()
			close(h)
		})
	}
}

func (r *Runtime) wait() {
	r.mu.Lock()
	h := r.hold
	r.mu.Unlock()
	if h != nil {
		<-h
	}
}

// SetRunningProcesses is what every agent's Ping reports as running.
func (r *Runtime) SetRunningProcesses(n int32) {
	r.mu.Lock()
	r.procs = n
	r.mu.Unlock()
}

// Pings counts the pings the agents answered.
func (r *Runtime) Pings() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pings
}

// Execs is how many exec calls sandbox id's agent got by either path (and
// refused: the fake runs no command).
func (r *Runtime) Execs(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.execs[id]
}

func (r *Runtime) countExec(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.execs == nil {
		r.execs = map[string]int{}
	}
	r.execs[id]++
}

// Spec is the spec sandbox id was started with.
func (r *Runtime) Spec(id string) (backend.Spec, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	st, err := r.load(id)
	return st.Spec, err
}

// agent serves every sandbox's agent channel; the connection says whose.
type agent struct {
	agentv1connect.UnimplementedAgentServiceHandler
	rt *Runtime
}

type idKey struct{}

// Ping answers while the sandbox runs thawed; a frozen agent does not
// answer until thawed, a dead one's connection fails.
func (a *agent) Ping(ctx context.Context, req *connect.Request[agentv1.PingRequest]) (*connect.Response[agentv1.PingResponse], error) {
	id, _ := ctx.Value(idKey{}).(string)
	for {
		a.rt.mu.Lock()
		st, err := a.rt.load(id)
		procs := a.rt.procs
		a.rt.mu.Unlock()
		switch {
		case err != nil || !st.Running:
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("the agent is gone"))
		case !st.Frozen:
			a.rt.mu.Lock()
			a.rt.pings++
			a.rt.mu.Unlock()
			return connect.NewResponse(&agentv1.PingResponse{RunningProcesses: procs}), nil
		}
		select {
		case <-ctx.Done():
			return nil, connect.NewError(connect.CodeDeadlineExceeded, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// Exec counts the call and refuses it: the fake runs no command.
func (a *agent) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], _ *connect.ServerStream[dsecv1.ExecEvent]) error {
	id, _ := ctx.Value(idKey{}).(string)
	a.rt.countExec(id)
	return connect.NewError(connect.CodeUnimplemented, errors.New("the fake agent runs no command"))
}

// idConn is the agent's end of a connection to sandbox id.
type idConn struct {
	net.Conn
	id string
	rt *Runtime
}

// Close closes the connection and forgets it.
func (c *idConn) Close() error {
	c.rt.mu.Lock()
	delete(c.rt.conns[c.id], c)
	c.rt.mu.Unlock()
	return c.Conn.Close()
}

// pipeListener hands the agent's ends of net.Pipe connections to the
// server.
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *pipeListener) Addr() net.Addr { return pipeAddr{} }

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "fake-agent" }
