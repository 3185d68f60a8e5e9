// Package dsec is the Go client of dsec, the sandbox infrastructure for
// agentic RL. It talks to a dsecd, or to a cluster of apiservers, over
// Connect, on a Unix socket, TCP or TLS:
//
//	c, err := dsec.NewClient("") // $DSEC_ADDR, else unix:///var/lib/dsec/dsecd.sock
//	sb, err := c.Create(ctx, "busybox:test", &dsec.CreateOptions{MemoryMB: 256})
//	defer sb.Delete(context.WithoutCancel(ctx))
//	res, err := sb.Exec(ctx, dsec.Sh("echo hello"), &dsec.ExecOptions{Timeout: time.Minute})
//
// Short programs (reward code, test cases) run in the fncall backend's pooled
// warm containers, with no sandbox to create (docs/fncall.md):
//
//	r, err := c.RunCode(ctx, dsec.RunCodeRequest{Language: "python", Code: "print(1)"})
//	rs, err := c.RunTests(ctx, dsec.RunCodeRequest{Language: "cpp", Code: src}, cases)
//
// Every call honours its context; calls whose context has no deadline get
// the client's default timeout (Exec: the command's own timeout plus a
// grace period; RunCode: its compile and run timeouts plus 30 s). Errors
// match the kinds in errors.go with errors.Is.
//
// # Addresses and failover
//
// The address is one address or a comma-separated list of them (several
// apiservers, or one load-balanced address), each unix:///path,
// http://host:port, https://host:port or host:port (http). The client keeps
// a current address, the first to begin with, and moves to the next when
// one fails:
//
//   - A call that cannot reach a server (the dial is refused or times out,
//     the TLS handshake fails) goes on to the next address at once, whatever
//     the call, Exec included: no server has seen it. Each address is tried
//     once this way per attempt.
//   - A call that reached a server and got Unavailable back (or a proxy's
//     502, 503 or 504, or a connection broken before the answer) is tried
//     again, on the next address, only if it may repeat: Get, List, Delete,
//     SetNetworkRules, NetworkLog, Provenance, SetProvenancePaths, SetWarmPool, WarmPools, ListLayers,
//     ListEnvironments, LayerStats, Languages, and of the IAM calls Project,
//     Projects, Quota, SetQuota, Principals, Grant, Bindings, RevokeToken,
//     Tokens and Audit (the calls the API marks free of side effects or
//     idempotent); RunCode, RunCodeBatch and RunTests
//     without network rules (a call leaves nothing behind); Create, which always carries an idempotency
//     key and sends the same key on every attempt, so it never makes a
//     second batch; the reads ReadFile, ListDir, Stat, Processes, Job.Wait
//     and Job.Output (Attach replays the output from the start) and
//     Download; and Remove and MkdirAll. Exec, ExecStream, Spawn,
//     WriteStdin, WriteFile, AppendFile, Kill, the Session calls, Upload,
//     ImportLayer, ImportImage, CreateProject, DeleteProject,
//     CreatePrincipal, DeletePrincipal, Ungrant, CreateToken and ExportAudit
//     are never sent again once a server had them.
//
// Such retries count against WithMaxRetries (6 by default); the first pass
// over addresses not yet tried by the call is immediate, later attempts
// back off exponentially with jitter (or by the server's Retry-After).
//
// # Token
//
// Every call carries "Authorization: Bearer <token>", the token being the
// WithToken option, else $DSEC_TOKEN, else the contents of the file named by
// $DSEC_TOKEN_FILE (which must be readable), else the contents of
// DefaultTokenFile (/var/lib/dsec/admin.token, written by the all-in-one
// dsecd) when it exists and is readable, else none. The token is read once,
// by NewClient, and never appears in an error: an Unauthenticated answer
// is not retried and its message says where the token came from instead.
//
// https:// addresses are verified with the system roots, or with the PEM
// bundle of WithCAFile, else $DSEC_CA_FILE, when set.
//
// Dial gives the API's generated clients over the same transport (a Conn),
// for programs that need the API's messages as they are; the dsec CLI, its
// benchmarks and the repository's tests reach the API through it.
//
// The package imports only the public API (dsec.dev/dsec/api/gen/...), never
// server code. It lives in the repository's one module, dsec.dev/dsec: a
// program outside the repository needs one replace of that module to a
// checkout (docs/go.md).
package dsec

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	mrand "math/rand/v2"
	"net/http"
	"os"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// DefaultAddr is the local daemon's Unix socket.
const DefaultAddr = "unix:///var/lib/dsec/dsecd.sock"

// Defaults for calls whose context carries no deadline.
const (
	DefaultTimeout       = 30 * time.Second
	DefaultCreateTimeout = 120 * time.Second
	execGrace            = 15 * time.Second
)

// Option configures a Client.
type Option func(*Client)

// WithTimeout sets the default timeout of unary calls (default 30 s).
func WithTimeout(d time.Duration) Option { return func(c *Client) { c.timeout = d } }

