package snapshot

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

var (
	benchFiles = flag.Int("snapshot.files", 20000, "files in BenchmarkCapture's upper")
	benchBytes = flag.Int64("snapshot.bytes", 100<<20, "bytes of file content in BenchmarkCapture's upper")
)

// BenchmarkCapture captures an upper of -snapshot.files files holding
// -snapshot.bytes by each method, against `cp -a` of the same upper on the
// same file system in the same run (alternating), and packs the capture
// once. It reports milliseconds per capture and per cp -a, their ratio, the
// pack's mkfs.erofs and whole times, and the peak RSS of the test process
// and of mkfs.erofs. Run it with a fixed count, e.g.
//
//	DSEC_TEST_ROOT=1 go test ./internal/edge/snapshot -run '^$' -bench Capture -benchtime 3x
func BenchmarkCapture(b *testing.B) {
	needRoot(b)
	for _, m := range []struct {
		method Method
		fs     func(b *testing.B) (upperParent, captures string)
	}{
		{MethodBtrfs, func(b *testing.B) (string, string) {
			mnt := btrfsFS(b, benchFSBytes())
			return subvolume(b, filepath.Join(mnt, "sb-1")), mnt
		}},
		{MethodReflink, func(b *testing.B) (string, string) {
			mnt := btrfsFS(b, benchFSBytes())
			return filepath.Join(mnt, "plain"), mnt
		}},
		{MethodCopy, func(b *testing.B) (string, string) { return b.TempDir(), b.TempDir() }},
	} {
		b.Run(string(m.method), func(b *testing.B) {
			parent, captures := m.fs(b)
			upper := filepath.Join(parent, "upper")
			content := benchUpper(b, upper, *benchFiles, *benchBytes)
			ctx := context.Background()
			var capture, cp time.Duration
			var packed Packed
			b.ResetTimer()
			for i := range b.N {
				dst := filepath.Join(captures, "capture-"+strconv.Itoa(i))
				start := time.Now()
				tree, err := Capture(ctx, upper, dst)
				capture += time.Since(start)
				if err != nil {
					b.Fatal(err)
				}
				if tree.Method != m.method {
					b.Fatalf("captured by %s; want %s", tree.Method, m.method)
				}
				if i == 0 {
					b.StopTimer()
					out := filepath.Join(b.TempDir(), "snap.erofs")
					if packed, err = Pack(ctx, tree, out, PackOptions{}); err != nil {
						b.Fatal(err)
					}
					os.Remove(out)
					b.StartTimer()
				}
				if err := tree.Remove(); err != nil {
					b.Fatal(err)
				}
				syncFS(b, captures)

				cpDst := filepath.Join(captures, "cp-"+strconv.Itoa(i))
				start = time.Now()
				if out, err := exec.Command("cp", "-a", upper, cpDst).CombinedOutput(); err != nil {
					b.Fatalf("cp -a: %v: %s", err, out)
				}
				cp += time.Since(start)
				if err := os.RemoveAll(cpDst); err != nil {
					b.Fatal(err)
				}
				syncFS(b, captures)
			}
			b.StopTimer()
			n := float64(b.N)
			b.ReportMetric(float64(capture.Microseconds())/1e3/n, "capture-ms")
			b.ReportMetric(float64(cp.Microseconds())/1e3/n, "cp-a-ms")
			b.ReportMetric(float64(cp)/float64(capture), "cp/capture")
			b.ReportMetric(float64(packed.Build.Microseconds())/1e3, "mkfs-ms")
			b.ReportMetric(float64(packed.Took.Microseconds())/1e3, "pack-ms")
			b.ReportMetric(float64(content)/(1<<20), "upper-MiB")
			b.ReportMetric(float64(packed.Size)/(1<<20), "layer-MiB")
			var self, children unix.Rusage
			unix.Getrusage(unix.RUSAGE_SELF, &self)
			unix.Getrusage(unix.RUSAGE_CHILDREN, &children)
			b.ReportMetric(float64(self.Maxrss)/1024, "maxrss-MiB")
			b.ReportMetric(float64(children.Maxrss)/1024, "child-maxrss-MiB")
		})
	}
}

// benchFSBytes sizes a btrfs for the benchmark's upper and its copies.
func benchFSBytes() int64 { return max(1<<30, 4**benchBytes+int64(*benchFiles)*16<<10) }

// benchUpper writes files files holding size bytes in all under dir, a
// hundred to a directory, with sizes spread around the mean, syncs, and
// returns the bytes written.
func benchUpper(b *testing.B, dir string, files int, size int64) int64 {
	b.Helper()
	r := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(r.Uint32())
	}
	mean := size / int64(files)
	var written int64
	for i := range files {
		d := filepath.Join(dir, fmt.Sprintf("d%04d", i/100))
		if i%100 == 0 {
			if err := os.MkdirAll(d, 0o755); err != nil {
				b.Fatal(err)
			}
		}
		n := mean/2 + r.Int64N(mean+1)
		if i == files-1 {
			n = max(0, size-written)
		}
		n = min(n, int64(len(buf)))
		off := r.IntN(len(buf) - int(n) + 1)
		if err := os.WriteFile(filepath.Join(d, "f"+strconv.Itoa(i)), buf[off:off+int(n)], 0o644); err != nil {
			b.Fatal(err)
		}
		written += n
	}
	syncFS(b, dir)
	return written
}

// syncFS writes back the file system holding dir, so that one run's dirty
// data does not land on the next.
func syncFS(b *testing.B, dir string) {
	b.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		b.Fatal(err)
	}
}
