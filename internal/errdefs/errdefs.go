// Package errdefs holds the error kinds every dsec package returns. Wrap them
// with context (fmt.Errorf("mount layer %s: %w", d, errdefs.ErrNotFound)) and
// test with errors.Is; they become RPC codes only at the API edge (see Code).
package errdefs

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"connectrpc.com/connect"
)

var (
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrResourceExhausted  = errors.New("resource exhausted")
	ErrUnavailable        = errors.New("unavailable")
	ErrDeadlineExceeded   = errors.New("deadline exceeded")
	ErrPermissionDenied   = errors.New("permission denied")
	ErrUnauthenticated    = errors.New("unauthenticated")
	ErrNotSupported       = errors.New("not supported")
	ErrInternal           = errors.New("internal error")
)

// Code is the Connect code for err, by the first kind it wraps.
func Code(err error) connect.Code {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	for _, m := range []struct {
		kind error
		code connect.Code
	}{
		{ErrInvalidArgument, connect.CodeInvalidArgument},
		{ErrNotFound, connect.CodeNotFound},
		{ErrAlreadyExists, connect.CodeAlreadyExists},
		{ErrFailedPrecondition, connect.CodeFailedPrecondition},
		{ErrResourceExhausted, connect.CodeResourceExhausted},
		{ErrUnavailable, connect.CodeUnavailable},
		{ErrDeadlineExceeded, connect.CodeDeadlineExceeded},
		{ErrPermissionDenied, connect.CodePermissionDenied},
		{ErrUnauthenticated, connect.CodeUnauthenticated},
		{ErrNotSupported, connect.CodeUnimplemented},
	} {
		if errors.Is(err, m.kind) {
			return m.code
		}
	}
	switch {
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded
	}
	return connect.CodeInternal
}

// ToConnect turns err into a *connect.Error carrying its code and message.
// It leaves nil and errors that already are *connect.Error alone. The
// message loses the kind's words at its end ("sandbox sb-x: not found"
// goes as "sandbox sb-x" with code not_found): every client prints the
// code beside the message, and would otherwise say the kind twice
// ("not_found: sandbox sb-x: not found").
func ToConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	return connect.NewError(Code(err), withoutKind(err))
}

// withoutKind is err with its message cut before a trailing ": <kind>",
// for the kind err wraps; errors.Is still sees the kind.
func withoutKind(err error) error {
	msg := err.Error()
	for _, kind := range kinds {
		if errors.Is(err, kind) {
			if cut, ok := strings.CutSuffix(msg, ": "+kind.Error()); ok && cut != "" {
				return &kindless{msg: cut, err: err}
			}
		}
	}
	return err
}

// kinds are the error kinds above.
var kinds = []error{ErrInvalidArgument, ErrNotFound, ErrAlreadyExists, ErrFailedPrecondition, ErrResourceExhausted,
	ErrUnavailable, ErrDeadlineExceeded, ErrPermissionDenied, ErrUnauthenticated, ErrNotSupported, ErrInternal}

// kindless is an error whose message leaves out its kind.
type kindless struct {
	msg string
	err error
}

func (k *kindless) Error() string { return k.msg }
func (k *kindless) Unwrap() error { return k.err }

// FromConnect maps a Connect error from a remote dsec component back onto the
// kinds above, keeping its message, so errors.Is works across the wire.
func FromConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	kind := ErrInternal
	switch ce.Code() {
	case connect.CodeInvalidArgument, connect.CodeOutOfRange:
		kind = ErrInvalidArgument
	case connect.CodeNotFound:
		kind = ErrNotFound
	case connect.CodeAlreadyExists:
		kind = ErrAlreadyExists
	case connect.CodeFailedPrecondition:
		kind = ErrFailedPrecondition
	case connect.CodeResourceExhausted:
		kind = ErrResourceExhausted
	case connect.CodeUnavailable:
		kind = ErrUnavailable
	case connect.CodeDeadlineExceeded:
		kind = ErrDeadlineExceeded
	case connect.CodePermissionDenied:
		kind = ErrPermissionDenied
	case connect.CodeUnauthenticated:
		kind = ErrUnauthenticated
	case connect.CodeUnimplemented:
		kind = ErrNotSupported
	case connect.CodeCanceled:
		return fmt.Errorf("%s: %w", ce.Message(), context.Canceled)
	}
	return &wrapped{msg: ce.Message(), kind: kind}
}

type wrapped struct {
	msg  string
	kind error
}

func (w *wrapped) Error() string { return w.msg }
func (w *wrapped) Unwrap() error { return w.kind }

// Interceptor turns the kinds above into Connect codes for every call a
// Connect handler serves: the API's edge, where the mapping belongs.
type Interceptor struct{}

func (Interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		return resp, ToConnect(err)
	}
}

func (Interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (Interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return ToConnect(next(ctx, conn))
	}
}
