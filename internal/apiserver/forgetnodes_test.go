package apiserver

import (
	"log/slog"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// TestForgetGoneNodes: the housekeeping deletes the event pull of a node
// gone from the fleet once nobody held it for eventForgetAfter, with this
// apiserver's ledger cursor of it and its creates' doubts older than
// doubtForgetAfter, and keeps those of a node still in the fleet (down or
// restarting) however old, a gone node's pull held lately and its doubts
// recorded lately.
func TestForgetGoneNodes(t *testing.T) {
	ctx := t.Context()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	s := New(Config{Name: "f", Auth: st, IAM: st, Events: st, Ledger: st, Metrics: metrics.New()},
		st, watcher.NewFixed(watcher.Node{Member: watcher.Member{Name: "n1"}}), slog.New(slog.DiscardHandler))

	now := time.Now()
	if _, err := st.ClaimEventPulls(ctx, "old", []string{"n1", "gone"}, now, now.Add(eventLease)); err != nil {
		t.Fatal(err)
	}
	if _, err := st.PullEvents(ctx, "old", []store.EventPull{{Node: "n1", Epoch: "e1", Seq: 4, UsageEpoch: "u1", UsageSeq: 3},
		{Node: "gone", Epoch: "e2", Seq: 9, UsageEpoch: "u2", UsageSeq: 5}}); err != nil {
		t.Fatal(err)
	}
	if err := st.ReleaseEventPulls(ctx, "old"); err != nil {
		t.Fatal(err)
	}
	if err := st.AddDoubts(ctx, []store.Doubt{
		{Node: "gone", Token: "old#0@gone", Created: now.Add(-doubtForgetAfter - time.Minute)},
		{Node: "gone", Token: "new#0@gone", Created: now},
		{Node: "n1", Token: "old#0@n1", Created: now.Add(-doubtForgetAfter - time.Minute)},
	}); err != nil {
		t.Fatal(err)
	}
	s.usage.markPulled([]string{"n1", "gone"})

	cursors := func(at time.Time) map[string]store.EventPull {
		t.Helper()
		ps, err := st.ClaimEventPulls(ctx, "check", []string{"n1", "gone"}, at, at.Add(eventLease))
		if err != nil {
			t.Fatal(err)
		}
		if err := st.ReleaseEventPulls(ctx, "check"); err != nil {
			t.Fatal(err)
		}
		out := map[string]store.EventPull{}
		for _, p := range ps {
			out[p.Node] = p
		}
		return out
	}

	// Gone, but not for long enough: kept.
	s.forgetGoneNodes(ctx, now.Add(eventForgetAfter/2))
	if c := cursors(now)["gone"]; c.Epoch != "e2" || c.Seq != 9 {
		t.Fatalf("gone's pull after half the grace: %+v, want it kept at e2/9", c)
	}
	// The check's claim held it: gone for the grace after that.
	s.forgetGoneNodes(ctx, time.Now().Add(eventForgetAfter+eventLease+time.Second))
	got := cursors(time.Now())
	if c := got["gone"]; c.Epoch != "" || c.Seq != 0 || c.UsageEpoch != "" || c.UsageSeq != 0 {
		t.Errorf("gone's pull after the grace: %+v, want it forgotten (pulled from its start)", c)
	}
	if c := got["n1"]; c.Epoch != "e1" || c.Seq != 4 || c.UsageEpoch != "u1" || c.UsageSeq != 3 {
		t.Errorf("n1's pull: %+v, want it kept at e1/4, its ledger at u1/3 (n1 is in the fleet)", c)
	}
	ds, err := st.Doubts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var doubts []string
	for _, d := range ds {
		doubts = append(doubts, d.Token)
	}
	if want := []string{"new#0@gone", "old#0@n1"}; !slices.Equal(doubts, want) {
		t.Errorf("doubts left: %v, want %v (gone's recent one, n1's however old)", doubts, want)
	}
	s.usage.mu.Lock()
	n := len(s.usage.pulled)
	s.usage.mu.Unlock()
	if n != 1 {
		t.Errorf("the ledger remembers when %d nodes were pulled, want 1 (n1)", n)
	}
}
