package apiserver

import (
	"context"
	"errors"
	"math"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// Quotas charges projects' quotas: the metadata store is one (its methods
// are documented there).
type Quotas interface {
	Charge(ctx context.Context, project string, amounts store.Amounts) error
	Release(ctx context.Context, project string, amounts store.Amounts) error
	SetUse(ctx context.Context, project string, resource store.Resource, n int64) error
	Quota(ctx context.Context, project string) ([]store.ProjectQuota, error)
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
	cpu := int64(math.Ceil(spec.GetCpus() * 1000))
	if cpu <= 0 {
		cpu = defaultChargeMilliCPUs
	}
	mem, disk := spec.GetMemoryMb(), spec.GetDiskMb()
	if mem <= 0 {
		mem = defaultChargeMemoryMB
	}
	if disk <= 0 {
		disk = defaultChargeDiskMB
	}
	k := int64(n)
	return store.Amounts{store.Sandboxes: k, store.VCPUs: cpu * k, store.MemoryMB: mem * k, store.DiskMB: disk * k}
}

// charge charges the project of spec for n sandboxes about to be made, and
// a create of each against creates_per_second; release gives the sandboxes'
// part back (a create that failed). Only the resources some project on the
// path limits are charged (limited). A refusal is the store's
// ResourceExhausted, naming the project, the resource, the limit and the
// use.
func (s *Server) charge(ctx context.Context, spec *dsecv1.SandboxSpec, n int) (release func(), err error) {
	project := spec.GetLabels()[ProjectLabel]
	limits, err := s.limited(ctx, project)
	if err != nil || len(limits) == 0 {
		return func() {}, err
	}
	all := amountsOf(spec, n)
	all[store.CreatesPerSecond] = int64(n)
	charged, held := store.Amounts{}, store.Amounts{}
	for r, v := range all {
		if !limits[r] {
			continue
		}
		charged[r] = v
		if r != store.CreatesPerSecond {
			held[r] = v
		}
	}
	if err := s.charges.charge(ctx, s.cfg.Quotas, project, charged); err != nil {
		return nil, err
	}
	return func() { s.releaseCharged(context.WithoutCancel(ctx), project, held) }, nil
}

// release gives back what sandboxes of project held, of the resources a
// create would have been charged now.
func (s *Server) release(ctx context.Context, project string, amounts store.Amounts) {
	limits, err := s.limited(ctx, project)
	if err != nil || len(limits) == 0 {
		return
	}
	held := store.Amounts{}
	for r, v := range amounts {
		if limits[r] {
			held[r] = v
		}
	}
	s.releaseCharged(ctx, project, held)
}

func (s *Server) releaseCharged(ctx context.Context, project string, held store.Amounts) {
	if len(held) == 0 {
		return
	}
	if err := s.cfg.Quotas.Release(ctx, project, held); err != nil {
		// The reconciliation sets the use from the truth.
		s.log.Warn("release quota", "project", iam.Display(project), "err", err)
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

// reconcileQuotas sets every project's sandbox use from the truth: the
// live sandboxes every node holds, by the project their label names. It
// runs only when every node of the fleet answers (an unreachable node's
// sandboxes cannot be counted), and corrects what no release reached: a
// sandbox ended by its TTL, its idle timeout or a failure, and the charges
// of creates an apiserver or edge died in the middle of. A create charged
// between the listing and the correction is not counted until the next
// sweep.
func (s *Server) reconcileQuotas(ctx context.Context) {
	if s.cfg.Quotas == nil {
		return
	}
	nodes := s.fleet.Nodes()
	for _, n := range nodes {
		if !n.Healthy {
			return
		}
	}
	truth := map[string]store.Amounts{}
	for _, n := range nodes {
		resp, err := n.Edge.List(ctx, connect.NewRequest(&dsecv1.ListRequest{States: liveStates()}))
		if err != nil {
			s.log.Warn("count sandboxes for quotas", "node", n.Name, "err", err)
			return
		}
		for _, sb := range resp.Msg.GetSandboxes() {
			if _, pooled := sb.GetSpec().GetLabels()[FnCallPoolLabel]; pooled || !live(sb.GetState()) {
				continue
			}
			p := projectOf(sb)
			if truth[p] == nil {
				truth[p] = store.Amounts{}
			}
			for r, v := range amountsOf(sb.GetSpec(), 1) {
				truth[p][r] += v
			}
		}
	}
	// Walk the projects that hold use, from the root down, and those that
	// hold sandboxes.
	seen := map[string]bool{}
	var walk func(path string) error
	walk = func(path string) error {
		qs, err := s.cfg.Quotas.Quota(ctx, path)
		if err != nil {
			return err
		}
		walked := false
		for _, q := range qs {
			if q.Project == path {
				continue
			}
			held := false
			for _, r := range sandboxResources {
				held = held || q.Used[r] > 0
			}
			if held || hasUnder(truth, q.Project) {
				if err := walk(q.Project); err != nil {
					return err
				}
				walked = true
			}
		}
		if walked { // the children's corrections moved this project's use
			if qs, err = s.cfg.Quotas.Quota(ctx, path); err != nil {
				return err
			}
		}
		var self store.ProjectQuota
		children := store.Amounts{}
		for _, q := range qs {
			if q.Project == path {
				self = q
				continue
			}
			for _, r := range sandboxResources {
				children[r] += q.Used[r]
			}
		}
		seen[path] = true
		for _, r := range sandboxResources {
			own := self.Used[r] - children[r]
			if want := truth[path][r]; own != want {
				if err := s.cfg.Quotas.SetUse(ctx, path, r, want); err != nil {
					return err
				}
				s.log.Info("quota use reconciled", "project", iam.Display(path), "resource", r, "was", own, "now", want)
			}
		}
		return nil
	}
	if err := walk(""); err != nil && !errors.Is(err, context.Canceled) {
		s.log.Warn("reconcile quota use", "err", err)
	}
	for p := range truth {
		if !seen[p] {
			s.log.Warn("sandboxes of a project the store does not hold", "project", iam.Display(p))
		}
	}
}

// hasUnder reports whether truth holds a project at or under path.
func hasUnder(truth map[string]store.Amounts, path string) bool {
	for p := range truth {
		if iam.Within(p, path) {
			return true
		}
	}
	return false
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

// limited is the set of sandbox resources (and creates per second) that a
// limit applies to on project: its own or an ancestor's. A create is
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
			for _, r := range append(sandboxResources, store.CreatesPerSecond) {
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
// queue on those rows one transaction at a time. The first charge of a
// project leads: it charges the sum of what has queued up meanwhile (up to
// maxChargeGroup charges) and goes on while more queue. When the sum does
// not fit, each of the group is charged alone, so a quota fills exactly
// (of 1,000 racing for 100, exactly 100 pass).
type chargeGroup struct {
	mu      sync.Mutex
	pending map[string][]*chargeReq
}

type chargeReq struct {
	amounts store.Amounts
	done    chan error
}

const maxChargeGroup = 256

// chargeTimeout bounds a group's transactions: the leader's caller may
// have gone, the others wait on it.
const chargeTimeout = 30 * time.Second

func (g *chargeGroup) charge(ctx context.Context, q Quotas, project string, amounts store.Amounts) error {
	req := &chargeReq{amounts: amounts, done: make(chan error, 1)}
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
		sum := store.Amounts{}
		for _, r := range group {
			for res, v := range r.amounts {
				sum[res] += v
			}
		}
		err := q.Charge(ctx, project, sum)
		if len(group) > 1 && errors.Is(err, errdefs.ErrResourceExhausted) {
			for _, r := range group {
				r.done <- q.Charge(ctx, project, r.amounts)
			}
			continue
		}
		for _, r := range group {
			r.done <- err
		}
	}
}
