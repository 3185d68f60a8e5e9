package edgetest

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/sandboxid"
)

// testTrajectory: a sandbox's trajectory begins with it, records a call
// that acted on it, reads from an offset, ends when the sandbox is
// deleted (and stays readable), and hashes what it holds; NotFound for a
// sandbox the node never made, InvalidArgument without an ID or past the
// end. An edge recording none answers NotSupported.
func testTrajectory(t *testing.T, e *edge) {
	ctx := t.Context()
	read := func(id string, off int64) (*dsecv1.TrajectoryResponse, error) {
		r, err := e.h.Trajectory(ctx, connect.NewRequest(&dsecv1.TrajectoryRequest{SandboxId: id, Offset: off}))
		if err != nil {
			return nil, err
		}
		return r.Msg, nil
	}
	_, err := read("", 0)
	wantKind(t, "Trajectory without a sandbox ID", err, errdefs.ErrInvalidArgument)
	sb := e.create(ctx, "")
	id := sb.GetId()
	if e.o.NoTrajectories {
		_, err := read(id, 0)
		wantKind(t, "Trajectory on an edge recording none", err, errdefs.ErrNotSupported)
		return
	}
	_, err = read(sandboxid.New(e.node, 0, 0), 0)
	wantKind(t, "Trajectory of an unknown sandbox", err, errdefs.ErrNotFound)
	// Recorded whether or not the edge can set rules (a node without
	// networking refuses).
	e.h.SetNetworkRules(ctx, connect.NewRequest(&dsecv1.SetNetworkRulesRequest{SandboxId: id, Rules: map[string]bool{}}))
	live, err := read(id, 0)
	if err != nil {
		t.Fatalf("Trajectory of a live sandbox: %v", err)
	}
	if live.GetEnded() || live.GetSize() != int64(len(live.GetLines())) || live.GetNextOffset() != live.GetSize() ||
		!bytes.Contains(live.GetLines(), []byte(`"type":"begin"`)) || !bytes.Contains(live.GetLines(), []byte(`"call":"set_network_rules"`)) {
		t.Errorf("Trajectory of a live sandbox: ended %v, size %d, next %d, lines:\n%s", live.GetEnded(), live.GetSize(), live.GetNextOffset(), live.GetLines())
	}
	if r, err := read(id, live.GetSize()); err != nil || len(r.GetLines()) != 0 || r.GetNextOffset() != live.GetSize() {
		t.Errorf("Trajectory from its end: %v, %v", r, err)
	}
	_, err = read(id, live.GetSize()+1)
	wantKind(t, "Trajectory past its end", err, errdefs.ErrInvalidArgument)
	if err := e.delete(ctx, id); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	done, err := read(id, 0)
	if err != nil {
		t.Fatalf("Trajectory of a deleted sandbox: %v", err)
	}
	sum := sha256.Sum256(done.GetLines())
	if !done.GetEnded() || !bytes.HasPrefix(done.GetLines(), live.GetLines()) || !bytes.Contains(done.GetLines(), []byte(`"type":"end"`)) ||
		done.GetSha256() != hex.EncodeToString(sum[:]) {
		t.Errorf("Trajectory of a deleted sandbox: ended %v, sha256 %s (of its lines %x), lines:\n%s", done.GetEnded(), done.GetSha256(), sum, done.GetLines())
	}
}
