package dsec

import (
	"context"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"
)

// Error kinds. Every error the SDK returns matches one of them with errors.Is.
var (
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrFailedPrecondition = errors.New("failed precondition")
	// ErrSandboxGone: the sandbox stopped or failed; it also matches
	// ErrFailedPrecondition. *Error.Reason says why (oom, ttl, idle, ...).
	ErrSandboxGone = errors.New("sandbox gone")
	// ErrOverloaded: the daemon refused the work for lack of capacity;
	// *Error.RetryAfter carries its hint, if any.
	ErrOverloaded       = errors.New("overloaded")
	ErrInvalidArgument  = errors.New("invalid argument")
	ErrUnauthenticated  = errors.New("unauthenticated")
	ErrPermissionDenied = errors.New("permission denied")
	// ErrUnavailable: the daemon cannot be reached (refused, reset, gone mid-call).
	ErrUnavailable = errors.New("unavailable")
	// ErrTimeout: the call's deadline passed. It also matches context.DeadlineExceeded.
	ErrTimeout = errors.New("timeout")
	// ErrStartupTimeout: sandboxes did not run within Create's timeout; it also matches ErrTimeout.
	ErrStartupTimeout = errors.New("startup timeout")
	ErrNotSupported   = errors.New("not supported")
	ErrCanceled       = errors.New("canceled")
	ErrInternal       = errors.New("internal error")
	// ErrCommandFailed: ExecResult.Err of a command that did not succeed.
	ErrCommandFailed = errors.New("command failed")
	// ErrOutputDropped: the result came with less output than the command
	// wrote (ExecResult.StdoutDropped, StderrDropped); it is returned with
	// the result. A stream that follows a command from its start (Exec,
	// ExecStream, Session.Run) never gets it; Job.Wait and Job.Output do
	// when the output past what the node keeps came while nothing read it.
	ErrOutputDropped = errors.New("output dropped")
)

// Error is what every failed call returns: a kind, the daemon's code and
// message, and details for some kinds.
type Error struct {
	Kind    error
	Code    connect.Code
	Message string
	// SandboxID, State and Reason are set for ErrSandboxGone.
	SandboxID, State, Reason string
	// RetryAfter is the daemon's hint for ErrOverloaded (0: none).
	RetryAfter time.Duration
	// Token says, for ErrUnauthenticated, where the token sent came from
	// ("token from $DSEC_TOKEN") or why none was; never the token itself.
	Token string
	// Fault is the platform's fault when the platform, not the caller or
	// the task, caused the error (a lost edge, a sandbox deleted or reaped
	// under a command, a create refused for room); FaultNone otherwise.
	Fault Fault
	cause error
}

func (e *Error) Error() string {
	s := e.Kind.Error()
	if e.Message != "" {
		s += ": " + e.Message
	}
	if e.Token != "" {
		s += " (" + e.Token + ")"
	}
	return s
}

// Unwrap lets errors.Is see the kind, its parent kinds, and the cause.
func (e *Error) Unwrap() []error {
	out := []error{e.Kind}
	switch e.Kind {
	case ErrSandboxGone:
		out = append(out, ErrFailedPrecondition)
	case ErrStartupTimeout:
		out = append(out, ErrTimeout, context.DeadlineExceeded)
	case ErrTimeout:
		out = append(out, context.DeadlineExceeded)
	}
	if e.cause != nil {
		out = append(out, e.cause)
	}
	return out
}

var goneRE = regexp.MustCompile(`sandbox (\S+) is (?:STATE_)?(stopped|stopping|failed|STOPPED|STOPPING|FAILED)(?: \((\w+)\))?`)

// fromConnect maps an error of a generated client call onto the kinds.
func fromConnect(err error, creating bool) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	code := connect.CodeOf(err)
	msg := err.Error()
	var ce *connect.Error
	if errors.As(err, &ce) {
		msg = ce.Message()
	}
	if ce != nil && !connect.IsWireError(ce) && code != connect.CodeCanceled && code != connect.CodeDeadlineExceeded && brokenTransport(err) {
		// The connection broke mid-call (a daemon killed, a reset): connect
		// reports a truncated stream as a protocol error of its own.
		code = connect.CodeUnavailable
	}
	out := &Error{Code: code, Message: msg, cause: err}
	var ua *unauthenticated
	if errors.As(err, &ua) {
		out.Token = ua.source
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded) || code == connect.CodeDeadlineExceeded:
		out.Kind = ErrTimeout
		if creating {
			out.Kind = ErrStartupTimeout
		}
	case errors.Is(err, context.Canceled):
		out.Kind = ErrCanceled
	default:
		out.Kind = kindOf(code)
	}
	if ce != nil {
		if v := ce.Meta().Get("Retry-After"); v != "" {
			if s, perr := strconv.ParseFloat(v, 64); perr == nil {
				out.RetryAfter = time.Duration(s * float64(time.Second))
			}
		}
	}
	if code == connect.CodeUnavailable && out.RetryAfter > 0 {
		out.Kind = ErrOverloaded
	}
	if out.Kind == ErrFailedPrecondition {
		if m := goneRE.FindStringSubmatch(msg); m != nil {
			out.Kind = ErrSandboxGone
			out.SandboxID, out.State, out.Reason = m[1], strings.ToLower(m[2]), strings.ToLower(m[3])
		}
	}
	out.Fault = errorFault(out)
	return out
}

func brokenTransport(err error) bool {
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	m := err.Error()
	for _, s := range []string{"EOF", "incomplete envelope", "connection reset", "connection refused", "broken pipe", "stream error", "GOAWAY", "closed"} {
		if strings.Contains(m, s) {
			return true
		}
	}
	return false
}

func kindOf(code connect.Code) error {
	switch code {
	case connect.CodeNotFound:
		return ErrNotFound
	case connect.CodeAlreadyExists:
		return ErrAlreadyExists
	case connect.CodeFailedPrecondition:
		return ErrFailedPrecondition
	case connect.CodeResourceExhausted:
		return ErrOverloaded
	case connect.CodeInvalidArgument, connect.CodeOutOfRange:
		return ErrInvalidArgument
	case connect.CodeUnauthenticated:
		return ErrUnauthenticated
	case connect.CodePermissionDenied:
		return ErrPermissionDenied
	case connect.CodeUnavailable:
		return ErrUnavailable
	case connect.CodeDeadlineExceeded:
		return ErrTimeout
	case connect.CodeUnimplemented:
		return ErrNotSupported
	case connect.CodeCanceled:
		return ErrCanceled
	}
	return ErrInternal
}

func invalid(format string, args ...any) error {
	return &Error{Kind: ErrInvalidArgument, Code: connect.CodeInvalidArgument, Message: fmt.Sprintf(format, args...)}
}
