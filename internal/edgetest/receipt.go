package edgetest

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/grade"
	ireceipt "dsec.dev/dsec/internal/receipt"
	"dsec.dev/dsec/internal/sandboxid"
	"dsec.dev/dsec/sdk/go/receipt"
)

// testReceipt checks SignReceipt: an edge without a key refuses it
// (NotSupported); one with a key signs a receipt of what it saw (a clean
// room it made, its layers, a command it ran, its exit and the reward its
// reward file gives), which verifies
// against Options.ReceiptCA and names the node, and refuses one naming a
// fact it did not see (FailedPrecondition) or a sandbox it never made
// (NotFound). An edge that runs nothing in its sandboxes sees no grader
// run, so it signs nothing.
func testReceipt(t *testing.T, e *edge) {
	ctx := t.Context()
	graded := "sb-graded"
	if !e.o.Deviations.NoAgent && e.o.ReceiptCA != "" {
		// A sandbox of this node, so the node vouches for its evidence.
		graded = e.create(ctx, "").GetId()
	}
	spec := e.spec()
	spec.Labels[grade.GradeOfLabel] = graded
	resp, err := e.h.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec}))
	if err != nil {
		t.Fatalf("Create the clean room: %v", err)
	}
	room := resp.Msg
	now := time.Now().UTC().Truncate(time.Second)
	r := receipt.Receipt{
		Sandbox: graded, GradeSandbox: room.GetId(),
		Image: room.GetSpec().GetEnvironment(), Layers: room.GetLayerDigests(),
		GraderCommand: []string{"sh", "-c", "exit 3"}, Exit: 3, Outcome: "task",
		Started: now, Finished: now,
	}
	if len(r.Layers) > 0 {
		r.Workspace = r.Layers[len(r.Layers)-1]
	}
	signTests := func(r receipt.Receipt, tests []string) ([]byte, error) {
		payload, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := e.h.SignReceipt(ctx, connect.NewRequest(&edgev1.SignReceiptRequest{Receipt: payload, TestFiles: tests}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetEnvelope(), nil
	}
	sign := func(r receipt.Receipt) ([]byte, error) { return signTests(r, nil) }
	if e.o.ReceiptCA == "" {
		_, err := sign(r)
		wantKind(t, "SignReceipt on an edge without a receipt key", err, errdefs.ErrNotSupported)
		return
	}
	if e.o.Deviations.NoAgent {
		_, err := sign(r)
		wantKind(t, "SignReceipt of a grader an edge without sandboxes' agents never ran", err, errdefs.ErrFailedPrecondition)
		return
	}

	_, err = sign(r)
	wantKind(t, "SignReceipt before the grader ran", err, errdefs.ErrFailedPrecondition)
	if _, err := e.exec(ctx, room.GetId(), "exit 3"); err != nil {
		t.Fatalf("exec the grader: %v", err)
	}
	env, err := sign(r)
	if err != nil {
		t.Fatalf("SignReceipt of what the edge saw: %v", err)
	}
	v, err := receipt.NewVerifierFile(e.o.ReceiptCA)
	if err != nil {
		t.Fatal(err)
	}
	got, err := v.Verify(env)
	if err != nil {
		t.Fatalf("verify the signed receipt: %v", err)
	}
	if got.Node != e.node || got.GradeSandbox != room.GetId() || got.Exit != 3 {
		t.Errorf("the signed receipt names node %q, clean room %q, exit %d; want %q, %q, 3", got.Node, got.GradeSandbox, got.Exit, e.node, room.GetId())
	}
	for _, f := range []string{"grade_sandbox", "layers", "workspace_digest", "grader_command", "grader_digest", "exit", "reward", "node"} {
		if !slices.Contains(got.Vouched, f) {
			t.Errorf("the signed receipt's vouched %v leaves out %s", got.Vouched, f)
		}
	}
	for _, f := range []string{"paths", "started", "finished", "trajectory_hash", "provenance_flags"} {
		if slices.Contains(got.Vouched, f) {
			t.Errorf("the signed receipt vouches for %s, which the node did not check: %v", f, got.Vouched)
		}
	}

	for _, c := range []struct {
		name string
		edit func(r *receipt.Receipt)
	}{
		{"another exit", func(r *receipt.Receipt) { r.Exit = 0; r.Reward = 1 }},
		{"a reward its exit rules out", func(r *receipt.Receipt) { r.Reward = 1 }},
		{"a command it never ran", func(r *receipt.Receipt) { r.GraderCommand = []string{"sh", "-c", "exit 0"} }},
		{"a fault it never saw", func(r *receipt.Receipt) { r.Outcome, r.Fault = "fault", "node_lost" }},
		{"other layers", func(r *receipt.Receipt) { r.Layers = append(r.Layers, "sha256:"+fake64) }},
		{"a capture not among its layers", func(r *receipt.Receipt) { r.Workspace = "sha256:" + fake64 }},
		{"another graded sandbox", func(r *receipt.Receipt) { r.Sandbox = "sb-other" }},
		{"another environment", func(r *receipt.Receipt) { r.Image = "other:env" }},
	} {
		edited := r
		edited.Layers = append([]string(nil), r.Layers...)
		c.edit(&edited)
		_, err := sign(edited)
		wantKind(t, "SignReceipt of "+c.name, err, errdefs.ErrFailedPrecondition)
	}
	// The reward: the edge reads the reward file as the grader left it.
	wrote := "mkdir -p " + grade.RewardDir + " && echo 0.5 > " + grade.RewardFile
	if _, err := e.exec(ctx, room.GetId(), wrote); err != nil {
		t.Fatalf("exec a grader that writes its reward: %v", err)
	}
	rewarded := r
	rewarded.GraderCommand, rewarded.Exit, rewarded.Reward = []string{"sh", "-c", wrote}, 0, 0.5
	if _, err := sign(rewarded); err != nil {
		t.Errorf("SignReceipt of the reward the grader wrote: %v", err)
	}
	rewarded.Reward = 1
	_, err = sign(rewarded)
	wantKind(t, "SignReceipt of a reward the grader did not write", err, errdefs.ErrFailedPrecondition)

	rewarded.Reward = 0.5
	testEvidence(t, e, rewarded, sign, v)
	testTests(t, e, room, rewarded, signTests, v)

	missing := r
	missing.GradeSandbox = "sb-never-made"
	_, err = sign(missing)
	if err == nil {
		t.Error("SignReceipt of a clean room the edge never made: signed")
	}
	_, err = e.h.SignReceipt(ctx, connect.NewRequest(&edgev1.SignReceiptRequest{Receipt: []byte(`{"sandbox":"x","grade_sandbox":"y","surprise":1}`)}))
	wantKind(t, "SignReceipt of a receipt with an unknown field", err, errdefs.ErrInvalidArgument)

	// Once the clean room is deleted, the edge vouches for nothing in it.
	if err := e.delete(ctx, room.GetId()); err != nil {
		t.Fatal(err)
	}
	if _, err := sign(r); err == nil {
		t.Error("SignReceipt of a deleted clean room: signed")
	}
}

const fake64 = "0000000000000000000000000000000000000000000000000000000000000000"

// testTests: the node hashes the tests' files named beside a receipt in
// the clean room itself and signs only the grader digest they give (with
// a tests' layer among the room's layers), and only while nothing but the
// grader's own user acted in the room since the grader began. r is a
// receipt the node signs, its grader having left reward 0.5.
func testTests(t *testing.T, e *edge, room *dsecv1.Sandbox, r receipt.Receipt, signTests func(receipt.Receipt, []string) ([]byte, error), v *receipt.Verifier) {
	ctx := t.Context()
	tests := map[string][]byte{"/grade-tests/check.sh": []byte("test -e /grade-tests/check.sh\n"), "/grade-tests/data": []byte("42\n")}
	paths := slices.Sorted(func(yield func(string) bool) {
		for p := range tests {
			if !yield(p) {
				return
			}
		}
	})
	for _, p := range paths {
		if _, err := e.c.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: room.GetId(), Path: p, Data: tests[p], MakeParents: true, User: "root"})); err != nil {
			t.Fatalf("lay tests file %s: %v", p, err)
		}
	}
	const grader = "sh /grade-tests/check.sh"
	if _, err := e.exec(ctx, room.GetId(), grader); err != nil {
		t.Fatalf("exec the grader: %v", err)
	}
	r.GraderCommand, r.Exit, r.Reward = []string{"sh", "-c", grader}, 0, 0.5
	r.GraderDigest = receipt.TestsDigest("", tests)
	env, err := signTests(r, paths)
	if err != nil {
		t.Fatalf("SignReceipt of the tests the grader ran with: %v", err)
	}
	if got, err := v.Verify(env); err != nil || got.GraderDigest != r.GraderDigest || !slices.Contains(got.Vouched, "grader_digest") {
		t.Errorf("the signed receipt with tests: %+v, %v; want grader digest %s vouched", got, err, r.GraderDigest)
	}
	if layers := room.GetLayerDigests(); len(layers) > 0 {
		withLayer := r
		withLayer.GraderDigest = receipt.TestsDigest(layers[0], tests)
		if _, err := signTests(withLayer, paths); err != nil {
			t.Errorf("SignReceipt of tests in one of the room's layers and files: %v", err)
		}
	}
	other := map[string][]byte{"/grade-tests/check.sh": tests["/grade-tests/check.sh"], "/grade-tests/data": []byte("43\n")}
	for _, c := range []struct {
		name   string
		digest string
		paths  []string
	}{
		{"other tests", receipt.TestsDigest("", other), paths},
		{"tests files it was not told of", r.GraderDigest, nil},
		{"a tests file that is not there", receipt.TestsDigest("", map[string][]byte{"/grade-tests/none": nil}), []string{"/grade-tests/none"}},
		{"a tests layer not among the room's", receipt.TestsDigest("sha256:"+fake64, tests), paths},
	} {
		edited := r
		edited.GraderDigest = c.digest
		_, err := signTests(edited, c.paths)
		if err == nil {
			t.Errorf("SignReceipt of %s: signed", c.name)
		}
	}
	// An exec as the grader's own user since (the grade's kill of what it
	// left) changes nothing the grader could not; a write does.
	if _, err := e.exec(ctx, room.GetId(), "true"); err != nil {
		t.Fatal(err)
	}
	if _, err := signTests(r, paths); err != nil {
		t.Errorf("SignReceipt after an exec as the grader's user: %v", err)
	}
	if _, err := e.c.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: room.GetId(), Path: "/grade-tests/data", Data: other["/grade-tests/data"], User: "root"})); err != nil {
		t.Fatal(err)
	}
	r.GraderDigest = receipt.TestsDigest("", other)
	_, err = signTests(r, paths)
	wantKind(t, "SignReceipt of tests written after the grader began", err, errdefs.ErrFailedPrecondition)
}

