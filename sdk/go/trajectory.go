package dsec

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TrajectoryLine is one line of a sandbox's trajectory (docs/trajectories.md):
// its begin line, a call that acted on it, a network event, or its end.
type TrajectoryLine struct {
	Seq  int64     `json:"seq"`
	Type string    `json:"type"` // begin, call, net or end
	Time time.Time `json:"time"`

	Sandbox *TrajectorySandbox `json:"sandbox,omitempty"`

	Call       string            `json:"call,omitempty"`
	Args       json.RawMessage   `json:"args,omitempty"` // the request as protojson
	ArgsSHA256 string            `json:"args_sha256,omitempty"`
	ArgsBytes  int               `json:"args_bytes,omitempty"`
	DurationMs float64           `json:"duration_ms,omitempty"`
	Exit       *int32            `json:"exit,omitempty"`
	Error      string            `json:"error,omitempty"`
	Stdout     *TrajectoryOutput `json:"stdout,omitempty"`
	Stderr     *TrajectoryOutput `json:"stderr,omitempty"`
	Stdin      *TrajectoryOutput `json:"stdin,omitempty"`
	Degraded   bool              `json:"degraded,omitempty"`

	Net json.RawMessage `json:"net,omitempty"`
	End json.RawMessage `json:"end,omitempty"`
}

// TrajectorySandbox is a trajectory's begin line: the sandbox it records.
type TrajectorySandbox struct {
	ID           string          `json:"id"`
	Node         string          `json:"node,omitempty"`
	Project      string          `json:"project,omitempty"`
	Environment  string          `json:"environment,omitempty"`
	Isolation    string          `json:"isolation,omitempty"`
	NetworkRules map[string]bool `json:"network_rules,omitempty"`
}

// TrajectoryOutput is what one stream of a call wrote: size and SHA-256
// always, its first bytes as Text (or Base64) up to the node's cap.
type TrajectoryOutput struct {
	Bytes     int64  `json:"bytes"`
	SHA256    string `json:"sha256"`
	Text      string `json:"text,omitempty"`
	Base64    string `json:"base64,omitempty"`
	Truncated bool   `json:"truncated,omitempty"`
}

// TrajectoryRead is one read of a trajectory from an offset.
type TrajectoryRead struct {
	Lines      []byte // whole JSON lines
	NextOffset int64
	Size       int64
	Ended      bool   // the sandbox is gone: the trajectory is complete
	SHA256     string // of the first Size bytes: the trajectory's hash once Ended
}

// ReadTrajectory reads sandbox id's trajectory from offset (bytes already
// read), up to the node's bound per read: a trainer that lost its
// connection reads what it missed from where it stopped.
func (c *Client) ReadTrajectory(ctx context.Context, id string, offset int64) (*TrajectoryRead, error) {
	var out *TrajectoryRead
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.sb.Trajectory(ctx, connect.NewRequest(&dsecv1.TrajectoryRequest{SandboxId: id, Offset: offset}))
		if err == nil {
			m := r.Msg
			out = &TrajectoryRead{Lines: m.GetLines(), NextOffset: m.GetNextOffset(), Size: m.GetSize(), Ended: m.GetEnded(), SHA256: m.GetSha256()}
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("read trajectory of %s: %w", id, err)
	}
	return out, nil
}

// Trajectory writes sandbox id's whole trajectory, as recorded so far, to
// w as JSON lines, and returns its SHA-256 (hex): its hash, once ended.
func (c *Client) Trajectory(ctx context.Context, id string, w io.Writer) (sum string, ended bool, err error) {
	var off int64
	for {
		r, err := c.ReadTrajectory(ctx, id, off)
		if err != nil {
			return "", false, err
		}
		if _, err := w.Write(r.Lines); err != nil {
			return "", false, fmt.Errorf("write trajectory of %s: %w", id, err)
		}
		off = r.NextOffset
		if off >= r.Size || len(r.Lines) == 0 {
			return r.SHA256, r.Ended, nil
		}
	}
}

// ParseTrajectory reads a trajectory's JSON lines.
func ParseTrajectory(r io.Reader) ([]TrajectoryLine, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 256<<20)
	var out []TrajectoryLine
	for n := 1; sc.Scan(); n++ {
		if len(bytes.TrimSpace(sc.Bytes())) == 0 {
			continue
		}
		var l TrajectoryLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return nil, fmt.Errorf("parse trajectory line %d: %w", n, err)
		}
		out = append(out, l)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read trajectory: %w", err)
	}
	return out, nil
}

// ReplayOptions shapes a replay.
type ReplayOptions struct {
	// Environment replaces the trajectory's environment ("": the same).
	Environment string
	// OnStep, if set, is called with each step as it is compared.
	OnStep func(ReplayStep)
}

// Replay step verdicts.
const (
	ReplayMatch    = "match"    // same exit (or error) and same output
	ReplayDiverged = "diverged" // exit, error or output differ
	ReplaySkipped  = "skipped"  // not replayed (see Detail)
)

