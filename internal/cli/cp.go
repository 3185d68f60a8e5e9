package cli

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/tarfile"
)

func (a *app) cpCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "cp SRC DST",
		Short: "copy files in or out: `cp LOCAL ID:DIR` or `cp ID:PATH LOCALDIR`",
		Long: "Copies a file or directory into or out of a sandbox. LOCAL is copied into the sandbox's\n" +
			"directory DIR (made if missing) under its own name; ID:PATH is copied into LOCALDIR under its own name.",
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			srcID, srcPath, srcRemote := splitRemote(args[0])
			dstID, dstPath, dstRemote := splitRemote(args[1])
			switch {
			case srcRemote && !dstRemote:
				return a.download(cmd, srcID, srcPath, args[1])
			case !srcRemote && dstRemote:
				return a.upload(cmd, args[0], dstID, dstPath)
			default:
				return fmt.Errorf("exactly one of SRC and DST must be ID:PATH")
			}
		},
	}
}

// splitRemote recognises ID:PATH where ID is a sandbox ID.
func splitRemote(s string) (id, p string, ok bool) {
	id, p, ok = strings.Cut(s, ":")
	if !ok || !strings.HasPrefix(id, "sb-") {
		return "", "", false
	}
	return id, p, true
}

func (a *app) upload(cmd *cobra.Command, local, id, dir string) error {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	base := filepath.Dir(filepath.Clean(local))
	err := filepath.WalkDir(local, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := os.Lstat(p)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(base, p)
		if err != nil {
			return err
		}
		return tarfile.WriteEntry(tw, p, rel, info, nil)
	})
	if err != nil {
		return fmt.Errorf("pack %s: %w", local, err)
	}
	if err := tw.Close(); err != nil {
		return err
	}
	resp, err := a.c.Sandboxes.Upload(cmd.Context(), connect.NewRequest(&dsecv1.UploadRequest{SandboxId: id, Path: dir, Tar: buf.Bytes()}))
	if err != nil {
		return err
	}
	if a.json {
		return a.printProto(resp.Msg)
	}
	return nil
}

func (a *app) download(cmd *cobra.Command, id, remote, localDir string) error {
	stream, err := a.c.Sandboxes.Download(cmd.Context(), connect.NewRequest(&dsecv1.DownloadRequest{SandboxId: id, Path: remote}))
	if err != nil {
		return err
	}
	defer stream.Close()
	pr, pw := io.Pipe()
	go func() {
		for stream.Receive() {
			if _, err := pw.Write(stream.Msg().GetData()); err != nil {
				return
			}
		}
		pw.CloseWithError(stream.Err())
	}()
	err = extractTar(pr, localDir)
	pr.CloseWithError(err)
	return err
}

// extractTar unpacks r into dir, refusing names that leave dir and never
// writing through a symlink.
func extractTar(r io.Reader, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read archive: %w", err)
		}
		name := path.Clean(hdr.Name)
		if path.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") {
			return fmt.Errorf("archive entry %q leaves the target directory", hdr.Name)
		}
		target := filepath.Join(dir, filepath.FromSlash(name))
		if err := noSymlinkParents(dir, name); err != nil {
			return err
		}
		mode := fs.FileMode(hdr.Mode) & fs.ModePerm
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(target, mode|0o700); err != nil {
				return err
			}
		case tar.TypeReg:
			os.Remove(target)
			f, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY|os.O_EXCL, mode)
			if err != nil {
				return err
			}
			_, err = io.Copy(f, tr)
			f.Close()
			if err != nil {
				return err
			}
		case tar.TypeSymlink:
			os.Remove(target)
			if err := os.Symlink(hdr.Linkname, target); err != nil {
				return err
			}
		default:
			// Devices, fifos and hard links are not copied out.
		}
	}
}

func noSymlinkParents(dir, name string) error {
	cur := dir
	parts := strings.Split(name, "/")
	for _, p := range parts[:len(parts)-1] {
		cur = filepath.Join(cur, p)
		fi, err := os.Lstat(cur)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			return fmt.Errorf("archive entry %q would be written through the symlink %s", name, cur)
		}
	}
	return nil
}
