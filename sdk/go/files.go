package dsec

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// ReadFile returns the whole content of a file in the sandbox.
func (s *Sandbox) ReadFile(ctx context.Context, path string) ([]byte, error) {
	var out []byte
	for {
		var resp *dsecv1.ReadFileResponse
		err := s.c.unary(ctx, true, func(ctx context.Context) error {
			r, err := s.c.sb.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: s.ID, Path: path, Offset: int64(len(out))}))
			if err == nil {
				resp = r.Msg
			}
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("read %s in %s: %w", path, s.ID, err)
		}
		out = append(out, resp.GetData()...)
		if !resp.GetTruncated() || len(resp.GetData()) == 0 {
			return out, nil
		}
	}
}

// WriteFile writes data to a file in the sandbox, making its parents; mode 0 means 0644.
func (s *Sandbox) WriteFile(ctx context.Context, path string, data []byte, mode fs.FileMode) error {
	return s.writeFile(ctx, path, data, mode, false)
}

// AppendFile appends data to a file in the sandbox.
func (s *Sandbox) AppendFile(ctx context.Context, path string, data []byte) error {
	return s.writeFile(ctx, path, data, 0, true)
}

func (s *Sandbox) writeFile(ctx context.Context, path string, data []byte, mode fs.FileMode, appendTo bool) error {
	err := s.c.unary(ctx, false, func(ctx context.Context) error {
		_, err := s.c.sb.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: s.ID, Path: path, Data: data,
			Mode: uint32(mode.Perm()), Append: appendTo, MakeParents: true}))
		return err
	})
	if err != nil {
		return fmt.Errorf("write %s in %s: %w", path, s.ID, err)
	}
	return nil
}