// ReplayStep is one recorded call as replayed.
type ReplayStep struct {
	Seq     int64  `json:"seq"`
	Call    string `json:"call"`
	Verdict string `json:"verdict"`
	Detail  string `json:"detail,omitempty"` // what differs, or why skipped
	// For commands: the exits and the outputs' hashes, recorded and now.
	WantExit   *int32 `json:"want_exit,omitempty"`
	GotExit    *int32 `json:"got_exit,omitempty"`
	WantStdout string `json:"want_stdout_sha256,omitempty"`
	GotStdout  string `json:"got_stdout_sha256,omitempty"`
	WantStderr string `json:"want_stderr_sha256,omitempty"`
	GotStderr  string `json:"got_stderr_sha256,omitempty"`
}

// ReplayReport is a replay's result.
type ReplayReport struct {
	Sandbox  string       `json:"sandbox"` // the fresh sandbox it ran in (deleted)
	Steps    []ReplayStep `json:"steps"`
	Matched  int          `json:"matched"`
	Diverged int          `json:"diverged"`
	Skipped  int          `json:"skipped"`
}

// Deterministic says every replayed step matched.
func (r *ReplayReport) Deterministic() bool { return r.Diverged == 0 }

// Replay runs a trajectory's calls in order in a fresh sandbox of the same
// environment (or o.Environment) and network rules, and compares each with
// its record: a command's exit code and the SHA-256 of its stdout and
// stderr, another call's success or failure. Calls that cannot be redone
// apart from their sandbox (pause, resume, snapshot, fork, shell, delete),
// and those whose arguments the trajectory kept only as a hash, are
// skipped. The sandbox is deleted at the end.
func (c *Client) Replay(ctx context.Context, lines []TrajectoryLine, o *ReplayOptions) (*ReplayReport, error) {
	if o == nil {
		o = &ReplayOptions{}
	}
	var begin *TrajectorySandbox
	for _, l := range lines {
		if l.Type == "begin" {
			begin = l.Sandbox
			break
		}
	}
	if begin == nil {
		return nil, fmt.Errorf("replay: the trajectory has no begin line: %w", ErrInvalidArgument)
	}
	env := begin.Environment
	if o.Environment != "" {
		env = o.Environment
	}
	sb, err := c.Create(ctx, env, &CreateOptions{NetworkRules: begin.NetworkRules, Isolation: begin.Isolation})
	if err != nil {
		return nil, fmt.Errorf("replay: %w", err)
	}
	defer c.Delete(context.WithoutCancel(ctx), sb.ID)
	rep := &ReplayReport{Sandbox: sb.ID}
	for _, l := range lines {
		if l.Type != "call" {
			continue
		}
		st := c.replayStep(ctx, sb.ID, l)
		switch st.Verdict {
		case ReplayMatch:
			rep.Matched++
		case ReplayDiverged:
			rep.Diverged++
		default:
			rep.Skipped++
		}
		rep.Steps = append(rep.Steps, st)
		if o.OnStep != nil {
			o.OnStep(st)
		}
	}
	return rep, nil
}

// replayed are the calls a replay redoes, by the request each takes.
var replayed = map[string]func() proto.Message{
	"exec":              func() proto.Message { return &dsecv1.ExecRequest{} },
	"session_run":       func() proto.Message { return &dsecv1.SessionRunRequest{} },
	"write_file":        func() proto.Message { return &dsecv1.WriteFileRequest{} },
	"upload":            func() proto.Message { return &dsecv1.UploadRequest{} },
	"remove":            func() proto.Message { return &dsecv1.RemoveRequest{} },
	"make_dir":          func() proto.Message { return &dsecv1.MakeDirRequest{} },
	"move":              func() proto.Message { return &dsecv1.MoveRequest{} },
	"write_stdin":       func() proto.Message { return &dsecv1.WriteStdinRequest{} },
	"signal":            func() proto.Message { return &dsecv1.SignalRequest{} },
	"session_interrupt": func() proto.Message { return &dsecv1.SessionInterruptRequest{} },
	"session_close":     func() proto.Message { return &dsecv1.SessionCloseRequest{} },
	"set_network_rules": func() proto.Message { return &dsecv1.SetNetworkRulesRequest{} },
}

func setSandbox(m proto.Message, id string) {
	f := m.ProtoReflect().Descriptor().Fields().ByName("sandbox_id")
	if f != nil {
		m.ProtoReflect().Set(f, protoreflect.ValueOfString(id))
	}
}

