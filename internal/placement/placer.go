package placement

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// DefaultBackend is the backend a Request with an empty Backend asks for.
const DefaultBackend = "container"

// Defaults for the zero fields of Config.
const (
	DefaultK         = 3
	DefaultRecentTTL = 10 * time.Second
	DefaultGroup     = 4
	DefaultSpread    = 8
)

// Node is one edge as the apiserver's watcher last saw it. Names are unique
// within a view; a Placer keys its accounting by them.
type Node struct {
	Name     string
	Backends []string // kinds the edge offers, by name (its isolations: container, gvisor, microvm); only what it lists
	Capacity int      // the most sandboxes the edge admits
	Live     int      // sandboxes the edge counted at ReportedAt
	Healthy  bool
	// ReportedAt is when Live was measured. Placements this Placer saw
	// succeed at or after it are added to Live; earlier ones are in it.
	ReportedAt time.Time
}

// Request asks for Count sandboxes of one backend in one decision.
type Request struct {
	Backend string // the kind asked for, an isolation's name; "" means DefaultBackend
	Count   int
}

// Config configures a Placer. The zero value works, with a random seed.
type Config struct {
	// K is how many distinct candidates are sampled per pick (DefaultK).
	K int
	// Group is how many sandboxes of a batch one pick places together, on
	// the node it chose (DefaultGroup; 1 places each on its own): a batch
	// of n costs about n/Group calls to edges rather than n, and its
	// sandboxes share each node's layer cache. A node with less room takes
	// what fits and the next pick the rest.
	Group int
	// Spread is how many picks a batch gets at least, when it has that
	// many sandboxes and there are that many candidates (DefaultSpread):
	// groups shrink for it, so a small batch still goes to several nodes
	// (4 over 2 nodes: 2 and 2) and its calls run in parallel.
	Spread int
	// Rand is the Placer's only source of randomness; the Placer uses it
	// under its own lock, so it must not be shared. Nil: seeded from the
	// runtime's random source.
	Rand *rand.Rand
	// Now tells the time of Done and of RecentTTL's expiry (time.Now). It
	// must be safe for concurrent use.
	Now func() time.Time
	// RecentTTL is how long a successful placement keeps counting when no
	// report newer than it arrives (DefaultRecentTTL).
	RecentTTL time.Duration
	// Replicas is how many apiservers place onto the same nodes (1). Scores
	// count each of this Placer's unreported placements Replicas times: see
	// the package comment.
	Replicas int
}

// Placer chooses nodes for sandboxes. It is safe for concurrent use; one
// apiserver shares one Placer among all its requests, so they see each
// other's reservations. Replicas each have their own and share nothing.
type Placer struct {
	k      int
	group  int
	spread int
	scale  int // Config.Replicas
	ttl    time.Duration
	now    func() time.Time
	blind  bool // ignore in-flight and recent placements (Simulate's baselines only)

	mu    sync.Mutex
	rng   *rand.Rand
	nodes map[string]*nodeState // only nodes with something in flight or recent
	cands []cand                // scratch for Place, reused under mu
	live  []int
}

type nodeState struct {
	inflight int     // returned by Place, not yet reported by Done
	recent   []stamp // reported placed by Done, oldest first
	recentN  int     // the sum of recent's n
}

type stamp struct {
	at time.Time
	n  int
}

type cand struct {
	name  string
	load  int // Live + in flight + recent + this decision's picks
	score int // load, with in flight and recent counted scale times
	cap   int
	picks int
}

// New returns a Placer.
func New(cfg Config) *Placer {
	p := &Placer{k: cfg.K, ttl: cfg.RecentTTL, now: cfg.Now, rng: cfg.Rand, nodes: map[string]*nodeState{}}
	if p.k <= 0 {
		p.k = DefaultK
	}
	p.group = cfg.Group
	if p.group <= 0 {
		p.group = DefaultGroup
	}
	p.spread = cfg.Spread
	if p.spread <= 0 {
		p.spread = DefaultSpread
	}
	p.scale = max(cfg.Replicas, 1)
	if p.ttl <= 0 {
		p.ttl = DefaultRecentTTL
	}
	if p.now == nil {
		p.now = time.Now
	}
	if p.rng == nil {
		p.rng = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	}
	return p
}

