package apiserver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/outcome"
	dsec "dsec.dev/dsec/sdk/go"
	"dsec.dev/dsec/sdk/go/receipt"
)

// gradeReceipt signs the receipt of a grade with the server's receipt key
// (Config.Receipts): what the clean room ran on (its environment's layer
// digests, as the edges recorded them at its create), the workspace
// capture's digest, the grader and its tests' digest, the exit, the reward,
// the outcome and the times, the graded sandbox's trajectory hash and its
// provenance flags as they stood when the grade began.
func (s *Server) gradeReceipt(ctx context.Context, req *dsecv1.GradeRequest, res *dsecv1.GradeResult, started, finished time.Time) ([]byte, error) {
	layers, err := s.environmentLayers(ctx, res.GetEnvironment())
	if err != nil {
		return nil, fmt.Errorf("sign grade receipt: %w", err)
	}
	grader := req.GetArgv()
	if len(grader) == 0 {
		grader = []string{"sh", "-c", req.GetCommand()}
	}
	r := receipt.Receipt{
		Sandbox:       req.GetSandboxId(),
		GradeSandbox:  res.GetGraderSandboxId(),
		Image:         res.GetEnvironment(),
		Layers:        layers,
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
	return s.cfg.Receipts.Sign(r)
}

// environmentLayers is the layer digests, bottom first, of an environment a
// sandbox was made from, as the edges recorded it.
func (s *Server) environmentLayers(ctx context.Context, env string) ([]string, error) {
	resp, err := (&layerService{s: s}).ListEnvironments(ctx, connect.NewRequest(&dsecv1.ListEnvironmentsRequest{}))
	if err != nil {
		return nil, fmt.Errorf("list environments: %w", err)
	}
	for _, e := range resp.Msg.GetEnvironments() {
		if e.GetName() == env {
			return e.GetLayerDigests(), nil
		}
	}
	return nil, fmt.Errorf("environment %s: no edge recorded its layers", env)
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
