// Package sandbox is the edge: it owns the sandboxes of one node. It names
// and admits or refuses creates, keeps warm pools of started sandboxes that
// matching creates take, composes each sandbox from its environment's layers,
// launches it through the runtime of its kind (package backend: one per
// isolation and profile the node offers, routed by the isolation and
// backend in the sandbox's record; see Kind),
// keeps the channel to its agent, reaps sandboxes past their TTL or idle
// timeout, notices the ones that died (from the end of a watch connection
// each agent holds, not by asking), and persists every record so that a
// restarted edge re-adopts what is still running.
//
// A sandbox's life is one state machine (states.go): a table of which call
// is legal in which phase, a list of the phase changes there are, and one
// function that makes each. Warm pool members are in it (a pooled mark on
// their state; a create's claim is a transition), and so are tombstones
// (the stopped and failed states).
package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	"dsec.dev/dsec/api/gen/dsec/agent/v1/agentv1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/edge/netctl"
	"dsec.dev/dsec/internal/edge/provenance"
	"dsec.dev/dsec/internal/edge/state"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/grade"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/qos"
	"dsec.dev/dsec/internal/sandboxid"
	"dsec.dev/dsec/internal/sandboxpage"
)

// Images resolves environments to mounted layers. *layers.Service
// implements it.
type Images interface {
	// ResolveEnvironment may adopt parts of env the node lacks from the
	// blob store another node published them to.
	ResolveEnvironment(ctx context.Context, env string) ([]image.Layer, error)
	// Mount makes layer digest available to sandbox id and describes it
	// for the sandbox's runtime: its image file and where it is mounted.
	Mount(ctx context.Context, id, digest string) (backend.Layer, error)
	// Release drops what Mount made for sandbox id alone.
	Release(ctx context.Context, id string)
	RecordEnvironment(env string, digests []string) error
}

// Defaults fill in what a SandboxSpec leaves at zero.
type Defaults struct {
	CPUs        float64
	MemoryMB    int64
	DiskMB      int64
	Pids        int64
	TTL         time.Duration
	IdleTimeout time.Duration
	User        string
}

// Limits bound what one sandbox may ask for and how many a node holds; 0
// leaves a limit unchecked. dsecd derives them from the node unless its
// flags set them (see daemon.Config), and a refusal names the flag.
type Limits struct {
	MaxSandboxes int     // dsecd --max-sandboxes; warm pool members count only for refills
	MaxCPUs      float64 // dsecd --max-cpus
	MaxMemoryMB  int64   // dsecd --max-memory-mb
	MaxDiskMB    int64
	MaxTTL       time.Duration
	// MinAvailableMB refuses creates while the node's MemAvailable is lower.
	MinAvailableMB int64
}

// DefaultStartTimeout is how long a new sandbox's agent may take to
// answer when Config.StartTimeout is 0.
const DefaultStartTimeout = 15 * time.Second

// Config is the edge's configuration.
type Config struct {
	Node string // node name, part of every sandbox ID
	// Slot and Generation are the node's place in the cluster's registry,
	// also in every sandbox ID (package sandboxid); 0 without a registry.
	Slot       uint16
	Generation uint32
	StateDir   string // where sandbox records and agent sockets live
	Defaults   Defaults
	Limits     Limits
	// OutputLimit is the output every agent keeps per command and stream
	// for a later attach; 0 leaves the agent's default.
	OutputLimit int64
	// StartTimeout bounds how long a new agent may take to answer.
	StartTimeout time.Duration
	// PingInterval is how often the agent of a sandbox is pinged when it
	// holds no watch connection (an agent older than them, re-adopted);
	// every other agent is asked only when its idle timeout would end it.
	PingInterval time.Duration
	// TombstoneTTL is how long a stopped or failed sandbox stays visible.
	TombstoneTTL time.Duration
	// MaxWarm bounds the sandboxes all warm pools of the node hold
	// together (default 256); WarmStarts bounds how many a refill starts
	// at once (default 2).
	MaxWarm    int
	WarmStarts int
	// PausedRetention is how long a sandbox may stay paused before it is
	// stopped (REASON_PAUSED_TOO_LONG); 0 = 7 days.
	PausedRetention time.Duration
	// PauseReleases says in words what a pause can release on this node
	// (see package swap); nil = not known.
	PauseReleases func() string
	// Missing says why the node lacks an isolation it has no runtime of
	// ("no runsc: ..."), for the refusal of a create asking for it and the
	// node's status; an isolation absent here is refused as not built in.
	Missing map[dsecv1.Isolation]string
	// Metrics records creates, deletes, pauses, warm-pool hits and
	// admission refusals; nil records nothing.
	Metrics *metrics.Edge
	// Reads watches sandboxes' protected paths (their spec's provenance);
	// nil: reads are not seen, and provenance says so.
	Reads ReadWatcher
	// Syscalls records the syscalls sandboxes' profiles refused; nil:
	// they are not seen, and provenance says so.
	Syscalls SyscallRecorder
	// ProvenanceOff records no provenance (dsecd --no-provenance): no
	// baseline at start, no watch, and Provenance returns only what is
	// unseen.
	ProvenanceOff bool
	// Events receives the lifecycle events of the node's sandboxes (pooled
	// ones only once a create claims them); nil records none.
	Events *eventlog.Log
	// Ledger receives what the node's sandboxes use (package ledger),
	// sampled every LedgerInterval (0: ledger.DefaultInterval) and a last
	// time before each goes; nil keeps no ledger (dsecd --no-ledger).
	Ledger         *ledger.Ledger
	LedgerInterval time.Duration
}

