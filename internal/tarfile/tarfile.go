// Package tarfile writes the files of a local tree into tar streams. It is
// the one place that turns a file's metadata into a tar header and copies
// its content, for publishing layers, the storage benchmark's OCI images,
// `dsec cp` and tests.
package tarfile

import (
	"archive/tar"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
)

// WriteEntry writes the file at path, which info describes (as from
// os.Lstat), into tw under name. The header comes from info: a symlink's
// target is read, owner names are dropped (numeric ids stay), and a
// directory's name ends in a slash. edit, when not nil, may change the
// header before it is written. A regular file's content follows, unless
// edit made the entry something else (a hard link, say).
func WriteEntry(tw *tar.Writer, path, name string, info fs.FileInfo, edit func(*tar.Header)) error {
	link := ""
	if info.Mode()&fs.ModeSymlink != 0 {
		var err error
		if link, err = os.Readlink(path); err != nil {
			return fmt.Errorf("read link %s: %w", path, err)
		}
	}
	hdr, err := tar.FileInfoHeader(info, link)
	if err != nil {
		return fmt.Errorf("tar header of %s: %w", path, err)
	}
	hdr.Name = filepath.ToSlash(name)
	if info.IsDir() {
		hdr.Name += "/"
	}
	hdr.Uname, hdr.Gname = "", ""
	if edit != nil {
		edit(hdr)
	}
	if err := tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("write tar header of %s: %w", path, err)
	}
	if hdr.Typeflag != tar.TypeReg || !info.Mode().IsRegular() {
		return nil
	}
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := io.Copy(tw, f); err != nil {
		return fmt.Errorf("write %s into the archive: %w", path, err)
	}
	return nil
}
