package dsec

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TestInfraFault: the errors that end a call are typed as the platform's
// faults by their code and the sandbox's reason; the caller's and the
// task's own are no fault.
func TestInfraFault(t *testing.T) {
	tests := []struct {
		err  error
		want Fault
	}{
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox sb-n-1 is stopped (deleted): deleted")), FaultSandboxDeleted},
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox sb-n-1 is stopped (ttl): its TTL of 2s ran out")), FaultSandboxTTL},
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox sb-n-1 is failed (node_lost): gone")), FaultNodeLost},
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox sb-n-1 is stopped (paused_too_long): kept 7d")), FaultPreempted},
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox sb-n-1 is failed (agent_lost): died")), FaultAgentLost},
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox sb-n-1 is stopped (oom): OOM-killed")), FaultNone},
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox sb-n-1 is still being created")), FaultNone},
		{connect.NewError(connect.CodeUnavailable, errors.New("node n1 unreachable")), FaultEdgeUnreachable},
		{connect.NewError(connect.CodeUnavailable, errors.New("sandbox sb-n-1: agent channel: EOF")), FaultAgentLost},
		{connect.NewError(connect.CodeResourceExhausted, errors.New("node n1 is full")), FaultAdmissionRefused},
		{fromConnect(connect.NewError(connect.CodeDeadlineExceeded, errors.New("late")), true), FaultStartTimeout},
		{connect.NewError(connect.CodeDeadlineExceeded, errors.New("late")), FaultNone},
		{connect.NewError(connect.CodeInvalidArgument, errors.New("bad")), FaultNone},
		{connect.NewError(connect.CodeNotFound, errors.New("sandbox sb-n-1: not found")), FaultNone},
		{context.Canceled, FaultNone},
		{nil, FaultNone},
	}
	for _, tt := range tests {
		wrapped := fmt.Errorf("exec in sb-n-1: %w", fromConnect(tt.err, false))
		if tt.err == nil {
			wrapped = nil
		}
		if got := InfraFault(wrapped); got != tt.want {
			t.Errorf("InfraFault(%v) = %q, want %q", tt.err, got, tt.want)
		}
	}
	// Every Fault of the API has a name and goes back to its number.
	for n := range dsecv1.Fault_name {
		f := dsecv1.Fault(n)
		if got := FaultFromProto(f).Proto(); got != f {
			t.Errorf("%v -> %q -> %v", f, FaultFromProto(f), got)
		}
	}
}
