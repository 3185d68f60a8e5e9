package cgroups

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
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
	if l.v2 {
		if w, err := watchEvents(l.Dir("", rel)); err == nil {
			defer w.close()
			return l.freezeV2(ctx, rel, w)
		}
		// No inotify (out of watches): poll.
	}
	return l.freezePoll(ctx, rel, freezePollMax)
}

// freezePollMax is the longest a poll of the freeze state sleeps between
// looks. A look is one read of a small file; a freeze that took the kernel
// 3 ms was seen up to 3 ms late with a 5 ms bound, which a grade's capture
// and a pause paid in full.
const freezePollMax = time.Millisecond

// freezePoll freezes rel and polls its state, backing off from 50 µs to
// maxDelay between looks: v1's way (its freezer.state sends no events), and
// v2's without inotify.
func (l *Layout) freezePoll(ctx context.Context, rel string, maxDelay time.Duration) error {
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
		delay = min(2*delay, maxDelay)
	}
}

// freezeV2 freezes rel on cgroup v2 and sleeps until the kernel reports
// the tree frozen: a change of cgroup.events's "frozen" is a modify event
// on the file (the kernel sends one at most every 10 ms per file, and the
// one that ends a freeze is normally the file's first in a long while), so
// the wait wakes when the last task stops instead of at the next of a
// backing-off poll's ticks (a capture or pause waited up to twice the
// freeze's own time for them). The watch's wait is bounded, so a missed
// event costs at most freezeRecheck.
func (l *Layout) freezeV2(ctx context.Context, rel string, w *eventsWatch) error {
	fail := func(err error) error {
		_ = l.Thaw(context.WithoutCancel(ctx), rel)
		return err
	}
	if err := os.WriteFile(l.freezeFile(rel), []byte("1"), 0); err != nil {
		return fail(fmt.Errorf("freeze cgroup %s: %w", rel, err))
	}
	for try := 1; ; try++ {
		frozen, err := l.Frozen(rel)
		if err != nil {
			return fail(err)
		}
		if frozen {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return fail(fmt.Errorf("freeze cgroup %s: not frozen after %d looks when %w; thawed it again", rel, try, err))
		}
		if err := w.wait(freezeRecheck); err != nil {
			return fail(fmt.Errorf("freeze cgroup %s: %w", rel, err))
		}
	}
}

// freezeRecheck bounds a wait for cgroup.events to change: the state is
// read again after it even without an event, and ctx is looked at.
const freezeRecheck = 5 * time.Millisecond

// eventsWatch is an inotify watch on a cgroup's cgroup.events file.
type eventsWatch struct{ fd int }

func watchEvents(dir string) (*eventsWatch, error) {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("inotify: %w", err)
	}
	if _, err := unix.InotifyAddWatch(fd, filepath.Join(dir, "cgroup.events"), unix.IN_MODIFY); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("watch %s/cgroup.events: %w", dir, err)
	}
	return &eventsWatch{fd: fd}, nil
}

// wait returns when the file changed since the last wait, or after d.
func (w *eventsWatch) wait(d time.Duration) error {
	fds := []unix.PollFd{{Fd: int32(w.fd), Events: unix.POLLIN}}
	if _, err := unix.Poll(fds, int(d.Milliseconds())); err != nil && !errors.Is(err, unix.EINTR) {
		return fmt.Errorf("wait for cgroup.events: %w", err)
	}
	var buf [4096]byte
	for {
		// Drain what came, so the next wait sleeps until the next change.
		if n, err := unix.Read(w.fd, buf[:]); n <= 0 || err != nil {
			return nil
		}
	}
}

func (w *eventsWatch) close() { unix.Close(w.fd) }

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
	Kept          Kept  // what of After stayed, by kind
	// SwapFree is the node's free swap when the reclaim began, and
	// SwapFreeAfter when it ended.
	SwapFree, SwapFreeAfter int64
}

