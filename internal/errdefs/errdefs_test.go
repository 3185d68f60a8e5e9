package errdefs

import (
	"errors"
	"fmt"
	"testing"

	"connectrpc.com/connect"
)

// TestToConnectSaysTheKindOnce: the code carries the kind, so the message
// leaves out its trailing words ("not_found: sandbox sb-x", not
// "not_found: sandbox sb-x: not found"); errors.Is still finds the kind,
// and a message with the kind elsewhere is left whole.
func TestToConnectSaysTheKindOnce(t *testing.T) {
	for _, tc := range []struct {
		err  error
		code connect.Code
		msg  string
	}{
		{fmt.Errorf("sandbox sb-x: %w", ErrNotFound), connect.CodeNotFound, "sandbox sb-x"},
		{fmt.Errorf("compile rule %q: IPv6: %w", "::/0", ErrInvalidArgument), connect.CodeInvalidArgument, `compile rule "::/0": IPv6`},
		{fmt.Errorf("pause: %w", ErrNotSupported), connect.CodeUnimplemented, "pause"},
		{fmt.Errorf("mount: %w", ErrInternal), connect.CodeInternal, "mount"},
		{fmt.Errorf("create: %w: after 3 tries", ErrResourceExhausted), connect.CodeResourceExhausted, "create: resource exhausted: after 3 tries"},
		{ErrNotFound, connect.CodeNotFound, "not found"},
		{errors.New("plain"), connect.CodeInternal, "plain"},
	} {
		err := ToConnect(tc.err)
		var ce *connect.Error
		if !errors.As(err, &ce) || ce.Code() != tc.code || ce.Message() != tc.msg {
			t.Errorf("ToConnect(%q) = %v, want %v %q", tc.err, err, tc.code, tc.msg)
		}
		if !errors.Is(err, tc.err) {
			t.Errorf("ToConnect(%q) no longer wraps it", tc.err)
		}
		if back := FromConnect(err); Code(back) != tc.code {
			t.Errorf("FromConnect(ToConnect(%q)) has code %v", tc.err, Code(back))
		}
	}
}
