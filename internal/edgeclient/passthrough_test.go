package edgeclient

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

func TestPassCodecKeepsTheWireBytes(t *testing.T) {
	ev := &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{ExitCode: 3, DurationSeconds: 0.25}}}
	wire, err := proto.Marshal(ev)
	if err != nil {
		t.Fatal(err)
	}
	buf := append([]byte(nil), wire...)
	var got dsecv1.ExecEvent
	if err := (passCodec{}).Unmarshal(buf, &got); err != nil {
		t.Fatal(err)
	}
	clear(buf) // Connect reuses its buffers: the message must not share them
	if got.GetEvent() != nil {
		t.Fatalf("the pass codec decoded the event: %v", got.GetEvent())
	}
	if !hasField(&got, execExited) {
		t.Error("hasField does not see the exited field in the raw bytes")
	}
	if hasField(&got, 2) {
		t.Error("hasField sees a stdout field that is not there")
	}
	out, err := (passCodec{}).Marshal(&got)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out, wire) {
		t.Fatalf("re-marshalled bytes differ:\n got %x\nwant %x", out, wire)
	}
	if n := (&dsecv1.ExecEvent{}).ProtoReflect().Descriptor().Fields().ByName("exited").Number(); n != execExited {
		t.Fatalf("ExecEvent.exited is field %d, execExited says %d", n, execExited)
	}
}

// edgeExec is an edge whose exec streams the events it is given.
type edgeExec struct {
	edgev1connect.UnimplementedEdgeServiceHandler
	events []*dsecv1.ExecEvent
}

func (e *edgeExec) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], out *connect.ServerStream[dsecv1.ExecEvent]) error {
	for _, ev := range e.events {
		if err := out.Send(ev); err != nil {
			return err
		}
	}
	return nil
}

// front is an apiserver's exec: it hands the stream to the remote edge.
type front struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	edge *Remote
}

func (f *front) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], out *connect.ServerStream[dsecv1.ExecEvent]) error {
	return f.edge.Exec(ctx, req, out)
}

// TestExecRelayedUndecoded: events cross an apiserver in front of a remote
// edge unchanged, large output included, and the stream ends with the exit.
func TestExecRelayedUndecoded(t *testing.T) {
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	events := []*dsecv1.ExecEvent{
		{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p1", Pid: 42}}},
		{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte("hello\n")}},
		{Event: &dsecv1.ExecEvent_Stderr{Stderr: big}},
		{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{ExitCode: 7}}},
	}
	mux := http.NewServeMux()
	mux.Handle(edgev1connect.NewEdgeServiceHandler(&edgeExec{events: events}))
	es := httptest.NewServer(mux)
	defer es.Close()
	fmux := http.NewServeMux()
	fmux.Handle(dsecv1connect.NewSandboxServiceHandler(&front{edge: New(es.Client(), es.Client(), es.URL, nil)}))
	fs := httptest.NewServer(fmux)
	defer fs.Close()

	c := dsecv1connect.NewSandboxServiceClient(fs.Client(), fs.URL)
	stream, err := c.Exec(context.Background(), connect.NewRequest(&dsecv1.ExecRequest{SandboxId: "x", Command: "true"}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	var got []*dsecv1.ExecEvent
	for stream.Receive() {
		got = append(got, proto.Clone(stream.Msg()).(*dsecv1.ExecEvent))
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if len(got) != len(events) {
		t.Fatalf("got %d events, want %d", len(got), len(events))
	}
	for i := range events {
		if !proto.Equal(got[i], events[i]) {
			t.Errorf("event %d: got %v, want %v", i, got[i], events[i])
		}
		if len(got[i].ProtoReflect().GetUnknown()) != 0 {
			t.Errorf("event %d reached the client with unknown fields", i)
		}
	}
}
