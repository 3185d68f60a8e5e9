package backendtest

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// testLimits runs the checks of a spec's limits one after the other in one
// sandbox: Usage's figures, CPU, disk, pids, and memory last (under a
// backend whose OOM kills the whole sandbox nothing runs after it). Then
// the sandbox is deleted cleanly.
func testLimits(t *testing.T, n *node) {
	s := n.spec("limits")
	s.Pids = 32
	sb := n.startSandbox(s)
	m, _ := n.rt.(backend.Meter)
	t.Run("Usage", func(t *testing.T) { testUsage(t, sb, m) })
	t.Run("CPU", func(t *testing.T) { testCPU(t, sb, m) })
	t.Run("Disk", func(t *testing.T) { testDisk(t, sb, m) })
	t.Run("Pids", func(t *testing.T) { testPids(t, sb) })
	t.Run("Memory", func(t *testing.T) { testMemory(t, sb) })
	n.delete(s.ID)
	n.gone(s.ID)
	if m != nil {
		if _, err := m.Usage(context.Background(), s.ID); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Usage of a deleted sandbox: %v, want not found", err)
		}
	}
}

func (sb *sandbox) usage(t *testing.T, m backend.Meter) backend.Usage {
	t.Helper()
	u, err := m.Usage(context.Background(), sb.spec.ID)
	if err != nil {
		t.Fatalf("Usage %s: %v", sb.spec.ID, err)
	}
	return u
}

// testUsage: a runtime that meters its sandboxes (a Meter) reports a
// running one's memory and disk limits as its spec set them and some
// memory in use, and NotFound for an ID it never started.
func testUsage(t *testing.T, sb *sandbox, m backend.Meter) {
	if m == nil {
		t.Skipf("%T does not meter its sandboxes (no Meter)", sb.n.rt)
	}
	u := sb.usage(t, m)
	if u.MemoryLimit != sb.spec.MemoryBytes {
		t.Errorf("Usage's memory limit = %d, want the spec's %d", u.MemoryLimit, sb.spec.MemoryBytes)
	}
	if u.DiskLimit != sb.spec.DiskBytes {
		t.Errorf("Usage's disk limit = %d, want the spec's %d", u.DiskLimit, sb.spec.DiskBytes)
	}
	if u.MemoryBytes <= 0 {
		t.Errorf("Usage's memory = %d with the agent running, want more than 0", u.MemoryBytes)
	}
	if u.DiskSize < u.DiskLimit {
		t.Errorf("Usage's disk size = %d, below its limit %d", u.DiskSize, u.DiskLimit)
	}
	if _, err := m.Usage(context.Background(), "rtt-unknown"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Usage of an unknown sandbox: %v, want not found", err)
	}
}

// testCPU: two busy loops in a sandbox of Spec.CPUs get no more CPU time
// than CPUs allows. The bound is a ratio measured in the run, Usage's
// CPU time over the wall time between two readings taken while the loops
// spin, with a quarter of slack; nothing asserts how long anything takes
// (a loaded host gives the loops less, which passes).
func testCPU(t *testing.T, sb *sandbox, m backend.Meter) {
	sb.n.needCommands(t)
	if m == nil {
		t.Skipf("%T does not meter its sandboxes (no Meter): no CPU time to bound", sb.n.rt)
	}
	b := sb.startBackground(t, "(while :; do :; done) & (while :; do :; done) & echo spinning; wait")
	defer sb.kill(t, b)
	if _, ok, out := b.readLine("spinning"); !ok {
		t.Fatalf("the busy loops did not start: %q, %v", out, b.stream.Err())
	}
	// Past their start, then over at least 0.4 s of CPU time (0.8 s of
	// wall time at 0.5 CPUs).
	u0 := sb.usage(t, m)
	var u1 backend.Usage
	if !waitFor(commandWithin, func() bool { u1 = sb.usage(t, m); return u1.CPUUsec-u0.CPUUsec >= 100_000 }) {
		t.Fatalf("the busy loops used %d µs of CPU in %s", u1.CPUUsec-u0.CPUUsec, commandWithin)
	}
	w1 := time.Now()
	var u2 backend.Usage
	if !waitFor(commandWithin, func() bool { u2 = sb.usage(t, m); return u2.CPUUsec-u1.CPUUsec >= 400_000 }) {
		t.Fatalf("the busy loops used %d µs of CPU in %s", u2.CPUUsec-u1.CPUUsec, commandWithin)
	}
	wall := time.Since(w1)
	ratio := float64(u2.CPUUsec-u1.CPUUsec) / float64(wall.Microseconds())
	t.Logf("two busy loops at %.2f CPUs: %.2f CPUs (%d µs of CPU in %s)", sb.spec.CPUs, ratio, u2.CPUUsec-u1.CPUUsec, wall)
	if ratio > sb.spec.CPUs*1.25 {
		t.Errorf("two busy loops got %.2f CPUs, over the spec's %.2f (and a quarter of slack)", ratio, sb.spec.CPUs)
	}
}

