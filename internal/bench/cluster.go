package bench

import (
	"context"
	"fmt"
	"io"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/placement"
	dsec "dsec.dev/dsec/sdk/go"
)

// ClusterOptions shape `dsec bench cluster`: a closed-loop load of keyed
// creates (as the SDKs send them) against a cluster's apiservers, batches
// and single creates at once, for Duration.
type ClusterOptions struct {
	Env      string
	Duration time.Duration
	// TTL is each sandbox's TTL (0: none): with one, the nodes end what
	// the load made as it runs, as a training loop's episodes end, and
	// hold the last TTL's sandboxes rather than every one.
	TTL            time.Duration
	Batch          int // sandboxes per batch create
	BatchWorkers   int // callers issuing batch creates, each one at a time
	SingleWorkers  int // callers issuing single creates
	Progress       io.Writer
	SimulateSeeds  int // placement simulations of the balance target, in the same run
	SimulateNodes  int
	SimulateFillTo float64
}

// ClusterReport is what the load achieved, and the placement simulation.
type ClusterReport struct {
	Apiservers      int            `json:"apiservers"`
	Seconds         float64        `json:"seconds"`
	Sandboxes       int64          `json:"sandboxes"`
	SandboxesPerSec float64        `json:"sandboxes_per_sec"`
	BatchCalls      int64          `json:"batch_calls"`
	SingleCalls     int64          `json:"single_calls"`
	SinglePerSec    float64        `json:"single_calls_per_sec"`
	Single          Latency        `json:"single_latency"`
	BatchLatency    Latency        `json:"batch_latency"`
	Errors          int64          `json:"errors"`
	FirstError      string         `json:"first_error,omitempty"`
	Nodes           int            `json:"nodes"`
	MaxOverMean     float64        `json:"max_over_mean"`
	PerNode         map[string]int `json:"-"`
	// The balance target at 80 % fill with 2 s stale reports, simulated
	// with the same placement code: power of k with in-flight accounting
	// against random placement, max ÷ mean node load.
	SimPowerOfK float64 `json:"sim_power_of_k_max_over_mean"`
	SimRandom   float64 `json:"sim_random_max_over_mean"`
	SimNodes    int     `json:"sim_nodes"`
}

// RunCluster drives the load through clients, one per apiserver, each
// worker keeping to one apiserver.
func RunCluster(ctx context.Context, clients []*dsec.Conn, o ClusterOptions) (*ClusterReport, error) {
	if len(clients) == 0 {
		return nil, fmt.Errorf("bench cluster: no apiserver")
	}
	spec := &dsecv1.SandboxSpec{Environment: o.Env, TtlSeconds: int64(o.TTL.Round(time.Second).Seconds())}
	rep := &ClusterReport{Apiservers: len(clients), PerNode: map[string]int{}}
	var mu sync.Mutex
	var singles, batches []time.Duration
	var sandboxes, batchCalls, singleCalls, errCount atomic.Int64
	record := func(sbs []*dsecv1.Sandbox) {
		mu.Lock()
		for _, sb := range sbs {
			rep.PerNode[sb.GetNode()]++
		}
		mu.Unlock()
	}
	fail := func(err error) {
		if errCount.Add(1) == 1 {
			mu.Lock()
			rep.FirstError = err.Error()
			mu.Unlock()
		}
	}
	create := func(c *dsec.Conn, n int) ([]*dsecv1.Sandbox, time.Duration, error) {
		cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		start := time.Now()
		resp, err := c.Sandboxes.Create(cctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec, Count: int32(n),
			IdempotencyKey: uuid.NewString()}))
		if err != nil {
			return nil, 0, err
		}
		return resp.Msg.GetSandboxes(), time.Since(start), nil
	}
	deadline := time.Now().Add(o.Duration)
	var wg sync.WaitGroup
	worker := func(i, n int) {
		defer wg.Done()
		c := clients[i%len(clients)]
		for time.Now().Before(deadline) && ctx.Err() == nil {
			sbs, took, err := create(c, n)
			if err != nil {
				fail(err)
				continue
			}
			sandboxes.Add(int64(len(sbs)))
			record(sbs)
			mu.Lock()
			if n == 1 {
				singleCalls.Add(1)
				singles = append(singles, took)
			} else {
				batchCalls.Add(1)
				batches = append(batches, took)
			}
			mu.Unlock()
		}
	}
	start := time.Now()
	for i := range o.BatchWorkers {
		wg.Add(1)
		go worker(i, o.Batch)
	}
	for i := range o.SingleWorkers {
		wg.Add(1)
		go worker(i, 1)
	}
	if o.Progress != nil {
		go func() {
			t := time.NewTicker(5 * time.Second)
			defer t.Stop()
			for time.Now().Before(deadline) {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					el := time.Since(start).Seconds()
					fmt.Fprintf(o.Progress, "%4.0fs: %d sandboxes (%.0f/s), %d single calls, %d errors\n",
						el, sandboxes.Load(), float64(sandboxes.Load())/el, singleCalls.Load(), errCount.Load())
				}
			}
		}()
	}
	wg.Wait()
	el := time.Since(start).Seconds()
	rep.Seconds = el
	rep.Sandboxes = sandboxes.Load()
	rep.SandboxesPerSec = float64(rep.Sandboxes) / el
	rep.BatchCalls, rep.SingleCalls = batchCalls.Load(), singleCalls.Load()
	rep.SinglePerSec = float64(rep.SingleCalls) / el
	rep.Single, rep.BatchLatency = summarize(singles), summarize(batches)
	rep.Errors = errCount.Load()
	rep.Nodes = len(rep.PerNode)
	if rep.Nodes > 0 {
		maxN, sum := 0, 0
		for _, n := range rep.PerNode {
			maxN = max(maxN, n)
			sum += n
		}
		rep.MaxOverMean = float64(maxN) / (float64(sum) / float64(rep.Nodes))
	}
	rep.SimNodes = o.SimulateNodes
	for seed := 1; seed <= o.SimulateSeeds; seed++ {
		res := placement.Simulate(placement.SimConfig{Seed: uint64(seed), Nodes: o.SimulateNodes, Fill: o.SimulateFillTo,
			Apiservers: len(clients)})
		rep.SimPowerOfK = max(rep.SimPowerOfK, res.InFlight.MaxOverMean)
		rep.SimRandom = max(rep.SimRandom, res.Random.MaxOverMean)
	}
	return rep, nil
}

