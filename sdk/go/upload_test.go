package dsec

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
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
	refuse  error // the answer once the header came, if set
}

func (u *uploadServer) UploadLayer(_ context.Context, st *connect.ClientStream[dsecv1.UploadLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.header, u.archive, u.pieces, u.ended = nil, nil, nil, false
	if u.refuse != nil && st.Receive() {
		return nil, u.refuse
	}
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
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true) // as dsecd serves it
	srv.Start()
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

	// A server refusing at the header is heard, its words intact, while
	// most of the archive is unsent (HTTP/2; over HTTP/1.1 the answer could
	// be lost to the connection the server closes).
	u.mu.Lock()
	u.refuse = connect.NewError(connect.CodeResourceExhausted, errors.New("the archive is over the 1 GiB an upload may have (dsecd --max-upload-bytes)"))
	u.mu.Unlock()
	huge := filepath.Join(t.TempDir(), "huge.tar")
	if err := os.WriteFile(huge, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(huge, 64<<20); err != nil {
		t.Fatal(err)
	}
	for range 10 {
		_, err := c.ImportLayer(t.Context(), "up:1", dsecv1.LayerKind_LAYER_KIND_BASE, huge, &LayerOptions{Upload: true})
		if !errors.Is(err, ErrOverloaded) || !strings.Contains(err.Error(), "--max-upload-bytes") {
			t.Fatalf("an upload the server refused: %v", err)
		}
	}
}
