package edgesvc

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/grade"
	"dsec.dev/dsec/internal/outcome"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

// Receipts returns the key a node signs grade receipts with. It is called
// for each receipt, so an edge whose certificate is rotated signs with the
// new one as its TLS does.
type Receipts func() (*sdkreceipt.Signer, error)

// SetReceipts gives the node its receipt key; call it before serving.
// Without one, SignReceipt answers NotSupported.
func (s *Service) SetReceipts(r Receipts) { s.receipts = r }

// SignReceipt signs a grade's receipt once the node has checked the facts
// in it that it saw itself: the clean room is its own and grades the
// receipt's sandbox, was started on the receipt's environment and layers
// (the workspace capture among them), ran the grader's command to the
// receipt's exit and fault, and its reward file and that exit give the
// receipt's reward (grade.Reward). The rest (the paths, the tests' digest,
// the provenance flags and trajectory hash of the graded sandbox, perhaps
// on another node, the times) is the apiserver's word, signed as given.
func (s *Service) SignReceipt(ctx context.Context, req *connect.Request[edgev1.SignReceiptRequest]) (*connect.Response[edgev1.SignReceiptResponse], error) {
	if s.receipts == nil {
		return nil, fmt.Errorf("sign receipt: node %s holds no receipt key: %w", s.edge.Node(), errdefs.ErrNotSupported)
	}
	dec := json.NewDecoder(bytes.NewReader(req.Msg.GetReceipt()))
	dec.DisallowUnknownFields()
	var r sdkreceipt.Receipt
	if err := dec.Decode(&r); err != nil {
		return nil, fmt.Errorf("sign receipt: read it: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	if r.GradeSandbox == "" || r.Sandbox == "" {
		return nil, fmt.Errorf("sign receipt: sandbox and grade_sandbox are required: %w", errdefs.ErrInvalidArgument)
	}
	room, err := s.edge.Get(ctx, r.GradeSandbox)
	if err != nil {
		return nil, fmt.Errorf("sign receipt: clean room %s: %w", r.GradeSandbox, err)
	}
	ran, ok := s.execs.last(r.GradeSandbox, commandKey(r.GraderCommand))
	if !ok {
		return nil, fmt.Errorf("sign receipt: node %s did not see %q run in clean room %s: %w",
			s.edge.Node(), strings.Join(r.GraderCommand, " "), r.GradeSandbox, errdefs.ErrFailedPrecondition)
	}
	file, err := s.rewardFile(ctx, r.GradeSandbox, ran)
	if err != nil {
		return nil, fmt.Errorf("sign receipt: %w", err)
	}
	if err := checkReceipt(r, room, ran, file); err != nil {
		return nil, fmt.Errorf("sign receipt: node %s saw otherwise: %w: %w", s.edge.Node(), err, errdefs.ErrFailedPrecondition)
	}
	signer, err := s.receipts()
	if err != nil {
		return nil, fmt.Errorf("sign receipt: %w", err)
	}
	if signer.Node() != s.edge.Node() {
		return nil, fmt.Errorf("sign receipt: node %s's receipt key names node %s: %w", s.edge.Node(), signer.Node(), errdefs.ErrFailedPrecondition)
	}
	env, err := signer.Sign(r)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.SignReceiptResponse{Envelope: env}), nil
}

// rewardFile reads the reward file of clean room id as its grader, which
// exited with ran, left it (nil for none, or for a grader the platform
// ended, whose reward file means nothing).
func (s *Service) rewardFile(ctx context.Context, id string, ran *dsecv1.ExecExited) ([]byte, error) {
	if ran.GetFault() != dsecv1.Fault_FAULT_UNSPECIFIED {
		return nil, nil
	}
	resp, err := s.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: grade.RewardFile, Limit: grade.MaxRewardBytes, User: "root"}))
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("read the reward file of clean room %s: %w", id, err)
	}
	return resp.Msg.GetData(), nil
}

