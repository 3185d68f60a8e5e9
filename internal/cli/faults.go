package cli

import (
	"fmt"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	dsec "dsec.dev/dsec/sdk/go"
)

// faultExitBase is where the exit codes of the platform's faults start:
// 200 + the API's Fault number (201 node_lost … 209 agent_lost), above
// 128+N for a signal and apart from 124-127, so a script masks a rollout
// the platform ended (rc 200-209) rather than scoring it (docs/outcomes.md).
const faultExitBase = 200

// faultExitsKey marks, in a command's Annotations (faultExits), a command
// whose errors exit with their fault's code: run, create, exec, shell, fn
// run. The others (ls, rm, …) exit 1 on any error.
const faultExitsKey = "dsec.dev/fault-exits"

var faultExits = map[string]string{faultExitsKey: "yes"}

// faultExit is the exit code of fault f.
func faultExit(f dsecv1.Fault) int { return faultExitBase + int(f) }

// faultErr is the exit of a call the platform ended with fault f.
func faultErr(f dsecv1.Fault, msg string) *exitCode {
	return &exitCode{code: faultExit(f), msg: fmt.Sprintf("infrastructure fault (%s): %s", dsec.FaultFromProto(f), msg)}
}
