package edgeclient

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// bigLister answers List with sandboxes enough to pass the edge's 16 KiB
// compression threshold.
type bigLister struct {
	edgev1connect.UnimplementedEdgeServiceHandler
}

func (bigLister) List(ctx context.Context, req *connect.Request[edgev1.ListRequest]) (*connect.Response[edgev1.ListResponse], error) {
	var sbs []*dsecv1.Sandbox
	for range 200 {
		sbs = append(sbs, &dsecv1.Sandbox{Id: strings.Repeat("x", 200)})
	}
	return connect.NewResponse(&edgev1.ListResponse{Sandboxes: sbs}), nil
}

// TestNoCompression: a client Dial made neither offers gzip nor gets an
// answer packed, over HTTP/1.1 and HTTP/2 alike (Go's transport offers
// gzip on its own unless told not to).
func TestNoCompression(t *testing.T) {
	var mu sync.Mutex
	var offered, packed []string
	mux := http.NewServeMux()
	mux.Handle(edgev1connect.NewEdgeServiceHandler(bigLister{}, connect.WithCompressMinBytes(16<<10)))
	es := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mux.ServeHTTP(w, r)
		mu.Lock()
		offered = append(offered, r.Proto+": "+r.Header.Get("Accept-Encoding"))
		packed = append(packed, r.Proto+": "+w.Header().Get("Content-Encoding"))
		mu.Unlock()
	}))
	es.EnableHTTP2 = true
	es.StartTLS()
	defer es.Close()
	tc := es.Client().Transport.(*http.Transport).TLSClientConfig
	r := Dial(tc, es.URL, nil)
	ctx := context.Background()
	for _, c := range []edgev1connect.EdgeServiceClient{r.c, r.bidi} {
		resp, err := c.List(ctx, connect.NewRequest(&edgev1.ListRequest{}))
		if err != nil || len(resp.Msg.GetSandboxes()) != 200 {
			t.Fatalf("list: %v", err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(offered) != 2 || !strings.HasPrefix(offered[0], "HTTP/1.1") || !strings.HasPrefix(offered[1], "HTTP/2") {
		t.Fatalf("calls seen: %q, want one over HTTP/1.1 and one over HTTP/2", offered)
	}
	for i := range offered {
		if strings.Contains(offered[i], "gzip") || strings.Contains(packed[i], "gzip") {
			t.Errorf("offered %q, answer packed %q: want no gzip", offered[i], packed[i])
		}
	}
}
