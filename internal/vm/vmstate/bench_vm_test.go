package vmstate_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"dsec.dev/dsec/internal/vm/qmp"
	"dsec.dev/dsec/internal/vm/vmstate"
	"dsec.dev/dsec/internal/vm/vmtest"
)

// BenchmarkPauseResume measures, in one run, a cold boot to the agent's
// first exec against a restore to the first exec (issue 30's target: at
// least 10 times faster), the host memory a pause releases (at least 90 %)
// and a resume to the first exec (at most 500 ms), with and without the
// prefetch of the hot set, and a fork's child to its first exec. Each
// iteration boots one guest and pauses and resumes it rounds times each
// way. Like the tests, it needs DSEC_VM_KERNEL_DIR and DSEC_BIN_DIR:
//
//	go test -run '^$' -bench PauseResume -benchtime 1x ./internal/vm/vmstate
func BenchmarkPauseResume(b *testing.B) {
	const rounds = 5
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx := context.Background()
	var cold, plain, prefetched, forked []time.Duration
	var released []float64
	for i := 0; b.Loop(); i++ {
		dir := b.TempDir()
		cfg := vmtest.Config(b, dir)
		cfg.MemoryFile = filepath.Join(dir, "memory")
		stateFile := filepath.Join(dir, "vmstate")

		t0 := time.Now()
		g := vmtest.Start(b, cfg, log)
		g.WaitBoot(b)
		g.MustExec(b, "true")
		cold = append(cold, time.Since(t0))
		// Something for the guest to keep: 32 MiB in /dev/shm.
		g.MustExec(b, "sh", "-c", "head -c 33554432 /dev/urandom > /dev/shm/data")

		pause := func() {
			q, err := qmp.Dial(ctx, g.P.QMPPath())
			if err != nil {
				b.Fatal(err)
			}
			st, err := vmstate.Pause(ctx, g.P, q, stateFile, log)
			q.Close()
			if err != nil {
				b.Fatal(err)
			}
			released = append(released, float64(st.Released)/float64(st.Resident))
		}
		resume := func(prefetch bool) time.Duration {
			t0 := time.Now()
			p, _, err := vmstate.Resume(ctx, cfg, stateFile, vmstate.ResumeOptions{Prefetch: prefetch}, log)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { p.Kill(); <-p.Done() })
			g.P = p
			g.MustExec(b, "true")
			return time.Since(t0)
		}
		for range rounds {
			pause()
			plain = append(plain, resume(false))
			pause()
			prefetched = append(prefetched, resume(true))
		}
		pause()
		child, err := vmstate.Fork(cfg, filepath.Join(dir, "child"))
		if err != nil {
			b.Fatal(err)
		}
		t0 = time.Now()
		p, _, err := vmstate.Resume(ctx, child, stateFile, vmstate.ResumeOptions{Prefetch: true}, log)
		if err != nil {
			b.Fatal(err)
		}
		c := vmtest.Adopt(b, p, log)
		c.MustExec(b, "true")
		forked = append(forked, time.Since(t0))
		p.Kill()
		<-p.Done()
	}
	med := func(ds []time.Duration) time.Duration {
		ds = slices.Clone(ds)
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	r := slices.Clone(released)
	slices.Sort(r)
	ratio := func(d time.Duration) float64 { return float64(med(cold)) / float64(d) }
	b.ReportMetric(float64(med(cold).Milliseconds()), "cold-ms")
	b.ReportMetric(float64(med(plain).Milliseconds()), "resume-ms")
	b.ReportMetric(float64(med(prefetched).Milliseconds()), "resume-prefetch-ms")
	b.ReportMetric(float64(med(forked).Milliseconds()), "fork-ms")
	b.ReportMetric(ratio(med(plain)), "cold/resume")
	b.ReportMetric(100*r[0], "released-min-%")
	b.Log(fmt.Sprintf("medians: cold boot to first exec %s; resume to first exec %s (%.1fx), with prefetch %s (%.1fx); a fork's child %s (%.1fx); a pause released %.1f%% to %.1f%% of QEMU's resident memory (%d pauses)",
		med(cold), med(plain), ratio(med(plain)), med(prefetched), ratio(med(prefetched)), med(forked), ratio(med(forked)),
		100*r[0], 100*r[len(r)-1], len(r)))
}
