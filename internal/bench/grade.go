package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	dsec "dsec.dev/dsec/sdk/go"
)

// GradeTarget is issue 32's bound on a clean-room grade of the demo's
// rollouts against grading them in place.
const GradeTarget = 1.25

// GradeOptions shape `dsec bench grade`: the demo's coding rollouts
// (demo/rollout.py), each graded twice, in place and in a clean room.
type GradeOptions struct {
	// Env is the demo's environment, BASE+WORKSPACE+TOOLKIT
	// (scripts/demo.sh imports it).
	Env string
	// Demo is the repository's demo directory: its patches, the project's
	// pristine tests and the grader.
	Demo        string
	Rollouts    int
	Concurrency int // rollouts at once
	// WarmPool is the warm pool of the rollouts' shape kept while the
	// bench runs, as the demo keeps one (0: none; the rollouts' creates
	// then start containers, which hold up every pool's refill).
	WarmPool int
	Progress io.Writer
}

func (o *GradeOptions) logf(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// GradeReport is what `dsec bench grade` prints.
type GradeReport struct {
	Env         string  `json:"env"`
	Rollouts    int     `json:"rollouts"`
	Concurrency int     `json:"concurrency"`
	InPlace     Latency `json:"in_place"`
	CleanRoom   Latency `json:"clean_room"`
	// Ratio is the clean room's p50 over in place's; Target its bound.
	Ratio  float64 `json:"ratio"`
	Target float64 `json:"target"`
	// Where a clean-room grade's time goes, p50 of each part (ms).
	Capture float64 `json:"capture_p50_ms"`
	Start   float64 `json:"start_p50_ms"`
	Tests   float64 `json:"tests_p50_ms"`
	Grader  float64 `json:"grader_p50_ms"`
	// Killing the grader's leftovers and reading the reward file; the
	// provenance and trajectory reads (beside the rest); the receipt's
	// signing.
	Reward   float64 `json:"reward_p50_ms"`
	Evidence float64 `json:"evidence_p50_ms"`
	Receipt  float64 `json:"receipt_p50_ms"`
	// Clean rooms taken from a grade pool, and captures laid into a room
	// rather than packed into a layer, of the clean-room grades.
	Pooled int `json:"pooled"`
	Laid   int `json:"laid"`
	// GradePool is the ready rooms of the grade pool the warm-up grade
	// asked for, when the measured rollouts began (0: no grade pool).
	GradePool int `json:"grade_pool_ready"`
	// Where grading in place goes, p50 (ms): writing the trusted files,
	// the grader's exec (the floor of both ways: a clean room runs the
	// same command), reading the reward.
	PlaceWrite float64 `json:"in_place_write_p50_ms"`
	PlaceExec  float64 `json:"in_place_exec_p50_ms"`
	PlaceRead  float64 `json:"in_place_read_p50_ms"`
	// Rollouts whose two rewards differ (a patch that edits the tests earns
	// more in place), by patch.
	Differ map[string]string `json:"rewards_differ,omitempty"`
	Errors []string          `json:"errors,omitempty"`
}

// demoGrade is the demo's grade (demo/rollout.py): the package captured,
// the tests and the grader laid pristine.
type demoGrade struct {
	files   map[string][]byte
	patches []string
}

const (
	demoGrader  = "python3 /opt/dsec-harness/grade.py /project /tmp/result.json"
	demoPackage = "/project/textstats"
	demoTests   = "/project/tests"
)

func loadDemo(dir string) (*demoGrade, error) {
	d := &demoGrade{files: map[string][]byte{}}
	grader, err := os.ReadFile(filepath.Join(dir, "toolkit", "opt", "dsec-harness", "grade.py"))
	if err != nil {
		return nil, fmt.Errorf("read the demo's grader: %w", err)
	}
	d.files["/opt/dsec-harness/grade.py"] = grader
	tests := filepath.Join(dir, "workspace", "project", "tests")
	err = filepath.WalkDir(tests, func(p string, e os.DirEntry, err error) error {
		if err != nil || e.IsDir() || !strings.HasSuffix(p, ".py") {
			return err
		}
		data, err := os.ReadFile(p)
		rel, _ := filepath.Rel(tests, p)
		d.files[demoTests+"/"+filepath.ToSlash(rel)] = data
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("read the demo's tests: %w", err)
	}
	if d.patches, err = filepath.Glob(filepath.Join(dir, "patches", "*.patch")); err != nil || len(d.patches) == 0 {
		return nil, fmt.Errorf("no patches in %s/patches (%v)", dir, err)
	}
	sort.Strings(d.patches)
	return d, nil
}

// RunGrade runs o.Rollouts of the demo's coding rollouts through c: each
// creates a sandbox of the demo's shape, applies its patch and is graded
// twice, in alternating order: in place (the trusted tests and grader
// written into the sandbox, the grader run there, as a sandbox that grades
// itself does) and in a clean room (Grade, as the demo does). Each time is
// the client's, from the first call to the reward.
func RunGrade(ctx context.Context, c *dsec.Client, o GradeOptions) (*GradeReport, error) {
	d, err := loadDemo(o.Demo)
	if err != nil {
		return nil, err
	}
	if o.Rollouts <= 0 {
		o.Rollouts = 12
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 2
	}
	r := &GradeReport{Env: o.Env, Rollouts: o.Rollouts, Concurrency: o.Concurrency, Target: GradeTarget, Differ: map[string]string{}}
	rolloutPool := ""
	if o.WarmPool > 0 {
		p, err := c.SetWarmPool(ctx, o.Env, o.WarmPool, rolloutShape())
		if err != nil {
			return nil, err
		}
		rolloutPool = p.Key
		defer c.SetWarmPool(context.WithoutCancel(ctx), o.Env, 0, rolloutShape())
	}
	// One rollout first, not counted: the first grade of a shape asks its
	// node for a grade pool (dsecd --grade-pool), which the rollouts
	// measured then find ready, as a trainer's steady state does.
	if _, _, _, err := d.rollout(ctx, c, o.Env, d.patches[0], false); err != nil {
		return nil, fmt.Errorf("warm-up rollout: %w", err)
	}
	r.GradePool = waitPools(ctx, c, o.Env, rolloutPool)
	o.logf("warm-up done; grade pool ready: %d", r.GradePool)
	var (
		mu                       sync.Mutex
		inPlace, clean           []time.Duration
		capture, start, tst, grd []time.Duration
		reward, evidence, rcpt   []time.Duration
		pWrite, pExec, pRead     []time.Duration
		wg                       sync.WaitGroup
	)
	sem := make(chan struct{}, o.Concurrency)
	for i := range o.Rollouts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			patch := d.patches[i%len(d.patches)]
			ip, cr, res, err := d.rollout(ctx, c, o.Env, patch, i%2 == 0)
			mu.Lock()
			defer mu.Unlock()
			name := strings.TrimSuffix(filepath.Base(patch), ".patch")
			if err != nil {
				r.Errors = append(r.Errors, fmt.Sprintf("rollout %d (%s): %v", i, name, err))
				return
			}
			inPlace, clean = append(inPlace, ip.took), append(clean, cr)
			t := res.GetTimes()
			ms := func(v int64) time.Duration { return time.Duration(v) * time.Millisecond }
			capture, start = append(capture, ms(t.GetCaptureMs())), append(start, ms(t.GetStartMs()))
			tst, grd = append(tst, ms(t.GetTestsMs())), append(grd, ms(t.GetGraderMs()))
			reward, evidence = append(reward, ms(t.GetRewardMs())), append(evidence, ms(t.GetEvidenceMs()))
			rcpt = append(rcpt, ms(t.GetReceiptMs()))
			pWrite, pExec, pRead = append(pWrite, ip.write), append(pExec, ip.exec), append(pRead, ip.read)
			if t.GetPooled() {
				r.Pooled++
			}
			if t.GetLaid() {
				r.Laid++
			}
			if ip.reward != res.GetReward() {
				r.Differ[name] = fmt.Sprintf("in place %.2f, clean room %.2f", ip.reward, res.GetReward())
			}
			o.logf("rollout %d (%s): in place %v (reward %.2f), clean room %v (reward %.2f, pooled %v)", i, name,
				ip.took.Round(time.Millisecond), ip.reward, cr.Round(time.Millisecond), res.GetReward(), t.GetPooled())
		}()
	}
	wg.Wait()
	if len(clean) == 0 {
		return nil, fmt.Errorf("no rollout was graded: %s", strings.Join(r.Errors, "; "))
	}
	r.InPlace, r.CleanRoom = summarize(inPlace), summarize(clean)
	r.Ratio = r.CleanRoom.P50 / r.InPlace.P50
	r.Capture, r.Start = summarize(capture).P50, summarize(start).P50
	r.Tests, r.Grader = summarize(tst).P50, summarize(grd).P50
	r.Reward, r.Evidence, r.Receipt = summarize(reward).P50, summarize(evidence).P50, summarize(rcpt).P50
	r.PlaceWrite, r.PlaceExec, r.PlaceRead = summarize(pWrite).P50, summarize(pExec).P50, summarize(pRead).P50
	return r, nil
}

