package apiserver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/pullpack"
	"dsec.dev/dsec/internal/store"
)

// The cost ledger (docs/usage.md). Each edge keeps what its sandboxes use
// (package ledger) and answers the apiservers' event pulls (events.go)
// with the records changed since the version the store has: a sandbox's
// end, its snapshots and a checkpoint of each live sandbox every few
// minutes, not every sample. pullEvents stores them with the node's
// events and cursors in one transaction (store.EventPulls), so the
// apiserver that holds the node next resumes after them; a record stored
// twice all the same (a node's ledger pulled whole again: its cursor
// forgotten) counts once, the store keeping each figure's largest
// report. FnCall calls, which run in no sandbox of the caller's, are
// counted by the apiserver that ran them, per project, and written every
// callFlushEvery. Usage reads the nodes'
// live records at query time (EdgeService.LiveUsage) and adds the rows up
// by project, sandbox, node or a label over a window, each live record in
// place of its stored checkpoint: store writes scale with the sandboxes
// that end, not with the sandboxes that live.

// liveUsageTimeout bounds one node's LiveUsage call in a Usage: a node
// that does not answer in time counts at its stored checkpoints.
const liveUsageTimeout = 5 * time.Second

// DefaultUsageRetention is how long the ledger keeps an ended sandbox's
// row when Config.UsageRetention is 0.
const DefaultUsageRetention = 90 * 24 * time.Hour

// LedgerStore is what the apiserver needs of the store for the ledger.
type LedgerStore interface {
	PutUsage(ctx context.Context, rows ...store.UsageRow) error
	SumUsage(ctx context.Context, q store.UsageQuery) ([]store.UsageSum, error)
	ExpireUsage(ctx context.Context, olderThan time.Time) (int, error)
}

// usageState is the apiserver's side of the ledger: when it last pulled
// each node's ledger, and the FnCall calls it ran, by project.
type usageState struct {
	epoch string // names this apiserver's FnCall counters: new each start

	mu      sync.Mutex
	pulled  map[string]time.Time // node → when its ledger was last stored
	calls   map[string]int64     // project → FnCall calls run since start
	dirty   bool                 // calls changed since last written
	started time.Time
}

func (u *usageState) init() {
	var b [6]byte
	rand.Read(b[:])
	u.epoch = hex.EncodeToString(b[:])
	u.pulled = map[string]time.Time{}
	u.calls = map[string]int64{}
	u.started = time.Now()
}

// countCall counts a FnCall call run for project.
func (u *usageState) countCall(project string) {
	u.mu.Lock()
	u.calls[project]++
	u.dirty = true
	u.mu.Unlock()
}

// markPulled notes that the nodes' ledgers were pulled and stored now.
func (u *usageState) markPulled(nodes []string) {
	now := time.Now()
	u.mu.Lock()
	for _, n := range nodes {
		u.pulled[n] = now
	}
	u.mu.Unlock()
}

// forget drops when it pulled the nodes not in keep (gone from the
// fleet).
func (u *usageState) forget(keep []string) {
	in := make(map[string]bool, len(keep))
	for _, n := range keep {
		in[n] = true
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	for n := range u.pulled {
		if !in[n] {
			delete(u.pulled, n)
		}
	}
}

// due says whether node's ledger, stored up to epoch ("": never), may be
// pulled now: never stored, never pulled by this apiserver, or last
// pulled at least every ago.
func (u *usageState) due(node, epoch string, every time.Duration) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	at, ok := u.pulled[node]
	return !ok || epoch == "" || every <= 0 || time.Since(at) >= every
}

// callRows are the FnCall counters to write, if any changed.
func (u *usageState) callRows(name string) []store.UsageRow {
	u.mu.Lock()
	defer u.mu.Unlock()
	if !u.dirty {
		return nil
	}
	u.dirty = false
	now := time.Now()
	rows := make([]store.UsageRow, 0, len(u.calls))
	for p, n := range u.calls {
		rows = append(rows, store.UsageRow{Key: "fncall/" + name + "/" + u.epoch + "/" + p, Project: p, Node: name,
			Started: u.started, Updated: now, Usage: store.Usage{FnCallCalls: n}})
	}
	return rows
}

// usageRows reads the ledger records a node sent as store rows.
func usageRows(recs []*dsecv1.UsageRecord) []store.UsageRow {
	rows := make([]store.UsageRow, 0, len(recs))
	for _, r := range recs {
		f := r.GetUsage()
		rows = append(rows, store.UsageRow{Key: r.GetSandboxId(), SandboxID: r.GetSandboxId(), Project: r.GetProject(), Labels: r.GetLabels(),
			Node: r.GetNode(), Started: timeOf(r.GetStartedUnixMs()), Ended: timeOf(r.GetEndedUnixMs()), Updated: timeOf(r.GetUpdatedUnixMs()), Sole: r.GetSole(),
			Usage: store.Usage{CPUUsec: f.GetCpuUsec(), MemoryGiBSec: f.GetMemoryGibSeconds(), DiskGiBHours: f.GetDiskGibHours(),
				DiskPeakBytes: f.GetDiskPeakBytes(), SnapshotBytes: f.GetSnapshotBytes(), EgressBytes: f.GetEgressBytes(), FnCallCalls: f.GetFncallCalls()}})
	}
	return rows
}

