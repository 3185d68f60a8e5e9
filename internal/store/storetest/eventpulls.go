package storetest

import (
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

func pullNodes(ps []store.EventPull) []string {
	var out []string
	for _, p := range ps {
		out = append(out, p.Node)
	}
	return out
}

// testReplicasEventPullLease: one replica at a time holds a node's pull;
// only the holder stores what it pulled, with the node's cursor in the
// same write; a lapsed lease goes to the other replica with the cursor
// where the last holder left it, and the old holder's pull then stores
// nothing; a node no longer named is given up, and a release hands all
// back at once.
func testReplicasEventPullLease(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	held, err := a.ClaimEventPulls(ctx, "a", []string{"n1", "n2"}, now, now.Add(5*time.Second))
	must(t, "a claims", err)
	if got := pullNodes(held); !equalStrings(got, []string{"n1", "n2"}) || held[0].Epoch != "" || held[0].Seq != 0 || held[0].Owner != "a" {
		t.Fatalf("a holds %+v, want n1 and n2 from the start", held)
	}
	held, err = b.ClaimEventPulls(ctx, "b", []string{"n1", "n2", "n3"}, now, now.Add(5*time.Second))
	must(t, "b claims", err)
	if got := pullNodes(held); !equalStrings(got, []string{"n3"}) {
		t.Fatalf("b holds %v, want only n3 (a holds the others)", got)
	}

	n, err := a.PullEvents(ctx, "a", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 2}},
		ev("n1/e1/1", "p", "sb-1", "created", now), ev("n1/e1/2", "p", "sb-1", "deleted", now))
	must(t, "a pulls n1", err)
	if n != 2 {
		t.Fatalf("a's pull stored %d, want 2", n)
	}
	n, err = b.PullEvents(ctx, "b", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 3}}, ev("n1/e1/3", "p", "sb-2", "created", now))
	wantKind(t, "b pulls a's node", err, errdefs.ErrFailedPrecondition)
	if n != 0 {
		t.Fatalf("a refused pull stored %d", n)
	}
	// A pull of two nodes, one of them b's, stores nothing.
	n, err = a.PullEvents(ctx, "a", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 3}, {Node: "n3", Epoch: "e3", Seq: 1}},
		ev("n1/e1/3", "p", "sb-2", "created", now), ev("n3/e3/1", "p", "sb-3", "created", now))
	wantKind(t, "a pulls n1 and b's n3 together", err, errdefs.ErrFailedPrecondition)
	if n != 0 {
		t.Fatalf("a refused pull of two nodes stored %d", n)
	}
	// A pull with nothing new still moves the cursor (a new epoch).
	_, err = a.PullEvents(ctx, "a", []store.EventPull{{Node: "n2", Epoch: "e9", Seq: 0}})
	must(t, "a moves n2's cursor", err)

	// a's leases lapse: b takes them with the cursors a left.
	later := now.Add(6 * time.Second)
	held, err = b.ClaimEventPulls(ctx, "b", []string{"n1", "n2", "n3"}, later, later.Add(5*time.Second))
	must(t, "b claims after the lapse", err)
	if got := pullNodes(held); !equalStrings(got, []string{"n1", "n2", "n3"}) {
		t.Fatalf("b holds %v after a's leases lapsed", got)
	}
	if held[0].Epoch != "e1" || held[0].Seq != 2 || held[1].Epoch != "e9" || held[1].Seq != 0 {
		t.Fatalf("b took n1 at %s/%d and n2 at %s/%d, want e1/2 and e9/0", held[0].Epoch, held[0].Seq, held[1].Epoch, held[1].Seq)
	}
	_, err = a.PullEvents(ctx, "a", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 3}}, ev("n1/e1/3", "p", "sb-2", "created", now))
	wantKind(t, "a pulls after losing n1", err, errdefs.ErrFailedPrecondition)
	n, err = b.PullEvents(ctx, "b", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 3}}, ev("n1/e1/3", "p", "sb-2", "created", now))
	must(t, "b pulls n1", err)
	if n != 1 {
		t.Fatalf("b's pull stored %d, want 1", n)
	}
	evs, err := a.ListEvents(ctx, store.EventQuery{})
	must(t, "ListEvents", err)
	wantKeys(t, "stored", evs, "n1/e1/1", "n1/e1/2", "n1/e1/3")

	// b no longer reaches n3: it gives it up, and a may take it.
	held, err = b.ClaimEventPulls(ctx, "b", []string{"n1", "n2"}, later, later.Add(5*time.Second))
	must(t, "b claims without n3", err)
	if got := pullNodes(held); !equalStrings(got, []string{"n1", "n2"}) {
		t.Fatalf("b holds %v, want n1 and n2", got)
	}
	held, err = a.ClaimEventPulls(ctx, "a", []string{"n1", "n2", "n3"}, later, later.Add(5*time.Second))
	must(t, "a claims n3", err)
	if got := pullNodes(held); !equalStrings(got, []string{"n3"}) {
		t.Fatalf("a holds %v, want n3", got)
	}
	must(t, "b releases", b.ReleaseEventPulls(ctx, "b"))
	held, err = a.ClaimEventPulls(ctx, "a", []string{"n1", "n2", "n3"}, later, later.Add(5*time.Second))
	must(t, "a claims after b's release", err)
	if got := pullNodes(held); !equalStrings(got, []string{"n1", "n2", "n3"}) {
		t.Fatalf("a holds %v after b released, want all", got)
	}
	if held[0].Seq != 3 {
		t.Fatalf("n1's cursor is %d, want 3", held[0].Seq)
	}
}
