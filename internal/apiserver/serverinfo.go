package apiserver

import (
	"context"

	"connectrpc.com/connect"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// SetEndpoints records where this server's process serves E2B's API and
// SandboxFusion's ("" for one it does not serve), for GetServerInfo. Call
// it once the listeners are up; calls before it see neither.
func (s *Server) SetEndpoints(e2bAddr, sandboxFusionAddr string) {
	s.info.Store(&dsecv1.ServerInfo{Name: s.cfg.Name, E2BAddr: e2bAddr, SandboxfusionAddr: sandboxFusionAddr})
}

// GetServerInfo says what this server serves besides the API, and the
// nodes it places sandboxes on with the isolations each offers.
func (s *Server) GetServerInfo(ctx context.Context, req *connect.Request[dsecv1.GetServerInfoRequest]) (*connect.Response[dsecv1.ServerInfo], error) {
	info := &dsecv1.ServerInfo{Name: s.cfg.Name}
	if i := s.info.Load(); i != nil {
		info = proto.CloneOf(i)
	}
	info.Nodes = s.nodeInfos()
	return connect.NewResponse(info), nil
}