// Print writes the report as a table with the targets beside it.
func (r *ClusterReport) Print(w io.Writer) {
	fmt.Fprintf(w, "dsec bench cluster: %d apiservers, %d edges that took sandboxes, %.0f s\n\n", r.Apiservers, r.Nodes, r.Seconds)
	fmt.Fprintf(w, "%-52s %14s   %s\n", "metric", "measured", "target")
	fmt.Fprintf(w, "%-52s %14.0f   ≥ 5,000\n", "sandboxes created per second (batches count each)", r.SandboxesPerSec)
	fmt.Fprintf(w, "%-52s %14.0f   ≥ 1,000\n", "single-sandbox create calls per second", r.SinglePerSec)
	fmt.Fprintf(w, "%-52s %8.1f / %4.1f ms   p99 ≤ 100 ms\n", "single create latency p50 / p99", r.Single.P50, r.Single.P99)
	fmt.Fprintf(w, "%-52s %8.1f / %4.1f ms\n", fmt.Sprintf("batch create latency p50 / p99 (%d calls)", r.BatchCalls), r.BatchLatency.P50, r.BatchLatency.P99)
	fmt.Fprintf(w, "%-52s %14d   0\n", "errors", r.Errors)
	fmt.Fprintf(w, "%-52s %14.3f\n", "max ÷ mean sandboxes per edge, this run", r.MaxOverMean)
	fmt.Fprintf(w, "%-52s %14.3f   ≤ 1.10\n", fmt.Sprintf("simulated, %d nodes at 80%% fill, 2 s stale: p-o-k", r.SimNodes), r.SimPowerOfK)
	fmt.Fprintf(w, "%-52s %14.3f   p-o-k ≥ 2× better\n", "  the same, random placement", r.SimRandom)
	if r.SimRandom > 1 {
		fmt.Fprintf(w, "%-52s %14.1f×\n", "  excess over 1.0, random ÷ p-o-k", (r.SimRandom-1)/(r.SimPowerOfK-1))
	}
	if r.FirstError != "" {
		fmt.Fprintf(w, "\nfirst error: %s\n", r.FirstError)
	}
	names := make([]string, 0, len(r.PerNode))
	for n := range r.PerNode {
		names = append(names, n)
	}
	sort.Strings(names)
	if len(names) > 0 && len(names) <= 8 {
		for _, n := range names {
			fmt.Fprintf(w, "  %s: %d\n", n, r.PerNode[n])
		}
	}
}

// JSON writes the report as JSON.
func (r *ClusterReport) JSON(w io.Writer) error { return writeJSON(w, r) }

// QuotaReport compares the create rate of two tokens in one run: one of a
// project under no quota limit (its creates are not charged) and one of a
// project with a limit (every create is charged in the metadata store), in
// alternating rounds so that a slow spell hits both.
type QuotaReport struct {
	Rounds     int            `json:"rounds"`
	Free       *ClusterReport `json:"free"`    // the sums of the uncharged rounds
	Charged    *ClusterReport `json:"charged"` // the sums of the charged rounds
	RateRatio  float64        `json:"rate_ratio"`
	SingleP50  [2]float64     `json:"single_p50_ms"`
	FirstError string         `json:"first_error,omitempty"`
}