// Manager is the edge of one node. Create it with New, then call Recover
// once before serving; Shutdown leaves sandboxes running, Teardown removes
// them all.
type Manager struct {
	cfg      Config
	runtimes map[Kind]backend.Runtime // the node's runtimes, one per kind it offers
	images   Images
	net      Network   // nil: the node offers loopback only
	snaps    Snapshots // nil: snapshots are refused
	states   *state.Store
	log      *slog.Logger

	mu        sync.Mutex
	sandboxes map[string]*sandbox
	ended     uint64    // sandboxes that stopped living since started (under mu)
	started   time.Time // when this Manager began counting ended

	poolMu   sync.Mutex
	pools    map[string]*pool
	poolKick chan struct{}
	lastTake time.Time // guarded by poolMu
	// cold counts creates starting a container for a caller; refills wait
	// while any does.
	cold atomic.Int32

	stop chan struct{}
	wg   sync.WaitGroup

	coreSched qos.CoreSched // the node's, read once by New
	hostCPU   *hostCPU      // the host's busy CPUs, for Status

	// life ends at Shutdown, and with it every sandbox's watch (watchers
	// counts them); shut says Shutdown began, after which no watch starts.
	// shut is guarded by mu.
	life     context.Context
	endLife  context.CancelFunc
	watchers sync.WaitGroup
	shut     bool
}

type sandbox struct {
	// op serializes the sandbox's transitions (pause, resume, snapshot,
	// stop); it is taken before mu, never while holding it.
	op sync.Mutex
	td teardown // what the sandbox holds; guarded by op once it runs
	// rt is the runtime of the sandbox's backend; nil for a tombstone.
	rt backend.Runtime

	mu         sync.Mutex
	rec        *dsecv1.Sandbox
	agent      agentclient.Client
	lastActive time.Time
	// running is the agent's count of live processes at the last ping.
	running   int32
	inflight  int // API calls in progress
	calls     int // of which calls not yet started (AgentStarting), which a pause waits for
	pingFails int
	// unwatch ends the sandbox's watch (see watch); nil before it starts.
	unwatch context.CancelFunc
	// polled: the agent holds no watch connection, so it is pinged every
	// PingInterval instead.
	polled bool
	gone   time.Time // when it stopped or failed; zero while alive; written under both mu and Manager.mu
	// pool is the key of the warm pool the sandbox waits in, "" once taken
	// (or never pooled). Guarded by Manager.mu, not mu.
	pool string
	// cpuAt is the CPU time of the last Metrics reading and when it was
	// taken, for the next one's CPU percentage. Guarded by mu.
	cpuAt cpuSample
	// samples are the sandbox's recent use as observe read it, oldest
	// first, for Metrics' history (see keepSample). Guarded by mu.
	samples []*dsecv1.MetricsSample
	// baseline is the writable layer as the sandbox started, for its
	// provenance; nil where the runtime does not show the layer. Guarded
	// by mu.
	baseline provenance.Baseline
	// syscallsSince is when this edge began to record the sandbox's
	// refused syscalls after a restart re-adopted it (zero for a sandbox
	// it started: from its start). Guarded by mu.
	syscallsSince time.Time
	// unwatched are the protected paths the last watch could not mark,
	// each with why (a path missing then): reads of them are not seen,
	// and Provenance says so in unseen. Guarded by mu.
	unwatched []string
	// token is the create token of the create that made (or took) it, ""
	// for none; kept on disk beside the record (state.SaveToken). Guarded by
	// Manager.mu, not mu.
	token string
}

