package apiserver

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

const (
	defaultLogLimit = 1000
	maxLogLimit     = 100000
)

// SetNetworkRules replaces a running sandbox's network rules.
func (s *Server) SetNetworkRules(ctx context.Context, req *connect.Request[dsecv1.SetNetworkRulesRequest]) (*connect.Response[dsecv1.SetNetworkRulesResponse], error) {
	e, err := s.sandboxEdge(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	return e.SetNetworkRules(ctx, req)
}

// NetworkLog returns a sandbox's network audit records, oldest first.
func (s *Server) NetworkLog(ctx context.Context, req *connect.Request[dsecv1.NetworkLogRequest]) (*connect.Response[dsecv1.NetworkLogResponse], error) {
	m := req.Msg
	limit := int(m.GetLimit())
	switch {
	case limit < 0:
		return nil, fmt.Errorf("limit %d must not be negative: %w", limit, errdefs.ErrInvalidArgument)
	case limit == 0:
		limit = defaultLogLimit
	case limit > maxLogLimit:
		limit = maxLogLimit
	}
	e, err := s.sandboxEdge(ctx, m.GetSandboxId())
	if err != nil {
		return nil, err
	}
	return e.NetworkLog(ctx, connect.NewRequest(&dsecv1.NetworkLogRequest{
		SandboxId: m.GetSandboxId(), SinceUnixMs: m.GetSinceUnixMs(), Limit: int32(limit)}))
}

// Provenance forwards to the sandbox's edge (package provenance).
func (s *Server) Provenance(ctx context.Context, req *connect.Request[dsecv1.ProvenanceRequest]) (*connect.Response[dsecv1.SandboxProvenance], error) {
	e, err := s.sandboxEdge(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	return e.Provenance(ctx, req)
}

// SetProvenancePaths forwards to the sandbox's edge.
func (s *Server) SetProvenancePaths(ctx context.Context, req *connect.Request[dsecv1.SetProvenancePathsRequest]) (*connect.Response[dsecv1.SetProvenancePathsResponse], error) {
	e, err := s.sandboxEdge(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	return e.SetProvenancePaths(ctx, req)
}
