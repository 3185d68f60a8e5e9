package placement

import (
	"container/heap"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// SimConfig describes a simulated fill of a cluster. Zero fields take the
// defaults in brackets.
type SimConfig struct {
	Seed       uint64  // seeds the workload and every Placer; 0 is a seed like any other
	Nodes      int     // nodes (160: one DSec scale unit)
	Capacity   int     // sandboxes per node (200)
	Fill       float64 // fraction of the total capacity created (0.8)
	Apiservers int     // replicas, each with its own Placer (4)
	K          int     // candidates per pick (DefaultK)
	Group      int     // sandboxes of a batch one pick places together, in every policy (DefaultGroup)
	Rate       float64 // creates per simulated second over the cluster (5,000)
	Batch      int     // sandboxes in one batch create (50); 1 means singles only
	BatchShare float64 // fraction of the sandboxes that arrive in batches (0.5)
	// ReportEvery is how often each node reports its load (2 s), each at its
	// own phase; Placers see Live only as of a node's last report.
	ReportEvery time.Duration
	// CreateTime is how long a create takes on the edge before the node
	// counts it in a report and the apiserver hears it worked (500 ms).
	CreateTime time.Duration
}

// SimResult is the outcome of one Simulate: the same workload run against
// each policy on its own copy of the cluster.
type SimResult struct {
	Config   SimConfig     // as run, defaults filled in
	Duration time.Duration // simulated time the creates took to arrive
	// InFlight is the Placer as the apiserver runs it: power of K with
	// in-flight and recent placements, Replicas = Apiservers.
	InFlight PolicyResult
	// InFlightOwn is the same with Replicas = 1: each replica counts only
	// its own placements (E2B's fix, PR #2201, as it is).
	InFlightOwn PolicyResult
	Naive       PolicyResult // power of K on reported load only
	Random      PolicyResult // uniform among the nodes with reported room
}

// PolicyResult is how evenly one policy filled the cluster.
type PolicyResult struct {
	Policy      string
	Placed      int     // sandboxes running at the end
	Mean        float64 // sandboxes per node
	Max         int     // sandboxes on the fullest node
	MaxOverMean float64
	Refused     int // creates an edge's admission refused, placed again elsewhere
	Unplaced    int // creates no node had room for
}

func (r PolicyResult) String() string {
	return fmt.Sprintf("%s: max/mean %.3f (max %d, mean %.1f), %d refused, %d unplaced",
		r.Policy, r.MaxOverMean, r.Max, r.Mean, r.Refused, r.Unplaced)
}

func (c SimConfig) withDefaults() SimConfig {
	if c.Nodes <= 0 {
		c.Nodes = 160
	}
	if c.Capacity <= 0 {
		c.Capacity = 200
	}
	if c.Fill <= 0 {
		c.Fill = 0.8
	}
	if c.Apiservers <= 0 {
		c.Apiservers = 4
	}
	if c.K <= 0 {
		c.K = DefaultK
	}
	if c.Group <= 0 {
		c.Group = DefaultGroup
	}
	if c.Rate <= 0 {
		c.Rate = 5000
	}
	if c.Batch <= 0 {
		c.Batch = 50
	}
	if c.BatchShare <= 0 {
		c.BatchShare = 0.5
	}
	c.BatchShare = min(c.BatchShare, 1)
	if c.ReportEvery <= 0 {
		c.ReportEvery = 2 * time.Second
	}
	if c.CreateTime <= 0 {
		c.CreateTime = 500 * time.Millisecond
	}
	return c
}

// Simulate fills a simulated cluster from empty to cfg.Fill with creates
// from cfg.Apiservers replicas and reports how evenly each policy spread
// them. Edges admit a create only while they have room and refuse the rest,
// which the apiserver places again elsewhere (Retry). Time is simulated;
// nothing sleeps, and a seed gives the same result every run.
func Simulate(cfg SimConfig) SimResult {
	cfg = cfg.withDefaults()
	w := newWorkload(cfg)
	res := SimResult{Config: cfg}
	if n := len(w.arrivals); n > 0 {
		res.Duration = w.arrivals[n-1].at
	}
	res.InFlight = w.run(fmt.Sprintf("power of %d, in-flight x%d replicas", cfg.K, cfg.Apiservers), cfg.K, false, cfg.Apiservers)
	res.InFlightOwn = w.run(fmt.Sprintf("power of %d, own in-flight only", cfg.K), cfg.K, false, 1)
	res.Naive = w.run(fmt.Sprintf("power of %d, reports only", cfg.K), cfg.K, true, 1)
	res.Random = w.run("random", 1, true, 1)
	return res
}

// workload is what every policy faces: the same arrivals and report phases.
type workload struct {
	cfg      SimConfig
	arrivals []arrival
	phases   []time.Duration // each node's first report
}

type arrival struct {
	at         time.Duration
	api, count int
}

func newWorkload(cfg SimConfig) *workload {
	rng := rand.New(rand.NewPCG(cfg.Seed, 0))
	w := &workload{cfg: cfg, phases: make([]time.Duration, cfg.Nodes)}
	for i := range w.phases {
		w.phases[i] = time.Duration(rng.Int64N(int64(cfg.ReportEvery)))
	}
	// q is the chance an arrival is a batch, so that BatchShare of the
	// sandboxes come in batches.
	q := 0.0
	if cfg.Batch > 1 {
		b, s := float64(cfg.Batch), cfg.BatchShare
		q = s / (b*(1-s) + s)
	}
	perArrival := q*float64(cfg.Batch) + 1 - q
	mean := float64(time.Second) * perArrival / cfg.Rate // between arrivals
	left := int(math.Round(cfg.Fill * float64(cfg.Nodes) * float64(cfg.Capacity)))
	var at time.Duration
	for left > 0 {
		at += time.Duration(rng.ExpFloat64() * mean)
		n := 1
		if rng.Float64() < q {
			n = min(cfg.Batch, left)
		}
		w.arrivals = append(w.arrivals, arrival{at: at, api: rng.IntN(cfg.Apiservers), count: n})
		left -= n
	}
	return w
}

// run plays the workload against one policy.
func (w *workload) run(policy string, k int, blind bool, replicas int) PolicyResult {
	c := newCluster(w.cfg, k, blind, replicas)
	c.res.Policy = policy
	for i, ph := range w.phases {
		c.q.add(event{at: ph, node: i, report: true})
	}
	for next := 0; next < len(w.arrivals) || c.pending > 0; {
		// Reports keep coming, so the queue is never empty.
		if next < len(w.arrivals) && w.arrivals[next].at < c.q.items[0].at {
			c.arrive(w.arrivals[next])
			next++
			continue
		}
		e := c.q.next()
		c.clock = e.at
		if e.report {
			c.report(e.node)
			e.at += w.cfg.ReportEvery
			c.q.add(e)
			continue
		}
		c.complete(e)
	}

	res := c.res
	for _, n := range c.running {
		res.Placed += n
		res.Max = max(res.Max, n)
	}
	res.Mean = float64(res.Placed) / float64(w.cfg.Nodes)
	if res.Mean > 0 {
		res.MaxOverMean = float64(res.Max) / res.Mean
	}
	return res
}

// cluster is one policy's simulated cluster: the edges, the watcher's view
// of them, and the apiservers' Placers.
type cluster struct {
	cfg      SimConfig
	base     time.Time
	clock    time.Duration
	placers  []*Placer
	view     []Node
	index    map[string]int // view by name
	running  []int          // per node, counted in reports
	starting []int          // per node, admitted and not yet counted
	pending  int            // creates admitted and not complete
	q        events
	res      PolicyResult
	picked   []int // scratch for arrive
	touched  []int
}

func newCluster(cfg SimConfig, k int, blind bool, replicas int) *cluster {
	c := &cluster{cfg: cfg, base: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC),
		view: make([]Node, cfg.Nodes), index: make(map[string]int, cfg.Nodes),
		running: make([]int, cfg.Nodes), starting: make([]int, cfg.Nodes), picked: make([]int, cfg.Nodes)}
	for i := range cfg.Apiservers {
		p := New(Config{K: k, Group: cfg.Group, Rand: rand.New(rand.NewPCG(cfg.Seed, uint64(i)+1)), Now: c.now, Replicas: replicas})
		p.blind = blind
		c.placers = append(c.placers, p)
	}
	for i := range c.view {
		c.view[i] = Node{Name: fmt.Sprintf("node-%03d", i), Backends: []string{DefaultBackend},
			Capacity: cfg.Capacity, Healthy: true, ReportedAt: c.base}
		c.index[c.view[i].Name] = i
	}
	return c
}