// New makes a Manager over the node's runtimes, one per kind it offers
// (each already Init'ed). It does not touch any sandbox until Recover. net
// may be nil: sandboxes then get loopback only and network rules are
// refused.
func New(cfg Config, runtimes map[Kind]backend.Runtime, images Images, net Network, log *slog.Logger) (*Manager, error) {
	if cfg.Node == "" || strings.ContainsAny(cfg.Node, "/ ") {
		return nil, fmt.Errorf("node name %q: %w", cfg.Node, errdefs.ErrInvalidArgument)
	}
	if len(runtimes) == 0 {
		return nil, fmt.Errorf("edge of node %s: no runtime: %w", cfg.Node, errdefs.ErrInvalidArgument)
	}
	for k, rt := range runtimes {
		if k != k.normal() || rt == nil {
			return nil, fmt.Errorf("edge of node %s: runtime %v for kind %v: %w", cfg.Node, rt, k, errdefs.ErrInvalidArgument)
		}
	}
	if cfg.StartTimeout == 0 {
		cfg.StartTimeout = DefaultStartTimeout
	}
	if cfg.PingInterval == 0 {
		cfg.PingInterval = 2 * time.Second
	}
	if cfg.TombstoneTTL == 0 {
		cfg.TombstoneTTL = 10 * time.Minute
	}
	if cfg.MaxWarm == 0 {
		cfg.MaxWarm = 256
	}
	if cfg.WarmStarts == 0 {
		cfg.WarmStarts = 2
	}
	if cfg.PausedRetention == 0 {
		cfg.PausedRetention = 7 * 24 * time.Hour
	}
	st, err := state.New(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	life, endLife := context.WithCancel(context.Background())
	m := &Manager{
		cfg: cfg, runtimes: maps.Clone(runtimes), images: images, net: net, states: st, log: log,
		sandboxes: make(map[string]*sandbox),
		started:   time.Now(),
		pools:     make(map[string]*pool),
		poolKick:  make(chan struct{}, 1),
		stop:      make(chan struct{}),
		life:      life,
		endLife:   endLife,
		coreSched: qos.CoreScheduling(),
		hostCPU:   newHostCPU(),
	}
	// A layer service that can take snapshot layers makes snapshots
	// possible.
	if sn, ok := images.(Snapshots); ok {
		m.snaps = sn
	}
	return m, nil
}

// Node is the name of the node this edge owns.
func (m *Manager) Node() string { return m.cfg.Node }

// NewID returns a fresh sandbox ID that names this node.
func (m *Manager) NewID() string { return sandboxid.New(m.cfg.Node, m.cfg.Slot, m.cfg.Generation) }

// Create makes a sandbox from spec and names it: it takes one from the warm
// pool of spec's shape when that holds one, else starts one, and returns
// once its agent answers. On any failure everything made so far is removed.
// The sandbox keeps token (the create's, "" for none) for SandboxOf and
// Tokens, on disk too, so a restarted edge still knows it.
func (m *Manager) Create(ctx context.Context, spec *dsecv1.SandboxSpec, token string) (rec *dsecv1.Sandbox, err error) {
	begin := time.Now()
	kind := KindOf(spec)
	defer func() {
		m.cfg.Metrics.Create(BackendName(kind.Profile), IsolationName(kind.Isolation), err, time.Since(begin))
	}()
	spec, err = m.applyDefaults(spec)
	if err != nil {
		return nil, err
	}
	if err := CheckProvenancePaths(spec.GetProvenance()); err != nil {
		return nil, err
	}
	if rec := m.takeWarm(ctx, spec, token); rec != nil {
		m.cfg.Metrics.Pool(true)
		m.startProvenance(ctx, rec.GetId())
		return rec, nil
	}
	m.cfg.Metrics.Pool(false)
	if err := m.admit(false); err != nil {
		m.cfg.Metrics.Refused(refusalReason(err))
		return nil, err
	}
	m.cold.Add(1)
	defer m.cold.Add(-1)
	sb, err := m.start(ctx, m.NewID(), spec, "", token, nil)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	rec = cloneRec(sb.rec)
	sb.mu.Unlock()
	m.startProvenance(ctx, rec.GetId())
	return rec, nil
}

// start launches sandbox id from spec (defaults already applied) for the
// create token names, and returns it running. A non-empty poolKey makes it
// a member of that warm pool: invisible to Get and List, with no expiry
// until it is taken. With from it is a child of a fork: its layers are
// the parent's and its runtime starts it from the parent's save.
func (m *Manager) start(ctx context.Context, id string, spec *dsecv1.SandboxSpec, poolKey, token string, from *forkSource) (*sandbox, error) {
	rt, err := m.runtimeOf(KindOf(spec))
	if err != nil {
		return nil, err
	}
	var layers []image.Layer
	if from != nil {
		for _, d := range from.digests {
			layers = append(layers, image.Layer{Digest: d})
		}
	} else if layers, err = m.images.ResolveEnvironment(ctx, spec.GetEnvironment()); err != nil {
		// The image store's errors name the environment and what is wrong with it.
		return nil, err
	}
	now := time.Now()
	rec := &dsecv1.Sandbox{
		Id: id, Node: m.cfg.Node, Spec: spec, State: dsecv1.State_STATE_CREATING,
		CreatedUnixMs: now.UnixMilli(),
	}
	sb := &sandbox{rec: rec, rt: rt, lastActive: now, pool: poolKey, token: token}
	// The create is the sandbox's first transition: a delete or pause
	// meanwhile waits for it.
	sb.op.Lock()
	defer sb.op.Unlock()
	m.mu.Lock()
	if _, dup := m.sandboxes[id]; dup {
		m.mu.Unlock()
		return nil, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrAlreadyExists)
	}
	m.sandboxes[id] = sb
	m.mu.Unlock()

	// Each resource is registered in the sandbox's teardown as it is
	// acquired; a failure releases what there is, in reverse, even if
	// the caller has gone.
	td := &sb.td
	fail := func(cause error) error {
		if err := td.run(ctx); err != nil {
			m.log.Warn("remove half-made sandbox", "id", id, "err", err)
		}
		m.mu.Lock()
		delete(m.sandboxes, id)
		m.mu.Unlock()
		m.log.Info("sandbox create failed", "id", id, "err", cause)
		return cause
	}
	m.hold(td, resRecord, id, rt)
	if token != "" {
		if err := m.states.SaveToken(id, token); err != nil {
			return nil, fail(err)
		}
	}
	if err := m.states.Save(rec); err != nil {
		return nil, fail(err)
	}
	tResolved := time.Now()
	m.hold(td, resLayers, id, rt)
	var mounted []backend.Layer
	for _, l := range layers {
		desc, err := m.images.Mount(ctx, id, l.Digest)
		if err != nil {
			return nil, fail(fmt.Errorf("mount layer %s: %w", l.Digest, err))
		}
		mounted = append(mounted, desc)
		sb.mu.Lock()
		rec.LayerDigests = append(rec.LayerDigests, l.Digest)
		sb.mu.Unlock()
	}
	var att *netctl.Attachment
	if len(spec.GetNetworkRules()) > 0 {
		m.hold(td, resNetwork, id, rt)
		att, err = m.net.Attach(ctx, id, spec.GetNetworkRules())
		if err != nil {
			return nil, fail(fmt.Errorf("attach sandbox %s to the network: %w", id, err))
		}
		sb.mu.Lock()
		rec.Address = att.Addr
		rec.Warnings = att.Warnings
		sb.mu.Unlock()
	}
	tPrepared := time.Now()
	m.hold(td, resContainer, id, rt)
	client, err := m.launch(ctx, rt, id, spec, mounted, att, from)
	if err != nil {
		return nil, fail(err)
	}
	started := time.Now()
	sb.mu.Lock()
	sb.agent = client
	rec.StartedUnixMs = started.UnixMilli()
	if poolKey == "" {
		rec.ExpiresUnixMs = started.Add(time.Duration(spec.GetTtlSeconds()) * time.Second).UnixMilli()
		if spec.GetPhases() != nil {
			enterPhase(rec, dsecv1.Phase_PHASE_SETUP, started)
		}
	}
	rec.LastActiveUnixMs = started.UnixMilli()
	sb.lastActive = started
	err = m.transition(sb, phase{dsecv1.State_STATE_RUNNING, poolKey != ""})
	sb.mu.Unlock()
	if err != nil {
		return nil, fail(err)
	}
	m.watch(sb)
	if poolKey == "" {
		if err := m.images.RecordEnvironment(spec.GetEnvironment(), rec.LayerDigests); err != nil {
			m.log.Warn("record environment use", "env", spec.GetEnvironment(), "err", err)
		}
	}
	m.log.Debug("sandbox running", "id", id, "env", spec.GetEnvironment(), "took", time.Since(now),
		"resolve", tResolved.Sub(now), "layers_and_record", tPrepared.Sub(tResolved), "launch", started.Sub(tPrepared),
		"warm_pool", poolKey)
	return sb, nil
}