// testEvidence: where the graded sandbox is the node's own, the node
// checks the receipt's trajectory hash against its trajectory and the
// provenance flags against those it reported since the grade began, and
// vouches for them; a node that records neither signs them unvouched. r
// is a receipt the node signs.
func testEvidence(t *testing.T, e *edge, r receipt.Receipt, sign func(receipt.Receipt) ([]byte, error), v *receipt.Verifier) {
	ctx := t.Context()
	tr, err := e.h.Trajectory(ctx, connect.NewRequest(&dsecv1.TrajectoryRequest{SandboxId: r.Sandbox, LimitBytes: 1}))
	if err == nil {
		r.Trajectory = fmt.Sprintf("sha256:%s@%d", tr.Msg.GetSha256(), tr.Msg.GetSize())
	}
	p, perr := e.h.Provenance(ctx, connect.NewRequest(&dsecv1.ProvenanceRequest{SandboxId: r.Sandbox, FlagsOnly: true}))
	if perr == nil {
		r.Provenance = flagNames(p.Msg.GetFlags())
	}
	env, err := sign(r)
	if err != nil {
		t.Fatalf("SignReceipt with the graded sandbox's evidence: %v", err)
	}
	got, err := v.Verify(env)
	if err != nil {
		t.Fatal(err)
	}
	if r.Trajectory != "" && !slices.Contains(got.Vouched, "trajectory_hash") {
		t.Errorf("the node records %s's trajectory, yet vouched %v leaves out its hash", r.Sandbox, got.Vouched)
	}
	if perr == nil && !slices.Contains(got.Vouched, "provenance_flags") {
		t.Errorf("the node reported %s's provenance, yet vouched %v leaves out its flags", r.Sandbox, got.Vouched)
	}
	if r.Trajectory != "" {
		edited := r
		edited.Trajectory = "sha256:" + fake64 + "@" + fmt.Sprint(tr.Msg.GetSize())
		_, err := sign(edited)
		wantKind(t, "SignReceipt of another trajectory hash", err, errdefs.ErrFailedPrecondition)
		edited.Trajectory = fmt.Sprintf("sha256:%s@%d", tr.Msg.GetSha256(), tr.Msg.GetSize()+1<<20)
		_, err = sign(edited)
		wantKind(t, "SignReceipt of a trajectory longer than the node's", err, errdefs.ErrFailedPrecondition)
	}
	if perr == nil {
		edited := r
		edited.Provenance = append(slices.Clone(r.Provenance), "tests_modified")
		if slices.Contains(r.Provenance, "tests_modified") {
			edited.Provenance = nil
		}
		_, err := sign(edited)
		wantKind(t, "SignReceipt of provenance flags the node did not report", err, errdefs.ErrFailedPrecondition)
	}
}

