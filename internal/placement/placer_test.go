package placement

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/errdefs"
)

var t0 = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)

// clock is a settable Now, safe for concurrent use.
type clock struct{ ns atomic.Int64 }

func newClock() *clock { c := &clock{}; c.set(t0); return c }

func (c *clock) now() time.Time          { return time.Unix(0, c.ns.Load()).UTC() }
func (c *clock) set(t time.Time)         { c.ns.Store(t.UnixNano()) }
func (c *clock) advance(d time.Duration) { c.ns.Add(int64(d)) }

func newPlacer(seed uint64, c *clock) *Placer {
	return New(Config{Rand: rand.New(rand.NewPCG(seed, 1)), Now: c.now})
}

func node(name string, live, capacity int, backends ...string) Node {
	if len(backends) == 0 {
		backends = []string{"container"}
	}
	return Node{Name: name, Backends: backends, Capacity: capacity, Live: live, Healthy: true, ReportedAt: t0}
}

func unhealthy(n Node) Node { n.Healthy = false; return n }

// counts tallies Place's answer per node.
func counts(names []string) map[string]int {
	m := map[string]int{}
	for _, n := range names {
		m[n]++
	}
	return m
}

func TestPlaceFilters(t *testing.T) {
	for _, tc := range []struct {
		name    string
		nodes   []Node
		req     Request
		exclude map[string]bool
		want    string // the only node that may be chosen
	}{
		{"unhealthy", []Node{unhealthy(node("a", 0, 10)), node("b", 5, 10)}, Request{Count: 5}, nil, "b"},
		{"backend", []Node{node("a", 0, 10, "container"), node("b", 5, 10, "container", "microvm")}, Request{Backend: "microvm", Count: 5}, nil, "b"},
		{"empty backend is container", []Node{node("a", 0, 10, "microvm"), node("b", 5, 10, "fncall", "container")}, Request{Count: 5}, nil, "b"},
		{"node offering nothing", []Node{{Name: "a", Capacity: 10, Healthy: true}, node("b", 5, 10)}, Request{Count: 5}, nil, "b"},
		{"full", []Node{node("a", 10, 10), node("b", 5, 10)}, Request{Count: 5}, nil, "b"},
		{"over full", []Node{node("a", 12, 10), node("b", 5, 10)}, Request{Count: 5}, nil, "b"},
		{"no capacity", []Node{node("a", 0, 0), node("b", 5, 10)}, Request{Count: 5}, nil, "b"},
		{"excluded", []Node{node("a", 0, 10), node("b", 5, 10)}, Request{Count: 5}, map[string]bool{"a": true}, "b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for seed := range uint64(5) {
				got, err := newPlacer(seed, newClock()).Place(tc.nodes, tc.req, tc.exclude)
				if err != nil {
					t.Fatal(err)
				}
				if diff := cmp.Diff(map[string]int{tc.want: tc.req.Count}, counts(got)); diff != "" {
					t.Errorf("seed %d: placements (-want +got):\n%s", seed, diff)
				}
			}
		})
	}
}

