package apiserver

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// Trajectory reads a sandbox's trajectory from its node; when that node is
// gone or unreachable, from any other, which reads the copy the blob store
// keeps (docs/trajectories.md). A sandbox may be gone, so the caller's
// role is checked on the project the trajectory names.
func (s *Server) Trajectory(ctx context.Context, req *connect.Request[dsecv1.TrajectoryRequest]) (*connect.Response[dsecv1.TrajectoryResponse], error) {
	id := req.Msg.GetSandboxId()
	resp, err := s.readTrajectory(ctx, req)
	if err != nil {
		return nil, err
	}
	if a, need, check := callerRole(ctx); check {
		if err := admit(a, need, id, resp.Msg.GetProject()); err != nil {
			return nil, err
		}
	}
	return resp, nil
}

func (s *Server) readTrajectory(ctx context.Context, req *connect.Request[dsecv1.TrajectoryRequest]) (*connect.Response[dsecv1.TrajectoryResponse], error) {
	e, err := s.edgeFor(req.Msg.GetSandboxId())
	if err == nil {
		resp, rerr := e.Trajectory(ctx, req)
		if rerr == nil || !errors.Is(errdefs.FromConnect(rerr), errdefs.ErrUnavailable) {
			return resp, rerr
		}
		err = rerr
	} else if errors.Is(err, errdefs.ErrInvalidArgument) {
		return nil, err
	}
	// The sandbox's node is gone or unreachable: another node reads the
	// blob store's copy.
	for _, n := range s.routable() {
		if n.Edge == e {
			continue
		}
		resp, rerr := n.Edge.Trajectory(ctx, req)
		if rerr == nil {
			return resp, nil
		}
		if !errors.Is(errdefs.FromConnect(rerr), errdefs.ErrUnavailable) {
			err = rerr
		}
	}
	return nil, err
}
