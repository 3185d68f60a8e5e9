package fuse2fs_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/vm/fuse2fs"
)

// BenchmarkCapture measures, in one run, a microVM capture's two steps on
// the host — mount the clone of the writable disk, then snapshot.Pack its
// upper dir into an EROFS layer — with the host kernel's ext4 on a loop
// device (how Capture mounted before, the baseline) and with fuse2fs, on
// an ext4 image holding what a sandbox wrote: 50 MiB in 300 files of
// random data across 10 dirs. It reports both and the ratio:
//
//	go test -run '^$' -bench Capture -benchtime 5x ./internal/vm/fuse2fs
func BenchmarkCapture(b *testing.B) {
	requireFuse2fs(b)
	src := b.TempDir()
	buf := make([]byte, 50<<20/300)
	for i := range 300 {
		dir := filepath.Join(src, "upper", fmt.Sprintf("d%d", i%10))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			b.Fatal(err)
		}
		rand.Read(buf)
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d", i)), buf, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	img := filepath.Join(b.TempDir(), "disk.ext4")
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-m", "0", "-d", src, img, "256M").CombinedOutput(); err != nil {
		b.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	ctx := context.Background()
	var kernel, fuse step
	for range b.N {
		kernel.add(b, img, func(dir string) (func() error, error) {
			if out, err := exec.Command("mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noexec", img, dir).CombinedOutput(); err != nil {
				return nil, fmt.Errorf("mount: %v: %s", err, out)
			}
			return func() error { return unix.Unmount(dir, 0) }, nil
		})
		fuse.add(b, img, func(dir string) (func() error, error) {
			m, err := fuse2fs.Mount(ctx, img, dir, fuse2fs.Options{})
			if err != nil {
				return nil, err
			}
			return m.Unmount, nil
		})
	}
	n := float64(b.N)
	b.ReportMetric(kernel.mount.Seconds()*1e3/n, "kernel-mount-ms")
	b.ReportMetric(kernel.pack.Seconds()*1e3/n, "kernel-pack-ms")
	b.ReportMetric(fuse.mount.Seconds()*1e3/n, "fuse2fs-mount-ms")
	b.ReportMetric(fuse.pack.Seconds()*1e3/n, "fuse2fs-pack-ms")
	b.ReportMetric((fuse.mount+fuse.pack).Seconds()/(kernel.mount+kernel.pack).Seconds(), "fuse2fs/kernel")
}

// step sums the times of one way to mount: the mount, then the pack (with
// the unmount).
type step struct{ mount, pack time.Duration }

func (s *step) add(b *testing.B, img string, mount func(dir string) (func() error, error)) {
	dir, out := b.TempDir(), filepath.Join(b.TempDir(), "layer.erofs")
	// The image's pages are not cached, as a fresh clone's are not.
	if f, err := os.Open(img); err == nil {
		unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
		f.Close()
	}
	start := time.Now()
	unmount, err := mount(dir)
	if err != nil {
		b.Fatal(err)
	}
	s.mount += time.Since(start)
	start = time.Now()
	_, err = snapshot.Pack(context.Background(), snapshot.NewTree(filepath.Join(dir, "upper"), snapshot.MethodDiskClone, 0, nil), out, snapshot.PackOptions{})
	if uerr := unmount(); err == nil {
		err = uerr
	}
	if err != nil {
		b.Fatal(err)
	}
	s.pack += time.Since(start)
}