// testDisk: writing past Spec.DiskBytes fails inside with ENOSPC or
// EDQUOT, the sandbox's statfs of / says no more than the limit, Usage
// sees the writable layer about full, and once the file is removed the
// space is back and the agent runs commands as before.
func testDisk(t *testing.T, sb *sandbox, m backend.Meter) {
	sb.n.needCommands(t)
	limit := sb.spec.DiskBytes
	r := sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=" + strconv.FormatInt(2*limit>>20, 10))
	if r.err != nil || r.exited == nil {
		t.Fatalf("dd past the disk limit: %s", r)
	}
	if r.exited.ExitCode == 0 || !(strings.Contains(r.stderr, "No space left on device") || strings.Contains(r.stderr, "Disk quota exceeded")) {
		t.Errorf("dd of %d MiB on a disk limit of %d MiB: %s; want it to fail with ENOSPC or EDQUOT", 2*limit>>20, limit>>20, r)
	}
	if m != nil {
		u := sb.usage(t, m)
		t.Logf("writable layer full: Usage says %d of %d bytes", u.DiskBytes, limit)
		if u.DiskBytes < limit*3/4 || u.DiskBytes > limit+limit/8 {
			t.Errorf("Usage's disk = %d with the writable layer full, want near its limit %d", u.DiskBytes, limit)
		}
	}
	// df's blocks are 1 KiB: the size of / as the sandbox sees it.
	out := sb.must(t, "df -k / | tail -n 1")
	var size int64
	if f := strings.Fields(out); len(f) > 1 {
		size, _ = strconv.ParseInt(f[1], 10, 64)
	}
	switch {
	case size <= 0:
		t.Errorf("df -k / in the sandbox: %q; want a size", out)
	case !sb.n.o.Deviations.StatfsNoLimit && size<<10 > limit+limit/10:
		t.Errorf("df -k / in the sandbox: %q; want a size of at most its disk limit, %d KiB", out, limit>>10)
	case sb.n.o.Deviations.StatfsNoLimit && m != nil && size<<10 > sb.usage(t, m).DiskSize:
		t.Errorf("df -k / in the sandbox: %q; want a size of at most the writable layer's file system, %d KiB (Deviations.StatfsNoLimit)", out, sb.usage(t, m).DiskSize>>10)
	}
	// Removed, the space is there again: half the limit fits.
	sb.must(t, "rm /root/fill && sync")
	half := "dd if=/dev/zero of=/root/half bs=1M count=" + strconv.FormatInt(limit>>21, 10) + " && rm /root/half"
	if r := sb.exec(half); !r.ok() {
		t.Errorf("%s after the full file was removed: %s", half, r)
	}
}

