package apiserver

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/sandboxpage"
	"dsec.dev/dsec/internal/store"
)

// Quotas charges projects' quotas: the metadata store is one (its methods
// are documented there).
type Quotas interface {
	Charge(ctx context.Context, project string, amounts store.Amounts) error
	Release(ctx context.Context, project string, amounts store.Amounts) error
	ChargeHeld(ctx context.Context, project string, amounts store.Amounts, holds []store.Hold) error
	ReserveCharged(ctx context.Context, project string, amounts store.Amounts, holds []store.Hold, rs []store.CreateReservation) ([]store.CreateReservation, []bool, error)
	Settle(ctx context.Context, ids []string, release bool) error
	ReleaseSandbox(ctx context.Context, project, id string, amounts store.Amounts) (bool, error)
	HoldRelease(ctx context.Context, project, sandbox string, amounts store.Amounts, expires time.Time) error
	Uses(ctx context.Context, resources []store.Resource) ([]store.Use, error)
	CorrectUse(ctx context.Context, read store.Use, n int64) (bool, error)
	ExpireHolds(ctx context.Context, now time.Time) (int, error)
	Quota(ctx context.Context, project string) ([]store.ProjectQuota, error)
}

// holdMargin is how long a hold outlives the deadline of the create, fork
// or call it is held for before any apiserver's sweep releases it as one
// whose apiserver died in the middle of it: room for the cleanup that
// runs past the deadline. A call without a deadline is held for
// store.DefaultHoldExpiry.
const holdMargin = 15 * time.Second

// holdUntil is when a hold for the call of ctx expires.
func holdUntil(ctx context.Context) time.Time {
	if d, ok := ctx.Deadline(); ok {
		return d.Add(holdMargin)
	}
	return time.Time{}
}

// What a sandbox asking for none is charged: dsecd's defaults for a
// sandbox (daemon.Config's Defaults), which the edge then gives it. The
// reconciliation sets use from the sandboxes' specs as the edges report
// them, so a node with other defaults is corrected there.
const (
	defaultChargeMilliCPUs = 1000
	defaultChargeMemoryMB  = 512
	defaultChargeDiskMB    = 1024
)

// sandboxResources are the resources a sandbox holds while it lives.
var sandboxResources = []store.Resource{store.Sandboxes, store.VCPUs, store.MemoryMB, store.DiskMB}

// amountsOf is what n sandboxes of spec hold.
func amountsOf(spec *dsecv1.SandboxSpec, n int) store.Amounts {
	cpu, mem, disk := sandboxpage.Asks(spec)
	if cpu <= 0 {
		cpu = defaultChargeMilliCPUs
	}
	if mem <= 0 {
		mem = defaultChargeMemoryMB
	}
	if disk <= 0 {
		disk = defaultChargeDiskMB
	}
	k := int64(n)
	return store.Amounts{store.Sandboxes: k, store.VCPUs: cpu * k, store.MemoryMB: mem * k, store.DiskMB: disk * k}
}

// amountsOfTally is what the sandboxes a node tallied hold: amountsOf
// each, summed.
func amountsOfTally(t *edgev1.ProjectTally) store.Amounts {
	return store.Amounts{store.Sandboxes: t.GetSandboxes(),
		store.VCPUs:    t.GetMilliCpus() + t.GetCpusUnset()*defaultChargeMilliCPUs,
		store.MemoryMB: t.GetMemoryMb() + t.GetMemoryUnset()*defaultChargeMemoryMB,
		store.DiskMB:   t.GetDiskMb() + t.GetDiskUnset()*defaultChargeDiskMB}
}

