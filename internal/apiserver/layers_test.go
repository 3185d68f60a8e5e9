package apiserver

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/layerupload"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/watcher"
	dsec "dsec.dev/dsec/sdk/go"
)

// overTransports runs a test with the edges called in-process, over
// HTTP/2 and over HTTP/1.1 (as a cluster's apiserver calls them); clients
// reach the apiserver over HTTP/1.1.
func overTransports(t *testing.T, test func(t *testing.T, start func(nodes ...watcher.Node) dsecv1connect.LayerServiceClient)) {
	for _, tc := range []struct {
		name          string
		remote, http1 bool
	}{{"in-process", false, false}, {"http2", true, false}, {"http1", true, true}} {
		t.Run(tc.name, func(t *testing.T) {
			test(t, func(nodes ...watcher.Node) dsecv1connect.LayerServiceClient {
				hs := startServer(t, tc.remote, tc.http1, nodes)
				return dsecv1connect.NewLayerServiceClient(hs.Client(), hs.URL)
			})
		})
	}
}

// TestImageImportedOncePerBlobStore: of two nodes sharing a blob store one
// imports the image and the other adopts it; a node with a store of its own
// imports too. The caller sees one progress stream and one result.
func TestImageImportedOncePerBlobStore(t *testing.T) {
	overTransports(t, func(t *testing.T, start func(nodes ...watcher.Node) dsecv1connect.LayerServiceClient) {
		shared, other := newFakeBlobStore(), newFakeBlobStore()
		a := &fakeLayers{name: "s3://one", store: shared}
		b := &fakeLayers{name: "s3://one", store: shared}
		c := &fakeLayers{name: "s3://two", store: other}
		cl := start(layerNode("a", a), layerNode("b", b), layerNode("c", c))
		stream, err := cl.ImportImage(t.Context(), connect.NewRequest(&dsecv1.ImportImageRequest{Ref: "img:1", Source: "docker://registry.test/img:1"}))
		if err != nil {
			t.Fatal(err)
		}
		var phases []string
		var last *dsecv1.ImportImageProgress
		for stream.Receive() {
			last = stream.Msg()
			phases = append(phases, last.GetPhase())
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if got := strings.Join(phases, " "); got != "fetch adopt done" {
			t.Errorf("progress phases %q, want one import's: fetch adopt done", got)
		}
		if !last.GetDone() || strings.Join(last.GetLayerDigests(), ",") != strings.Join(fakeImageDigests, ",") {
			t.Errorf("result %v", last)
		}
		ai, _, aa := a.counts()
		bi, _, ba := b.counts()
		ci, _, ca := c.counts()
		if ai+bi != 1 || aa+ba != 1 || ci != 1 || ca != 0 {
			t.Errorf("imports a %d b %d c %d, adoptions a %d b %d c %d; want one import per blob store and the other node adopting",
				ai, bi, ci, aa, ba, ca)
		}
	})
}

// TestImageImportWhereTheStoreDiffers: a node whose blob store has the
// importer's name but not its content imports for itself.
func TestImageImportWhereTheStoreDiffers(t *testing.T) {
	a := &fakeLayers{name: "dir:/var/lib/dsec/blobstore", store: newFakeBlobStore()}
	b := &fakeLayers{name: "dir:/var/lib/dsec/blobstore", store: newFakeBlobStore()}
	hs := startServer(t, true, true, []watcher.Node{layerNode("a", a), layerNode("b", b)})
	cl := dsecv1connect.NewLayerServiceClient(hs.Client(), hs.URL)
	stream, err := cl.ImportImage(t.Context(), connect.NewRequest(&dsecv1.ImportImageRequest{Ref: "img:1", Source: "docker://registry.test/img:1"}))
	if err != nil {
		t.Fatal(err)
	}
	for stream.Receive() {
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	ai, _, _ := a.counts()
	bi, _, _ := b.counts()
	if ai != 1 || bi != 1 {
		t.Errorf("imports a %d b %d, want each node to import when adopting found nothing", ai, bi)
	}
}

// upload streams data as an upload of ref in pieces of piece bytes.
func upload(ctx context.Context, cl dsecv1connect.LayerServiceClient, ref string, data []byte, piece int) (*dsecv1.Layer, error) {
	s := cl.UploadLayer(ctx)
	err := s.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Header{Header: &dsecv1.UploadLayerHeader{
		Ref: ref, Kind: dsecv1.LayerKind_LAYER_KIND_BASE}}})
	for len(data) > 0 && err == nil {
		n := min(piece, len(data))
		err = s.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Data{Data: data[:n]}})
		data = data[n:]
	}
	if err == nil {
		err = s.Send(layerupload.End())
	}
	resp, cerr := s.CloseAndReceive()
	if cerr != nil {
		return nil, cerr
	}
	return resp.Msg, err
}

