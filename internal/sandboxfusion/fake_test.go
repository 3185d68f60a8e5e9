package sandboxfusion

import (
	"context"
	"sync"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"google.golang.org/protobuf/proto"
)

// fakeRunner records the requests it gets and answers each with fn.
type fakeRunner struct {
	mu   sync.Mutex
	reqs []*dsecv1.RunCodeRequest
	fn   func(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error)
}

func (f *fakeRunner) RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
	f.mu.Lock()
	f.reqs = append(f.reqs, proto.Clone(req).(*dsecv1.RunCodeRequest))
	f.mu.Unlock()
	return f.fn(ctx, req)
}

func (f *fakeRunner) requests() []*dsecv1.RunCodeRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*dsecv1.RunCodeRequest(nil), f.reqs...)
}

// canned answers every call with resp.
func canned(resp *dsecv1.RunCodeResponse, err error) *fakeRunner {
	return &fakeRunner{fn: func(context.Context, *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		return resp, err
	}}
}

func rc(v int32) *int32 { return &v }

// finished is a step that exited with code.
func finished(code int32, stdout, stderr string) *dsecv1.CommandResult {
	return &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, ExecutionTimeSeconds: 0.02,
		ReturnCode: rc(code), Stdout: []byte(stdout), Stderr: []byte(stderr)}
}

func timedOut(stdout string) *dsecv1.CommandResult {
	return &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED, ExecutionTimeSeconds: 1,
		Stdout: []byte(stdout)}
}

func success(stdout string) *dsecv1.RunCodeResponse {
	return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SUCCESS, RunResult: finished(0, stdout, ""), Node: "node-1"}
}