// quotaCharge is what a create of n sandboxes of spec is charged: the
// resources some project on its path limits (limited), with a create of
// each against creates_per_second; held is the part the sandboxes hold.
// ok is false when no limit applies: nothing is charged.
func (s *Server) quotaCharge(ctx context.Context, spec *dsecv1.SandboxSpec, n int) (c store.QuotaCharge, ok bool, err error) {
	project := spec.GetLabels()[ProjectLabel]
	limits, err := s.limited(ctx, project)
	if err != nil || len(limits) == 0 {
		return c, false, err
	}
	all := amountsOf(spec, n)
	all[store.CreatesPerSecond] = int64(n)
	c = store.QuotaCharge{Project: project, Amounts: store.Amounts{}, Held: store.Amounts{}, Expires: holdUntil(ctx)}
	for r, v := range all {
		if !limits[r] {
			continue
		}
		c.Amounts[r] = v
		if r != store.CreatesPerSecond {
			c.Held[r] = v
		}
	}
	return c, len(c.Amounts) > 0, nil
}

// held names the holds of a charge made for something under way (a
// create, a fork, a FnCall call), which settle once it is over.
type held []string

// charge charges the project of spec for n sandboxes about to be made, held
// under hold until settled. A refusal is the store's ResourceExhausted,
// naming the project, the resource, the limit and the use.
func (s *Server) charge(ctx context.Context, spec *dsecv1.SandboxSpec, n int, hold string) (held, error) {
	c, ok, err := s.quotaCharge(ctx, spec, n)
	if err != nil || !ok {
		return nil, err
	}
	if err := s.charges.charge(ctx, s.cfg.Quotas, c.Project, c.Amounts, []store.Hold{{ID: hold, Amounts: c.Held, Expires: c.Expires}}); err != nil {
		return nil, err
	}
	return held{hold}, nil
}

// settleHolds ends the holds of h: with keep what they held stays charged
// (the sandboxes exist and hold it: settled in the background, settleGroup),
// else it is given back.
func (s *Server) settleHolds(ctx context.Context, h held, keep bool) {
	if len(h) == 0 {
		return
	}
	if keep {
		s.kept.settle(ctx, s.cfg.Quotas, s.log, h)
		return
	}
	if err := s.cfg.Quotas.Settle(context.WithoutCancel(ctx), h, true); err != nil {
		// The holds expire (holdUntil); the sweep then counts from the edges.
		s.log.Warn("settle quota holds", "holds", h, "keep", keep, "err", err)
	}
}

// limitedPart is the part of amounts a create of project would be charged
// now: the resources a limit applies to on its path.
func (s *Server) limitedPart(ctx context.Context, project string, amounts store.Amounts) store.Amounts {
	limits, err := s.limited(ctx, project)
	if err != nil || len(limits) == 0 {
		return nil
	}
	part := store.Amounts{}
	for r, v := range amounts {
		if limits[r] {
			part[r] = v
		}
	}
	if len(part) == 0 {
		return nil
	}
	return part
}

// holdRelease records, before live sandbox id of project is deleted, that
// its release is under way (store.HoldRelease): a sweep that counts the
// edges once it is gone but read the use before it is released keeps it
// counted by the hold, rather than taking it away before the release
// does again. It returns the hold, or nil when nothing is charged there
// (or the store failed: the sweep then corrects any difference).
func (s *Server) holdRelease(ctx context.Context, project, id string, amounts store.Amounts) held {
	part := s.limitedPart(ctx, project, amounts)
	if part == nil {
		return nil
	}
	if err := s.cfg.Quotas.HoldRelease(ctx, project, id, part, holdUntil(ctx)); err != nil {
		s.log.Warn("hold the release of a sandbox", "project", iam.Display(project), "sandbox", id, "err", err)
		return nil
	}
	return held{store.ReleaseHold(id)}
}

// releaseSandbox gives back, once, what sandbox id of project held, of the
// resources a create would be charged now, and ends its holdRelease hold.
func (s *Server) releaseSandbox(ctx context.Context, project, id string, amounts store.Amounts) {
	part := s.limitedPart(ctx, project, amounts)
	if part == nil {
		return
	}
	if _, err := s.cfg.Quotas.ReleaseSandbox(ctx, project, id, part); err != nil {
		// The reconciliation sets the use from the truth.
		s.log.Warn("release quota", "project", iam.Display(project), "sandbox", id, "err", err)
	}
}

// live reports whether a sandbox in state st holds its resources.
func live(st dsecv1.State) bool {
	switch st {
	case dsecv1.State_STATE_STOPPED, dsecv1.State_STATE_FAILED, dsecv1.State_STATE_UNSPECIFIED:
		return false
	}
	return true
}

