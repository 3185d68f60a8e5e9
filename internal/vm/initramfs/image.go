package initramfs

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"

	"dsec.dev/dsec/internal/vm/kernel"
)

// Image is what a guest's initramfs holds.
type Image struct {
	// Init is the host path of the guest's /init: dsec-agent, whose guest
	// mode (package agent/guest) is the VM's pid 1.
	Init string
	// Kernel's modules and manifest go under kernel.GuestDir; nil for
	// none.
	Kernel *kernel.Kernel
	// Files are more host files to copy in.
	Files []File
	// Symlinks are more links, name -> target.
	Symlinks map[string]string
}

// File is a host file copied into the image.
type File struct {
	Name   string      // path in the guest
	Source string      // path on the host
	Mode   fs.FileMode // permissions (0 = the source's)

	module bool // a kernel module: copied without its signature and BTF
}

// Build writes img's initramfs to w: /init, the modules, the files and
// links, and the directories they need. The kernel makes /dev/console
// itself when the image lacks it (devtmpfs is mounted by init).
func Build(w io.Writer, img Image) error {
	cw := NewWriter(w)
	dirs := map[string]bool{}
	mkdirs := func(name string) error {
		var parents []string
		for d := path.Dir(strings.TrimPrefix(name, "/")); d != "." && !dirs[d]; d = path.Dir(d) {
			parents = append(parents, d)
			dirs[d] = true
		}
		slices.Reverse(parents)
		for _, d := range parents {
			if err := cw.Dir(d, 0o755); err != nil {
				return err
			}
		}
		return nil
	}
	// The mount points init uses, and /etc for the agent's host files.
	for _, d := range []string{"dev", "proc", "sys", "tmp", "run", "root", "etc"} {
		dirs[d] = true
		perm := fs.FileMode(0o755)
		if d == "tmp" {
			perm = 0o777 | fs.ModeSticky
		}
		if err := cw.Dir(d, perm); err != nil {
			return fmt.Errorf("build initramfs: %w", err)
		}
	}
	files := []File{{Name: "init", Source: img.Init, Mode: 0o755}}
	if k := img.Kernel; k != nil {
		files = append(files, File{Name: path.Join(kernel.GuestDir, "manifest"), Source: k.Manifest(), Mode: 0o644})
		for _, m := range k.Modules {
			files = append(files, File{Name: path.Join(kernel.GuestDir, "modules", m+".ko"), Source: k.ModulePath(m), Mode: 0o644, module: true})
		}
	}
	files = append(files, img.Files...)
	for _, f := range files {
		if err := mkdirs(f.Name); err != nil {
			return fmt.Errorf("build initramfs: %w", err)
		}
		if err := copyIn(cw, f); err != nil {
			return fmt.Errorf("build initramfs: %w", err)
		}
	}
	names := make([]string, 0, len(img.Symlinks))
	for name := range img.Symlinks {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if err := mkdirs(name); err != nil {
			return fmt.Errorf("build initramfs: %w", err)
		}
		if err := cw.Symlink(name, img.Symlinks[name]); err != nil {
			return fmt.Errorf("build initramfs: %w", err)
		}
	}
	if err := cw.Close(); err != nil {
		return fmt.Errorf("build initramfs: %w", err)
	}
	return nil
}