func TestPlaceErrors(t *testing.T) {
	three := []Node{node("a", 200, 200), node("b", 200, 200), node("c", 200, 200)}
	for _, tc := range []struct {
		name     string
		nodes    []Node
		req      Request
		exclude  map[string]bool
		shortage Shortage
		free     int
		msg      string
		kind     error
	}{
		{"no nodes", nil, Request{Count: 1}, nil, NoHealthyNode, 0,
			"no healthy node (no nodes are registered)", errdefs.ErrUnavailable},
		{"none healthy", []Node{unhealthy(node("a", 0, 10)), unhealthy(node("b", 0, 10))}, Request{Count: 1}, nil, NoHealthyNode, 0,
			"no healthy node (2 nodes, none healthy)", errdefs.ErrUnavailable},
		{"no backend", []Node{node("a", 0, 10, "container", "fncall"), node("b", 0, 10, "container"), unhealthy(node("c", 0, 10, "microvm"))},
			Request{Backend: "microvm", Count: 1}, nil, NoBackend, 0,
			"no healthy node offers microvm sandboxes (2 healthy nodes offer container, fncall)", errdefs.ErrFailedPrecondition},
		{"all tried", []Node{node("a", 0, 10), node("b", 0, 10), node("c", 0, 10, "microvm")}, Request{Count: 1},
			map[string]bool{"a": true, "b": true}, AllTried, 0,
			"every healthy node offering container was already tried (2 nodes)", errdefs.ErrResourceExhausted},
		{"all full", three, Request{Count: 1}, nil, AllFull, 0,
			"every healthy node offering container is full (3 nodes, 600 of 600 sandboxes)", errdefs.ErrResourceExhausted},
		{"one full", three[:1], Request{Backend: "container", Count: 1}, nil, AllFull, 0,
			"every healthy node offering container is full (1 node, 200 of 200 sandboxes)", errdefs.ErrResourceExhausted},
		{"all full or tried", append([]Node{node("d", 0, 200)}, three[:2]...), Request{Count: 1}, map[string]bool{"d": true}, AllFull, 0,
			"every healthy node offering container is full or was already tried (2 full, 400 of 400 sandboxes; 1 tried)", errdefs.ErrResourceExhausted},
		{"batch too big", []Node{node("a", 160, 200), node("b", 160, 200), node("c", 160, 200)}, Request{Count: 300}, nil, TooLittleRoom, 120,
			"room for 120 of 300 container sandboxes (3 healthy nodes offering container, 480 of 600 sandboxes used)", errdefs.ErrResourceExhausted},
		{"batch too big, some tried", []Node{node("a", 160, 200), node("b", 160, 200), node("c", 0, 200)}, Request{Count: 100},
			map[string]bool{"c": true}, TooLittleRoom, 80,
			"room for 80 of 100 container sandboxes (2 healthy nodes offering container, 320 of 400 sandboxes used; 1 more already tried)", errdefs.ErrResourceExhausted},
		{"batch bigger than the nodes", []Node{node("a", 10, 200), node("b", 0, 200)}, Request{Count: 500}, nil, TooBig, 390,
			"a batch of 500 container sandboxes is more than the 2 healthy nodes offering container hold together even when empty (400); make smaller batches",
			errdefs.ErrFailedPrecondition},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPlacer(1, newClock())
			got, err := p.Place(tc.nodes, tc.req, tc.exclude)
			if err == nil {
				t.Fatalf("Place = %v, want an error", got)
			}
			// Only a shortage that waiting can end is ResourceExhausted,
			// which callers retry.
			if !errors.Is(err, tc.kind) {
				t.Errorf("error %v does not wrap %v", err, tc.kind)
			}
			var ex *ExhaustedError
			if !errors.As(err, &ex) {
				t.Fatalf("error %T is not an *ExhaustedError", err)
			}
			if ex.Shortage != tc.shortage || ex.Free() != tc.free {
				t.Errorf("shortage %d, free %d; want %d, %d", ex.Shortage, ex.Free(), tc.shortage, tc.free)
			}
			if err.Error() != tc.msg {
				t.Errorf("message\n got %q\nwant %q", err, tc.msg)
			}
			if len(p.nodes) != 0 {
				t.Errorf("a refused Place reserved %v", p.nodes)
			}
		})
	}

	t.Run("count", func(t *testing.T) {
		for _, n := range []int{0, -1} {
			_, err := newPlacer(1, newClock()).Place(three, Request{Count: n}, nil)
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Count %d: error %v, want InvalidArgument", n, err)
			}
		}
	})
}

// TestBatchSpreads checks that a batch's earlier picks count at once: the
// batch spreads in proportion to room instead of piling where a sample
// first pointed.
func TestBatchSpreads(t *testing.T) {
	for _, tc := range []struct {
		name  string
		nodes []Node
		count int
		want  map[string]int // each node's fair share
		slack int            // how far from its share a node may land
	}{
		// With K ≥ the node count every pick sees every node.
		{"3 equal nodes", []Node{node("a", 0, 200), node("b", 0, 200), node("c", 0, 200)}, 300,
			map[string]int{"a": 100, "b": 100, "c": 100}, 0},
		{"3 nodes by capacity", []Node{node("a", 0, 100), node("b", 0, 200), node("c", 0, 300)}, 300,
			map[string]int{"a": 50, "b": 100, "c": 150}, 1},
		{"3 nodes by load", []Node{node("a", 100, 200), node("b", 50, 200), node("c", 0, 200)}, 150,
			map[string]int{"a": 0, "b": 50, "c": 100}, 1},
		// With K < N a node is compared only when sampled.
		{"30 equal nodes", equal(30, 0, 200), 300, fair(30, 10), 2},
	} {
		// Grouped picks land in steps of a group: a node may be a group
		// further from its share.
		for _, group := range []int{1, DefaultGroup} {
			t.Run(fmt.Sprintf("%s, group %d", tc.name, group), func(t *testing.T) {
				for seed := range uint64(10) {
					p := New(Config{Rand: rand.New(rand.NewPCG(seed, 1)), Now: newClock().now, Group: group})
					got, err := p.Place(tc.nodes, Request{Count: tc.count}, nil)
					if err != nil {
						t.Fatal(err)
					}
					c := counts(got)
					slack := tc.slack + group - 1
					if group > 1 {
						slack++
					}
					for name, share := range tc.want {
						if c[name] > share*3/2+group-1 || abs(c[name]-share) > slack {
							t.Errorf("seed %d: %s got %d, share %d ± %d (all: %v)", seed, name, c[name], share, slack, c)
						}
					}
				}
			})
		}
	}
}

