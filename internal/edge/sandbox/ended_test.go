package sandbox

import (
	"context"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TestStatusCountsEnded: Status counts the sandboxes that stopped living
// since the edge started (apiservers skip checking a node's sandbox rows
// while the count and the start stay); a restarted edge starts counting
// again from a later start.
func TestStatusCountsEnded(t *testing.T) {
	ctx := context.Background()
	rt := newFake(t)
	dir := t.TempDir()
	m := newTestManager(t, dir, rt)
	first := m.Status()
	if first.Ended != 0 || first.Started.IsZero() {
		t.Fatalf("a new edge reports %d ended since %v", first.Ended, first.Started)
	}
	var ids []string
	for range 3 {
		sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.GetId())
	}
	if st := m.Status(); st.Ended != 0 || st.Live != 3 {
		t.Fatalf("3 created: %d ended, %d live", st.Ended, st.Live)
	}
	for _, id := range ids[:2] {
		if err := m.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	m.Delete(ctx, ids[0]) // deleting it again ends nothing more
	if st := m.Status(); st.Ended != 2 || st.Live != 1 || !st.Started.Equal(first.Started) {
		t.Fatalf("2 deleted: %d ended, %d live, since %v (was %v)", st.Ended, st.Live, st.Started, first.Started)
	}
	m.Shutdown()
	m2 := newTestManager(t, dir, rt)
	if st := m2.Status(); st.Ended != 0 || !st.Started.After(first.Started) || st.Live != 1 {
		t.Fatalf("after a restart: %d ended since %v (first start %v), %d live", st.Ended, st.Started, first.Started, st.Live)
	}
}
