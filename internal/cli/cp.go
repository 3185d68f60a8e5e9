package cli

import (
	"archive/tar"
	"bytes"
	"context"
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
		Short: "copy files in or out: `cp LOCAL ID:PATH` or `cp ID:PATH LOCAL`",
		Long: `Copies a file or directory between this machine and a sandbox. One of SRC and DST
is ID:PATH (a relative PATH is taken from the sandbox's working directory). As with
docker cp:
  - when DST is an existing directory, or ends in /, SRC is copied into it under its
    own name (DST is made if missing);
  - otherwise SRC is copied as DST: a file replaces the file DST, a directory becomes
    DST (a directory never replaces a file);
  - when SRC is a directory and ends in /., its contents are copied, not itself;
  - LOCAL - reads a tar archive from stdin, extracted into the directory DST, or
    writes SRC as a tar archive to stdout.`,
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

// splitRemote recognises ID:PATH where ID is a sandbox ID. An empty PATH is
// the sandbox's working directory.
func splitRemote(s string) (id, p string, ok bool) {
	id, p, ok = strings.Cut(s, ":")
	if !ok || !strings.HasPrefix(id, "sb-") {
		return "", "", false
	}
	if p == "" {
		p = "."
	}
	return id, p, true
}

// contentsOf reports whether p names a directory's contents: it ends in "/.".
func contentsOf(p string) bool {
	return strings.HasSuffix(p, "/.") || p == "."
}

// remoteType returns the type of p in the sandbox ("file", "dir", "symlink",
// "other"), or "" when p does not exist.
func (a *app) remoteType(ctx context.Context, id, p string) (string, error) {
	resp, err := a.c.Sandboxes.Stat(ctx, connect.NewRequest(&dsecv1.StatRequest{SandboxId: id, Path: p}))
	if connect.CodeOf(err) == connect.CodeNotFound {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	return resp.Msg.GetInfo().GetType(), nil
}

func (a *app) upload(cmd *cobra.Command, local, id, dst string) error {
	ctx := cmd.Context()
	if local == "-" {
		data, err := io.ReadAll(a.stdin)
		if err != nil {
			return fmt.Errorf("read the archive from stdin: %w", err)
		}
		return a.sendTar(cmd, id, dst, data)
	}
	info, err := os.Lstat(local)
	if err != nil {
		return err
	}
	kind, err := a.remoteType(ctx, id, dst)
	if err != nil {
		return err
	}
	// dir is where the archive is extracted; name is what local is called
	// there ("" when its contents go in directly).
	var dir, name string
	switch {
	case kind == "symlink":
		return fmt.Errorf("%s:%s is a symlink; name the directory it points to", id, dst)
	case kind != "" && kind != "dir" && (info.IsDir() || strings.HasSuffix(dst, "/")):
		return fmt.Errorf("cannot copy %s over %s:%s, which is not a directory", local, id, dst)
	case info.IsDir() && contentsOf(local):
		dir = dst
	case kind == "dir" || strings.HasSuffix(dst, "/"):
		dir, name = dst, filepath.Base(filepath.Clean(local))
	default:
		dir, name = path.Dir(path.Clean(dst)), path.Base(path.Clean(dst))
	}
	data, err := packTree(local, name)
	if err != nil {
		return err
	}
	return a.sendTar(cmd, id, dir, data)
}

// packTree packs local (a file or a directory tree) as a tar archive whose
// entries are under name ("": local's contents at the top).
func packTree(local, name string) ([]byte, error) {
	var buf bytes.Buffer
	if err := writeTree(&buf, local, name); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// writeTree writes local as packTree packs it, to w, as it walks.
func writeTree(w io.Writer, local, name string) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(local, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := os.Lstat(p)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(local, p)
		if err != nil {
			return err
		}
		entry := path.Join(name, filepath.ToSlash(rel))
		if entry == "." {
			return nil // the contents' own directory: the target already is it
		}
		return tarfile.WriteEntry(tw, p, entry, info, nil)
	})
	if err != nil {
		return fmt.Errorf("pack %s: %w", local, err)
	}
	return tw.Close()
}

func (a *app) sendTar(cmd *cobra.Command, id, dir string, data []byte) error {
	resp, err := a.c.Sandboxes.Upload(cmd.Context(), connect.NewRequest(&dsecv1.UploadRequest{SandboxId: id, Path: dir, Tar: data}))
	if err != nil {
		return err
	}
	if a.json {
		return a.printProto(resp.Msg)
	}
	return nil
}

func (a *app) download(cmd *cobra.Command, id, src, local string) error {
	ctx := cmd.Context()
	kind, err := a.remoteType(ctx, id, src)
	if err != nil {
		return err
	}
	if kind == "" {
		return fmt.Errorf("%s:%s does not exist", id, src)
	}
	stream, err := a.c.Sandboxes.Download(ctx, connect.NewRequest(&dsecv1.DownloadRequest{SandboxId: id, Path: src}))
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
	if local == "-" {
		_, err = io.Copy(a.stdout, pr)
		pr.CloseWithError(err)
		return err
	}

	// The agent names entries after src's base name ("." for the root).
	// rename maps them to their local names below dir.
	from := path.Base(path.Clean(src))
	st, statErr := os.Stat(local)
	exists := statErr == nil
	trailing := strings.HasSuffix(local, "/") || strings.HasSuffix(local, string(filepath.Separator))
	var dir, to string
	switch {
	case exists && !st.IsDir() && (kind == "dir" || trailing):
		return fmt.Errorf("cannot copy %s:%s over %s, which is not a directory", id, src, local)
	case kind == "dir" && (contentsOf(src) || from == "/"):
		dir, to = local, ""
	case exists && st.IsDir() || trailing:
		dir, to = local, from
	default:
		dir, to = filepath.Dir(filepath.Clean(local)), filepath.Base(filepath.Clean(local))
	}
	rename := func(name string) (string, error) {
		if from == "." || from == "/" {
			return path.Join(to, name), nil
		}
		if name == from {
			return path.Join(to, "."), nil
		}
		if rest, ok := strings.CutPrefix(name, from+"/"); ok {
			return path.Join(to, rest), nil
		}
		return "", fmt.Errorf("archive entry %q is not below %q", name, from)
	}
	err = extractTar(pr, dir, rename)
	pr.CloseWithError(err)
	return err
}

// extractTar unpacks r into dir, each entry under the name rename gives it,
// refusing names that leave dir and never writing through a symlink.
func extractTar(r io.Reader, dir string, rename func(string) (string, error)) error {
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
		name, err := rename(path.Clean(hdr.Name))
		if err != nil {
			return err
		}
		if name == "." {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return err
			}
			continue
		}
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