func (c *cluster) now() time.Time { return c.base.Add(c.clock) }

// arrive places one create request, as an apiserver would: the edges admit
// what they have room for and refuse the rest, which is placed again
// without them.
func (c *cluster) arrive(a arrival) {
	c.clock = a.at
	p := c.placers[a.api]
	var r Retry
	for left := a.count; left > 0; {
		names, err := p.Place(c.view, Request{Count: left}, r.Exclude)
		if err != nil {
			c.res.Unplaced += left
			return
		}
		left = 0
		c.touched = c.touched[:0]
		for _, name := range names {
			i := c.index[name]
			if c.picked[i] == 0 {
				c.touched = append(c.touched, i)
			}
			c.picked[i]++
		}
		for _, i := range c.touched {
			n := c.picked[i]
			c.picked[i] = 0
			admit := min(n, c.cfg.Capacity-c.running[i]-c.starting[i])
			if admit > 0 {
				c.starting[i] += admit
				c.pending++
				c.q.add(event{at: c.clock + c.cfg.CreateTime, node: i, api: a.api, n: admit})
			}
			if n > admit {
				p.Done(c.view[i].Name, n-admit, false)
				c.res.Refused += n - admit
				left += n - admit
				r.Again(c.view[i].Name, fmt.Errorf("node %s is full: %w", c.view[i].Name, errdefs.ErrResourceExhausted))
			}
		}
	}
}