// rolloutShape is what every rollout's sandbox asks for.
func rolloutShape() *dsec.CreateOptions {
	return &dsec.CreateOptions{MemoryMB: 256, CPUs: 0.5, TTL: 10 * time.Minute}
}

// waitPools waits (at most 30 s) until the warm pools of env, the
// rollouts' (key rollouts) and the grade pool the warm-up asked for, are
// full, and returns the ready rooms of the grade pool: the other warm
// pool of env.
func waitPools(ctx context.Context, c *dsec.Client, env, rollouts string) int {
	deadline := time.Now().Add(30 * time.Second)
	for {
		pools, err := c.WarmPools(ctx)
		if err != nil {
			return 0
		}
		full, grade := true, 0
		for _, p := range pools {
			if p.Environment != env {
				continue
			}
			if p.Ready < p.Size {
				full = false
			}
			if p.Key != rollouts {
				grade = p.Ready
			}
		}
		if full || time.Now().After(deadline) || ctx.Err() != nil {
			return grade
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type placeGrade struct {
	took              time.Duration
	write, exec, read time.Duration
	reward            float64
}

// rollout makes one rollout's sandbox, applies patch and grades it both
// ways, in place first when placeFirst.
func (d *demoGrade) rollout(ctx context.Context, c *dsec.Client, env, patch string, placeFirst bool) (placeGrade, time.Duration, *dsecv1.GradeResult, error) {
	var ip placeGrade
	sb, err := c.Create(ctx, env, rolloutShape())
	if err != nil {
		return ip, 0, nil, err
	}
	defer sb.Delete(context.WithoutCancel(ctx))
	data, err := os.ReadFile(patch)
	if err != nil {
		return ip, 0, nil, err
	}
	if err := sb.WriteFile(ctx, "/tmp/candidate.patch", data, 0); err != nil {
		return ip, 0, nil, err
	}
	if _, err := sb.Exec(ctx, dsec.Sh("cd /project && patch -p1 --batch < /tmp/candidate.patch"), nil); err != nil {
		return ip, 0, nil, err
	}
	var res *dsecv1.GradeResult
	var cr time.Duration
	cleanRoom := func() error {
		t := time.Now()
		res, err = sb.Grade(ctx, dsec.GradeOptions{Paths: []string{demoPackage}, TestsFiles: d.files,
			TestsPaths: []string{demoTests}, Command: demoGrader, Timeout: time.Minute})
		cr = time.Since(t)
		return err
	}
	place := func() error {
		t := time.Now()
		ip, err = d.inPlace(ctx, sb)
		ip.took = time.Since(t)
		return err
	}
	steps := []func() error{cleanRoom, place}
	if placeFirst {
		steps = []func() error{place, cleanRoom}
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return ip, 0, nil, err
		}
	}
	return ip, cr, res, nil
}

// inPlace grades in the sandbox itself: the trusted files written over
// its own, the grader run there, the reward read from its file.
func (d *demoGrade) inPlace(ctx context.Context, sb *dsec.Sandbox) (placeGrade, error) {
	var g placeGrade
	t := time.Now()
	for p, data := range d.files {
		if err := sb.WriteFile(ctx, p, data, 0); err != nil {
			return g, err
		}
	}
	g.write = time.Since(t)
	t = time.Now()
	r, err := sb.Exec(ctx, dsec.Sh("DSEC_REWARD_FILE=/tmp/reward "+demoGrader+" >/dev/null"), nil)
	if err != nil {
		return g, err
	}
	if r.ExitCode != 0 {
		return g, fmt.Errorf("the grader in place exited %d: %s", r.ExitCode, r.Stderr)
	}
	g.exec = time.Since(t)
	t = time.Now()
	out, err := sb.ReadFile(ctx, "/tmp/reward")
	if err != nil {
		return g, err
	}
	g.read = time.Since(t)
	_, err = fmt.Sscanf(strings.TrimSpace(string(out)), "%g", &g.reward)
	return g, err
}

func (r *GradeReport) Print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "the demo's rollouts (%s): %d, %d at once; each graded in place and in a clean room, alternating which goes first\n", r.Env, r.Rollouts, r.Concurrency)
	fmt.Fprintln(tw, "\tp50\tp99\tmax")
	fmt.Fprintf(tw, "in place\t%.0f ms\t%.0f ms\t%.0f ms\n", r.InPlace.P50, r.InPlace.P99, r.InPlace.Max)
	fmt.Fprintf(tw, "clean room\t%.0f ms\t%.0f ms\t%.0f ms\n", r.CleanRoom.P50, r.CleanRoom.P99, r.CleanRoom.Max)
	tw.Flush()
	fmt.Fprintf(w, "clean room's parts, p50: start %.0f ms, capture %.0f ms, tests %.0f ms, grader %.0f ms, kill+reward %.0f ms, receipt %.0f ms (evidence %.0f ms, beside them)\n",
		r.Start, r.Capture, r.Tests, r.Grader, r.Reward, r.Receipt, r.Evidence)
	fmt.Fprintf(w, "clean rooms from a grade pool: %d of %d; captures laid into the room: %d\n", r.Pooled, r.Rollouts-len(r.Errors), r.Laid)
	fmt.Fprintf(w, "in place's parts, p50: write %.0f ms, grader exec %.0f ms (the floor), read %.0f ms\n", r.PlaceWrite, r.PlaceExec, r.PlaceRead)
	verdict := "PASS"
	if r.Ratio > r.Target {
		verdict = "MISS"
	}
	fmt.Fprintf(w, "clean room / in place (p50): %.2fx (target <= %.2fx) %s\n", r.Ratio, r.Target, verdict)
	for name, d := range r.Differ {
		fmt.Fprintf(w, "rewards differ for %s: %s\n", name, d)
	}
	for _, e := range r.Errors {
		fmt.Fprintln(w, "error:", e)
	}
}

func (r *GradeReport) JSON(w io.Writer) error { return writeJSON(w, r) }
