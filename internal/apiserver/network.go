package apiserver

import (
	"context"
	"fmt"
	"time"

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
	m := req.Msg
	e, err := s.edgeFor(m.GetSandboxId())
	if err != nil {
		return nil, err
	}
	warnings, err := e.SetNetworkRules(ctx, m.GetSandboxId(), m.GetRules(), m.GetCut())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.SetNetworkRulesResponse{Warnings: warnings}), nil
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
	e, err := s.edgeFor(m.GetSandboxId())
	if err != nil {
		return nil, err
	}
	var since time.Time
	if m.GetSinceUnixMs() > 0 {
		since = time.UnixMilli(m.GetSinceUnixMs())
	}
	events, err := e.NetworkLog(ctx, m.GetSandboxId(), since, limit)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.NetworkLogResponse{}
	for _, ev := range events {
		pe := &dsecv1.NetworkEvent{
			TimeUnixMs: ev.Time.UnixMilli(), Kind: ev.Kind, Verdict: ev.Verdict, Protocol: ev.Proto,
			Port: int32(ev.Port), Name: ev.Name, BytesOut: ev.BytesOut, BytesIn: ev.BytesIn, Rule: ev.Rule,
		}
		if ev.Dest.IsValid() {
			pe.Destination = ev.Dest.String()
		}
		out.Events = append(out.Events, pe)
	}
	return connect.NewResponse(out), nil
}
