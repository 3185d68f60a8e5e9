package root

import (
	"strconv"
	"strings"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// dfLine is one file system as `df -k` prints it, in KiB.
type dfLine struct{ size, used, avail int64 }

// df runs `df -k path` in sandbox id as user, from dir, and returns its line.
func df(t *testing.T, d *testutil.Daemon, id, user, dir, path string) dfLine {
	t.Helper()
	r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, Argv: []string{"df", "-k", path}, User: user, Cwd: dir})
	if r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Fatalf("df -k %s as %q: %s", path, user, r)
	}
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	f := strings.Fields(lines[len(lines)-1])
	if len(f) < 4 {
		t.Fatalf("df -k %s: %q", path, r.stdout)
	}
	var n [3]int64
	for i := range n {
		v, err := strconv.ParseInt(f[i+1], 10, 64)
		if err != nil {
			t.Fatalf("df -k %s: %q: %v", path, r.stdout, err)
		}
		n[i] = v
	}
	return dfLine{n[0], n[1], n[2]}
}

// df, statfs(2) and statvfs(3) inside a sandbox describe its writable
// layer: size is the disk limit, used is what the sandbox wrote, available
// is the rest. The node's own disk stays out of sight, and the limit is
// still what stops writes.
func TestDiskFreeShowsTheLimit(t *testing.T) {
	d := startDaemon(t)
	sb := create(t, d, &dsecv1.SandboxSpec{DiskMb: 256})
	id := sb.GetId()
	const limit = 256 << 10 // KiB

	// Used counts what the kernel checks a write against: what the layer
	// holds (the agent's /etc/hosts and /etc/hostname, a few KiB) plus the
	// reservations of the open btrfs transaction (a MiB or two of metadata
	// until the next commit; sync commits it).
	fresh := df(t, d, id, "", "/", "/")
	if fresh.size != limit {
		t.Fatalf("df / before writing: size %d KiB, want the disk limit %d KiB (%+v)", fresh.size, limit, fresh)
	}
	if fresh.used > 4<<10 || fresh.used+fresh.avail != limit {
		t.Fatalf("df / of a fresh sandbox: %+v, want little used and the rest available", fresh)
	}
	mustSh(t, d, id, "sync")
	before := df(t, d, id, "", "/", "/")
	// Every way of naming the root agrees, for every user.
	for _, c := range []struct{ user, dir, path string }{
		{"", "/tmp", "."},
		{"nobody", "/tmp", "/"},
		{"nobody", "/", "tmp/../etc"},
	} {
		if got := df(t, d, id, c.user, c.dir, c.path); got.size != limit {
			t.Errorf("df -k %s as %q in %s: %+v, want size %d KiB", c.path, c.user, c.dir, got, limit)
		}
	}
	if got := strings.Fields(mustSh(t, d, id, "stat -f -c '%S %b' /")); len(got) != 2 || got[0] != "4096" || got[1] != strconv.Itoa(limit/4) {
		t.Errorf("stat -f /: %q, want 4096-byte blocks, %d of them", got, limit/4)
	}
	// The agent holds CAP_SYS_PTRACE to read other users' /proc files for
	// this; no command gets it, so the agent stays out of their sight.
	for _, line := range strings.Split(strings.TrimSpace(mustSh(t, d, id, "grep ^Cap /proc/self/status")), "\n") {
		_, hex, _ := strings.Cut(line, ":")
		if v, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64); err != nil || v&(1<<19) != 0 {
			t.Errorf("a command's %q: CAP_SYS_PTRACE (bit 19) or unreadable", line)
		}
	}
	if out := mustSh(t, d, id, "ls /proc"); strings.Contains(" "+strings.ReplaceAll(out, "\n", " ")+" ", " 1 ") {
		t.Errorf("pid 1 is visible inside: %q", out)
	}
	// Other mounts keep their own numbers.
	if shm := df(t, d, id, "", "/", "/dev/shm"); shm.size != 64<<10 {
		t.Errorf("df /dev/shm: %+v, want its own 64 MiB", shm)
	}

	mustSh(t, d, id, "dd if=/dev/zero of=/fill bs=1M count=50 2>/dev/null")
	const wrote = 50 << 10 // KiB
	check := func(when string) dfLine {
		t.Helper()
		after := df(t, d, id, "", "/", "/")
		if grew := after.used - before.used; grew < wrote-2<<10 || grew > wrote+2<<10 {
			t.Errorf("%s: used grew by %d KiB, want about %d KiB (%+v then %+v)", when, grew, wrote, before, after)
		}
		if shrank := before.avail - after.avail; shrank < wrote-2<<10 || shrank > wrote+2<<10 {
			t.Errorf("%s: available shrank by %d KiB, want about %d KiB (%+v then %+v)", when, shrank, wrote, before, after)
		}
		if after.size != limit {
			t.Errorf("%s: size %d KiB, want %d", when, after.size, limit)
		}
		t.Logf("df -k / %s: %+v (before: %+v)", when, after, before)
		return after
	}
	check("right after the write")
	mustSh(t, d, id, "sync")
	check("after sync")

	// The limit still stops writes, and df then shows the layer full.
	r := sh(t, d, id, "dd if=/dev/zero of=/more bs=1M count=400")
	if r.exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK || !strings.Contains(r.stderr, "quota") {
		t.Fatalf("writing 400 MiB more into a 256 MiB layer: %s, want a disk quota error", r)
	}
	full := df(t, d, id, "", "/", "/")
	if full.avail > 2<<10 || full.used < limit-4<<10 {
		t.Errorf("df / once the layer is full: %+v", full)
	}
	t.Logf("df -k / once full: %+v", full)
}