// RunClusterQuota runs RunCluster's load rounds times with each set of
// clients, alternating (ABBA: the sides take turns to go first), each
// round o.Duration / (2 × rounds) long.
func RunClusterQuota(ctx context.Context, free, charged []*dsec.Conn, o ClusterOptions, rounds int) (*QuotaReport, error) {
	sums, err := runClusterRounds(ctx, [2]ClusterSide{{Name: "uncharged", Clients: free}, {Name: "charged", Clients: charged}}, o, rounds)
	if err != nil {
		return nil, err
	}
	rep := &QuotaReport{Rounds: rounds, Free: sums[0], Charged: sums[1]}
	rep.RateRatio = rep.Charged.SandboxesPerSec / rep.Free.SandboxesPerSec
	rep.SingleP50 = [2]float64{rep.Free.Single.P50, rep.Charged.Single.P50}
	return rep, nil
}

// ClusterSide is one side of a comparison of create rates: the clients
// of its apiservers, and what to do before each of its rounds (nil:
// nothing), e.g. thaw its cluster and freeze the other's.
type ClusterSide struct {
	Name    string
	Clients []*dsec.Conn
	// Before, if set, is called before each measured round of the side;
	// WarmUp before its warm-up round (Before when WarmUp is nil).
	Before func(ctx context.Context) error
	WarmUp func(ctx context.Context) error
}

// runClusterRounds runs RunCluster's load rounds times on each side,
// alternating (ABBA: the sides take turns to go first), each round
// o.Duration / (2 × rounds) long, and returns each side's sums. A warm-up
// round of each side, half as long, comes first and is not counted: the
// first round a cluster serves is its slowest (connections made, caches
// and heaps grown), and without it that cost fell on the first side
// alone. The second side warms up first, so that the first side's first
// round follows its own warm-up: a round that follows the other side's
// may cost more (BenchmarkClusterOps thaws a cluster frozen through the
// other's rounds, whose timers then fire), and after warm-ups A B the
// order A B B A A B B A gave the first side one such round more than the
// second (rounds 1, 4 and 8 against 2 and 6); after warm-ups B A each
// side has rounds/2 of them.
func runClusterRounds(ctx context.Context, sides [2]ClusterSide, o ClusterOptions, rounds int) ([2]*ClusterReport, error) {
	o.Duration /= time.Duration(2 * rounds)
	o.SimulateSeeds = 0
	warm := o
	warm.Duration /= 2
	for _, side := range []ClusterSide{sides[1], sides[0]} {
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, "warm-up, %s\n", side.Name)
		}
		before := side.WarmUp
		if before == nil {
			before = side.Before
		}
		if before != nil {
			if err := before(ctx); err != nil {
				return [2]*ClusterReport{}, fmt.Errorf("before %s's warm-up: %w", side.Name, err)
			}
		}
		if _, err := RunCluster(ctx, side.Clients, warm); err != nil {
			return [2]*ClusterReport{}, fmt.Errorf("%s's warm-up: %w", side.Name, err)
		}
	}
	var sums [2]*ClusterReport
	add := func(sum **ClusterReport, r *ClusterReport) {
		if *sum == nil {
			*sum = &ClusterReport{Apiservers: r.Apiservers, PerNode: map[string]int{}}
		}
		s := *sum
		s.Seconds += r.Seconds
		s.Sandboxes += r.Sandboxes
		s.SingleCalls += r.SingleCalls
		s.BatchCalls += r.BatchCalls
		s.Errors += r.Errors
		if s.FirstError == "" {
			s.FirstError = r.FirstError
		}
		s.Single.P50 += r.Single.P50 / float64(rounds)
		s.SandboxesPerSec = float64(s.Sandboxes) / s.Seconds
		s.SinglePerSec = float64(s.SingleCalls) / s.Seconds
	}
	for round := range rounds {
		order := []int{0, 1}
		if round%2 == 1 {
			// Each round makes the cluster bigger (its sandboxes live
			// on), so the later side of a round is the slower: the
			// sides take turns to go first (ABBA), which cancels it.
			order = []int{1, 0}
		}
		for _, i := range order {
			side := sides[i]
			if o.Progress != nil {
				fmt.Fprintf(o.Progress, "round %d of %d, %s\n", round+1, rounds, side.Name)
			}
			if side.Before != nil {
				if err := side.Before(ctx); err != nil {
					return sums, fmt.Errorf("before %s's round %d: %w", side.Name, round+1, err)
				}
			}
			r, err := RunCluster(ctx, side.Clients, o)
			if err != nil {
				return sums, err
			}
			if o.Progress != nil {
				fmt.Fprintf(o.Progress, "round %d of %d, %s: %.0f sandboxes/s\n", round+1, rounds, side.Name, r.SandboxesPerSec)
			}
			add(&sums[i], r)
		}
	}
	return sums, nil
}