// testPids: forks in a sandbox stop at Spec.Pids: a shell starting twice as
// many sleeps gets fewer than Pids of them (its own processes count), and
// at least half; the agent answers at that peak, and once the sleeps are
// killed, commands run again.
func testPids(t *testing.T, sb *sandbox) {
	sb.n.needCommands(t)
	pids := sb.spec.Pids
	script := `i=0
( while [ $i -lt ` + strconv.FormatInt(2*pids, 10) + ` ]; do sleep 600 & i=$((i+1)); echo $i >/tmp/forks; done ) 2>/tmp/forkerr
read n </tmp/forks
echo "peak $n"
read x`
	b := sb.startBackground(t, script)
	line, ok, out := b.readLine("peak ")
	if !ok {
		sb.kill(t, b)
		t.Fatalf("the fork loop printed no peak: %q, %v", out, b.stream.Err())
	}
	if _, err := ping(sb.c, sb.n.o.boot()); err != nil {
		t.Errorf("the agent does not answer with the sandbox's pids in use: %v", err)
	}
	sb.n.running(sb.spec.ID)
	sb.kill(t, b)
	peak, err := strconv.ParseInt(strings.TrimPrefix(line, "peak "), 10, 64)
	if err != nil {
		t.Fatalf("the fork loop said %q", line)
	}
	t.Logf("pids limit %d: %d sleeps started", pids, peak)
	if peak >= pids || peak < pids/2 {
		t.Errorf("a shell started %d sleeps under a pids limit of %d, want fewer than %d and at least %d", peak, pids, pids, pids/2)
	}
	var r result
	if !waitFor(sb.n.o.boot(), func() bool { r = sb.exec("cat /tmp/forkerr"); return r.ok() }) {
		t.Fatalf("no command runs once the sleeps are killed: %s", r)
	}
	if !strings.Contains(r.stdout, "fork") {
		t.Errorf("the fork loop's errors: %q, want a failed fork", r.stdout)
	}
}

// testMemory: a process allocating twice Spec.MemoryBytes is OOM-killed,
// which the agent reports (EXIT_STATUS_OOM) and Status counts, and the
// agent lives on and runs commands; under Deviations.OOMKillsSandbox the
// whole sandbox stops running instead, Status counting the OOM kill and
// saying why in its Reason (Delete then removes it).
func testMemory(t *testing.T, sb *sandbox) {
	sb.n.needCommands(t)
	ctx := context.Background()
	dev := sb.n.o.Deviations
	before, err := sb.n.rt.Status(ctx, sb.spec.ID)
	if err != nil {
		t.Fatalf("Status: %v", err)
	}
	mib := strconv.FormatInt(2*sb.spec.MemoryBytes>>20, 10)
	r := sb.exec("mkdir -p /tmp/oom && exec " + sb.n.o.agentPath() + " hold-memory " + mib + " /tmp/oom")
	t.Logf("holding %s MiB under a limit of %d MiB: %s", mib, sb.spec.MemoryBytes>>20, r)
	if dev.OOMKillsSandbox {
		var st backend.Status
		if !waitFor(sb.n.o.boot(), func() bool {
			st, err = sb.n.rt.Status(ctx, sb.spec.ID)
			return err == nil && !st.Running
		}) {
			t.Fatalf("Status after the sandbox ran out of memory = %+v, %v; want it known and not running (Deviations.OOMKillsSandbox)", st, err)
		}
		// What the edge fails the sandbox with: REASON_OOM for a counted
		// kill, and the runtime's words.
		if st.OOMKills <= before.OOMKills || !strings.Contains(st.Reason, "memory") {
			t.Errorf("Status after the sandbox ran out of memory = %+v; want an OOM kill counted and a reason naming its memory (Deviations.OOMKillsSandbox)", st)
		}
		t.Logf("Status after the sandbox ran out of memory: %d OOM kills, %q", st.OOMKills, st.Reason)
		sb.n.silent(sb.spec.ID, "after its sandbox ran out of memory", sb.dial)
		return
	}
	switch {
	case r.exited == nil:
		t.Fatalf("the allocating process: %s; want it OOM-killed", r)
	case r.exited.Status != dsecv1.ExitStatus_EXIT_STATUS_OOM:
		t.Errorf("the allocating process: %s; want EXIT_STATUS_OOM", r)
	}
	after := sb.n.running(sb.spec.ID)
	if after.OOMKills <= before.OOMKills {
		t.Errorf("Status's OOM kills = %d after an OOM kill, were %d", after.OOMKills, before.OOMKills)
	}
	if _, err := ping(sb.c, sb.n.o.boot()); err != nil {
		t.Fatalf("the agent does not answer after an OOM kill: %v", err)
	}
	if got := sb.must(t, "echo alive"); got != "alive" {
		t.Errorf("echo alive after an OOM kill: %q", got)
	}
}