// Place chooses a node for each of req.Count sandboxes in one decision and
// returns their names, one per sandbox, those of one pick (up to
// Config.Group) next to each other. Candidates are the healthy nodes
// offering req.Backend with room, less those in exclude (the nodes this
// request already tried). Everything returned is reserved as in flight until
// the caller reports it with Done, which it must do exactly once per
// sandbox, whether the create worked or not.
//
// The batch is placed whole or not at all: when the candidates have less
// room than req.Count, or there are none, Place returns an *ExhaustedError
// saying what ran out, of a kind that says whether waiting helps (see its
// Unwrap).
func (p *Placer) Place(nodes []Node, req Request, exclude map[string]bool) ([]string, error) {
	backend := req.Backend
	if backend == "" {
		backend = DefaultBackend
	}
	if req.Count < 1 {
		return nil, fmt.Errorf("place %d %s sandboxes: %w", req.Count, backend, errdefs.ErrInvalidArgument)
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	expired := p.now().Add(-p.ttl)
	ex := ExhaustedError{Backend: backend, Count: req.Count, Nodes: len(nodes)}
	cands := p.cands[:0]
	for i := range nodes {
		n := &nodes[i]
		if !n.Healthy {
			continue
		}
		ex.Healthy++
		if !slices.Contains(n.Backends, backend) {
			continue
		}
		ex.Offering++
		if exclude[n.Name] {
			ex.Excluded++
			continue
		}
		c := cand{name: n.Name, load: max(n.Live, 0), cap: max(n.Capacity, 0)}
		c.score = c.load
		if st := p.nodes[n.Name]; st != nil && !p.blind {
			own := st.inflight + st.unreported(n.ReportedAt, expired)
			c.load += own
			c.score += own * p.scale
			if st.idle() {
				delete(p.nodes, n.Name)
			}
		}
		ex.Capacity += c.cap
		ex.Used += min(c.load, c.cap)
		cands = append(cands, c)
	}
	p.cands = cands[:0]
	if ex.Capacity-ex.Used < req.Count {
		ex.Shortage = ex.shortage()
		if ex.Shortage == NoBackend {
			ex.Offered = offered(nodes)
		}
		return nil, &ex
	}

	// live holds the indices of the candidates with room; a candidate leaves
	// it when this decision fills it. Its first k entries are shuffled anew
	// for each sandbox (a partial Fisher–Yates), which samples k distinct
	// candidates uniformly whatever order the rest is in.
	live := p.live[:0]
	for i := range cands {
		if cands[i].load < cands[i].cap {
			live = append(live, i)
		}
	}
	group := min(p.group, max(1, req.Count/min(req.Count, len(live), p.spread)))
	out := make([]string, 0, req.Count)
	for len(out) < req.Count {
		k := min(p.k, len(live))
		best := 0
		for j := range k {
			r := j + p.rng.IntN(len(live)-j)
			live[j], live[r] = live[r], live[j]
			if j > 0 && lighter(&cands[live[j]], &cands[live[best]]) {
				best = j
			}
		}
		c := &cands[live[best]]
		n := min(group, req.Count-len(out), c.cap-c.load)
		c.load += n
		c.score += n
		c.picks += n
		for range n {
			out = append(out, c.name)
		}
		if c.load >= c.cap {
			live[best] = live[len(live)-1]
			live = live[:len(live)-1]
		}
	}
	p.live = live[:0]

	if !p.blind {
		for i := range cands {
			if c := &cands[i]; c.picks > 0 {
				st := p.nodes[c.name]
				if st == nil {
					st = &nodeState{}
					p.nodes[c.name] = st
				}
				st.inflight += c.picks
			}
		}
	}
	return out, nil
}

// lighter reports whether a is less loaded than b relative to capacity:
// a.load/a.cap < b.load/b.cap, without division. Ties go to b, the one
// sampled first, so they break at random.
func lighter(a, b *cand) bool {
	return int64(a.score)*int64(b.cap) < int64(b.score)*int64(a.cap)
}

// Done reports the outcome of n of the caller's placements on node: they
// leave the in-flight count, and if placed they count as recent on the node
// until a report newer than now arrives (Observe, or a Node whose
// ReportedAt is after it) or RecentTTL passes, so that metrics measured
// before the sandboxes existed never hide them. Reports of more than is in
// flight on node are cut to what is.
func (p *Placer) Done(node string, n int, placed bool) {
	if n <= 0 || p.blind {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	st := p.nodes[node]
	if st == nil {
		return
	}
	n = min(n, st.inflight)
	st.inflight -= n
	if placed && n > 0 {
		st.add(p.now(), n)
	}
	if st.idle() {
		delete(p.nodes, node)
	}
}

// Observe tells the Placer that node reported its load as measured at
// reportedAt: recent placements made before then are in that report and
// stop counting. The watcher calls it for every report it receives.
func (p *Placer) Observe(node string, reportedAt time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := p.nodes[node]
	if st == nil {
		return
	}
	st.dropBefore(reportedAt)
	if st.idle() {
		delete(p.nodes, node)
	}
}

// unreported drops the recent placements at or before expired and returns
// how many of the rest a report measured at reportedAt does not include.
// Observe has usually dropped those it does include already, so the scan
// for them stops at once.
func (st *nodeState) unreported(reportedAt, expired time.Time) int {
	i := 0
	for i < len(st.recent) && !st.recent[i].at.After(expired) {
		st.recentN -= st.recent[i].n
		i++
	}
	st.recent = st.recent[i:]
	n := st.recentN
	for j := 0; j < len(st.recent) && st.recent[j].at.Before(reportedAt); j++ {
		n -= st.recent[j].n
	}
	return n
}

// dropBefore drops the recent placements made before t.
func (st *nodeState) dropBefore(t time.Time) {
	i := 0
	for i < len(st.recent) && st.recent[i].at.Before(t) {
		st.recentN -= st.recent[i].n
		i++
	}
	st.recent = st.recent[i:]
}

// add records n placements confirmed at at, keeping recent in time order
// even if the clock stepped back.
func (st *nodeState) add(at time.Time, n int) {
	st.recentN += n
	if k := len(st.recent); k == 0 || st.recent[k-1].at.Before(at) {
		st.recent = append(st.recent, stamp{at, n})
		return
	}
	i, found := slices.BinarySearchFunc(st.recent, at, func(s stamp, t time.Time) int { return s.at.Compare(t) })
	if found {
		st.recent[i].n += n
		return
	}
	st.recent = slices.Insert(st.recent, i, stamp{at, n})
}

func (st *nodeState) idle() bool { return st.inflight == 0 && len(st.recent) == 0 }
