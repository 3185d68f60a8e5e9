package dsec

import (
	"context"
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Sandbox is one sandbox. Its methods are safe for concurrent use; Info is
// the last record seen and is updated by Refresh.
type Sandbox struct {
	ID   string
	c    *Client
	info *dsecv1.Sandbox
}

// Info is the sandbox's last known record.
func (s *Sandbox) Info() *dsecv1.Sandbox { return s.info }

// State is the last known state, e.g. "running" or "stopped".
func (s *Sandbox) State() string {
	return strings.ToLower(strings.TrimPrefix(s.info.GetState().String(), "STATE_"))
}

// Reason is why the sandbox stopped, e.g. "oom" or "ttl" ("unspecified" while it runs).
func (s *Sandbox) Reason() string {
	return strings.ToLower(strings.TrimPrefix(s.info.GetReason().String(), "REASON_"))
}

// Refresh fetches the sandbox's current record.
func (s *Sandbox) Refresh(ctx context.Context) error {
	n, err := s.c.Get(ctx, s.ID)
	if err != nil {
		return err
	}
	s.info = n.info
	return nil
}

// Delete stops the sandbox and removes everything it had.
func (s *Sandbox) Delete(ctx context.Context) error { return s.c.Delete(ctx, s.ID) }

// Pause freezes the sandbox and pushes its memory out of RAM; see
// Client.Pause.
func (s *Sandbox) Pause(ctx context.Context, keepMemory bool) (*PauseResult, error) {
	n, res, err := s.c.Pause(ctx, s.ID, keepMemory)
	if err != nil {
		return nil, err
	}
	s.info = n.info
	return res, nil
}

// SetTimeout moves the sandbox's TTL end to timeout from now; see
// Client.SetTimeout.
func (s *Sandbox) SetTimeout(ctx context.Context, timeout time.Duration, extendOnly bool) error {
	n, err := s.c.SetTimeout(ctx, s.ID, timeout, extendOnly)
	if err != nil {
		return err
	}
	s.info = n.info
	return nil
}

// Metrics reads the sandbox's resource use now; see Client.Metrics.
func (s *Sandbox) Metrics(ctx context.Context) (*dsecv1.SandboxMetrics, error) {
	return s.c.Metrics(ctx, s.ID)
}

// MetricsSince returns the samples of the sandbox's use its node took
// after since; see Client.MetricsSince.
func (s *Sandbox) MetricsSince(ctx context.Context, since time.Time) ([]MetricsSample, error) {
	return s.c.MetricsSince(ctx, s.ID, since)
}

// Snapshot packs the sandbox's file system into layer snap:NAME; see
// Client.Snapshot.
func (s *Sandbox) Snapshot(ctx context.Context, name string, exclude ...string) (*dsecv1.SnapshotInfo, error) {
	return s.c.Snapshot(ctx, s.ID, name, exclude...)
}

// Fork starts n sandboxes from one snapshot of this one; see Client.Fork.
func (s *Sandbox) Fork(ctx context.Context, n int, exclude ...string) (*dsecv1.SnapshotInfo, []ForkChild, error) {
	return s.c.Fork(ctx, s.ID, n, exclude...)
}

// ForkWith is Fork with options; see Client.ForkWith.
func (s *Sandbox) ForkWith(ctx context.Context, n int, o ForkOptions) (*dsecv1.SnapshotInfo, []ForkChild, error) {
	return s.c.ForkWith(ctx, s.ID, n, o)
}

// Resume lets a paused sandbox run again; already says it was running.
func (s *Sandbox) Resume(ctx context.Context) (already bool, err error) {
	n, already, err := s.c.Resume(ctx, s.ID)
	if err != nil {
		return false, err
	}
	s.info = n.info
	return already, nil
}

// Command is what Exec runs: a shell command line or an argv.
type Command struct {
	Shell string   // run under `sh -c` (the static shell of the agent)
	Argv  []string // run directly
}

// Sh is a shell command line.
func Sh(line string) Command { return Command{Shell: line} }

// Argv is a program and its arguments, run without a shell.
func Argv(argv ...string) Command { return Command{Argv: argv} }

// ExecOptions tune a command. The zero value (or nil) runs it as the
// sandbox's user, in its workdir, without a timeout.
type ExecOptions struct {
	// Timeout is enforced inside the sandbox: the whole process tree is
	// killed and the status is StatusTimeout.
	Timeout time.Duration
	Cwd     string
	Env     map[string]string
	User    string
	// Stdin is written to the command's stdin, which is then closed (Spawn
	// leaves it open for Job.WriteStdin). Up to 1 MiB goes in the exec
	// request, more is streamed once the command has started, so its size
	// is not bounded by one request.
	Stdin     []byte
	ShellPath string // another shell for Command.Shell
	// OnStdout and OnStderr, if set, get each chunk of output as it arrives.
	OnStdout func([]byte)
	OnStderr func([]byte)
}

// Status says how a command ended.
type Status string

const (
	StatusOK           Status = "ok"
	StatusNonzero      Status = "nonzero"
	StatusTimeout      Status = "timeout"
	StatusOOM          Status = "oom"
	StatusKilled       Status = "killed"
	StatusSandboxError Status = "sandbox_error" // the command could not be started
	StatusRunning      Status = "running"       // Job.Output of a process still running
)

// ExecResult is what a finished command did. A non-zero exit is a result,
// not an error; Err turns it into one.
type ExecResult struct {
	ExitCode int
	Stdout   []byte
	Stderr   []byte
	Duration time.Duration
	// Truncated says Stdout or Stderr lacks output the command wrote:
	// StdoutDropped and StderrDropped bytes of it, dropped by the node
	// because they came, past what it keeps of a command's output
	// (16 MiB a stream by default), while nothing read them. The call that
	// returns such a result also returns an error matching
	// ErrOutputDropped.
	Truncated     bool
	StdoutDropped int64
	StderrDropped int64

	Status    Status
	Signal    int
	Message   string
	ProcessID string
	PID       int
	// InfraFault is the platform's fault when the platform ended the
	// command (an OOM kill by a limit above the sandbox's own); FaultNone
	// when the task did. A command the platform cut off before it exited
	// (its sandbox deleted or reaped, its edge lost) gives no result but an
	// error whose InfraFault(err) says which.
	InfraFault Fault
	// Phase is the sandbox's phase when the command started
	// (CreateOptions.Phases); PhaseNone without phase budgets.
	Phase Phase
}

// Err is nil when the command succeeded, else an error matching ErrCommandFailed.
func (r *ExecResult) Err() error {
	if r.Status == StatusOK {
		return nil
	}
	msg := fmt.Sprintf("command exited with %s (exit code %d)", r.Status, r.ExitCode)
	if r.Message != "" {
		msg += ": " + r.Message
	}
	return &Error{Kind: ErrCommandFailed, Message: msg}
}

// dropErr is the error that comes with a result that lacks output, else nil.
func (r *ExecResult) dropErr() error {
	if r == nil || !r.Truncated {
		return nil
	}
	var missing []string
	if r.StdoutDropped > 0 {
		missing = append(missing, fmt.Sprintf("%d bytes of stdout", r.StdoutDropped))
	}
	if r.StderrDropped > 0 {
		missing = append(missing, fmt.Sprintf("%d bytes of stderr", r.StderrDropped))
	}
	if len(missing) == 0 {
		missing = append(missing, "output") // an agent that did not count it
	}
	return &Error{Kind: ErrOutputDropped, Message: fmt.Sprintf(
		"the result lacks %s the command wrote: the node dropped them, past what it keeps of a command's output, as nothing read them",
		strings.Join(missing, " and "))}
}

func statusOf(s dsecv1.ExitStatus, code int32) Status {
	switch s {
	case dsecv1.ExitStatus_EXIT_STATUS_OK:
		return StatusOK
	case dsecv1.ExitStatus_EXIT_STATUS_NONZERO:
		return StatusNonzero
	case dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT:
		return StatusTimeout
	case dsecv1.ExitStatus_EXIT_STATUS_OOM:
		return StatusOOM
	case dsecv1.ExitStatus_EXIT_STATUS_KILLED:
		return StatusKilled
	case dsecv1.ExitStatus_EXIT_STATUS_START_ERROR:
		return StatusSandboxError
	}
	if code == 0 {
		return StatusOK
	}
	return StatusNonzero
}

// EventType names the kinds of ExecEvent.
type EventType string

const (
	EventStarted EventType = "started"
	EventStdout  EventType = "stdout"
	EventStderr  EventType = "stderr"
	// EventDropped marks where the stream lacks Dropped bytes of Stream
	// (see ErrOutputDropped).
	EventDropped EventType = "dropped"
	EventExited  EventType = "exited"
)

// Event is one event of a streamed command.
type Event struct {
	Type      EventType
	Data      []byte      // stdout, stderr
	ProcessID string      // started
	PID       int         // started
	Tag       string      // started
	Stream    EventType   // dropped: EventStdout or EventStderr
	Dropped   int64       // dropped
	Result    *ExecResult // exited, with the output gathered so far
}

// collector turns ExecEvents into output buffers and, at the end, a result.
type collector struct {
	out, errb              []byte
	droppedOut, droppedErr int64
	truncated              bool // the exit said the stream lacked output
	processID, tag         string
	pid                    int
	phase                  Phase
	result                 *ExecResult
	onOut, onErr           func([]byte)
	onStarted              func(processID string)
}

func (c *collector) feed(ev *dsecv1.ExecEvent) *Event {
	switch e := ev.GetEvent().(type) {
	case *dsecv1.ExecEvent_Started:
		c.processID, c.pid, c.tag = e.Started.GetProcessId(), int(e.Started.GetPid()), e.Started.GetTag()
		c.phase = phaseOf(e.Started.GetPhase())
		if c.onStarted != nil {
			c.onStarted(c.processID)
		}
		return &Event{Type: EventStarted, ProcessID: c.processID, PID: c.pid, Tag: c.tag}
	case *dsecv1.ExecEvent_Stdout:
		c.out = append(c.out, e.Stdout...)
		if c.onOut != nil {
			c.onOut(e.Stdout)
		}
		return &Event{Type: EventStdout, Data: e.Stdout, ProcessID: c.processID}
	case *dsecv1.ExecEvent_Stderr:
		c.errb = append(c.errb, e.Stderr...)
		if c.onErr != nil {
			c.onErr(e.Stderr)
		}
		return &Event{Type: EventStderr, Data: e.Stderr, ProcessID: c.processID}
	case *dsecv1.ExecEvent_Dropped:
		stream, n := EventStdout, e.Dropped.GetBytes()
		if e.Dropped.GetStderr() {
			stream = EventStderr
			c.droppedErr += n
		} else {
			c.droppedOut += n
		}
		return &Event{Type: EventDropped, ProcessID: c.processID, Stream: stream, Dropped: n}
	case *dsecv1.ExecEvent_Exited:
		x := e.Exited
		c.truncated = x.GetStdoutTruncated() || x.GetStderrTruncated()
		if x.GetStdoutTruncated() {
			c.droppedOut = max(c.droppedOut, x.GetStdoutBytes()-int64(len(c.out)))
		}
		if x.GetStderrTruncated() {
			c.droppedErr = max(c.droppedErr, x.GetStderrBytes()-int64(len(c.errb)))
		}
		c.result = &ExecResult{
			ExitCode: int(x.GetExitCode()), Stdout: c.out, Stderr: c.errb,
			Duration: time.Duration(x.GetDurationSeconds() * float64(time.Second)),
			Status:   statusOf(x.GetStatus(), x.GetExitCode()), Signal: int(x.GetSignal()),
			Message: x.GetMessage(), ProcessID: c.processID, PID: c.pid, InfraFault: FaultFromProto(x.GetFault()),
			Phase: c.phase,
		}
		c.setDropped(c.result)
		return &Event{Type: EventExited, ProcessID: c.processID, Result: c.result}
	}
	return nil // keepalive
}

// setDropped puts what the stream lacked into r.
func (c *collector) setDropped(r *ExecResult) {
	r.StdoutDropped, r.StderrDropped = c.droppedOut, c.droppedErr
	r.Truncated = c.truncated || c.droppedOut > 0 || c.droppedErr > 0
}

// execRequest builds the Exec request, and the feed of a stdin too large
// for it (nil when the request carries all of it).
func (s *Sandbox) execRequest(cmd Command, o *ExecOptions) (*dsecv1.ExecRequest, *stdinFeed, error) {
	if o == nil {
		o = &ExecOptions{}
	}
	if (cmd.Shell == "") == (len(cmd.Argv) == 0) {
		return nil, nil, invalid("a command needs exactly one of Shell and Argv")
	}
	req := &dsecv1.ExecRequest{
		SandboxId: s.ID, Argv: cmd.Argv, Command: cmd.Shell, Shell: o.ShellPath, Env: o.Env,
		Cwd: o.Cwd, User: o.User, Stdin: o.Stdin, TimeoutSeconds: o.Timeout.Seconds(),
	}
	if len(o.Stdin) <= stdinInline {
		return req, nil, nil
	}
	req.Stdin, req.KeepStdinOpen = nil, true
	return req, &stdinFeed{sb: s, data: o.Stdin}, nil
}

// stdinInline is the most stdin an exec request carries itself (the API
// takes at most 63 MiB in one); more is streamed with WriteStdin in chunks
// of stdinChunk once the command has started.
const (
	stdinInline = 1 << 20
	stdinChunk  = 1 << 20
)

// stdinFeed streams a large stdin into a started command and closes it.
// Errors end it quietly: a command that exits or closes its stdin early
// takes no more input, and its exit status tells the rest.
type stdinFeed struct {
	sb     *Sandbox
	data   []byte
	cancel context.CancelFunc
	done   chan struct{}
}

// hook returns the collector's onStarted for the feed, which starts it.
func (f *stdinFeed) hook(ctx context.Context) func(string) {
	if f == nil {
		return nil
	}
	return func(processID string) {
		if f.done != nil {
			return
		}
		ctx, f.cancel = context.WithCancel(ctx)
		f.done = make(chan struct{})
		go func() {
			defer close(f.done)
			job := &Job{sb: f.sb, ProcessID: processID}
			job.WriteStdin(ctx, f.data, true)
		}()
	}
}

// stop ends the feed, if it is still writing, and waits for it.
func (f *stdinFeed) stop() {
	if f == nil || f.done == nil {
		return
	}
	f.cancel()
	<-f.done
}

// execCtx bounds a streamed call: the command's timeout plus a grace period
// for its report, or the caller's context alone when there is no timeout.
func execCtx(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	if timeout <= 0 {
		return context.WithCancel(ctx)
	}
	return withTimeout(ctx, timeout+execGrace)
}

// drive reads a stream of ExecEvents until the command exits.
func drive(stream *connect.ServerStreamForClient[dsecv1.ExecEvent], col *collector) (*ExecResult, error) {
	defer stream.Close()
	for col.result == nil && stream.Receive() {
		col.feed(stream.Msg())
	}
	if col.result != nil {
		return col.result, nil
	}
	if err := stream.Err(); err != nil {
		return nil, fromConnect(err, false)
	}
	return nil, &Error{Kind: ErrUnavailable, Code: connect.CodeUnavailable, Message: "the stream ended before the command exited"}
}

// Exec runs cmd and waits for it. Its stream follows the command from its
// start, so the result has all its output however much there is.
func (s *Sandbox) Exec(ctx context.Context, cmd Command, o *ExecOptions) (*ExecResult, error) {
	req, feed, err := s.execRequest(cmd, o)
	if err != nil {
		return nil, err
	}
	ctx, cancel := execCtx(ctx, o.timeout())
	defer cancel()
	stream, err := s.c.sb.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("exec in %s: %w", s.ID, fromConnect(err, false))
	}
	defer feed.stop()
	col := &collector{onStarted: feed.hook(ctx)}
	if o != nil {
		col.onOut, col.onErr = o.OnStdout, o.OnStderr
	}
	res, err := drive(stream, col)
	if err != nil {
		return nil, fmt.Errorf("exec in %s: %w", s.ID, err)
	}
	if err := res.dropErr(); err != nil {
		return res, fmt.Errorf("exec in %s: %w", s.ID, err)
	}
	return res, nil
}

