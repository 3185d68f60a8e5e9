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
// part back (a create that failed). A refusal is the store's
// ResourceExhausted, naming the project, the resource, the limit and the
// use.
func (s *Server) charge(ctx context.Context, spec *dsecv1.SandboxSpec, n int) (release func(), err error) {
	project := spec.GetLabels()[ProjectLabel]
	if limited, err := s.limited(ctx, project); err != nil || !limited {
		return func() {}, err
	}
	amounts := amountsOf(spec, n)
	charged := store.Amounts{store.CreatesPerSecond: int64(n)}
	for r, v := range amounts {
		charged[r] = v
	}
	if err := s.charges.charge(ctx, s.cfg.Quotas, project, charged); err != nil {
		return nil, err
	}
	return func() { s.release(context.WithoutCancel(ctx), project, amounts) }, nil
}

// release gives back what sandboxes of project held.
func (s *Server) release(ctx context.Context, project string, amounts store.Amounts) {
	if limited, err := s.limited(ctx, project); err != nil || !limited {
		return
	}
	if err := s.cfg.Quotas.Release(ctx, project, amounts); err != nil {
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
// project no create was charged under takes effect within it.
const limitedTTL = time.Second

// limitCache remembers, by project, whether a limit on a sandbox resource
// applies to it (its own or an ancestor's).
type limitCache struct {
	mu sync.Mutex
	m  map[string]limitEntry
}

type limitEntry struct {
	limited bool
	at      time.Time
}

// limited reports whether a limit on a sandbox resource (or on creates per
// second) applies to project: its own or an ancestor's. A create under no
// limit is not charged, nor its sandboxes released: charging locks the
// root's quota rows, which would serialise every create of the cluster
// for nothing; the reconciliation keeps their use from the edges' truth,
// so a limit set later starts from it.
func (s *Server) limited(ctx context.Context, project string) (bool, error) {
	if s.cfg.Quotas == nil {
		return false, nil
	}
	now := time.Now()
	s.limits.mu.Lock()
	e, ok := s.limits.m[project]
	s.limits.mu.Unlock()
	if ok && now.Sub(e.at) < limitedTTL {
		return e.limited, nil
	}
	limited := false
	for _, p := range iam.Ancestors(project) {
		qs, err := s.cfg.Quotas.Quota(ctx, p)
		if err != nil {
			return false, err
		}
		for _, q := range qs {
			if q.Project != p {
				continue
			}
			for _, r := range append(sandboxResources, store.CreatesPerSecond) {
				if l, ok := q.Limits[r]; ok && l != store.Unlimited {
					limited = true
				}
			}
		}
		if limited {
			break
		}
	}
	s.limits.mu.Lock()
	if s.limits.m == nil || len(s.limits.m) >= maxSandboxProjects {
		s.limits.m = map[string]limitEntry{}
	}
	s.limits.m[project] = limitEntry{limited: limited, at: now}
	s.limits.mu.Unlock()
	return limited, nil
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