// TestUploadGoesToOneEdgePerBlobStore: the archive reaches one node of the
// two sharing a store, whole and in order, and the node with its own store;
// the other adopts.
func TestUploadGoesToOneEdgePerBlobStore(t *testing.T) {
	data := make([]byte, 3<<20+12345)
	rand.Read(data)
	sum := sha256.Sum256(data)
	want := "sha256:" + hex.EncodeToString(sum[:])
	overTransports(t, func(t *testing.T, start func(nodes ...watcher.Node) dsecv1connect.LayerServiceClient) {
		shared := newFakeBlobStore()
		a := &fakeLayers{name: "s3://one", store: shared}
		b := &fakeLayers{name: "s3://one", store: shared}
		c := &fakeLayers{name: "s3://two", store: newFakeBlobStore()}
		cl := start(layerNode("a", a), layerNode("b", b), layerNode("c", c))
		l, err := upload(t.Context(), cl, "up:1", data, 256<<10)
		if err != nil {
			t.Fatal(err)
		}
		if l.GetDigest() != want {
			t.Errorf("layer %s, want the archive's digest %s", l.GetDigest(), want)
		}
		_, au, aa := a.counts()
		_, bu, ba := b.counts()
		_, cu, _ := c.counts()
		n := int64(len(data))
		if au+bu != n || min(au, bu) != 0 || aa+ba != 1 || cu != n {
			t.Errorf("bytes received a %d b %d c %d, adoptions a %d b %d; want the archive once per blob store", au, bu, cu, aa, ba)
		}
	})
}

// TestUploadWhereTheStoreDiffers: an upload cannot be read twice, so a node
// whose store lacks what the importer put in the store of the same name
// fails, saying why.
func TestUploadWhereTheStoreDiffers(t *testing.T) {
	a := &fakeLayers{name: "dir:/var/lib/dsec/blobstore", store: newFakeBlobStore()}
	b := &fakeLayers{name: "dir:/var/lib/dsec/blobstore", store: newFakeBlobStore()}
	hs := startServer(t, false, false, []watcher.Node{layerNode("a", a), layerNode("b", b)})
	cl := dsecv1connect.NewLayerServiceClient(hs.Client(), hs.URL)
	_, err := upload(t.Context(), cl, "up:1", []byte("archive"), 4)
	if err == nil || !strings.Contains(err.Error(), "node b") || !strings.Contains(err.Error(), "do not share one") {
		t.Errorf("upload over stores of one name: %v", err)
	}
}

// TestBrokenUploadIsNotTakenWhole: a client that goes midway leaves every
// node with a broken stream, never a clean end, and nothing published; on
// one node (the all-in-one) and on several at once.
func TestBrokenUploadIsNotTakenWhole(t *testing.T) {
	overTransports(t, func(t *testing.T, start func(nodes ...watcher.Node) dsecv1connect.LayerServiceClient) {
		for _, stores := range [][]string{{"s3://one"}, {"s3://one", "s3://two"}} {
			var nodes []watcher.Node
			var fakes []*fakeLayers
			for i, name := range stores {
				f := &fakeLayers{name: name, store: newFakeBlobStore()}
				fakes = append(fakes, f)
				nodes = append(nodes, layerNode(string(rune('a'+i)), f))
			}
			cl := start(nodes...)
			ctx, cancel := context.WithCancel(t.Context())
			s := cl.UploadLayer(ctx)
			s.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Header{Header: &dsecv1.UploadLayerHeader{Ref: "up:1", Kind: dsecv1.LayerKind_LAYER_KIND_BASE}}})
			s.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Data{Data: bytes.Repeat([]byte("x"), 64<<10)}})
			testutil.WaitFor(t, 5*time.Second, "every node to get the first piece", func() bool {
				for _, f := range fakes {
					if _, n, _ := f.counts(); n == 0 {
						return false
					}
				}
				return true
			})
			cancel()
			if _, err := s.CloseAndReceive(); err == nil {
				t.Fatal("a cancelled upload succeeded")
			}
			for i, f := range fakes {
				testutil.WaitFor(t, 5*time.Second, "the node's upload to end", func() bool {
					f.mu.Lock()
					defer f.mu.Unlock()
					return len(f.uploads) == 1
				})
				if f.uploads[0] == nil {
					t.Errorf("%d nodes: node %d saw a broken upload end cleanly", len(fakes), i)
				}
				if len(f.store.refs) != 0 {
					t.Errorf("%d nodes: node %d published %v", len(fakes), i, f.store.refs)
				}
			}
		}
	})
}

