package apiserver

import (
	"context"
	"errors"
	"fmt"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/shellrelay"
)

// maxExecStdin is the most stdin one exec request may carry: what the
// agent channel's framed path (package execwire) takes in one frame, less
// room for the rest of the request. Larger stdin is streamed with
// WriteStdin.
const maxExecStdin = 63 << 20

// The calls below run inside a sandbox: each is checked, then handed
// unchanged to the edge that holds the sandbox, which hands it to the
// sandbox's agent. An in-process edge gets the caller's own stream.

func (s *Server) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], out *connect.ServerStream[dsecv1.ExecEvent]) error {
	m := req.Msg
	if len(m.GetArgv()) == 0 && m.GetCommand() == "" {
		return fmt.Errorf("exec needs argv or command: %w", errdefs.ErrInvalidArgument)
	}
	if len(m.GetArgv()) > 0 && m.GetCommand() != "" {
		return fmt.Errorf("exec takes argv or command, not both: %w", errdefs.ErrInvalidArgument)
	}
	if m.GetTimeoutSeconds() < 0 {
		return fmt.Errorf("timeout_seconds must not be negative: %w", errdefs.ErrInvalidArgument)
	}
	if n := len(m.GetStdin()); n > maxExecStdin {
		return fmt.Errorf("stdin of %d bytes is over the %d MiB an exec can carry; set keep_stdin_open and stream it with WriteStdin, or write it to a file: %w",
			n, maxExecStdin>>20, errdefs.ErrInvalidArgument)
	}
	e, err := s.sandboxEdge(ctx, m.GetSandboxId())
	if err != nil {
		return err
	}
	return s.whileRoutable(ctx, m.GetSandboxId(), func(ctx context.Context) error { return e.Exec(ctx, req, out) })
}

func (s *Server) Attach(ctx context.Context, req *connect.Request[dsecv1.AttachRequest], out *connect.ServerStream[dsecv1.ExecEvent]) error {
	if req.Msg.GetProcessId() == "" && req.Msg.GetTag() == "" {
		return fmt.Errorf("attach: process_id or tag is required: %w", errdefs.ErrInvalidArgument)
	}
	e, err := s.sandboxEdge(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	return s.whileRoutable(ctx, req.Msg.GetSandboxId(), func(ctx context.Context) error { return e.Attach(ctx, req, out) })
}

func (s *Server) SessionRun(ctx context.Context, req *connect.Request[dsecv1.SessionRunRequest], out *connect.ServerStream[dsecv1.ExecEvent]) error {
	if req.Msg.GetSession() == "" {
		return fmt.Errorf("session name is required: %w", errdefs.ErrInvalidArgument)
	}
	e, err := s.sandboxEdge(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	return s.whileRoutable(ctx, req.Msg.GetSandboxId(), func(ctx context.Context) error { return e.SessionRun(ctx, req, out) })
}

func (s *Server) Download(ctx context.Context, req *connect.Request[dsecv1.DownloadRequest], out *connect.ServerStream[dsecv1.DownloadChunk]) error {
	e, err := s.sandboxEdge(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	return e.Download(ctx, req, out)
}

func (s *Server) WatchDir(ctx context.Context, req *connect.Request[dsecv1.WatchDirRequest], out *connect.ServerStream[dsecv1.WatchEvent]) error {
	if req.Msg.GetPath() == "" {
		return fmt.Errorf("watch needs a path: %w", errdefs.ErrInvalidArgument)
	}
	e, err := s.sandboxEdge(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	return e.WatchDir(ctx, req, out)
}

// routeCheckEvery is how often a relayed command's stream checks that its
// sandbox's node is still routable: the watcher's polls come about once a
// second.
const routeCheckEvery = time.Second

// whileRoutable runs call, a command's stream relayed to the edge of
// sandbox id, on a context cut with Unavailable once the watcher finds the
// node unroutable mid-call. An edge that is stopped (SIGSTOP, a frozen VM)
// or cut off keeps its connections open, so without this the stream would
// wait for the caller's deadline, and the caller would take the platform's
// fault for its own timeout (docs/outcomes.md: edge_unreachable).
func (s *Server) whileRoutable(ctx context.Context, id string, call func(context.Context) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() {
		tick := time.NewTicker(routeCheckEvery)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				if _, err := s.edgeFor(id); errors.Is(err, errdefs.ErrUnavailable) {
					cancel(fmt.Errorf("the sandbox's node stopped answering mid-call: %w", err))
					return
				}
			}
		}
	}()
	err := call(ctx)
	if cause := context.Cause(ctx); err != nil && errors.Is(cause, errdefs.ErrUnavailable) {
		return cause
	}
	return err
}

// forward hands a unary call to the edge of the sandbox it names.
func forward[Req, Res any](ctx context.Context, s *Server, id string, req *connect.Request[Req], pick func(Edge) func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error)) (*connect.Response[Res], error) {
	e, err := s.sandboxEdge(ctx, id)
	if err != nil {
		return nil, err
	}
	return pick(e)(ctx, req)
}

func (s *Server) WriteStdin(ctx context.Context, req *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error) {
		return e.WriteStdin
	})
}

