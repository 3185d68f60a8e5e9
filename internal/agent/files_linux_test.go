package agent_test

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

func TestFiles(t *testing.T) {
	a := startAgent(t, agentOpts{})
	c := a.client
	ctx := context.Background()
	dir := t.TempDir()
	os.Chmod(dir, 0o755)
	os.Chmod(filepath.Dir(dir), 0o755)
	f := filepath.Join(dir, "sub", "a.txt")

	if _, err := c.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{Path: f, Data: []byte("hello")})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("write without parents: %v", err)
	}
	w, err := c.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{Path: f, Data: []byte("hello"), MakeParents: true, Mode: 0o600}))
	if err != nil || w.Msg.Written != 5 {
		t.Fatalf("write: %v", err)
	}
	if _, err := c.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{Path: f, Data: []byte(" world"), Append: true})); err != nil {
		t.Fatal(err)
	}
	rd, err := c.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{Path: f}))
	if err != nil || string(rd.Msg.Data) != "hello world" || rd.Msg.Size != 11 || rd.Msg.Truncated {
		t.Fatalf("read: %v %v", rd, err)
	}
	rd, err = c.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{Path: f, Offset: 2, Limit: 3}))
	if err != nil || string(rd.Msg.Data) != "llo" || !rd.Msg.Truncated {
		t.Fatalf("read range: %v %v", rd, err)
	}
	if _, err := c.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{Path: filepath.Join(dir, "nope")})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("read missing: %v", err)
	}
	if _, err := c.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{Path: dir})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("read dir: %v", err)
	}
	st, err := c.Stat(ctx, connect.NewRequest(&dsecv1.StatRequest{Path: f}))
	if err != nil || st.Msg.Info.Type != "file" || st.Msg.Info.Mode != 0o600 || st.Msg.Info.Size != 11 || st.Msg.Info.Name != "a.txt" {
		t.Fatalf("stat: %v %v", st, err)
	}
	os.Symlink("a.txt", filepath.Join(dir, "sub", "link"))
	st, err = c.Stat(ctx, connect.NewRequest(&dsecv1.StatRequest{Path: filepath.Join(dir, "sub", "link")}))
	if err != nil || st.Msg.Info.Type != "symlink" || st.Msg.Info.LinkTarget != "a.txt" {
		t.Fatalf("stat link: %v %v", st, err)
	}
	if _, err := c.MakeDir(ctx, connect.NewRequest(&dsecv1.MakeDirRequest{Path: filepath.Join(dir, "x", "y")})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("mkdir without parents: %v", err)
	}
	if _, err := c.MakeDir(ctx, connect.NewRequest(&dsecv1.MakeDirRequest{Path: filepath.Join(dir, "x", "y"), Parents: true, Mode: 0o700})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.MakeDir(ctx, connect.NewRequest(&dsecv1.MakeDirRequest{Path: filepath.Join(dir, "x")})); connect.CodeOf(err) != connect.CodeAlreadyExists {
		t.Errorf("mkdir existing: %v", err)
	}
	ls, err := c.ListDir(ctx, connect.NewRequest(&dsecv1.ListDirRequest{Path: dir}))
	if err != nil || len(ls.Msg.Entries) != 2 || ls.Msg.Entries[0].Name != "sub" || ls.Msg.Entries[1].Type != "dir" {
		t.Fatalf("list: %v %v", ls, err)
	}
	mv, err := c.Move(ctx, connect.NewRequest(&dsecv1.MoveRequest{Source: filepath.Join(dir, "x", "y"), Destination: filepath.Join(dir, "x", "z", "w"), MakeParents: true}))
	if err != nil || mv.Msg.Info.GetType() != "dir" || mv.Msg.Info.GetPath() != filepath.Join(dir, "x", "z", "w") || mv.Msg.Info.GetMode() != 0o700 {
		t.Fatalf("move: %v %v", mv, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "x", "y")); !os.IsNotExist(err) {
		t.Errorf("the source is still there after a move: %v", err)
	}
	if _, err := c.Move(ctx, connect.NewRequest(&dsecv1.MoveRequest{Source: filepath.Join(dir, "x", "y"), Destination: filepath.Join(dir, "x", "v")})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("move missing: %v", err)
	}
	if _, err := c.Move(ctx, connect.NewRequest(&dsecv1.MoveRequest{Source: filepath.Join(dir, "x", "z"), Destination: filepath.Join(dir, "q", "z")})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("move without parents: %v", err)
	}
	if _, err := c.Remove(ctx, connect.NewRequest(&dsecv1.RemoveRequest{Path: filepath.Join(dir, "x")})); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("remove non-empty: %v", err)
	}
	if _, err := c.Remove(ctx, connect.NewRequest(&dsecv1.RemoveRequest{Path: filepath.Join(dir, "x"), Recursive: true})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Remove(ctx, connect.NewRequest(&dsecv1.RemoveRequest{Path: filepath.Join(dir, "x")})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("remove missing: %v", err)
	}

	t.Run("as nobody", func(t *testing.T) {
		testutil.RequireRoot(t)
		// f is root's and 0600; dir is root's and 0755.
		if _, err := c.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{Path: f, User: "nobody"})); connect.CodeOf(err) != connect.CodePermissionDenied {
			t.Errorf("read root's file: %v", err)
		}
		if _, err := c.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{Path: filepath.Join(dir, "n.txt"), User: "nobody"})); connect.CodeOf(err) != connect.CodePermissionDenied {
			t.Errorf("write into root's dir: %v", err)
		}
		nd := filepath.Join(dir, "nobody")
		os.Mkdir(nd, 0o755)
		os.Chown(nd, 65534, 65534)
		if _, err := c.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{Path: filepath.Join(nd, "n.txt"), Data: []byte("x"), User: "nobody"})); err != nil {
			t.Fatal(err)
		}
		st, err := c.Stat(ctx, connect.NewRequest(&dsecv1.StatRequest{Path: filepath.Join(nd, "n.txt")}))
		if err != nil || st.Msg.Info.Uid != 65534 {
			t.Errorf("owner: %v %v", st, err)
		}
		// The agent's own thread credentials must be back to root.
		if _, err := c.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{Path: f})); err != nil {
			t.Errorf("read as root after nobody: %v", err)
		}
	})
}

