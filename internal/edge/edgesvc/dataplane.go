package edgesvc

import (
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/trajectory"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/flushhold"
	"dsec.dev/dsec/internal/grade"
	"dsec.dev/dsec/internal/shellrelay"
)

// The calls below run inside a sandbox: each is handed, unchanged, to the
// sandbox's agent, and the sandbox counts as active while it lasts.

type unaryCall[Req, Res any] func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error)

// clientStream is a stream of messages from the agent: a Connect server
// stream, or a framed exec (package execwire).
type clientStream[Res any] interface {
	Receive() bool
	Msg() *Res
	Err() error
	Close() error
}

type streamCall[Req, Res any] func(context.Context, *Req) (clientStream[Res], error)

// connectStream adapts a Connect server-streaming call.
func connectStream[Req, Res any](call func(context.Context, *connect.Request[Req]) (*connect.ServerStreamForClient[Res], error)) streamCall[Req, Res] {
	return func(ctx context.Context, msg *Req) (clientStream[Res], error) {
		s, err := call(ctx, connect.NewRequest(msg))
		if err != nil {
			return nil, err
		}
		return s, nil
	}
}

// agent finds the agent channel of a running sandbox.
func (s *Service) agent(ctx context.Context, id string) (agentclient.Client, func(), error) {
	if id == "" {
		return nil, nil, fmt.Errorf("sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	return s.edge.Agent(ctx, id)
}

// recordUnary is forwardUnary for a call that acts on the sandbox: it is
// recorded in the sandbox's trajectory as call.
func recordUnary[Req, Res any](ctx context.Context, s *Service, id, call string, msg *Req, pick func(agentclient.Client) unaryCall[Req, Res]) (*connect.Response[Res], error) {
	step := s.begin(ctx, id, call, msg)
	resp, err := forwardUnary(ctx, s, id, msg, pick)
	step.End(ctx, err)
	return resp, err
}

func forwardUnary[Req, Res any](ctx context.Context, s *Service, id string, msg *Req, pick func(agentclient.Client) unaryCall[Req, Res]) (*connect.Response[Res], error) {
	if id == "" {
		return nil, fmt.Errorf("sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	a, _, release, err := s.edge.AgentStarting(ctx, id)
	if err != nil {
		return nil, err
	}
	defer release()
	resp, err := pick(a)(ctx, connect.NewRequest(msg))
	if err != nil {
		return nil, s.agentErr(ctx, id, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

// sender is the sending half of a server stream: a Connect handler's, or
// the all-in-one apiserver's own, handed in unchanged.
type sender[Res any] interface {
	Send(*Res) error
}

// forwardStream relays a server stream from the agent. A command's stream
// (command: an exec, an attach, a session's run) counts as a call not yet
// started until its first event, so that a pause waits for it (a microVM
// paused to disk ends the agent channel; from its started event on the
// command's stream re-attaches across that). A stream recorded (step not
// nil) feeds its events to step.
func forwardStream[Req, Res any](ctx context.Context, s *Service, id string, msg *Req, out sender[Res], command bool, step *trajectory.Step, pick func(agentclient.Client) streamCall[Req, Res]) error {
	if id == "" {
		return fmt.Errorf("sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	var (
		a       agentclient.Client
		started func()
		release func()
		err     error
	)
	if command {
		a, started, release, err = s.edge.AgentStarting(ctx, id)
	} else {
		a, release, err = s.edge.Agent(ctx, id)
		started = func() {}
	}
	if err != nil {
		return err
	}
	defer release()
	in, err := pick(a)(ctx, msg)
	if err != nil {
		return s.agentErr(ctx, id, err)
	}
	defer in.Close()
	phase := dsecv1.Phase_PHASE_UNSPECIFIED
	if command {
		phase = s.edge.Phase(id) // the phase the command starts in
	}
	for in.Receive() {
		started()
		if phase != dsecv1.Phase_PHASE_UNSPECIFIED {
			if ev, ok := any(in.Msg()).(*dsecv1.ExecEvent); ok && ev.GetStarted() != nil {
				ev.GetStarted().Phase = phase
			}
		}
		if step != nil {
			if e, ok := any(in.Msg()).(*dsecv1.ExecEvent); ok {
				step.Event(e)
			}
		}
		// An exit is the last event: it leaves with the end of the stream.
		if e, ok := any(in.Msg()).(interface{ GetExited() *dsecv1.ExecExited }); ok && e.GetExited() != nil {
			flushhold.Hold(ctx)
		}
		if err := out.Send(in.Msg()); err != nil {
			return err
		}
	}
	if err := in.Err(); err != nil {
		return s.agentErr(ctx, id, err)
	}
	return nil
}

// Exec takes the agent channel's framed path, the fastest.
func (s *Service) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], out *connect.ServerStream[dsecv1.ExecEvent]) (err error) {
	began := time.Now()
	step, seq := s.beginSeq(ctx, req.Msg.GetSandboxId(), "exec", req.Msg)
	defer func() {
		step.End(ctx, err)
		if s.metrics != nil {
			s.metrics.Exec(s.edge.Isolation(req.Msg.GetSandboxId()), err, time.Since(began))
		}
	}()
	watch := execWatch{out: out, log: &s.execs, id: req.Msg.GetSandboxId(), command: commandKey(execCommand(req.Msg)),
		seq: seq, user: req.Msg.GetUser(),
		afterReward: req.Msg.GetAfter().GetKillUser() && req.Msg.GetAfter().GetReadFile() == grade.RewardFile}
	return forwardStream(ctx, s, req.Msg.GetSandboxId(), req.Msg, watch, true, step, func(a agentclient.Client) streamCall[dsecv1.ExecRequest, dsecv1.ExecEvent] {
		return func(ctx context.Context, req *dsecv1.ExecRequest) (clientStream[dsecv1.ExecEvent], error) {
			in, err := a.ExecEvents(ctx, req)
			if err != nil || req.GetAfter() == nil {
				return in, err
			}
			return &afterExit{in: in, ctx: ctx, agent: a, req: req}, nil
		}
	})
}

// maxAfterRead bounds the file ExecAfter.read_file reads back: a grade's
// reward, a number.
const maxAfterRead = 4 << 10

// afterExit is an exec's stream from the agent that, when the command
// exits and the agent did not do what its request's after asks
// (ExecAfter), does it before the exit goes on, and puts what it did on the exit (ExecExited.after): the kill
// of the command's user's leftovers and the read of a file, on the node,
// without two more calls from the caller. A command the platform ended
// (a fault) is left as it is. Where the kill or the read fails, the
// stream ends with that error instead of the exit.
type afterExit struct {
	in    agentclient.ExecStream
	ctx   context.Context
	agent agentclient.Client
	req   *dsecv1.ExecRequest
	err   error
}

func (a *afterExit) Receive() bool {
	if a.err != nil || !a.in.Receive() {
		return false
	}
	x := a.in.Msg().GetExited()
	if x == nil || x.GetFault() != dsecv1.Fault_FAULT_UNSPECIFIED || x.GetAfter() != nil {
		// No exit yet, the platform ended it, or the agent did the after
		// steps itself (an agent that could not, or that predates them,
		// leaves them to the node).
		return true
	}
	done, err := runAfter(a.ctx, a.agent, a.req)
	if err != nil {
		a.err = err
		return false
	}
	x.After = done
	return true
}

func (a *afterExit) Msg() *dsecv1.ExecEvent { return a.in.Msg() }
func (a *afterExit) Close() error           { return a.in.Close() }

func (a *afterExit) Err() error {
	if a.err != nil {
		return a.err
	}
	return a.in.Err()
}

// runAfter does what req.after asks once req's command has exited: kill
// what its user still runs in the sandbox, then read a file as root.
func runAfter(ctx context.Context, a agentclient.Client, req *dsecv1.ExecRequest) (*dsecv1.ExecAfterDone, error) {
	began := time.Now()
	after := req.GetAfter()
	done := &dsecv1.ExecAfterDone{}
	if after.GetKillUser() {
		kill, err := a.ExecEvents(ctx, &dsecv1.ExecRequest{SandboxId: req.GetSandboxId(),
			Command: "kill -9 -1 2>/dev/null; exit 0", User: req.GetUser(), TimeoutSeconds: 30})
		if err != nil {
			return nil, fmt.Errorf("kill what the command left: %w", err)
		}
		for kill.Receive() {
		}
		err = kill.Err()
		kill.Close()
		if err != nil {
			return nil, fmt.Errorf("kill what the command left: %w", err)
		}
	}
	if p := after.GetReadFile(); p != "" {
		rf, err := a.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: req.GetSandboxId(), Path: p, Limit: maxAfterRead, User: "root"}))
		switch {
		case connect.CodeOf(err) == connect.CodeNotFound:
			done.FileMissing = true
		case err != nil:
			return nil, fmt.Errorf("read %s after the command: %w", p, err)
		default:
			done.File = rf.Msg.GetData()
		}
	}
	done.DurationSeconds = time.Since(began).Seconds()
	return done, nil
}

func (s *Service) Attach(ctx context.Context, req *connect.Request[dsecv1.AttachRequest], out *connect.ServerStream[dsecv1.ExecEvent]) error {
	return forwardStream(ctx, s, req.Msg.GetSandboxId(), req.Msg, out, true, nil, func(a agentclient.Client) streamCall[dsecv1.AttachRequest, dsecv1.ExecEvent] {
		return connectStream(a.Attach)
	})
}

func (s *Service) SessionRun(ctx context.Context, req *connect.Request[dsecv1.SessionRunRequest], out *connect.ServerStream[dsecv1.ExecEvent]) (err error) {
	step := s.begin(ctx, req.Msg.GetSandboxId(), "session_run", req.Msg)
	defer func() { step.End(ctx, err) }()
	return forwardStream(ctx, s, req.Msg.GetSandboxId(), req.Msg, out, true, step, func(a agentclient.Client) streamCall[dsecv1.SessionRunRequest, dsecv1.ExecEvent] {
		return func(ctx context.Context, req *dsecv1.SessionRunRequest) (clientStream[dsecv1.ExecEvent], error) {
			in, err := a.SessionRun(ctx, connect.NewRequest(req))
			if err != nil {
				return nil, err
			}
			// A run outlives a microVM's pause to disk as an exec does.
			return agentclient.Reattaching(ctx, a.Attach, in), nil
		}
	})
}

func (s *Service) Download(ctx context.Context, req *connect.Request[dsecv1.DownloadRequest], out *connect.ServerStream[dsecv1.DownloadChunk]) error {
	return forwardStream(ctx, s, req.Msg.GetSandboxId(), req.Msg, out, false, nil, func(a agentclient.Client) streamCall[dsecv1.DownloadRequest, dsecv1.DownloadChunk] {
		return func(ctx context.Context, req *dsecv1.DownloadRequest) (clientStream[dsecv1.DownloadChunk], error) {
			// A download resumes across a microVM's pause to disk.
			return agentclient.ResumingDownload(ctx, a.Download, req)
		}
	})
}

func (s *Service) WatchDir(ctx context.Context, req *connect.Request[dsecv1.WatchDirRequest], out *connect.ServerStream[dsecv1.WatchEvent]) error {
	return forwardStream(ctx, s, req.Msg.GetSandboxId(), req.Msg, out, false, nil, func(a agentclient.Client) streamCall[dsecv1.WatchDirRequest, dsecv1.WatchEvent] {
		return func(ctx context.Context, req *dsecv1.WatchDirRequest) (clientStream[dsecv1.WatchEvent], error) {
			// A watch is set again after a microVM's pause to disk.
			return agentclient.Rewatching(ctx, a.WatchDir, req)
		}
	})
}

func (s *Service) WriteStdin(ctx context.Context, req *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error) {
	return recordUnary(ctx, s, req.Msg.GetSandboxId(), "write_stdin", req.Msg, func(a agentclient.Client) unaryCall[dsecv1.WriteStdinRequest, dsecv1.WriteStdinResponse] {
		return a.WriteStdin
	})
}

func (s *Service) Signal(ctx context.Context, req *connect.Request[dsecv1.SignalRequest]) (*connect.Response[dsecv1.SignalResponse], error) {
	return recordUnary(ctx, s, req.Msg.GetSandboxId(), "signal", req.Msg, func(a agentclient.Client) unaryCall[dsecv1.SignalRequest, dsecv1.SignalResponse] {
		return a.Signal
	})
}

func (s *Service) ListProcesses(ctx context.Context, req *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error) {
	return forwardUnary(ctx, s, req.Msg.GetSandboxId(), req.Msg, func(a agentclient.Client) unaryCall[dsecv1.ListProcessesRequest, dsecv1.ListProcessesResponse] {
		return a.ListProcesses
	})
}

func (s *Service) SessionInterrupt(ctx context.Context, req *connect.Request[dsecv1.SessionInterruptRequest]) (*connect.Response[dsecv1.SessionInterruptResponse], error) {
	return recordUnary(ctx, s, req.Msg.GetSandboxId(), "session_interrupt", req.Msg, func(a agentclient.Client) unaryCall[dsecv1.SessionInterruptRequest, dsecv1.SessionInterruptResponse] {
		return a.SessionInterrupt
	})
}

func (s *Service) SessionClose(ctx context.Context, req *connect.Request[dsecv1.SessionCloseRequest]) (*connect.Response[dsecv1.SessionCloseResponse], error) {
	return recordUnary(ctx, s, req.Msg.GetSandboxId(), "session_close", req.Msg, func(a agentclient.Client) unaryCall[dsecv1.SessionCloseRequest, dsecv1.SessionCloseResponse] {
		return a.SessionClose
	})
}

func (s *Service) ReadFile(ctx context.Context, req *connect.Request[dsecv1.ReadFileRequest]) (*connect.Response[dsecv1.ReadFileResponse], error) {
	return forwardUnary(ctx, s, req.Msg.GetSandboxId(), req.Msg, func(a agentclient.Client) unaryCall[dsecv1.ReadFileRequest, dsecv1.ReadFileResponse] {
		return a.ReadFile
	})
}

func (s *Service) WriteFile(ctx context.Context, req *connect.Request[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error) {
	return recordUnary(ctx, s, req.Msg.GetSandboxId(), "write_file", req.Msg, func(a agentclient.Client) unaryCall[dsecv1.WriteFileRequest, dsecv1.WriteFileResponse] {
		return a.WriteFile
	})
}

func (s *Service) ListDir(ctx context.Context, req *connect.Request[dsecv1.ListDirRequest]) (*connect.Response[dsecv1.ListDirResponse], error) {
	return forwardUnary(ctx, s, req.Msg.GetSandboxId(), req.Msg, func(a agentclient.Client) unaryCall[dsecv1.ListDirRequest, dsecv1.ListDirResponse] {
		return a.ListDir
	})
}

func (s *Service) Stat(ctx context.Context, req *connect.Request[dsecv1.StatRequest]) (*connect.Response[dsecv1.StatResponse], error) {
	return forwardUnary(ctx, s, req.Msg.GetSandboxId(), req.Msg, func(a agentclient.Client) unaryCall[dsecv1.StatRequest, dsecv1.StatResponse] {
		return a.Stat
	})
}

func (s *Service) Remove(ctx context.Context, req *connect.Request[dsecv1.RemoveRequest]) (*connect.Response[dsecv1.RemoveResponse], error) {
	return recordUnary(ctx, s, req.Msg.GetSandboxId(), "remove", req.Msg, func(a agentclient.Client) unaryCall[dsecv1.RemoveRequest, dsecv1.RemoveResponse] {
		return a.Remove
	})
}

func (s *Service) MakeDir(ctx context.Context, req *connect.Request[dsecv1.MakeDirRequest]) (*connect.Response[dsecv1.MakeDirResponse], error) {
	return recordUnary(ctx, s, req.Msg.GetSandboxId(), "make_dir", req.Msg, func(a agentclient.Client) unaryCall[dsecv1.MakeDirRequest, dsecv1.MakeDirResponse] {
		return a.MakeDir
	})
}

func (s *Service) Move(ctx context.Context, req *connect.Request[dsecv1.MoveRequest]) (*connect.Response[dsecv1.MoveResponse], error) {
	return recordUnary(ctx, s, req.Msg.GetSandboxId(), "move", req.Msg, func(a agentclient.Client) unaryCall[dsecv1.MoveRequest, dsecv1.MoveResponse] {
		return a.Move
	})
}

func (s *Service) Upload(ctx context.Context, req *connect.Request[dsecv1.UploadRequest]) (*connect.Response[dsecv1.UploadResponse], error) {
	return recordUnary(ctx, s, req.Msg.GetSandboxId(), "upload", req.Msg, func(a agentclient.Client) unaryCall[dsecv1.UploadRequest, dsecv1.UploadResponse] {
		return a.Upload
	})
}

// Shell pumps a bidirectional PTY stream between the caller and the agent.
func (s *Service) Shell(ctx context.Context, stream *connect.BidiStream[dsecv1.ShellInput, dsecv1.ShellOutput]) error {
	first, err := stream.Receive()
	if err != nil {
		return fmt.Errorf("read shell start: %w", err)
	}
	return s.ShellFrom(ctx, first, stream)
}

// ShellFrom is Shell for a caller that has read the stream's first message
// already (the apiserver reads it to route the stream).
func (s *Service) ShellFrom(ctx context.Context, first *dsecv1.ShellInput, stream shellrelay.Stream) error {
	start := first.GetStart()
	if start == nil {
		return fmt.Errorf("the first shell message must be start: %w", errdefs.ErrInvalidArgument)
	}
	id := start.GetSandboxId()
	if id == "" {
		return fmt.Errorf("sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	// A pause waits for the shell's start, as for a command's; from then
	// on its stream re-attaches across a microVM's pause to disk.
	a, started, release, err := s.edge.AgentStarting(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	step := s.begin(ctx, id, "shell", start)
	if step != nil {
		stream = recordedShell{Stream: stream, step: step}
	}
	open := func(ctx context.Context) shellrelay.Hop { return agentclient.ReattachingShell(ctx, a.Shell, started) }
	err = shellrelay.RelayHop(ctx, first, stream, open, func(err error) error { return s.agentErr(ctx, id, err) })
	step.End(ctx, err)
	return err
}

// recordedShell records a shell's input and output in its step.
type recordedShell struct {
	shellrelay.Stream
	step *trajectory.Step
}

func (r recordedShell) Receive() (*dsecv1.ShellInput, error) {
	in, err := r.Stream.Receive()
	if err == nil {
		r.step.Stdin(in.GetData())
	}
	return in, err
}

func (r recordedShell) Send(out *dsecv1.ShellOutput) error {
	switch o := out.GetOutput().(type) {
	case *dsecv1.ShellOutput_Data:
		r.step.Stdout(o.Data)
	case *dsecv1.ShellOutput_Exited:
		r.step.Exit(o.Exited.GetExitCode())
	}
	return r.Stream.Send(out)
}
