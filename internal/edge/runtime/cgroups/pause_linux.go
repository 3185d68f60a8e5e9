package cgroups

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/swap"
)

// Freeze stops every task in rel's cgroup tree and returns once the kernel
// reports the whole tree frozen. If ctx ends first the tree is thawed again
// and the error says so: a sandbox is never left half frozen.
//
// On v1 a tree can stay FREEZING: a task forking or in an uninterruptible
// sleep when the freeze was asked is not frozen later by itself. The
// request is written again until it takes, and now and then the tree is
// thawed for a moment so that such a task can move on.
func (l *Layout) Freeze(ctx context.Context, rel string) error {
	file, value := l.freezeFile(rel), "FROZEN"
	if l.v2 {
		value = "1"
	}
	fail := func(err error) error {
		_ = l.Thaw(context.WithoutCancel(ctx), rel)
		return err
	}
	delay := 50 * time.Microsecond
	for try := 1; ; try++ {
		if !l.v2 && try%64 == 0 {
			if err := os.WriteFile(file, []byte("THAWED"), 0); err != nil {
				return fail(fmt.Errorf("freeze cgroup %s: %w", rel, err))
			}
			time.Sleep(delay)
		}
		if try == 1 || !l.v2 {
			if err := os.WriteFile(file, []byte(value), 0); err != nil {
				return fail(fmt.Errorf("freeze cgroup %s: %w", rel, err))
			}
		}
		frozen, err := l.Frozen(rel)
		if err != nil {
			return fail(err)
		}
		if frozen {
			return nil
		}
		select {
		case <-ctx.Done():
			return fail(fmt.Errorf("freeze cgroup %s: not frozen after %d tries when %w; thawed it again", rel, try, ctx.Err()))
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Millisecond)
	}
}

// Thaw lets rel's tasks run again. Thawing a tree that is not frozen does
// nothing.
func (l *Layout) Thaw(ctx context.Context, rel string) error {
	file, value := l.freezeFile(rel), "THAWED"
	if l.v2 {
		value = "0"
	}
	if err := os.WriteFile(file, []byte(value), 0); err != nil {
		return fmt.Errorf("thaw cgroup %s: %w", rel, err)
	}
	return nil
}

// Frozen reports whether the kernel holds every task of rel's tree frozen
// (v1 freezer.state FROZEN; v2 cgroup.events frozen 1). A tree on its way
// (FREEZING) is not frozen.
func (l *Layout) Frozen(rel string) (bool, error) {
	if l.v2 {
		n, err := readKey(filepath.Join(l.Dir("", rel), "cgroup.events"), "frozen")
		if err != nil {
			return false, fmt.Errorf("read freeze state of cgroup %s: %w", rel, err)
		}
		return n == 1, nil
	}
	b, err := os.ReadFile(l.freezeFile(rel))
	if err != nil {
		return false, fmt.Errorf("read freeze state of cgroup %s: %w", rel, err)
	}
	return strings.TrimSpace(string(b)) == "FROZEN", nil
}

func (l *Layout) freezeFile(rel string) string {
	if l.v2 {
		return filepath.Join(l.Dir("", rel), "cgroup.freeze")
	}
	return filepath.Join(l.Dir("freezer", rel), "freezer.state")
}

// Procs lists the processes of rel's whole cgroup tree (the freezer
// hierarchy on v1, which holds the agent's per-command children).
func (l *Layout) Procs(rel string) ([]int, error) {
	top := l.Dir("freezer", rel)
	var out []int
	err := filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p == top {
				return err
			}
			return nil // a child removed meanwhile
		}
		if !d.IsDir() {
			return nil
		}
		pids, err := readPids(filepath.Join(p, "cgroup.procs"))
		if err == nil {
			out = append(out, pids...)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list processes of cgroup %s: %w", rel, err)
	}
	return out, nil
}

// Reclaimed is what Reclaim did to a cgroup's memory.
type Reclaimed struct {
	Before, After int64 // memory charged to the cgroup (RAM: anonymous and page cache)
	Swap          int64 // of the cgroup's memory, the bytes in swap afterwards
}

