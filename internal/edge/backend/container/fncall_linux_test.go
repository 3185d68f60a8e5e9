package container

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/edge/swap"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// TestFnCallSandbox checks what the fncall backend adds to a container
// (with the stand-in agent, which takes any flags): the cpu cgroup fd and
// the agent's flags, a size-capped tmpfs /tmp charged to the sandbox's
// memory, loopback only; and that it keeps its sandboxes apart from the
// container backend made from the same Config.
func TestFnCallSandbox(t *testing.T) {
	n := newNode(t)
	ctx := context.Background()
	fn, err := NewFnCall(n.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := fn.Init(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ids, _ := fn.List(ctx)
		for _, id := range ids {
			if err := fn.Delete(ctx, id); err != nil {
				t.Errorf("delete %s: %v", id, err)
			}
		}
		if err := fn.Teardown(ctx); err != nil {
			t.Errorf("fncall teardown: %v", err)
		}
	})
	if f := fn.Features(); !f.Pause || f.Snapshot || !f.Network {
		t.Errorf("fncall features %+v, want pause and network, no snapshots", f)
	}
	fnNode := &node{rt: fn, cfg: n.cfg, lower: n.lower, sockDir: n.sockDir}
	s := n.spec(t, "sb-fn")
	s.MemoryBytes = 64 << 20
	sb := fnNode.start(t, s)
	st, err := fn.Status(ctx, s.ID)
	if err != nil || !st.Running {
		t.Fatalf("status %+v, %v", st, err)
	}

	t.Run("agent flags and cpu fd", func(t *testing.T) {
		// runc start returns once it has told the container's init to
		// exec; until the exec, pid 1 is still "runc init".
		var args []string
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", st.Pid))
			if err != nil {
				t.Fatal(err)
			}
			args = strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")
			if !slices.Contains(args, "init") || time.Now().After(deadline) {
				break
			}
		}
		i := slices.Index(args, "--cpu-cgroup-fd")
		if i < 0 || i+2 >= len(args) || args[i+2] != "--fncall" {
			t.Fatalf("agent args %q: want --cpu-cgroup-fd N --fncall", args)
		}
		fd, err := strconv.Atoi(args[i+1])
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", st.Pid, fd))
		if err != nil {
			t.Fatalf("agent fd %d: %v", fd, err)
		}
		want := fn.layout.Dir("cpu", fn.cgroupRel(s.ID))
		if got != want {
			t.Errorf("agent fd %d is %s, want the cpu cgroup %s", fd, got, want)
		}
		if !strings.HasSuffix(want, filepath.Join(n.cfg.CgroupParent+"-fncall", s.ID)) {
			t.Errorf("fncall cgroup %s is not under %s-fncall", want, n.cfg.CgroupParent)
		}
	})

	t.Run("tmp", func(t *testing.T) {
		mounts := sb.must(t, "cat /proc/mounts")
		var line string
		for _, l := range strings.Split(mounts, "\n") {
			if f := strings.Fields(l); len(f) > 3 && f[1] == "/tmp" {
				line = l
			}
		}
		if !strings.HasPrefix(line, "tmpfs /tmp tmpfs ") || !strings.Contains(line, "size=32768k") || strings.Contains(line, "noexec") {
			t.Errorf("/tmp mount %q, want an exec-able tmpfs of half the 64 MiB memory limit", line)
		}
		// Writing past the cap fails with ENOSPC, well before the OOM killer.
		out, code := sb.run(t, "dd if=/dev/zero of=/tmp/big bs=1M count=40 2>&1")
		if code == 0 || !strings.Contains(out, "space") {
			t.Errorf("writing 40 MiB into a 32 MiB /tmp: exit %d: %s", code, out)
		}
		// What /tmp holds is charged to the sandbox's memory.
		sb.must(t, "rm -f /tmp/big && echo ok")
		before := readMemoryUsage(t, fn, s.ID)
		sb.must(t, "dd if=/dev/zero of=/tmp/f bs=1M count=16 2>/dev/null && echo ok")
		if after := readMemoryUsage(t, fn, s.ID); after-before < 12<<20 {
			t.Errorf("memory use %d -> %d after 16 MiB into /tmp: tmpfs not charged to the sandbox", before, after)
		}
	})

	t.Run("pause pushes /tmp out", func(t *testing.T) {
		// What /tmp holds is shared memory: with swap a pause pushes it out,
		// even just read back, and resume's prefetch reads it in again.
		testutil.RequireCommand(t, "mkswap")
		dir := filepath.Join(t.TempDir(), "swap")
		t.Cleanup(func() {
			if err := swap.Remove(dir); err != nil {
				t.Errorf("remove swap: %v", err)
			}
		})
		if _, err := swap.Provision(ctx, dir, swap.Config{Kind: swap.File, Size: 128 << 20}, slog.New(slog.DiscardHandler)); err != nil {
			t.Fatal(err)
		}
		sum := sb.must(t, "dd if=/dev/urandom of=/tmp/r bs=1M count=12 2>/dev/null && md5sum /tmp/r")
		st, err := fn.Pause(ctx, s.ID, true)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("pause: resident %d MiB, released %d MiB, %d MiB to swap, kept %+v %q",
			st.Resident>>20, st.Released>>20, st.Swapped>>20, st.Kept, st.KeptReason)
		if st.Resident < 12<<20 || st.Released*10 < st.Resident*9 {
			t.Errorf("a fncall sandbox with %d MiB in its tmpfs /tmp released %d of %d bytes, want at least 90 %%", st.Resident>>20, st.Released, st.Resident)
		}
		rs, err := fn.Resume(ctx, s.ID, true)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("resume: prefetch %s, %d MiB of tmpfs files advised", rs.Prefetch, rs.AdvisedTmpfs>>20)
		if rs.AdvisedTmpfs < 12<<20 {
			t.Errorf("resume's prefetch advised %d bytes of tmpfs files, want at least the 12 MiB of /tmp/r", rs.AdvisedTmpfs)
		}
		if got := sb.must(t, "md5sum /tmp/r"); got != sum {
			t.Errorf("/tmp changed across the pause: %q, was %q", got, sum)
		}
	})

	t.Run("loopback only", func(t *testing.T) {
		if dev := sb.must(t, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"); dev != "lo" {
			t.Errorf("interfaces = %q, want only lo", dev)
		}
	})

	t.Run("apart from the container backend", func(t *testing.T) {
		if ids, _ := n.rt.List(ctx); slices.Contains(ids, s.ID) {
			t.Errorf("the container backend lists the fncall sandbox: %v", ids)
		}
		if _, err := n.rt.Status(ctx, s.ID); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("the container backend's Status of the fncall sandbox: %v, want not found", err)
		}
		// A container Delete of its ID touches nothing of it.
		if err := n.rt.Delete(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		if st, err := fn.Status(ctx, s.ID); err != nil || !st.Running {
			t.Fatalf("fncall sandbox after the container backend deleted its ID: %+v, %v", st, err)
		}
		sb.must(t, "echo still here > /tmp/x && cat /tmp/x")
		// And a container sandbox beside it.
		c := n.spec(t, "sb-fn-c")
		n.start(t, c)
		if ids, _ := fn.List(ctx); slices.Contains(ids, c.ID) {
			t.Errorf("the fncall backend lists the container sandbox: %v", ids)
		}
	})
}

func readMemoryUsage(t *testing.T, r *Container, id string) int64 {
	t.Helper()
	cs, err := r.layout.Stats(r.cgroupRel(id))
	if err != nil {
		t.Fatal(err)
	}
	return cs.MemoryBytes
}
