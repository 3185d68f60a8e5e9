package e2b

// envd's process service over dsec's exec API.
//
// Every command runs as a dsec background process (Exec with background
// set), so it outlives the request that started it, as envd's commands
// do; the request's Connect-Timeout-Ms becomes the command's timeout (0 or
// none: no limit). The pid in events is the command's pid in the sandbox,
// which dsec reports; the procTable maps it back to dsec's process ID
// (from the Exec's start event; a pid it does not know is looked up with
// ListProcesses). A command with a pty runs in a terminal of dsec's Shell
// stream, held here (pty.go).

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	processpb "dsec.dev/dsec/api/gen/e2b/process"
)

// processService is envd's process.Process.
type processService struct {
	h *Handler
}

// requestTimeout is the Connect-Timeout-Ms of a request, 0 for none.
func requestTimeout(h http.Header) (time.Duration, error) {
	v := h.Get("Connect-Timeout-Ms")
	if v == "" {
		return 0, nil
	}
	ms, err := strconv.ParseInt(v, 10, 64)
	if err != nil || ms < 0 {
		return 0, fmt.Errorf("Connect-Timeout-Ms %q is not a number of milliseconds", v)
	}
	return time.Duration(ms) * time.Millisecond, nil
}

func invalid(format string, args ...any) error {
	return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf(format, args...))
}

// deadlineSlack is how close to its deadline a request's failed call is
// taken for the deadline's doing.
const deadlineSlack = 100 * time.Millisecond

// dsecErr is a failed dsec call as a Connect error: dsec's code, with what
// was being done. A cancelled or expired request keeps its own code.
func dsecErr(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	// The calls below carry the request's deadline, and may see it pass a
	// moment before the request does.
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < deadlineSlack {
		return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("%s: the request's timeout (Connect-Timeout-Ms) passed", what))
	}
	return connect.NewError(connect.CodeOf(err), fmt.Errorf("%s: %s", what, messageOf(err)))
}

// argvOf is the argv a process config runs.
func argvOf(c *processpb.ProcessConfig) []string {
	return append([]string{c.GetCmd()}, c.GetArgs()...)
}

// cwdOf is the directory a command of t starts in: "" leaves it to the
// agent (the user's home, or the environment's workdir).
func cwdOf(t target, c *processpb.ProcessConfig) string {
	if c.GetCwd() == "" {
		return ""
	}
	return resolve(t, c.GetCwd())
}

// execRequest is the dsec Exec of an envd Start without a pty.
func execRequest(t target, m *processpb.StartRequest, timeout time.Duration) *dsecv1.ExecRequest {
	c := m.GetProcess()
	return &dsecv1.ExecRequest{
		SandboxId: t.ID,
		Argv:      argvOf(c),
		Env:       c.GetEnvs(),
		Cwd:       cwdOf(t, c),
		User:      userOf(t),
		// Without stdin (false), the command reads EOF at once; unset is
		// true, as older SDKs expect.
		KeepStdinOpen:  m.Stdin == nil || m.GetStdin(),
		TimeoutSeconds: timeout.Seconds(),
		Background:     true,
		Tag:            m.GetTag(),
	}
}

// Start runs a command and streams its events: start, output, end.
func (s *processService) Start(ctx context.Context, req *connect.Request[processpb.StartRequest], stream *connect.ServerStream[processpb.StartResponse]) error {
	t := targetOf(ctx)
	m := req.Msg
	if m.GetProcess().GetCmd() == "" {
		return invalid("process.cmd is required")
	}
	timeout, err := requestTimeout(req.Header())
	if err != nil {
		return invalid("%v", err)
	}
	send := func(ev *processpb.ProcessEvent) error { return stream.Send(&processpb.StartResponse{Event: ev}) }
	if m.Pty != nil {
		return s.startPTY(ctx, t, m, timeout, send)
	}
	es, err := s.h.api.Exec(ctx, connect.NewRequest(execRequest(t, m, timeout)))
	if err != nil {
		return dsecErr(ctx, "start "+m.GetProcess().GetCmd(), err)
	}
	defer es.Close()
	var e *procEntry
	ended, err := relay(es, 0, func(st *dsecv1.ExecStarted) error {
		e = &procEntry{id: st.GetProcessId(), pid: uint32(st.GetPid()), tag: m.GetTag(), config: m.GetProcess()}
		s.h.procs.put(t.ID, e)
		return send(startEvent(e.pid))
	}, send)
	if ended && e != nil {
		s.h.procs.drop(t.ID, e.pid, e.id)
	}
	if err != nil || ended {
		return err
	}
	return streamEnd(ctx, es.Err(), "the command "+m.GetProcess().GetCmd())
}