// countedResources are the resources reconciliation counts: what live
// sandboxes hold, and FnCall calls in flight, which the edges do not show
// (their truth is 0: only their holds count).
var countedResources = append(slices.Clone(sandboxResources), store.FnCallInflight)

// reconcileQuotas corrects every project's use from the truth: the live
// sandboxes every node holds, by the project their label names, plus the
// holds of the creates, forks and calls under way. It runs only when every
// node of the fleet answers (an unreachable node's sandboxes cannot be
// counted), and corrects what no release reached: a sandbox ended by its
// TTL, its idle timeout or a failure, and the charges of creates an
// apiserver or edge died in the middle of (their holds expire after their
// deadline, holdUntil). It corrects only what it can prove: the use is read before
// the edges are listed, and a project's use is corrected only if nothing
// of its own was charged, released or settled since (CorrectUse), so a
// create charged meanwhile is never corrected away; it waits for the next
// sweep.
func (s *Server) reconcileQuotas(ctx context.Context) {
	if s.cfg.Quotas == nil {
		return
	}
	if n, err := s.cfg.Quotas.ExpireHolds(ctx, time.Now()); err != nil {
		s.log.Warn("expire quota holds", "err", err)
	} else if n > 0 {
		s.log.Info("quota holds expired (their creates or calls died with their apiserver)", "holds", n)
	}
	nodes := s.fleet.Nodes()
	for _, n := range nodes {
		if !n.Healthy {
			return
		}
	}
	uses, err := s.cfg.Quotas.Uses(ctx, countedResources)
	if err != nil {
		s.log.Warn("read quota use", "err", err)
		return
	}
	truth := map[string]store.Amounts{}
	for _, n := range nodes {
		// The node sums its sandboxes by project (tally): listing every
		// sandbox of every node from every apiserver each sweep was a tenth
		// of an apiserver's CPU and a fifth of an edge's under `dsec bench
		// cluster`, at 100,000 sandboxes a node.
		resp, err := n.Edge.List(ctx, connect.NewRequest(&edgev1.ListRequest{States: liveStates(), ExcludeLabels: []string{FnCallPoolLabel},
			Tally: true}))
		if err != nil {
			s.log.Warn("count sandboxes for quotas", "node", n.Name, "err", err)
			return
		}
		tallies := resp.Msg.GetTallies()
		if !resp.Msg.GetTallied() {
			// An edge from before tallies answers every sandbox.
			tally := sandboxpage.Tally{}
			for _, sb := range resp.Msg.GetSandboxes() {
				if _, pooled := sb.GetSpec().GetLabels()[FnCallPoolLabel]; !pooled && live(sb.GetState()) {
					tally.Add(sb)
				}
			}
			tallies = tally.List()
		}
		for _, t := range tallies {
			p := t.GetProject()
			if truth[p] == nil {
				truth[p] = store.Amounts{}
			}
			for r, v := range amountsOfTally(t) {
				truth[p][r] += v
			}
		}
	}
	seen := map[string]bool{}
	for _, u := range uses {
		seen[u.Project] = true
		want := truth[u.Project][u.Resource]
		if u.Own == want+u.Held {
			continue
		}
		ok, err := s.cfg.Quotas.CorrectUse(ctx, u, want)
		switch {
		case err != nil:
			if !errors.Is(err, context.Canceled) {
				s.log.Warn("reconcile quota use", "project", iam.Display(u.Project), "resource", u.Resource, "err", err)
			}
		case ok:
			s.log.Info("quota use reconciled", "project", iam.Display(u.Project), "resource", u.Resource, "was", u.Own, "now", want+u.Held, "held", u.Held)
		default:
			s.log.Debug("quota use changed while it was counted: left to the next sweep", "project", iam.Display(u.Project), "resource", u.Resource)
		}
	}
	for p := range truth {
		if !seen[p] {
			s.log.Warn("sandboxes of a project the store does not hold", "project", iam.Display(p))
		}
	}
}

