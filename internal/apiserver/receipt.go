package apiserver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/outcome"
	dsec "dsec.dev/dsec/sdk/go"
	"dsec.dev/dsec/sdk/go/receipt"
)

// gradeReceipt has the edge that ran the grade's clean room sign its
// receipt (EdgeService.SignReceipt): the apiserver composes it (what the
// clean room ran on, as that edge recorded it at its create, the workspace
// capture's digest, the grader and its tests' digest, the exit, the reward,
// the outcome and the times, the graded sandbox's trajectory hash and its
// provenance flags as they stood when the grade began), and the edge checks
// what it saw itself before it signs with its key: its leaf certificate
// from the cluster CA, or the all-in-one's node key. An edge that holds no
// key answers NotSupported.
func (s *Server) gradeReceipt(ctx context.Context, req *dsecv1.GradeRequest, res *dsecv1.GradeResult, started, finished time.Time) ([]byte, error) {
	room := res.GetGraderSandboxId()
	e, err := s.edgeFor(room)
	if err != nil {
		return nil, fmt.Errorf("sign grade receipt: clean room %s: %w", room, err)
	}
	sb, err := e.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: room}))
	if err != nil {
		return nil, fmt.Errorf("sign grade receipt: clean room %s: %w", room, err)
	}
	grader := req.GetArgv()
	if len(grader) == 0 {
		grader = []string{"sh", "-c", req.GetCommand()}
	}
	r := receipt.Receipt{
		Sandbox:       req.GetSandboxId(),
		GradeSandbox:  room,
		Image:         res.GetEnvironment(),
		Layers:        sb.Msg.GetLayerDigests(),
		Workspace:     res.GetCapture().GetDigest(),
		Paths:         req.GetPaths(),
		GraderCommand: grader,
		GraderDigest:  testsDigest(req.GetTests()),
		Exit:          int(res.GetExit().GetExitCode()),
		Reward:        res.GetReward(),
		Trajectory:    res.GetTrajectoryHash(),
		Provenance:    dsec.ProvenanceFlagNames(res.GetProvenance().GetFlags()),
		Outcome:       "task",
		Started:       started.UTC(),
		Finished:      finished.UTC(),
	}
	if f := res.GetFault(); f != dsecv1.Fault_FAULT_UNSPECIFIED {
		r.Outcome, r.Fault = "fault", outcome.Words(f)
	}
	payload, err := json.Marshal(r)
	if err != nil {
		return nil, fmt.Errorf("sign grade receipt: encode: %w", err)
	}
	signed, err := e.SignReceipt(ctx, connect.NewRequest(&edgev1.SignReceiptRequest{Receipt: payload}))
	if err != nil {
		return nil, fmt.Errorf("sign grade receipt on node %s: %w", sb.Msg.GetNode(), err)
	}
	return signed.Msg.GetEnvelope(), nil
}

// testsDigest is the digest of a grade's trusted tests: the layer named
// (its ref or digest, as asked; its digest is among the layers), and the
// SHA-256 of the files, each path and content length-prefixed, in path
// order; "" for none.
func testsDigest(t *dsecv1.GradeTests) string {
	files := t.GetFiles()
	if len(files) == 0 {
		return t.GetLayer()
	}
	h := sha256.New()
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for _, p := range paths {
		fmt.Fprintf(h, "%d:%s%d:", len(p), p, len(files[p]))
		h.Write(files[p])
	}
	d := "files:sha256:" + hex.EncodeToString(h.Sum(nil))
	if t.GetLayer() != "" {
		d = t.GetLayer() + "+" + d
	}
	return d
}