// launch starts the sandbox in its backend's runtime, which makes the
// agent channel, and waits for the agent to answer on it; a fork's child
// starts from its parent's save (Forker.StartFork).
func (m *Manager) launch(ctx context.Context, rt backend.Runtime, id string, spec *dsecv1.SandboxSpec, layers []backend.Layer, att *netctl.Attachment, from *forkSource) (agentclient.Client, error) {
	dir := m.states.Dir(id)
	agent := backend.Agent{User: spec.GetUser(), Workdir: spec.GetWorkdir(), Hostname: spec.GetHostname(), OutputLimit: m.cfg.OutputLimit}
	// A mirror's variables (PIP_INDEX_URL and the like) come first, so the
	// caller's own env wins.
	env := map[string]string{}
	if att != nil {
		agent.Address = att.Addr
		maps.Copy(env, att.Env)
	}
	maps.Copy(env, spec.GetEnv())
	if len(env) > 0 {
		agent.Env = env
	}

	hostname := spec.GetHostname()
	if hostname == "" {
		hostname = id
		if len(hostname) > 63 {
			hostname = hostname[:63]
		}
	}
	var err error
	rs := backend.Spec{
		ID:          id,
		Layers:      layers,
		DiskBytes:   spec.GetDiskMb() << 20,
		CPUs:        spec.GetCpus(),
		MemoryBytes: spec.GetMemoryMb() << 20,
		Pids:        spec.GetPids(),
		Hostname:    hostname,
		Agent:       agent,
		QoS:         qos.Class(spec.GetQos()),

		AllowPrivilegeEscalation: spec.GetAllowPrivilegeEscalation(),
		LogPath:                  filepath.Join(dir, "agent.log"),
	}
	if att != nil {
		rs.NetnsPath, rs.ResolvConf = att.NetnsPath, att.ResolvConf
	}
	var dial backend.Dialer
	if from != nil {
		dial, err = from.forker.StartFork(ctx, from.save, rs)
	} else {
		dial, err = rt.Start(ctx, rs)
	}
	if err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", id, err)
	}
	tStarted := time.Now()
	client := agentclient.New(dial)
	if err := m.waitReady(ctx, id, client); err != nil {
		client.Close()
		return nil, err
	}
	m.log.Debug("agent answered", "id", id, "after", time.Since(tStarted))
	return client, nil
}