// Reclaim pushes rel's memory out of RAM while its tasks are frozen: the
// page cache is dropped, and anonymous memory goes to swap when the node
// has swap (without it, anonymous memory cannot leave RAM, and After says
// how much stayed). limit is the cgroup's memory limit, put back at the end
// (0: none). On v1 it drops the cache with memory.force_empty, then lowers
// memory.limit_in_bytes to force the rest out and raises it again; on v2 it
// writes memory.reclaim, letting the cgroup swap meanwhile.
func (l *Layout) Reclaim(ctx context.Context, rel string, limit int64) (Reclaimed, error) {
	if l.v2 {
		return l.reclaimV2(rel)
	}
	dir := l.Dir("memory", rel)
	usage := filepath.Join(dir, "memory.usage_in_bytes")
	var r Reclaimed
	var err error
	if r.Before, err = readInt(usage); err != nil {
		return r, err
	}
	// Page cache first: it needs no swap and is the cheaper to drop.
	if err := os.WriteFile(filepath.Join(dir, "memory.force_empty"), []byte("0"), 0); err != nil && !errors.Is(err, unix.EBUSY) {
		return r, fmt.Errorf("drop the page cache of cgroup %s: %w", rel, err)
	}
	if swapFree() > 0 {
		if err := shrinkV1(ctx, dir, limit); err != nil {
			return r, fmt.Errorf("swap out cgroup %s: %w", rel, err)
		}
	}
	if r.After, err = readInt(usage); err != nil {
		return r, err
	}
	if memsw, err := readInt(filepath.Join(dir, "memory.memsw.usage_in_bytes")); err == nil {
		r.Swap = max(memsw-r.After, 0)
	}
	return r, nil
}

// shrinkV1 lowers the memory limit step by step towards nothing, so the
// kernel swaps the cgroup's anonymous memory out, then puts limit back. A
// step the kernel cannot meet (EBUSY) is tried again with half the step,
// since the kernel gives up after a few reclaim rounds that a busy node's
// swap writes can outlast; shrinkBusyTries refusals in a row (what is left
// cannot be swapped) end the shrinking without an error.
func shrinkV1(ctx context.Context, dir string, limit int64) error {
	file := filepath.Join(dir, "memory.limit_in_bytes")
	defer os.WriteFile(file, []byte(limitValue(limit)), 0)
	const floor = 1 << 20
	busy := 0
	for {
		cur, err := readInt(filepath.Join(dir, "memory.usage_in_bytes"))
		if err != nil {
			return err
		}
		if cur <= floor || ctx.Err() != nil {
			return nil
		}
		// Halving lets each step's reclaim succeed where one leap to the
		// floor gives up after the kernel's few retries; after a refusal
		// the step is halved again.
		step := (cur - floor) / 2 >> busy
		target := max(cur-step, floor)
		if step <= 0 {
			return nil
		}
		if err := os.WriteFile(file, []byte(strconv.FormatInt(target, 10)), 0); err != nil {
			if !errors.Is(err, unix.EBUSY) {
				return err
			}
			if busy++; busy >= shrinkBusyTries {
				return nil
			}
			continue
		}
		busy = 0
	}
}

// shrinkBusyTries is how many refused steps in a row end a shrink.
const shrinkBusyTries = 4

func (l *Layout) reclaimV2(rel string) (Reclaimed, error) {
	dir := l.Dir("", rel)
	var r Reclaimed
	var err error
	if r.Before, err = readInt(filepath.Join(dir, "memory.current")); err != nil {
		return r, err
	}
	swapMax := filepath.Join(dir, "memory.swap.max")
	if old, err := os.ReadFile(swapMax); err == nil {
		if err := os.WriteFile(swapMax, []byte("max"), 0); err == nil {
			defer os.WriteFile(swapMax, old, 0)
		}
	}
	// EAGAIN: the kernel reclaimed less than asked, which is expected
	// without swap.
	if err := os.WriteFile(filepath.Join(dir, "memory.reclaim"), []byte(strconv.FormatInt(r.Before, 10)), 0); err != nil && !errors.Is(err, unix.EAGAIN) {
		return r, fmt.Errorf("reclaim the memory of cgroup %s: %w", rel, err)
	}
	if r.After, err = readInt(filepath.Join(dir, "memory.current")); err != nil {
		return r, err
	}
	r.Swap, _ = readInt(filepath.Join(dir, "memory.swap.current"))
	return r, nil
}

// swapFree is the node's free swap in bytes, all areas together.
func swapFree() int64 {
	n, err := swap.Describe("")
	if err != nil {
		return 0
	}
	return n.Free
}

// SetMemoryLimit sets rel's memory limit (0: none). On v1 it is the limit a
// Reclaim lowered for a while; on v2 reclaim leaves the limit alone, so
// this does nothing there.
func (l *Layout) SetMemoryLimit(rel string, limit int64) error {
	if l.v2 {
		return nil
	}
	file := filepath.Join(l.Dir("memory", rel), "memory.limit_in_bytes")
	if err := os.WriteFile(file, []byte(limitValue(limit)), 0); err != nil {
		return fmt.Errorf("set the memory limit of cgroup %s: %w", rel, err)
	}
	return nil
}

// limitValue is a v1 memory.limit_in_bytes value: limit, or -1 for none.
func limitValue(limit int64) string {
	if limit <= 0 {
		return "-1"
	}
	return strconv.FormatInt(limit, 10)
}
