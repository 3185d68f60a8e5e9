package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/edge/runtime"
)

// runBaseline measures bare runc on a busybox bundle equivalent to the
// sandboxes above (see runtime.BareSpec): runc run for create → first exec,
// runc exec for a warm exec, and idle `sleep` containers for memory.
func runBaseline(ctx context.Context, o Options) (*Side, error) {
	rt := o.Runtime
	if rt == "" {
		rt = "runc"
	}
	dir, err := os.MkdirTemp("", "dsec-bench-runc-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	state := filepath.Join(dir, "state")
	rootfs := filepath.Join(dir, "rootfs")
	if err := image.BuildBusyboxRootfs(rootfs); err != nil {
		return nil, fmt.Errorf("build busybox rootfs: %w", err)
	}
	// The bundles are made like the sandboxes measured beside them: the
	// same namespaces, capabilities, seccomp profile, masked paths and
	// limits, so that both sides pay for the same filters and throttling.
	bundle := func(name string, args ...string) (string, error) {
		b := filepath.Join(dir, name)
		if err := os.MkdirAll(b, 0o755); err != nil {
			return "", err
		}
		spec, err := runtime.BareSpec(runtime.Spec{CPUs: benchCPUs, MemoryBytes: benchMemoryMB << 20}, rootfs, args)
		if err != nil {
			return "", fmt.Errorf("make the runc bundle: %w", err)
		}
		out, err := json.Marshal(spec)
		if err != nil {
			return "", err
		}
		return b, os.WriteFile(filepath.Join(b, "config.json"), out, 0o644)
	}
	runB, err := bundle("run", "true")
	if err != nil {
		return nil, err
	}
	sleepB, err := bundle("sleep", "sleep", "3600")
	if err != nil {
		return nil, err
	}
	var created []string
	var mu sync.Mutex
	defer func() {
		for _, id := range created {
			exec.Command(rt, "--root", state, "delete", "-f", id).Run()
		}
	}()
	track := func(id string) { mu.Lock(); created = append(created, id); mu.Unlock() }
	n := 0
	nextID := func() string { mu.Lock(); defer mu.Unlock(); n++; return fmt.Sprintf("bench-%d", n) }
	runOnce := func() (time.Duration, error) {
		id := nextID()
		t := time.Now()
		err := runCmd(ctx, rt, "--root", state, "run", "--bundle", runB, id)
		d := time.Since(t)
		exec.Command(rt, "--root", state, "delete", "-f", id).Run()
		return d, err
	}
	side := &Side{}
	o.logf("runc: %d sequential runc run", o.Seq)
	var lat []time.Duration
	for range o.Seq {
		d, err := runOnce()
		if err != nil {
			return nil, err
		}
		lat = append(lat, d)
	}
	side.CreateToExec = summarize(lat)

	o.logf("runc: burst of %d concurrent runc run", o.Burst)
	lats := make([]time.Duration, o.Burst)
	errs := make([]error, o.Burst)
	var wg sync.WaitGroup
	t0 := time.Now()
	for i := range o.Burst {
		wg.Add(1)
		go func() { defer wg.Done(); lats[i], errs[i] = runOnce() }()
	}
	wg.Wait()
	wall := time.Since(t0)
	lat = lat[:0]
	for i, err := range errs {
		if err != nil {
			side.BurstErrors++
			continue
		}
		lat = append(lat, lats[i])
	}
	side.BurstCreateExec = summarize(lat)
	side.BurstWallS = wall.Seconds()
	side.BurstPerSecond = float64(len(lat)) / wall.Seconds()

	o.logf("runc: %d runc exec in a running container", o.Execs)
	warm := nextID()
	if err := runCmd(ctx, rt, "--root", state, "run", "--detach", "--bundle", sleepB, warm); err != nil {
		return nil, err
	}
	track(warm)
	lat = lat[:0]
	for range o.Execs {
		t := time.Now()
		if err := runCmd(ctx, rt, "--root", state, "exec", warm, "true"); err != nil {
			return nil, err
		}
		lat = append(lat, time.Since(t))
	}
	side.WarmExec = summarize(lat)

	idle := min(o.Idle, 200)
	o.logf("runc: %d idle sleep containers for memory", idle)
	time.Sleep(time.Second)
	before := usedMemMiB()
	for range idle {
		id := nextID()
		if err := runCmd(ctx, rt, "--root", state, "run", "--detach", "--bundle", sleepB, id); err != nil {
			return nil, err
		}
		track(id)
	}
	time.Sleep(3 * time.Second)
	side.IdleCount = idle
	side.IdleAnswering = idle
	side.IdleMemPerMiB = (usedMemMiB() - before) / float64(idle)
	side.IdleMemoryMethod = "(MemTotal-MemAvailable) after minus before, divided by the count"
	return side, nil
}