// WithMaxRetries sets how often a call that may repeat is retried (default 6).
func WithMaxRetries(n int) Option { return func(c *Client) { c.maxRetries = n } }

// WithHTTPClient replaces the HTTP client: every address is then reached
// through its Transport (http.DefaultTransport if nil), which must dial Unix
// sockets itself, and WithCAFile does not apply. The token is still added.
func WithHTTPClient(hc *http.Client) Option { return func(c *Client) { c.hc = hc } }

// WithToken sets the bearer token sent on every call, instead of
// $DSEC_TOKEN, $DSEC_TOKEN_FILE or DefaultTokenFile.
func WithToken(token string) Option { return func(c *Client) { c.token = token } }

// WithCAFile verifies https:// apiservers with the PEM bundle at path
// instead of $DSEC_CA_FILE or the system roots.
func WithCAFile(path string) Option { return func(c *Client) { c.caFile = path } }

// Client is a client of a dsecd or of a cluster of apiservers. It is safe
// for concurrent use.
type Client struct {
	sb         dsecv1connect.SandboxServiceClient
	layers     dsecv1connect.LayerServiceClient
	fn         dsecv1connect.FnCallServiceClient
	iam        dsecv1connect.IAMServiceClient
	uploads    dsecv1connect.LayerServiceClient // UploadLayer, over HTTP/2
	hc         *http.Client
	pool       *pool
	timeout    time.Duration
	maxRetries int
	token      string
	caFile     string
}

// NewClient makes a client for addr, one address or a comma-separated
// list of them, each unix:///path, http://host:port, https://host:port or
// host:port (http); "" means $DSEC_ADDR, else DefaultAddr. It reads the
// token and the CA bundle (see the package doc) but does not connect yet.
func NewClient(addr string, opts ...Option) (*Client, error) {
	c := &Client{timeout: DefaultTimeout, maxRetries: 6}
	for _, o := range opts {
		o(c)
	}
	pc := poolConfig{addr: addr, addrName: "NewClient's address", token: c.token,
		tokenName: "the WithToken option", tokenHint: "use WithToken", caFile: c.caFile}
	if c.hc != nil {
		pc.rt = c.hc.Transport
		if pc.rt == nil {
			pc.rt = http.DefaultTransport
		}
	}
	c.token = ""
	p, err := newPool(pc)
	if err != nil {
		return nil, err
	}
	c.pool = p
	base := p.baseURL()
	hc := &http.Client{Transport: p}
	if c.hc != nil {
		hc.Timeout, hc.CheckRedirect, hc.Jar = c.hc.Timeout, c.hc.CheckRedirect, c.hc.Jar
	}
	c.hc = hc
	ic := connect.WithInterceptors(interceptor{p: p})
	c.sb = dsecv1connect.NewSandboxServiceClient(hc, base, ic)
	c.layers = dsecv1connect.NewLayerServiceClient(hc, base, ic)
	c.fn = dsecv1connect.NewFnCallServiceClient(hc, base, ic)
	c.iam = dsecv1connect.NewIAMServiceClient(hc, base, ic)
	c.uploads = dsecv1connect.NewLayerServiceClient(&http.Client{Transport: uploads{p}, Timeout: hc.Timeout}, base, ic)
	return c, nil
}

// Addr returns addr, else $DSEC_ADDR, else DefaultAddr.
func Addr(addr string) string {
	if addr != "" {
		return addr
	}
	if env := os.Getenv("DSEC_ADDR"); env != "" {
		return env
	}
	return DefaultAddr
}

// addrFrom says where Addr(addr) takes the address from: name (the
// caller's, when addr is set), "$DSEC_ADDR", or DefaultAddr.
func addrFrom(addr, name string) string {
	switch {
	case addr != "":
		return name
	case os.Getenv("DSEC_ADDR") != "":
		return "$DSEC_ADDR"
	}
	return DefaultAddr
}

// poolConfig is what newPool reads: the address list, the token and the
// CA bundle as the caller was given them, and how its messages name them.
type poolConfig struct {
	addr, addrName   string
	token, tokenName string
	tokenHint        string // how to give a token ("use WithToken")
	caFile           string
	rt               http.RoundTripper // every endpoint's transport; nil: the SDK's own
}

// newPool parses the address list of pc (see Addr), finds the token and
// the CA bundle, and makes each endpoint's transports.
func newPool(pc poolConfig) (*pool, error) {
	addrs, err := splitAddrs(Addr(pc.addr))
	if err != nil {
		return nil, err
	}
	cred, err := loadCredential(pc.token, pc.tokenName, pc.tokenHint)
	if err != nil {
		return nil, err
	}
	tlsConf, err := tlsConfig(pc.caFile)
	if err != nil {
		return nil, err
	}
	p := &pool{cred: cred, addrFrom: addrFrom(pc.addr, pc.addrName)}
	for _, a := range addrs {
		ep, socket, err := parseEndpoint(a)
		if err != nil {
			return nil, err
		}
		if pc.rt != nil {
			ep.rt, ep.up = pc.rt, pc.rt
		} else {
			// HTTP/1.1 with kept-alive connections: every call but an
			// upload and the shell is unary or server-streaming, and on a
			// node an exec answers about 0.2 ms sooner than over HTTP/2.
			ep.rt, ep.up = newTransport(socket, tlsConf), uploadTransport(socket, tlsConf, ep.scheme == "https")
		}
		p.eps = append(p.eps, ep)
	}
	p.basePath = p.eps[0].prefix
	return p, nil
}

