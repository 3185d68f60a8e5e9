package swap

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

func TestParse(t *testing.T) {
	for in, want := range map[string]Config{
		"":                {},
		"none":            {},
		"file:64M":        {Kind: File, Size: 64 << 20},
		"zram:2G":         {Kind: Zram, Size: 2 << 30},
		"file:1073741824": {Kind: File, Size: 1 << 30},
	} {
		got, err := Parse(in)
		if err != nil || got != want {
			t.Errorf("Parse(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, bad := range []string{"disk:1G", "file", "file:", "file:-1G", "zram:1M", "file:lots"} {
		if _, err := Parse(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Parse(%q) = %v, want InvalidArgument", bad, err)
		}
	}
}

// provision turns swap on under a temp dir and removes it when the test
// ends, failing the test if it is left on.
func provision(t *testing.T, cfg Config) (*Swap, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "swap")
	t.Cleanup(func() {
		if err := Remove(dir); err != nil {
			t.Errorf("remove swap: %v", err)
		}
		if n, _ := Describe(dir); n.Own != "" {
			t.Errorf("swap %s still on after Remove", n.Own)
		}
	})
	s, err := Provision(context.Background(), dir, cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	return s, dir
}

func TestSwapFile(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "mkswap")
	before, err := Describe("")
	if err != nil {
		t.Fatal(err)
	}
	s, dir := provision(t, Config{Kind: File, Size: 32 << 20})
	n, err := Describe(dir)
	if err != nil {
		t.Fatal(err)
	}
	if n.Own != s.Path() || n.Total-before.Total < 31<<20 {
		t.Fatalf("after Provision: %+v (before %+v), want our %s of 32 MiB", n, before, s.Path())
	}
	// A restarted edge adopts the swap that is on.
	again, err := Provision(context.Background(), dir, Config{Kind: File, Size: 32 << 20}, slog.New(slog.DiscardHandler))
	if err != nil || again.Path() != s.Path() {
		t.Fatalf("Provision again: %v, %v", again, err)
	}
	if n2, _ := Describe(dir); n2.Total != n.Total {
		t.Fatalf("a second Provision added swap: %+v then %+v", n, n2)
	}
	if err := Remove(dir); err != nil {
		t.Fatal(err)
	}
	if after, _ := Describe(dir); after.Own != "" || after.Total != before.Total {
		t.Fatalf("after Remove: %+v, want %+v", after, before)
	}
	if _, err := os.Stat(s.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("swap file left: %v", err)
	}
}

func TestSwapZram(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "mkswap")
	if _, err := os.Stat("/sys/class/zram-control"); err != nil {
		testutil.Require(t, false, "the kernel has no zram")
	}
	s, dir := provision(t, Config{Kind: Zram, Size: 32 << 20})
	n, err := Describe(dir)
	if err != nil {
		t.Fatal(err)
	}
	if n.Own != s.Path() {
		t.Fatalf("after Provision: %+v, want our %s", n, s.Path())
	}
	dev := filepath.Base(s.Path())
	if err := Remove(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat("/sys/block/" + dev); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("zram device %s left after Remove: %v", dev, err)
	}
}

func TestSwapFileRefusedOnTmpfs(t *testing.T) {
	testutil.RequireRoot(t)
	dir, err := os.MkdirTemp("/dev/shm", "dsec-swap-test-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	_, err = Provision(context.Background(), dir, Config{Kind: File, Size: 32 << 20}, slog.New(slog.DiscardHandler))
	if !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("swap file on tmpfs: %v, want FailedPrecondition naming zram", err)
	}
	if _, err := os.Stat(filepath.Join(dir, fileName)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a refused swap file was left: %v", err)
	}
}
