package storetest

import (
	"fmt"
	"maps"
	"slices"
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

// testReplicasLedgerPull: the ledger records of a pull are stored with
// the node's ledger cursor, in the pull's write (a sole end appended, a
// checkpoint merged, as PutUsage does), or not at all when the lease is
// another's; the next holder takes the node at that cursor; a pull
// carrying a record without a key is refused whole.
func testReplicasLedgerPull(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	t0 := now.Add(-time.Hour)
	_, err := a.ClaimEventPulls(ctx, "a", []string{"n1"}, now, now.Add(5*time.Second))
	must(t, "a claims", err)
	end := usageRow("sb-1", "p", map[string]string{"run": "r1"}, t0, t0.Add(time.Minute), 1_000_000)
	end.Sole = true
	live := usageRow("sb-2", "p", nil, t0, time.Time{}, 2_000_000)
	n, err := a.PullEvents(ctx, "a", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 1, UsageEpoch: "u1", UsageSeq: 7,
		Usage: []store.UsageRow{end, live}}}, ev("n1/e1/1", "p", "sb-2", "created", now))
	must(t, "a pulls n1 with its ledger", err)
	if n != 1 {
		t.Fatalf("a's pull stored %d events, want 1", n)
	}
	_, err = b.PullEvents(ctx, "b", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 1, UsageEpoch: "u1", UsageSeq: 9,
		Usage: []store.UsageRow{usageRow("sb-3", "p", nil, t0, time.Time{}, 3_000_000)}}})
	wantKind(t, "b pulls a's node with a ledger record", err, errdefs.ErrFailedPrecondition)
	bad := live
	bad.Key = ""
	_, err = a.PullEvents(ctx, "a", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 1, UsageEpoch: "u1", UsageSeq: 8,
		Usage: []store.UsageRow{bad}}})
	wantKind(t, "a pulls a record without a key", err, errdefs.ErrInvalidArgument)

	sums, err := b.SumUsage(ctx, store.UsageQuery{By: "sandbox"})
	must(t, "SumUsage", err)
	got := map[string]int64{}
	for _, s := range sums {
		got[s.Key] = s.CPUUsec
	}
	if want := map[string]int64{"sb-1": 1_000_000, "sb-2": 2_000_000}; !maps.Equal(got, want) {
		t.Fatalf("the store sums CPU by sandbox %v, want %v (a's pull, none of b's refused one)", got, want)
	}

	later := now.Add(6 * time.Second)
	held, err := b.ClaimEventPulls(ctx, "b", []string{"n1"}, later, later.Add(5*time.Second))
	must(t, "b claims after a's lease lapsed", err)
	if len(held) != 1 || held[0].UsageEpoch != "u1" || held[0].UsageSeq != 7 || held[0].Epoch != "e1" || held[0].Seq != 1 {
		t.Fatalf("b took %+v, want n1 with its events at e1/1 and its ledger at u1/7", held)
	}
	// Events off: a pull of the ledger alone moves its cursor alone.
	_, err = b.PullEvents(ctx, "b", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 1, UsageEpoch: "u2", UsageSeq: 1}})
	must(t, "b moves n1's ledger cursor to a new epoch", err)
	held, err = b.ClaimEventPulls(ctx, "b", []string{"n1"}, later, later.Add(5*time.Second))
	must(t, "b claims again", err)
	if len(held) != 1 || held[0].UsageEpoch != "u2" || held[0].UsageSeq != 1 {
		t.Fatalf("b holds %+v, want n1's ledger at u2/1", held)
	}
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

// testReplicasEventPullBalance: two replicas share four nodes two and
// two. The first to claim takes all (it is alone); the second, alive but
// holding none, makes the first give back its share at its next claim,
// which the second then takes at the cursor the first stored, while the
// first can no longer store a pull of it. When the first lapses, the
// second takes all again; a node free for a whole lease that no replica
// under its share takes is taken over the share.
func testReplicasEventPullBalance(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	nodes := []string{"n1", "n2", "n3", "n4"}
	lease := 5 * time.Second
	now := ms(time.Now())
	claim := func(st store.Store, owner string, nodes []string, at time.Time) []string {
		t.Helper()
		held, err := st.ClaimEventPulls(ctx, owner, nodes, at, at.Add(lease))
		must(t, owner+" claims", err)
		return pullNodes(held)
	}
	if got := claim(a, "a", nodes, now); !equalStrings(got, nodes) {
		t.Fatalf("a alone holds %v, want all four", got)
	}
	_, err := a.PullEvents(ctx, "a", []store.EventPull{{Node: "n4", Epoch: "e4", Seq: 1}}, ev("n4/e4/1", "p", "sb-1", "created", now))
	must(t, "a pulls n4", err)
	if got := claim(b, "b", nodes, now); len(got) != 0 {
		t.Fatalf("b holds %v while a holds all, want none yet", got)
	}
	// a is over its share (2) while b holds fewer: it gives two back.
	if got := claim(a, "a", nodes, now); !equalStrings(got, []string{"n1", "n2"}) {
		t.Fatalf("a holds %v after b came, want n1 and n2", got)
	}
	_, err = a.PullEvents(ctx, "a", []store.EventPull{{Node: "n4", Epoch: "e4", Seq: 2}}, ev("n4/e4/2", "p", "sb-1", "deleted", now))
	wantKind(t, "a pulls n4 after giving it back", err, errdefs.ErrFailedPrecondition)
	held, err := b.ClaimEventPulls(ctx, "b", nodes, now, now.Add(lease))
	must(t, "b claims its share", err)
	if got := pullNodes(held); !equalStrings(got, []string{"n3", "n4"}) {
		t.Fatalf("b holds %v, want n3 and n4", got)
	}
	if held[1].Epoch != "e4" || held[1].Seq != 1 {
		t.Fatalf("b took n4 at %s/%d, want e4/1 (where a left it)", held[1].Epoch, held[1].Seq)
	}
	_, err = b.PullEvents(ctx, "b", []store.EventPull{{Node: "n4", Epoch: "e4", Seq: 2}}, ev("n4/e4/2", "p", "sb-1", "deleted", now))
	must(t, "b pulls n4", err)
	// Both at their share: claims again change nothing.
	for range 2 {
		if got := claim(a, "a", nodes, now); !equalStrings(got, []string{"n1", "n2"}) {
			t.Fatalf("a holds %v when balanced, want n1 and n2", got)
		}
		if got := claim(b, "b", nodes, now); !equalStrings(got, []string{"n3", "n4"}) {
			t.Fatalf("b holds %v when balanced, want n3 and n4", got)
		}
	}
	evs, err := a.ListEvents(ctx, store.EventQuery{})
	must(t, "ListEvents", err)
	wantKeys(t, "stored", evs, "n4/e4/1", "n4/e4/2")

	// b alone reaches n5, a new node, and is at its share of what it
	// reaches (2 of n3, n4, n5); once n5 has been free a whole lease (both
	// renewing meanwhile), b takes it over its share.
	mine := []string{"n3", "n4", "n5"}
	var at time.Time
	for i, step := range []time.Duration{time.Second, 4 * time.Second, 7 * time.Second} {
		at = now.Add(step)
		want := []string{"n3", "n4"}
		if i == 2 {
			want = mine
		}
		if got := claim(a, "a", nodes, at); !equalStrings(got, []string{"n1", "n2"}) {
			t.Fatalf("a holds %v at +%s, want n1 and n2", got, step)
		}
		if got := claim(b, "b", mine, at); !equalStrings(got, want) {
			t.Fatalf("b holds %v at +%s, want %v", got, step, want)
		}
	}

	// a lapses: b takes everything it reaches at the cursors a left.
	all := append(slices.Clone(nodes), "n5")
	gone := at.Add(lease + time.Second)
	if got := claim(b, "b", all, gone); !equalStrings(got, all) {
		t.Fatalf("b holds %v after a lapsed, want all five", got)
	}
}

