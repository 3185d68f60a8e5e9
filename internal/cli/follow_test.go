package cli

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// followServer answers FollowEvents: each call plays the next of its
// scripts, which sends events and ends the stream with an error (nil: a
// clean end); it records each call's cursor.
type followServer struct {
	fakeSandboxes
	mu      sync.Mutex
	scripts []func(*connect.ServerStream[dsecv1.Event]) error
	afters  []int64
}

func (f *followServer) FollowEvents(ctx context.Context, r *connect.Request[dsecv1.ListEventsRequest], s *connect.ServerStream[dsecv1.Event]) error {
	f.mu.Lock()
	f.afters = append(f.afters, r.Msg.GetAfter())
	if len(f.scripts) == 0 {
		f.mu.Unlock()
		return connect.NewError(connect.CodeFailedPrecondition, errors.New("no more scripts"))
	}
	play := f.scripts[0]
	f.scripts = f.scripts[1:]
	f.mu.Unlock()
	return play(s)
}

func sendEvents(ids ...int64) func(*connect.ServerStream[dsecv1.Event]) error {
	return func(s *connect.ServerStream[dsecv1.Event]) error {
		for _, id := range ids {
			if err := s.Send(&dsecv1.Event{Id: id, SandboxId: "sb-e1-a", Kind: "created"}); err != nil {
				return err
			}
		}
		return nil
	}
}

// TestFollowResumesAfterABreak: dsec events --follow whose stream breaks
// (its apiserver restarted: Unavailable, or the connection cut) follows
// again after the last event it printed, printing none twice and missing
// none; an answer refusing the request ends it, and no address answering
// the first follow is said at once. (It ended at the first restart of the
// apiserver it followed through.)
func TestFollowResumesAfterABreak(t *testing.T) {
	f := &followServer{}
	f.scripts = []func(*connect.ServerStream[dsecv1.Event]) error{
		func(s *connect.ServerStream[dsecv1.Event]) error {
			sendEvents(1, 2)(s)
			return connect.NewError(connect.CodeUnavailable, errors.New("the apiserver is shutting down"))
		},
		func(s *connect.ServerStream[dsecv1.Event]) error {
			sendEvents(3)(s)
			panic(http.ErrAbortHandler) // the connection cut, as a killed apiserver's is
		},
		sendEvents(4),
	}
	addr := startHandler(t, f)
	out, errOut, err := runCLIErr(t, addr, "events", "--follow")
	if err != nil {
		t.Fatalf("dsec events --follow: %v (stderr %q)", err, errOut)
	}
	var ids []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n")[1:] {
		ids = append(ids, strings.Fields(line)[0])
	}
	if strings.Join(ids, ",") != "1,2,3,4" {
		t.Errorf("printed events %v, want 1,2,3,4 once each", ids)
	}
	f.mu.Lock()
	afters := f.afters
	f.mu.Unlock()
	if len(afters) != 3 || afters[0] != 0 || afters[1] != 2 || afters[2] != 3 {
		t.Errorf("followed after %v, want [0 2 3]", afters)
	}
	if strings.Count(errOut, "the event stream broke") != 2 || !strings.Contains(errOut, "following again after event 2") {
		t.Errorf("stderr %q, want two notes of the breaks", errOut)
	}

	// --limit counts over the breaks.
	f.mu.Lock()
	f.afters = nil
	f.scripts = []func(*connect.ServerStream[dsecv1.Event]) error{
		func(s *connect.ServerStream[dsecv1.Event]) error {
			sendEvents(1, 2)(s)
			return connect.NewError(connect.CodeUnavailable, errors.New("down"))
		},
		sendEvents(3, 4, 5),
	}
	f.mu.Unlock()
	if out, _, err := runCLIErr(t, addr, "events", "--follow", "--limit", "3"); err != nil || strings.Count(out, "sb-e1-a") != 3 {
		t.Errorf("--limit 3 over a break: %v, %q", err, out)
	}

	// A refusal is an answer: no second follow.
	f.mu.Lock()
	f.afters = nil
	f.scripts = []func(*connect.ServerStream[dsecv1.Event]) error{
		func(*connect.ServerStream[dsecv1.Event]) error {
			return connect.NewError(connect.CodePermissionDenied, errors.New("needs viewer"))
		},
	}
	f.mu.Unlock()
	if _, _, err := runCLIErr(t, addr, "events", "--follow"); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("a refused follow: %v, want PermissionDenied", err)
	}
	f.mu.Lock()
	if len(f.afters) != 1 {
		t.Errorf("a refused follow was asked %d times, want once", len(f.afters))
	}
	f.mu.Unlock()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	if _, _, err := runCLIErr(t, closed, "events", "--follow"); err == nil || !strings.Contains(describe(err), "cannot reach dsecd") {
		t.Errorf("following an address nothing listens on: %v, want it said at once", err)
	}
}
