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
	{"EventsOnce", testEventsOnce},
	{"EventsPulledAgain", testEventsPulledAgain},
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
		store.Event{Key: "k5", At: t0.Add(4 * time.Second), Project: "a", SandboxID: "sb-1", Kind: "failed", Node: "n2",
			Reason: "oom", Message: "its agent was OOM-killed"},
	)
	must(t, "AppendEvents", err)
	if n != 5 {
		t.Fatalf("AppendEvents stored %d, want 5", n)
	}
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

// testEventsOnce: an event appended again (the same key: a report pulled
// twice) is stored once, and the new ones of the same append are stored.
func testEventsOnce(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	_, err := st.AppendEvents(ctx, ev("k1", "a", "sb-1", "created", now), ev("k2", "a", "sb-1", "paused", now))
	must(t, "AppendEvents", err)
	n, err := st.AppendEvents(ctx, ev("k1", "a", "sb-1", "created", now), ev("k2", "a", "sb-1", "paused", now),
		ev("k3", "a", "sb-1", "resumed", now))
	must(t, "AppendEvents again", err)
	if n != 1 {
		t.Fatalf("AppendEvents again stored %d, want 1 (k3)", n)
	}
	all, err := st.ListEvents(ctx, store.EventQuery{})
	must(t, "ListEvents", err)
	wantKeys(t, "all", all, "k1", "k2", "k3")
}

// testEventsPulledAgain: a pull that brings keys stored already (a
// node's pull forgotten while the node kept running, then registered
// again: its events come again from its start) stores the new ones, each
// once, in order, and moves the cursor; a pull of many events in one
// write stores them all in order.
func testEventsPulledAgain(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	_, err := st.ClaimEventPulls(ctx, "a", []string{"n1"}, now, now.Add(time.Minute))
	must(t, "claim", err)
	var first []store.Event
	for i := 1; i <= 300; i++ {
		first = append(first, ev(fmt.Sprintf("n1/e1/%d", i), "p", "sb-1", "created", now))
	}
	n, err := st.PullEvents(ctx, "a", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 300}}, first...)
	must(t, "the first pull", err)
	if n != 300 {
		t.Fatalf("the first pull stored %d, want 300", n)
	}
	again := append(slices.Clone(first[250:]), ev("n1/e1/301", "p", "sb-1", "deleted", now), ev("n1/e1/302", "p", "sb-2", "created", now))
	n, err = st.PullEvents(ctx, "a", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 302}}, again...)
	must(t, "a pull of keys stored already", err)
	if n != 2 {
		t.Fatalf("the pull of 50 keys stored and 2 new stored %d, want 2", n)
	}
	all, err := st.ListEvents(ctx, store.EventQuery{})
	must(t, "ListEvents", err)
	var want []string
	for i := 1; i <= 302; i++ {
		want = append(want, fmt.Sprintf("n1/e1/%d", i))
	}
	wantKeys(t, "stored", all, want...)
	held, err := st.ClaimEventPulls(ctx, "a", []string{"n1"}, now, now.Add(time.Minute))
	must(t, "claim again", err)
	if len(held) != 1 || held[0].Epoch != "e1" || held[0].Seq != 302 {
		t.Fatalf("held %+v, want n1 at e1/302", held)
	}
}

// testEventsExpire: ExpireEvents removes the events older than its time.
func testEventsExpire(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	_, err := st.AppendEvents(ctx, ev("old", "a", "sb-1", "created", now.Add(-2*time.Hour)),
		ev("new", "a", "sb-1", "deleted", now))
	must(t, "AppendEvents", err)
	n, err := st.ExpireEvents(ctx, now.Add(-time.Hour))
	must(t, "ExpireEvents", err)
	if n != 1 {
		t.Fatalf("ExpireEvents removed %d, want 1", n)
	}
	all, err := st.ListEvents(ctx, store.EventQuery{})
	must(t, "ListEvents", err)
	wantKeys(t, "left", all, "new")
}

// testReplicasEventsConcurrent: two stores appending the same and
// different events at once store each key once, and a reader following
// the cursor all along sees every event exactly once.
func testReplicasEventsConcurrent(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	const rounds, per = 20, 5
	now := ms(time.Now())
	var wg sync.WaitGroup
	errs := make(chan error, 2*rounds)
	for _, st := range []store.Store{a, b} {
		wg.Go(func() {
			for r := range rounds {
				var evs []store.Event
				for i := range per {
					evs = append(evs, ev(fmt.Sprintf("k%03d-%d", r, i), "p", "sb", "created", now))
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
	if len(seen) != rounds*per {
		t.Fatalf("the follower saw %d keys, want %d", len(seen), rounds*per)
	}
	for k, n := range seen {
		if n != 1 {
			t.Fatalf("the follower saw %s %d times", k, n)
		}
	}
	all, err := a.ListEvents(ctx, store.EventQuery{Limit: 10 * rounds * per})
	must(t, "ListEvents", err)
	if len(all) != rounds*per {
		t.Fatalf("%d events stored, want %d", len(all), rounds*per)
	}
}
