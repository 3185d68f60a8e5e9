package edgesvc

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/grade"
	"dsec.dev/dsec/internal/outcome"
	"dsec.dev/dsec/internal/receipt"
	"dsec.dev/dsec/internal/sandboxid"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

// Receipts returns the key a node signs grade receipts with. It is called
// for each receipt, so an edge whose certificate is rotated signs with the
// new one as its TLS does.
type Receipts func() (*sdkreceipt.Signer, error)

// SetReceipts gives the node its receipt key; call it before serving.
// Without one, SignReceipt and Attest answer NotSupported.
func (s *Service) SetReceipts(r Receipts) { s.receipts = r }

// Trust returns what the node checks other nodes' attestations against:
// the cluster's CA bundle (the all-in-one: its own node certificate). It
// is called for each receipt that carries one, so a rotated CA bundle
// counts from then on.
type Trust func() (*sdkreceipt.Verifier, error)

// SetTrust gives the node the trust it checks the attestations a
// SignReceipt carries against; call it before serving. Without it, the
// node vouches for no other node's sandbox.
func (s *Service) SetTrust(t Trust) { s.trust = t }

// Attest signs, with the node's receipt key, what the node sees now of a
// sandbox of its own (internal/receipt.Attestation): the SHA-256 of the
// first trajectory_bytes bytes of its trajectory (0: all of it), and the
// flags of the newest provenance report it made of it and when (the same
// reports SignReceipt checks a receipt of its own sandbox against). A
// grade whose clean room is on another node hands it to that node's
// SignReceipt.
func (s *Service) Attest(ctx context.Context, req *connect.Request[edgev1.AttestRequest]) (*connect.Response[edgev1.AttestResponse], error) {
	id := req.Msg.GetSandboxId()
	if id == "" {
		return nil, fmt.Errorf("attest: sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	if s.receipts == nil {
		return nil, fmt.Errorf("attest %s: node %s holds no receipt key: %w", id, s.edge.Node(), errdefs.ErrNotSupported)
	}
	if node, err := sandboxid.Node(id); err != nil || node != s.edge.Node() {
		return nil, fmt.Errorf("attest %s: not a sandbox of node %s: %w", id, s.edge.Node(), errdefs.ErrNotFound)
	}
	if _, err := s.edge.Get(ctx, id); err != nil {
		return nil, fmt.Errorf("attest %s: %w", id, err)
	}
	a := receipt.Attestation{Sandbox: id}
	if s.rec != nil {
		size := req.Msg.GetTrajectoryBytes()
		rd, err := s.rec.Read(ctx, id, 0, int(max(size, 1)))
		switch {
		case err != nil:
			s.log.Debug("attestation without a trajectory", "sandbox", id, "err", err)
		case size == 0 && rd.Size > 0:
			a.Trajectory = fmt.Sprintf("sha256:%s@%d", rd.SHA256, rd.Size)
		case size > 0 && int64(len(rd.Lines)) >= size:
			sum := sha256.Sum256(rd.Lines[:size])
			a.Trajectory = fmt.Sprintf("sha256:%x@%d", sum, size)
		}
	}
	if p, ok := s.execs.lastReport(id); ok {
		a.Provenance, a.Reported = p.flags, p.at.UTC()
	}
	signer, err := s.receipts()
	if err != nil {
		return nil, fmt.Errorf("attest %s: %w", id, err)
	}
	env, err := receipt.Attest(signer, a)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, errdefs.ErrFailedPrecondition)
	}
	return connect.NewResponse(&edgev1.AttestResponse{Attestation: env}), nil
}

