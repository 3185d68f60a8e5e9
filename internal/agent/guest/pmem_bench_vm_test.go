package guest_test

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/vmtest"
)

// BenchmarkSharedLayer measures, in one run, the host memory of 8 guests
// that each read the same 200 MiB of a base layer, attached as virtio-blk
// disks (each guest caches the layer in its own RAM) and then as
// virtio-pmem devices with DAX (the guests read the host's page cache of
// the file, one copy). Issue 30's target: pmem at most 0.6 of virtio-blk.
// Host memory is counted the same way for both: the guests' QEMUs'
// anonymous and shmem resident memory (guest RAM, TCG's code buffer,
// QEMU's heap) plus the layer file's pages in the host's page cache,
// counted once, after every guest has read the layer (nothing frees them
// meanwhile). ΣPSS is printed beside it. 8 TCG boots are heavy: run it by
// hand, under the root lock, with DSEC_VM_KERNEL_DIR and DSEC_BIN_DIR:
//
//	go test -run '^$' -bench SharedLayer -benchtime 1x ./internal/agent/guest
func BenchmarkSharedLayer(b *testing.B) {
	const (
		guests    = 8
		files     = 50
		fileBytes = 4 << 20 // 50 files of 4 MiB: 200 MiB
		memoryMiB = 512     // room for the layer in each guest's page cache
	)
	dir := b.TempDir()
	data := map[string][]byte{}
	rng := rand.NewChaCha8([32]byte{2})
	for i := range files {
		f := make([]byte, fileBytes)
		rng.Read(f)
		data[fmt.Sprintf("data/f%02d", i)] = f
	}
	t0 := time.Now()
	layer := buildLayer(b, dir, "data", data, "")
	data = nil
	fi, err := os.Stat(layer)
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("layer: %d MiB in %d files, built in %s", fi.Size()>>20, files, time.Since(t0).Round(time.Millisecond))

	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	run := func(pmem bool) sharedRun {
		dropCache(b, layer)
		var gs []*vmtest.Guest
		t0 := time.Now()
		for i := range guests {
			vdir := filepath.Join(dir, fmt.Sprintf("pmem%v-%d", pmem, i))
			cfg := vmtest.Config(b, vdir)
			cfg.MemoryMiB = memoryMiB
			cfg.TCGBufferMiB = 64
			cfg.FreePageReporting = true
			cfg.Drives = append([]qemu.Drive{{Path: layer, Serial: "data", ReadOnly: true, Pmem: pmem}}, cfg.Drives...)
			cfg.Cmdline = fmt.Sprintf("-- --layer %s --layer %s --upper %s", cfg.GuestRef(0), cfg.GuestRef(1), cfg.GuestRef(2))
			gs = append(gs, vmtest.Start(b, cfg, log))
		}
		for _, g := range gs {
			g.WaitBoot(b)
		}
		r := sharedRun{boot: time.Since(t0), machine: gs[0].P.Config().Machine}
		t0 = time.Now()
		for _, g := range gs {
			g.MustExec(b, "sh", "-c", "cat /data/* > /dev/null")
		}
		r.read = time.Since(t0)
		for _, g := range gs {
			st := procStatus(b, g.P.Pid())
			r.anon += st["RssAnon:"] + st["RssShmem:"]
			r.pss += smapsPss(b, g.P.Pid())
		}
		r.layerCache = cachedBytes(b, layer)
		for _, g := range gs {
			g.P.Kill()
			<-g.P.Done()
		}
		return r
	}
	for b.Loop() {
		blk := run(false)
		pmem := run(true)
		ratio := float64(pmem.total()) / float64(blk.total())
		accel := "tcg"
		if a, _ := qemu.DetectAccel(); a == qemu.KVM {
			accel = "kvm"
		}
		b.Logf("%d guests of %d MiB (%s), each reading the same %d MiB of a base layer:", guests, memoryMiB, accel, files*fileBytes>>20)
		b.Logf("%-10s %-8s %10s %12s %12s %10s %10s %10s", "layer", "machine", "boot", "read (all)", "QEMU anon", "layer cache", "total", "ΣPSS")
		for _, r := range []struct {
			name string
			r    sharedRun
		}{{"virtio-blk", blk}, {"pmem+DAX", pmem}} {
			b.Logf("%-10s %-8s %10s %12s %9d MiB %7d MiB %6d MiB %6d MiB", r.name, r.r.machine, r.r.boot.Round(time.Millisecond),
				r.r.read.Round(time.Millisecond), r.r.anon>>20, r.r.layerCache>>20, r.r.total()>>20, r.r.pss>>20)
		}
		b.Logf("pmem/virtio-blk host memory: %.2f (target <= 0.6)", ratio)
		b.ReportMetric(ratio, "pmem/blk")
	}
}

// sharedRun is what one arm of BenchmarkSharedLayer measured.
type sharedRun struct {
	machine    qemu.Machine
	boot, read time.Duration
	anon       int64 // the QEMUs' RssAnon + RssShmem
	pss        int64 // the QEMUs' proportional set sizes
	layerCache int64 // the layer file's pages in the host's page cache
}

func (r sharedRun) total() int64 { return r.anon + r.layerCache }

// dropCache drops path's clean pages from the host's page cache.
func dropCache(b *testing.B, path string) {
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		b.Fatal(err)
	}
}

// cachedBytes is how much of path is in the host's page cache (mincore of
// a mapping that touches no page).
func cachedBytes(b *testing.B, path string) int64 {
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		b.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Munmap(m)
	page := os.Getpagesize()
	vec := make([]byte, (len(m)+page-1)/page)
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		b.Fatalf("mincore %s: %v", path, errno)
	}
	var n int64
	for _, v := range vec {
		n += int64(v & 1)
	}
	return n * int64(page)
}

// procStatus is the kB fields of /proc/pid/status, in bytes.
func procStatus(b *testing.B, pid int) map[string]int64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	m := map[string]int64{}
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[2] == "kB" {
			if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				m[f[0]] = kb << 10
			}
		}
	}
	return m
}

// smapsPss is process pid's proportional set size in bytes.
func smapsPss(b *testing.B, pid int) int64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "Pss:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			return kb << 10
		}
	}
	b.Fatalf("no Pss in /proc/%d/smaps_rollup", pid)
	return 0
}