// checkReceipt compares a receipt with what the node saw: the clean room
// room, the grader's exit ran and its reward file.
func checkReceipt(r sdkreceipt.Receipt, room *dsecv1.Sandbox, ran *dsecv1.ExecExited, rewardFile []byte) error {
	spec := room.GetSpec()
	switch {
	case spec.GetLabels()[grade.GradeOfLabel] != r.Sandbox:
		return fmt.Errorf("clean room %s grades sandbox %q, not %s", r.GradeSandbox, spec.GetLabels()[grade.GradeOfLabel], r.Sandbox)
	case spec.GetEnvironment() != r.Image:
		return fmt.Errorf("clean room %s runs environment %s, not %s", r.GradeSandbox, spec.GetEnvironment(), r.Image)
	case !slices.Equal(room.GetLayerDigests(), r.Layers):
		return fmt.Errorf("clean room %s runs on layers %v, not %v", r.GradeSandbox, room.GetLayerDigests(), r.Layers)
	case r.Workspace == "" || !slices.Contains(room.GetLayerDigests(), r.Workspace):
		return fmt.Errorf("the workspace capture %q is not a layer of clean room %s", r.Workspace, r.GradeSandbox)
	case int(ran.GetExitCode()) != r.Exit:
		return fmt.Errorf("the grader exited %d, not %d", ran.GetExitCode(), r.Exit)
	}
	fault := ""
	if f := ran.GetFault(); f != dsecv1.Fault_FAULT_UNSPECIFIED {
		fault = outcome.Words(f)
	}
	switch {
	case fault != r.Fault:
		return fmt.Errorf("the grader's fault was %q, not %q", fault, r.Fault)
	case fault != "" && r.Outcome != "fault", fault == "" && r.Outcome != "task":
		return fmt.Errorf("the grader's outcome was not %q", r.Outcome)
	case fault != "" && r.Reward != 0:
		return fmt.Errorf("the platform ended the grader, which scores nothing, not %v", r.Reward)
	}
	if fault != "" {
		return nil
	}
	if want, source := grade.Reward(ran, rewardFile); r.Reward != want {
		return fmt.Errorf("the grader's reward was %v (from its %s), not %v", want, source, r.Reward)
	}
	return nil
}

// commandKey names a command as a receipt does (grader_command): its argv,
// or sh -c COMMAND.
func commandKey(argv []string) [sha256.Size]byte {
	b, _ := json.Marshal(argv) // a []string always encodes
	return sha256.Sum256(b)
}

// execCommand is the command an exec request ran, as a receipt names it.
func execCommand(req *dsecv1.ExecRequest) []string {
	if len(req.GetArgv()) > 0 {
		return req.GetArgv()
	}
	return []string{"sh", "-c", req.GetCommand()}
}

// Bounds of the exec log: the last execs of each sandbox, of the sandboxes
// that ran one most recently. A grade asks for its receipt moments after
// its grader exited, two calls later.
const (
	execsPerSandbox = 8
	execSandboxes   = 4096
)

// execLog is what the node saw of the execs it ran to their end: per
// sandbox, each command's key and exit, newest last. It is safe for
// concurrent use; the zero value is empty.
type execLog struct {
	mu    sync.Mutex
	execs map[string][]execSeen
	order []string // sandboxes, oldest first
}

type execSeen struct {
	command [sha256.Size]byte
	exit    *dsecv1.ExecExited
}

func (l *execLog) add(id string, command [sha256.Size]byte, exit *dsecv1.ExecExited) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.execs == nil {
		l.execs = map[string][]execSeen{}
	}
	seen, known := l.execs[id]
	if !known {
		l.order = append(l.order, id)
	}
	if len(seen) == execsPerSandbox {
		seen = slices.Delete(seen, 0, 1)
	}
	l.execs[id] = append(seen, execSeen{command: command, exit: exit})
	for len(l.order) > execSandboxes {
		delete(l.execs, l.order[0])
		l.order = l.order[1:]
	}
}

// last is the exit of the newest exec of command in sandbox id.
func (l *execLog) last(id string, command [sha256.Size]byte) (*dsecv1.ExecExited, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	seen := l.execs[id]
	for i := len(seen) - 1; i >= 0; i-- {
		if seen[i].command == command {
			return seen[i].exit, true
		}
	}
	return nil, false
}

// forget drops a deleted sandbox's execs.
func (l *execLog) forget(id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.execs[id]; !ok {
		return
	}
	delete(l.execs, id)
	l.order = slices.DeleteFunc(l.order, func(s string) bool { return s == id })
}

// execWatch is an exec's stream to its caller, noting the exit in the
// node's exec log before it is sent on: by the time the caller learns the
// exit, the node can vouch for it.
type execWatch struct {
	out     sender[dsecv1.ExecEvent]
	log     *execLog
	id      string
	command [sha256.Size]byte
}

func (w execWatch) Send(e *dsecv1.ExecEvent) error {
	if x := e.GetExited(); x != nil {
		w.log.add(w.id, w.command, x)
	}
	return w.out.Send(e)
}
