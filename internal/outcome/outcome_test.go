package outcome_test

import (
	"context"
	"fmt"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/outcome"
)

// TestOf: an error that ended a call is typed by its kind, and a sandbox's
// gone error by the sandbox's reason, in process as after the wire.
func TestOf(t *testing.T) {
	gone := func(r dsecv1.Reason) error {
		return sandbox.GoneError(&dsecv1.Sandbox{Id: "sb-n-1", State: dsecv1.State_STATE_STOPPED, Reason: r})
	}
	tests := []struct {
		err  error
		want dsecv1.Fault
	}{
		{gone(dsecv1.Reason_REASON_DELETED), dsecv1.Fault_FAULT_SANDBOX_DELETED},
		{gone(dsecv1.Reason_REASON_TTL), dsecv1.Fault_FAULT_SANDBOX_TTL},
		{gone(dsecv1.Reason_REASON_NODE_LOST), dsecv1.Fault_FAULT_NODE_LOST},
		{gone(dsecv1.Reason_REASON_PAUSED_TOO_LONG), dsecv1.Fault_FAULT_PREEMPTED},
		{gone(dsecv1.Reason_REASON_OOM), dsecv1.Fault_FAULT_UNSPECIFIED},
		{fmt.Errorf("node n1: %w", errdefs.ErrUnavailable), dsecv1.Fault_FAULT_EDGE_UNREACHABLE},
		{fmt.Errorf("sandbox sb-n-1: agent channel: EOF: %w", errdefs.ErrUnavailable), dsecv1.Fault_FAULT_AGENT_LOST},
		{fmt.Errorf("node n1 is full: %w", errdefs.ErrResourceExhausted), dsecv1.Fault_FAULT_ADMISSION_REFUSED},
		{fmt.Errorf("bad: %w", errdefs.ErrInvalidArgument), dsecv1.Fault_FAULT_UNSPECIFIED},
		{context.Canceled, dsecv1.Fault_FAULT_UNSPECIFIED},
		{nil, dsecv1.Fault_FAULT_UNSPECIFIED},
	}
	for _, tt := range tests {
		if got := outcome.Of(tt.err); got != tt.want {
			t.Errorf("Of(%v) = %v, want %v", tt.err, got, tt.want)
		}
		if tt.err != nil {
			if got := outcome.Of(errdefs.ToConnect(tt.err)); got != tt.want {
				t.Errorf("Of(wire %v) = %v, want %v", tt.err, got, tt.want)
			}
		}
	}
	if w := outcome.Words(dsecv1.Fault_FAULT_SANDBOX_TTL); w != "sandbox_ttl" {
		t.Errorf("Words = %q", w)
	}
}