func TestUploadDownload(t *testing.T) {
	a := startAgent(t, agentOpts{})
	c := a.client
	ctx := context.Background()
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "tree", "d"), 0o755)
	os.WriteFile(filepath.Join(src, "tree", "f.txt"), []byte("file one"), 0o640)
	os.WriteFile(filepath.Join(src, "tree", "d", "big"), bytes.Repeat([]byte("0123456789"), 100000), 0o755)
	os.Symlink("../f.txt", filepath.Join(src, "tree", "d", "ln"))

	s, err := c.Download(ctx, connect.NewRequest(&dsecv1.DownloadRequest{Path: filepath.Join(src, "tree")}))
	if err != nil {
		t.Fatal(err)
	}
	var archive bytes.Buffer
	chunks := 0
	for s.Receive() {
		archive.Write(s.Msg().Data)
		chunks++
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	if chunks < 4 {
		t.Errorf("download came in %d chunks", chunks)
	}
	dst := t.TempDir()
	up, err := c.Upload(ctx, connect.NewRequest(&dsecv1.UploadRequest{Path: filepath.Join(dst, "new"), Tar: archive.Bytes()}))
	if err != nil {
		t.Fatal(err)
	}
	if up.Msg.Files != 2 || up.Msg.Bytes != 8+1000000 {
		t.Errorf("upload counted %d files %d bytes", up.Msg.Files, up.Msg.Bytes)
	}
	for _, rel := range []string{"f.txt", "d/big"} {
		want, _ := os.ReadFile(filepath.Join(src, "tree", rel))
		got, err := os.ReadFile(filepath.Join(dst, "new", "tree", rel))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s differs: %v", rel, err)
		}
		sst, _ := os.Stat(filepath.Join(src, "tree", rel))
		dstt, _ := os.Stat(filepath.Join(dst, "new", "tree", rel))
		if dstt == nil || sst.Mode() != dstt.Mode() {
			t.Errorf("%s mode %v, want %v", rel, dstt, sst.Mode())
		}
	}
	if l, err := os.Readlink(filepath.Join(dst, "new", "tree", "d", "ln")); err != nil || l != "../f.txt" {
		t.Errorf("symlink: %q %v", l, err)
	}

	outside := t.TempDir()
	hostile := []struct {
		name    string
		entries []tar.Header
	}{
		{"dotdot", []tar.Header{{Name: "../escape", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1}}},
		{"absolute", []tar.Header{{Name: filepath.Join(outside, "abs"), Typeflag: tar.TypeReg, Mode: 0o644, Size: 1}}},
		{"through symlink", []tar.Header{
			{Name: "link", Typeflag: tar.TypeSymlink, Linkname: outside},
			{Name: "link/evil", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1},
		}},
		{"device", []tar.Header{{Name: "null", Typeflag: tar.TypeChar, Mode: 0o666, Devmajor: 1, Devminor: 3}}},
		{"hard link out", []tar.Header{{Name: "h", Typeflag: tar.TypeLink, Linkname: "../../etc/passwd"}}},
	}
	for _, h := range hostile {
		t.Run("refuse "+h.name, func(t *testing.T) {
			var b bytes.Buffer
			tw := tar.NewWriter(&b)
			for _, e := range h.entries {
				tw.WriteHeader(&e)
				if e.Size > 0 {
					tw.Write(bytes.Repeat([]byte("x"), int(e.Size)))
				}
			}
			tw.Close()
			target := filepath.Join(t.TempDir(), "in")
			_, err := c.Upload(ctx, connect.NewRequest(&dsecv1.UploadRequest{Path: target, Tar: b.Bytes()}))
			if connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Errorf("got %v, want InvalidArgument", err)
			}
			ents, _ := os.ReadDir(outside)
			if len(ents) != 0 {
				t.Errorf("wrote outside the target: %v", ents)
			}
		})
	}
	_ = io.EOF
}

