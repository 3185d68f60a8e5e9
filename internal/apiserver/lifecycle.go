package apiserver

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// Pause, Resume, SetTimeout and Metrics are the sandbox's node's to carry
// out: it holds the state machine, the clocks and the cgroups.

func (s *Server) Pause(ctx context.Context, req *connect.Request[dsecv1.PauseRequest]) (*connect.Response[dsecv1.PauseResponse], error) {
	if req.Msg.GetSandboxId() == "" {
		return nil, fmt.Errorf("pause: sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.PauseRequest]) (*connect.Response[dsecv1.PauseResponse], error) {
		return e.Pause
	})
}

func (s *Server) Resume(ctx context.Context, req *connect.Request[dsecv1.ResumeRequest]) (*connect.Response[dsecv1.ResumeResponse], error) {
	if req.Msg.GetSandboxId() == "" {
		return nil, fmt.Errorf("resume: sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.ResumeRequest]) (*connect.Response[dsecv1.ResumeResponse], error) {
		return e.Resume
	})
}

func (s *Server) EndPhase(ctx context.Context, req *connect.Request[dsecv1.EndPhaseRequest]) (*connect.Response[dsecv1.EndPhaseResponse], error) {
	if req.Msg.GetSandboxId() == "" {
		return nil, fmt.Errorf("end phase: sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.EndPhaseRequest]) (*connect.Response[dsecv1.EndPhaseResponse], error) {
		return e.EndPhase
	})
}

func (s *Server) SetTimeout(ctx context.Context, req *connect.Request[dsecv1.SetTimeoutRequest]) (*connect.Response[dsecv1.SetTimeoutResponse], error) {
	if req.Msg.GetSandboxId() == "" {
		return nil, fmt.Errorf("set timeout: sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	if req.Msg.GetTimeoutSeconds() < 0 {
		return nil, fmt.Errorf("set timeout: timeout_seconds %d must not be negative: %w", req.Msg.GetTimeoutSeconds(), errdefs.ErrInvalidArgument)
	}
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.SetTimeoutRequest]) (*connect.Response[dsecv1.SetTimeoutResponse], error) {
		return e.SetTimeout
	})
}

func (s *Server) Metrics(ctx context.Context, req *connect.Request[dsecv1.MetricsRequest]) (*connect.Response[dsecv1.SandboxMetrics], error) {
	if req.Msg.GetSandboxId() == "" {
		return nil, fmt.Errorf("metrics: sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.MetricsRequest]) (*connect.Response[dsecv1.SandboxMetrics], error) {
		return e.Metrics
	})
}
