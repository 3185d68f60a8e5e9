package dsec

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// uploadServer keeps what each upload sent.
type uploadServer struct {
	dsecv1connect.UnimplementedLayerServiceHandler
	mu      sync.Mutex
	header  *dsecv1.UploadLayerHeader
	archive []byte
	pieces  []int
	ended   bool
}

func (u *uploadServer) UploadLayer(_ context.Context, st *connect.ClientStream[dsecv1.UploadLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.header, u.archive, u.pieces, u.ended = nil, nil, nil, false
	for st.Receive() {
		switch m := st.Msg(); {
		case m.GetHeader() != nil:
			u.header = m.GetHeader()
		case m.GetEnd():
			u.ended = true
		default:
			u.archive = append(u.archive, m.GetData()...)
			u.pieces = append(u.pieces, len(m.GetData()))
		}
	}
	return connect.NewResponse(&dsecv1.Layer{Refs: []string{u.header.GetRef()}}), st.Err()
}

// TestUploadLayerStreams: LayerOptions.Upload streams a tree packed as it
// goes, or an archive file as it is with its size, in pieces of at most
// uploadPiece bytes, then the end marker.
func TestUploadLayerStreams(t *testing.T) {
	noToken(t)
	u := &uploadServer{}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewLayerServiceHandler(u))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	c, err := NewClient(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	tree := t.TempDir()
	big := make([]byte, 5<<19) // 2.5 MiB: several pieces
	rand.Read(big)
	if err := os.WriteFile(filepath.Join(tree, "big"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	l, err := c.ImportLayer(t.Context(), "up:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, tree, &LayerOptions{Upload: true})
	if err != nil || l.GetRefs()[0] != "up:1" {
		t.Fatalf("upload a tree: %v, %v", l, err)
	}
	check := func(wantSize int64) []byte {
		t.Helper()
		u.mu.Lock()
		defer u.mu.Unlock()
		if u.header.GetRef() != "up:1" || u.header.GetKind() != dsecv1.LayerKind_LAYER_KIND_WORKSPACE || u.header.GetSize() != wantSize || !u.ended {
			t.Errorf("header %v, size want %d, ended %v", u.header, wantSize, u.ended)
		}
		for _, n := range u.pieces {
			if n == 0 || n > uploadPiece {
				t.Errorf("a piece of %d bytes (pieces %v)", n, u.pieces)
			}
		}
		return u.archive
	}
	archive := check(0)
	tr := tar.NewReader(bytes.NewReader(archive))
	hdr, err := tr.Next()
	if err != nil || hdr.Name != "big" {
		t.Fatalf("the archive's first entry: %v, %v", hdr, err)
	}
	if got, _ := io.ReadAll(tr); !bytes.Equal(got, big) {
		t.Errorf("the archive's big differs")
	}
	f := filepath.Join(t.TempDir(), "layer.tar")
	if err := os.WriteFile(f, archive, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ImportLayer(t.Context(), "up:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, f, &LayerOptions{Upload: true}); err != nil {
		t.Fatal(err)
	}
	if got := check(int64(len(archive))); !bytes.Equal(got, archive) {
		t.Errorf("an archive file was not sent as it is")
	}
}
