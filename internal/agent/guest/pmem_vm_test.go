package guest_test

import (
	"bytes"
	"context"
	"crypto/md5"
	"encoding/hex"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/vmtest"
)

// TestGuestPmem boots one real guest (q35) whose base layer, built as the
// store builds layers, is a virtio-pmem device mounted with DAX, under a
// virtio-blk layer and the writable disk, with free page reporting on. It
// reads a file of the pmem layer intact without the guest's page cache
// growing by it (the host's page cache serves it), and RAM the guest
// frees goes back to the host.
func TestGuestPmem(t *testing.T) {
	dir := t.TempDir()
	cfg := vmtest.Config(t, dir)
	busybox := vmtest.StaticBusybox(t)

	// The base: busybox and 24 MiB of random data, pmem; the top: a file
	// of its own, a virtio-blk disk.
	const bigSize = 24 << 20
	big := make([]byte, bigSize)
	rng := rand.NewChaCha8([32]byte{1})
	rng.Read(big)
	base := buildLayer(t, dir, "base", map[string][]byte{"data/big": big, "data/small.txt": []byte("small\n")}, busybox)
	top := buildLayer(t, dir, "top", map[string][]byte{"hello.txt": []byte("from the top layer\n")}, "")
	upper := cfg.Drives[1]
	cfg.Drives = []qemu.Drive{
		{Path: base, Serial: "layer0", ReadOnly: true, Pmem: true},
		{Path: top, Serial: "layer1", ReadOnly: true},
		upper,
	}
	cfg.FreePageReporting = true
	cfg.Cmdline = fmt.Sprintf("-- --layer %s --layer %s --upper %s", cfg.GuestRef(0), cfg.GuestRef(1), upper.Serial)

	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	start := time.Now()
	g := vmtest.Start(t, cfg, log)
	g.WaitBoot(t)
	t.Logf("%s %s guest with a pmem layer: QEMU start to the agent's first answer %s", g.P.Config().Accel, g.P.Config().Machine,
		time.Since(start).Round(time.Millisecond))
	if m := g.P.Config().Machine; m != qemu.Q35 {
		t.Fatalf("machine %s, want q35 for a pmem layer", m)
	}

	t.Run("DAX", func(t *testing.T) {
		if tail := g.P.ConsoleTail(200); !strings.Contains(tail, "dax=true") {
			t.Errorf("the console has no pmem layer mounted with DAX:\n%s", tail)
		}
	})

	t.Run("Root", func(t *testing.T) {
		if out := g.MustExec(t, "cat", "/data/small.txt", "/hello.txt"); out != "small\nfrom the top layer\n" {
			t.Errorf("files of both layers: %q", out)
		}
	})

	// A read of the pmem layer's file is the host's pages, not the
	// guest's page cache: Cached grows by far less than the file (a
	// virtio-blk layer's read adds the whole file).
	t.Run("ReadShared", func(t *testing.T) {
		cached := func() int64 {
			out := g.MustExec(t, "grep", "^Cached:", "/proc/meminfo")
			f := strings.Fields(out)
			if len(f) < 2 {
				t.Fatalf("Cached in /proc/meminfo: %q", out)
			}
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
		before := cached()
		sum := md5.Sum(big)
		out := g.MustExec(t, "busybox", "md5sum", "/data/big")
		if got := strings.Fields(out); len(got) == 0 || got[0] != hex.EncodeToString(sum[:]) {
			t.Errorf("md5sum of /data/big in the guest %q, want %x", out, sum)
		}
		grew := cached() - before
		t.Logf("reading the %d MiB file grew the guest's page cache by %d KiB", bigSize>>20, grew>>10)
		if grew > bigSize/4 {
			t.Errorf("the guest's page cache grew by %d KiB reading a %d KiB file of a DAX layer", grew>>10, bigSize>>10)
		}
	})

	// 64 MiB written to the guest's tmpfs and removed: free page
	// reporting hands the pages back, and QEMU's anonymous memory shrinks.
	t.Run("FreePageReporting", func(t *testing.T) {
		g.MustExec(t, "sh", "-c", "head -c 67108864 /dev/zero > /dev/shm/fill")
		peak := rssAnon(t, g.P.Pid())
		g.MustExec(t, "rm", "/dev/shm/fill")
		deadline := time.Now().Add(time.Minute)
		for {
			now := rssAnon(t, g.P.Pid())
			if peak-now >= 32<<20 {
				t.Logf("QEMU's anonymous memory %d MiB after the guest removed 64 MiB, %d MiB before", now>>20, peak>>20)
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("QEMU's anonymous memory is %d MiB a minute after the guest freed 64 MiB (%d MiB before)", now>>20, peak>>20)
			}
			time.Sleep(500 * time.Millisecond)
		}
	})
}

// buildLayer builds an EROFS layer file named name in dir the way the
// store does (image.BuildLayerFile: flat files, padded to 2 MiB) from
// files, with busybox and its applets under /bin when busybox is not "".
func buildLayer(t testing.TB, dir, name string, files map[string][]byte, busybox string) string {
	t.Helper()
	testutil.RequireCommand(t, "mkfs.erofs")
	tree := filepath.Join(dir, name+"-tree")
	if busybox != "" {
		b, err := os.ReadFile(busybox)
		if err != nil {
			t.Fatal(err)
		}
		files["bin/busybox"] = b
	}
	for p, b := range files {
		if err := os.MkdirAll(filepath.Join(tree, filepath.Dir(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(tree, p), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if busybox != "" {
		for _, applet := range slices.Concat(vmtest.Applets, []string{"rm"}) {
			if err := os.Symlink("busybox", filepath.Join(tree, "bin", applet)); err != nil {
				t.Fatal(err)
			}
		}
	}
	out := filepath.Join(dir, name+".erofs")
	if _, _, err := image.BuildLayerFile(context.Background(), tree, out); err != nil {
		t.Fatal(err)
	}
	return out
}

// rssAnon is process pid's resident anonymous memory (RssAnon) in bytes.
func rssAnon(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range bytes.Lines(b) {
		if f := strings.Fields(string(line)); len(f) >= 2 && f[0] == "RssAnon:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no RssAnon in /proc/%d/status", pid)
	return 0
}
