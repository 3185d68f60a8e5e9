package storetest

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

// eventCases are the conformance cases of the event stream.
var eventCases = []struct {
	name string
	fn   func(t *testing.T, st store.Store)
}{
	{"Events", testEvents},
	{"EventsPacked", testEventsPacked},
	{"EventsExpire", testEventsExpire},
	{"Webhooks", testWebhooks},
	{"WebhookUpdate", testWebhookUpdate},
	{"EventPullsForget", testEventPullsForget},
}

// eventReplicaCases need two Stores on one database.
var eventReplicaCases = []struct {
	name string
	fn   func(t *testing.T, a, b store.Store)
}{
	{"EventsConcurrent", testReplicasEventsConcurrent},
	{"WebhookLease", testReplicasWebhookLease},
	{"EventPullLease", testReplicasEventPullLease},
	{"LedgerPull", testReplicasLedgerPull},
	{"EventPullBalance", testReplicasEventPullBalance},
}

func ev(key, project, sb, kind string, at time.Time) store.Event {
	return store.Event{Key: key, At: at, Project: project, SandboxID: sb, Kind: kind, Node: "n1"}
}

func keysOf(evs []store.Event) []string {
	out := make([]string, 0, len(evs))
	for _, e := range evs {
		out = append(out, e.Key)
	}
	return out
}

func wantKeys(t *testing.T, what string, got []store.Event, want ...string) {
	t.Helper()
	if g := keysOf(got); !slices.Equal(g, want) {
		t.Fatalf("%s: got events %q, want %q", what, g, want)
	}
}

// testEvents: events come back in the order they were appended, with
// their fields, selected by project subtree, cursor, time, sandbox and
// kind.
func testEvents(t *testing.T, st store.Store) {
	ctx := t.Context()
	t0 := ms(time.Now().Add(-time.Minute))
	n, err := st.AppendEvents(ctx,
		ev("k1", "a", "sb-1", "created", t0),
		ev("k2", "a/b", "sb-2", "created", t0.Add(time.Second)),
		ev("k3", "ab", "sb-3", "created", t0.Add(2*time.Second)),
		ev("k4", "", "sb-4", "created", t0.Add(3*time.Second)),
	)
	must(t, "AppendEvents", err)
	if n != 4 {
		t.Fatalf("AppendEvents stored %d, want 4", n)
	}
	// A second pull: one pull's events of a project are one pack, in
	// order, and each pull's after the last.
	_, err = st.AppendEvents(ctx, store.Event{Key: "k5", At: t0.Add(4 * time.Second), Project: "a", SandboxID: "sb-1", Kind: "failed", Node: "n2",
		Reason: "oom", Message: "its agent was OOM-killed"})
	must(t, "AppendEvents", err)
	all, err := st.ListEvents(ctx, store.EventQuery{})
	must(t, "ListEvents", err)
	wantKeys(t, "all", all, "k1", "k2", "k3", "k4", "k5")
	if last, err := st.LastEventID(ctx); err != nil || last != all[4].ID {
		t.Fatalf("LastEventID: %d, %v; want %d", last, err, all[4].ID)
	}
	for i := 1; i < len(all); i++ {
		if all[i].ID <= all[i-1].ID {
			t.Fatalf("ids not growing: %d then %d", all[i-1].ID, all[i].ID)
		}
	}
	got := all[4]
	want := store.Event{ID: got.ID, Key: "k5", At: t0.Add(4 * time.Second), Project: "a", SandboxID: "sb-1", Kind: "failed",
		Node: "n2", Reason: "oom", Message: "its agent was OOM-killed"}
	if !got.At.Equal(want.At) {
		t.Fatalf("At: got %v, want %v", got.At, want.At)
	}
	got.At = want.At
	if got != want {
		t.Fatalf("event: got %+v, want %+v", got, want)
	}

	for _, tc := range []struct {
		name string
		q    store.EventQuery
		want []string
	}{
		{"project a and under it", store.EventQuery{Projects: []string{"a"}}, []string{"k1", "k2", "k5"}},
		{"project a/b", store.EventQuery{Projects: []string{"a/b"}}, []string{"k2"}},
		{"two projects", store.EventQuery{Projects: []string{"a/b", "ab"}}, []string{"k2", "k3"}},
		{"the root is all", store.EventQuery{Projects: []string{"ab", ""}}, []string{"k1", "k2", "k3", "k4", "k5"}},
		{"after a cursor", store.EventQuery{After: all[1].ID}, []string{"k3", "k4", "k5"}},
		{"since", store.EventQuery{Since: t0.Add(3 * time.Second)}, []string{"k4", "k5"}},
		{"sandbox", store.EventQuery{SandboxID: "sb-1"}, []string{"k1", "k5"}},
		{"kinds", store.EventQuery{Kinds: []string{"failed", "paused"}}, []string{"k5"}},
		{"limit", store.EventQuery{Limit: 2}, []string{"k1", "k2"}},
		{"nothing after the last", store.EventQuery{After: all[4].ID}, nil},
	} {
		got, err := st.ListEvents(ctx, tc.q)
		must(t, "ListEvents "+tc.name, err)
		wantKeys(t, tc.name, got, tc.want...)
	}
	_, err = st.ListEvents(ctx, store.EventQuery{Projects: []string{"../x"}})
	wantKind(t, "ListEvents of a bad path", err, errdefs.ErrInvalidArgument)
	_, err = st.AppendEvents(ctx, store.Event{Kind: "created"})
	wantKind(t, "AppendEvents without a key", err, errdefs.ErrInvalidArgument)
}

