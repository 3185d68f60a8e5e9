package container

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/opencontainers/runtime-spec/specs-go"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/cgroups"
	"dsec.dev/dsec/internal/edge/backend/container/pagein"
	"dsec.dev/dsec/internal/errdefs"
)

// freezeTimeout bounds a freeze: a sandbox whose processes cannot all be
// frozen by then is thawed again and the pause refused.
const freezeTimeout = 10 * time.Second

// Freeze stops every process of sandbox id (its cgroup tree, the agent's
// per-command children included) and returns once all are frozen. It
// does not touch memory: Pause does that.
func (r *Container) Freeze(ctx context.Context, id string) error {
	if !backend.ValidID(id) {
		return fmt.Errorf("freeze sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	if !r.layout.Exists(r.cgroupRel(id)) {
		return fmt.Errorf("freeze sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	ctx, cancel := context.WithTimeout(ctx, freezeTimeout)
	defer cancel()
	if r.gvisor() {
		// The cgroup freezer would stop the sentry too, and every runsc
		// call that asks it (state, list, kill) would hang until thawed:
		// runsc pause stops the sandbox's tasks inside the sentry instead.
		// runsc refuses to pause a paused sandbox: a second Freeze is
		// harmless, as under runc.
		return r.runscPause(ctx, id, "pause", "paused")
	}
	if err := r.layout.Freeze(ctx, r.cgroupRel(id)); err != nil {
		return fmt.Errorf("freeze sandbox %s: %w", id, err)
	}
	return nil
}

// Thaw lets sandbox id's processes run again.
func (r *Container) Thaw(ctx context.Context, id string) error {
	if !backend.ValidID(id) {
		return fmt.Errorf("thaw sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	if r.gvisor() {
		return r.runscPause(ctx, id, "resume", "running")
	}
	return r.layout.Thaw(ctx, r.cgroupRel(id))
}

// runscPause runs runsc pause or resume (cmd) on sandbox id unless runsc
// says it is in state done already.
func (r *Container) runscPause(ctx context.Context, id, cmd, done string) error {
	verb := map[string]string{"pause": "freeze", "resume": "thaw"}[cmd]
	st, err := r.runtimeState(ctx, id)
	if err != nil {
		return fmt.Errorf("%s sandbox %s: %w", verb, id, err)
	}
	if st.Status == done {
		return nil
	}
	if _, err := r.runtimeCmd(ctx, cmd, id); err != nil {
		return fmt.Errorf("%s sandbox %s: %w", verb, id, err)
	}
	return nil
}

// Frozen reports whether sandbox id is frozen.
func (r *Container) Frozen(ctx context.Context, id string) (bool, error) {
	if !backend.ValidID(id) {
		return false, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	if r.gvisor() {
		st, err := r.runtimeState(ctx, id)
		if err != nil {
			return false, err
		}
		return st.Status == "paused", nil
	}
	return r.layout.Frozen(r.cgroupRel(id))
}

// Pause freezes sandbox id and then, with reclaim, pushes its memory out
// of RAM: page cache dropped, anonymous and shared memory (files in its
// tmpfs mounts) to swap where the node has swap; the stats say what stayed
// and why. A failure to reclaim leaves the sandbox frozen and says so in
// the error's words; a failure to freeze leaves it running.
func (r *Container) Pause(ctx context.Context, id string, reclaim bool) (backend.PauseStats, error) {
	var st backend.PauseStats
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
	st.Kept = backend.KeptMemory{Anon: rec.Kept.Anon, Shmem: rec.Kept.Shmem, Cache: rec.Kept.Cache, Kernel: rec.Kept.Kernel}
	st.KeptReason = keptReason(rec)
	if err != nil {
		return st, fmt.Errorf("pause sandbox %s: frozen, but its memory stays in RAM: %w", id, err)
	}
	return st, nil
}

// keptWorthAWord is how much of one kind of memory a pause must leave in
// RAM before keptReason names it: a sandbox's page tables and kernel
// objects alone come to a few hundred KiB.
const keptWorthAWord = 1 << 20

// keptReason says in words why what a reclaim left in RAM stayed, where
// the node can tell; "" when no kind of memory left keptWorthAWord.
func keptReason(r cgroups.Reclaimed) string {
	k := r.Kept
	var why []string
	if swappable := k.Anon + k.Shmem; swappable >= keptWorthAWord {
		what := swappableWords(k)
		switch {
		case r.SwapFree <= 0:
			why = append(why, what+" cannot leave RAM: the node has no swap (dsecd --swap)")
		case r.SwapFreeAfter < swappable-k.Locked:
			why = append(why, fmt.Sprintf("%s stayed: the node's swap has %s free", what, mib(r.SwapFreeAfter)))
		case k.Locked >= swappable:
			why = append(why, what+" is locked in RAM (mlock, SHM_LOCK)")
		default:
			w := what + " stayed although the node's swap had room: the kernel's reclaim did not take it"
			if k.Locked > 0 {
				w += fmt.Sprintf("; %s of it is locked in RAM (mlock, SHM_LOCK)", mib(k.Locked))
			}
			why = append(why, w)
		}
	}
	if k.Cache >= keptWorthAWord {
		why = append(why, mib(k.Cache)+" of page cache stayed: the kernel's reclaim did not drop it")
	}
	if k.Kernel >= keptWorthAWord {
		why = append(why, mib(k.Kernel)+" is kernel memory (page tables, kernel objects), which never leaves RAM")
	}
	return strings.Join(why, "; ")
}

// swappableWords names the anonymous and shared memory of k.
func swappableWords(k cgroups.Kept) string {
	const shm = " of shared memory (tmpfs files such as /dev/shm, shared mappings)"
	switch {
	case k.Anon < keptWorthAWord/2:
		return mib(k.Shmem) + shm
	case k.Shmem < keptWorthAWord/2:
		return mib(k.Anon) + " of process memory"
	}
	return mib(k.Shmem) + shm + " and " + mib(k.Anon) + " of process memory"
}

// mib is n bytes in MiB, in words.
func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// Resume thaws sandbox id. With prefetch, it first asks the kernel to read
// the frozen processes' swapped-out memory and the files of the sandbox's
// tmpfs mounts back (MADV_WILLNEED), so that the first touch after the
// thaw does not fault them in page by page. The memory limit is set again
// from the sandbox's bundle, whatever an interrupted pause left.
func (r *Container) Resume(ctx context.Context, id string, prefetch bool) (backend.ResumeStats, error) {
	var st backend.ResumeStats
	rel := r.cgroupRel(id)
	if !backend.ValidID(id) {
		return st, fmt.Errorf("resume sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	if !r.layout.Exists(rel) {
		return st, fmt.Errorf("resume sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	if err := r.layout.SetMemoryLimit(rel, r.memoryLimit(id)); err != nil {
		r.log.Warn("restore the memory limit of a paused sandbox", "id", id, "err", err)
	}
	// Under gVisor the processes in the cgroup are the sentry and the
	// gofer, whose memory holds every task's: no prefetch yet.
	if prefetch && !r.gvisor() {
		t0 := time.Now()
		pids, err := r.layout.Procs(rel)
		if err != nil {
			r.log.Warn("list processes to prefetch", "id", id, "err", err)
		}
		namespaces := map[string]bool{}
		for _, pid := range pids {
			n, err := pagein.WillNeed(pid)
			if err != nil {
				r.log.Debug("prefetch process memory", "id", id, "pid", pid, "err", err)
			}
			st.Advised += n
			// The files in its tmpfs mounts (/dev/shm, a tmpfs /tmp), once
			// per mount namespace.
			ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid))
			if err != nil || namespaces[ns] {
				continue
			}
			namespaces[ns] = true
			n, err = pagein.WillNeedTmpfs(pid)
			if err != nil {
				r.log.Debug("prefetch tmpfs files", "id", id, "pid", pid, "err", err)
			}
			st.AdvisedTmpfs += n
		}
		st.Prefetch = time.Since(t0)
	}
	t1 := time.Now()
	if err := r.Thaw(ctx, id); err != nil {
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