func (o *ExecOptions) timeout() time.Duration {
	if o == nil {
		return 0
	}
	return o.Timeout
}

// ExecStream is a running command's event stream. Call Next until it
// returns false, then Err; Close abandons it (which kills the command).
type ExecStream struct {
	stream *connect.ServerStreamForClient[dsecv1.ExecEvent]
	cancel context.CancelFunc
	feed   *stdinFeed
	col    collector
	ev     *Event
	err    error
	done   bool
}

// ExecStream starts cmd and returns its events as they happen.
func (s *Sandbox) ExecStream(ctx context.Context, cmd Command, o *ExecOptions) (*ExecStream, error) {
	req, feed, err := s.execRequest(cmd, o)
	if err != nil {
		return nil, err
	}
	ctx, cancel := execCtx(ctx, o.timeout())
	stream, err := s.c.sb.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		cancel()
		return nil, fmt.Errorf("exec in %s: %w", s.ID, fromConnect(err, false))
	}
	x := &ExecStream{stream: stream, cancel: cancel, feed: feed}
	x.col.onStarted = x.feed.hook(ctx)
	return x, nil
}

// Next advances to the next event; false at the end or on error.
func (x *ExecStream) Next() bool {
	for !x.done {
		if !x.stream.Receive() {
			x.done = true
			if err := x.stream.Err(); err != nil {
				x.err = fromConnect(err, false)
			} else if x.col.result == nil {
				x.err = &Error{Kind: ErrUnavailable, Code: connect.CodeUnavailable, Message: "the stream ended before the command exited"}
			}
			x.Close()
			return false
		}
		if ev := x.col.feed(x.stream.Msg()); ev != nil {
			x.ev = ev
			if ev.Type == EventExited {
				x.err = ev.Result.dropErr()
				x.done = true
				x.Close()
			}
			return true
		}
	}
	return false
}