// Reclaim pushes rel's memory out of RAM while its tasks are frozen: the
// page cache is dropped, and anonymous and shared memory (tmpfs files such
// as /dev/shm) go to swap when the node has swap (without it they cannot
// leave RAM, and Kept says how much stayed). limit is the cgroup's memory
// limit, put back at the end (0: none). On v1 it drops the cache with
// memory.force_empty, then lowers memory.limit_in_bytes to force the rest
// out and raises it again; on v2 it writes memory.reclaim, letting the
// cgroup swap meanwhile.
//
// The kernel's reclaim (the classic LRU lists of this kernel, not MGLRU)
// swaps pages out from the inactive list and refills it from the active
// list only while the cgroup's statistics say it is short; those are
// brought up to date at most every two seconds. Pages touched twice just
// before the pause (a file in /dev/shm written and read back) are active
// while the statistics still count them inactive: reclaim would swap out
// only what really was inactive, then find nothing to scan and give up.
// Reading memory.stat brings the statistics up to date (an rstat flush),
// so Reclaim reads it before reclaiming and before each step of the v1
// shrink.
func (l *Layout) Reclaim(ctx context.Context, rel string, limit int64) (Reclaimed, error) {
	var r Reclaimed
	r.SwapFree = swapFree()
	if l.v2 {
		err := l.reclaimV2(rel, &r)
		r.SwapFreeAfter = swapFree()
		return r, err
	}
	dir := l.Dir("memory", rel)
	usage := filepath.Join(dir, "memory.usage_in_bytes")
	var err error
	if r.Before, err = readInt(usage); err != nil {
		return r, err
	}
	if err := flushStats(dir); err != nil {
		return r, err
	}
	// Page cache first: it needs no swap and is the cheaper to drop. With
	// swap, force_empty swaps anonymous memory out as well.
	if err := os.WriteFile(filepath.Join(dir, "memory.force_empty"), []byte("0"), 0); err != nil && !errors.Is(err, unix.EBUSY) {
		return r, fmt.Errorf("drop the page cache of cgroup %s: %w", rel, err)
	}
	if r.SwapFree > 0 {
		if err := shrinkV1(ctx, dir, limit); err != nil {
			return r, fmt.Errorf("swap out cgroup %s: %w", rel, err)
		}
	}
	r.SwapFreeAfter = swapFree()
	if r.After, err = readInt(usage); err != nil {
		return r, err
	}
	if r.Kept, err = keptIn(dir, false, r.After); err != nil {
		return r, err
	}
	if memsw, err := readInt(filepath.Join(dir, "memory.memsw.usage_in_bytes")); err == nil {
		r.Swap = max(memsw-r.After, 0)
	}
	return r, nil
}

// shrinkV1 lowers the memory limit step by step towards nothing, so the
// kernel swaps the cgroup's anonymous and shared memory out, then puts
// limit back. A step the kernel cannot meet (EBUSY) is tried again with
// half the step, since the kernel gives up after a few reclaim rounds that
// a busy node's swap writes can outlast; shrinkBusyTries refusals in a row
// (what is left cannot be swapped) end the shrinking without an error.
// Each step reads memory.stat first, which brings the statistics reclaim
// goes by up to date (see Reclaim).
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
		if err := flushStats(dir); err != nil {
			return err
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

func (l *Layout) reclaimV2(rel string, r *Reclaimed) error {
	dir := l.Dir("", rel)
	var err error
	if r.Before, err = readInt(filepath.Join(dir, "memory.current")); err != nil {
		return err
	}
	swapMax := filepath.Join(dir, "memory.swap.max")
	if old, err := os.ReadFile(swapMax); err == nil {
		if err := os.WriteFile(swapMax, []byte("max"), 0); err == nil {
			defer os.WriteFile(swapMax, old, 0)
		}
	}
	if err := flushStats(dir); err != nil {
		return err
	}
	// EAGAIN: the kernel reclaimed less than asked, which is expected
	// without swap.
	if err := os.WriteFile(filepath.Join(dir, "memory.reclaim"), []byte(strconv.FormatInt(r.Before, 10)), 0); err != nil && !errors.Is(err, unix.EAGAIN) {
		return fmt.Errorf("reclaim the memory of cgroup %s: %w", rel, err)
	}
	if r.After, err = readInt(filepath.Join(dir, "memory.current")); err != nil {
		return err
	}
	if r.Kept, err = keptIn(dir, true, r.After); err != nil {
		return err
	}
	r.Swap, _ = readInt(filepath.Join(dir, "memory.swap.current"))
	return nil
}

// flushStats reads the memory.stat of the memory cgroup dir, which makes
// the kernel bring the cgroup's statistics up to date (see Reclaim).
func flushStats(dir string) error {
	path := filepath.Join(dir, "memory.stat")
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	defer f.Close()
	if _, err := io.Copy(io.Discard, f); err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	return nil
}

// keptIn reads what of usage bytes charged to the memory cgroup dir (v2:
// the unified dir) stays in RAM, by kind, from its memory.stat.
func keptIn(dir string, v2 bool, usage int64) (Kept, error) {
	var anon, file, shmem, locked int64
	// v1 counts shmem in cache, and only its "total_" keys include the
	// children; v2 counts shmem in file, and every key includes them.
	keys := map[string]*int64{"total_rss": &anon, "total_cache": &file, "total_shmem": &shmem, "total_unevictable": &locked}
	if v2 {
		keys = map[string]*int64{"anon": &anon, "file": &file, "shmem": &shmem, "unevictable": &locked}
	}
	path := filepath.Join(dir, "memory.stat")
	f, err := os.Open(path)
	if err != nil {
		return Kept{}, fmt.Errorf("read %s: %w", path, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), " ")
		if p := keys[k]; p != nil {
			*p, _ = strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	if err := sc.Err(); err != nil {
		return Kept{}, fmt.Errorf("read %s: %w", path, err)
	}
	return Kept{
		Anon: anon, Shmem: shmem, Cache: max(file-shmem, 0), Locked: locked,
		Kernel: max(usage-anon-file, 0),
	}, nil
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
