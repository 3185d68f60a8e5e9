package sandbox

import (
	"context"
	"errors"
	"fmt"
	"path"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/provenance"
	"dsec.dev/dsec/internal/errdefs"
)

// ReadWatcher records opens of sandboxes' protected paths.
// *provenance.Watcher implements it.
type ReadWatcher interface {
	// Watch marks sandbox id's protected paths, seen through root, whose
	// agent (its opens are the API's, not counted) runs as host pid agent;
	// it returns the paths it could not mark, with why.
	Watch(id, root string, agent int, paths []string) ([]string, error)
	Reads(id string) []*dsecv1.ProvenanceRead
	Forget(id string)
}

// SyscallRecorder records the syscalls sandboxes' seccomp profiles
// refused, by the audit session each sandbox's processes share.
// *provenance.SyscallLog implements it.
type SyscallRecorder interface {
	Track(id string, session uint32) error
	Denials(id string) (provenance.Denials, bool)
	Forget(id string)
}

// maxNetworkEvents bounds the audit records a provenance summarises.
const maxNetworkEvents = 100_000

// Provenance gathers what the host sees of how sandbox id's state came to
// be (see package provenance): its writable layer scanned against its
// layers, protected reads, network attempts, processes running now and
// packages installed, with the flags. The writable layer of a sandbox whose
// runtime is no Inspector is read from a capture, for which the sandbox is
// frozen a moment (a microVM). With flagsOnly the file list stays empty.
func (m *Manager) Provenance(ctx context.Context, id string, flagsOnly bool) (*dsecv1.SandboxProvenance, error) {
	sb, err := m.lookup(id)
	if err != nil {
		return nil, err
	}
	rec := sb.record()
	if !sb.live() {
		return nil, fmt.Errorf("provenance of %s: %w", id, GoneError(rec))
	}
	paths := rec.GetSpec().GetProvenance()
	kind := KindOf(rec.GetSpec())
	if m.cfg.ProvenanceOff {
		return &dsecv1.SandboxProvenance{
			SandboxId: id, Isolation: IsolationName(kind.Isolation), TakenUnixMs: time.Now().UnixMilli(),
			Paths: paths, Flags: &dsecv1.ProvenanceFlags{}, Unseen: []string{"all: this node records no provenance (dsecd --no-provenance)"},
		}, nil
	}
	p := &dsecv1.SandboxProvenance{
		SandboxId: id, Isolation: IsolationName(kind.Isolation), TakenUnixMs: time.Now().UnixMilli(),
		Paths: paths, Unseen: unseenBy(kind.Isolation),
	}
	if d, ok := m.denials(id); ok {
		p.SyscallsDenied, p.SyscallSamples = d.Syscalls, d.Samples
		p.SyscallSamplesDropped, p.SyscallRecordsLost = d.SamplesDropped, d.Lost
		sb.mu.Lock()
		since := sb.syscallsSince
		sb.mu.Unlock()
		if !since.IsZero() {
			p.Unseen = append([]string{"syscalls_denied: refusals before the edge restarted (" + since.UTC().Format(time.RFC3339) + ") are not counted"}, p.Unseen...)
		}
	} else {
		p.Unseen = append([]string{"syscalls_denied: " + m.syscallsUnseen(kind.Isolation)}, p.Unseen...)
	}
	// A protected path missing when it was marked has no watch: its reads
	// are not seen (mark it again once it exists).
	sb.mu.Lock()
	for _, u := range sb.unwatched {
		p.Unseen = append(p.Unseen, "protected_read: "+u+" (not watched: mark the paths again once it exists)")
	}
	sb.mu.Unlock()
	// The processes first: a grade asks for them as it starts.
	ps, err := m.processes(ctx, sb, id)
	if err != nil {
		return nil, fmt.Errorf("provenance of %s: %w", id, err)
	}
	p.Processes = ps
	scan, err := m.scanLayer(ctx, sb, rec, paths, !flagsOnly)
	if err != nil {
		return nil, fmt.Errorf("provenance of %s: %w", id, err)
	}
	p.FilesWritten, p.FilesWrittenTotal = scan.Files, scan.FilesTotal
	p.Replaced, p.TestsChanged, p.Packages = scan.Replaced, scan.TestsChanged, scan.Packages
	if m.cfg.Reads != nil {
		p.ProtectedReads = m.cfg.Reads.Reads(id)
	}
	if m.net != nil && len(rec.GetSpec().GetNetworkRules()) > 0 {
		events, err := m.net.Log(id, time.Time{}, maxNetworkEvents)
		if err != nil {
			return nil, fmt.Errorf("provenance of %s: %w", id, err)
		}
		p.Network = provenance.Network(events)
	}
	p.Flags = provenance.Flags(p, scan.Outside)
	return p, nil
}