// attested adds to the receipt's vouched the graded sandbox's evidence
// that an attestation of another node (SignReceiptRequest.attestation)
// vouches for (receipt.Vouches), among want; an attestation that does not
// verify vouches for nothing and is logged.
func (s *Service) attested(r *sdkreceipt.Receipt, attestation []byte, want []string) {
	if len(attestation) == 0 || len(want) == 0 {
		return
	}
	if s.trust == nil {
		s.log.Info("receipt's attestation not checked: the node holds no trust for other nodes", "sandbox", r.Sandbox)
		return
	}
	v, err := s.trust()
	if err != nil {
		s.log.Warn("receipt's attestation not checked", "sandbox", r.Sandbox, "err", err)
		return
	}
	fields, err := receipt.Vouches(v, attestation, *r, r.Started.Add(-provenanceSkew))
	if err != nil {
		s.log.Warn("receipt's attestation does not vouch for all it could", "sandbox", r.Sandbox, "vouched", fields, "err", err)
	}
	for _, f := range fields {
		if slices.Contains(want, f) {
			r.Vouched = append(r.Vouched, f)
		}
	}
}

// SignReceipt signs a grade's receipt once the node has checked the facts
// in it that it saw itself: the clean room is its own and grades the
// receipt's sandbox, was started on the receipt's environment and layers
// (the workspace capture among them), ran the grader's command to the
// receipt's exit and fault, and its reward file and that exit give the
// receipt's reward (grade.Reward); the trusted tests it holds (the files
// named in the request, hashed here, and the tests' layer among its
// layers) are the receipt's grader digest, and nothing but the grader's
// own user acted in it since the grader began, so they are the tests the
// grader ran with. Where the graded sandbox's trajectory is the node's
// (the sandbox is its own, or its trajectory is in the blob store), its
// hash is checked too, and the provenance flags against those the node
// reported for it since the grade began; where it is another node's, the
// request's attestation of that node may vouch for them (attested). It
// stamps the fields it checked in the receipt's vouched; the rest (the
// paths, the times, and the graded sandbox's evidence no one vouched for)
// it signs as given.
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
	refuse := func(err error) error {
		return fmt.Errorf("sign receipt: node %s saw otherwise: %w: %w", s.edge.Node(), err, errdefs.ErrFailedPrecondition)
	}
	// Nothing but the grader's user acted in the clean room since the
	// grader began (the grade kills what it left as that user): what the
	// node reads there now is what the grader left.
	if other := s.execs.othersSince(r.GradeSandbox, ran.seq, ran.user); other != "" {
		return nil, refuse(fmt.Errorf("%s acted in clean room %s after its grader began", other, r.GradeSandbox))
	}
	file, err := s.rewardFile(ctx, r.GradeSandbox, ran.exit, ran.afterReward)
	if err != nil {
		return nil, fmt.Errorf("sign receipt: %w", err)
	}
	if err := checkReceipt(r, room, ran.exit, file); err != nil {
		return nil, refuse(err)
	}
	if err := s.checkTests(ctx, r, room, req.Msg.GetTestFiles()); err != nil {
		return nil, refuse(err)
	}
	r.Vouched = []string{"sandbox", "grade_sandbox", "image", "layers", "workspace_digest", "grader_command", "grader_digest",
		"exit", "reward", "outcome", "fault"}
	traj, err := s.checkTrajectory(ctx, r)
	if err != nil {
		return nil, refuse(err)
	}
	prov, err := s.checkProvenance(r)
	if err != nil {
		return nil, refuse(err)
	}
	if traj {
		r.Vouched = append(r.Vouched, "trajectory_hash")
	}
	if prov {
		r.Vouched = append(r.Vouched, "provenance_flags")
	}
	// The graded sandbox on another node: what that node attested of it.
	var rest []string
	if !traj {
		rest = append(rest, "trajectory_hash")
	}
	if !prov {
		rest = append(rest, "provenance_flags")
	}
	s.attested(&r, req.Msg.GetAttestation(), rest)
	r.Vouched = append(r.Vouched, "node", "signed_at")
	slices.SortStableFunc(r.Vouched, func(a, b string) int {
		return slices.Index(sdkreceipt.Fields, a) - slices.Index(sdkreceipt.Fields, b)
	})
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
// ended, whose reward file means nothing). A grader whose exec had the
// node kill its leftovers and then read the reward file (afterReward:
// ExecAfter) carries what the node read then.
func (s *Service) rewardFile(ctx context.Context, id string, ran *dsecv1.ExecExited, afterReward bool) ([]byte, error) {
	if ran.GetFault() != dsecv1.Fault_FAULT_UNSPECIFIED {
		return nil, nil
	}
	if ran.GetAfter() != nil && afterReward {
		return ran.GetAfter().GetFile(), nil
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

// maxTestsBytes bounds the test files the node reads back to hash.
const maxTestsBytes = 64 << 20

// checkTests checks the receipt's grader digest against the trusted tests
// in clean room room: the files at paths, read and hashed here after the
// grader ran (sdkreceipt.TestsDigest), and the tests' layer it names,
// which must be one of the room's layers or the layer its environment
// names last (ENV+LAYER, as the grade asks for it).
func (s *Service) checkTests(ctx context.Context, r sdkreceipt.Receipt, room *dsecv1.Sandbox, paths []string) error {
	layer := sdkreceipt.TestsLayer(r.GraderDigest)
	if layer != "" && !slices.Contains(room.GetLayerDigests(), layer) && !strings.HasSuffix(room.GetSpec().GetEnvironment(), "+"+layer) {
		return fmt.Errorf("the tests' layer %s is not a layer of clean room %s", layer, r.GradeSandbox)
	}
	files := map[string][]byte{}
	var total int64
	for _, p := range paths {
		if !strings.HasPrefix(p, "/") {
			return fmt.Errorf("tests file %q is not an absolute path", p)
		}
		resp, err := s.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: r.GradeSandbox, Path: p, Limit: maxTestsBytes - total, User: "root"}))
		if err != nil {
			return fmt.Errorf("read tests file %s in clean room %s: %w", p, r.GradeSandbox, err)
		}
		if resp.Msg.GetTruncated() {
			return fmt.Errorf("the tests files in clean room %s hold more than the %d bytes the node hashes", r.GradeSandbox, maxTestsBytes)
		}
		files[p] = resp.Msg.GetData()
		total += int64(len(files[p]))
	}
	if got := sdkreceipt.TestsDigest(layer, files); got != r.GraderDigest {
		return fmt.Errorf("the tests in clean room %s are %q, not %q", r.GradeSandbox, got, r.GraderDigest)
	}
	return nil
}

