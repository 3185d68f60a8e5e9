package initramfs

import (
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/vm/kernel"
)

// TestEntryBytes checks one entry against the newc format byte for byte.
func TestEntryBytes(t *testing.T) {
	var buf bytes.Buffer
	w := NewWriter(&buf)
	if err := w.File("a", 0o644, strings.NewReader("hi"), 2); err != nil {
		t.Fatal(err)
	}
	want := "070701" + "00000001" + "000081A4" + "00000000" + "00000000" + "00000001" + "00000000" +
		"00000002" + "00000000" + "00000000" + "00000000" + "00000000" + "00000002" + "00000000" +
		"a\x00" + "hi\x00\x00"
	if got := buf.String(); got != want {
		t.Errorf("entry:\n got %q\nwant %q", got, want)
	}
}

// entry is one entry of an archive, as read back.
type entry struct {
	Name string
	Mode uint32
	Data string
}

// readArchive parses a newc archive, checking its alignment and trailer.
func readArchive(t *testing.T, b []byte) []entry {
	t.Helper()
	var out []entry
	off := 0
	align := func() { off = (off + 3) &^ 3 }
	for {
		if off+headerSize > len(b) || string(b[off:off+6]) != magic {
			t.Fatalf("no newc header at offset %d", off)
		}
		field := func(i int) int {
			v, err := strconv.ParseUint(string(b[off+6+8*i:off+14+8*i]), 16, 32)
			if err != nil {
				t.Fatalf("header at %d, field %d: %v", off, i, err)
			}
			return int(v)
		}
		mode, size, namesize := field(1), field(6), field(11)
		name := string(b[off+headerSize : off+headerSize+namesize-1])
		if b[off+headerSize+namesize-1] != 0 {
			t.Fatalf("name %q is not NUL-terminated", name)
		}
		off += headerSize + namesize
		align()
		if name == trailer {
			if off != len(b) {
				t.Errorf("%d bytes after the trailer", len(b)-off)
			}
			return out
		}
		out = append(out, entry{Name: name, Mode: uint32(mode), Data: string(b[off : off+size])})
		off += size
		align()
	}
}

func TestBuild(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string, mode fs.FileMode) string {
		p := filepath.Join(dir, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	agent := write("dsec-agent", "agent binary", 0o755)
	write("kernel/manifest", "kernel 6.1.0-99-amd64\nmodule virtio\nmodule ext4\n", 0o644)
	write("kernel/modules/virtio.ko", "virtio module", 0o644)
	write("kernel/modules/ext4.ko", "ext4 module", 0o644)
	busybox := write("busybox", "busybox binary", 0o755)
	k, err := kernel.Load(filepath.Join(dir, "kernel"))
	if err != nil {
		t.Fatal(err)
	}

	var buf bytes.Buffer
	err = Build(&buf, Image{
		Init:     agent,
		Kernel:   k,
		Files:    []File{{Name: "/bin/busybox", Source: busybox}},
		Symlinks: map[string]string{"/bin/sh": "busybox", "/bin/echo": "busybox"},
	})
	if err != nil {
		t.Fatal(err)
	}
	got := readArchive(t, buf.Bytes())
	dirMode := func(perm uint32) uint32 { return modeDir | perm }
	want := []entry{
		{"dev", dirMode(0o755), ""}, {"proc", dirMode(0o755), ""}, {"sys", dirMode(0o755), ""},
		{"tmp", dirMode(0o1777), ""}, {"run", dirMode(0o755), ""}, {"root", dirMode(0o755), ""}, {"etc", dirMode(0o755), ""},
		{"init", modeReg | 0o755, "agent binary"},
		{".dsec", dirMode(0o755), ""}, {".dsec/kernel", dirMode(0o755), ""},
		{".dsec/kernel/manifest", modeReg | 0o644, "kernel 6.1.0-99-amd64\nmodule virtio\nmodule ext4\n"},
		{".dsec/kernel/modules", dirMode(0o755), ""},
		{".dsec/kernel/modules/virtio.ko", modeReg | 0o644, "virtio module"},
		{".dsec/kernel/modules/ext4.ko", modeReg | 0o644, "ext4 module"},
		{"bin", dirMode(0o755), ""},
		{"bin/busybox", modeReg | 0o755, "busybox binary"},
		{"bin/echo", modeLink | 0o777, "busybox"},
		{"bin/sh", modeLink | 0o777, "busybox"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("archive (-want +got):\n%s", diff)
	}
}

func TestBuildRefuses(t *testing.T) {
	for name, img := range map[string]Image{
		"missing init":  {Init: filepath.Join(t.TempDir(), "nothing")},
		"escaping name": {Init: os.Args[0], Files: []File{{Name: "../etc/passwd", Source: os.Args[0]}}},
		"directory":     {Init: t.TempDir()},
	} {
		t.Run(name, func(t *testing.T) {
			if err := Build(&bytes.Buffer{}, img); err == nil {
				t.Error("Build succeeded")
			}
		})
	}
}

func TestCached(t *testing.T) {
	src := t.TempDir()
	agent := filepath.Join(src, "dsec-agent")
	if err := os.WriteFile(agent, []byte("agent v1"), 0o755); err != nil {
		t.Fatal(err)
	}
	cache := filepath.Join(t.TempDir(), "initramfs")
	img := Image{Init: agent, Symlinks: map[string]string{"/bin/sh": "busybox"}}
	first, err := Cached(cache, img)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(first)
	if err != nil {
		t.Fatal(err)
	}
	held := false
	for _, e := range readArchive(t, b) {
		held = held || e.Name == "init" && e.Data == "agent v1"
	}
	if !held {
		t.Error("the cached image has no /init holding the agent")
	}
	fi, _ := os.Stat(first)
	again, err := Cached(cache, img)
	if err != nil || again != first {
		t.Fatalf("the same image again: %s, %v; want %s", again, err, first)
	}
	if fi2, _ := os.Stat(again); !fi2.ModTime().Equal(fi.ModTime()) {
		t.Error("the same image was written again")
	}
	// A new agent is a new image.
	if err := os.WriteFile(agent, []byte("agent v2"), 0o755); err != nil {
		t.Fatal(err)
	}
	second, err := Cached(cache, img)
	if err != nil || second == first {
		t.Fatalf("a changed agent: %s, %v; want a path other than %s", second, err, first)
	}
	entries, _ := os.ReadDir(cache)
	if len(entries) != 2 {
		t.Errorf("the cache holds %d files, want the 2 images and no temporary file", len(entries))
	}
}