// baseURL is the first endpoint's URL, which the generated clients are
// made with (each request goes to the current endpoint's).
func (p *pool) baseURL() string {
	first := p.eps[0]
	return first.scheme + "://" + first.host + first.prefix
}

// closeIdle drops the idle connections of every endpoint's transports.
func (p *pool) closeIdle() {
	for _, ep := range p.eps {
		for _, rt := range []http.RoundTripper{ep.rt, ep.up} {
			if t, ok := rt.(interface{ CloseIdleConnections() }); ok {
				t.CloseIdleConnections()
			}
		}
	}
}

// Close drops the client's idle connections.
func (c *Client) Close() error {
	c.pool.closeIdle()
	return nil
}

// withTimeout gives ctx the default deadline d when it has none (d <= 0: none).
func withTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || d <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, d)
}

// retry runs call until it succeeds, fails with a non-retryable error, or
// the retries or the context run out. Only unavailable is retried: a server
// unreachable, a connection broken, an answer of Unavailable (or a proxy's
// 502, 503, 504). Every attempt counts; an attempt after an answer of
// Unavailable goes to the next address, at once while this call has
// addresses left that it has not tried, else after a backoff.
func (c *Client) retry(ctx context.Context, creating bool, call func(context.Context) error) error {
	ctx, ct := c.pool.trace(ctx)
	for attempt := 0; ; attempt++ {
		err := call(ctx)
		if err == nil {
			return nil
		}
		err = fromConnect(err, creating)
		var e *Error
		if !errors.As(err, &e) || e.Code != connect.CodeUnavailable || attempt >= c.maxRetries {
			return err
		}
		var cve *tls.CertificateVerificationError
		if errors.As(err, &cve) {
			return err // a certificate that does not verify will not a moment later
		}
		delay := backoff(attempt, e.RetryAfter)
		if i := ct.lastReached(); i >= 0 {
			// A server had the request (its answer, or a connection it
			// broke): the next attempt goes elsewhere.
			c.pool.advance(i)
			if ct.untried() {
				delay = 0
			}
		}
		if delay == 0 {
			continue
		}
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= delay {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(delay):
		}
	}
}

func backoff(attempt int, hint time.Duration) time.Duration {
	if hint > 0 {
		return hint
	}
	base := math.Min(2, 0.05*math.Pow(2, float64(attempt)))
	return time.Duration((base/2 + mrand.Float64()*base/2) * float64(time.Second))
}

func (c *Client) unary(ctx context.Context, idempotent bool, call func(context.Context) error) error {
	ctx, cancel := withTimeout(ctx, c.timeout)
	defer cancel()
	if !idempotent {
		return fromConnect(call(ctx), false)
	}
	return c.retry(ctx, false, call)
}

// The CPU classes of CreateOptions.QoS.
const (
	QoSLatency    = "latency"
	QoSBestEffort = "best_effort"
)

// The isolations of CreateOptions.Isolation.
const (
	IsolationContainer = "container"
	IsolationGVisor    = "gvisor"
	IsolationMicroVM   = "microvm"
)

// CreateOptions describe new sandboxes. Zero fields take the node's defaults.
type CreateOptions struct {
	Backend string // the profile: "container" (default; a sandbox)
	// Isolation is what keeps the sandbox apart from its node:
	// IsolationContainer (default: runc on the host's kernel),
	// IsolationGVisor (gVisor's user-space kernel) or IsolationMicroVM (a
	// kernel of its own under QEMU). A cluster places it only on nodes
	// that offer it and refuses it (ErrFailedPrecondition) when none does,
	// saying what the nodes lack.
	Isolation string
	// QoS is the CPU class: QoSLatency (default) or QoSBestEffort, which
	// runs the sandbox under SCHED_IDLE, on CPU time latency sandboxes
	// leave. Anything else is ErrInvalidArgument.
	QoS          string
	CPUs         float64
	MemoryMB     int64
	DiskMB       int64
	Pids         int64
	TTL          time.Duration // hard lifetime
	IdleTimeout  time.Duration // negative: never
	User         string        // default user of commands
	Env          map[string]string
	Labels       map[string]string
	NetworkRules map[string]bool
	Hostname     string
	Workdir      string
	// Timeout bounds waiting for the sandboxes to run (default 120 s, or the
	// context's deadline); past it the call fails with ErrStartupTimeout.
	Timeout time.Duration
	// IdempotencyKey; a random one is made when empty.
	IdempotencyKey string
	// PauseOnTimeout makes the TTL and idle timeout pause the sandbox
	// rather than stop it; a paused sandbox's clocks stand still.
	PauseOnTimeout bool
	// NoAutoResume makes calls to a paused sandbox fail
	// (ErrFailedPrecondition) instead of resuming it first.
	NoAutoResume bool
	// Phases, when set, split the sandbox's life into setup, agent and
	// verify budgets; the TTL is their sum plus a margin (see PhaseBudgets).
	Phases *PhaseBudgets
	// Provenance marks the task's workspace, test and protected paths for
	// the sandbox's provenance (Sandbox.Provenance).
	Provenance *ProvenancePaths
}