// Event is the current event.
func (x *ExecStream) Event() *Event { return x.ev }

// Err is the error that ended the stream, if any; after the exit event,
// one matching ErrOutputDropped when the stream lacked output.
func (x *ExecStream) Err() error { return x.err }

// Close ends the stream.
func (x *ExecStream) Close() error {
	x.done = true
	x.stream.Close()
	x.cancel()
	x.feed.stop()
	return nil
}

// SpawnOptions tune a background command.
type SpawnOptions struct {
	ExecOptions
	Tag string // a name to find the process by
}

// Spawn starts cmd in the background and returns once it runs. The process
// survives this connection; Job.Wait and Job.Output reattach to it. Its stdin
// stays open for Job.WriteStdin until written with close set.
func (s *Sandbox) Spawn(ctx context.Context, cmd Command, o *SpawnOptions) (*Job, error) {
	if o == nil {
		o = &SpawnOptions{}
	}
	req, feed, err := s.execRequest(cmd, &o.ExecOptions)
	if err != nil {
		return nil, err
	}
	req.Background, req.Tag, req.KeepStdinOpen = true, o.Tag, true
	ctx, cancel := withTimeout(ctx, s.c.timeout)
	defer cancel()
	stream, err := s.c.sb.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("spawn in %s: %w", s.ID, fromConnect(err, false))
	}
	defer stream.Close()
	col := &collector{}
	for col.processID == "" && col.result == nil && stream.Receive() {
		col.feed(stream.Msg())
	}
	if col.processID == "" {
		err := fromConnect(stream.Err(), false)
		if err == nil {
			err = &Error{Kind: ErrUnavailable, Code: connect.CodeUnavailable, Message: "the stream ended before the process started"}
		}
		return nil, fmt.Errorf("spawn in %s: %w", s.ID, err)
	}
	tag := col.tag
	if tag == "" {
		tag = o.Tag
	}
	job := &Job{sb: s, ProcessID: col.processID, PID: col.pid, Tag: tag}
	if feed != nil {
		// The request carried none of it; the process's stdin stays open.
		if err := job.WriteStdin(ctx, feed.data, false); err != nil {
			return job, fmt.Errorf("spawn in %s: write stdin: %w", s.ID, err)
		}
	}
	return job, nil
}