func equal(n, live, capacity int) []Node {
	nodes := make([]Node, n)
	for i := range nodes {
		nodes[i] = node(fmt.Sprintf("n%02d", i), live, capacity)
	}
	return nodes
}

func fair(n, share int) map[string]int {
	m := map[string]int{}
	for i := range n {
		m[fmt.Sprintf("n%02d", i)] = share
	}
	return m
}

func abs(n int) int { return max(n, -n) }

// TestThunderingHerd is the case E2B PR #2201 fixed: between two reports a
// burst of single creates arrives, and one node looked emptiest at the last
// report. Counting its own placements, the Placer gives that node its
// share; on reports alone, power of k piles onto it (it wins every sample
// it is in, K/N of all creates), and random placement spreads no better
// than chance.
func TestThunderingHerd(t *testing.T) {
	const nodes, burst = 20, 200
	const share = burst / nodes
	for _, tc := range []struct {
		name        string
		k           int
		blind       bool
		maxEmptiest int // most the emptiest-looking node may get
		minEmptiest int // least it must get
		maxAny      int // most any node may get
	}{
		{"in-flight", DefaultK, false, share * 3 / 2, 0, share * 3 / 2},
		{"reports only", DefaultK, true, burst, share * 2, burst},
		{"random", 1, true, burst, 0, burst},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for seed := range uint64(10) {
				c := newClock()
				p := New(Config{K: tc.k, Rand: rand.New(rand.NewPCG(seed, 2)), Now: c.now})
				p.blind = tc.blind
				view := equal(nodes, 50, 100)
				view[7].Live = 49 // emptiest at the last report
				got := map[string]int{}
				var inflight []string
				for range burst {
					names, err := p.Place(view, Request{Count: 1}, nil)
					if err != nil {
						t.Fatal(err)
					}
					got[names[0]]++
					c.advance(5 * time.Millisecond)
					// Creates finish a few placements later: some of the
					// burst is in flight, the rest recent.
					if inflight = append(inflight, names[0]); len(inflight) > 5 {
						p.Done(inflight[0], 1, true)
						inflight = inflight[1:]
					}
				}
				most := 0
				for _, n := range got {
					most = max(most, n)
				}
				if e := got["n07"]; e > tc.maxEmptiest || e < tc.minEmptiest || most > tc.maxAny {
					t.Errorf("seed %d: the emptiest node got %d, the most any got %d, of a share of %d; want %d..%d and at most %d",
						seed, e, most, share, tc.minEmptiest, tc.maxEmptiest, tc.maxAny)
				}
				if seed == 0 {
					t.Logf("seed 0: the emptiest node got %d, the most any got %d, of a share of %d", got["n07"], most, share)
				}
			}
		})
	}
}

// TestInFlight checks that what Place returns holds room until Done, and
// that a failed create gives it back.
func TestInFlight(t *testing.T) {
	c := newClock()
	p := newPlacer(1, c)
	view := []Node{node("a", 0, 2)}
	for i := range 2 {
		if _, err := p.Place(view, Request{Count: 1}, nil); err != nil {
			t.Fatalf("place %d: %v", i, err)
		}
	}
	if _, err := p.Place(view, Request{Count: 1}, nil); err == nil || err.Error() != "every healthy node offering container is full (1 node, 2 of 2 sandboxes)" {
		t.Fatalf("third place: %v, want full counting the two in flight", err)
	}
	p.Done("a", 1, false)
	if _, err := p.Place(view, Request{Count: 1}, nil); err != nil {
		t.Fatalf("after a failed create: %v", err)
	}
	p.Done("a", 1, true)
	if _, err := p.Place(view, Request{Count: 1}, nil); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("a recent placement gave its room back: %v", err)
	}
	p.Done("a", 5, false) // more than is in flight: cut to the one there is
	p.Done("b", 1, true)  // nothing there
	if st := p.nodes["a"]; st.inflight != 0 || len(st.recent) != 1 {
		t.Fatalf("state of a = %+v, want nothing in flight and one recent", *st)
	}
	if _, ok := p.nodes["b"]; ok {
		t.Fatal("Done on a node with nothing in flight made state")
	}
	p.Observe("a", c.now().Add(time.Second))
	if len(p.nodes) != 0 {
		t.Fatalf("state left after everything was reported: %v", p.nodes)
	}
}

