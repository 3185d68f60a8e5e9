package container

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/edge/swap"
	"dsec.dev/dsec/internal/testutil"
)

// buildMemhog puts dsec-agent, whose hold-memory mode the test runs as
// memhog, into the node's busybox rootfs (the node's own agent is a test
// double).
func buildMemhog(t *testing.T, n *node) {
	t.Helper()
	copyFile(t, filepath.Join(testutil.Binaries(t), "dsec-agent"), filepath.Join(n.lower, "bin", "dsec-agent"))
}

// waitFile waits for a sandbox file to hold a line.
func waitFile(t *testing.T, sb *sandbox, path string) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, code := sb.run(t, "cat "+path+" 2>/dev/null")
		if code == 0 && strings.TrimSpace(out) != "" {
			return strings.TrimSpace(out)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not appear in %s", path, sb.id)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPause: a paused sandbox is frozen, keeps every byte of its memory, and
// runs on after resume. Without swap a pause releases only the page cache
// and says how much stayed; with the edge's own swap it releases at least
// 90 % of what the sandbox held in RAM, and resume's prefetch brings it back.
func TestPause(t *testing.T) {
	n := newNode(t)
	buildMemhog(t, n)
	testutil.RequireCommand(t, "mkswap")
	ctx := context.Background()
	s := n.spec(t, "sb-pause")
	s.MemoryBytes = 256 << 20
	sb := n.start(t, s)
	sb.must(t, "dsec-agent hold-memory 96 >/dev/null 2>&1 &")
	sum := waitFile(t, sb, "/tmp/memhog.sum")
	// Page cache of its own, too.
	sb.must(t, "dd if=/dev/zero of=/tmp/cache bs=1M count=16 2>/dev/null && cat /tmp/cache >/dev/null")

	check := func(t *testing.T) {
		t.Helper()
		sb.must(t, "rm -f /tmp/memhog.check; kill -USR1 $(cat /tmp/memhog.pid)")
		if got, _, _ := strings.Cut(waitFile(t, sb, "/tmp/memhog.check"), " "); got != sum {
			t.Fatalf("memory changed across the pause: checksum %s, was %s", got, sum)
		}
	}
	frozen := func(t *testing.T, want bool) {
		t.Helper()
		got, err := n.rt.Frozen(ctx, s.ID)
		if err != nil || got != want {
			t.Fatalf("Frozen = %v, %v; want %v", got, err, want)
		}
	}

	host, err := swap.Describe("")
	if err != nil {
		t.Fatal(err)
	}
	t.Run("without swap", func(t *testing.T) {
		testutil.Require(t, host.Total == 0, "the host has swap of its own")
		st, err := n.rt.Pause(ctx, s.ID, true)
		if err != nil {
			t.Fatal(err)
		}
		frozen(t, true)
		t.Logf("no swap: frozen in %s, reclaim %s, resident %d MiB, released %d MiB", st.Frozen, st.Reclaim, st.Resident>>20, st.Released>>20)
		if st.Released < 8<<20 || st.Resident-st.Released < 90<<20 {
			t.Errorf("without swap a pause should drop the page cache (16 MiB) and keep the 96 MiB of anonymous memory: resident %d, released %d", st.Resident, st.Released)
		}
		if _, err := n.rt.Resume(ctx, s.ID, true); err != nil {
			t.Fatal(err)
		}
		frozen(t, false)
		check(t)
	})

	t.Run("with swap", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "swap")
		t.Cleanup(func() {
			if err := swap.Remove(dir); err != nil {
				t.Errorf("remove swap: %v", err)
			}
		})
		if _, err := swap.Provision(ctx, dir, swap.Config{Kind: swap.File, Size: 512 << 20}, slog.New(slog.DiscardHandler)); err != nil {
			t.Fatal(err)
		}
		sb.must(t, "cat /tmp/cache >/dev/null")
		for i := range 3 {
			st, err := n.rt.Pause(ctx, s.ID, true)
			if err != nil {
				t.Fatal(err)
			}
			frozen(t, true)
			t.Logf("pause %d: frozen in %s, reclaim %s, resident %d MiB, released %d MiB, %d MiB to swap",
				i, st.Frozen, st.Reclaim, st.Resident>>20, st.Released>>20, st.Swapped>>20)
			if st.Released*10 < st.Resident*9 {
				t.Errorf("pause %d released %d of %d bytes, want at least 90 %%", i, st.Released, st.Resident)
			}
			rs, err := n.rt.Resume(ctx, s.ID, true)
			if err != nil {
				t.Fatal(err)
			}
			frozen(t, false)
			t.Logf("resume %d: prefetch %s (%d MiB advised), thaw %s", i, rs.Prefetch, rs.Advised>>20, rs.Thaw)
			if got := readHost(t, filepath.Join(n.rt.layout.Dir("memory", n.rt.cgroupRel(s.ID)), "memory.limit_in_bytes")); got != "268435456" {
				t.Errorf("memory limit after resume = %s, want the sandbox's 256 MiB", got)
			}
			check(t)
		}
	})

	t.Run("freeze and thaw", func(t *testing.T) {
		if err := n.rt.Freeze(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		frozen(t, true)
		// A second freeze is harmless.
		if err := n.rt.Freeze(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		if err := n.rt.Thaw(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		frozen(t, false)
		sb.must(t, "true")
	})

	t.Run("delete while paused", func(t *testing.T) {
		s2 := n.spec(t, "sb-pause-del")
		sb2 := n.start(t, s2)
		sb2.must(t, "sleep 1000 >/dev/null 2>&1 &")
		if _, err := n.rt.Pause(ctx, s2.ID, true); err != nil {
			t.Fatal(err)
		}
		if err := n.rt.Delete(ctx, s2.ID); err != nil {
			t.Fatalf("delete a paused sandbox: %v", err)
		}
		if n.rt.layout.Exists(n.rt.cgroupRel(s2.ID)) {
			t.Fatal("a deleted paused sandbox left its cgroups")
		}
	})
}