// checkTrajectory checks the receipt's trajectory hash (sha256:HEX@SIZE:
// the SHA-256 of the trajectory's first SIZE bytes) against the graded
// sandbox's trajectory, if the node holds it; vouched says it could.
func (s *Service) checkTrajectory(ctx context.Context, r sdkreceipt.Receipt) (vouched bool, err error) {
	if r.Trajectory == "" || s.rec == nil {
		return false, nil
	}
	sum, sizeText, ok := strings.Cut(strings.TrimPrefix(r.Trajectory, "sha256:"), "@")
	size, perr := strconv.ParseInt(sizeText, 10, 64)
	if !ok || perr != nil || size < 0 || !strings.HasPrefix(r.Trajectory, "sha256:") {
		return false, fmt.Errorf("trajectory hash %q is not sha256:HEX@SIZE", r.Trajectory)
	}
	rd, err := s.rec.Read(ctx, r.Sandbox, 0, int(max(size, 1)))
	if err != nil {
		// Another node's sandbox, not yet in the blob store: not the node's
		// to vouch for.
		s.log.Debug("receipt's trajectory not checked", "sandbox", r.Sandbox, "err", err)
		return false, nil
	}
	if int64(len(rd.Lines)) < size {
		return false, fmt.Errorf("the trajectory of %s holds %d bytes, fewer than the %d its hash covers", r.Sandbox, len(rd.Lines), size)
	}
	if got := sha256.Sum256(rd.Lines[:size]); hex.EncodeToString(got[:]) != sum {
		return false, fmt.Errorf("the first %d bytes of the trajectory of %s hash to sha256:%x, not %s", size, r.Sandbox, got, r.Trajectory)
	}
	return true, nil
}