// TestRecent checks when a successful placement stops counting: once a
// report measured after it arrives, by Observe or in the view itself, or
// when RecentTTL has passed.
func TestRecent(t *testing.T) {
	const ttl = 10 * time.Second
	for _, tc := range []struct {
		name       string
		observe    time.Duration // Observe at placed+observe, if not 0
		reportedAt time.Duration // the view's ReportedAt, relative to placed
		later      time.Duration // time passed since placed
		counted    bool
	}{
		{"no report since", 0, -time.Second, time.Second, true},
		{"older report observed", -time.Millisecond, -time.Second, time.Second, true},
		{"report at the placement", 0, 0, time.Second, true},
		{"newer report observed", time.Millisecond, -time.Second, time.Second, false},
		{"newer report in the view", 0, time.Millisecond, time.Second, false},
		{"just inside the TTL", 0, -time.Second, ttl - time.Nanosecond, true},
		{"TTL passed", 0, -time.Second, ttl, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newClock()
			p := New(Config{Rand: rand.New(rand.NewPCG(1, 1)), Now: c.now, RecentTTL: ttl})
			view := []Node{node("a", 0, 1)}
			if _, err := p.Place(view, Request{Count: 1}, nil); err != nil {
				t.Fatal(err)
			}
			c.advance(300 * time.Millisecond)
			placed := c.now()
			p.Done("a", 1, true)
			if tc.observe != 0 {
				p.Observe("a", placed.Add(tc.observe))
			}
			c.advance(tc.later)
			view[0].ReportedAt = placed.Add(tc.reportedAt)
			_, err := p.Place(view, Request{Count: 1}, nil)
			if counted := err != nil; counted != tc.counted {
				t.Errorf("placement counted = %v, want %v (Place: %v)", counted, tc.counted, err)
			}
		})
	}
}

// TestObserveKeepsLater checks that a report drops only the placements it
// includes, in a node's own time order even if the clock stepped back.
func TestObserveKeepsLater(t *testing.T) {
	c := newClock()
	p := newPlacer(1, c)
	view := []Node{node("a", 0, 10)}
	if _, err := p.Place(view, Request{Count: 4}, nil); err != nil {
		t.Fatal(err)
	}
	for _, step := range []time.Duration{0, time.Second, -3 * time.Second, 5 * time.Second} {
		c.advance(step)
		p.Done("a", 1, true)
	}
	// Done at t0, t0+1s, t0-2s and t0+3s.
	p.Observe("a", t0.Add(500*time.Millisecond))
	var got []time.Duration
	for _, s := range p.nodes["a"].recent {
		got = append(got, s.at.Sub(t0))
	}
	if diff := cmp.Diff([]time.Duration{time.Second, 3 * time.Second}, got); diff != "" {
		t.Errorf("recent after Observe (-want +got):\n%s", diff)
	}
	if n := p.nodes["a"].recentN; n != 2 {
		t.Errorf("recentN = %d, want 2", n)
	}
}

// TestReplicas checks that Replicas weighs own placements in scores but not
// in the room check.
func TestReplicas(t *testing.T) {
	c := newClock()
	p := New(Config{K: 2, Rand: rand.New(rand.NewPCG(1, 1)), Now: c.now, Replicas: 4})
	view := []Node{node("a", 0, 10), node("b", 3, 10)}
	if got, _ := p.Place(view, Request{Count: 1}, nil); got[0] != "a" {
		t.Fatalf("first pick %s, want a", got[0])
	}
	// a: 0 + 4×1 = 4 > b's 3.
	if got, _ := p.Place(view, Request{Count: 1}, nil); got[0] != "b" {
		t.Fatalf("second pick %s, want b: one own placement on a should count as 4", got[0])
	}
	// Room counts own placements once: a has 9 left, b 6.
	if _, err := p.Place(view, Request{Count: 15}, nil); err != nil {
		t.Fatalf("a batch that fits: %v", err)
	}
}