// testEventsPacked: a pull's events are stored in packs (one project's
// events of the pull, packMax at most), and read back as the events they
// hold: every event once, under consecutive IDs, each project's in the
// order pulled, whatever cursor, bound, limit and order a read has, the
// cursor of a read inside a pack as well.
func testEventsPacked(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	_, err := st.ClaimEventPulls(ctx, "a", []string{"n1"}, now, now.Add(time.Minute))
	must(t, "claim", err)
	start, err := st.LastEventID(ctx)
	must(t, "LastEventID", err)
	// 1,300 events of three projects, interleaved: more than two packs'
	// worth of p's.
	projects := []string{"p", "q", "p/r"}
	var evs []store.Event
	for i := 1; i <= 1300; i++ {
		evs = append(evs, ev(fmt.Sprintf("n1/e1/%d", i), projects[i%3], fmt.Sprintf("sb-%d", i%7), "created", now.Add(time.Duration(i)*time.Millisecond)))
	}
	n, err := st.PullEvents(ctx, "a", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 1300}}, evs...)
	must(t, "the pull", err)
	if n != 1300 {
		t.Fatalf("the pull stored %d, want 1300", n)
	}
	last, err := st.LastEventID(ctx)
	must(t, "LastEventID", err)
	if last != start+1300 {
		t.Fatalf("LastEventID after 1,300 events from %d: %d", start, last)
	}
	all, err := st.ListEvents(ctx, store.EventQuery{After: start, Limit: 2000})
	must(t, "ListEvents", err)
	if len(all) != 1300 {
		t.Fatalf("ListEvents: %d events, want 1300", len(all))
	}
	byKey := map[string]store.Event{}
	for i, e := range all {
		if e.ID != start+int64(i)+1 {
			t.Fatalf("event %d: ID %d, want %d (consecutive)", i, e.ID, start+int64(i)+1)
		}
		byKey[e.Key] = e
	}
	for _, want := range evs {
		got, ok := byKey[want.Key]
		if !ok {
			t.Fatalf("event %s not stored", want.Key)
		}
		want.ID = got.ID
		if !got.At.Equal(want.At) {
			t.Fatalf("event %s: at %v, want %v", want.Key, got.At, want.At)
		}
		got.At = want.At
		if got != want {
			t.Fatalf("event: got %+v, want %+v", got, want)
		}
	}
	// Each project's events in the order pulled.
	for _, p := range projects {
		var want []string
		for _, e := range evs {
			if e.Project == p {
				want = append(want, e.Key)
			}
		}
		got, err := st.ListEvents(ctx, store.EventQuery{Projects: []string{p}, After: start, Limit: 2000})
		must(t, "ListEvents of "+p, err)
		if p == "p" {
			// p and p/r under it, each in its order.
			var own []store.Event
			for _, e := range got {
				if e.Project == "p" {
					own = append(own, e)
				}
			}
			if len(got) != 2*len(want) {
				t.Fatalf("project p and under it: %d events, want %d", len(got), 2*len(want))
			}
			got = own
		}
		wantKeys(t, "project "+p, got, want...)
	}
	// Pages of 100 by cursor, from inside packs, read every event once in
	// ID order; newest first by Before, every event once backwards.
	var paged []store.Event
	for after := start; ; {
		page, err := st.ListEvents(ctx, store.EventQuery{After: after, Limit: 100})
		must(t, "a page", err)
		if len(page) == 0 {
			break
		}
		paged = append(paged, page...)
		after = page[len(page)-1].ID
	}
	wantKeys(t, "paged by cursor", paged, keysOf(all)...)
	var back []store.Event
	for before := last + 1; ; {
		page, err := st.ListEvents(ctx, store.EventQuery{After: start, Before: before, NewestFirst: true, Limit: 70})
		must(t, "a page newest first", err)
		if len(page) == 0 {
			break
		}
		back = append(back, page...)
		before = page[len(page)-1].ID
	}
	slices.Reverse(back)
	wantKeys(t, "paged newest first", back, keysOf(all)...)
	// A sandbox's events and a kind, across packs.
	got, err := st.ListEvents(ctx, store.EventQuery{After: start, SandboxID: "sb-3", Limit: 2000})
	must(t, "ListEvents of a sandbox", err)
	for _, e := range got {
		if e.SandboxID != "sb-3" {
			t.Fatalf("ListEvents of sb-3 returned %+v", e)
		}
	}
	if want := (1300-3)/7 + 1; len(got) != want {
		t.Fatalf("ListEvents of sb-3: %d events, want %d", len(got), want)
	}
	got, err = st.ListEvents(ctx, store.EventQuery{After: all[5].ID, Before: all[9].ID})
	must(t, "ListEvents between two IDs", err)
	wantKeys(t, "between two IDs", got, keysOf(all[6:9])...)
	held, err := st.ClaimEventPulls(ctx, "a", []string{"n1"}, now, now.Add(time.Minute))
	must(t, "claim again", err)
	if len(held) != 1 || held[0].Epoch != "e1" || held[0].Seq != 1300 {
		t.Fatalf("held %+v, want n1 at e1/1300", held)
	}
}

