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

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/container"
	"dsec.dev/dsec/internal/edge/image"
)

// baseline is a bare runc (or the runtime of Options.Runtime) with busybox
// bundles made like the sandboxes it is compared with: the same
// namespaces, capabilities, seccomp profile, masked paths and limits (see
// container.BareSpec), so that both sides pay for the same filters and
// throttling.
type baseline struct {
	rt     string // runtime binary
	dir    string // bundles, rootfs and the runtime's state
	state  string
	runB   string // bundle whose process is `true`
	sleepB string // bundle whose process sleeps

	mu      sync.Mutex
	n       int
	created []string // detached containers to delete at close
}

func newBaseline(o Options) (*baseline, error) {
	b := &baseline{rt: o.Runtime}
	if b.rt == "" {
		b.rt = "runc"
	}
	if _, err := exec.LookPath(b.rt); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "dsec-bench-runc-")
	if err != nil {
		return nil, err
	}
	b.dir, b.state = dir, filepath.Join(dir, "state")
	rootfs := filepath.Join(dir, "rootfs")
	if err := image.BuildBusyboxRootfs(rootfs); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("build busybox rootfs: %w", err)
	}
	bundle := func(name string, args ...string) (string, error) {
		bd := filepath.Join(dir, name)
		if err := os.MkdirAll(bd, 0o755); err != nil {
			return "", err
		}
		spec, err := container.BareSpec(backend.Spec{CPUs: benchCPUs, MemoryBytes: benchMemoryMB << 20}, rootfs, args)
		if err != nil {
			return "", fmt.Errorf("make the runc bundle: %w", err)
		}
		out, err := json.Marshal(spec)
		if err != nil {
			return "", err
		}
		return bd, os.WriteFile(filepath.Join(bd, "config.json"), out, 0o644)
	}
	if b.runB, err = bundle("run", "true"); err == nil {
		b.sleepB, err = bundle("sleep", "sleep", "3600")
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return b, nil
}

// close deletes every container left and the bundles.
func (b *baseline) close() {
	b.mu.Lock()
	ids := b.created
	b.created = nil
	b.mu.Unlock()
	for _, id := range ids {
		b.deleteContainer(id)
	}
	os.RemoveAll(b.dir)
}

// deleteContainer force-deletes one container, whatever its state.
func (b *baseline) deleteContainer(id string) {
	exec.Command(b.rt, "--root", b.state, "delete", "-f", id).Run()
}

// deleteContainers deletes containers this baseline started.
func (b *baseline) deleteContainers(ids []string) {
	gone := make(map[string]bool, len(ids))
	for _, id := range ids {
		b.deleteContainer(id)
		gone[id] = true
	}
	b.mu.Lock()
	kept := b.created[:0]
	for _, id := range b.created {
		if !gone[id] {
			kept = append(kept, id)
		}
	}
	b.created = kept
	b.mu.Unlock()
}

func (b *baseline) nextID() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.n++
	return fmt.Sprintf("bench-%d-%d", os.Getpid(), b.n)
}

// run times `runc run` of a container whose process is `true`, then
// deletes it.
func (b *baseline) run(ctx context.Context) (time.Duration, error) {
	id := b.nextID()
	t := time.Now()
	err := runCmd(ctx, b.rt, "--root", b.state, "run", "--bundle", b.runB, id)
	d := time.Since(t)
	b.deleteContainer(id)
	return d, err
}

// startSleeper starts a detached container that sleeps; close deletes it.
func (b *baseline) startSleeper(ctx context.Context) (string, error) {
	id := b.nextID()
	if err := runCmd(ctx, b.rt, "--root", b.state, "run", "--detach", "--bundle", b.sleepB, id); err != nil {
		return "", err
	}
	b.mu.Lock()
	b.created = append(b.created, id)
	b.mu.Unlock()
	return id, nil
}

// exec times `runc exec` of `true` in container id.
func (b *baseline) exec(ctx context.Context, id string) (time.Duration, error) {
	t := time.Now()
	err := runCmd(ctx, b.rt, "--root", b.state, "exec", id, "true")
	return time.Since(t), err
}

// runBaseline measures b beside the sandboxes: runc run for create → first
// exec, alone and in a burst, and idle `sleep` containers for memory. The
// warm exec is measured with dsec's, alternating (see warmExecs).
func runBaseline(ctx context.Context, o Options, b *baseline) (*Side, error) {
	side := &Side{}
	o.logf("runc: %d sequential runc run", o.Seq)
	var lat []time.Duration
	for range o.Seq {
		d, err := b.run(ctx)
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
		go func() { defer wg.Done(); lats[i], errs[i] = b.run(ctx) }()
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

	idle := min(o.Idle, 200)
	o.logf("runc: %d idle sleep containers for memory", idle)
	// 200 containers of 0.5 MiB are a small rise, and the host may still be
	// freeing the memory of dsec's idle sandboxes. The memory is therefore
	// read before the containers start, once they run, and once they are
	// deleted again: the mean of the rise and the fall cancels a steady
	// drift.
	before := o.settledMemMiB()
	var ids []string
	for range idle {
		id, err := b.startSleeper(ctx)
		if err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	running := o.settledMemMiB()
	b.deleteContainers(ids)
	after := o.settledMemMiB()
	side.IdleCount = idle
	side.IdleAnswering = idle
	side.IdleMemPerMiB, side.IdleMemoryMethod = perSandboxMiB(((running-before)+(running-after))/2, idle)
	side.IdleMemoryMethod += "; for runc, the mean of the rise as the containers start and the fall as they are deleted"
	return side, nil
}
