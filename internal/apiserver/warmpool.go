package apiserver

import (
	"context"
	"fmt"
	"slices"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/watcher"
)

// maxWarmPoolSize bounds one pool's size per node; the edge also bounds all
// its pools together.
const maxWarmPoolSize = 1000

// SetWarmPool sets a warm pool on every node that offers the shape's
// isolation: each keeps size sandboxes of the shape ready. It answers with the first node's pool.
func (s *Server) SetWarmPool(ctx context.Context, req *connect.Request[dsecv1.SetWarmPoolRequest]) (*connect.Response[dsecv1.WarmPool], error) {
	m := req.Msg
	if m.GetSpec().GetEnvironment() == "" {
		return nil, fmt.Errorf("spec.environment is required (BASE[+LAYER...]): %w", errdefs.ErrInvalidArgument)
	}
	if m.GetSize() < 0 || m.GetSize() > maxWarmPoolSize {
		return nil, fmt.Errorf("size %d is outside 0..%d: %w", m.GetSize(), maxWarmPoolSize, errdefs.ErrInvalidArgument)
	}
	// A pool belongs to a project as a sandbox does (the spec's
	// ProjectLabel: the one named, else the token's; builder there), and
	// serves that project's creates only.
	m.Spec = proto.Clone(m.GetSpec()).(*dsecv1.SandboxSpec)
	if err := normalizeQoS(m.Spec); err != nil {
		return nil, err
	}
	if err := placeInProject(ctx, m.Spec); err != nil {
		return nil, err
	}
	if m.GetSize() > 0 {
		if err := s.usable(ctx, m.GetSpec().GetEnvironment()); err != nil {
			return nil, err
		}
	}
	all := s.routable()
	if len(all) == 0 {
		return nil, fmt.Errorf("set warm pool: no node is available: %w", errdefs.ErrUnavailable)
	}
	// Only the nodes that offer the pool's isolation keep it.
	var nodes []watcher.Node
	for _, n := range all {
		if offers(n, m.GetSpec()) {
			nodes = append(nodes, n)
		}
	}
	if len(nodes) == 0 {
		name := isolationName(m.GetSpec().GetIsolation())
		why := s.missingOn(name)
		if why != "" {
			why = " (" + why + ")"
		}
		return nil, fmt.Errorf("set warm pool: no healthy node offers isolation %s%s: %w", name, why, errdefs.ErrFailedPrecondition)
	}
	var first *dsecv1.WarmPool
	for _, n := range nodes {
		p, err := n.Edge.SetWarmPool(ctx, connect.NewRequest(m))
		if err != nil {
			return nil, fmt.Errorf("set warm pool on node %s: %w", n.Name, err)
		}
		if first == nil {
			first = p.Msg
		}
	}
	return connect.NewResponse(first), nil
}

// allWarmPools lists the warm pools of every routable node.
func (s *Server) allWarmPools(ctx context.Context) ([]*dsecv1.WarmPool, error) {
	var out []*dsecv1.WarmPool
	for _, n := range s.routable() {
		ps, err := n.Edge.ListWarmPools(ctx, connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
		if err != nil {
			return nil, fmt.Errorf("list warm pools of node %s: %w", n.Name, err)
		}
		out = append(out, ps.Msg.GetPools()...)
	}
	return out, nil
}

// ListWarmPools lists every node's warm pools the caller sees: those of
// its projects, and the root's.
func (s *Server) ListWarmPools(ctx context.Context, req *connect.Request[dsecv1.ListWarmPoolsRequest]) (*connect.Response[dsecv1.ListWarmPoolsResponse], error) {
	pools, err := s.allWarmPools(ctx)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListWarmPoolsResponse{Pools: pools}
	if a, check := caller(ctx, iam.Viewer); check {
		out.Pools = slices.DeleteFunc(out.Pools, func(p *dsecv1.WarmPool) bool {
			project := projectOf(&dsecv1.Sandbox{Spec: p.GetSpec()})
			return project != "" && a.On(project) < iam.Viewer
		})
	}
	return connect.NewResponse(out), nil
}
