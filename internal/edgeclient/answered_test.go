package edgeclient

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"

	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// TestAnswered: the client reports the edge's answers, its errors among
// them, and a stream's first message, but not a transport's failure.
func TestAnswered(t *testing.T) {
	mux := http.NewServeMux()
	mux.Handle(edgev1connect.NewEdgeServiceHandler(&edgeExec{events: []*dsecv1.ExecEvent{
		{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte("a")}},
		{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte("b")}},
	}}))
	es := httptest.NewServer(mux)
	defer es.Close()
	var n atomic.Int32
	r := New(es.Client(), es.Client(), es.URL, func() { n.Add(1) })
	ctx := context.Background()

	// The edge's own error (Unimplemented here) is an answer.
	if _, err := r.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: "x"})); err == nil {
		t.Fatal("get from an edge that does not implement it succeeded")
	}
	if got := n.Load(); got != 1 {
		t.Fatalf("after an error of the edge's: %d answers, want 1", got)
	}
	var events int
	stream, err := r.c.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: "x", Command: "true"}))
	if err != nil {
		t.Fatal(err)
	}
	for stream.Receive() {
		events++
	}
	stream.Close()
	if events != 2 {
		t.Fatalf("stream brought %d events, want 2", events)
	}
	if got := n.Load(); got != 2 {
		t.Fatalf("after a stream: %d answers, want 2 (one per stream)", got)
	}

	es.Close()
	if _, err := r.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: "x"})); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("get from a closed edge: %v", err)
	}
	if got := n.Load(); got != 2 {
		t.Fatalf("a closed edge's transport error counted as an answer (%d)", got)
	}
}