// streamEnd is the error of a dsec stream that ended before the exit.
func streamEnd(ctx context.Context, err error, what string) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil {
		return dsecErr(ctx, "follow "+what, err)
	}
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf("the events of %s ended before its exit", what))
}

// execStream is a dsec stream of exec events (Exec, Attach).
type execStream interface {
	Receive() bool
	Msg() *dsecv1.ExecEvent
}

// relay sends a dsec exec stream as envd's events: started through
// started, output as data (the first skip outputs dropped: what an Attach
// replays), keepalives as keepalives, the exit as the end. It reports
// whether the end was sent; a command that could not start is an
// invalid_argument error, as envd's.
func relay(es execStream, skip int, started func(*dsecv1.ExecStarted) error, send func(*processpb.ProcessEvent) error) (bool, error) {
	begun := false
	for es.Receive() {
		var err error
		switch ev := es.Msg().Event.(type) {
		case *dsecv1.ExecEvent_Started:
			begun = true
			err = started(ev.Started)
		case *dsecv1.ExecEvent_Stdout:
			if skip > 0 {
				skip--
				continue
			}
			err = send(dataEvent(ev.Stdout, false))
		case *dsecv1.ExecEvent_Stderr:
			if skip > 0 {
				skip--
				continue
			}
			err = send(dataEvent(ev.Stderr, true))
		case *dsecv1.ExecEvent_Keepalive:
			err = send(keepaliveEvent())
		case *dsecv1.ExecEvent_Exited:
			if !begun || ev.Exited.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_START_ERROR {
				return false, invalid("%s", startErrorText(ev.Exited))
			}
			return true, send(endEvent(ev.Exited))
		}
		if err != nil {
			return false, err
		}
	}
	return false, nil
}

func startErrorText(e *dsecv1.ExecExited) string {
	if e.GetMessage() != "" {
		return "start the command: " + e.GetMessage()
	}
	return "the command could not be started"
}

func startEvent(pid uint32) *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: pid}}}
}

func dataEvent(b []byte, stderr bool) *processpb.ProcessEvent {
	d := &processpb.ProcessEvent_DataEvent{Output: &processpb.ProcessEvent_DataEvent_Stdout{Stdout: b}}
	if stderr {
		d.Output = &processpb.ProcessEvent_DataEvent_Stderr{Stderr: b}
	}
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: d}}
}

func keepaliveEvent() *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Keepalive{Keepalive: &processpb.ProcessEvent_KeepAlive{}}}
}

// endEvent is envd's end of a dsec exit: status and error in Go's
// os.ProcessState words ("exit status 2", "signal: killed"), as envd
// reports them; error unset for exit code 0; dsec's reason (a timeout, the
// OOM killer) added to the error.
func endEvent(e *dsecv1.ExecExited) *processpb.ProcessEvent {
	end := &processpb.ProcessEvent_EndEvent{}
	if sig := e.GetSignal(); sig != 0 {
		end.ExitCode = -1
		end.Status = "signal: " + signalName(sig)
	} else {
		end.ExitCode = e.GetExitCode()
		end.Exited = true
		end.Status = "exit status " + strconv.Itoa(int(e.GetExitCode()))
	}
	if end.ExitCode != 0 {
		msg := end.Status
		switch e.GetStatus() {
		case dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT, dsecv1.ExitStatus_EXIT_STATUS_OOM:
			if e.GetMessage() != "" {
				msg += " (" + e.GetMessage() + ")"
			}
		}
		end.Error = &msg
	}
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: end}}
}

// signalName is a Linux signal in Go's words, as os.ProcessState says it.
func signalName(sig int32) string {
	names := [...]string{1: "hangup", 2: "interrupt", 3: "quit", 4: "illegal instruction", 5: "trace/breakpoint trap",
		6: "aborted", 7: "bus error", 8: "floating point exception", 9: "killed", 10: "user defined signal 1",
		11: "segmentation fault", 12: "user defined signal 2", 13: "broken pipe", 14: "alarm clock", 15: "terminated"}
	if sig > 0 && int(sig) < len(names) {
		return names[sig]
	}
	return "signal " + strconv.Itoa(int(sig))
}

