// Package kernel reads a microVM guest kernel directory, as
// scripts/build-vm-kernel.sh makes it: the uncompressed kernel (vmlinux),
// the guest's modules (modules/NAME.ko) and a manifest naming the kernel's
// version and the order in which the guest loads the modules. The host
// boots vmlinux and packs the modules into the guest's initramfs (package
// initramfs) under GuestDir, with the manifest, so the guest's init reads
// the same directory format.
package kernel

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// GuestDir is where the initramfs holds the manifest and the modules.
const GuestDir = "/.dsec/kernel"

// DefaultDir is where scripts/build-vm-kernel.sh puts the guest kernel by
// default.
const DefaultDir = "/var/cache/dsec/vm-kernel"

// Kernel is one guest kernel directory.
type Kernel struct {
	Dir     string
	Version string   // uname -r of the guest
	Package string   // the Debian package it came from, NAME=VERSION
	Modules []string // module names, in load order
}

// Load reads the manifest of the kernel directory dir. It does not require
// vmlinux: the guest reads its own copy of the directory, without it.
func Load(dir string) (*Kernel, error) {
	f, err := os.Open(filepath.Join(dir, "manifest"))
	if err != nil {
		return nil, fmt.Errorf("read kernel manifest: %w", err)
	}
	defer f.Close()
	k := &Kernel{Dir: dir}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		key, value, _ := strings.Cut(line, " ")
		value = strings.TrimSpace(value)
		switch key {
		case "kernel":
			k.Version = value
		case "package":
			k.Package = value
		case "module":
			if value == "" || strings.ContainsAny(value, "/ ") {
				return nil, fmt.Errorf("read kernel manifest %s line %d: bad module name %q", f.Name(), n, value)
			}
			k.Modules = append(k.Modules, value)
		default:
			// Later keys are for later readers.
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read kernel manifest %s: %w", f.Name(), err)
	}
	if k.Version == "" {
		return nil, fmt.Errorf("read kernel manifest %s: no kernel line", f.Name())
	}
	return k, nil
}

// Vmlinux is the path of the kernel image the host boots.
func (k *Kernel) Vmlinux() string { return filepath.Join(k.Dir, "vmlinux") }

// Manifest is the path of the manifest.
func (k *Kernel) Manifest() string { return filepath.Join(k.Dir, "manifest") }

// ModulePath is the path of module name's file.
func (k *Kernel) ModulePath(name string) string {
	return filepath.Join(k.Dir, "modules", name+".ko")
}