// denials returns what sandbox id's profile refused, if it is tracked.
func (m *Manager) denials(id string) (provenance.Denials, bool) {
	if m.cfg.Syscalls == nil {
		return provenance.Denials{}, false
	}
	return m.cfg.Syscalls.Denials(id)
}

// syscallsUnseen says why a sandbox of isolation i has no record of its
// refused syscalls.
func (m *Manager) syscallsUnseen(i dsecv1.Isolation) string {
	switch {
	case i == dsecv1.Isolation_ISOLATION_GVISOR:
		return "gVisor's sentry applies the seccomp profile and reports no refusal to the host"
	case i == dsecv1.Isolation_ISOLATION_MICROVM:
		return "a microVM's guest kernel runs no profile of ours; nothing in the guest records refusals"
	case m.cfg.Syscalls == nil:
		return "this node reads no audit records (no audit netlink socket)"
	}
	return "not recorded for this sandbox (it may escalate privileges, so its profile is not logged; or it has no audit session of its own)"
}

// trackSyscalls attributes the audit records of the sandbox's refused
// syscalls to it, where its runtime logs them (backend.SyscallAuditor).
func (m *Manager) trackSyscalls(ctx context.Context, sb *sandbox) error {
	au, ok := sb.rt.(backend.SyscallAuditor)
	if m.cfg.Syscalls == nil || !ok {
		return nil
	}
	id := sb.record().GetId()
	session, err := au.AuditSession(ctx, id)
	if errors.Is(err, errdefs.ErrNotSupported) {
		return nil
	}
	if err != nil {
		return err
	}
	return m.cfg.Syscalls.Track(id, session)
}

// unseenBy says what provenance cannot see of a sandbox of isolation i.
func unseenBy(i dsecv1.Isolation) []string {
	var out []string
	switch i {
	case dsecv1.Isolation_ISOLATION_GVISOR:
		out = append(out, "protected_read: the sentry serves the sandbox's files; the host sees no open by a sandbox process")
	case dsecv1.Isolation_ISOLATION_MICROVM:
		out = append(out,
			"protected_read: the guest's kernel serves its files; no watch in the guest yet",
			"leftover_processes: only the agent's own commands (ListProcesses), not processes they left detached")
	}
	return out
}

// processes lists what runs in the sandbox but its agent: the runtime's
// view where it has one, else the agent's own commands still running.
func (m *Manager) processes(ctx context.Context, sb *sandbox, id string) ([]*dsecv1.ProvenanceProcess, error) {
	var out []*dsecv1.ProvenanceProcess
	if in, ok := sb.rt.(backend.Inspector); ok {
		ps, err := in.Processes(ctx, id)
		if err != nil {
			return nil, err
		}
		for _, p := range ps {
			out = append(out, &dsecv1.ProvenanceProcess{Pid: int32(p.Pid), Command: p.Command})
		}
		return out, nil
	}
	sb.mu.Lock()
	client := sb.agent
	sb.mu.Unlock()
	if client == nil {
		return nil, nil
	}
	res, err := client.ListProcesses(ctx, connect.NewRequest(&dsecv1.ListProcessesRequest{SandboxId: id}))
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	for _, pi := range res.Msg.GetProcesses() {
		if pi.GetRunning() {
			out = append(out, &dsecv1.ProvenanceProcess{Pid: pi.GetPid(), Command: path.Base(strings.Join(pi.GetArgv()[:min(1, len(pi.GetArgv()))], ""))})
		}
	}
	return out, nil
}