func (o *CreateOptions) spec(env string) (*dsecv1.SandboxSpec, error) {
	if o == nil {
		o = &CreateOptions{}
	}
	if o.Backend != "" && o.Backend != "container" {
		return nil, invalid("backend %q is not known (container)", o.Backend)
	}
	spec := &dsecv1.SandboxSpec{
		Environment: env, Backend: dsecv1.Backend_BACKEND_CONTAINER, Cpus: o.CPUs,
		MemoryMb: o.MemoryMB, DiskMb: o.DiskMB, Pids: o.Pids,
		TtlSeconds: seconds(o.TTL), IdleTimeoutSeconds: seconds(o.IdleTimeout),
		User: o.User, Env: o.Env, Labels: o.Labels, NetworkRules: o.NetworkRules,
		Hostname: o.Hostname, Workdir: o.Workdir, Phases: o.Phases.proto(),
		Qos: o.QoS, Provenance: o.Provenance.proto(),
	}
	switch o.Isolation {
	case "", IsolationContainer:
	case IsolationGVisor:
		spec.Isolation = dsecv1.Isolation_ISOLATION_GVISOR
	case IsolationMicroVM:
		spec.Isolation = dsecv1.Isolation_ISOLATION_MICROVM
	default:
		return nil, invalid("isolation %q is not known (container, gvisor, microvm)", o.Isolation)
	}
	if o.PauseOnTimeout {
		spec.OnTimeout = dsecv1.OnTimeout_ON_TIMEOUT_PAUSE
	}
	if o.NoAutoResume {
		no := false
		spec.AutoResume = &no
	}
	return spec, nil
}

func seconds(d time.Duration) int64 {
	if d < 0 {
		return -1
	}
	return int64(math.Ceil(d.Seconds()))
}