// ListDir lists a directory of the sandbox.
func (s *Sandbox) ListDir(ctx context.Context, path string) ([]*dsecv1.FileInfo, error) {
	var out []*dsecv1.FileInfo
	err := s.c.unary(ctx, true, func(ctx context.Context) error {
		r, err := s.c.sb.ListDir(ctx, connect.NewRequest(&dsecv1.ListDirRequest{SandboxId: s.ID, Path: path}))
		if err == nil {
			out = r.Msg.GetEntries()
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list %s in %s: %w", path, s.ID, err)
	}
	return out, nil
}

// Stat describes a path of the sandbox; a missing one gives ErrNotFound.
func (s *Sandbox) Stat(ctx context.Context, path string) (*dsecv1.FileInfo, error) {
	var out *dsecv1.FileInfo
	err := s.c.unary(ctx, true, func(ctx context.Context) error {
		r, err := s.c.sb.Stat(ctx, connect.NewRequest(&dsecv1.StatRequest{SandboxId: s.ID, Path: path}))
		if err == nil {
			out = r.Msg.GetInfo()
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("stat %s in %s: %w", path, s.ID, err)
	}
	return out, nil
}

// Remove removes a path of the sandbox (a directory's content too when recursive).
func (s *Sandbox) Remove(ctx context.Context, path string, recursive bool) error {
	err := s.c.unary(ctx, true, func(ctx context.Context) error {
		_, err := s.c.sb.Remove(ctx, connect.NewRequest(&dsecv1.RemoveRequest{SandboxId: s.ID, Path: path, Recursive: recursive}))
		return err
	})
	if err != nil {
		return fmt.Errorf("remove %s in %s: %w", path, s.ID, err)
	}
	return nil
}

// MkdirAll makes a directory of the sandbox and its parents.
func (s *Sandbox) MkdirAll(ctx context.Context, path string, mode fs.FileMode) error {
	err := s.c.unary(ctx, true, func(ctx context.Context) error {
		_, err := s.c.sb.MakeDir(ctx, connect.NewRequest(&dsecv1.MakeDirRequest{SandboxId: s.ID, Path: path, Parents: true, Mode: uint32(mode.Perm())}))
		return err
	})
	if err != nil {
		return fmt.Errorf("make directory %s in %s: %w", path, s.ID, err)
	}
	return nil
}

// Upload copies a local directory's content (or one file) into directory
// path of the sandbox, as one tar archive. It returns the files written.
func (s *Sandbox) Upload(ctx context.Context, localPath, path string) (int64, error) {
	var buf bytes.Buffer
	if err := writeTar(&buf, localPath); err != nil {
		return 0, fmt.Errorf("pack %s: %w", localPath, err)
	}
	var resp *dsecv1.UploadResponse
	ctx, cancel := withTimeout(ctx, 5*s.c.timeout)
	defer cancel()
	err := s.c.unary(ctx, false, func(ctx context.Context) error {
		r, err := s.c.sb.Upload(ctx, connect.NewRequest(&dsecv1.UploadRequest{SandboxId: s.ID, Path: path, Tar: buf.Bytes()}))
		if err == nil {
			resp = r.Msg
		}
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("upload %s to %s:%s: %w", localPath, s.ID, path, err)
	}
	return resp.GetFiles(), nil
}

func writeTar(w io.Writer, root string) error {
	tw := tar.NewWriter(w)
	st, err := os.Stat(root)
	if err != nil {
		return err
	}
	base := root
	if !st.IsDir() {
		base = filepath.Dir(root)
	}
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(base, p)
		if err != nil || rel == "." {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if info.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if info.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// Download copies path (a file or directory) of the sandbox into localDir
// and returns the names extracted. Entries that would land outside localDir,
// and device files, are refused.
func (s *Sandbox) Download(ctx context.Context, path, localDir string) ([]string, error) {
	data, err := s.DownloadTar(ctx, path)
	if err != nil {
		return nil, err
	}
	names, err := ExtractTar(bytes.NewReader(data), localDir)
	if err != nil {
		return nil, fmt.Errorf("extract %s of %s: %w", path, s.ID, err)
	}
	return names, nil
}

// DownloadTar returns path (a file or directory) of the sandbox as a tar archive.
func (s *Sandbox) DownloadTar(ctx context.Context, path string) ([]byte, error) {
	ctx, cancel := withTimeout(ctx, 5*s.c.timeout)
	defer cancel()
	var buf bytes.Buffer
	err := s.c.retry(ctx, false, func(ctx context.Context) error {
		buf.Reset()
		stream, err := s.c.sb.Download(ctx, connect.NewRequest(&dsecv1.DownloadRequest{SandboxId: s.ID, Path: path}))
		if err != nil {
			return err
		}
		defer stream.Close()
		for stream.Receive() {
			buf.Write(stream.Msg().GetData())
		}
		return stream.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("download %s of %s: %w", path, s.ID, err)
	}
	return buf.Bytes(), nil
}

// ExtractTar extracts a tar archive into dest, refusing anything that escapes it.
func ExtractTar(r io.Reader, dest string) ([]string, error) {
	root, err := filepath.Abs(dest)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return nil, err
	}
	inside := func(p string) bool {
		return p == root || strings.HasPrefix(p, root+string(filepath.Separator))
	}
	var names []string
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return names, nil
		}
		if err != nil {
			return names, err
		}
		target := filepath.Join(root, filepath.FromSlash(hdr.Name))
		if !inside(target) {
			return names, invalid("tar entry %q leaves the destination", hdr.Name)
		}
		// Never write through a symlink placed by an earlier entry.
		if real, err := filepath.EvalSymlinks(filepath.Dir(target)); err == nil && !inside(real) {
			return names, invalid("tar entry %q leaves the destination through a link", hdr.Name)
		}
		mode := fs.FileMode(hdr.Mode).Perm()
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(target, mode|0o700); err != nil {
				return names, err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
				return names, err
			}
			if fi, err := os.Lstat(target); err == nil && fi.Mode()&fs.ModeSymlink != 0 {
				os.Remove(target) // replace a link, never write through it
			}
			f, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
			if err != nil {
				return names, err
			}
			_, err = io.Copy(f, tr)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return names, err
			}
		case tar.TypeSymlink:
			lt := filepath.Join(filepath.Dir(target), hdr.Linkname)
			if filepath.IsAbs(hdr.Linkname) || !inside(lt) {
				return names, invalid("tar link %q -> %q leaves the destination", hdr.Name, hdr.Linkname)
			}
			os.Remove(target)
			if err := os.Symlink(hdr.Linkname, target); err != nil {
				return names, err
			}
		case tar.TypeLink:
			src := filepath.Join(root, filepath.FromSlash(hdr.Linkname))
			if !inside(src) {
				return names, invalid("tar link %q -> %q leaves the destination", hdr.Name, hdr.Linkname)
			}
			os.Remove(target)
			if err := os.Link(src, target); err != nil {
				return names, err
			}
		default:
			return names, invalid("tar entry %q has a type (%c) that is not extracted", hdr.Name, hdr.Typeflag)
		}
		names = append(names, hdr.Name)
	}
}

// uploadPiece is how much of an archive one message of an upload carries.
const uploadPiece = 1 << 20

// uploadLayer streams path as an upload: an archive file as it is, or a
// directory's contents packed as they are sent. A source that fails midway
// abandons the call, so no truncated archive is taken for a whole one.
func (c *Client) uploadLayer(ctx context.Context, h *dsecv1.UploadLayerHeader, path string) (*dsecv1.Layer, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	var src io.Reader
	if st.IsDir() {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(writeTar(pw, path)) }()
		defer pr.Close() // stops the packer if the upload ends first
		src = pr
	} else {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		src, h.Size = f, st.Size()
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream := c.uploads.UploadLayer(ctx)
	sent := stream.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Header{Header: h}})
	buf := make([]byte, uploadPiece)
	for sent == nil {
		n, rerr := io.ReadFull(src, buf)
		if n > 0 {
			sent = stream.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Data{Data: buf[:n]}})
		}
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			if sent == nil {
				sent = stream.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_End{End: true}})
			}
			break
		}
		if rerr != nil {
			cancel()
			stream.CloseAndReceive()
			return nil, fmt.Errorf("read %s: %w", path, rerr)
		}
	}
	// A send that failed with io.EOF means the server ended the call: its
	// answer says why. A source that failed has cancelled the call, and
	// sent no end: no hop takes what came for a whole archive.
	if sent != nil && !errors.Is(sent, io.EOF) {
		return nil, fromConnect(sent, false)
	}
	resp, err := stream.CloseAndReceive()
	if err != nil {
		return nil, fromConnect(err, false)
	}
	return resp.Msg, nil
}
