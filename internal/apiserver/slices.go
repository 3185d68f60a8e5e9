package apiserver

import (
	"context"
	"errors"
	"sync"
	"time"

	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// Quota slices (store.LeaseSlice): each apiserver leases, for every limited
// project it creates sandboxes of, a slice of the project's headroom sized
// by its recent create rate, and charges keyed creates to the slice's own
// row (store.ReserveSliced) in the statement that reserves their keys,
// batched with other creates' reservations. Without slices every charged
// create of the cluster locks the same rows (the project's and every
// ancestor's), so one create group commits at a time cluster-wide. A
// create that finds no slice, or one spent, is charged exactly (reserve)
// and asks for a lease; a slice unused for a lease period goes back, and
// all of them when the apiserver stops; a dead apiserver's expire.

const (
	// sliceEvery is how often a slice is leased again: resized to the
	// last period's demand and its expiry pushed back.
	sliceEvery = time.Second
	// sliceTTL is how long a slice lives without being leased again.
	sliceTTL = 10 * time.Second
	// sliceMargin is how long before its expiry an apiserver stops
	// charging a slice it could not lease again: room for clocks and
	// a late statement.
	sliceMargin = 3 * time.Second
	// sliceAhead is how many periods of demand a slice is sized for.
	sliceAhead = 2
)

// sliceLeases are the slices this apiserver holds, by project.
type sliceLeases struct {
	mu sync.Mutex
	m  map[string]*leasedSlice
}

type leasedSlice struct {
	id     string
	usable time.Time // creates charge it until then
	// demand is what creates charged, or wanted to charge, since the
	// slice was last leased; least is the last create's charge.
	demand, least store.Amounts
	leasing       bool
	exactUntil    time.Time // no slice fitted: creates are charged exactly until then
}

// sliceable reports whether a charge can go to a slice: a rate cannot be
// sliced, nor a fork's charge in parts.
func sliceable(c *store.QuotaCharge) bool {
	return c != nil && c.Parts == 0 && c.Amounts[store.CreatesPerSecond] == 0 && len(c.Amounts) > 0
}

// sliceFor returns the slice a create of project charged amounts may be
// charged to, or "" (charge it exactly), and counts the demand; without a
// slice it starts a lease.
func (s *Server) sliceFor(ctx context.Context, project string, amounts store.Amounts) string {
	now := time.Now()
	l := &s.slices
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[string]*leasedSlice{}
	}
	e := l.m[project]
	if e == nil {
		if len(l.m) >= maxSandboxProjects {
			return ""
		}
		e = &leasedSlice{demand: store.Amounts{}}
		l.m[project] = e
	}
	for r, n := range amounts {
		e.demand[r] += n
	}
	e.least = amounts
	if e.id != "" && now.Before(e.usable) {
		return e.id
	}
	if !e.leasing && !now.Before(e.exactUntil) {
		e.leasing = true
		go s.leaseSlice(context.WithoutCancel(ctx), project)
	}
	return ""
}

// sliceSpent drops slice id of project, which refused a charge, and
// leases another.
func (s *Server) sliceSpent(ctx context.Context, project, id string) {
	l := &s.slices
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.m[project]
	if e == nil || e.id != id {
		return
	}
	e.id = ""
	if !e.leasing {
		e.leasing = true
		go s.leaseSlice(context.WithoutCancel(ctx), project)
	}
}

// leaseSlice leases project's slice again, sized for the demand since it
// was last leased, or returns it when there was none; its caller set
// leasing.
func (s *Server) leaseSlice(ctx context.Context, project string) {
	l := &s.slices
	l.mu.Lock()
	e := l.m[project]
	if e == nil {
		l.mu.Unlock()
		return // returned: the apiserver stops
	}
	old, least := e.id, e.least
	want := store.Amounts{}
	for r, n := range e.demand {
		want[r] = max(n, least[r]) * sliceAhead
	}
	e.demand = store.Amounts{}
	l.mu.Unlock()

	ctx, cancel := context.WithTimeout(ctx, chargeTimeout)
	defer cancel()
	start := time.Now()
	sl, err := s.cfg.Quotas.LeaseSlice(ctx, s.cfg.Name, project, old, want, least, start.Add(sliceTTL))
	l.mu.Lock()
	defer l.mu.Unlock()
	e.leasing = false
	switch {
	case err != nil:
		// The old slice, if the lease did not reach the store, expires.
		e.id = ""
		e.exactUntil = time.Now().Add(sliceEvery)
		s.log.Warn("lease a quota slice", "project", iam.Display(project), "err", err)
	case len(want) == 0:
		if l.m[project] == e {
			delete(l.m, project) // idle: returned
		}
	case sl.ID == "":
		e.id = ""
		e.exactUntil = time.Now().Add(sliceEvery) // near a limit
	default:
		e.id, e.usable = sl.ID, start.Add(sliceTTL-sliceMargin)
	}
}

// RunQuotaSlices leases this apiserver's slices again every sliceEvery
// until ctx ends, then returns them all.
func (s *Server) RunQuotaSlices(ctx context.Context) {
	if s.cfg.Quotas == nil {
		return
	}
	t := time.NewTicker(sliceEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			s.returnSlices(context.WithoutCancel(ctx))
			return
		case <-t.C:
		}
		s.slices.mu.Lock()
		for project, e := range s.slices.m {
			switch {
			case e.leasing:
			case e.id == "" && len(e.demand) == 0:
				delete(s.slices.m, project)
			default:
				e.leasing = true
				go s.leaseSlice(ctx, project)
			}
		}
		s.slices.mu.Unlock()
	}
}

// returnSlices gives back the headroom of every slice this apiserver
// holds: it stops.
func (s *Server) returnSlices(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	s.slices.mu.Lock()
	held := map[string]string{}
	for project, e := range s.slices.m {
		if e.id != "" {
			held[project] = e.id
		}
	}
	s.slices.m = nil
	s.slices.mu.Unlock()
	for project, id := range held {
		if _, err := s.cfg.Quotas.LeaseSlice(ctx, s.cfg.Name, project, id, nil, nil, time.Time{}); err != nil {
			s.log.Warn("return a quota slice (it expires)", "project", iam.Display(project), "err", err)
		}
	}
}

// reserveSliced reserves r charged to its project's slice when this
// apiserver holds one with room, else as reserve does.
func (s *Server) reserveSliced(ctx context.Context, r store.CreateReservation) (store.CreateReservation, bool, error) {
	if c := r.Charge; sliceable(c) {
		if id := s.sliceFor(ctx, c.Project, c.Amounts); id != "" {
			got, reserved, err := s.cfg.Quotas.ReserveSliced(ctx, id, r)
			switch {
			case errors.Is(err, store.ErrSliceSpent):
				s.sliceSpent(ctx, c.Project, id)
			case err != nil || reserved:
				return got, reserved, err
			}
			// A key held already: reserve follows it.
		}
	}
	return s.reserve(ctx, r)
}