// provenanceSkew is how much earlier than the grade's start the node's
// clock may put the provenance the grade read: an apiserver's clock and
// the node's may differ.
const provenanceSkew = 2 * time.Second

// checkProvenance checks the receipt's provenance flags against those the
// node reported for the graded sandbox since the grade began (the grade
// reads them as it begins): one of them must be the receipt's. With none
// reported here (the sandbox is another node's), vouched is false.
func (s *Service) checkProvenance(r sdkreceipt.Receipt) (vouched bool, err error) {
	seen := s.execs.reportedSince(r.Sandbox, r.Started.Add(-provenanceSkew))
	if len(seen) == 0 {
		return false, nil
	}
	want := slices.Sorted(slices.Values(r.Provenance))
	for _, p := range seen {
		if slices.Equal(slices.Sorted(slices.Values(p.flags)), want) {
			return true, nil
		}
	}
	return false, fmt.Errorf("the node reported provenance flags %v of %s since the grade began, not %v", seen[len(seen)-1].flags, r.Sandbox, r.Provenance)
}

// flagNames names the provenance flags set in f by their API names, in
// field order (as the SDK's ProvenanceFlagNames does).
func flagNames(f *dsecv1.ProvenanceFlags) []string {
	out := []string{}
	m := f.ProtoReflect()
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		if fd := fields.Get(i); m.Get(fd).Bool() {
			out = append(out, string(fd.Name()))
		}
	}
	return out
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
	case r.Workspace == "" || (r.Workspace != room.GetLaidDigest() && !slices.Contains(room.GetLayerDigests(), r.Workspace)):
		// A pooled clean room's capture was laid into it, not stacked as
		// a layer: the node keeps the digest of what it laid.
		return fmt.Errorf("the workspace capture %q is neither a layer of clean room %s nor what its node laid into it", r.Workspace, r.GradeSandbox)
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

// Bounds of the room log: the last execs, calls and provenance answers of
// each sandbox, of the sandboxes acted on most recently. A grade asks for
// its receipt moments after its grader exited, two calls later.
const (
	execsPerSandbox      = 8
	callsPerSandbox      = 16
	provenancePerSandbox = 4
	execSandboxes        = 4096
)

// execLog is what the node saw done to its sandboxes, for receipts: per
// sandbox, the calls that acted on it in the order they began, the execs
// it ran to their end (each command's key, its user, its exit and which
// call it was), and the provenance it reported. It is safe for concurrent
// use; the zero value is empty.
type execLog struct {
	mu    sync.Mutex
	execs map[string]*roomSeen
	order []string // sandboxes, oldest first
}

// roomSeen is what the node saw done to one sandbox, newest last in each
// list.
type roomSeen struct {
	calls      int64 // the calls that acted on it so far
	recent     []callSeen
	execs      []execSeen
	provenance []provenanceSeen
}

// callSeen is one call that acted on a sandbox: its number among the
// sandbox's calls (from 1), its name in the trajectory and, for an exec,
// the user it ran as.
type callSeen struct {
	seq  int64
	call string
	user string
}

type execSeen struct {
	command [sha256.Size]byte
	exit    *dsecv1.ExecExited
	seq     int64 // the exec's call
	user    string
	// afterReward: the exec had the node kill its user's leftovers and
	// then read the reward file (ExecAfter), which its exit carries.
	afterReward bool
}

// provenanceSeen is provenance the node reported: its flags' names and
// when.
type provenanceSeen struct {
	at    time.Time
	flags []string
}

