package initramfs

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"

	"dsec.dev/dsec/internal/vm/kernel"
)

// Cached returns the path of img's initramfs in dir, building it there
// first when no earlier call did. Every VM of a node boots the same
// initramfs while the agent and the kernel stay the same, so it is built
// once: its name is a digest of every input's contents, and it is written
// whole (a temporary file renamed), so concurrent callers and a crash leave
// no half-written image under that name.
func Cached(dir string, img Image) (string, error) {
	key, err := img.digest()
	if err != nil {
		return "", fmt.Errorf("build initramfs: %w", err)
	}
	path := filepath.Join(dir, "initrd-"+key[:32]+".cpio")
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("build initramfs: %w", err)
	}
	f, err := os.CreateTemp(dir, ".initrd-*")
	if err != nil {
		return "", fmt.Errorf("build initramfs: %w", err)
	}
	defer os.Remove(f.Name())
	err = Build(f, img)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", err
	}
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		return "", fmt.Errorf("build initramfs: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return "", fmt.Errorf("build initramfs: %w", err)
	}
	return path, nil
}

// digest is a SHA-256 of everything Build writes: names, modes, link
// targets and the files' contents.
func (img Image) digest() (string, error) {
	h := sha256.New()
	fmt.Fprintf(h, "dsec initramfs 3\n") // 2: modules without their signatures; 3: and without BTF
	files := []File{{Name: "init", Source: img.Init, Mode: 0o755}}
	if k := img.Kernel; k != nil {
		files = append(files, File{Name: kernel.GuestDir + "/manifest", Source: k.Manifest()})
		for _, m := range k.Modules {
			files = append(files, File{Name: kernel.GuestDir + "/modules/" + m, Source: k.ModulePath(m)})
		}
	}
	files = append(files, img.Files...)
	for _, f := range files {
		fmt.Fprintf(h, "file %q %o\n", f.Name, f.Mode)
		if err := hashFile(h, f.Source); err != nil {
			return "", err
		}
	}
	names := make([]string, 0, len(img.Symlinks))
	for name := range img.Symlinks {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		fmt.Fprintf(h, "link %q %q\n", name, img.Symlinks[name])
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func hashFile(w io.Writer, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := io.Copy(w, f)
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	fmt.Fprintf(w, "\n%d\n", n)
	return nil
}
