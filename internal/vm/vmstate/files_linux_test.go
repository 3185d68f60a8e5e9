package vmstate

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// Clone copies a sparse file whole, its holes left holes (a RAM file is
// mostly holes), and refuses to overwrite.
func TestCloneSparse(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "memory")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	const size = 64 << 20
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	a, b := bytes.Repeat([]byte("a"), 1<<20), bytes.Repeat([]byte("b"), 4096)
	if _, err := f.WriteAt(a, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(b, 40<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()

	dst := filepath.Join(dir, "child")
	if err := Clone(src, dst); err != nil {
		t.Fatal(err)
	}
	want, _ := os.ReadFile(src)
	got, err := os.ReadFile(dst)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the clone differs from its source (%d bytes, %v)", len(got), err)
	}
	if n := allocatedBytes(dst); n > 8<<20 {
		t.Errorf("the clone of a file with 1 MiB of data takes %d bytes: its holes were filled", n)
	}
	if err := Clone(src, dst); err == nil {
		t.Error("Clone overwrote an existing file")
	}
}

// The page cache of a file is dropped once written back, and its
// residency read back.
func TestDropCache(t *testing.T) {
	path := filepath.Join(t.TempDir(), "memory")
	if err := os.WriteFile(path, bytes.Repeat([]byte("x"), 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	before, err := cachedBytes(path)
	if err != nil {
		t.Fatal(err)
	}
	spans, err := residentRanges(path)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, s := range spans {
		n += s.Len
	}
	if n != before {
		t.Errorf("resident ranges add up to %d bytes, cached %d", n, before)
	}
	if err := dropCache(path); err != nil {
		t.Fatal(err)
	}
	after, err := cachedBytes(path)
	if err != nil {
		t.Fatal(err)
	}
	if after >= before || after > 64<<10 {
		t.Errorf("cached before the drop %d bytes, after %d", before, after)
	}
}

// A state is saved once its meta is written, and Discard removes both.
func TestSavedDiscard(t *testing.T) {
	state := filepath.Join(t.TempDir(), "vmstate")
	if err := os.WriteFile(state, []byte("device state"), 0o600); err != nil {
		t.Fatal(err)
	}
	if Saved(state) {
		t.Error("a state file without its meta counts as saved")
	}
	if err := writeMeta(state, meta{ChannelConnected: true, Resident: []span{{0, 4096}}}); err != nil {
		t.Fatal(err)
	}
	m, err := readMeta(state)
	if err != nil || !m.ChannelConnected || len(m.Resident) != 1 || m.Resident[0] != (span{0, 4096}) {
		t.Errorf("readMeta = %+v, %v", m, err)
	}
	if !Saved(state) {
		t.Error("Saved is false with the meta written")
	}
	if err := Discard(state); err != nil {
		t.Fatal(err)
	}
	if Saved(state) || fileSize(state) != 0 {
		t.Error("Discard left the state")
	}
	if err := Discard(state); err != nil {
		t.Errorf("a second Discard: %v", err)
	}
}