func newKey() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// CreateMany makes n sandboxes from env ("BASE[+LAYER...]") in one call:
// all of them or none. Retries after a transport failure reuse the call's
// idempotency key, so they never make a second batch.
func (c *Client) CreateMany(ctx context.Context, n int, env string, o *CreateOptions) ([]*Sandbox, error) {
	if n < 1 {
		return nil, invalid("n must be at least 1")
	}
	spec, err := o.spec(env)
	if err != nil {
		return nil, err
	}
	timeout := DefaultCreateTimeout
	key := newKey()
	if o != nil {
		if o.Timeout > 0 {
			timeout = o.Timeout
		}
		if o.IdempotencyKey != "" {
			key = o.IdempotencyKey
		}
	}
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < timeout {
		timeout = time.Until(dl)
	}
	// The daemon waits timeout; we wait a little longer for its verdict.
	ctx, cancel := context.WithTimeout(ctx, timeout+2*time.Second)
	defer cancel()
	req := &dsecv1.CreateRequest{Spec: spec, Count: int32(n), IdempotencyKey: key,
		WaitSeconds: max(1, int64(timeout.Seconds()))}
	var resp *dsecv1.CreateResponse
	err = c.retry(ctx, true, func(ctx context.Context) error {
		r, err := c.sb.Create(ctx, connect.NewRequest(req))
		if err == nil {
			resp = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("create %d sandbox(es) of %s: %w", n, env, err)
	}
	out := make([]*Sandbox, 0, len(resp.GetSandboxes()))
	for _, info := range resp.GetSandboxes() {
		out = append(out, c.wrap(info))
	}
	return out, nil
}

// Create makes one sandbox; see CreateMany.
func (c *Client) Create(ctx context.Context, env string, o *CreateOptions) (*Sandbox, error) {
	sbs, err := c.CreateMany(ctx, 1, env, o)
	if err != nil {
		return nil, err
	}
	if len(sbs) != 1 {
		return nil, &Error{Kind: ErrInternal, Message: fmt.Sprintf("create returned %d sandboxes", len(sbs))}
	}
	return sbs[0], nil
}

func (c *Client) wrap(info *dsecv1.Sandbox) *Sandbox {
	return &Sandbox{ID: info.GetId(), c: c, info: info}
}

// Sandbox is a handle on an existing sandbox by ID, without a call.
func (c *Client) Sandbox(id string) *Sandbox {
	return c.wrap(&dsecv1.Sandbox{Id: id})
}

// Get fetches a sandbox's current record.
func (c *Client) Get(ctx context.Context, id string) (*Sandbox, error) {
	var info *dsecv1.Sandbox
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.sb.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
		if err == nil {
			info = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("get sandbox %s: %w", id, err)
	}
	return c.wrap(info), nil
}

// List returns the sandboxes whose labels all match and whose state is any
// of states; with no states, the live ones (creating, running, stopping).
// ListAll includes the stopped and failed ones the node still keeps.
func (c *Client) List(ctx context.Context, labels map[string]string, states ...dsecv1.State) ([]*Sandbox, error) {
	return c.list(ctx, &dsecv1.ListRequest{Labels: labels, States: states})
}

// ListAll returns every sandbox whose labels all match, whatever its state:
// stopped and failed ones stay listed for the node's retention period.
func (c *Client) ListAll(ctx context.Context, labels map[string]string) ([]*Sandbox, error) {
	return c.list(ctx, &dsecv1.ListRequest{Labels: labels, All: true})
}

// Page is one page of a paged listing (ListPage).
type Page struct {
	Sandboxes []*Sandbox
	// Next is the token of the page after this one; "" when this is the
	// last.
	Next string
	// Total is how many sandboxes match in all pages.
	Total int
	// Unreachable names the nodes the apiserver could not reach: their
	// sandboxes are in neither the page nor Total (docs/cluster.md).
	Unreachable []string
}

// ListPage returns one page of at most size sandboxes (at most 1,000)
// matching req's filter (labels, states, all), newest first, starting
// after token ("" the first page; then a Page's Next). The API reads and
// sends only that page, so a caller walking 10,000 sandboxes holds 100 at
// a time; sandboxes made meanwhile do not shift the pages after.
func (c *Client) ListPage(ctx context.Context, filter *dsecv1.ListRequest, size int, token string) (*Page, error) {
	req := &dsecv1.ListRequest{PageSize: int32(size), PageToken: token}
	if filter != nil {
		req.Labels, req.States, req.All = filter.GetLabels(), filter.GetStates(), filter.GetAll()
	}
	var resp *dsecv1.ListResponse
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.sb.List(ctx, connect.NewRequest(req))
		if err == nil {
			resp = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list a page of sandboxes: %w", err)
	}
	p := &Page{Next: resp.GetNextPageToken(), Total: int(resp.GetTotal()), Unreachable: resp.GetUnreachableNodes()}
	for _, info := range resp.GetSandboxes() {
		p.Sandboxes = append(p.Sandboxes, c.wrap(info))
	}
	return p, nil
}

func (c *Client) list(ctx context.Context, req *dsecv1.ListRequest) ([]*Sandbox, error) {
	var resp *dsecv1.ListResponse
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.sb.List(ctx, connect.NewRequest(req))
		if err == nil {
			resp = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list sandboxes: %w", err)
	}
	out := make([]*Sandbox, 0, len(resp.GetSandboxes()))
	for _, info := range resp.GetSandboxes() {
		out = append(out, c.wrap(info))
	}
	return out, nil
}

// PauseResult is what a pause did.
type PauseResult struct {
	AlreadyPaused bool          // it was paused before; nothing was done
	Frozen        time.Duration // from the call to every process frozen
	Reclaim       time.Duration // pushing memory out of RAM after the freeze
	// Resident is the sandbox's memory in RAM before; Released what left
	// RAM; Swapped what of that went to swap (the rest was page cache).
	Resident, Released, Swapped int64
	// Kept is what stayed in RAM (Resident - Released), by kind, and
	// KeptReason why, in words, where the node can tell ("" when no kind
	// of memory left as much as 1 MiB).
	Kept       KeptMemory
	KeptReason string
}

// KeptMemory is what of a paused sandbox's memory stayed in RAM, in bytes.
type KeptMemory struct {
	Total int64
	Anon  int64 // its processes' anonymous memory
	// Shmem is shared memory: files in tmpfs such as /dev/shm, System V
	// segments, shared mappings. Like Anon it leaves RAM only through swap.
	Shmem  int64
	Cache  int64 // page cache
	Kernel int64 // kernel memory charged to it (page tables, kernel objects): never leaves RAM
}

// Pause freezes sandbox id and pushes its memory out of RAM (keepMemory:
// freeze only). It stays paused across a restart of its node; any call
// that runs in it resumes it first, unless made with NoAutoResume.
func (c *Client) Pause(ctx context.Context, id string, keepMemory bool) (*Sandbox, *PauseResult, error) {
	var resp *connect.Response[dsecv1.PauseResponse]
	err := c.unary(ctx, true, func(ctx context.Context) (err error) {
		resp, err = c.sb.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: id, KeepMemory: keepMemory}))
		return err
	})
	if err != nil {
		return nil, nil, fmt.Errorf("pause sandbox %s: %w", id, err)
	}
	st := resp.Msg.GetSandbox().GetLastPause()
	return c.wrap(resp.Msg.GetSandbox()), &PauseResult{
		AlreadyPaused: resp.Msg.GetAlreadyPaused(),
		Frozen:        time.Duration(st.GetFrozenUs()) * time.Microsecond,
		Reclaim:       time.Duration(st.GetReclaimMs()) * time.Millisecond,
		Resident:      st.GetResidentBytes(), Released: st.GetReleasedBytes(), Swapped: st.GetSwappedBytes(),
		Kept: KeptMemory{
			Total: st.GetKeptBytes(), Anon: st.GetKeptAnonBytes(), Shmem: st.GetKeptShmemBytes(),
			Cache: st.GetKeptCacheBytes(), Kernel: st.GetKeptKernelBytes(),
		},
		KeptReason: st.GetKeptReason(),
	}, nil
}