// scanLayer scans the sandbox's writable layer, in place where its
// runtime shows it (Inspector), else from a capture.
func (m *Manager) scanLayer(ctx context.Context, sb *sandbox, rec *dsecv1.Sandbox, paths *dsecv1.ProvenancePaths, list bool) (*provenance.Result, error) {
	id := rec.GetId()
	lower, release, err := m.lowerDirs(ctx, id+".prov", rec.GetLayerDigests())
	if err != nil {
		return nil, err
	}
	defer release()
	sb.mu.Lock()
	opts := provenance.ScanOptions{Lower: lower, Paths: paths, ListFiles: list, Baseline: sb.baseline}
	sb.mu.Unlock()
	if in, ok := sb.rt.(backend.Inspector); ok {
		upper, err := in.Upper(id)
		if err != nil {
			return nil, err
		}
		return provenance.Scan(upper, opts)
	}
	if _, _, err := m.snapshotter(sb); err != nil {
		return nil, fmt.Errorf("read writable layer: %w", err)
	}
	tree, _, _, err := m.capture(ctx, sb, "prov"+fmt.Sprint(time.Now().UnixNano()))
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := tree.Remove(); err != nil {
			m.log.Warn("remove provenance capture", "id", id, "err", err)
		}
	}()
	return provenance.Scan(tree.Dir, opts)
}

// lowerDirs mounts layers (bottom first) for job and returns their dirs
// top first, as a scan wants them.
func (m *Manager) lowerDirs(ctx context.Context, job string, digests []string) ([]string, func(), error) {
	release := func() { m.images.Release(context.WithoutCancel(ctx), job) }
	lower := make([]string, len(digests))
	for i, d := range digests {
		l, err := m.images.Mount(ctx, job, d)
		if err != nil {
			release()
			return nil, nil, fmt.Errorf("mount layer %s: %w", d, err)
		}
		lower[len(digests)-1-i] = l.Dir
	}
	return lower, release, nil
}

// SetProvenancePaths replaces sandbox id's provenance paths (saved in its
// record) and watches its protected paths from now on; it returns those it
// could not watch, with why.
func (m *Manager) SetProvenancePaths(ctx context.Context, id string, paths *dsecv1.ProvenancePaths) ([]string, error) {
	if err := CheckProvenancePaths(paths); err != nil {
		return nil, err
	}
	sb, err := m.lookup(id)
	if err != nil {
		return nil, err
	}
	sb.op.Lock()
	sb.mu.Lock()
	if !sb.gone.IsZero() {
		sb.mu.Unlock()
		sb.op.Unlock()
		return nil, fmt.Errorf("set provenance paths of %s: it has ended: %w", id, errdefs.ErrFailedPrecondition)
	}
	rec := cloneRec(sb.rec)
	rec.Spec.Provenance = paths
	err = m.states.Save(rec)
	if err == nil {
		sb.rec = rec
	}
	sb.mu.Unlock()
	sb.op.Unlock()
	if err != nil {
		return nil, fmt.Errorf("set provenance paths of %s: %w", id, err)
	}
	return m.watchProtected(ctx, sb)
}

// CheckProvenancePaths refuses provenance paths that are not absolute.
func CheckProvenancePaths(p *dsecv1.ProvenancePaths) error {
	for _, list := range [][]string{p.GetWorkspace(), p.GetTests(), p.GetProtected()} {
		for _, s := range list {
			if !path.IsAbs(s) || strings.ContainsRune(s, 0) {
				return fmt.Errorf("provenance path %q: must be absolute: %w", s, errdefs.ErrInvalidArgument)
			}
		}
	}
	return nil
}

