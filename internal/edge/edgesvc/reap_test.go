package edgesvc_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/errdefs"
)

func newService(cfg hollow.Config) *edgesvc.Service {
	cfg.Node = "h1"
	return edgesvc.New(hollow.New(cfg), nil, slog.New(slog.DiscardHandler))
}

func create(t *testing.T, svc *edgesvc.Service, token string) (string, error) {
	t.Helper()
	resp, err := svc.Create(context.Background(), connect.NewRequest(&edgev1.CreateRequest{
		Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, CreateToken: token}))
	if err != nil {
		return "", err
	}
	return resp.Msg.GetId(), nil
}

func mustCreate(t *testing.T, svc *edgesvc.Service, token string) string {
	t.Helper()
	id, err := create(t, svc, token)
	if err != nil {
		t.Fatalf("create %q: %v", token, err)
	}
	return id
}

func reap(t *testing.T, svc *edgesvc.Service, req *edgev1.ReapRequest) []string {
	t.Helper()
	resp, err := svc.Reap(context.Background(), connect.NewRequest(req))
	if err != nil {
		t.Fatalf("reap %v: %v", req, err)
	}
	return resp.Msg.GetRemovedIds()
}

func state(t *testing.T, svc *edgesvc.Service, id string) dsecv1.State {
	t.Helper()
	resp, err := svc.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	if err != nil {
		t.Fatalf("get %s: %v", id, err)
	}
	return resp.Msg.GetState()
}

// TestCreateToken: a token returns the sandbox it made while that lives;
// once the sandbox is gone the same token makes a new one.
func TestCreateToken(t *testing.T) {
	svc := newService(hollow.Config{})
	first := mustCreate(t, svc, "b#0@h1")
	if again := mustCreate(t, svc, "b#0@h1"); again != first {
		t.Fatalf("the same token made %s and %s", first, again)
	}
	if other := mustCreate(t, svc, "b#1@h1"); other == first {
		t.Fatal("another token got the same sandbox")
	}
	if _, err := svc.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: first})); err != nil {
		t.Fatal(err)
	}
	if renewed := mustCreate(t, svc, "b#0@h1"); renewed == first {
		t.Fatal("a token whose sandbox was deleted returned the deleted one")
	}
}

// TestReapTokens: Reap removes the sandboxes of the tokens it names but
// those it is told to keep, and refuses every later create of those tokens,
// of one that never arrived too (a create still queued for a frozen node).
func TestReapTokens(t *testing.T) {
	svc := newService(hollow.Config{})
	gone := mustCreate(t, svc, "b#0@h1")
	kept := mustCreate(t, svc, "b#1@h1")
	other := mustCreate(t, svc, "b#2@h1")
	removed := reap(t, svc, &edgev1.ReapRequest{Tokens: []string{"b#0@h1", "b#1@h1", "b#9@h1"}, KeepIds: []string{kept}})
	if !slices.Equal(removed, []string{gone}) {
		t.Fatalf("removed %v, want [%s]", removed, gone)
	}
	if st := state(t, svc, gone); st != dsecv1.State_STATE_STOPPED {
		t.Errorf("reaped sandbox is %s", st)
	}
	for _, id := range []string{kept, other} {
		if st := state(t, svc, id); st != dsecv1.State_STATE_RUNNING {
			t.Errorf("sandbox %s is %s after a reap that spared it", id, st)
		}
	}
	for _, tok := range []string{"b#0@h1", "b#9@h1"} {
		if _, err := create(t, svc, tok); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("create with reaped token %s: %v, want FailedPrecondition", tok, err)
		}
	}
	// Reaping again removes nothing more.
	if removed := reap(t, svc, &edgev1.ReapRequest{Tokens: []string{"b#0@h1"}}); len(removed) != 0 {
		t.Errorf("second reap removed %v", removed)
	}
	if _, err := svc.Reap(context.Background(), connect.NewRequest(&edgev1.ReapRequest{TokenPrefixes: []string{""}})); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("reap of an empty prefix (everything): %v", err)
	}
}

// TestReapPrefix: a prefix reaps every create of one batch, on this node,
// and refuses the batch's creates from then on; other batches go on.
func TestReapPrefix(t *testing.T) {
	svc := newService(hollow.Config{})
	a0 := mustCreate(t, svc, "aaaa#0@h1")
	a1 := mustCreate(t, svc, "aaaa#1@h1")
	b0 := mustCreate(t, svc, "bbbb#0@h1")
	plain := mustCreate(t, svc, "")
	removed := reap(t, svc, &edgev1.ReapRequest{TokenPrefixes: []string{"aaaa#"}})
	slices.Sort(removed)
	want := []string{a0, a1}
	slices.Sort(want)
	if !slices.Equal(removed, want) {
		t.Fatalf("removed %v, want %v", removed, want)
	}
	if _, err := create(t, svc, "aaaa#2@h1"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("create of a reaped batch: %v", err)
	}
	mustCreate(t, svc, "bbbb#1@h1")
	for _, id := range []string{b0, plain} {
		if st := state(t, svc, id); st != dsecv1.State_STATE_RUNNING {
			t.Errorf("sandbox %s is %s", id, st)
		}
	}
}

// TestReapWaitsForCreate: a reap of a token whose create is still running
// waits for it, then removes what it made.
func TestReapWaitsForCreate(t *testing.T) {
	svc := newService(hollow.Config{StartDelay: 300 * time.Millisecond})
	made := make(chan string, 1)
	go func() {
		id, err := create(t, svc, "b#0@h1")
		if err != nil {
			t.Error(err)
		}
		made <- id
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, _ := svc.Status(context.Background(), connect.NewRequest(&edgev1.StatusRequest{}))
		if st.Msg.GetCreating() == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the create never started")
		}
		time.Sleep(5 * time.Millisecond)
	}
	removed := reap(t, svc, &edgev1.ReapRequest{Tokens: []string{"b#0@h1"}})
	id := <-made
	if !slices.Equal(removed, []string{id}) {
		t.Fatalf("reap during the create removed %v, want the sandbox it made, %s", removed, id)
	}
	if st := state(t, svc, id); st != dsecv1.State_STATE_STOPPED {
		t.Errorf("sandbox of the reaped create is %s", st)
	}
}

// TestGone: Gone names the IDs the node has no live sandbox for.
func TestGone(t *testing.T) {
	svc := newService(hollow.Config{})
	live := mustCreate(t, svc, "")
	deleted := mustCreate(t, svc, "")
	if _, err := svc.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: deleted})); err != nil {
		t.Fatal(err)
	}
	unknown := "sb-h1-0123456789abcdef"
	resp, err := svc.Gone(context.Background(), connect.NewRequest(&edgev1.GoneRequest{Ids: []string{live, deleted, unknown}}))
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Msg.GetIds(); !slices.Equal(got, []string{deleted, unknown}) {
		t.Fatalf("gone %v, want [%s %s]", got, deleted, unknown)
	}
}
