package grade_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/grade"
)

// failingExec is a sandbox API whose execs fail (an edge lost under the
// grader), noting what Run deletes.
type failingExec struct {
	grade.API // the calls Run should not make panic on nil
	deleted   []string
	room      *dsecv1.SandboxSpec // the clean room's spec, as created
}

func (f *failingExec) Get(context.Context, *connect.Request[dsecv1.GetRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return connect.NewResponse(&dsecv1.Sandbox{Id: "sb-a", Spec: &dsecv1.SandboxSpec{Environment: "busybox:test", Qos: "best_effort"}}), nil
}

func (f *failingExec) Snapshot(_ context.Context, req *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotInfo], error) {
	return connect.NewResponse(&dsecv1.SnapshotInfo{Name: req.Msg.GetName(), Environment: "busybox:test+snap:" + req.Msg.GetName()}), nil
}

func (f *failingExec) Create(_ context.Context, req *connect.Request[dsecv1.CreateRequest]) (*connect.Response[dsecv1.CreateResponse], error) {
	f.room = req.Msg.GetSpec()
	return connect.NewResponse(&dsecv1.CreateResponse{Sandboxes: []*dsecv1.Sandbox{{Id: "sb-room"}}}), nil
}

func (f *failingExec) WriteFile(context.Context, *connect.Request[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error) {
	return connect.NewResponse(&dsecv1.WriteFileResponse{}), nil
}

func (f *failingExec) Exec(context.Context, *connect.Request[dsecv1.ExecRequest]) (*connect.ServerStreamForClient[dsecv1.ExecEvent], error) {
	return nil, connect.NewError(connect.CodeUnavailable, errors.New("node e1 is unreachable"))
}

func (f *failingExec) Delete(_ context.Context, req *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error) {
	f.deleted = append(f.deleted, req.Msg.GetId())
	return connect.NewResponse(&dsecv1.DeleteResponse{}), nil
}

func (f *failingExec) DeleteSnapshot(_ context.Context, req *connect.Request[dsecv1.DeleteSnapshotRequest]) (*connect.Response[dsecv1.DeleteSnapshotResponse], error) {
	f.deleted = append(f.deleted, "snapshot")
	return connect.NewResponse(&dsecv1.DeleteSnapshotResponse{}), nil
}

// TestRunFailsTidily: a grade whose grader cannot run (its clean room's
// edge unreachable) is an error of the platform's kind, never a result,
// and deletes the clean room and the capture before it returns (a return
// of an error once panicked on the cleanup it had set to nil).
func TestRunFailsTidily(t *testing.T) {
	api := &failingExec{}
	res, done, err := grade.Run(t.Context(), api, &dsecv1.GradeRequest{SandboxId: "sb-a", Paths: []string{"/work"}, Command: "true"}, nil)
	if err == nil || res != nil || done != nil {
		t.Fatalf("Run with the grader's exec failing: result %v, done %v, error %v; want only an error", res, done != nil, err)
	}
	if connect.CodeOf(err) != connect.CodeUnavailable {
		t.Errorf("Run's error %v is %v, want the exec's Unavailable", err, connect.CodeOf(err))
	}
	if !slices.Equal(api.deleted, []string{"sb-room", "snapshot"}) {
		t.Errorf("Run deleted %v, want the clean room and then the capture", api.deleted)
	}
	// The trainer waits on the reward: a best-effort rollout's clean room
	// runs at the latency class.
	if got := api.room.GetQos(); got != "latency" {
		t.Errorf("the clean room of a best-effort sandbox has qos %q, want latency", got)
	}
}