func (m *Manager) waitReady(ctx context.Context, id string, client agentv1connect.AgentServiceClient) error {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.StartTimeout)
	defer cancel()
	delay := time.Millisecond
	for {
		pctx, pcancel := context.WithTimeout(ctx, time.Second)
		_, err := client.Ping(pctx, connect.NewRequest(&agentv1.PingRequest{}))
		pcancel()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("sandbox %s: agent did not answer within %s: %v: %w", id, m.cfg.StartTimeout, err, errdefs.ErrDeadlineExceeded)
		case <-time.After(delay):
		}
		delay = min(delay*2, 50*time.Millisecond)
	}
}

func (m *Manager) applyDefaults(in *dsecv1.SandboxSpec) (*dsecv1.SandboxSpec, error) {
	if in == nil {
		return nil, fmt.Errorf("sandbox spec is missing: %w", errdefs.ErrInvalidArgument)
	}
	spec := cloneSpec(in)
	d, l := m.cfg.Defaults, m.cfg.Limits
	if spec.GetEnvironment() == "" {
		return nil, fmt.Errorf("environment is required (BASE[+LAYER...]): %w", errdefs.ErrInvalidArgument)
	}
	if len(spec.GetNetworkRules()) > 0 && m.net == nil {
		return nil, fmt.Errorf("node %s runs without network support, so it cannot enforce network rules; refusing to run a sandbox with a different network than asked: %w", m.cfg.Node, errdefs.ErrFailedPrecondition)
	}
	for k := range spec.GetLabels() {
		if strings.HasPrefix(k, "dsec.dev/") && k != iam.ProjectLabel && k != grade.GradeOfLabel {
			return nil, fmt.Errorf("label %q: the dsec.dev/ prefix is reserved for dsec itself: %w", k, errdefs.ErrInvalidArgument)
		}
	}
	if spec.Cpus < 0 || spec.MemoryMb < 0 || spec.DiskMb < 0 || spec.Pids < 0 || spec.TtlSeconds < 0 {
		return nil, fmt.Errorf("cpus, memory_mb, disk_mb, pids and ttl_seconds must not be negative: %w", errdefs.ErrInvalidArgument)
	}
	if spec.Cpus == 0 {
		spec.Cpus = d.CPUs
	}
	if spec.MemoryMb == 0 {
		spec.MemoryMb = d.MemoryMB
	}
	if spec.DiskMb == 0 {
		spec.DiskMb = d.DiskMB
	}
	if spec.Pids == 0 {
		spec.Pids = d.Pids
	}
	if ttl, err := phaseTTL(spec.GetPhases()); err != nil {
		return nil, err
	} else if ttl > 0 {
		if spec.TtlSeconds != 0 && spec.TtlSeconds < ttl {
			return nil, fmt.Errorf("ttl %ds is less than the phase budgets' sum and margin, %ds: %w", spec.TtlSeconds, ttl, errdefs.ErrInvalidArgument)
		}
		spec.TtlSeconds = max(spec.TtlSeconds, ttl)
		if spec.IdleTimeoutSeconds == 0 {
			spec.IdleTimeoutSeconds = -1 // the phases bound the life
		}
	}
	if spec.TtlSeconds == 0 {
		spec.TtlSeconds = int64(d.TTL / time.Second)
	}
	if spec.IdleTimeoutSeconds == 0 {
		spec.IdleTimeoutSeconds = int64(d.IdleTimeout / time.Second)
	}
	if spec.User == "" {
		spec.User = d.User
	}
	kind := KindOf(spec)
	spec.Isolation, spec.Backend = kind.Isolation, kind.Profile
	rt, err := m.runtimeOf(kind)
	if err != nil {
		return nil, err
	}
	if spec.GetOnTimeout() == dsecv1.OnTimeout_ON_TIMEOUT_PAUSE && !rt.Features().Pause {
		return nil, fmt.Errorf("on_timeout pause: %w", m.lacks(kind, "pause"))
	}
	if len(spec.GetNetworkRules()) > 0 && !rt.Features().Network {
		return nil, fmt.Errorf("network rules: %w", m.lacks(kind, "give a sandbox a network"))
	}
	switch {
	case l.MaxCPUs > 0 && spec.Cpus > l.MaxCPUs:
		return nil, fmt.Errorf("cpus %.2f is over the node's limit of %.2f (dsecd --max-cpus, limits.max_cpus): %w", spec.Cpus, l.MaxCPUs, errdefs.ErrInvalidArgument)
	case l.MaxMemoryMB > 0 && spec.MemoryMb > l.MaxMemoryMB:
		return nil, fmt.Errorf("memory_mb %d is over the node's limit of %d (dsecd --max-memory-mb): %w", spec.MemoryMb, l.MaxMemoryMB, errdefs.ErrInvalidArgument)
	case l.MaxDiskMB > 0 && spec.DiskMb > l.MaxDiskMB:
		return nil, fmt.Errorf("disk_mb %d is over the node's limit of %d: %w", spec.DiskMb, l.MaxDiskMB, errdefs.ErrInvalidArgument)
	case l.MaxTTL > 0 && time.Duration(spec.TtlSeconds)*time.Second > l.MaxTTL:
		return nil, fmt.Errorf("ttl %ds is over the node's limit of %s: %w", spec.TtlSeconds, l.MaxTTL, errdefs.ErrInvalidArgument)
	}
	if spec.MemoryMb > 0 && spec.MemoryMb < 16 {
		return nil, fmt.Errorf("memory_mb %d is below the 16 MiB a sandbox needs: %w", spec.MemoryMb, errdefs.ErrInvalidArgument)
	}
	return spec, nil
}