// TestUploadMessagesAreBounded: no message of an upload is held beyond
// maxUploadMessage, and a stream must start with its header.
func TestUploadMessagesAreBounded(t *testing.T) {
	a := &fakeLayers{name: "s3://one", store: newFakeBlobStore()}
	hs := startServer(t, false, false, []watcher.Node{layerNode("a", a)})
	cl := dsecv1connect.NewLayerServiceClient(hs.Client(), hs.URL)
	_, err := upload(t.Context(), cl, "up:1", make([]byte, maxUploadMessage+1), maxUploadMessage+1)
	if connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Errorf("a piece over %d bytes: %v, want resource_exhausted", maxUploadMessage, err)
	}
	s := cl.UploadLayer(t.Context())
	s.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Data{Data: []byte("x")}})
	if _, err := s.CloseAndReceive(); connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "must be the header") {
		t.Errorf("data before the header: %v", err)
	}
	if l, err := upload(t.Context(), cl, "up:1", []byte("small"), 2); err != nil || l.GetDigest() == "" {
		t.Errorf("an upload to the one node: %v, %v", l, err)
	}
}

// TestEarlyRefusalReachesTheCaller: an edge that refuses an upload before
// its end (here at its header) is heard by the CLI's client, its words
// intact, while most of the archive is unsent: uploads go over HTTP/2 on
// both hops, where HTTP/1.1 could lose the answer to the connection the
// server closes under the body (about one in ten tries did).
func TestEarlyRefusalReachesTheCaller(t *testing.T) {
	a := &fakeLayers{name: "s3://one", store: newFakeBlobStore(),
		refuse: fmt.Errorf("upload layer a:1: the archive is over the 1 GiB an upload may have (dsecd --max-upload-bytes): %w", errdefs.ErrResourceExhausted)}
	hs := startServer(t, true, true, []watcher.Node{layerNode("a", a)})
	c, err := dsec.Dial(hs.URL, dsec.DialOptions{})
	if err != nil {
		t.Fatal(err)
	}
	piece := make([]byte, 1<<20)
	for range 20 {
		s := c.Layers.UploadLayer(t.Context())
		err := s.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Header{Header: &dsecv1.UploadLayerHeader{
			Ref: "a:1", Kind: dsecv1.LayerKind_LAYER_KIND_BASE}}})
		for i := 0; i < 64 && err == nil; i++ {
			err = s.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Data{Data: piece}})
		}
		_, err = s.CloseAndReceive()
		if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "--max-upload-bytes") {
			t.Fatalf("an upload the edge refused: %v", err)
		}
	}
}

// TestImportLayerOncePerBlobStore: a path is imported by one node of a
// store, the other adopts; a cluster's import needs a ref to adopt by.
func TestImportLayerOncePerBlobStore(t *testing.T) {
	shared := newFakeBlobStore()
	a := &fakeLayers{name: "s3://one", store: shared}
	b := &fakeLayers{name: "s3://one", store: shared}
	hs := startServer(t, true, true, []watcher.Node{layerNode("a", a), layerNode("b", b)})
	cl := dsecv1connect.NewLayerServiceClient(hs.Client(), hs.URL)
	if _, err := cl.ImportLayer(t.Context(), connect.NewRequest(&dsecv1.ImportLayerRequest{Ref: "l:1", Kind: dsecv1.LayerKind_LAYER_KIND_BASE, Path: "/srv/tree"})); err != nil {
		t.Fatal(err)
	}
	ai, _, aa := a.counts()
	bi, _, ba := b.counts()
	if ai+bi != 1 || aa+ba != 1 {
		t.Errorf("imports a %d b %d, adoptions a %d b %d", ai, bi, aa, ba)
	}
	_, err := cl.ImportLayer(t.Context(), connect.NewRequest(&dsecv1.ImportLayerRequest{Kind: dsecv1.LayerKind_LAYER_KIND_BASE, Path: "/srv/tree"}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("an import without a ref in a cluster: %v", err)
	}
}