// testEventsExpire: ExpireEvents removes the events older than its time
// (the packs whose newest event is).
func testEventsExpire(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	// Two pulls: a pack goes when its newest event is too old.
	_, err := st.AppendEvents(ctx, ev("old", "a", "sb-1", "created", now.Add(-2*time.Hour)))
	must(t, "AppendEvents", err)
	_, err = st.AppendEvents(ctx, ev("new", "a", "sb-1", "deleted", now))
	must(t, "AppendEvents", err)
	n, err := st.ExpireEvents(ctx, now.Add(-time.Hour))
	must(t, "ExpireEvents", err)
	if n != 1 {
		t.Fatalf("ExpireEvents removed %d, want 1", n)
	}
	all, err := st.ListEvents(ctx, store.EventQuery{})
	must(t, "ListEvents", err)
	wantKeys(t, "left", all, "new")
	// Everything expired, IDs go on from the last given: a reader's
	// cursor never passes an event stored later.
	_, err = st.ExpireEvents(ctx, now.Add(time.Hour))
	must(t, "ExpireEvents of all", err)
	_, err = st.AppendEvents(ctx, ev("later", "a", "sb-2", "created", now))
	must(t, "AppendEvents after", err)
	got, err := st.ListEvents(ctx, store.EventQuery{After: all[0].ID})
	must(t, "ListEvents after the last expired", err)
	wantKeys(t, "stored after all expired", got, "later")
}

// testReplicasEventsConcurrent: two stores appending events at once
// store them all, and a reader following the cursor all along sees every
// event exactly once.
func testReplicasEventsConcurrent(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	const rounds, per = 20, 5
	now := ms(time.Now())
	var wg sync.WaitGroup
	errs := make(chan error, 2*rounds)
	for w, st := range []store.Store{a, b} {
		wg.Go(func() {
			for r := range rounds {
				var evs []store.Event
				for i := range per {
					evs = append(evs, ev(fmt.Sprintf("k%d-%03d-%d", w, r, i), []string{"p", "q"}[i%2], "sb", "created", now))
				}
				if _, err := st.AppendEvents(ctx, evs...); err != nil {
					errs <- err
				}
			}
		})
	}
	seen := map[string]int{}
	var cursor int64
	follow := func() {
		got, err := b.ListEvents(ctx, store.EventQuery{After: cursor})
		must(t, "ListEvents", err)
		for _, e := range got {
			seen[e.Key]++
			cursor = e.ID
		}
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for {
		select {
		case <-done:
		default:
			follow()
			continue
		}
		break
	}
	close(errs)
	for err := range errs {
		t.Fatalf("AppendEvents: %v", err)
	}
	follow()
	if len(seen) != 2*rounds*per {
		t.Fatalf("the follower saw %d keys, want %d", len(seen), 2*rounds*per)
	}
	for k, n := range seen {
		if n != 1 {
			t.Fatalf("the follower saw %s %d times", k, n)
		}
	}
	all, err := a.ListEvents(ctx, store.EventQuery{Limit: 10 * rounds * per})
	must(t, "ListEvents", err)
	if len(all) != 2*rounds*per {
		t.Fatalf("%d events stored, want %d", len(all), 2*rounds*per)
	}
}
