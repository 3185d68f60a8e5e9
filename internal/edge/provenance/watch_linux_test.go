package provenance

import (
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/testutil"
)

// TestWatcherOverlay: opens of a protected file and of a file in a
// protected dir, made by another process through an overlay mount, are
// recorded with the opener's name, by the path in the mount; an open of
// another file is not, nor one by the pid given as the agent.
func TestWatcherOverlay(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	lower, upper, work, merged := filepath.Join(dir, "lower"), filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "merged")
	for _, d := range []string{lower + "/hidden/sub", lower + "/work", upper, work, merged} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"hidden/sub/test_hidden.py", "work/sol.py", "answer.txt"} {
		if err := os.WriteFile(filepath.Join(lower, f), []byte("x\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mount("overlay", merged, "overlay", 0, "lowerdir="+lower+",upperdir="+upper+",workdir="+work); err != nil {
		t.Fatalf("mount overlay: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(merged, unix.MNT_DETACH) })

	w, err := NewWatcher(slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	unwatched, err := w.Watch("sb-1", merged, -1, []string{"/hidden", "/answer.txt", "/missing"})
	if err != nil || len(unwatched) != 1 {
		t.Fatalf("Watch: unwatched %v, %v; want /missing alone", unwatched, err)
	}
	// The shell opens each file itself and lives on a moment, so its name
	// is still there when the event is read.
	for _, f := range []string{"hidden/sub/test_hidden.py", "work/sol.py", "answer.txt"} {
		if out, err := exec.Command("sh", "-c", `read x < "$1"; sleep 0.3`, "sh", filepath.Join(merged, f)).CombinedOutput(); err != nil {
			t.Fatalf("read %s: %v %s", f, err, out)
		}
	}
	var reads []string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		reads = reads[:0]
		for _, r := range w.Reads("sb-1") {
			if r.GetCommand() != "sh" {
				t.Errorf("read of %s by %q, want sh", r.GetPath(), r.GetCommand())
			}
			reads = append(reads, r.GetPath())
		}
		if len(reads) == 2 {
			break
		}
	}
	if len(reads) != 2 || reads[0] != "/answer.txt" || reads[1] != "/hidden/sub/test_hidden.py" {
		t.Errorf("reads %v, want /answer.txt and /hidden/sub/test_hidden.py", reads)
	}
	w.Forget("sb-1")
	if got := w.Reads("sb-1"); len(got) != 0 {
		t.Errorf("reads after Forget: %v", got)
	}
}