// admit refuses a create when the node is full or short of memory. Warm
// pool members count towards full only for a refill (countPooled), so they
// never keep a caller's create out.
func (m *Manager) admit(countPooled bool) error {
	m.mu.Lock()
	live := 0
	for _, sb := range m.sandboxes {
		if sb.gone.IsZero() && (countPooled || sb.pool == "") {
			live++
		}
	}
	m.mu.Unlock()
	if min := m.cfg.Limits.MinAvailableMB; min > 0 {
		if avail, err := memAvailableMB(); err == nil {
			return m.admission(live, avail)
		}
	}
	return m.admission(live, -1)
}

// admission is admit's verdict on a node holding live sandboxes with
// availMB of memory available (<0: not known).
func (m *Manager) admission(live int, availMB int64) error {
	if max := m.cfg.Limits.MaxSandboxes; max > 0 && live >= max {
		return fmt.Errorf("node %s holds its maximum of %d sandboxes (dsecd --max-sandboxes raises it): %w", m.cfg.Node, max, errdefs.ErrResourceExhausted)
	}
	if min := m.cfg.Limits.MinAvailableMB; min > 0 && availMB >= 0 && availMB < min {
		return fmt.Errorf("node %s has %d MiB of memory available, below its floor of %d MiB: %w", m.cfg.Node, availMB, min, errdefs.ErrResourceExhausted)
	}
	return nil
}

// Get returns the sandbox's record, stopped and failed ones included for a
// while after they ended.
func (m *Manager) Get(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	sb, err := m.lookup(id)
	if err != nil {
		return nil, err
	}
	rec := sb.record()
	if m.cfg.PauseReleases != nil && rec.GetState() != dsecv1.State_STATE_STOPPED && rec.GetState() != dsecv1.State_STATE_FAILED {
		rec.PauseReleases = m.cfg.PauseReleases()
	}
	return rec, nil
}

// Gone returns those of ids that name no live sandbox: ended, unknown, or
// waiting in a warm pool (nobody's yet).
func (m *Manager) Gone(ids []string) []string {
	var out []string
	for _, id := range ids {
		sb, err := m.lookup(id)
		if err != nil {
			out = append(out, id)
			continue
		}
		sb.mu.Lock()
		st := sb.rec.GetState()
		sb.mu.Unlock()
		if !Live(st) {
			out = append(out, id)
		}
	}
	return out
}

// List returns the sandboxes whose labels include labels and whose state is
// one of states (any, when empty), oldest first.
func (m *Manager) List(ctx context.Context, labels map[string]string, states []dsecv1.State) ([]*dsecv1.Sandbox, error) {
	out, _, err := m.Query(ctx, sandboxpage.Query{Labels: labels, States: states})
	sort.Slice(out, func(i, j int) bool {
		if out[i].CreatedUnixMs != out[j].CreatedUnixMs {
			return out[i].CreatedUnixMs < out[j].CreatedUnixMs
		}
		return out[i].Id < out[j].Id
	})
	return out, err
}

// Query answers an edge's List: the records of the sandboxes q matches
// (a warm pool's aside) or, paged, its page of them, and how many match.
// Only the answer's records are copied.
func (m *Manager) Query(ctx context.Context, q sandboxpage.Query) ([]*dsecv1.Sandbox, int, error) {
	m.mu.Lock()
	all := make([]*sandbox, 0, len(m.sandboxes))
	for _, sb := range m.sandboxes {
		if sb.pool == "" {
			all = append(all, sb)
		}
	}
	m.mu.Unlock()
	pick := sandboxpage.NewPick[*sandbox](q)
	for _, sb := range all {
		sb.mu.Lock()
		pick.Offer(sb.rec, sb)
		sb.mu.Unlock()
	}
	page := pick.Page()
	out := make([]*dsecv1.Sandbox, len(page))
	for i, sb := range page {
		out[i] = sb.record()
	}
	return out, pick.Total(), nil
}