// Resume brings a paused sandbox's memory back and lets it run; already
// says it was running.
func (c *Client) Resume(ctx context.Context, id string) (sb *Sandbox, already bool, err error) {
	var resp *connect.Response[dsecv1.ResumeResponse]
	err = c.unary(ctx, true, func(ctx context.Context) (err error) {
		resp, err = c.sb.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: id}))
		return err
	})
	if err != nil {
		return nil, false, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	return c.wrap(resp.Msg.GetSandbox()), resp.Msg.GetAlreadyRunning(), nil
}

// SetTimeout moves sandbox id's TTL end to timeout from now, later or
// sooner (with extendOnly, never sooner). A paused sandbox gets timeout of
// running time once resumed.
func (c *Client) SetTimeout(ctx context.Context, id string, timeout time.Duration, extendOnly bool) (*Sandbox, error) {
	var resp *connect.Response[dsecv1.SetTimeoutResponse]
	err := c.unary(ctx, true, func(ctx context.Context) (err error) {
		resp, err = c.sb.SetTimeout(ctx, connect.NewRequest(&dsecv1.SetTimeoutRequest{
			SandboxId: id, TimeoutSeconds: int64(timeout / time.Second), ExtendOnly: extendOnly}))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("set timeout of sandbox %s: %w", id, err)
	}
	return c.wrap(resp.Msg.GetSandbox()), nil
}

// Metrics reads sandbox id's resource use now: CPU (percent of its cores),
// memory and its writable layer's disk use, with their limits.
func (c *Client) Metrics(ctx context.Context, id string) (*dsecv1.SandboxMetrics, error) {
	var resp *connect.Response[dsecv1.SandboxMetrics]
	err := c.unary(ctx, true, func(ctx context.Context) (err error) {
		resp, err = c.sb.Metrics(ctx, connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: id}))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("metrics of sandbox %s: %w", id, err)
	}
	return resp.Msg, nil
}

// MetricsSample is one sample of a sandbox's use, as its node took it.
type MetricsSample struct {
	At time.Time
	// CPUCores is the CPU it used over the time since the sample before
	// (the first kept: since it started), in cores; CPUTime its CPU time
	// since it started.
	CPUCores float64
	CPUTime  time.Duration
	// MemoryBytes is its cgroup's memory, page cache included, against
	// MemoryLimitBytes (the node's memory when it has no limit).
	MemoryBytes, MemoryLimitBytes int64
	DiskBytes                     int64 // its writable layer
	EgressBytes                   int64 // sent out of its network since it started; 0 without a network
}

// MetricsSince returns the samples of sandbox id's use its node took after
// since, oldest first: one each dsecd --ledger-interval (10 s), the last
// 10 minutes of them at most (120), kept while the sandbox lives. A node
// that keeps no cost ledger (--no-ledger) keeps none.
func (c *Client) MetricsSince(ctx context.Context, id string, since time.Time) ([]MetricsSample, error) {
	var resp *connect.Response[dsecv1.SandboxMetrics]
	err := c.unary(ctx, true, func(ctx context.Context) (err error) {
		resp, err = c.sb.Metrics(ctx, connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: id, SinceUnixMs: max(since.UnixMilli(), 1)}))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("metrics of sandbox %s: %w", id, err)
	}
	out := make([]MetricsSample, 0, len(resp.Msg.GetSamples()))
	for _, s := range resp.Msg.GetSamples() {
		out = append(out, MetricsSample{At: time.UnixMilli(s.GetTimeUnixMs()), CPUCores: s.GetCpuUsedCores(),
			CPUTime: time.Duration(s.GetCpuUsedUsec()) * time.Microsecond, MemoryBytes: s.GetMemoryUsedBytes(),
			MemoryLimitBytes: s.GetMemoryLimitBytes(), DiskBytes: s.GetDiskUsedBytes(), EgressBytes: s.GetNetEgressBytes()})
	}
	return out, nil
}

// Snapshot packs sandbox id's file system into layer snap:NAME (the
// paper's pack_diff), leaving out its changes under exclude. The sandbox
// stands still only while its writable layer is captured. The result's
// Environment restores it: Create(ctx, info.GetEnvironment(), ...).
func (c *Client) Snapshot(ctx context.Context, id, name string, exclude ...string) (*dsecv1.SnapshotInfo, error) {
	return c.SnapshotTo(ctx, id, name, "", exclude...)
}