// TestWatchDir: a recursive watch reports creates, writes, renames,
// removes and metadata changes, in a directory made after it started too,
// and ends with not_found when its directory goes.
func TestWatchDir(t *testing.T) {
	a := startAgent(t, agentOpts{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	stream, err := a.client.WatchDir(ctx, connect.NewRequest(&dsecv1.WatchDirRequest{Path: dir, Recursive: true}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if !stream.Receive() || !stream.Msg().GetStarted() {
		t.Fatalf("the first event is not started: %v %v", stream.Msg(), stream.Err())
	}
	type ev struct {
		name   string
		change dsecv1.FileChange
	}
	expect := func(want ...ev) {
		t.Helper()
		for _, w := range want {
			for {
				if !stream.Receive() {
					t.Fatalf("the watch ended before %v: %v", w, stream.Err())
				}
				m := stream.Msg()
				if m.GetName() == w.name && m.GetChange() == w.change {
					break
				}
			}
		}
	}
	os.WriteFile(filepath.Join(dir, "a"), []byte("x"), 0o644)
	expect(ev{"a", dsecv1.FileChange_FILE_CHANGE_CREATE}, ev{"a", dsecv1.FileChange_FILE_CHANGE_WRITE})
	os.Mkdir(filepath.Join(dir, "sub"), 0o755)
	expect(ev{"sub", dsecv1.FileChange_FILE_CHANGE_CREATE})
	os.WriteFile(filepath.Join(dir, "sub", "b"), []byte("y"), 0o644)
	expect(ev{"sub/b", dsecv1.FileChange_FILE_CHANGE_CREATE}, ev{"sub/b", dsecv1.FileChange_FILE_CHANGE_WRITE})
	os.Chmod(filepath.Join(dir, "a"), 0o600)
	expect(ev{"a", dsecv1.FileChange_FILE_CHANGE_CHMOD})
	os.Rename(filepath.Join(dir, "a"), filepath.Join(dir, "c"))
	expect(ev{"a", dsecv1.FileChange_FILE_CHANGE_RENAME}, ev{"c", dsecv1.FileChange_FILE_CHANGE_CREATE})
	// A directory moved within the tree is watched under its new name.
	os.Rename(filepath.Join(dir, "sub"), filepath.Join(dir, "moved"))
	expect(ev{"sub", dsecv1.FileChange_FILE_CHANGE_RENAME}, ev{"moved", dsecv1.FileChange_FILE_CHANGE_CREATE})
	os.WriteFile(filepath.Join(dir, "moved", "d"), nil, 0o644)
	expect(ev{"moved/d", dsecv1.FileChange_FILE_CHANGE_CREATE})
	os.Remove(filepath.Join(dir, "c"))
	expect(ev{"c", dsecv1.FileChange_FILE_CHANGE_REMOVE})
	os.RemoveAll(dir)
	for stream.Receive() {
	}
	if connect.CodeOf(stream.Err()) != connect.CodeNotFound {
		t.Errorf("the watch of a removed directory ended with %v, want not_found", stream.Err())
	}

	st, err := a.client.WatchDir(ctx, connect.NewRequest(&dsecv1.WatchDirRequest{Path: dir}))
	if err == nil {
		if st.Receive() {
			t.Errorf("watch of a missing directory started: %v", st.Msg())
		}
		err = st.Err()
		st.Close()
	}
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("watch of a missing directory: %v, want not_found", err)
	}
}