func (c *Client) replayStep(ctx context.Context, id string, l TrajectoryLine) ReplayStep {
	st := ReplayStep{Seq: l.Seq, Call: l.Call, Verdict: ReplaySkipped}
	mk, ok := replayed[l.Call]
	switch {
	case !ok:
		st.Detail = "not replayed: it acts on the sandbox as a whole"
		return st
	case l.Args == nil:
		st.Detail = "not replayed: the trajectory kept only a hash of its arguments"
		return st
	}
	req := mk()
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(l.Args, req); err != nil {
		st.Detail = fmt.Sprintf("not replayed: its arguments do not parse: %v", err)
		return st
	}
	setSandbox(req, id)
	var (
		exit           *int32
		stdout, stderr = sha256.New(), sha256.New()
		err            error
	)
	switch m := req.(type) {
	case *dsecv1.ExecRequest:
		exit, err = c.replayStream(ctx, func(ctx context.Context) (*connect.ServerStreamForClient[dsecv1.ExecEvent], error) {
			return c.sb.Exec(ctx, connect.NewRequest(m))
		}, stdout, stderr)
	case *dsecv1.SessionRunRequest:
		exit, err = c.replayStream(ctx, func(ctx context.Context) (*connect.ServerStreamForClient[dsecv1.ExecEvent], error) {
			return c.sb.SessionRun(ctx, connect.NewRequest(m))
		}, stdout, stderr)
	default:
		err = c.replayUnary(ctx, req)
	}
	st.Verdict = ReplayMatch
	if (err != nil) != (l.Error != "") {
		st.Verdict = ReplayDiverged
		st.Detail = fmt.Sprintf("recorded error %q, now %v", l.Error, err)
		return st
	}
	if l.Call != "exec" && l.Call != "session_run" {
		return st
	}
	st.WantExit, st.GotExit = l.Exit, exit
	st.GotStdout, st.GotStderr = hex.EncodeToString(stdout.Sum(nil)), hex.EncodeToString(stderr.Sum(nil))
	st.WantStdout, st.WantStderr = outputSum(l.Stdout), outputSum(l.Stderr)
	var diffs []string
	if (l.Exit == nil) != (exit == nil) || (exit != nil && *l.Exit != *exit) {
		diffs = append(diffs, fmt.Sprintf("exit %s, now %s", exitText(l.Exit), exitText(exit)))
	}
	if st.WantStdout != st.GotStdout {
		diffs = append(diffs, "stdout differs")
	}
	if st.WantStderr != st.GotStderr {
		diffs = append(diffs, "stderr differs")
	}
	if len(diffs) > 0 {
		st.Verdict = ReplayDiverged
		st.Detail = fmt.Sprint(diffs)
	}
	return st
}

// emptySum is the SHA-256 of no bytes: a stream that wrote nothing.
var emptySum = hex.EncodeToString(sha256.New().Sum(nil))

func outputSum(o *TrajectoryOutput) string {
	if o == nil {
		return emptySum
	}
	return o.SHA256
}

func exitText(e *int32) string {
	if e == nil {
		return "none"
	}
	return fmt.Sprint(*e)
}

func (c *Client) replayStream(ctx context.Context, open func(context.Context) (*connect.ServerStreamForClient[dsecv1.ExecEvent], error), stdout, stderr io.Writer) (*int32, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	s, err := open(ctx)
	if err != nil {
		return nil, fromConnect(err, false)
	}
	defer s.Close()
	var exit *int32
	for s.Receive() {
		switch ev := s.Msg().GetEvent().(type) {
		case *dsecv1.ExecEvent_Stdout:
			stdout.Write(ev.Stdout)
		case *dsecv1.ExecEvent_Stderr:
			stderr.Write(ev.Stderr)
		case *dsecv1.ExecEvent_Exited:
			code := ev.Exited.GetExitCode()
			exit = &code
		}
	}
	if err := s.Err(); err != nil {
		return exit, fromConnect(err, false)
	}
	return exit, nil
}

func (c *Client) replayUnary(ctx context.Context, req proto.Message) error {
	var err error
	switch m := req.(type) {
	case *dsecv1.WriteFileRequest:
		_, err = c.sb.WriteFile(ctx, connect.NewRequest(m))
	case *dsecv1.UploadRequest:
		_, err = c.sb.Upload(ctx, connect.NewRequest(m))
	case *dsecv1.RemoveRequest:
		_, err = c.sb.Remove(ctx, connect.NewRequest(m))
	case *dsecv1.MakeDirRequest:
		_, err = c.sb.MakeDir(ctx, connect.NewRequest(m))
	case *dsecv1.MoveRequest:
		_, err = c.sb.Move(ctx, connect.NewRequest(m))
	case *dsecv1.WriteStdinRequest:
		_, err = c.sb.WriteStdin(ctx, connect.NewRequest(m))
	case *dsecv1.SignalRequest:
		_, err = c.sb.Signal(ctx, connect.NewRequest(m))
	case *dsecv1.SessionInterruptRequest:
		_, err = c.sb.SessionInterrupt(ctx, connect.NewRequest(m))
	case *dsecv1.SessionCloseRequest:
		_, err = c.sb.SessionClose(ctx, connect.NewRequest(m))
	case *dsecv1.SetNetworkRulesRequest:
		_, err = c.sb.SetNetworkRules(ctx, connect.NewRequest(m))
	default:
		return fmt.Errorf("replay %T: %w", req, ErrInvalidArgument)
	}
	return err
}