// watchProtected marks the sandbox's protected paths with the node's
// ReadWatcher. What cannot be watched (no watcher, a backend whose files
// the host does not see, a missing path) is returned in words and logged.
func (m *Manager) watchProtected(ctx context.Context, sb *sandbox) ([]string, error) {
	rec := sb.record()
	id, protected := rec.GetId(), rec.GetSpec().GetProvenance().GetProtected()
	if len(protected) == 0 {
		sb.mu.Lock()
		sb.unwatched = nil
		sb.mu.Unlock()
		return nil, nil
	}
	if m.cfg.Reads == nil {
		return []string{"all: this node watches no reads (it has no fanotify)"}, nil
	}
	in, ok := sb.rt.(backend.Inspector)
	var root string
	var agent int
	err := errdefs.ErrNotSupported
	if ok {
		root, agent, err = in.Root(ctx, id)
	}
	if errors.Is(err, errdefs.ErrNotSupported) {
		return []string{"all: " + IsolationName(KindOf(rec.GetSpec()).Isolation) + " sandboxes' reads are not seen from the host"}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("watch protected paths of %s: %w", id, err)
	}
	unwatched, err := m.cfg.Reads.Watch(id, root, agent, protected)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	sb.unwatched = unwatched
	sb.mu.Unlock()
	return unwatched, nil
}

// startProvenance records a new sandbox's writable layer as the platform
// left it (a baseline, saved beside its record, where the runtime shows
// the layer) and watches its protected paths. What fails is logged: the
// sandbox serves on, its provenance then less exact.
func (m *Manager) startProvenance(ctx context.Context, id string) {
	if m.cfg.ProvenanceOff {
		return
	}
	sb, err := m.lookup(id)
	if err != nil {
		return
	}
	if in, ok := sb.rt.(backend.Inspector); ok {
		if err := m.takeBaseline(sb, in, id); err != nil {
			m.log.Warn("take provenance baseline", "id", id, "err", err)
		}
	}
	if unwatched, err := m.watchProtected(ctx, sb); err != nil {
		m.log.Warn("watch protected paths", "id", id, "err", err)
	} else if len(unwatched) > 0 {
		m.log.Info("protected paths not watched", "id", id, "unwatched", unwatched)
	}
	if err := m.trackSyscalls(ctx, sb); err != nil {
		m.log.Warn("record refused syscalls", "id", id, "err", err)
	}
}

// rebaseline takes sb's baseline again as its setup phase ends: what the
// trainer wrote while setting the task up (its files, its tests, packages
// it installed) is the task's, not the agent's, and is left out of the
// files written, replaced and tests changed while it stays unchanged.
func (m *Manager) rebaseline(sb *sandbox, id string) {
	if m.cfg.ProvenanceOff {
		return
	}
	if in, ok := sb.rt.(backend.Inspector); ok {
		if err := m.takeBaseline(sb, in, id); err != nil {
			m.log.Warn("take provenance baseline at the end of setup", "id", id, "err", err)
		}
	}
}

func (m *Manager) takeBaseline(sb *sandbox, in backend.Inspector, id string) error {
	upper, err := in.Upper(id)
	if err != nil {
		return err
	}
	b, err := provenance.TakeBaseline(upper)
	if err != nil {
		return err
	}
	if err := b.Save(m.baselinePath(id)); err != nil {
		return err
	}
	sb.mu.Lock()
	sb.baseline = b
	sb.mu.Unlock()
	return nil
}

func (m *Manager) baselinePath(id string) string {
	return filepath.Join(m.states.Dir(id), "provenance-baseline.json")
}

// recoverProvenance loads a re-adopted sandbox's baseline and watches its
// protected paths again (the marks went with the daemon that made them).
func (m *Manager) recoverProvenance(ctx context.Context, id string) {
	if m.cfg.ProvenanceOff {
		return
	}
	sb, err := m.lookup(id)
	if err != nil || !sb.live() {
		return
	}
	b, err := provenance.LoadBaseline(m.baselinePath(id))
	if err != nil {
		m.log.Warn("load provenance baseline", "id", id, "err", err)
	}
	sb.mu.Lock()
	sb.baseline = b
	sb.mu.Unlock()
	if _, err := m.watchProtected(ctx, sb); err != nil {
		m.log.Warn("watch protected paths", "id", id, "err", err)
	}
	// What was refused before is not known: the count starts again here.
	sb.mu.Lock()
	sb.syscallsSince = time.Now()
	sb.mu.Unlock()
	if err := m.trackSyscalls(ctx, sb); err != nil {
		m.log.Warn("record refused syscalls", "id", id, "err", err)
	}
}