// startPTY runs a command in a terminal. dsec's Shell does not say which
// process it started, so the start finds it in ListProcesses: the one
// with this argv that was not there before (terminal starts in a sandbox
// take turns here for that).
func (s *processService) startPTY(ctx context.Context, t target, m *processpb.StartRequest, timeout time.Duration, send func(*processpb.ProcessEvent) error) error {
	c := m.GetProcess()
	argv := argvOf(c)
	lock := s.h.procs.ptyLock(t.ID)
	lock.Lock()
	unlocked := false
	unlock := func() {
		if !unlocked {
			unlocked = true
			lock.Unlock()
		}
	}
	defer unlock()
	before, err := s.list(ctx, t.ID)
	if err != nil {
		return err
	}
	known := map[string]bool{}
	for _, p := range before {
		known[p.GetProcessId()] = true
	}

	// The terminal lives past this request, until its command exits or the
	// request's timeout passes.
	pctx, cancel := context.WithCancel(context.Background())
	if timeout > 0 {
		pctx, cancel = context.WithTimeout(context.Background(), timeout)
	}
	shell := s.h.api.Shell(pctx)
	sess := newPTYSession(shell, cancel)
	size := m.GetPty().GetSize()
	err = shell.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Start{Start: &dsecv1.ShellStart{
		SandboxId: t.ID, Argv: argv, Env: c.GetEnvs(), Cwd: cwdOf(t, c), User: userOf(t),
		Size: &dsecv1.TerminalSize{Rows: size.GetRows(), Cols: size.GetCols()},
	}}})
	if err != nil {
		cancel()
		return dsecErr(ctx, "open a terminal", err)
	}
	sub, leave := sess.subscribe()
	defer leave()
	go sess.run()

	p, err := s.findPTY(ctx, t.ID, argv, known, sess)
	if err != nil {
		cancel()
		return err
	}
	entry := &procEntry{id: p.GetProcessId(), pid: uint32(p.GetPid()), tag: m.GetTag(), config: c, pty: sess}
	s.h.procs.put(t.ID, entry)
	unlock()
	go func() {
		// Connect answers an ended terminal for a while, as envd does.
		<-sess.done
		time.AfterFunc(exitedWithin, func() { s.h.procs.drop(t.ID, entry.pid, entry.id) })
	}()
	if err := send(startEvent(entry.pid)); err != nil {
		return err
	}
	return sess.follow(ctx, sub, send)
}

// findPTY waits for the process of a terminal just opened to show in
// dsec's list: new (not in known), with argv, not already a terminal here.
func (s *processService) findPTY(ctx context.Context, sb string, argv []string, known map[string]bool, sess *ptySession) (*dsecv1.ProcessInfo, error) {
	deadline := time.Now().Add(10 * time.Second)
	for delay := time.Millisecond; ; delay = min(2*delay, 50*time.Millisecond) {
		ended := sess.ended()
		if ended {
			sess.mu.Lock()
			exit, err := sess.exit, sess.err
			sess.mu.Unlock()
			if err != nil {
				return nil, dsecErr(ctx, "open a terminal", err)
			}
			if exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_START_ERROR {
				return nil, invalid("%s", startErrorText(exit))
			}
		}
		list, err := s.list(ctx, sb)
		if err != nil {
			return nil, err
		}
		for i := len(list) - 1; i >= 0; i-- {
			p := list[i]
			if !known[p.GetProcessId()] && slices.Equal(p.GetArgv(), argv) && !s.h.procs.claimed(sb, p.GetProcessId()) {
				return p, nil
			}
		}
		if ended || time.Now().After(deadline) {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("the terminal's process did not show in the sandbox's process list"))
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-sess.done:
		case <-time.After(delay):
		}
	}
}

// list is dsec's process list of sandbox sb.
func (s *processService) list(ctx context.Context, sb string) ([]*dsecv1.ProcessInfo, error) {
	resp, err := s.h.api.ListProcesses(ctx, connect.NewRequest(&dsecv1.ListProcessesRequest{SandboxId: sb}))
	if err != nil {
		return nil, dsecErr(ctx, "list the sandbox's processes", err)
	}
	return resp.Msg.GetProcesses(), nil
}

// selectorText names a selector in messages.
func selectorText(sel *processpb.ProcessSelector) string {
	switch v := sel.GetSelector().(type) {
	case *processpb.ProcessSelector_Pid:
		return "process with pid " + strconv.FormatUint(uint64(v.Pid), 10)
	case *processpb.ProcessSelector_Tag:
		return "process with tag " + strconv.Quote(v.Tag)
	}
	return "process"
}

