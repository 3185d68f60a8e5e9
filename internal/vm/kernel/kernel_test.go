package kernel

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	manifest := "# made by a test\nkernel 6.1.0-99-amd64\npackage linux-image-6.1.0-99-amd64=6.1.999-1\n" +
		"module virtio_ring\nmodule virtio\n\nfuture key\nmodule ext4\n"
	if err := os.WriteFile(filepath.Join(dir, "manifest"), []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	k, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := &Kernel{Dir: dir, Version: "6.1.0-99-amd64", Package: "linux-image-6.1.0-99-amd64=6.1.999-1",
		Modules: []string{"virtio_ring", "virtio", "ext4"}}
	if diff := cmp.Diff(want, k); diff != "" {
		t.Errorf("Load (-want +got):\n%s", diff)
	}
	if got := k.ModulePath("ext4"); got != filepath.Join(dir, "modules", "ext4.ko") {
		t.Errorf("ModulePath(ext4) = %s", got)
	}
}

func TestLoadRefuses(t *testing.T) {
	for name, manifest := range map[string]string{
		"no kernel line":  "module virtio\n",
		"module with dir": "kernel 6.1\nmodule ../../etc/passwd\n",
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, "manifest"), []byte(manifest), 0o644); err != nil {
				t.Fatal(err)
			}
			if k, err := Load(dir); err == nil {
				t.Errorf("Load = %+v, want an error", k)
			}
		})
	}
	if _, err := Load(t.TempDir()); err == nil {
		t.Error("Load of a directory without a manifest succeeded")
	}
}
