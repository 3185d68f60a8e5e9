package bench

// The floors of `dsec bench e2b`: each client against a server that does
// nothing. An E2B figure is what node and the SDK cost, plus the adapter,
// plus dsec's own work; a dsec figure is what its Go client costs plus the
// same work. Timing both clients against servers that answer at once
// (same machine, same run, same kind of connection as the real figures)
// separates the clients' costs from the server's, so the report can say
// what the E2B figure would be with an adapter that cost nothing.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	processpb "dsec.dev/dsec/api/gen/e2b/process"
	"dsec.dev/dsec/api/gen/e2b/process/processpbconnect"
	"dsec.dev/dsec/internal/e2b"
	dsec "dsec.dev/dsec/sdk/go"
)

// floors holds the two instant servers and a dsec client of the second.
type floors struct {
	e2bURL string     // E2B's control plane and envd, for the SDK's apiUrl and sandboxUrl
	dsec   *dsec.Conn // dsec's Go client, on an instant SandboxService
	close  func()
}

// startFloors starts the instant servers on loopback. dsecAddr is the
// address dsec's client uses in the real figures: a Unix socket there
// gives a Unix socket here, anything else loopback TCP with a token.
func startFloors(dsecAddr string) (*floors, error) {
	e2bLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("listen for the instant E2B server: %w", err)
	}
	e2bSrv := instantServer(instantE2B())
	go e2bSrv.Serve(e2bLn)

	var dsecLn net.Listener
	var dir, addr string
	if strings.HasPrefix(dsecAddr, "unix://") { // the first of the list, as the SDK spells a socket
		dir, err = os.MkdirTemp("", "dsec-bench-floor-")
		if err == nil {
			sock := filepath.Join(dir, "floor.sock")
			dsecLn, err = net.Listen("unix", sock)
			addr = "unix://" + sock
		}
	} else {
		dsecLn, err = net.Listen("tcp", "127.0.0.1:0")
		if err == nil {
			addr = dsecLn.Addr().String()
		}
	}
	if err != nil {
		e2bSrv.Close()
		if dir != "" {
			os.RemoveAll(dir)
		}
		return nil, fmt.Errorf("listen for the instant dsec server: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(&instantDsec{}))
	dsecSrv := instantServer(mux)
	go dsecSrv.Serve(dsecLn)
	closeAll := func() {
		e2bSrv.Close()
		dsecSrv.Close()
		if dir != "" {
			os.RemoveAll(dir)
		}
	}
	c, err := dsec.Dial(addr, dsec.DialOptions{Token: "instant-server"})
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("dial the instant dsec server: %w", err)
	}
	return &floors{e2bURL: "http://" + e2bLn.Addr().String(), dsec: c, close: closeAll}, nil
}

// instantServer serves h as dsecd serves its API: HTTP/1.1 and cleartext
// HTTP/2.
func instantServer(h http.Handler) *http.Server {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, Protocols: new(http.Protocols)}
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetUnencryptedHTTP2(true)
	return srv
}

// instantE2B answers what Sandbox.create, commands.run and kill send: a
// sandbox, a command that starts and exits 0, a deletion.
func instantE2B() http.Handler {
	mux := http.NewServeMux()
	mux.Handle(processpbconnect.NewProcessHandler(instantProcess{}))
	var n atomic.Int64
	create := func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		id := fmt.Sprintf("instant%d", n.Add(1))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(map[string]string{"templateID": "base", "sandboxID": id, "clientID": "instant",
			"envdVersion": e2b.EnvdVersion, "envdAccessToken": "instant", "trafficAccessToken": "instant"})
	}
	mux.HandleFunc("POST /sandboxes", create)
	mux.HandleFunc("POST /v2/sandboxes", create)
	mux.HandleFunc("DELETE /sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	return mux
}

// instantProcess is envd's process service whose commands exit at once.
type instantProcess struct {
	processpbconnect.UnimplementedProcessHandler
}

func (instantProcess) Start(ctx context.Context, req *connect.Request[processpb.StartRequest], stream *connect.ServerStream[processpb.StartResponse]) error {
	ev := func(e *processpb.ProcessEvent) error { return stream.Send(&processpb.StartResponse{Event: e}) }
	if err := ev(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: 1}}}); err != nil {
		return err
	}
	return ev(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: &processpb.ProcessEvent_EndEvent{Exited: true, Status: "exit status 0"}}})
}

// instantDsec is dsec's SandboxService whose sandboxes exist at once and
// whose commands exit 0 at once.
type instantDsec struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	n atomic.Int64
}

func (s *instantDsec) Create(ctx context.Context, req *connect.Request[dsecv1.CreateRequest]) (*connect.Response[dsecv1.CreateResponse], error) {
	sb := &dsecv1.Sandbox{Id: fmt.Sprintf("sb-instant-%d", s.n.Add(1)), Spec: req.Msg.GetSpec(), State: dsecv1.State_STATE_RUNNING}
	return connect.NewResponse(&dsecv1.CreateResponse{Sandboxes: []*dsecv1.Sandbox{sb}}), nil
}

func (s *instantDsec) Delete(ctx context.Context, req *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error) {
	return connect.NewResponse(&dsecv1.DeleteResponse{}), nil
}

func (s *instantDsec) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], stream *connect.ServerStream[dsecv1.ExecEvent]) error {
	if err := stream.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p1", Pid: 1}}}); err != nil {
		return err
	}
	return stream.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}})
}