// limitedTTL is how long limitCache trusts what it read: a limit set on a
// path no create was charged under takes effect within it.
const limitedTTL = time.Second

// limitCache remembers, by project, which resources a limit applies to on
// it (its own or an ancestor's).
type limitCache struct {
	mu sync.Mutex
	m  map[string]limitEntry
}

type limitEntry struct {
	limits map[store.Resource]bool
	at     time.Time
}

// limited is the set of sandbox resources, FnCall calls in flight and
// creates per second that a limit applies to on project: its own or an ancestor's. A create is
// charged only those: a charge locks and updates its resources' rows of
// the project and of every project above it, the root's included, which
// serialises charges cluster-wide; a resource no project on the path
// limits needs no exact count. Reconciliation keeps every resource's use
// from the edges' truth, so a limit set later starts from it.
func (s *Server) limited(ctx context.Context, project string) (map[store.Resource]bool, error) {
	if s.cfg.Quotas == nil {
		return nil, nil
	}
	now := time.Now()
	s.limits.mu.Lock()
	e, ok := s.limits.m[project]
	s.limits.mu.Unlock()
	if ok && now.Sub(e.at) < limitedTTL {
		return e.limits, nil
	}
	limits := map[store.Resource]bool{}
	for _, p := range iam.Ancestors(project) {
		qs, err := s.cfg.Quotas.Quota(ctx, p)
		if err != nil {
			if ok {
				return e.limits, nil // the store is away: what was last read
			}
			return nil, err
		}
		for _, q := range qs {
			if q.Project != p {
				continue
			}
			for _, r := range append(slices.Clone(countedResources), store.CreatesPerSecond) {
				if l, ok := q.Limits[r]; ok && l != store.Unlimited {
					limits[r] = true
				}
			}
		}
	}
	s.limits.mu.Lock()
	if s.limits.m == nil || len(s.limits.m) >= maxSandboxProjects {
		s.limits.m = map[string]limitEntry{}
	}
	s.limits.m[project] = limitEntry{limits: limits, at: now}
	s.limits.mu.Unlock()
	return limits, nil
}

// chargeGroup makes the charges of one project that arrive together one
// transaction: a charge locks the quota rows of its project and of every
// project above it, so concurrent charges of one project would otherwise
// queue on those rows one transaction at a time. A keyed create's charge
// comes with its reservation, made in the same transaction
// (store.ReserveCharged). The first charge of a project leads: it charges
// the sum of what has queued up meanwhile (up to maxChargeGroup charges)
// and goes on while more queue. When the sum does not fit, each of the
// group is charged alone, so a quota fills exactly (of 1,000 racing for
// 100, exactly 100 pass).
type chargeGroup struct {
	mu      sync.Mutex
	pending map[string][]*chargeReq
}

type chargeReq struct {
	amounts store.Amounts
	holds   []store.Hold
	// res is a keyed create's reservation, charged its Charge if it is
	// made; got and reserved are what became of it.
	res      *store.CreateReservation
	got      store.CreateReservation
	reserved bool
	done     chan error
}

const maxChargeGroup = 256

// chargeTimeout bounds a group's transactions: the leader's caller may
// have gone, the others wait on it.
const chargeTimeout = 30 * time.Second

func (g *chargeGroup) charge(ctx context.Context, q Quotas, project string, amounts store.Amounts, holds []store.Hold) error {
	return g.queue(ctx, q, project, &chargeReq{amounts: amounts, holds: holds, done: make(chan error, 1)})
}

// reserve reserves r.Key and charges r.Charge in one transaction, with the
// other charges of its project queued meanwhile. reserved is false when
// the key is held already (nothing was charged): its caller reads the
// reservation that holds it.
func (g *chargeGroup) reserve(ctx context.Context, q Quotas, r store.CreateReservation) (got store.CreateReservation, reserved bool, err error) {
	req := &chargeReq{res: &r, done: make(chan error, 1)}
	if err := g.queue(ctx, q, r.Charge.Project, req); err != nil {
		return store.CreateReservation{}, false, err
	}
	return req.got, req.reserved, nil
}