func copyIn(cw *Writer, f File) error {
	src, err := os.Open(f.Source)
	if err != nil {
		return fmt.Errorf("add %s: %w", f.Name, err)
	}
	defer src.Close()
	fi, err := src.Stat()
	if err != nil {
		return fmt.Errorf("add %s: %w", f.Name, err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("add %s: %s is not a regular file", f.Name, f.Source)
	}
	mode := f.Mode
	if mode == 0 {
		mode = fi.Mode().Perm()
	}
	if f.module {
		b, err := io.ReadAll(src)
		if err != nil {
			return fmt.Errorf("add %s: %w", f.Name, err)
		}
		b = StripModuleBTF(StripModuleSignature(b))
		return cw.File(f.Name, mode, bytes.NewReader(b), int64(len(b)))
	}
	return cw.File(f.Name, mode, src, fi.Size())
}

// moduleSigMagic ends a signed kernel module: the signature, then a
// struct module_signature (12 bytes, the signature's length big-endian in
// its last four), then the magic.
const moduleSigMagic = "~Module signature appended~\n"

// StripModuleSignature is module b without its appended signature (b
// itself when it has none). The guest kernel (Debian's) checks a signed
// module's signature on every load, a SHA-256 of the whole module that
// under TCG cost a third of the modules' load time (ext4's 2 MiB alone
// ~60 ms); it does not enforce signatures, so an unsigned module loads
// without the check (and taints the kernel "E", which nothing of ours
// reads).
func StripModuleSignature(b []byte) []byte {
	if !bytes.HasSuffix(b, []byte(moduleSigMagic)) {
		return b
	}
	end := len(b) - len(moduleSigMagic)
	if end < 12 {
		return b
	}
	sigLen := int(binary.BigEndian.Uint32(b[end-4 : end]))
	if sigLen > end-12 {
		return b
	}
	return b[:end-12-sigLen]
}

// StripModuleBTF is module b (an ELF64 little-endian relocatable object,
// as the guest kernel's are) with its .BTF section emptied, b itself when
// it has none or is not such an object. The guest kernel (Debian's, with
// CONFIG_DEBUG_INFO_BTF_MODULES) parses and checks every module's BTF type
// information as it loads it, only for BPF programs that trace the
// module's functions; under TCG that check is a part of every module's
// load (ext4's BTF is 139 KiB). An empty .BTF section is one the kernel
// skips. Its bytes are cut out too, less what the file's alignments keep.
func StripModuleBTF(b []byte) []byte {
	le := binary.LittleEndian
	const ehdrSize, shdrSize = 64, 64
	if len(b) < ehdrSize || string(b[:4]) != "\x7fELF" || b[4] != 2 || b[5] != 1 ||
		le.Uint16(b[0x10:]) != 1 || le.Uint16(b[0x3a:]) != shdrSize {
		return b
	}
	shoff, shnum, shstrndx := le.Uint64(b[0x28:]), uint64(le.Uint16(b[0x3c:])), uint64(le.Uint16(b[0x3e:]))
	if shstrndx >= shnum || shoff > uint64(len(b)) || shnum*shdrSize > uint64(len(b))-shoff {
		return b
	}
	shdr := func(i uint64) []byte { return b[shoff+i*shdrSize : shoff+(i+1)*shdrSize] }
	strOff, strSize := le.Uint64(shdr(shstrndx)[24:]), le.Uint64(shdr(shstrndx)[32:])
	if strOff > uint64(len(b)) || strSize > uint64(len(b))-strOff {
		return b
	}
	strtab := b[strOff : strOff+strSize]
	name := func(i uint64) string {
		n := uint64(le.Uint32(shdr(i)))
		if n >= uint64(len(strtab)) {
			return ""
		}
		s := strtab[n:]
		if end := bytes.IndexByte(s, 0); end >= 0 {
			s = s[:end]
		}
		return string(s)
	}
	btf := uint64(0)
	align := uint64(8) // the section header table's
	for i := uint64(1); i < shnum; i++ {
		if name(i) == ".BTF" {
			btf = i
		}
		align = max(align, le.Uint64(shdr(i)[48:]))
	}
	if btf == 0 {
		return b
	}
	off, size := le.Uint64(shdr(btf)[24:]), le.Uint64(shdr(btf)[32:])
	if off > uint64(len(b)) || size > uint64(len(b))-off || align&(align-1) != 0 {
		return b
	}
	cut := size &^ (align - 1)
	// No section may lie in the cut but an empty one at its start.
	for i := uint64(1); i < shnum; i++ {
		o, sz := le.Uint64(shdr(i)[24:]), le.Uint64(shdr(i)[32:])
		if i != btf && le.Uint32(shdr(i)[4:]) != uint32(elfNobits) && o < off+size && o+sz > off && sz > 0 {
			return b
		}
	}
	if shoff > off && shoff < off+size {
		return b
	}
	out := append(append(make([]byte, 0, uint64(len(b))-cut), b[:off]...), b[off+cut:]...)
	shift := func(o uint64) uint64 {
		if o >= off+cut {
			return o - cut
		}
		if o > off {
			return off
		}
		return o
	}
	newShoff := shift(shoff)
	le.PutUint64(out[0x28:], newShoff)
	for i := uint64(1); i < shnum; i++ {
		h := out[newShoff+i*shdrSize : newShoff+(i+1)*shdrSize]
		le.PutUint64(h[24:], shift(le.Uint64(h[24:])))
		if i == btf {
			le.PutUint64(h[32:], 0)
		}
	}
	return out
}

// elfNobits is SHT_NOBITS: a section without bytes in the file (.bss).
const elfNobits = 8
