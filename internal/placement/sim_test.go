package placement

import (
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestSimulate fills 160 nodes to 80 % from 4 replicas at 5,000 creates/s
// with 2 s stale reports (the defaults), over several seeds. These are
// figures of simulated placement, not of wall-clock time.
func TestSimulate(t *testing.T) {
	seeds := []uint64{1, 2, 3, 4, 5}
	if testing.Short() || raceDetector {
		seeds = seeds[:2]
	}
	for _, seed := range seeds {
		r := Simulate(SimConfig{Seed: seed})
		t.Logf("seed %d, %d nodes × %d, %d replicas, %.0f/s for %v:\n  %v\n  %v\n  %v\n  %v", seed,
			r.Config.Nodes, r.Config.Capacity, r.Config.Apiservers, r.Config.Rate, r.Duration,
			r.InFlight, r.InFlightOwn, r.Naive, r.Random)
		want := int(0.8 * 160 * 200)
		for _, p := range []PolicyResult{r.InFlight, r.InFlightOwn, r.Naive, r.Random} {
			if p.Placed != want || p.Unplaced != 0 {
				t.Errorf("seed %d: %s placed %d, %d unplaced; want all %d", seed, p.Policy, p.Placed, p.Unplaced, want)
			}
		}
		excess := func(p PolicyResult) float64 { return p.MaxOverMean - 1 }
		if r.InFlight.MaxOverMean > 1.10 {
			t.Errorf("seed %d: %v, want max/mean ≤ 1.10", seed, r.InFlight)
		}
		if excess(r.InFlight) > excess(r.Random)/2 {
			t.Errorf("seed %d: in-flight excess %.3f is more than half of random's %.3f", seed, excess(r.InFlight), excess(r.Random))
		}
		if excess(r.InFlight) > excess(r.InFlightOwn) || excess(r.InFlight) > excess(r.Naive) {
			t.Errorf("seed %d: counting in-flight for all replicas (%.3f) does worse than own only (%.3f) or none (%.3f)",
				seed, r.InFlight.MaxOverMean, r.InFlightOwn.MaxOverMean, r.Naive.MaxOverMean)
		}
	}
}

// TestSimulateOneReplica: with one apiserver its own placements are all
// there are, and counting them is enough.
func TestSimulateOneReplica(t *testing.T) {
	seeds := []uint64{1, 2, 3}
	if testing.Short() || raceDetector {
		seeds = seeds[:1]
	}
	for _, seed := range seeds {
		r := Simulate(SimConfig{Seed: seed, Apiservers: 1})
		if diff := cmp.Diff(r.InFlight.MaxOverMean, r.InFlightOwn.MaxOverMean); diff != "" {
			t.Errorf("seed %d: Replicas 1 differs from itself:\n%s", seed, diff)
		}
		if r.InFlight.MaxOverMean > 1.05 || r.Naive.MaxOverMean < 1.15 {
			t.Errorf("seed %d: %v; %v", seed, r.InFlight, r.Naive)
		}
	}
}

func TestSimulateRepeats(t *testing.T) {
	cfg := SimConfig{Seed: 9, Nodes: 40, Capacity: 100}
	if diff := cmp.Diff(Simulate(cfg), Simulate(cfg)); diff != "" {
		t.Errorf("the same seed gave different runs:\n%s", diff)
	}
}