// found is a process a call names: its entry, whether that came from the
// table (and so may be stale), and, when it has exited, its exit.
type found struct {
	e      *procEntry
	cached bool
	exit   *dsecv1.ExecExited
}

// find is the process sel names in sandbox sb: from the table unless
// fresh, else from dsec's list, running (or, with window, exited at most
// that long ago). Not found is a not_found error, as envd's.
func (s *processService) find(ctx context.Context, sb string, sel *processpb.ProcessSelector, fresh bool, window time.Duration) (found, error) {
	switch v := sel.GetSelector().(type) {
	case *processpb.ProcessSelector_Pid:
		if !fresh {
			if e := s.h.procs.get(sb, v.Pid); e != nil {
				return found{e: e, cached: true}, nil
			}
		}
	case *processpb.ProcessSelector_Tag:
		if v.Tag == "" {
			return found{}, invalid("process.tag is empty")
		}
		if e := s.h.procs.ptyByTag(sb, v.Tag); e != nil {
			return found{e: e}, nil
		}
	default:
		return found{}, invalid("process: a pid or a tag is required")
	}
	list, err := s.list(ctx, sb)
	if err != nil {
		return found{}, err
	}
	p := pick(list, sel, window, time.Now())
	if p == nil {
		return found{}, connect.NewError(connect.CodeNotFound, fmt.Errorf("%s not found", selectorText(sel)))
	}
	e := s.h.procs.byID(sb, p.GetProcessId())
	if e == nil {
		e = &procEntry{id: p.GetProcessId(), pid: uint32(p.GetPid()), tag: p.GetTag()}
		if p.GetRunning() {
			s.h.procs.put(sb, e)
		}
	}
	if !p.GetRunning() {
		return found{e: e, exit: p.GetExited()}, nil
	}
	return found{e: e}, nil
}

// onProcess calls call on the running process sel names. A stale entry
// of the table (its process gone, its pid maybe another's now) is
// dropped, and the call made once more on what the pid is now. With
// fresh, the process is looked up in dsec's list whatever the table says.
func (s *processService) onProcess(ctx context.Context, sel *processpb.ProcessSelector, fresh bool, call func(*procEntry) error) error {
	sb := targetOf(ctx).ID
	f, err := s.find(ctx, sb, sel, fresh, 0)
	if err != nil {
		return err
	}
	err = call(f.e)
	if err == nil || !f.cached || f.e.pty != nil {
		return err
	}
	if c := connect.CodeOf(err); c != connect.CodeNotFound && c != connect.CodeFailedPrecondition {
		return err
	}
	s.h.procs.drop(sb, f.e.pid, f.e.id)
	g, ferr := s.find(ctx, sb, sel, true, 0)
	if ferr != nil {
		return ferr
	}
	if g.e.id == f.e.id {
		return err
	}
	return call(g.e)
}

// Connect streams a running command's events from now on: its start, its
// output, its end. A command that exited lately gets its start and end.
func (s *processService) Connect(ctx context.Context, req *connect.Request[processpb.ConnectRequest], stream *connect.ServerStream[processpb.ConnectResponse]) error {
	sb := targetOf(ctx).ID
	send := func(ev *processpb.ProcessEvent) error { return stream.Send(&processpb.ConnectResponse{Event: ev}) }
	f, err := s.find(ctx, sb, req.Msg.GetProcess(), false, exitedWithin)
	if err != nil {
		return err
	}
	if f.e.pty != nil {
		sub, leave := f.e.pty.subscribe()
		defer leave()
		if err := send(startEvent(f.e.pid)); err != nil {
			return err
		}
		return f.e.pty.follow(ctx, sub, send)
	}
	if f.exit != nil {
		if err := send(startEvent(f.e.pid)); err != nil {
			return err
		}
		return send(endEvent(f.exit))
	}
	// envd streams a command from the Connect on, while dsec's Attach
	// replays what it retained first: count the replay without following,
	// then skip as many outputs of the followed stream.
	skip := 0
	what := selectorText(req.Msg.GetProcess())
	rs, err := s.h.api.Attach(ctx, connect.NewRequest(&dsecv1.AttachRequest{SandboxId: sb, ProcessId: f.e.id, NoFollow: true}))
	if err != nil {
		return s.attachErr(ctx, sb, f, what, err)
	}
	var exit *dsecv1.ExecExited
	for rs.Receive() {
		switch ev := rs.Msg().Event.(type) {
		case *dsecv1.ExecEvent_Stdout, *dsecv1.ExecEvent_Stderr:
			skip++
		case *dsecv1.ExecEvent_Exited:
			exit = ev.Exited
		}
	}
	rerr := rs.Err()
	rs.Close()
	if rerr != nil {
		return s.attachErr(ctx, sb, f, what, rerr)
	}
	if exit != nil {
		if err := send(startEvent(f.e.pid)); err != nil {
			return err
		}
		return send(endEvent(exit))
	}
	as, err := s.h.api.Attach(ctx, connect.NewRequest(&dsecv1.AttachRequest{SandboxId: sb, ProcessId: f.e.id}))
	if err != nil {
		return s.attachErr(ctx, sb, f, what, err)
	}
	defer as.Close()
	ended, err := relay(as, skip, func(*dsecv1.ExecStarted) error { return send(startEvent(f.e.pid)) }, send)
	if ended {
		s.h.procs.drop(sb, f.e.pid, f.e.id)
	}
	if err != nil || ended {
		return err
	}
	return streamEnd(ctx, as.Err(), "the "+what)
}

