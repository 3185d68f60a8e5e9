package runtime

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/opencontainers/runtime-spec/specs-go"

	"dsec.dev/dsec/internal/edge/runtime/pagein"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
)

// freezeTimeout bounds a freeze: a sandbox whose processes cannot all be
// frozen by then is thawed again and the pause refused.
const freezeTimeout = 10 * time.Second

// Freeze stops every process of sandbox id (its cgroup tree, the agent's
// per-command children included) and returns once all are frozen. It
// does not touch memory: Pause does that.
func (r *Container) Freeze(ctx context.Context, id string) error {
	if !idPattern.MatchString(id) {
		return fmt.Errorf("freeze sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	if !r.layout.Exists(r.cgroupRel(id)) {
		return fmt.Errorf("freeze sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	ctx, cancel := context.WithTimeout(ctx, freezeTimeout)
	defer cancel()
	if err := r.layout.Freeze(ctx, r.cgroupRel(id)); err != nil {
		return fmt.Errorf("freeze sandbox %s: %w", id, err)
	}
	return nil
}

// Thaw lets sandbox id's processes run again.
func (r *Container) Thaw(ctx context.Context, id string) error {
	if !idPattern.MatchString(id) {
		return fmt.Errorf("thaw sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	return r.layout.Thaw(ctx, r.cgroupRel(id))
}

// Frozen reports whether sandbox id is frozen.
func (r *Container) Frozen(ctx context.Context, id string) (bool, error) {
	if !idPattern.MatchString(id) {
		return false, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	return r.layout.Frozen(r.cgroupRel(id))
}

// Pause freezes sandbox id and then, with reclaim, pushes its memory out
// of RAM: page cache dropped, anonymous memory to swap where the node has
// swap. A failure to reclaim leaves the sandbox frozen and says so in the
// error's words; a failure to freeze leaves it running.
func (r *Container) Pause(ctx context.Context, id string, reclaim bool) (PauseStats, error) {
	var st PauseStats
	t0 := time.Now()
	if err := r.Freeze(ctx, id); err != nil {
		return st, err
	}
	st.Frozen = time.Since(t0)
	if !reclaim {
		return st, nil
	}
	t1 := time.Now()
	rec, err := r.layout.Reclaim(ctx, r.cgroupRel(id), r.memoryLimit(id))
	st.Reclaim = time.Since(t1)
	st.Resident, st.Released, st.Swapped = rec.Before, max(rec.Before-rec.After, 0), rec.Swap
	if err != nil {
		return st, fmt.Errorf("pause sandbox %s: frozen, but its memory stays in RAM: %w", id, err)
	}
	return st, nil
}

// Resume thaws sandbox id. With prefetch, it first asks the kernel to read
// the frozen processes' swapped-out memory back (MADV_WILLNEED), so that
// the first touch after the thaw does not fault it in page by page. The
// memory limit is set again from the sandbox's bundle, whatever an
// interrupted pause left.
func (r *Container) Resume(ctx context.Context, id string, prefetch bool) (ResumeStats, error) {
	var st ResumeStats
	rel := r.cgroupRel(id)
	if !idPattern.MatchString(id) {
		return st, fmt.Errorf("resume sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	if !r.layout.Exists(rel) {
		return st, fmt.Errorf("resume sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	if err := r.layout.SetMemoryLimit(rel, r.memoryLimit(id)); err != nil {
		r.log.Warn("restore the memory limit of a paused sandbox", "id", id, "err", err)
	}
	if prefetch {
		t0 := time.Now()
		pids, err := r.layout.Procs(rel)
		if err != nil {
			r.log.Warn("list processes to prefetch", "id", id, "err", err)
		}
		for _, pid := range pids {
			n, err := pagein.WillNeed(pid)
			if err != nil {
				r.log.Debug("prefetch process memory", "id", id, "pid", pid, "err", err)
			}
			st.Advised += n
		}
		st.Prefetch = time.Since(t0)
	}
	t1 := time.Now()
	if err := r.layout.Thaw(ctx, rel); err != nil {
		return st, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	st.Thaw = time.Since(t1)
	return st, nil
}

// memoryLimit is sandbox id's memory limit from its bundle (0: none or
// unknown).
func (r *Container) memoryLimit(id string) int64 {
	b, err := os.ReadFile(filepath.Join(r.bundleDir(id), "config.json"))
	if err != nil {
		return 0
	}
	var s specs.Spec
	if err := json.Unmarshal(b, &s); err != nil || s.Linux == nil || s.Linux.Resources == nil ||
		s.Linux.Resources.Memory == nil || s.Linux.Resources.Memory.Limit == nil {
		return 0
	}
	return *s.Linux.Resources.Memory.Limit
}

// Upper is sandbox id's writable layer: the overlay's upper dir, on the
// upper file system.
func (r *Container) Upper(id string) (string, error) {
	if !idPattern.MatchString(id) {
		return "", fmt.Errorf("upper of sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	return filepath.Join(r.upperDir(id), "upper"), nil
}

// CaptureDir is where snapshots capture writable layers: on the upper file
// system (a btrfs snapshot or a reflink needs that), outside every
// sandbox's quota project. Init empties it.
func (r *Container) CaptureDir() string { return filepath.Join(r.cfg.UpperRoot, ".captures") }

// clearCaptures removes what a snapshot cut short by a restart left in the
// capture dir.
func (r *Container) clearCaptures() error {
	dir := r.CaptureDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("make %s: %w", dir, err)
	}
	des, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("read %s: %w", dir, err)
	}
	var errs []error
	for _, de := range des {
		p := filepath.Join(dir, de.Name())
		r.log.Info("removing a capture left by an interrupted snapshot", "path", p)
		if err := snapshot.RemoveCapture(p); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
