package apiserver

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/outcome"
	"dsec.dev/dsec/internal/sandboxid"
	dsec "dsec.dev/dsec/sdk/go"
	"dsec.dev/dsec/sdk/go/receipt"
)

// gradeReceipt has the edge that ran the grade's clean room sign its
// receipt (EdgeService.SignReceipt): the apiserver composes it (what the
// clean room ran on, as that edge recorded it at its create, the workspace
// capture's digest, the grader and its tests' digest, the exit, the reward,
// the outcome and the times, the graded sandbox's trajectory hash and its
// provenance flags as they stood when the grade began), and the edge checks
// what it saw itself (the tests' files it hashes in the clean room, from
// the paths given beside the receipt, and the graded sandbox's evidence,
// from that sandbox's node's attestation when it is another node's)
// before it signs with its key: its leaf certificate from the cluster CA,
// or the all-in-one's node key. An edge that holds no key answers
// NotSupported.
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
		GraderDigest:  receipt.TestsDigest(req.GetTests().GetLayer(), req.GetTests().GetFiles()),
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
	// The edge hashes the tests' files in the clean room itself.
	files := slices.Sorted(maps.Keys(req.GetTests().GetFiles()))
	attestation := s.attestation(ctx, r, sb.Msg.GetNode())
	signed, err := e.SignReceipt(ctx, connect.NewRequest(&edgev1.SignReceiptRequest{Receipt: payload, TestFiles: files, Attestation: attestation}))
	if err != nil {
		return nil, fmt.Errorf("sign grade receipt on node %s: %w", sb.Msg.GetNode(), err)
	}
	return signed.Msg.GetEnvelope(), nil
}

// attestation asks the graded sandbox's node to attest the receipt's
// evidence of it (EdgeService.Attest: its trajectory hash over the
// receipt's size, and its newest provenance report's flags) when the clean
// room ran on another node (roomNode), which cannot see that sandbox: the
// clean room's node vouches for that evidence only on its node's signed
// word. nil where the sandbox is the room's node's own, or the attestation
// cannot be had (logged: the receipt is then signed without vouching for
// that evidence, as before).
func (s *Server) attestation(ctx context.Context, r receipt.Receipt, roomNode string) []byte {
	node, err := sandboxid.Node(r.Sandbox)
	if err != nil || node == roomNode {
		return nil
	}
	var size int64
	if _, sizeText, ok := strings.Cut(r.Trajectory, "@"); ok {
		size, _ = strconv.ParseInt(sizeText, 10, 64)
	}
	e, err := s.edgeFor(r.Sandbox)
	if err == nil {
		var resp *connect.Response[edgev1.AttestResponse]
		resp, err = e.Attest(ctx, connect.NewRequest(&edgev1.AttestRequest{SandboxId: r.Sandbox, TrajectoryBytes: size}))
		if err == nil {
			return resp.Msg.GetAttestation()
		}
	}
	s.log.Warn("receipt without the graded sandbox's node's attestation", "sandbox", r.Sandbox, "node", node, "err", err)
	return nil
}