func (g *chargeGroup) queue(ctx context.Context, q Quotas, project string, req *chargeReq) error {
	g.mu.Lock()
	if g.pending == nil {
		g.pending = map[string][]*chargeReq{}
	}
	queue, running := g.pending[project]
	g.pending[project] = append(queue, req)
	g.mu.Unlock()
	if !running {
		g.lead(ctx, q, project)
	}
	return <-req.done
}

// lead charges the queued charges of project until none is left.
func (g *chargeGroup) lead(ctx context.Context, q Quotas, project string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), chargeTimeout)
	defer cancel()
	for {
		g.mu.Lock()
		queue := g.pending[project]
		if len(queue) == 0 {
			delete(g.pending, project)
			g.mu.Unlock()
			return
		}
		n := min(len(queue), maxChargeGroup)
		group := queue[:n:n]
		g.pending[project] = queue[n:]
		g.mu.Unlock()
		err := chargeTogether(ctx, q, project, group)
		if len(group) > 1 && err != nil && !errors.Is(err, errdefs.ErrUnavailable) {
			// Past the limit, or one hold's ID taken: each alone.
			for _, r := range group {
				r.done <- chargeTogether(ctx, q, project, []*chargeReq{r})
			}
			continue
		}
		for _, r := range group {
			r.done <- err
		}
	}
}

// chargeTogether charges the sum of group, and reserves its keyed
// creates' keys, in one transaction.
func chargeTogether(ctx context.Context, q Quotas, project string, group []*chargeReq) error {
	sum := store.Amounts{}
	var holds []store.Hold
	var rs []store.CreateReservation
	var keyed []*chargeReq
	for _, r := range group {
		if r.res != nil {
			rs = append(rs, *r.res)
			keyed = append(keyed, r)
			continue
		}
		for res, v := range r.amounts {
			sum[res] += v
		}
		holds = append(holds, r.holds...)
	}
	if len(rs) == 0 {
		return q.ChargeHeld(ctx, project, sum, holds)
	}
	got, reserved, err := q.ReserveCharged(ctx, project, sum, holds, rs)
	if err != nil {
		return err
	}
	for i, r := range keyed {
		r.got, r.reserved = got[i], reserved[i]
	}
	return nil
}

// settleGroup settles the holds whose charge stays (creates and forks
// that made their sandboxes) apart from the calls that made them, so no
// create waits for it: queued holds go to the store together, in one
// statement (up to maxSettleGroup), by one goroutine while any are queued.
// A hold not settled (the apiserver stopped first) expires; reconciliation
// meanwhile counts it beside the sandbox it was for, an overcount that the
// sweep after it corrects.
type settleGroup struct {
	mu      sync.Mutex
	running bool
	pending []string
	idle    chan struct{} // closed when nothing is queued or being settled
}

const maxSettleGroup = 1024

// settle queues ids to be settled keeping their charge.
func (g *settleGroup) settle(ctx context.Context, q Quotas, log *slog.Logger, ids []string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.pending = append(g.pending, ids...)
	if g.running {
		return
	}
	g.running = true
	g.idle = make(chan struct{})
	go g.lead(context.WithoutCancel(ctx), q, log)
}

func (g *settleGroup) lead(ctx context.Context, q Quotas, log *slog.Logger) {
	for {
		g.mu.Lock()
		n := min(len(g.pending), maxSettleGroup)
		if n == 0 {
			g.running = false
			close(g.idle)
			g.mu.Unlock()
			return
		}
		ids := g.pending[:n:n]
		g.pending = g.pending[n:]
		g.mu.Unlock()
		sctx, cancel := context.WithTimeout(ctx, chargeTimeout)
		if err := q.Settle(sctx, ids, false); err != nil {
			// The holds expire (holdUntil); the sweep then counts from the edges.
			log.Warn("settle quota holds", "holds", len(ids), "err", err)
		}
		cancel()
	}
}

// wait returns once nothing queued is left to settle.
func (g *settleGroup) wait() {
	g.mu.Lock()
	idle := g.idle
	g.mu.Unlock()
	if idle != nil {
		<-idle
	}
}
