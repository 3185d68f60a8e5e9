package call

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestSettle: a fncall container started at a raised CPU weight is back at
// the default once its agent settles, on cgroup v1 (cpu.shares) and v2
// (cpu.weight) alike.
func TestSettle(t *testing.T) {
	for _, c := range []struct{ file, start, want string }{
		{"cpu.shares", "8192", "1024"},
		{"cpu.weight", "800", "100"},
	} {
		t.Run(c.file, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, c.file), []byte(c.start), 0o644); err != nil {
				t.Fatal(err)
			}
			fd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			if err := New(Config{CPUFD: fd}).Settle(); err != nil {
				t.Fatal(err)
			}
			if got, _ := os.ReadFile(filepath.Join(dir, c.file)); string(got) != c.want {
				t.Errorf("%s after Settle: %q, want %q", c.file, got, c.want)
			}
		})
	}
	if err := New(Config{CPUFD: -1}).Settle(); err != nil {
		t.Errorf("no cpu cgroup: %v", err)
	}
}
