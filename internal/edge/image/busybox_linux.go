package image

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// busyboxPath is the static busybox (Debian's busybox-static) the tiny base copies.
const busyboxPath = "/bin/busybox"

// BuildBusyboxRootfs writes a tiny base root file system into dir (created if
// needed; it should be empty): /bin/busybox with a symlink for every applet,
// /etc/passwd and /etc/group with root and nobody (65534), and the usual
// directories (/tmp and /var/tmp 1777, /root 0700, /proc, /sys, /dev...).
// Every object gets mtime 0, so importing the tree always gives the same digest.
// scripts/build-busybox-base.sh builds the same tree.
func BuildBusyboxRootfs(dir string) error {
	out, err := exec.Command(busyboxPath, "--list").Output()
	if err != nil {
		return fmt.Errorf("build busybox rootfs: list applets of %s: %w", busyboxPath, err)
	}
	dirs := []struct {
		path string
		mode uint32
	}{
		{"", 0o755}, {"bin", 0o755}, {"sbin", 0o755}, {"usr", 0o755}, {"usr/bin", 0o755}, {"usr/sbin", 0o755},
		{"usr/lib", 0o755}, {"lib", 0o755}, {"etc", 0o755}, {"root", 0o700}, {"home", 0o755},
		{"tmp", 0o1777}, {"var", 0o755}, {"var/tmp", 0o1777}, {"run", 0o755},
		{"proc", 0o555}, {"sys", 0o555}, {"dev", 0o755},
	}
	for _, d := range dirs {
		p := filepath.Join(dir, d.path)
		if err := os.MkdirAll(p, 0o755); err != nil {
			return fmt.Errorf("build busybox rootfs: %w", err)
		}
		// unix.Chmod takes the raw mode, sticky bit included.
		if err := unix.Chmod(p, d.mode); err != nil {
			return fmt.Errorf("build busybox rootfs: %w", err)
		}
	}
	if err := copyFile(busyboxPath, filepath.Join(dir, "bin/busybox"), 0o755); err != nil {
		return fmt.Errorf("build busybox rootfs: %w", err)
	}
	files := map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
		"etc/group":  "root:x:0:\nnogroup:x:65534:\n",
		"etc/hosts":  "127.0.0.1\tlocalhost\n::1\tlocalhost\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			return fmt.Errorf("build busybox rootfs: %w", err)
		}
	}
	links := map[string]string{"usr/bin/env": "/bin/busybox"}
	for _, applet := range strings.Fields(string(out)) {
		if applet == "busybox" || strings.Contains(applet, "/") {
			continue
		}
		links["bin/"+applet] = "busybox"
	}
	for name, target := range links {
		p := filepath.Join(dir, name)
		if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
			return fmt.Errorf("build busybox rootfs: %w", err)
		}
		if err := os.Symlink(target, p); err != nil {
			return fmt.Errorf("build busybox rootfs: %w", err)
		}
	}
	err = filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if err := unix.Lchown(p, 0, 0); err != nil {
			return err
		}
		return unix.Lutimes(p, []unix.Timeval{{}, {}})
	})
	if err != nil {
		return fmt.Errorf("build busybox rootfs: %w", err)
	}
	return nil
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Chmod(dst, mode)
}