// SnapshotTo is Snapshot into project (a path; "" the token's), on which
// the caller holds builder: the snapshot belongs to it and its bytes are
// charged to its quota (snapshot_bytes).
func (c *Client) SnapshotTo(ctx context.Context, id, name, project string, exclude ...string) (*dsecv1.SnapshotInfo, error) {
	resp, err := c.sb.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: name, Exclude: exclude, Project: project}))
	if err != nil {
		return nil, fmt.Errorf("snapshot sandbox %s as %s: %w", id, name, fromConnect(err, false))
	}
	return resp.Msg, nil
}

// ListSnapshots lists every snapshot the token sees: its projects', those
// shared with them, and the root's.
func (c *Client) ListSnapshots(ctx context.Context) ([]*dsecv1.SnapshotInfo, error) {
	var resp *connect.Response[dsecv1.ListSnapshotsResponse]
	err := c.unary(ctx, true, func(ctx context.Context) (err error) {
		resp, err = c.sb.ListSnapshots(ctx, connect.NewRequest(&dsecv1.ListSnapshotsRequest{}))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list snapshots: %w", err)
	}
	return resp.Msg.GetSnapshots(), nil
}

// DeleteSnapshot removes a snapshot's layer from every node.
func (c *Client) DeleteSnapshot(ctx context.Context, name string) error {
	err := c.unary(ctx, true, func(ctx context.Context) error {
		_, err := c.sb.DeleteSnapshot(ctx, connect.NewRequest(&dsecv1.DeleteSnapshotRequest{Name: name}))
		return err
	})
	if err != nil {
		return fmt.Errorf("delete snapshot %s: %w", name, err)
	}
	return nil
}

// ForkChild is one child of a fork: its sandbox, or why it was not made.
type ForkChild struct {
	Sandbox *Sandbox
	Err     error
}

// Fork takes one snapshot of sandbox id and starts n (at most 16) sandboxes
// from it with its spec: a file-system fork, the children start fresh
// processes; of a microVM a memory fork, the children go on from its
// running state on its node, each with its own identity (exclude is
// refused).
func (c *Client) Fork(ctx context.Context, id string, n int, exclude ...string) (*dsecv1.SnapshotInfo, []ForkChild, error) {
	return c.ForkWith(ctx, id, n, ForkOptions{Exclude: exclude})
}

// ForkOptions are a fork's options beyond its count.
type ForkOptions struct {
	Exclude []string // as for Snapshot: a file-system fork's only
	Name    string   // the snapshot's name (default fork-ID-TIME)
	// IdempotencyKey makes a microVM's fork safe to send again: a repeat
	// with the same key and request gets the children the first made, and
	// makes no more. The call is then retried after a transport failure,
	// as Create is. A file-system fork refuses a key.
	IdempotencyKey string
}

// ForkWith is Fork with options.
func (c *Client) ForkWith(ctx context.Context, id string, n int, o ForkOptions) (*dsecv1.SnapshotInfo, []ForkChild, error) {
	req := &dsecv1.ForkRequest{SandboxId: id, Count: int32(n), Exclude: o.Exclude, Name: o.Name, IdempotencyKey: o.IdempotencyKey}
	var resp *dsecv1.ForkResponse
	call := func(ctx context.Context) error {
		r, err := c.sb.Fork(ctx, connect.NewRequest(req))
		if err == nil {
			resp = r.Msg
		}
		return err
	}
	var err error
	if o.IdempotencyKey != "" {
		err = c.retry(ctx, true, call)
	} else {
		err = fromConnect(call(ctx), false)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("fork sandbox %s: %w", id, err)
	}
	out := make([]ForkChild, len(resp.GetChildren()))
	for i, ch := range resp.GetChildren() {
		if ch.GetError() != "" {
			out[i].Err = fmt.Errorf("fork child %d of %s: %s", i, id, ch.GetError())
			continue
		}
		out[i].Sandbox = c.wrap(ch.GetSandbox())
	}
	return resp.GetSnapshot(), out, nil
}

// Delete stops sandbox id and removes everything it had; a sandbox already
// gone is not an error.
func (c *Client) Delete(ctx context.Context, id string) error {
	err := c.unary(ctx, true, func(ctx context.Context) error {
		_, err := c.sb.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
		return err
	})
	if err != nil {
		return fmt.Errorf("delete sandbox %s: %w", id, err)
	}
	return nil
}

// Reap deletes every live sandbox whose labels match and returns how many it deleted.
func (c *Client) Reap(ctx context.Context, labels map[string]string) (int, error) {
	sbs, err := c.List(ctx, labels, dsecv1.State_STATE_CREATING, dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_STOPPING)
	if err != nil {
		return 0, err
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
		sem   = make(chan struct{}, 16)
	)
	for _, sb := range sbs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if err := sb.Delete(ctx); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return len(sbs), first
}

// ListLayers lists the layers the token sees (its projects', those shared
// with them, and the root's), each with the names it sees.
func (c *Client) ListLayers(ctx context.Context) ([]*dsecv1.Layer, error) {
	var out []*dsecv1.Layer
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.layers.ListLayers(ctx, connect.NewRequest(&dsecv1.ListLayersRequest{}))
		if err == nil {
			out = r.Msg.GetLayers()
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list layers: %w", err)
	}
	return out, nil
}

// LayerOptions tune ImportLayer; nil takes the defaults.
type LayerOptions struct {
	// AllowSetuid keeps setuid and setgid files and file capabilities,
	// which an import refuses otherwise.
	AllowSetuid bool
	// Upload streams path from this machine (a directory packed as a tar
	// archive as it is sent, or an archive file as it is) instead of naming
	// a path on the daemon's host: a cluster's client does this. Nothing
	// holds the whole archive; an edge refuses one over its
	// --max-upload-bytes.
	Upload bool
	// Project is the project the layer belongs to (a path; "" the
	// token's), on which the caller holds builder; its bytes are charged
	// to the project's quota (layer_bytes).
	Project string
}

// ImportLayer builds a layer named ref from a directory or tar archive on
// the daemon's host, or with Upload on this one. The layer's Warnings say
// what the import left out (device nodes under /dev: every sandbox gets
// its own).
func (c *Client) ImportLayer(ctx context.Context, ref string, kind dsecv1.LayerKind, path string, o *LayerOptions) (*dsecv1.Layer, error) {
	ctx, cancel := withTimeout(ctx, 10*time.Minute)
	defer cancel()
	if o == nil {
		o = &LayerOptions{}
	}
	if o.Upload {
		l, err := c.uploadLayer(ctx, &dsecv1.UploadLayerHeader{Ref: ref, Kind: kind, AllowSetuid: o.AllowSetuid, Project: o.Project}, path)
		if err != nil {
			return nil, fmt.Errorf("upload layer %s: %w", ref, err)
		}
		return l, nil
	}
	req := &dsecv1.ImportLayerRequest{Ref: ref, Kind: kind, Path: path, AllowSetuid: o.AllowSetuid, Project: o.Project}
	r, err := c.layers.ImportLayer(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("import layer %s: %w", ref, fromConnect(err, false))
	}
	return r.Msg, nil
}

// RemoveLayer removes a layer's ref (name:tag; the layer goes with its
// last ref), an image, or a layer by digest, from every node. Only a
// builder of the layer's project removes it; its bytes go back to the
// project's quota.
func (c *Client) RemoveLayer(ctx context.Context, ref string) error {
	_, err := c.layers.RemoveLayer(ctx, connect.NewRequest(&dsecv1.RemoveLayerRequest{Ref: ref}))
	if err != nil {
		return fmt.Errorf("remove layer %s: %w", ref, fromConnect(err, false))
	}
	return nil
}

// ShareLayer shares a layer or an image (name:tag) of a project the token
// holds builder on with project (a path), read-only: that project and
// everything under it may list it, make sandboxes from it and fork them,
// never remove, overwrite or share it. It returns the projects ref is
// shared with now. Sharing again changes nothing.
func (c *Client) ShareLayer(ctx context.Context, ref, project string) ([]string, error) {
	return c.share(ctx, ref, project, false)
}

// UnshareLayer takes a share away; one that is not there changes nothing.
func (c *Client) UnshareLayer(ctx context.Context, ref, project string) ([]string, error) {
	return c.share(ctx, ref, project, true)
}

// ShareSnapshot is ShareLayer of snapshot name (its layer snap:NAME).
func (c *Client) ShareSnapshot(ctx context.Context, name, project string) ([]string, error) {
	return c.share(ctx, "snap:"+name, project, false)
}

// UnshareSnapshot is UnshareLayer of snapshot name.
func (c *Client) UnshareSnapshot(ctx context.Context, name, project string) ([]string, error) {
	return c.share(ctx, "snap:"+name, project, true)
}

func (c *Client) share(ctx context.Context, ref, project string, unshare bool) ([]string, error) {
	var out []string
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.layers.ShareLayer(ctx, connect.NewRequest(&dsecv1.ShareLayerRequest{Ref: ref, Project: project, Unshare: unshare}))
		if err == nil {
			out = r.Msg.GetSharedWith()
		}
		return err
	})
	verb := "share"
	if unshare {
		verb = "unshare"
	}
	if err != nil {
		return nil, fmt.Errorf("%s %s with project %s: %w", verb, ref, project, err)
	}
	return out, nil
}

// ListEnvironments lists the environments sandboxes were made from.
func (c *Client) ListEnvironments(ctx context.Context) ([]*dsecv1.Environment, error) {
	var out []*dsecv1.Environment
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.layers.ListEnvironments(ctx, connect.NewRequest(&dsecv1.ListEnvironmentsRequest{}))
		if err == nil {
			out = r.Msg.GetEnvironments()
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list environments: %w", err)
	}
	return out, nil
}