func (s *Server) Signal(ctx context.Context, req *connect.Request[dsecv1.SignalRequest]) (*connect.Response[dsecv1.SignalResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.SignalRequest]) (*connect.Response[dsecv1.SignalResponse], error) {
		return e.Signal
	})
}

func (s *Server) ListProcesses(ctx context.Context, req *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error) {
		return e.ListProcesses
	})
}

func (s *Server) SessionInterrupt(ctx context.Context, req *connect.Request[dsecv1.SessionInterruptRequest]) (*connect.Response[dsecv1.SessionInterruptResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.SessionInterruptRequest]) (*connect.Response[dsecv1.SessionInterruptResponse], error) {
		return e.SessionInterrupt
	})
}

func (s *Server) SessionClose(ctx context.Context, req *connect.Request[dsecv1.SessionCloseRequest]) (*connect.Response[dsecv1.SessionCloseResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.SessionCloseRequest]) (*connect.Response[dsecv1.SessionCloseResponse], error) {
		return e.SessionClose
	})
}

func (s *Server) ReadFile(ctx context.Context, req *connect.Request[dsecv1.ReadFileRequest]) (*connect.Response[dsecv1.ReadFileResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.ReadFileRequest]) (*connect.Response[dsecv1.ReadFileResponse], error) {
		return e.ReadFile
	})
}

func (s *Server) WriteFile(ctx context.Context, req *connect.Request[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error) {
		return e.WriteFile
	})
}

func (s *Server) ListDir(ctx context.Context, req *connect.Request[dsecv1.ListDirRequest]) (*connect.Response[dsecv1.ListDirResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.ListDirRequest]) (*connect.Response[dsecv1.ListDirResponse], error) {
		return e.ListDir
	})
}

func (s *Server) Stat(ctx context.Context, req *connect.Request[dsecv1.StatRequest]) (*connect.Response[dsecv1.StatResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.StatRequest]) (*connect.Response[dsecv1.StatResponse], error) {
		return e.Stat
	})
}

func (s *Server) Remove(ctx context.Context, req *connect.Request[dsecv1.RemoveRequest]) (*connect.Response[dsecv1.RemoveResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.RemoveRequest]) (*connect.Response[dsecv1.RemoveResponse], error) {
		return e.Remove
	})
}

func (s *Server) MakeDir(ctx context.Context, req *connect.Request[dsecv1.MakeDirRequest]) (*connect.Response[dsecv1.MakeDirResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.MakeDirRequest]) (*connect.Response[dsecv1.MakeDirResponse], error) {
		return e.MakeDir
	})
}

func (s *Server) Move(ctx context.Context, req *connect.Request[dsecv1.MoveRequest]) (*connect.Response[dsecv1.MoveResponse], error) {
	if req.Msg.GetSource() == "" || req.Msg.GetDestination() == "" {
		return nil, fmt.Errorf("move needs a source and a destination: %w", errdefs.ErrInvalidArgument)
	}
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.MoveRequest]) (*connect.Response[dsecv1.MoveResponse], error) {
		return e.Move
	})
}

func (s *Server) Upload(ctx context.Context, req *connect.Request[dsecv1.UploadRequest]) (*connect.Response[dsecv1.UploadResponse], error) {
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.UploadRequest]) (*connect.Response[dsecv1.UploadResponse], error) {
		return e.Upload
	})
}

// shellRouter is what an Edge offers beyond EdgeService for shells: the
// apiserver reads the stream's first message to route it, and the edge
// takes the stream from there. Both edgesvc.Service and edgeclient.Remote
// have it.
type shellRouter interface {
	ShellFrom(ctx context.Context, first *dsecv1.ShellInput, stream shellrelay.Stream) error
}

// Shell routes a PTY stream by the sandbox its first message names.
func (s *Server) Shell(ctx context.Context, stream *connect.BidiStream[dsecv1.ShellInput, dsecv1.ShellOutput]) error {
	first, err := stream.Receive()
	if err != nil {
		return fmt.Errorf("read shell start: %w", err)
	}
	start := first.GetStart()
	if start == nil {
		return fmt.Errorf("the first shell message must be start: %w", errdefs.ErrInvalidArgument)
	}
	e, err := s.sandboxEdge(ctx, start.GetSandboxId())
	if err != nil {
		return err
	}
	r, ok := e.(shellRouter)
	if !ok {
		return fmt.Errorf("shell: the edge of sandbox %s cannot take a routed stream: %w", start.GetSandboxId(), errdefs.ErrNotSupported)
	}
	return r.ShellFrom(ctx, first, stream)
}