// report is node i telling every watcher its load.
func (c *cluster) report(i int) {
	c.view[i].Live = c.running[i]
	c.view[i].ReportedAt = c.now()
	for _, p := range c.placers {
		p.Observe(c.view[i].Name, c.view[i].ReportedAt)
	}
}

// complete is the end of a create: the node counts it and the apiserver
// that placed it hears it worked.
func (c *cluster) complete(e event) {
	c.pending--
	c.starting[e.node] -= e.n
	c.running[e.node] += e.n
	c.placers[e.api].Done(c.view[e.node].Name, e.n, true)
}

// event is a node's report or the end of a create. Events order by time,
// then by the order they were added in, so runs repeat exactly.
type event struct {
	at     time.Duration
	seq    int
	report bool
	node   int
	api, n int
}

// events is a heap of events (container/heap).
type events struct {
	items []event
	added int
}

func (q *events) add(e event) {
	e.seq = q.added
	q.added++
	heap.Push(q, e)
}

func (q *events) next() event { return heap.Pop(q).(event) }

func (q *events) Len() int { return len(q.items) }
func (q *events) Less(i, j int) bool {
	a, b := &q.items[i], &q.items[j]
	if a.at != b.at {
		return a.at < b.at
	}
	return a.seq < b.seq
}
func (q *events) Swap(i, j int) { q.items[i], q.items[j] = q.items[j], q.items[i] }
func (q *events) Push(x any)    { q.items = append(q.items, x.(event)) }
func (q *events) Pop() any {
	e := q.items[len(q.items)-1]
	q.items = q.items[:len(q.items)-1]
	return e
}
