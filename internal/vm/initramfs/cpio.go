// Package initramfs builds a microVM's initramfs: a cpio archive in the
// kernel's "newc" format (Writer), and the guest's image in it (Build):
// dsec-agent as /init, the kernel's modules with their manifest (package
// kernel) and the files the caller adds. The archive is left uncompressed:
// the kernel unpacks it without decompressing, which under TCG is the
// cheapest.
package initramfs

import (
	"fmt"
	"io"
	"io/fs"
	"path"
	"strings"
)

// newc's header: the magic and thirteen 8-digit hexadecimal fields.
const (
	magic      = "070701"
	headerSize = 110
	trailer    = "TRAILER!!!"
)

// Writer writes a newc cpio archive. Entries are written as they are
// added; Close writes the trailer. Names are relative to the archive's
// root ("init", "lib/modules"); every directory must be added before what
// it holds.
type Writer struct {
	w   io.Writer
	off int64
	ino uint32
	err error
}

// NewWriter returns a Writer to w.
func NewWriter(w io.Writer) *Writer { return &Writer{w: w} }

// Dir adds a directory.
func (w *Writer) Dir(name string, perm fs.FileMode) error {
	return w.entry(name, modeDir|permBits(perm), nil, 0)
}

// File adds a regular file of size bytes read from r.
func (w *Writer) File(name string, perm fs.FileMode, r io.Reader, size int64) error {
	return w.entry(name, modeReg|permBits(perm), r, size)
}

// Symlink adds a symbolic link to target.
func (w *Writer) Symlink(name, target string) error {
	return w.entry(name, modeLink|0o777, strings.NewReader(target), int64(len(target)))
}

// Close writes the trailer. It does not close the underlying writer.
func (w *Writer) Close() error {
	if w.err != nil {
		return w.err
	}
	if err := w.header(trailer, 0, 0); err != nil {
		return err
	}
	return w.err
}

// permBits is perm as stat(2)'s permission bits, setuid, setgid and
// sticky included.
func permBits(perm fs.FileMode) uint32 {
	bits := uint32(perm.Perm())
	if perm&fs.ModeSetuid != 0 {
		bits |= 0o4000
	}
	if perm&fs.ModeSetgid != 0 {
		bits |= 0o2000
	}
	if perm&fs.ModeSticky != 0 {
		bits |= 0o1000
	}
	return bits
}

// The file type bits of a cpio mode (those of stat(2)).
const (
	modeDir  = 0o040000
	modeReg  = 0o100000
	modeLink = 0o120000
)

func (w *Writer) entry(name string, mode uint32, r io.Reader, size int64) error {
	if w.err != nil {
		return w.err
	}
	clean := path.Clean(strings.TrimPrefix(name, "/"))
	if clean == "." || clean == ".." || strings.HasPrefix(clean, "../") || clean == trailer {
		w.err = fmt.Errorf("write cpio entry %q: not a name in the archive", name)
		return w.err
	}
	if size < 0 || size > 0xffffffff {
		w.err = fmt.Errorf("write cpio entry %s: size %d does not fit newc's 32 bits", clean, size)
		return w.err
	}
	if err := w.header(clean, mode, size); err != nil {
		return err
	}
	if size > 0 {
		n, err := io.CopyN(w.w, r, size)
		w.off += n
		if err != nil {
			w.err = fmt.Errorf("write cpio entry %s: %w", clean, err)
			return w.err
		}
	}
	return w.pad()
}

// header writes an entry's header and name, padded.
func (w *Writer) header(name string, mode uint32, size int64) error {
	nlink := uint32(1)
	if mode&0o170000 == modeDir {
		nlink = 2
	}
	var ino uint32
	if name != trailer {
		w.ino++
		ino = w.ino
	}
	fields := []uint32{
		ino, mode, 0, 0, nlink, 0, // ino, mode, uid, gid, nlink, mtime
		uint32(size),
		0, 0, 0, 0, // devmajor, devminor, rdevmajor, rdevminor
		uint32(len(name) + 1), // namesize, with its NUL
		0,                     // check
	}
	var b strings.Builder
	b.WriteString(magic)
	for _, f := range fields {
		fmt.Fprintf(&b, "%08X", f)
	}
	b.WriteString(name)
	b.WriteByte(0)
	n, err := io.WriteString(w.w, b.String())
	w.off += int64(n)
	if err != nil {
		w.err = fmt.Errorf("write cpio header %s: %w", name, err)
		return w.err
	}
	return w.pad()
}

// pad aligns the archive to 4 bytes, as newc's headers and data are.
func (w *Writer) pad() error {
	if r := w.off % 4; r != 0 {
		n, err := w.w.Write(make([]byte, 4-r))
		w.off += int64(n)
		if err != nil {
			w.err = fmt.Errorf("write cpio padding: %w", err)
			return w.err
		}
	}
	return nil
}