// attachErr is a failed Attach: a process dsec forgot is not_found (and
// out of the table).
func (s *processService) attachErr(ctx context.Context, sb string, f found, what string, err error) error {
	if connect.CodeOf(err) == connect.CodeNotFound {
		s.h.procs.drop(sb, f.e.pid, f.e.id)
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("%s not found", what))
	}
	return dsecErr(ctx, "connect to the "+what, err)
}

// List is the sandbox's running commands, with the config they were
// started with as far as this apiserver knows it (else their argv).
func (s *processService) List(ctx context.Context, req *connect.Request[processpb.ListRequest]) (*connect.Response[processpb.ListResponse], error) {
	sb := targetOf(ctx).ID
	asked := time.Now()
	list, err := s.list(ctx, sb)
	if err != nil {
		return nil, err
	}
	resp := &processpb.ListResponse{Processes: []*processpb.ProcessInfo{}}
	running := map[string]bool{}
	for _, p := range list {
		if !p.GetRunning() || p.GetPid() <= 0 {
			continue
		}
		running[p.GetProcessId()] = true
		e := s.h.procs.byID(sb, p.GetProcessId())
		info := &processpb.ProcessInfo{Pid: uint32(p.GetPid()), Config: configOf(e, p)}
		tag := p.GetTag()
		if e != nil && e.tag != "" {
			tag = e.tag
		}
		if tag != "" {
			info.Tag = &tag
		}
		resp.Processes = append(resp.Processes, info)
	}
	s.h.procs.prune(sb, running, asked)
	return connect.NewResponse(resp), nil
}

// SendInput writes to a command's stdin, or a terminal's input.
func (s *processService) SendInput(ctx context.Context, req *connect.Request[processpb.SendInputRequest]) (*connect.Response[processpb.SendInputResponse], error) {
	if err := s.input(ctx, req.Msg.GetProcess(), req.Msg.GetInput()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.SendInputResponse{}), nil
}

// input writes in to the process sel names.
func (s *processService) input(ctx context.Context, sel *processpb.ProcessSelector, in *processpb.ProcessInput) error {
	sb := targetOf(ctx).ID
	what := selectorText(sel)
	switch v := in.GetInput().(type) {
	case *processpb.ProcessInput_Pty:
		return s.onProcess(ctx, sel, false, func(e *procEntry) error {
			if e.pty == nil {
				return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("the %s has no terminal: send its input as stdin", what))
			}
			return e.pty.send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Data{Data: v.Pty}})
		})
	case *processpb.ProcessInput_Stdin:
		return s.onProcess(ctx, sel, false, func(e *procEntry) error {
			if e.pty != nil {
				return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("the %s runs in a terminal: send its input as pty", what))
			}
			return s.writeStdin(ctx, sb, e, what, v.Stdin, false)
		})
	}
	return invalid("input: stdin or pty is required")
}

