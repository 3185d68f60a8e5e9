package dsec

import (
	"errors"
	"strings"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Fault says that the platform, not the task, ended a call: a trainer masks
// such a rollout rather than scoring it 0. FaultNone means the task ended it
// (its exit code, its own timeout, its own memory limit) or nothing ended
// it. docs/outcomes.md has the table of faults, how each is detected and
// what each surface says.
type Fault string

const (
	FaultNone               Fault = ""
	FaultNodeLost           Fault = "node_lost"
	FaultEdgeUnreachable    Fault = "edge_unreachable"
	FaultPreempted          Fault = "preempted"
	FaultAdmissionRefused   Fault = "admission_refused"
	FaultStartTimeout       Fault = "start_timeout"
	FaultNodeMemoryPressure Fault = "node_memory_pressure"
	FaultSandboxTTL         Fault = "sandbox_ttl"
	FaultSandboxDeleted     Fault = "sandbox_deleted"
	FaultAgentLost          Fault = "agent_lost"
)

// FaultFromProto maps the API's enum onto a Fault.
func FaultFromProto(f dsecv1.Fault) Fault {
	if f == dsecv1.Fault_FAULT_UNSPECIFIED {
		return FaultNone
	}
	return Fault(strings.ToLower(strings.TrimPrefix(f.String(), "FAULT_")))
}

// Proto is the API's enum of f (FAULT_UNSPECIFIED for FaultNone or a name
// the API does not know).
func (f Fault) Proto() dsecv1.Fault {
	if f == FaultNone {
		return dsecv1.Fault_FAULT_UNSPECIFIED
	}
	return dsecv1.Fault(dsecv1.Fault_value["FAULT_"+strings.ToUpper(string(f))])
}

// faultOfReason is the fault of a sandbox that ended for reason (as the
// API's Reason in lower case, without its prefix) while a call ran in it,
// FaultNone for the task's own ends (an OOM at its memory limit).
func faultOfReason(reason string) Fault {
	switch reason {
	case "deleted":
		return FaultSandboxDeleted
	case "ttl", "idle":
		return FaultSandboxTTL
	case "node_lost":
		return FaultNodeLost
	case "agent_lost", "start_error":
		return FaultAgentLost
	case "paused_too_long":
		return FaultPreempted
	}
	return FaultNone
}

// errorFault types an error that ended a call: the kinds the platform
// causes are faults; the caller's (invalid argument, not found, permission
// denied, its own cancellation or deadline) are not.
func errorFault(e *Error) Fault {
	switch e.Kind {
	case ErrSandboxGone:
		return faultOfReason(e.Reason)
	case ErrUnavailable:
		if strings.Contains(e.Message, "agent channel") {
			return FaultAgentLost // the edge answered: the sandbox's agent did not
		}
		return FaultEdgeUnreachable
	case ErrOverloaded:
		return FaultAdmissionRefused
	case ErrStartupTimeout:
		return FaultStartTimeout
	}
	return FaultNone
}

// InfraFault says whether the platform ended what err reports and how: the
// Fault of an *Error (an exec stream cut by a lost edge, a sandbox deleted
// under a command, a create refused for room), else FaultNone. A nil err
// is FaultNone.
func InfraFault(err error) Fault {
	var e *Error
	if errors.As(err, &e) {
		return e.Fault
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		if fe, ok := fromConnect(err, false).(*Error); ok {
			return fe.Fault
		}
	}
	return FaultNone
}
