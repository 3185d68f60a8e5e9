package agentclient

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"path/filepath"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"

	"dsec.dev/dsec/api/gen/dsec/agent/v1/agentv1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// oldAgent serves only the Connect service, as agents from before the
// framed path did.
type oldAgent struct {
	agentv1connect.UnimplementedAgentServiceHandler
	execs int
}

func (a *oldAgent) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], s *connect.ServerStream[dsecv1.ExecEvent]) error {
	a.execs++
	if err := s.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte(req.Msg.GetArgv()[0])}}); err != nil {
		return err
	}
	return s.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{ExitCode: 4}}})
}

// TestOldAgentGetsConnectExec checks that exec still works, and runs once,
// on an agent that predates the framed path (one re-adopted after an
// upgrade of the edge).
func TestOldAgentGetsConnectExec(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	a := &oldAgent{}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewAgentServiceHandler(a))
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	defer srv.Close()

	c := Dial(path)
	defer c.Close()
	for i, word := range []string{"first", "second"} {
		s, err := c.ExecEvents(context.Background(), &dsecv1.ExecRequest{Argv: []string{word}})
		if err != nil {
			t.Fatalf("exec %d: %v", i, err)
		}
		var out string
		var code int32 = -1
		for s.Receive() {
			out += string(s.Msg().GetStdout())
			if e := s.Msg().GetExited(); e != nil {
				code = e.ExitCode
			}
		}
		if err := s.Err(); err != nil || out != word || code != 4 {
			t.Errorf("exec %d: stdout %q exit %d err %v", i, out, code, err)
		}
	}
	if a.execs != 2 {
		t.Errorf("the agent ran %d commands for 2 execs", a.execs)
	}
}

// bigFileAgent answers ReadFile with more than the agent's 64 KiB
// compression threshold.
type bigFileAgent struct {
	agentv1connect.UnimplementedAgentServiceHandler
}

func (bigFileAgent) ReadFile(ctx context.Context, req *connect.Request[dsecv1.ReadFileRequest]) (*connect.Response[dsecv1.ReadFileResponse], error) {
	return connect.NewResponse(&dsecv1.ReadFileResponse{Data: bytes.Repeat([]byte("a"), 256<<10)}), nil
}

// TestNoCompression: the client does not offer gzip, so the agent does not
// pack its answers (Go's transport offers it on its own unless told not
// to).
func TestNoCompression(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewAgentServiceHandler(bigFileAgent{}, connect.WithCompressMinBytes(64<<10)))
	var offered, packed atomic.Value
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mux.ServeHTTP(w, r)
		offered.Store(r.Header.Get("Accept-Encoding"))
		packed.Store(w.Header().Get("Content-Encoding"))
	})}
	go srv.Serve(ln)
	defer srv.Close()
	c := Dial(path)
	defer c.Close()
	resp, err := c.ReadFile(context.Background(), connect.NewRequest(&dsecv1.ReadFileRequest{Path: "/big"}))
	if err != nil || len(resp.Msg.GetData()) != 256<<10 {
		t.Fatalf("read file: %v", err)
	}
	if o, p := offered.Load(), packed.Load(); o != "" || p != "" {
		t.Errorf("offered %q, answer packed %q: want neither", o, p)
	}
}
