package sandboxfusion

import (
	"context"
	"fmt"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// programs is the fake cluster: what each program does.
func programs(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
	switch req.GetCode() {
	case "correct":
		return success(string(req.GetStdin()) + "\n"), nil
	case "wrong":
		return success("nope\n"), nil
	case "compile-error":
		return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED, CompileResult: finished(1, "", "error: expected ';'")}, nil
	case "compile-timeout":
		return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED, CompileResult: timedOut("")}, nil
	case "runtime-error":
		return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED, RunResult: finished(1, "", "Traceback")}, nil
	case "killed":
		return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED, RunResult: finished(-9, "", "")}, nil
	case "timeout":
		return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED, RunResult: timedOut("partial")}, nil
	case "broken-node":
		return nil, fmt.Errorf("edge node-3 lost its agent: %w", errdefs.ErrUnavailable)
	}
	return nil, fmt.Errorf("unknown program %q", req.GetCode())
}

func TestVerlScoring(t *testing.T) {
	srv := httptest.NewServer(NewHandler(&fakeRunner{fn: programs}, Config{}))
	defer srv.Close()
	c := &testutil.VerlClient{URL: srv.URL + "/run_code"}
	for _, tc := range []struct {
		code, lang string
		want       int
	}{
		{"correct", "python", 1},
		{"wrong", "python", 0},
		{"compile-error", "cpp", -4},
		{"compile-timeout", "cpp", -4},
		{"runtime-error", "python", -2},
		{"killed", "python", -2},
		{"timeout", "python", -3},
		{"broken-node", "python", -1},
		{"correct", "cobol-is-fine-here", 1}, // the fake knows no languages
	} {
		if got := c.Score(tc.code, "42", "42\n", tc.lang, 10, 10); got != tc.want {
			t.Errorf("%s (%s) scored %d, want %d", tc.code, tc.lang, got, tc.want)
		}
	}
	// An unknown language is a 422, which verl scores -1 without retrying.
	srv2 := httptest.NewServer(NewHandler(canned(nil, fmt.Errorf("unknown language \"x\": %w", errdefs.ErrInvalidArgument)), Config{}))
	defer srv2.Close()
	c2 := &testutil.VerlClient{URL: srv2.URL + "/run_code"}
	if got := c2.Score("correct", "", "", "x", 1, 1); got != -1 || c2.Tries.Load() != 1 {
		t.Errorf("unknown language scored %d after %d tries, want -1 after 1", got, c2.Tries.Load())
	}
}

// TestVerlRetriesOverload: a full cluster answers 504, which verl
// retries; it scores once a try gets through, and -1 after 3 504s.
func TestVerlRetriesOverload(t *testing.T) {
	var calls atomic.Int32
	full := fmt.Errorf("every pool is full: %w", errdefs.ErrResourceExhausted)
	f := &fakeRunner{fn: func(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		if calls.Add(1) <= 2 {
			return nil, full
		}
		return programs(ctx, req)
	}}
	srv := httptest.NewServer(NewHandler(f, Config{}))
	defer srv.Close()
	c := &testutil.VerlClient{URL: srv.URL + "/run_code"}
	if got := c.Score("correct", "7", "7", "python", 1, 1); got != 1 || c.Tries.Load() != 3 {
		t.Errorf("scored %d after %d tries, want 1 after 3", got, c.Tries.Load())
	}

	srvFull := httptest.NewServer(NewHandler(canned(nil, full), Config{}))
	defer srvFull.Close()
	cf := &testutil.VerlClient{URL: srvFull.URL + "/run_code"}
	if got := cf.Score("correct", "7", "7", "python", 1, 1); got != -1 || cf.Tries.Load() != 3 {
		t.Errorf("always full: scored %d after %d tries, want -1 after 3", got, cf.Tries.Load())
	}
}