// flagNames names the flags set, as a receipt does.
func flagNames(f *dsecv1.ProvenanceFlags) []string {
	var out []string
	m := f.ProtoReflect()
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		if fd := fields.Get(i); m.Get(fd).Bool() {
			out = append(out, string(fd.Name()))
		}
	}
	return out
}

// testAttest checks Attest: an edge without a key refuses it
// (NotSupported); one with a key signs what it sees of a sandbox of its
// own (its trajectory hash, over all of it or its first bytes, and its
// newest provenance report's flags), which verifies against
// Options.ReceiptCA as the node's (internal/receipt.VerifyAttestation),
// and answers NotFound for a sandbox it never made or another node's.
func testAttest(t *testing.T, e *edge) {
	ctx := t.Context()
	sb := e.create(ctx, "").GetId()
	attest := func(id string, size int64) ([]byte, error) {
		resp, err := e.h.Attest(ctx, connect.NewRequest(&edgev1.AttestRequest{SandboxId: id, TrajectoryBytes: size}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetAttestation(), nil
	}
	if e.o.ReceiptCA == "" {
		_, err := attest(sb, 0)
		wantKind(t, "Attest on an edge without a receipt key", err, errdefs.ErrNotSupported)
		return
	}
	v, err := receipt.NewVerifierFile(e.o.ReceiptCA)
	if err != nil {
		t.Fatal(err)
	}
	// A provenance report, as a grade reads one; an edge that reports
	// none attests no flags.
	p, perr := e.h.Provenance(ctx, connect.NewRequest(&dsecv1.ProvenanceRequest{SandboxId: sb, FlagsOnly: true}))
	tr, terr := e.h.Trajectory(ctx, connect.NewRequest(&dsecv1.TrajectoryRequest{SandboxId: sb, LimitBytes: 1}))
	env, err := attest(sb, 0)
	if err != nil {
		t.Fatalf("Attest of a sandbox of the node: %v", err)
	}
	a, err := ireceipt.VerifyAttestation(v, env)
	if err != nil {
		t.Fatalf("verify the attestation: %v", err)
	}
	if a.Sandbox != sb || a.Node != e.node {
		t.Errorf("the attestation is of sandbox %s by node %s, want %s by %s", a.Sandbox, a.Node, sb, e.node)
	}
	if perr == nil && (a.Reported.IsZero() || !slices.Equal(a.Provenance, flagNames(p.Msg.GetFlags()))) {
		t.Errorf("the attestation says flags %v reported at %v, want the report's %v", a.Provenance, a.Reported, flagNames(p.Msg.GetFlags()))
	}
	if perr != nil && !a.Reported.IsZero() {
		t.Errorf("the attestation says a provenance report at %v of an edge that reported none (%v)", a.Reported, perr)
	}
	if terr == nil {
		// The trajectory may have grown since (the Provenance and Attest
		// calls are not recorded, but a sandbox's network events are): the
		// hash of its first bytes is the one Trajectory gave.
		whole := fmt.Sprintf("sha256:%s@%d", tr.Msg.GetSha256(), tr.Msg.GetSize())
		env, err := attest(sb, tr.Msg.GetSize())
		if err != nil {
			t.Fatalf("Attest of the first %d bytes of the trajectory: %v", tr.Msg.GetSize(), err)
		}
		switch b, err := ireceipt.VerifyAttestation(v, env); {
		case err != nil:
			t.Errorf("verify the attestation of the first %d bytes: %v", tr.Msg.GetSize(), err)
		case b.Trajectory != whole:
			t.Errorf("the attestation of the first %d bytes says trajectory %q, want %q", tr.Msg.GetSize(), b.Trajectory, whole)
		}
		if a.Trajectory == "" {
			t.Errorf("the attestation of the whole trajectory names none; Trajectory gave %s", whole)
		}
	}
	for name, id := range map[string]string{
		"a sandbox it never made": sandboxid.New(e.node, 7, 7),
		"another node's sandbox":  sandboxid.New(e.node+"-other", 0, 0),
	} {
		_, err := attest(id, 0)
		wantKind(t, "Attest of "+name, err, errdefs.ErrNotFound)
	}
}