// pulledUsage reads the ledger records of a pull's answer as store rows:
// packed, or (from an edge that predates packing) as messages.
func pulledUsage(m *edgev1.EventsResponse) ([]store.UsageRow, error) {
	if len(m.GetPackedUsage()) == 0 {
		return usageRows(m.GetUsage()), nil
	}
	rows := make([]store.UsageRow, 0, pullpack.RecordCount(m.GetPackedUsage()))
	err := pullpack.ReadRecords(m.GetPackedUsage(), func(node string, r pullpack.Record) {
		rows = append(rows, store.UsageRow{Key: r.SandboxID, SandboxID: r.SandboxID, Project: r.Project, Labels: r.Labels, Node: node,
			Started: timeOf(r.StartedUnixMs), Ended: timeOf(r.EndedUnixMs), Updated: timeOf(r.UpdatedUnixMs), Sole: r.Sole && r.EndedUnixMs != 0,
			Usage: store.Usage{CPUUsec: r.CPUUsec, MemoryGiBSec: r.MemoryGiBSeconds, DiskGiBHours: r.DiskGiBHours, DiskPeakBytes: r.DiskPeakBytes,
				SnapshotBytes: r.SnapshotBytes, EgressBytes: r.EgressBytes}})
	})
	if err != nil {
		return nil, err
	}
	return rows, nil
}

// flushCalls writes this apiserver's FnCall counters when they changed.
func (s *Server) flushCalls(ctx context.Context) {
	if s.cfg.Ledger == nil {
		return
	}
	calls := s.usage.callRows(s.cfg.Name)
	if len(calls) == 0 {
		return
	}
	if err := s.cfg.Ledger.PutUsage(ctx, calls...); err != nil {
		s.log.Warn("store the FnCall counters", "projects", len(calls), "err", err)
		s.usage.mu.Lock()
		s.usage.dirty = true
		s.usage.mu.Unlock()
	}
}

// RunUsageExpiry forgets ended sandboxes' ledger rows older than the
// configured retention, about once an hour at random times, until ctx
// ends (at once without Config.Ledger or when rows are kept forever).
func (s *Server) RunUsageExpiry(ctx context.Context) {
	retention := s.cfg.UsageRetention
	if retention == 0 {
		retention = DefaultUsageRetention
	}
	if s.cfg.Ledger == nil || retention < 0 {
		return
	}
	expireEvery(ctx, "usage rows", retention, auditExpiryEvery, s.log, s.cfg.Ledger.ExpireUsage)
}

// liveUsage reads the ledger records of project's sandboxes (and those
// under it) that every routable node holds now, at once; a node that
// fails or is late is left out: its live sandboxes count at their last
// stored checkpoint.
func (s *Server) liveUsage(ctx context.Context, project string) []store.UsageRow {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		rows []store.UsageRow
	)
	for _, n := range s.routable() {
		if n.Edge == nil {
			continue
		}
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, liveUsageTimeout)
			defer cancel()
			resp, err := n.Edge.LiveUsage(cctx, connect.NewRequest(&edgev1.LiveUsageRequest{Projects: []string{project}}))
			if err != nil {
				s.log.Warn("read a node's live usage: its live sandboxes count at their stored checkpoints", "node", n.Name, "err", err)
				return
			}
			got := usageRows(resp.Msg.GetUsage())
			mu.Lock()
			rows = append(rows, got...)
			mu.Unlock()
		})
	}
	wg.Wait()
	return rows
}

func usageMsg(u store.Usage) *dsecv1.UsageFigures {
	return &dsecv1.UsageFigures{CpuUsec: u.CPUUsec, MemoryGibSeconds: u.MemoryGiBSec, DiskGibHours: u.DiskGiBHours,
		DiskPeakBytes: u.DiskPeakBytes, SnapshotBytes: u.SnapshotBytes, EgressBytes: u.EgressBytes, FncallCalls: u.FnCallCalls,
		Sandboxes: u.Sandboxes}
}

// Usage adds up the ledger's rows of a project and the projects under it.
func (s *Server) Usage(ctx context.Context, req *connect.Request[dsecv1.UsageRequest]) (*connect.Response[dsecv1.UsageResponse], error) {
	if s.cfg.Ledger == nil {
		return nil, fmt.Errorf("usage: this server keeps no cost ledger (no metadata store, or dsecd --no-ledger): %w", errdefs.ErrNotSupported)
	}
	m := req.Msg
	a := actor(ctx)
	path, err := projectOr(a, m.Project)
	if err != nil {
		return nil, err
	}
	if err := allow(a, iam.Op(dsecv1connect.SandboxServiceUsageProcedure), path); err != nil {
		return nil, err
	}
	by := m.GetBy()
	if by == "" {
		by = "project"
	}
	if err := store.CheckUsageBy(by); err != nil {
		return nil, err
	}
	since, until := timeOf(m.GetSinceUnixMs()), timeOf(m.GetUntilUnixMs())
	if !since.IsZero() && !until.IsZero() && !since.Before(until) {
		return nil, fmt.Errorf("usage from %s until %s: an empty window: %w", since.Format(time.RFC3339), until.Format(time.RFC3339), errdefs.ErrInvalidArgument)
	}
	live := s.liveUsage(ctx, path)
	sums, err := s.cfg.Ledger.SumUsage(ctx, store.UsageQuery{Projects: []string{path}, Since: since, Until: until, By: by, Live: live})
	if err != nil {
		return nil, err
	}
	out := &dsecv1.UsageResponse{By: by}
	var total store.Usage
	for _, g := range sums {
		out.Groups = append(out.Groups, &dsecv1.UsageGroup{Key: g.Key, Usage: usageMsg(g.Usage)})
		total.Add(g.Usage)
	}
	out.Total = usageMsg(total)
	return connect.NewResponse(out), nil
}
