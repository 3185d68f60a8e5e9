// Package sandboxfusion serves SandboxFusion's HTTP API (bytedance/
// SandboxFusion: /run_code, /submit, /run_jupyter, /v1/ping) over dsec's
// FnCallService, field for field and status for status, so that RL reward
// code written against SandboxFusion (verl, ROLL, SkyRL) can point its URL
// at dsec and change nothing else.
//
// The package owns the translation only: JSON in SandboxFusion's shapes,
// FastAPI-like validation errors (422), the mapping onto
// dsecv1.RunCodeRequest and back, OJ judging of ad-hoc stdio cases, a
// Python driver that runs notebook cells in one process, and an admission
// gate (a bounded number of calls in flight, a bounded queue behind them,
// HTTP 504 beyond that, the one status verl retries). Running the calls is
// the Runner's: the apiserver passes its FnCallService, which places them
// on the cluster's edges. The package imports no edge package, so the
// apiserver can serve it.
//
// docs/fncall.md ("SandboxFusion's API") lists the endpoints, the field
// mapping and what differs from SandboxFusion.
package sandboxfusion