// Job is a background process in a sandbox.
type Job struct {
	sb        *Sandbox
	ProcessID string
	PID       int
	Tag       string
}

// Job is a handle on a background process by process ID or tag.
func (s *Sandbox) Job(processID, tag string) *Job {
	return &Job{sb: s, ProcessID: processID, Tag: tag}
}

func (j *Job) attachReq() *dsecv1.AttachRequest {
	if j.ProcessID != "" {
		return &dsecv1.AttachRequest{SandboxId: j.sb.ID, ProcessId: j.ProcessID}
	}
	return &dsecv1.AttachRequest{SandboxId: j.sb.ID, Tag: j.Tag}
}

// Wait waits for the process to exit and returns its result with its
// retained output and all it wrote since. A broken connection is retried
// (the output is replayed), so a daemon restart does not lose the result.
// Bound it with ctx. Output dropped before Wait followed the process comes
// with an error matching ErrOutputDropped, and the result.
func (j *Job) Wait(ctx context.Context) (*ExecResult, error) {
	var res *ExecResult
	err := j.sb.c.retry(ctx, false, func(ctx context.Context) error {
		stream, err := j.sb.c.sb.Attach(ctx, connect.NewRequest(j.attachReq()))
		if err != nil {
			return err
		}
		r, err := drive(stream, &collector{})
		if err != nil {
			return err
		}
		res = r
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("wait for process %s: %w", j.ProcessID+j.Tag, err)
	}
	if err := res.dropErr(); err != nil {
		return res, fmt.Errorf("wait for process %s: %w", j.ProcessID+j.Tag, err)
	}
	return res, nil
}

// Output returns the output retained so far, at once: it does not wait for
// more. While the process runs, the result's Status is StatusRunning and its
// ExitCode -1. Output dropped (past what the node keeps, while nothing read
// it) comes with an error matching ErrOutputDropped, and the result.
func (j *Job) Output(ctx context.Context) (*ExecResult, error) {
	ctx, cancel := withTimeout(ctx, j.sb.c.timeout)
	defer cancel()
	req := j.attachReq()
	req.NoFollow = true
	var res *ExecResult
	err := j.sb.c.retry(ctx, false, func(ctx context.Context) error {
		stream, err := j.sb.c.sb.Attach(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		defer stream.Close()
		col := &collector{}
		for stream.Receive() {
			col.feed(stream.Msg())
		}
		if err := stream.Err(); err != nil {
			return err
		}
		if col.processID != "" {
			j.ProcessID, j.PID = col.processID, col.pid
		}
		res = col.result
		if res == nil {
			res = &ExecResult{ExitCode: -1, Stdout: col.out, Stderr: col.errb, Status: StatusRunning,
				ProcessID: j.ProcessID, PID: j.PID}
			col.setDropped(res)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("output of process %s: %w", j.ProcessID+j.Tag, err)
	}
	if err := res.dropErr(); err != nil {
		return res, fmt.Errorf("output of process %s: %w", j.ProcessID+j.Tag, err)
	}
	return res, nil
}

func (j *Job) info(ctx context.Context) (*dsecv1.ProcessInfo, error) {
	ps, err := j.sb.Processes(ctx)
	if err != nil {
		return nil, err
	}
	for _, p := range ps {
		if p.GetProcessId() == j.ProcessID || (j.ProcessID == "" && p.GetTag() == j.Tag) {
			j.ProcessID = p.GetProcessId()
			return p, nil
		}
	}
	return nil, &Error{Kind: ErrNotFound, Code: connect.CodeNotFound,
		Message: fmt.Sprintf("process %s is not in sandbox %s", j.ProcessID+j.Tag, j.sb.ID)}
}

// Running reports whether the process still runs.
func (j *Job) Running(ctx context.Context) (bool, error) {
	p, err := j.info(ctx)
	if err != nil {
		return false, err
	}
	return p.GetRunning(), nil
}

// Kill sends sig to the process; 0 kills its whole tree with SIGKILL.
func (j *Job) Kill(ctx context.Context, sig int) error {
	if j.ProcessID == "" {
		if _, err := j.info(ctx); err != nil {
			return err
		}
	}
	return j.sb.c.unary(ctx, false, func(ctx context.Context) error {
		_, err := j.sb.c.sb.Signal(ctx, connect.NewRequest(&dsecv1.SignalRequest{SandboxId: j.sb.ID, ProcessId: j.ProcessID, Signal: int32(sig)}))
		return err
	})
}

// WriteStdin writes data to the process's stdin, in requests of at most
// 1 MiB, closing it after when closeAfter is set.
func (j *Job) WriteStdin(ctx context.Context, data []byte, closeAfter bool) error {
	for {
		n := min(len(data), stdinChunk)
		last := n == len(data)
		err := j.sb.c.unary(ctx, false, func(ctx context.Context) error {
			_, err := j.sb.c.sb.WriteStdin(ctx, connect.NewRequest(&dsecv1.WriteStdinRequest{
				SandboxId: j.sb.ID, ProcessId: j.ProcessID, Data: data[:n], Close: last && closeAfter}))
			return err
		})
		if err != nil || last {
			return err
		}
		data = data[n:]
	}
}

// Processes lists the sandbox's processes started through the API.
func (s *Sandbox) Processes(ctx context.Context) ([]*dsecv1.ProcessInfo, error) {
	var out []*dsecv1.ProcessInfo
	err := s.c.unary(ctx, true, func(ctx context.Context) error {
		r, err := s.c.sb.ListProcesses(ctx, connect.NewRequest(&dsecv1.ListProcessesRequest{SandboxId: s.ID}))
		if err == nil {
			out = r.Msg.GetProcesses()
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list processes of %s: %w", s.ID, err)
	}
	return out, nil
}

// Session is a named, stateful shell session: the working directory and
// exported variables a command leaves behind are what the next one starts with.
type Session struct {
	sb    *Sandbox
	Name  string
	Shell string // used when the session is made
	User  string // used when the session is made
}

// Session returns the session called name (made on first use).
func (s *Sandbox) Session(name string) *Session { return &Session{sb: s, Name: name} }

// Run runs a command line in the session; timeout 0 means none.
func (ss *Session) Run(ctx context.Context, cmd string, timeout time.Duration) (*ExecResult, error) {
	ctx, cancel := execCtx(ctx, timeout)
	defer cancel()
	stream, err := ss.sb.c.sb.SessionRun(ctx, connect.NewRequest(&dsecv1.SessionRunRequest{
		SandboxId: ss.sb.ID, Session: ss.Name, Command: cmd, TimeoutSeconds: timeout.Seconds(),
		Shell: ss.Shell, User: ss.User}))
	if err != nil {
		return nil, fmt.Errorf("run in session %s: %w", ss.Name, fromConnect(err, false))
	}
	res, err := drive(stream, &collector{})
	if err != nil {
		return nil, fmt.Errorf("run in session %s: %w", ss.Name, err)
	}
	if err := res.dropErr(); err != nil {
		return res, fmt.Errorf("run in session %s: %w", ss.Name, err)
	}
	return res, nil
}

// Interrupt sends SIGINT to the command running in the session.
func (ss *Session) Interrupt(ctx context.Context) error {
	return ss.sb.c.unary(ctx, false, func(ctx context.Context) error {
		_, err := ss.sb.c.sb.SessionInterrupt(ctx, connect.NewRequest(&dsecv1.SessionInterruptRequest{SandboxId: ss.sb.ID, Session: ss.Name}))
		return err
	})
}

// Close ends the session and kills what runs in it.
func (ss *Session) Close(ctx context.Context) error {
	return ss.sb.c.unary(ctx, false, func(ctx context.Context) error {
		_, err := ss.sb.c.sb.SessionClose(ctx, connect.NewRequest(&dsecv1.SessionCloseRequest{SandboxId: ss.sb.ID, Session: ss.Name}))
		return err
	})
}