// Delete stops the sandbox and removes everything it had. A sandbox that is
// already gone, or was never known, is not an error.
func (m *Manager) Delete(ctx context.Context, id string) error {
	sb, err := m.lookup(id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	begin := time.Now()
	sb.mu.Lock()
	kind := KindOf(sb.rec.GetSpec())
	sb.mu.Unlock()
	err = m.stopSandbox(ctx, sb, dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_DELETED, "deleted by request")
	m.cfg.Metrics.Delete(BackendName(kind.Profile), IsolationName(kind.Isolation), err, time.Since(begin))
	return err
}

// refusalReason is the admission refusals metric's reason for admit's
// error: the node's sandbox maximum or its memory floor.
func refusalReason(err error) string {
	if strings.Contains(err.Error(), "maximum of") {
		return "max_sandboxes"
	}
	return "memory_floor"
}

// Agent returns the channel to a running sandbox's agent. The call counts
// as activity for the idle timeout until release is called, so a long
// stream keeps its sandbox alive.
func (m *Manager) Agent(ctx context.Context, id string) (client agentclient.Client, release func(), err error) {
	return m.agent(ctx, id, nil)
}

// AgentStarting is Agent for a call that a pause must not cut off before
// it has started: a pause waits for started (up to callDrain). A unary
// call (a file read or write, a signal) starts at its end, which release
// implies; a command's stream once its command has started (its first
// event), after which it can re-attach across a microVM's pause to disk,
// which ends the agent channel under every call.
func (m *Manager) AgentStarting(ctx context.Context, id string) (client agentclient.Client, started, release func(), err error) {
	client, release, err = m.agent(ctx, id, &started)
	return client, started, release, err
}

func (m *Manager) agent(ctx context.Context, id string, started *func()) (client agentclient.Client, release func(), err error) {
	err = m.use(ctx, id, func(sb *sandbox) error {
		sb.lastActive = time.Now()
		sb.inflight++
		start := func() {}
		if started != nil {
			sb.calls++
			start = sync.OnceFunc(func() {
				sb.mu.Lock()
				sb.calls--
				sb.mu.Unlock()
			})
			*started = start
		}
		client = sb.agent
		var once sync.Once
		release = func() {
			once.Do(func() {
				start()
				sb.mu.Lock()
				sb.inflight--
				sb.lastActive = time.Now()
				sb.mu.Unlock()
			})
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	return client, release, nil
}

// GoneError says why a sandbox that is no longer running cannot be used.
func GoneError(rec *dsecv1.Sandbox) error {
	why := strings.ToLower(strings.TrimPrefix(rec.GetReason().String(), "REASON_"))
	msg := rec.GetMessage()
	if msg == "" {
		msg = why
	}
	return fmt.Errorf("sandbox %s is %s (%s): %s: %w", rec.GetId(), stateWord(rec.GetState()), why, msg, errdefs.ErrFailedPrecondition)
}

// SandboxOf returns the ID of the live sandbox (not stopping or ended) the
// create token made.
func (m *Manager) SandboxOf(token string) (string, bool) {
	if token == "" {
		return "", false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for id, sb := range m.sandboxes {
		if sb.token == token && sb.pool == "" && sb.live() {
			return id, true
		}
	}
	return "", false
}

// Tokens returns the create token of every live sandbox that has one,
// token to sandbox ID.
func (m *Manager) Tokens() map[string]string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]string{}
	for id, sb := range m.sandboxes {
		if sb.token != "" && sb.pool == "" && sb.live() {
			out[sb.token] = id
		}
	}
	return out
}

// record is a copy of the sandbox's record, its last activity as the edge
// knows it now (calls and checks move it without a save).
func (sb *sandbox) record() *dsecv1.Sandbox {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	rec := cloneRec(sb.rec)
	if sb.gone.IsZero() && sb.lastActive.UnixMilli() > rec.GetLastActiveUnixMs() {
		rec.LastActiveUnixMs = sb.lastActive.UnixMilli()
	}
	return rec
}

// live says whether the sandbox is live (see Live).
func (sb *sandbox) live() bool {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.gone.IsZero() && Live(sb.rec.GetState())
}

func (m *Manager) lookup(id string) (*sandbox, error) {
	m.mu.Lock()
	sb, ok := m.sandboxes[id]
	if ok && sb.pool != "" {
		ok = false // waiting in a warm pool: nobody's sandbox yet
	}
	m.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("no sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	return sb, nil
}

// stopSandbox releases a sandbox's resources (its teardown, last acquired
// first) and leaves a tombstone in the given final state: a caller's
// delete, or the edge's stop (TTL, idle, a dead agent). It is safe to call
// more than once and at any point of the sandbox's life: a paused sandbox
// is thawed and killed; a teardown step that fails stays registered, the
// sandbox stays stopping, and the next call tries again.
func (m *Manager) stopSandbox(ctx context.Context, sb *sandbox, final dsecv1.State, reason dsecv1.Reason, msg string) error {
	return m.stopAs(ctx, sb, callDelete, final, reason, msg)
}

// drop stops a sandbox its warm pool lets go of, unless a create claimed
// it meanwhile: that one is the caller's and stays.
func (m *Manager) drop(ctx context.Context, sb *sandbox, why string) {
	if err := m.stopAs(ctx, sb, callDrop, dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_DELETED, why); err != nil {
		m.log.Warn("drop sandbox from its warm pool", "id", sb.rec.GetId(), "why", why, "err", err)
	}
}

// stopAs is stopSandbox and drop: call c (callDelete or callDrop) as the
// table answers it in the sandbox's phase, under its op lock.
func (m *Manager) stopAs(ctx context.Context, sb *sandbox, c call, final dsecv1.State, reason dsecv1.Reason, msg string) error {
	ctx = context.WithoutCancel(ctx)
	sb.op.Lock()
	defer sb.op.Unlock()
	sb.mu.Lock()
	p, id := sb.phaseOf(), sb.rec.GetId()
	switch v := decide(p, c); {
	case v == allow:
		if err := m.transitionLogged(sb, phase{dsecv1.State_STATE_STOPPING, p.pooled}); err != nil {
			sb.mu.Unlock()
			return fmt.Errorf("stop sandbox %s: %w", id, err)
		}
	case v == noop && p.state == dsecv1.State_STATE_STOPPING && (c == callDelete || p.pooled):
		// A teardown that failed midway: this call tries again.
	case v == noop:
		sb.mu.Unlock()
		return nil
	default:
		err := refusal(sb.rec, v, c)
		sb.mu.Unlock()
		return fmt.Errorf("stop sandbox %s: %w", id, err)
	}
	if sb.unwatch != nil {
		// Its agent is about to end: that is no news.
		sb.unwatch()
	}
	sb.mu.Unlock()

	if err := sb.td.run(ctx); err != nil {
		return fmt.Errorf("stop sandbox %s: %w", id, err)
	}
	m.mu.Lock() // gone is read under either lock
	sb.mu.Lock()
	sb.rec.Reason = reason
	sb.rec.Message = msg
	err := m.transition(sb, phase{final, p.pooled})
	if err == nil {
		m.ended++
		if sb.agent != nil {
			sb.agent.Close()
		}
		sb.agent = nil
	}
	sb.mu.Unlock()
	m.mu.Unlock()
	if err != nil {
		return fmt.Errorf("stop sandbox %s: %w", id, err)
	}
	level := slog.LevelDebug
	if final == dsecv1.State_STATE_FAILED {
		level = slog.LevelWarn
	}
	if m.cfg.Reads != nil {
		m.cfg.Reads.Forget(id)
	}
	if m.cfg.Syscalls != nil {
		m.cfg.Syscalls.Forget(id)
	}
	m.log.Log(ctx, level, "sandbox ended", "id", id, "state", final.String(), "reason", reason.String(), "message", msg)
	return nil
}

func cloneRec(r *dsecv1.Sandbox) *dsecv1.Sandbox { return proto.Clone(r).(*dsecv1.Sandbox) }

func cloneSpec(s *dsecv1.SandboxSpec) *dsecv1.SandboxSpec {
	if s == nil {
		return nil
	}
	return proto.Clone(s).(*dsecv1.SandboxSpec)
}

// Status is the node's load as the apiservers' watchers see it.
type Status struct {
	Node           string
	Backends       []dsecv1.Backend // the profiles of Kinds, in the enum's order
	MaxSandboxes   int
	Live           int // creating or running for callers
	Creating       int
	Pooled         int // idle in warm pools
	MaxCPUs        float64
	MaxMemoryMB    int64
	MemAvailableMB int64
	// The host's CPUs, how many were busy on average over the last second
	// or more (-1: not known yet), and its memory (0: not known): what
	// the console's nodes page shows.
	CPUs       float64
	CPUBusy    float64
	MemTotalMB int64
	// Refusing says why admission refuses creates now; "" when it takes them.
	Refusing string
	At       time.Time
	// Ended counts the sandboxes that stopped living since Started, when
	// this edge began counting (its process started).
	Ended   uint64
	Started time.Time
	// Kinds are the isolations and profiles the node offers, with their
	// accelerators; Missing says why it lacks the isolations it lacks.
	Kinds   []*dsecv1.SandboxKind
	Missing map[string]string
	// CoreSched says whether latency sandboxes get a core-scheduling
	// cookie here, and why not.
	CoreSched qos.CoreSched
}

// Status reports the node's capacity and load now.
func (m *Manager) Status() Status {
	st := Status{Node: m.cfg.Node, Backends: m.Backends(), Kinds: m.kindInfos(), Missing: m.Missing(), MaxSandboxes: m.cfg.Limits.MaxSandboxes, MaxCPUs: m.cfg.Limits.MaxCPUs,
		MaxMemoryMB: m.cfg.Limits.MaxMemoryMB, At: time.Now(), Started: m.started, CoreSched: m.coreSched,
		CPUBusy: -1}
	if m.hostCPU != nil {
		st.CPUBusy = m.hostCPU.Busy(st.At)
	}
	// The host's online CPUs, which the busy figure is over.
	st.CPUs = float64(m.hostCPU.CPUs())
	if t, err := meminfoMB("MemTotal"); err == nil {
		st.MemTotalMB = t
	}
	m.mu.Lock()
	st.Ended = m.ended
	for _, sb := range m.sandboxes {
		if !sb.gone.IsZero() {
			continue
		}
		if sb.pool != "" {
			st.Pooled++
			continue
		}
		st.Live++
		sb.mu.Lock()
		if sb.rec.GetState() == dsecv1.State_STATE_CREATING {
			st.Creating++
		}
		sb.mu.Unlock()
	}
	m.mu.Unlock()
	avail := int64(-1)
	if a, err := memAvailableMB(); err == nil {
		avail, st.MemAvailableMB = a, a
	}
	// The counts and the memory just read, not a second pass of admit.
	if err := m.admission(st.Live, avail); err != nil {
		st.Refusing = err.Error()
	}
	return st
}