// room returns sandbox id's record, making it; l.mu is held.
func (l *execLog) room(id string) *roomSeen {
	if l.execs == nil {
		l.execs = map[string]*roomSeen{}
	}
	r := l.execs[id]
	if r == nil {
		r = &roomSeen{}
		l.execs[id] = r
		l.order = append(l.order, id)
		for len(l.order) > execSandboxes {
			delete(l.execs, l.order[0])
			l.order = l.order[1:]
		}
	}
	return r
}

// keep appends v to list, dropping the oldest past n.
func keep[T any](list []T, v T, n int) []T {
	if len(list) == n {
		list = slices.Delete(list, 0, 1)
	}
	return append(list, v)
}

// act notes that call began acting on sandbox id (user: an exec's user)
// and returns its number among the sandbox's calls.
func (l *execLog) act(id, call, user string) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.room(id)
	r.calls++
	r.recent = keep(r.recent, callSeen{seq: r.calls, call: call, user: user}, callsPerSandbox)
	return r.calls
}

// add notes the exit of exec call seq, as user, of command in sandbox id
// (afterReward: see execSeen).
func (l *execLog) add(id string, command [sha256.Size]byte, exit *dsecv1.ExecExited, seq int64, user string, afterReward bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.room(id)
	r.execs = keep(r.execs, execSeen{command: command, exit: exit, seq: seq, user: user, afterReward: afterReward}, execsPerSandbox)
}

// last is the newest exec of command in sandbox id.
func (l *execLog) last(id string, command [sha256.Size]byte) (execSeen, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.execs[id]
	if r == nil {
		return execSeen{}, false
	}
	for i := len(r.execs) - 1; i >= 0; i-- {
		if r.execs[i].command == command {
			return r.execs[i], true
		}
	}
	return execSeen{}, false
}

// othersSince describes the first call that acted on sandbox id after
// call seq other than an exec as user: "" when there was none. Calls the
// log no longer holds count as such a call: it cannot tell.
func (l *execLog) othersSince(id string, seq int64, user string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.execs[id]
	if r == nil {
		return ""
	}
	if len(r.recent) > 0 && r.recent[0].seq > seq+1 {
		return fmt.Sprintf("%d calls, more than the node keeps", r.calls-seq)
	}
	for _, c := range r.recent {
		if c.seq > seq && (c.call != "exec" || c.user != user) {
			if c.call == "exec" {
				return fmt.Sprintf("an exec as user %q", c.user)
			}
			return "a call " + c.call
		}
	}
	return ""
}

// reported notes provenance flags the node reported for sandbox id.
func (l *execLog) reported(id string, flags []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.room(id)
	r.provenance = keep(r.provenance, provenanceSeen{at: time.Now(), flags: flags}, provenancePerSandbox)
}

// lastReport is the newest provenance the node reported for sandbox id.
func (l *execLog) lastReport(id string) (provenanceSeen, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.execs[id]
	if r == nil || len(r.provenance) == 0 {
		return provenanceSeen{}, false
	}
	return r.provenance[len(r.provenance)-1], true
}

// reportedSince is the provenance the node reported for sandbox id at or
// after since, oldest first.
func (l *execLog) reportedSince(id string, since time.Time) []provenanceSeen {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.execs[id]
	if r == nil {
		return nil
	}
	var out []provenanceSeen
	for _, p := range r.provenance {
		if !p.at.Before(since) {
			out = append(out, p)
		}
	}
	return out
}

// forget drops a deleted sandbox's record.
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
	seq     int64 // the exec's call
	user    string
	// afterReward: the exec asks the node to kill its user's leftovers
	// and read the reward file once it exits.
	afterReward bool
}

func (w execWatch) Send(e *dsecv1.ExecEvent) error {
	if x := e.GetExited(); x != nil {
		w.log.add(w.id, w.command, x, w.seq, w.user, w.afterReward)
	}
	return w.out.Send(e)
}