// CompareReport compares the create rate of two sides (two clusters, or
// two callers of one) in one run, in alternating rounds.
type CompareReport struct {
	Rounds    int               `json:"rounds"`
	Names     [2]string         `json:"names"`
	Sides     [2]*ClusterReport `json:"sides"`
	RateRatio float64           `json:"rate_ratio"` // the first side's rate ÷ the second's
	SingleP50 [2]float64        `json:"single_p50_ms"`
	Target    float64           `json:"target"` // the least ratio that passes (0: none)
}

// RunClusterCompare runs RunCluster's load rounds times on each side,
// alternating (ABBA), each round o.Duration / (2 × rounds) long, and
// reports the first side's create rate over the second's against target.
func RunClusterCompare(ctx context.Context, sides [2]ClusterSide, o ClusterOptions, rounds int, target float64) (*CompareReport, error) {
	sums, err := runClusterRounds(ctx, sides, o, rounds)
	if err != nil {
		return nil, err
	}
	rep := &CompareReport{Rounds: rounds, Names: [2]string{sides[0].Name, sides[1].Name}, Sides: sums, Target: target}
	rep.RateRatio = sums[0].SandboxesPerSec / sums[1].SandboxesPerSec
	rep.SingleP50 = [2]float64{sums[0].Single.P50, sums[1].Single.P50}
	return rep, nil
}

// Print writes the comparison with its target.
func (r *CompareReport) Print(w io.Writer) {
	fmt.Fprintf(w, "dsec bench cluster, compared: %d rounds of each side, alternating, ABBA\n\n", r.Rounds)
	fmt.Fprintf(w, "%-44s %12s %12s\n", "", r.Names[0], r.Names[1])
	fmt.Fprintf(w, "%-44s %12.0f %12.0f\n", "sandboxes created per second", r.Sides[0].SandboxesPerSec, r.Sides[1].SandboxesPerSec)
	fmt.Fprintf(w, "%-44s %12.0f %12.0f\n", "single-sandbox create calls per second", r.Sides[0].SinglePerSec, r.Sides[1].SinglePerSec)
	fmt.Fprintf(w, "%-44s %12.1f %12.1f\n", "single create latency p50, ms (mean of rounds)", r.SingleP50[0], r.SingleP50[1])
	fmt.Fprintf(w, "%-44s %12d %12d\n", "errors", r.Sides[0].Errors, r.Sides[1].Errors)
	verdict := ""
	if r.Target > 0 {
		verdict = fmt.Sprintf(" (target ≥ %.2f×): PASS", r.Target)
		if r.RateRatio < r.Target {
			verdict = fmt.Sprintf(" (target ≥ %.2f×): MISS", r.Target)
		}
	}
	fmt.Fprintf(w, "\n%s ÷ %s create rate: %.3f×%s\n", r.Names[0], r.Names[1], r.RateRatio, verdict)
	for _, s := range r.Sides {
		if s.FirstError != "" {
			fmt.Fprintf(w, "first error: %s\n", s.FirstError)
		}
	}
}

// JSON writes the report as JSON.
func (r *CompareReport) JSON(w io.Writer) error { return writeJSON(w, r) }

// Print writes the comparison with its target.
func (r *QuotaReport) Print(w io.Writer) {
	fmt.Fprintf(w, "dsec bench cluster --quota-token: %d rounds of each side, alternating, ABBA\n\n", r.Rounds)
	fmt.Fprintf(w, "%-44s %12s %12s\n", "", "uncharged", "charged")
	fmt.Fprintf(w, "%-44s %12.0f %12.0f\n", "sandboxes created per second", r.Free.SandboxesPerSec, r.Charged.SandboxesPerSec)
	fmt.Fprintf(w, "%-44s %12.0f %12.0f\n", "single-sandbox create calls per second", r.Free.SinglePerSec, r.Charged.SinglePerSec)
	fmt.Fprintf(w, "%-44s %12.1f %12.1f\n", "single create latency p50, ms (mean of rounds)", r.SingleP50[0], r.SingleP50[1])
	fmt.Fprintf(w, "%-44s %12d %12d\n", "errors", r.Free.Errors, r.Charged.Errors)
	verdict := "PASS"
	if r.RateRatio < 0.9 {
		verdict = "MISS"
	}
	fmt.Fprintf(w, "\ncharged ÷ uncharged create rate: %.2f× (target ≥ 0.9×): %s\n", r.RateRatio, verdict)
	for _, s := range []*ClusterReport{r.Free, r.Charged} {
		if s.FirstError != "" {
			fmt.Fprintf(w, "first error: %s\n", s.FirstError)
		}
	}
}

// JSON writes the report as JSON.
func (r *QuotaReport) JSON(w io.Writer) error { return writeJSON(w, r) }
