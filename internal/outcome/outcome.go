// Package outcome types the end of a call on the server's side: whether
// the task ended it or the platform did, and which platform fault
// (dsecv1.Fault). The SDKs type the errors that end a stream the same way
// (sdk/go faults.go, libdsec's errors.py); docs/outcomes.md has the table.
package outcome

import (
	"regexp"
	"strings"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// goneRE reads the reason out of a sandbox's "gone" error, as
// sandbox.GoneError words it ("sandbox sb-… is stopped (ttl): …"), in
// process or after it crossed the wire.
var goneRE = regexp.MustCompile(`sandbox \S+ is (?:stopped|stopping|failed) \((\w+)\)`)

// OfReason is the fault of a call whose sandbox ended for reason while the
// call ran; FAULT_UNSPECIFIED for the task's own ends (an OOM at the
// sandbox's memory limit) and reasons that are no fault.
func OfReason(r dsecv1.Reason) dsecv1.Fault {
	switch r {
	case dsecv1.Reason_REASON_DELETED:
		return dsecv1.Fault_FAULT_SANDBOX_DELETED
	case dsecv1.Reason_REASON_TTL, dsecv1.Reason_REASON_IDLE:
		return dsecv1.Fault_FAULT_SANDBOX_TTL
	case dsecv1.Reason_REASON_NODE_LOST:
		return dsecv1.Fault_FAULT_NODE_LOST
	case dsecv1.Reason_REASON_AGENT_LOST, dsecv1.Reason_REASON_START_ERROR:
		return dsecv1.Fault_FAULT_AGENT_LOST
	case dsecv1.Reason_REASON_PAUSED_TOO_LONG:
		return dsecv1.Fault_FAULT_PREEMPTED
	}
	return dsecv1.Fault_FAULT_UNSPECIFIED
}

// Of types an error that ended a call: the sandbox gone under it (by its
// reason), an edge or agent that could not be reached, no room to run it;
// FAULT_UNSPECIFIED for the caller's own errors (invalid argument, not
// found, permission denied) and nil.
func Of(err error) dsecv1.Fault {
	if err == nil {
		return dsecv1.Fault_FAULT_UNSPECIFIED
	}
	switch errdefs.Code(err) {
	case connect.CodeFailedPrecondition:
		if m := goneRE.FindStringSubmatch(err.Error()); m != nil {
			return OfReason(dsecv1.Reason(dsecv1.Reason_value["REASON_"+strings.ToUpper(m[1])]))
		}
	case connect.CodeUnavailable:
		if strings.Contains(err.Error(), "agent channel") {
			return dsecv1.Fault_FAULT_AGENT_LOST
		}
		return dsecv1.Fault_FAULT_EDGE_UNREACHABLE
	case connect.CodeResourceExhausted:
		return dsecv1.Fault_FAULT_ADMISSION_REFUSED
	}
	return dsecv1.Fault_FAULT_UNSPECIFIED
}

// Words is a fault's name as the SDKs, the CLI and SandboxFusion's
// messages give it: "sandbox_deleted"; "" for FAULT_UNSPECIFIED.
func Words(f dsecv1.Fault) string {
	if f == dsecv1.Fault_FAULT_UNSPECIFIED {
		return ""
	}
	return strings.ToLower(strings.TrimPrefix(f.String(), "FAULT_"))
}