// testEventPullsForget: the pulls of nodes gone from the fleet that no
// apiserver has held for the grace are deleted; a node still in the fleet
// (down, or restarting) keeps its cursor however long nobody held it, and
// so does a gone node another apiserver still holds or held lately.
func testEventPullsForget(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	lease := 5 * time.Second
	_, err := st.ClaimEventPulls(ctx, "a", []string{"down", "gone", "held", "recent"}, now, now.Add(lease))
	must(t, "a claims", err)
	_, err = st.PullEvents(ctx, "a", []store.EventPull{{Node: "down", Epoch: "e1", Seq: 2}, {Node: "gone", Epoch: "e2", Seq: 5},
		{Node: "held", Epoch: "e3", Seq: 7}, {Node: "recent", Epoch: "e4", Seq: 1}})
	must(t, "a pulls", err)
	must(t, "a releases", st.ReleaseEventPulls(ctx, "a"))
	// An hour later: b holds "held"; a held "recent" again until a minute
	// ago.
	later := now.Add(time.Hour)
	_, err = st.ClaimEventPulls(ctx, "b", []string{"held"}, later, later.Add(lease))
	must(t, "b claims held", err)
	_, err = st.ClaimEventPulls(ctx, "a", []string{"recent"}, later.Add(-time.Minute), later.Add(-time.Minute).Add(lease))
	must(t, "a claims recent", err)
	_, err = st.ClaimEventPulls(ctx, "a", nil, later.Add(-time.Minute).Add(time.Millisecond), later.Add(lease))
	must(t, "a gives up recent", err)

	// The fleet is "down" alone now.
	n, err := st.ForgetEventPulls(ctx, []string{"down"}, later.Add(-30*time.Minute))
	must(t, "ForgetEventPulls", err)
	if n != 1 {
		t.Fatalf("ForgetEventPulls deleted %d pulls, want 1 (gone's)", n)
	}
	n, err = st.ForgetEventPulls(ctx, []string{"down"}, later.Add(-30*time.Minute))
	must(t, "ForgetEventPulls again", err)
	if n != 0 {
		t.Fatalf("ForgetEventPulls again deleted %d pulls, want none", n)
	}
	must(t, "b releases", st.ReleaseEventPulls(ctx, "b"))
	at := later.Add(2 * lease)
	held, err := st.ClaimEventPulls(ctx, "c", []string{"down", "gone", "held", "recent"}, at, at.Add(lease))
	must(t, "c claims", err)
	got := map[string]string{}
	for _, p := range held {
		got[p.Node] = fmt.Sprintf("%s/%d", p.Epoch, p.Seq)
	}
	want := map[string]string{"down": "e1/2", "gone": "/0", "held": "e3/7", "recent": "e4/1"}
	if !maps.Equal(got, want) {
		t.Fatalf("cursors after the forget: %v, want %v (gone's from its start)", got, want)
	}

	// With no node left in the fleet, only what nobody held lately goes.
	n, err = st.ForgetEventPulls(ctx, nil, at)
	must(t, "ForgetEventPulls of an empty fleet", err)
	if n != 0 {
		t.Fatalf("ForgetEventPulls deleted %d pulls c holds", n)
	}
	must(t, "c releases", st.ReleaseEventPulls(ctx, "c"))
	n, err = st.ForgetEventPulls(ctx, nil, time.Now().Add(time.Hour))
	must(t, "ForgetEventPulls of an empty fleet, after release", err)
	if n != 4 {
		t.Fatalf("ForgetEventPulls deleted %d pulls, want all 4", n)
	}
}