func (s *processService) writeStdin(ctx context.Context, sb string, e *procEntry, what string, data []byte, closeIt bool) error {
	_, err := s.h.api.WriteStdin(ctx, connect.NewRequest(&dsecv1.WriteStdinRequest{SandboxId: sb, ProcessId: e.id, Data: data, Close: closeIt}))
	if err == nil {
		return nil
	}
	switch connect.CodeOf(err) {
	case connect.CodeNotFound:
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("%s not found", what))
	case connect.CodeFailedPrecondition:
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("the stdin of the %s is closed (started without stdin, closed, or the command exited)", what))
	}
	return dsecErr(ctx, "write to the stdin of the "+what, err)
}

// StreamInput writes a client stream of input in order: a start naming
// the process first, then data.
func (s *processService) StreamInput(ctx context.Context, stream *connect.ClientStream[processpb.StreamInputRequest]) (*connect.Response[processpb.StreamInputResponse], error) {
	var sel *processpb.ProcessSelector
	for stream.Receive() {
		switch ev := stream.Msg().Event.(type) {
		case *processpb.StreamInputRequest_Start:
			f, err := s.find(ctx, targetOf(ctx).ID, ev.Start.GetProcess(), false, 0)
			if err != nil {
				return nil, err
			}
			// By pid from here on: a tag would be looked up for every input.
			sel = &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: f.e.pid}}
		case *processpb.StreamInputRequest_Data:
			if sel == nil {
				return nil, invalid("input stream: the first message must be start")
			}
			if err := s.input(ctx, sel, ev.Data.GetInput()); err != nil {
				return nil, err
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.StreamInputResponse{}), nil
}

// CloseStdin ends a command's stdin (EOF).
func (s *processService) CloseStdin(ctx context.Context, req *connect.Request[processpb.CloseStdinRequest]) (*connect.Response[processpb.CloseStdinResponse], error) {
	sel := req.Msg.GetProcess()
	what := selectorText(sel)
	err := s.onProcess(ctx, sel, false, func(e *procEntry) error {
		if e.pty != nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("the %s runs in a terminal: send ^D (0x04) to end its input", what))
		}
		return s.writeStdin(ctx, targetOf(ctx).ID, e, what, nil, true)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.CloseStdinResponse{}), nil
}

// SendSignal sends SIGTERM or SIGKILL to a command (and, as dsec signals,
// what it started).
func (s *processService) SendSignal(ctx context.Context, req *connect.Request[processpb.SendSignalRequest]) (*connect.Response[processpb.SendSignalResponse], error) {
	var sig int32
	switch req.Msg.GetSignal() {
	case processpb.Signal_SIGNAL_SIGKILL:
		sig = 9
	case processpb.Signal_SIGNAL_SIGTERM:
		sig = 15
	default:
		return nil, invalid("signal %d: only SIGTERM (15) and SIGKILL (9) are sent", req.Msg.GetSignal())
	}
	sel := req.Msg.GetProcess()
	what := selectorText(sel)
	sb := targetOf(ctx).ID
	// dsec's SIGKILL of an exited process succeeds: whether the process
	// still runs is asked of dsec's list, so a kill of one that has exited
	// is not_found, as the SDK's kill() expects.
	err := s.onProcess(ctx, sel, true, func(e *procEntry) error {
		if e.pty != nil && e.pty.ended() {
			return connect.NewError(connect.CodeNotFound, fmt.Errorf("%s not found", what))
		}
		_, err := s.h.api.Signal(ctx, connect.NewRequest(&dsecv1.SignalRequest{SandboxId: sb, ProcessId: e.id, Signal: sig}))
		if err == nil {
			return nil
		}
		switch connect.CodeOf(err) {
		case connect.CodeNotFound, connect.CodeFailedPrecondition: // gone, or exited
			return connect.NewError(connect.CodeNotFound, fmt.Errorf("%s not found (it has exited)", what))
		}
		return dsecErr(ctx, "signal the "+what, err)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.SendSignalResponse{}), nil
}

// Update resizes a command's terminal.
func (s *processService) Update(ctx context.Context, req *connect.Request[processpb.UpdateRequest]) (*connect.Response[processpb.UpdateResponse], error) {
	sel := req.Msg.GetProcess()
	what := selectorText(sel)
	err := s.onProcess(ctx, sel, false, func(e *procEntry) error {
		if req.Msg.Pty == nil {
			return nil
		}
		if e.pty == nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("the %s has no terminal to resize", what))
		}
		sz := req.Msg.GetPty().GetSize()
		return e.pty.send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Resize{Resize: &dsecv1.TerminalSize{Rows: sz.GetRows(), Cols: sz.GetCols()}}})
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.UpdateResponse{}), nil
}