// TestConcurrent races many requests on one Placer: nothing reserved ever
// exceeds a node's capacity, and everything reported leaves no state.
func TestConcurrent(t *testing.T) {
	const workers, rounds, capacity = 16, 300, 20
	c := newClock()
	p := New(Config{Rand: rand.New(rand.NewPCG(7, 7)), Now: c.now})
	view := equal(10, 0, capacity)
	held := make(map[string]*atomic.Int64)
	for _, n := range view {
		held[n.Name] = new(atomic.Int64)
	}
	var wg sync.WaitGroup
	var placed, refused atomic.Int64
	stop := make(chan struct{})
	var observer sync.WaitGroup
	observer.Add(1)
	go func() { // the watcher
		defer observer.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			for _, n := range view {
				p.Observe(n.Name, c.now())
			}
		}
	}()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 0))
			for range rounds {
				names, err := p.Place(view, Request{Count: 1 + rng.IntN(5)}, nil)
				if err != nil {
					if !errors.Is(err, errdefs.ErrResourceExhausted) {
						t.Error(err)
						return
					}
					refused.Add(1)
					continue
				}
				for _, n := range names {
					if h := held[n].Add(1); h > capacity {
						t.Errorf("%d held on %s, capacity %d", h, n, capacity)
					}
				}
				c.advance(time.Millisecond)
				ok := rng.IntN(2) == 0
				for _, n := range names {
					held[n].Add(-1)
					p.Done(n, 1, ok)
				}
				placed.Add(int64(len(names)))
			}
		}()
	}
	wg.Wait()
	close(stop)
	observer.Wait()
	t.Logf("%d placed, %d refused", placed.Load(), refused.Load())
	c.advance(time.Second)
	for _, n := range view {
		p.Observe(n.Name, c.now())
	}
	if len(p.nodes) != 0 {
		t.Errorf("state left after every placement was reported: %d nodes", len(p.nodes))
	}
}

// TestGroupedPicks: a batch's sandboxes go to nodes a group at a time, so a
// batch of 50 over 160 nodes needs 13 calls to edges rather than ~45; a
// batch still gets Spread picks when it has the sandboxes and there are
// the nodes (groups shrink: 4 over 2 nodes go 2 and 2); a node with less
// room than a group takes what fits and the rest go elsewhere; a group of
// 1 places each sandbox on its own.
func TestGroupedPicks(t *testing.T) {
	many := equal(160, 0, 200)
	for _, tc := range []struct {
		group, count int
		nodes        []Node
		wantNodes    int // distinct nodes the batch lands on
		wantMax      int // the most sandboxes on one of them
	}{
		{DefaultGroup, 50, many, 13, DefaultGroup},
		{8, 50, many, 9, 6}, // 8 picks at least: groups of 50/8
		{DefaultGroup, 8, many, 8, 1},
		{DefaultGroup, 16, many, 8, 2},
		{DefaultGroup, 4, []Node{node("a", 0, 200), node("b", 0, 200)}, 2, 2},
		{DefaultGroup, 6, []Node{node("a", 198, 200), node("b", 198, 200), node("c", 198, 200)}, 3, 2},
	} {
		p := New(Config{Rand: rand.New(rand.NewPCG(7, 1)), Now: newClock().now, Group: tc.group})
		got, err := p.Place(tc.nodes, Request{Count: tc.count}, nil)
		if err != nil {
			t.Fatal(err)
		}
		c := counts(got)
		most := 0
		for _, n := range c {
			most = max(most, n)
		}
		if len(got) != tc.count || len(c) != tc.wantNodes || most != tc.wantMax {
			t.Errorf("group %d, %d sandboxes over %d nodes: %d placed on %d nodes, at most %d on one; want %d nodes, at most %d",
				tc.group, tc.count, len(tc.nodes), len(got), len(c), most, tc.wantNodes, tc.wantMax)
		}
		// The picks of one group sit next to each other.
		for i := 1; i < len(got); i++ {
			if tc.nodes[0].Live == 0 && i%tc.wantMax != 0 && got[i] != got[i-1] {
				t.Errorf("group %d: sandbox %d on %s, %d on %s: a group split", tc.group, i-1, got[i-1], i, got[i])
			}
		}
	}
	p := New(Config{Rand: rand.New(rand.NewPCG(7, 1)), Now: newClock().now, Group: 1})
	got, err := p.Place(many, Request{Count: 50}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(counts(got)); n < 40 {
		t.Errorf("group 1: 50 sandboxes over 160 nodes landed on %d nodes, want at least 40", n)
	}
}
