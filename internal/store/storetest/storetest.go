// Package storetest is the conformance suite every store.Store
// implementation runs: call Run from the implementation's tests with a
// constructor that returns a Store on an empty database and closes it when
// the test ends, and RunReplicas with one that returns two independent
// Stores on one empty database (two apiserver replicas).
package storetest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// promptly is how long a call with a cancelled context may take.
const promptly = 5 * time.Second

// Run runs the conformance suite. open is called once per subtest and must
// return a Store on an empty database.
func Run(t *testing.T, open func(t *testing.T) store.Store) {
	tests := []struct {
		name string
		fn   func(t *testing.T, st store.Store)
	}{
		{"IdempotencyRoundTrip", testIdempotencyRoundTrip},
		{"ExpireIdempotency", testExpireIdempotency},
		{"ReserveNew", testReserveNew},
		{"ReserveExisting", testReserveExisting},
		{"ReserveDifferentRequest", testReserveDifferentRequest},
		{"ReserveConcurrent", testReserveConcurrent},
		{"Complete", testComplete},
		{"CompleteAgain", testCompleteAgain},
		{"CompleteAtomic", testCompleteAtomic},
		{"CompleteConcurrent", testCompleteConcurrent},
		{"Release", testRelease},
		{"DeleteSandboxRows", testDeleteSandboxRows},
		{"NodeSandboxRows", testNodeSandboxRows},
		{"ReservationNonce", testReservationNonce},
		{"CompleteOtherNonce", testCompleteOtherNonce},
		{"TouchCreate", testTouchCreate},
		{"StaleCreates", testStaleCreates},
		{"AbandonCreate", testAbandonCreate},
		{"Doubts", testDoubts},
		{"DoubtsForget", testDoubtsForget},
		{"InvalidArguments", testInvalidArguments},
		{"RegisterSlots", testRegisterSlots},
		{"RegisterAgain", testRegisterAgain},
		{"RegisterIdentityConflict", testRegisterIdentityConflict},
		{"GenerationSurvivesRemove", testGenerationSurvivesRemove},
		{"RegisterConcurrent", testRegisterConcurrent},
		{"Heartbeat", testHeartbeat},
		{"RemoveNode", testRemoveNode},
		{"Principals", testPrincipals},
		{"TokenRoundTrip", testTokenRoundTrip},
		{"TokenExpiry", testTokenExpiry},
		{"TokenRevoke", testTokenRevoke},
		{"ForgedTokens", testForgedTokens},
		{"Cancelled", testCancelled},
	}
	tests = append(tests, iamCases...)
	tests = append(tests, holdCases...)
	tests = append(tests, eventCases...)
	tests = append(tests, usageCases...)
	tests = append(tests, consoleCases...)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.fn(t, open(t))
		})
	}
}

// RunReplicas runs the cases that need two Stores on one database. open is
// called once per subtest and must return two independent Stores (their own
// connections, as two processes would have) on one empty database.
func RunReplicas(t *testing.T, open func(t *testing.T) (a, b store.Store)) {
	tests := []struct {
		name string
		fn   func(t *testing.T, a, b store.Store)
	}{
		{"ReserveConcurrent", testReplicasReserveConcurrent},
		{"CompleteSeenByOther", testReplicasCompleteSeen},
		{"CompleteConcurrent", testReplicasCompleteConcurrent},
		{"AbandonVersusComplete", testReplicasAbandonVersusComplete},
		{"RegisterConcurrent", testReplicasRegisterConcurrent},
		{"RegisterIdentityConflict", testReplicasIdentityConflict},
		{"TokenSeenByOther", testReplicasToken},
	}
	tests = append(tests, iamReplicaCases...)
	tests = append(tests, holdReplicaCases...)
	tests = append(tests, eventReplicaCases...)
	tests = append(tests, usageReplicaCases...)
	tests = append(tests, consoleReplicaCases...)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a, b := open(t)
			tc.fn(t, a, b)
		})
	}
}

// --- helpers

func ms(t time.Time) time.Time { return time.UnixMilli(t.UnixMilli()) }

func wantKind(t *testing.T, what string, err, kind error) {
	t.Helper()
	if !errors.Is(err, kind) {
		t.Fatalf("%s: got error %v, want one wrapping %q", what, err, kind)
	}
}

func must(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// within fails unless got lies in [from, to] at the store's precision.
func within(t *testing.T, what string, got, from, to time.Time) {
	t.Helper()
	if got.Before(ms(from)) || got.After(ms(to).Add(time.Millisecond)) {
		t.Fatalf("%s = %v, want between %v and %v", what, got, from, to)
	}
}

func reserve(t *testing.T, st store.Store, key, hash string) store.CreateReservation {
	t.Helper()
	got, reserved, err := st.ReserveCreate(t.Context(), store.CreateReservation{
		Key: key, RequestHash: hash, Owner: "api-1", Placements: []string{"n1", "n2"},
	})
	must(t, "ReserveCreate "+key, err)
	if !reserved {
		t.Fatalf("ReserveCreate %s: reserved false for a new key (existing %+v)", key, got)
	}
	return got
}

func rows(key string, ids ...string) []store.SandboxRow {
	var out []store.SandboxRow
	for i, id := range ids {
		out = append(out, store.SandboxRow{ID: id, Node: fmt.Sprintf("n%d", i%2+1)})
	}
	return out
}

func sandboxIDs(t *testing.T, st store.Store, key string) []string {
	t.Helper()
	rs, err := st.SandboxRows(t.Context(), key)
	must(t, "SandboxRows "+key, err)
	var ids []string
	for _, r := range rs {
		ids = append(ids, r.ID)
	}
	return ids
}

// stillPending fails unless key's reservation is pending with no outcome.
func stillPending(t *testing.T, st store.Store, key, hash string) {
	t.Helper()
	got, reserved, err := st.ReserveCreate(t.Context(), store.CreateReservation{Key: key, RequestHash: hash})
	must(t, "ReserveCreate "+key, err)
	if reserved || got.State != store.StatePending || len(got.IDs) != 0 {
		t.Fatalf("reservation %s: reserved=%v %+v, want it still pending with no IDs", key, reserved, got)
	}
	if _, err := st.GetIdempotency(t.Context(), key); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("GetIdempotency %s while pending: %v, want ErrNotFound", key, err)
	}
	if ids := sandboxIDs(t, st, key); len(ids) != 0 {
		t.Fatalf("sandbox rows of pending %s: %v, want none", key, ids)
	}
}

// --- idempotency records

func testIdempotencyRoundTrip(t *testing.T, st store.Store) {
	ctx := t.Context()
	_, err := st.GetIdempotency(ctx, "k1")
	wantKind(t, "GetIdempotency of a missing key", err, errdefs.ErrNotFound)
	for _, want := range []store.Idempotency{
		{Key: "k1", RequestHash: "h", IDs: []string{"sb-a-1", "sb-a-2"}, Created: ms(time.Now())},
		// A second Put replaces the record.
		{Key: "k1", RequestHash: "h2", IDs: []string{"sb-b-1"}, Created: ms(time.Now().Add(time.Second))},
		{Key: "no-ids", RequestHash: "h", Created: ms(time.Now())},
	} {
		must(t, "PutIdempotency", st.PutIdempotency(ctx, want))
		got, err := st.GetIdempotency(ctx, want.Key)
		must(t, "GetIdempotency", err)
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("record %s (-want +got):\n%s", want.Key, diff)
		}
	}
}

func testExpireIdempotency(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := time.Now()
	must(t, "Put", st.PutIdempotency(ctx, store.Idempotency{Key: "old1", RequestHash: "h", IDs: []string{"a"}, Created: now.Add(-2 * time.Hour)}))
	must(t, "Put", st.PutIdempotency(ctx, store.Idempotency{Key: "old2", RequestHash: "h", IDs: []string{"b"}, Created: now.Add(-90 * time.Minute)}))
	must(t, "Put", st.PutIdempotency(ctx, store.Idempotency{Key: "new", RequestHash: "h", IDs: []string{"c"}, Created: now}))
	// A pending reservation is never expired: its create may still run.
	_, _, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "pending", RequestHash: "h", Created: now.Add(-3 * time.Hour)})
	must(t, "ReserveCreate", err)

	n, err := st.ExpireIdempotency(ctx, now.Add(-time.Hour))
	must(t, "ExpireIdempotency", err)
	if n != 2 {
		t.Fatalf("ExpireIdempotency removed %d records, want 2", n)
	}
	for key, kind := range map[string]error{"old1": errdefs.ErrNotFound, "old2": errdefs.ErrNotFound, "new": nil} {
		_, err := st.GetIdempotency(ctx, key)
		if !errors.Is(err, kind) {
			t.Fatalf("GetIdempotency %s after expiry: %v, want %v", key, err, kind)
		}
	}
	stillPending(t, st, "pending", "h")
	if n, err := st.ExpireIdempotency(ctx, now.Add(-time.Hour)); err != nil || n != 0 {
		t.Fatalf("second ExpireIdempotency: %d, %v; want 0, nil", n, err)
	}
}

// --- reservations

func testReserveNew(t *testing.T, st store.Store) {
	before := time.Now()
	got := reserve(t, st, "k", "h")
	after := time.Now()
	want := store.CreateReservation{Key: "k", RequestHash: "h", Owner: "api-1", Placements: []string{"n1", "n2"},
		State: store.StatePending, Nonce: got.Nonce, Created: got.Created, Updated: got.Created}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("reservation (-want +got):\n%s", diff)
	}
	if len(got.Nonce) != 16 {
		t.Fatalf("nonce %q, want 16 hex digits", got.Nonce)
	}
	within(t, "Created", got.Created, before, after)
	stillPending(t, st, "k", "h")
}

func testReserveExisting(t *testing.T, st store.Store) {
	first := reserve(t, st, "k", "h")
	// Another caller with the same request, its own owner and placements:
	// the first reservation comes back unchanged.
	got, reserved, err := st.ReserveCreate(t.Context(), store.CreateReservation{
		Key: "k", RequestHash: "h", Owner: "api-2", Placements: []string{"n9"}, Created: time.Now().Add(time.Hour),
	})
	must(t, "ReserveCreate again", err)
	if reserved {
		t.Fatal("ReserveCreate of a reserved key returned reserved=true")
	}
	if diff := cmp.Diff(first, got); diff != "" {
		t.Fatalf("existing reservation changed (-first +got):\n%s", diff)
	}
}

func testReserveDifferentRequest(t *testing.T, st store.Store) {
	ctx := t.Context()
	reserve(t, st, "pending", "h")
	must(t, "Put", st.PutIdempotency(ctx, store.Idempotency{Key: "done", RequestHash: "h", IDs: []string{"x"}, Created: time.Now()}))
	for _, key := range []string{"pending", "done"} {
		_, _, err := st.ReserveCreate(ctx, store.CreateReservation{Key: key, RequestHash: "other"})
		wantKind(t, "ReserveCreate "+key+" with another request", err, errdefs.ErrInvalidArgument)
		if !strings.Contains(err.Error(), "was used for a different request") {
			t.Fatalf("error %q does not say the key was used for a different request", err)
		}
	}
	stillPending(t, st, "pending", "h")
}

func testReserveConcurrent(t *testing.T, st store.Store) {
	reserveRace(t, []store.Store{st}, 32)
}

// reserveRace has n goroutines, spread over stores, reserve one key.
func reserveRace(t *testing.T, stores []store.Store, n int) {
	t.Helper()
	var wg sync.WaitGroup
	got := make([]store.CreateReservation, n)
	reserved := make([]bool, n)
	errs := make([]error, n)
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			got[i], reserved[i], errs[i] = stores[i%len(stores)].ReserveCreate(t.Context(), store.CreateReservation{
				Key: "race", RequestHash: "h", Owner: fmt.Sprintf("api-%d", i),
			})
		}()
	}
	close(start)
	wg.Wait()
	winner := -1
	for i := range n {
		must(t, fmt.Sprintf("ReserveCreate #%d", i), errs[i])
		if reserved[i] {
			if winner >= 0 {
				t.Fatalf("callers %d and %d both reserved the key", winner, i)
			}
			winner = i
		}
	}
	if winner < 0 {
		t.Fatal("no caller reserved the key")
	}
	for i := range n {
		if diff := cmp.Diff(got[winner], got[i]); diff != "" {
			t.Fatalf("caller %d saw another reservation than the winner %d (-winner +got):\n%s", i, winner, diff)
		}
	}
	if want := fmt.Sprintf("api-%d", winner); got[winner].Owner != want {
		t.Fatalf("owner %q, want the winner %q", got[winner].Owner, want)
	}
}

func testComplete(t *testing.T, st store.Store) {
	ctx := t.Context()
	res := reserve(t, st, "k", "h")
	before := time.Now()
	must(t, "CompleteCreate", st.CompleteCreate(ctx, "k", res.Nonce, rows("k", "sb-1", "sb-2", "sb-3")))
	after := time.Now()

	rec, err := st.GetIdempotency(ctx, "k")
	must(t, "GetIdempotency", err)
	want := store.Idempotency{Key: "k", RequestHash: "h", IDs: []string{"sb-1", "sb-2", "sb-3"}, Created: res.Created}
	if diff := cmp.Diff(want, rec); diff != "" {
		t.Fatalf("record after completion (-want +got):\n%s", diff)
	}
	got, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k", RequestHash: "h"})
	must(t, "ReserveCreate a done key", err)
	if reserved || got.State != store.StateDone || !cmp.Equal(got.IDs, want.IDs) || got.Owner != "api-1" {
		t.Fatalf("reservation of a done key: reserved=%v %+v", reserved, got)
	}
	within(t, "Updated", got.Updated, before, after)

	rs, err := st.SandboxRows(ctx, "k")
	must(t, "SandboxRows", err)
	if len(rs) != 3 {
		t.Fatalf("SandboxRows: %d rows, want 3", len(rs))
	}
	for i, r := range rs {
		if r.ID != want.IDs[i] || r.Key != "k" || r.Node != fmt.Sprintf("n%d", i%2+1) {
			t.Fatalf("row %d: %+v", i, r)
		}
		within(t, "row Created", r.Created, before, after)
	}
	// A row's own creation time is kept.
	res2 := reserve(t, st, "k2", "h")
	at := ms(time.Now().Add(-time.Minute))
	must(t, "CompleteCreate k2", st.CompleteCreate(ctx, "k2", res2.Nonce, []store.SandboxRow{{ID: "sb-9", Node: "n1", Key: "k2", Created: at}}))
	if rs, _ := st.SandboxRows(ctx, "k2"); len(rs) != 1 || !rs[0].Created.Equal(at) {
		t.Fatalf("SandboxRows k2: %+v, want one created at %v", rs, at)
	}
}

func testCompleteAgain(t *testing.T, st store.Store) {
	ctx := t.Context()
	res := reserve(t, st, "k", "h")
	must(t, "CompleteCreate", st.CompleteCreate(ctx, "k", res.Nonce, rows("k", "sb-1", "sb-2")))
	// The same completion again (a retry that lost the first answer).
	must(t, "CompleteCreate again", st.CompleteCreate(ctx, "k", res.Nonce, rows("k", "sb-1", "sb-2")))
	err := st.CompleteCreate(ctx, "k", res.Nonce, rows("k", "sb-1", "sb-3"))
	wantKind(t, "CompleteCreate with other IDs", err, errdefs.ErrAlreadyExists)
	if ids := sandboxIDs(t, st, "k"); !cmp.Equal(ids, []string{"sb-1", "sb-2"}) {
		t.Fatalf("rows after a refused completion: %v", ids)
	}
	err = st.CompleteCreate(ctx, "unknown", "", rows("unknown", "sb-4"))
	wantKind(t, "CompleteCreate of an unknown key", err, errdefs.ErrNotFound)
	if ids := sandboxIDs(t, st, "unknown"); len(ids) != 0 {
		t.Fatalf("rows recorded for an unknown key: %v", ids)
	}
}

func testCompleteAtomic(t *testing.T, st store.Store) {
	ctx := t.Context()
	first := reserve(t, st, "first", "h")
	must(t, "CompleteCreate first", st.CompleteCreate(ctx, "first", first.Nonce, rows("first", "sb-dup")))

	res := reserve(t, st, "k", "h")
	for _, tc := range []struct {
		name string
		ids  []string
	}{
		{"an ID another create recorded, last", []string{"sb-1", "sb-2", "sb-dup"}},
		{"an ID another create recorded, first", []string{"sb-dup", "sb-1"}},
		{"one ID twice in the batch", []string{"sb-1", "sb-2", "sb-1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := st.CompleteCreate(ctx, "k", res.Nonce, rows("k", tc.ids...))
			wantKind(t, "CompleteCreate", err, errdefs.ErrAlreadyExists)
			stillPending(t, st, "k", "h")
			if ids := sandboxIDs(t, st, "first"); !cmp.Equal(ids, []string{"sb-dup"}) {
				t.Fatalf("the other create's rows changed: %v", ids)
			}
		})
	}
	// The reservation is intact: a completion with fresh IDs goes through.
	must(t, "CompleteCreate with fresh IDs", st.CompleteCreate(ctx, "k", res.Nonce, rows("k", "sb-1", "sb-2")))
	if ids := sandboxIDs(t, st, "k"); !cmp.Equal(ids, []string{"sb-1", "sb-2"}) {
		t.Fatalf("rows: %v", ids)
	}
}

func testCompleteConcurrent(t *testing.T, st store.Store) {
	completeRace(t, []store.Store{st})
}

// completeRace completes one reservation from many goroutines: those with
// the winning IDs all succeed, the others get ErrAlreadyExists, and only
// one batch of rows is stored.
func completeRace(t *testing.T, stores []store.Store) {
	t.Helper()
	ctx := t.Context()
	res := reserve(t, stores[0], "k", "h")
	const n = 16
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			batch := i % 2 // two candidate batches
			errs[i] = stores[i%len(stores)].CompleteCreate(ctx, "k", res.Nonce,
				rows("k", fmt.Sprintf("sb-%d-a", batch), fmt.Sprintf("sb-%d-b", batch)))
		}()
	}
	close(start)
	wg.Wait()
	rec, err := stores[0].GetIdempotency(ctx, "k")
	must(t, "GetIdempotency", err)
	winner := strings.TrimSuffix(strings.TrimPrefix(rec.IDs[0], "sb-"), "-a")
	for i := range n {
		if fmt.Sprint(i%2) == winner {
			must(t, fmt.Sprintf("CompleteCreate #%d with the winning batch", i), errs[i])
		} else {
			wantKind(t, fmt.Sprintf("CompleteCreate #%d with the losing batch", i), errs[i], errdefs.ErrAlreadyExists)
		}
	}
	if ids := sandboxIDs(t, stores[0], "k"); !cmp.Equal(ids, rec.IDs) {
		t.Fatalf("rows %v, want exactly the winning batch %v", ids, rec.IDs)
	}
}

func testRelease(t *testing.T, st store.Store) {
	ctx := t.Context()
	reserve(t, st, "k", "h")
	must(t, "ReleaseCreate", st.ReleaseCreate(ctx, "k"))
	// The key is free again: a retry reserves it afresh.
	res := reserve(t, st, "k", "h")
	must(t, "ReleaseCreate of an unknown key", st.ReleaseCreate(ctx, "unknown"))

	must(t, "CompleteCreate", st.CompleteCreate(ctx, "k", res.Nonce, rows("k", "sb-1")))
	err := st.ReleaseCreate(ctx, "k")
	wantKind(t, "ReleaseCreate of a done key", err, errdefs.ErrFailedPrecondition)
	if rec, err := st.GetIdempotency(ctx, "k"); err != nil || !cmp.Equal(rec.IDs, []string{"sb-1"}) {
		t.Fatalf("done record after a refused release: %+v, %v", rec, err)
	}
	must(t, "Put", st.PutIdempotency(ctx, store.Idempotency{Key: "put", RequestHash: "h", IDs: []string{"x"}, Created: time.Now()}))
	wantKind(t, "ReleaseCreate of a put record", st.ReleaseCreate(ctx, "put"), errdefs.ErrFailedPrecondition)
}

func testDeleteSandboxRows(t *testing.T, st store.Store) {
	ctx := t.Context()
	res := reserve(t, st, "k", "h")
	must(t, "CompleteCreate", st.CompleteCreate(ctx, "k", res.Nonce, rows("k", "sb-1", "sb-2", "sb-3")))
	must(t, "DeleteSandboxRows", st.DeleteSandboxRows(ctx, []string{"sb-1", "sb-3", "sb-unknown"}))
	if ids := sandboxIDs(t, st, "k"); !cmp.Equal(ids, []string{"sb-2"}) {
		t.Fatalf("rows after delete: %v, want [sb-2]", ids)
	}
	must(t, "DeleteSandboxRows of nothing", st.DeleteSandboxRows(ctx, nil))
	// The idempotency record outlives its rows.
	if rec, err := st.GetIdempotency(ctx, "k"); err != nil || len(rec.IDs) != 3 {
		t.Fatalf("record after deleting rows: %+v, %v", rec, err)
	}
}

func testNodeSandboxRows(t *testing.T, st store.Store) {
	ctx := t.Context()
	a := reserve(t, st, "a", "h")
	must(t, "CompleteCreate a", st.CompleteCreate(ctx, "a", a.Nonce, rows("a", "sb-a1", "sb-a2", "sb-a3")))
	b := reserve(t, st, "b", "h")
	must(t, "CompleteCreate b", st.CompleteCreate(ctx, "b", b.Nonce, rows("b", "sb-b1", "sb-b2")))
	// rows puts index 0, 2, … on n1 and 1, 3, … on n2.
	got, err := st.NodeSandboxRows(ctx, "n1")
	must(t, "NodeSandboxRows n1", err)
	var ids []string
	for _, r := range got {
		if r.Node != "n1" || r.Key == "" {
			t.Fatalf("row of n1: %+v", r)
		}
		ids = append(ids, r.ID)
	}
	if want := []string{"sb-a1", "sb-a3", "sb-b1"}; !cmp.Equal(ids, want) {
		t.Fatalf("rows of n1: %v, want %v", ids, want)
	}
	if got, err := st.NodeSandboxRows(ctx, "n9"); err != nil || len(got) != 0 {
		t.Fatalf("rows of a node without any: %+v, %v", got, err)
	}
}

// --- reconciliation: nonces, leases, abandonment, doubts

func testReservationNonce(t *testing.T, st store.Store) {
	ctx := t.Context()
	first := reserve(t, st, "k", "h")
	if len(first.Nonce) != 16 {
		t.Fatalf("nonce %q, want 16 hex digits", first.Nonce)
	}
	got, err := st.Reservation(ctx, "k")
	must(t, "Reservation", err)
	if diff := cmp.Diff(first, got); diff != "" {
		t.Fatalf("Reservation of a pending key (-reserved +read):\n%s", diff)
	}
	must(t, "ReleaseCreate", st.ReleaseCreate(ctx, "k"))
	second := reserve(t, st, "k", "h")
	if second.Nonce == first.Nonce {
		t.Fatalf("the key reserved again has the same nonce %q", second.Nonce)
	}
	must(t, "CompleteCreate", st.CompleteCreate(ctx, "k", second.Nonce, rows("k", "sb-1")))
	got, err = st.Reservation(ctx, "k")
	must(t, "Reservation of a done key", err)
	if got.State != store.StateDone || got.Nonce != second.Nonce || !cmp.Equal(got.IDs, []string{"sb-1"}) {
		t.Fatalf("Reservation of a done key: %+v", got)
	}
	_, err = st.Reservation(ctx, "unknown")
	wantKind(t, "Reservation of an unknown key", err, errdefs.ErrNotFound)
}

func testCompleteOtherNonce(t *testing.T, st store.Store) {
	ctx := t.Context()
	first := reserve(t, st, "k", "h")
	must(t, "ReleaseCreate", st.ReleaseCreate(ctx, "k"))
	second := reserve(t, st, "k", "h")
	// A create of the first reservation, late, must not complete the second.
	err := st.CompleteCreate(ctx, "k", first.Nonce, rows("k", "sb-old"))
	wantKind(t, "CompleteCreate under a released reservation's nonce", err, errdefs.ErrNotFound)
	stillPending(t, st, "k", "h")
	must(t, "CompleteCreate under the current nonce", st.CompleteCreate(ctx, "k", second.Nonce, rows("k", "sb-new")))
	// Once done, the same IDs are a no-op whoever asks, other IDs are refused.
	must(t, "CompleteCreate again", st.CompleteCreate(ctx, "k", second.Nonce, rows("k", "sb-new")))
	err = st.CompleteCreate(ctx, "k", first.Nonce, rows("k", "sb-old"))
	wantKind(t, "CompleteCreate of a done key with other IDs", err, errdefs.ErrAlreadyExists)
	if ids := sandboxIDs(t, st, "k"); !cmp.Equal(ids, []string{"sb-new"}) {
		t.Fatalf("rows: %v", ids)
	}
}

// reserveAt reserves key as created (and last touched) at at.
func reserveAt(t *testing.T, st store.Store, key string, at time.Time) store.CreateReservation {
	t.Helper()
	got, reserved, err := st.ReserveCreate(t.Context(), store.CreateReservation{Key: key, RequestHash: "h", Owner: "api-1",
		Placements: []string{"n1"}, Created: at})
	must(t, "ReserveCreate "+key, err)
	if !reserved {
		t.Fatalf("ReserveCreate %s: not reserved", key)
	}
	return got
}

func testTouchCreate(t *testing.T, st store.Store) {
	ctx := t.Context()
	old := time.Now().Add(-time.Hour)
	r := reserveAt(t, st, "k", old)
	if !r.Updated.Equal(ms(old)) {
		t.Fatalf("Updated %v, want the creation time %v", r.Updated, ms(old))
	}
	before := time.Now()
	must(t, "TouchCreate", st.TouchCreate(ctx, "k", r.Nonce))
	got, err := st.Reservation(ctx, "k")
	must(t, "Reservation", err)
	within(t, "Updated after a touch", got.Updated, before, time.Now())
	if !got.Created.Equal(r.Created) || got.State != store.StatePending {
		t.Fatalf("a touch changed more than Updated: %+v", got)
	}
	wantKind(t, "TouchCreate with another nonce", st.TouchCreate(ctx, "k", "0123456789abcdef"), errdefs.ErrNotFound)
	wantKind(t, "TouchCreate of an unknown key", st.TouchCreate(ctx, "unknown", ""), errdefs.ErrNotFound)
	must(t, "CompleteCreate", st.CompleteCreate(ctx, "k", r.Nonce, rows("k", "sb-1")))
	wantKind(t, "TouchCreate of a done key", st.TouchCreate(ctx, "k", r.Nonce), errdefs.ErrNotFound)
}

func testStaleCreates(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := time.Now()
	oldest := reserveAt(t, st, "oldest", now.Add(-3*time.Hour))
	older := reserveAt(t, st, "older", now.Add(-2*time.Hour))
	reserveAt(t, st, "fresh", now)
	done := reserveAt(t, st, "done", now.Add(-4*time.Hour))
	must(t, "CompleteCreate", st.CompleteCreate(ctx, "done", done.Nonce, rows("done", "sb-1")))
	touched := reserveAt(t, st, "touched", now.Add(-5*time.Hour))
	must(t, "TouchCreate", st.TouchCreate(ctx, "touched", touched.Nonce))

	got, err := st.StaleCreates(ctx, now.Add(-time.Hour), 10)
	must(t, "StaleCreates", err)
	if diff := cmp.Diff([]store.CreateReservation{oldest, older}, got); diff != "" {
		t.Fatalf("stale reservations (-want +got):\n%s", diff)
	}
	got, err = st.StaleCreates(ctx, now.Add(-time.Hour), 1)
	must(t, "StaleCreates with a limit", err)
	if len(got) != 1 || got[0].Key != "oldest" {
		t.Fatalf("StaleCreates limited to 1: %+v", got)
	}
}

func testAbandonCreate(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := time.Now()
	r := reserveAt(t, st, "k", now.Add(-time.Hour))
	doubts := []store.Doubt{
		{Node: "n1", Token: r.Nonce + "#", Prefix: true, Key: "k"},
		{Node: "n2", Token: r.Nonce + "#", Prefix: true, Key: "k"},
	}
	// Touched since the cut-off, or under another nonce: left alone.
	ok, err := st.AbandonCreate(ctx, "k", r.Nonce, now.Add(-2*time.Hour), doubts)
	must(t, "AbandonCreate of a reservation touched since", err)
	if ok {
		t.Fatal("AbandonCreate removed a reservation touched after the cut-off")
	}
	ok, err = st.AbandonCreate(ctx, "k", "0123456789abcdef", now, doubts)
	must(t, "AbandonCreate under another nonce", err)
	if ok {
		t.Fatal("AbandonCreate removed a reservation of another nonce")
	}
	if ds, err := st.Doubts(ctx); err != nil || len(ds) != 0 {
		t.Fatalf("doubts after refused abandonments: %+v, %v", ds, err)
	}
	stillPending(t, st, "k", "h")

	before := time.Now()
	ok, err = st.AbandonCreate(ctx, "k", r.Nonce, now, doubts)
	must(t, "AbandonCreate", err)
	if !ok {
		t.Fatal("AbandonCreate left a stale reservation")
	}
	_, err = st.Reservation(ctx, "k")
	wantKind(t, "Reservation after abandoning it", err, errdefs.ErrNotFound)
	ds, err := st.Doubts(ctx)
	must(t, "Doubts", err)
	if len(ds) != 2 {
		t.Fatalf("doubts: %+v, want 2", ds)
	}
	for i, d := range ds {
		within(t, "doubt Created", d.Created, before, time.Now())
		d.Created = time.Time{}
		if diff := cmp.Diff(doubts[i], d); diff != "" {
			t.Fatalf("doubt %d (-want +got):\n%s", i, diff)
		}
	}
	// Its creates cannot complete it now; the key is free.
	err = st.CompleteCreate(ctx, "k", r.Nonce, rows("k", "sb-1"))
	wantKind(t, "CompleteCreate of an abandoned reservation", err, errdefs.ErrNotFound)
	ok, err = st.AbandonCreate(ctx, "k", r.Nonce, now, doubts)
	if err != nil || ok {
		t.Fatalf("AbandonCreate again: %v, %v; want false", ok, err)
	}
	reserve(t, st, "k", "h")

	// A done reservation is never abandoned.
	d := reserveAt(t, st, "done", now.Add(-time.Hour))
	must(t, "CompleteCreate", st.CompleteCreate(ctx, "done", d.Nonce, rows("done", "sb-d")))
	if ok, err := st.AbandonCreate(ctx, "done", d.Nonce, now, nil); err != nil || ok {
		t.Fatalf("AbandonCreate of a done reservation: %v, %v", ok, err)
	}
}

func testDoubts(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	add := []store.Doubt{
		{Node: "n2", Token: "b1#0@n2", Created: now.Add(-time.Minute)},
		{Node: "n1", Token: "b2#3@n1", Key: "k", Created: now},
		{Node: "n1", Token: "b3#", Prefix: true, Key: "k3", Created: now.Add(-time.Second)},
	}
	must(t, "AddDoubts", st.AddDoubts(ctx, add))
	// Recording one again keeps the first record.
	must(t, "AddDoubts again", st.AddDoubts(ctx, []store.Doubt{{Node: "n2", Token: "b1#0@n2", Key: "other", Created: now}}))
	must(t, "AddDoubts of nothing", st.AddDoubts(ctx, nil))
	got, err := st.Doubts(ctx)
	must(t, "Doubts", err)
	want := []store.Doubt{add[2], add[1], add[0]} // by node, then oldest first
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("doubts (-want +got):\n%s", diff)
	}
	// Created defaults to now.
	before := time.Now()
	must(t, "AddDoubts without a time", st.AddDoubts(ctx, []store.Doubt{{Node: "n3", Token: "b4#1@n3"}}))
	got, _ = st.Doubts(ctx)
	within(t, "Created", got[len(got)-1].Created, before, time.Now())

	must(t, "ClearDoubts", st.ClearDoubts(ctx, []store.Doubt{
		{Node: "n1", Token: "b2#3@n1"}, {Node: "n2", Token: "b3#"}, {Node: "n9", Token: "unknown"}}))
	must(t, "ClearDoubts of nothing", st.ClearDoubts(ctx, nil))
	got, err = st.Doubts(ctx)
	must(t, "Doubts after clearing", err)
	var left []string
	for _, d := range got {
		left = append(left, d.Node+" "+d.Token)
	}
	if want := []string{"n1 b3#", "n2 b1#0@n2", "n3 b4#1@n3"}; !cmp.Equal(left, want) {
		t.Fatalf("doubts left: %v, want %v", left, want)
	}
	wantKind(t, "AddDoubts without a node", st.AddDoubts(ctx, []store.Doubt{{Token: "t"}}), errdefs.ErrInvalidArgument)
	wantKind(t, "AddDoubts without a token", st.AddDoubts(ctx, []store.Doubt{{Node: "n1"}}), errdefs.ErrInvalidArgument)
}

// testDoubtsForget: ForgetDoubts deletes the doubts of the nodes not kept
// recorded before the time given, and no other; with no node kept, every
// node's old doubts.
func testDoubtsForget(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	old, recent := now.Add(-2*time.Hour), now.Add(-time.Minute)
	must(t, "AddDoubts", st.AddDoubts(ctx, []store.Doubt{
		{Node: "kept", Token: "a#0@kept", Created: old},
		{Node: "gone", Token: "b#0@gone", Created: old},
		{Node: "gone", Token: "c#", Prefix: true, Key: "k", Created: old},
		{Node: "gone", Token: "d#0@gone", Created: recent},
		{Node: "other", Token: "e#0@other", Created: old},
	}))
	left := func() []string {
		t.Helper()
		got, err := st.Doubts(ctx)
		must(t, "Doubts", err)
		var out []string
		for _, d := range got {
			out = append(out, d.Token)
		}
		return out
	}
	n, err := st.ForgetDoubts(ctx, []string{"kept", "other"}, now.Add(-time.Hour))
	must(t, "ForgetDoubts", err)
	if want := []string{"d#0@gone", "a#0@kept", "e#0@other"}; n != 2 || !cmp.Equal(left(), want) {
		t.Fatalf("ForgetDoubts of gone's older than an hour: deleted %d, left %v; want 2 deleted, %v left", n, left(), want)
	}
	n, err = st.ForgetDoubts(ctx, []string{"kept", "other"}, now.Add(-time.Hour))
	must(t, "ForgetDoubts again", err)
	if n != 0 {
		t.Fatalf("ForgetDoubts again deleted %d, want none", n)
	}
	n, err = st.ForgetDoubts(ctx, nil, now.Add(-time.Hour))
	must(t, "ForgetDoubts keeping no node", err)
	if want := []string{"d#0@gone"}; n != 2 || !cmp.Equal(left(), want) {
		t.Fatalf("ForgetDoubts keeping no node: deleted %d, left %v; want 2 deleted, %v left", n, left(), want)
	}
}

func testInvalidArguments(t *testing.T, st store.Store) {
	ctx := t.Context()
	res := reserve(t, st, "k", "h")
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"ReserveCreate with no key", func() error {
			_, _, err := st.ReserveCreate(ctx, store.CreateReservation{RequestHash: "h"})
			return err
		}()},
		{"CompleteCreate with no key", st.CompleteCreate(ctx, "", "", rows("", "sb-1"))},
		{"CompleteCreate with an empty ID", st.CompleteCreate(ctx, "k", res.Nonce, []store.SandboxRow{{Node: "n1"}})},
		{"CompleteCreate with a row of another key", st.CompleteCreate(ctx, "k", res.Nonce, []store.SandboxRow{{ID: "sb-1", Node: "n1", Key: "other"}})},
		{"RegisterNode with no name", func() error {
			_, err := st.RegisterNode(ctx, store.Node{Identity: "fp"}, time.Minute)
			return err
		}()},
		{"RegisterNode with no identity", func() error {
			_, err := st.RegisterNode(ctx, store.Node{Name: "n1"}, time.Minute)
			return err
		}()},
		{"IssueToken with a negative ttl", func() error {
			_, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "p", Role: iam.Admin, TTL: -time.Second})
			return err
		}()},
		{"CreatePrincipal with no name", func() error {
			_, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: ""})
			return err
		}()},
		{"CreatePrincipal with a control character", func() error {
			_, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "a\nb"})
			return err
		}()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantKind(t, tc.name, tc.err, errdefs.ErrInvalidArgument)
		})
	}
	stillPending(t, st, "k", "h")
}

// --- node registry

func node(name, identity string, at time.Time) store.Node {
	return store.Node{Name: name, Addr: name + ".internal:7443", Backends: []string{"runc", "crun"},
		MaxSandboxes: 200, CPUs: 16, MemoryMB: 65536, Identity: identity, LastSeen: at}
}

func register(t *testing.T, st store.Store, n store.Node, live time.Duration) store.Node {
	t.Helper()
	got, err := st.RegisterNode(t.Context(), n, live)
	must(t, "RegisterNode "+n.Name, err)
	return got
}

func testRegisterSlots(t *testing.T, st store.Store) {
	ctx := t.Context()
	at := ms(time.Now())
	var want []store.Node
	for i, name := range []string{"n1", "n2", "n3"} {
		n := node(name, "fp-"+name, at)
		got := register(t, st, n, time.Minute)
		n.Slot, n.Generation, n.Registered = i+1, 1, at
		if diff := cmp.Diff(n, got); diff != "" {
			t.Fatalf("RegisterNode %s (-want +got):\n%s", name, diff)
		}
		want = append(want, n)
	}
	nodes, err := st.Nodes(ctx)
	must(t, "Nodes", err)
	if diff := cmp.Diff(want, nodes); diff != "" {
		t.Fatalf("Nodes (-want +got):\n%s", diff)
	}
	got, err := st.NodeBySlot(ctx, 2)
	must(t, "NodeBySlot 2", err)
	if diff := cmp.Diff(want[1], got); diff != "" {
		t.Fatalf("NodeBySlot 2 (-want +got):\n%s", diff)
	}
	_, err = st.NodeBySlot(ctx, 4)
	wantKind(t, "NodeBySlot of a free slot", err, errdefs.ErrNotFound)

	// A freed slot in the middle is the lowest free one.
	must(t, "RemoveNode n2", st.RemoveNode(ctx, "n2"))
	n4 := register(t, st, node("n4", "fp-n4", at), time.Minute)
	if n4.Slot != 2 || n4.Generation != 2 {
		t.Fatalf("n4 got slot %d generation %d, want slot 2 (freed) generation 2", n4.Slot, n4.Generation)
	}
	if n5 := register(t, st, node("n5", "fp-n5", at), time.Minute); n5.Slot != 4 || n5.Generation != 1 {
		t.Fatalf("n5 got slot %d generation %d, want 4, 1", n5.Slot, n5.Generation)
	}
	// With no time given, the registration happens now.
	before := time.Now()
	n6 := register(t, st, node("n6", "fp-n6", time.Time{}), time.Minute)
	within(t, "LastSeen", n6.LastSeen, before, time.Now())
	if !n6.Registered.Equal(n6.LastSeen) {
		t.Fatalf("Registered %v, want %v", n6.Registered, n6.LastSeen)
	}
}

func testRegisterAgain(t *testing.T, st store.Store) {
	ctx := t.Context()
	t0 := ms(time.Now().Add(-time.Minute))
	register(t, st, node("n0", "fp-n0", t0), time.Minute)
	first := register(t, st, node("n1", "fp-n1", t0), time.Minute)

	// The same edge restarts (same identity) with new capacity and address,
	// while it is still live: same slot and generation, new fields.
	again := node("n1", "fp-n1", t0.Add(10*time.Second))
	again.Addr, again.Backends, again.MaxSandboxes, again.CPUs, again.MemoryMB = "10.0.0.9:7443", []string{"crun"}, 50, 2.5, 4096
	got := register(t, st, again, time.Minute)
	want := again
	want.Slot, want.Generation, want.Registered = first.Slot, first.Generation, first.Registered
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("re-registration (-want +got):\n%s", diff)
	}
	if stored, err := st.NodeBySlot(ctx, first.Slot); err != nil || !cmp.Equal(want, stored) {
		t.Fatalf("stored after re-registration: %v\n%s", err, cmp.Diff(want, stored))
	}
	// A re-registration stamped earlier leaves LastSeen where it was.
	late := register(t, st, node("n1", "fp-n1", t0), time.Minute)
	if !late.LastSeen.Equal(want.LastSeen) {
		t.Fatalf("LastSeen moved back to %v from %v", late.LastSeen, want.LastSeen)
	}
}

func testRegisterIdentityConflict(t *testing.T, st store.Store) {
	ctx := t.Context()
	t0 := ms(time.Now().Add(-time.Hour))
	first := register(t, st, node("n1", "fp-good", t0), time.Minute)

	// Another certificate claims the name while the node is live.
	_, err := st.RegisterNode(ctx, node("n1", "fp-evil", t0.Add(59*time.Second)), time.Minute)
	wantKind(t, "RegisterNode with another identity within the live window", err, errdefs.ErrAlreadyExists)
	if !strings.Contains(err.Error(), "n1") {
		t.Fatalf("error %q does not name the node", err)
	}
	if got, _ := st.NodeBySlot(ctx, first.Slot); got.Identity != "fp-good" || got.Generation != first.Generation {
		t.Fatalf("a refused claim changed the node: %+v", got)
	}

	// After the window the old edge is presumed gone: the new identity takes
	// the slot over, with the next generation.
	t1 := t0.Add(time.Minute)
	got := register(t, st, node("n1", "fp-new", t1), time.Minute)
	if got.Slot != first.Slot || got.Generation != first.Generation+1 || got.Identity != "fp-new" || !got.Registered.Equal(t1) {
		t.Fatalf("takeover: %+v, want slot %d generation %d identity fp-new registered %v", got, first.Slot, first.Generation+1, t1)
	}
	// The old edge's heartbeats are refused from now on.
	err = st.Heartbeat(ctx, "n1", first.Generation, t1.Add(time.Second))
	wantKind(t, "Heartbeat at the taken-over generation", err, errdefs.ErrFailedPrecondition)
	must(t, "Heartbeat at the new generation", st.Heartbeat(ctx, "n1", got.Generation, t1.Add(time.Second)))
	// And the old identity coming back while the new one is live is refused.
	_, err = st.RegisterNode(ctx, node("n1", "fp-good", t1.Add(2*time.Second)), time.Minute)
	wantKind(t, "RegisterNode by the old identity", err, errdefs.ErrAlreadyExists)
}

func testGenerationSurvivesRemove(t *testing.T, st store.Store) {
	ctx := t.Context()
	at := ms(time.Now())
	var last int64
	// Slot 1 changes hands four times; its generation only grows.
	for i, name := range []string{"a", "b", "a", "c"} {
		n := register(t, st, node(name, fmt.Sprintf("fp-%d", i), at), time.Minute)
		if n.Slot != 1 || n.Generation <= last {
			t.Fatalf("owner %d (%s): slot %d generation %d, want slot 1 and a generation above %d", i, name, n.Slot, n.Generation, last)
		}
		last = n.Generation
		must(t, "RemoveNode "+name, st.RemoveNode(ctx, name))
	}
	if last != 4 {
		t.Fatalf("generation after four owners: %d, want 4", last)
	}
	nodes, err := st.Nodes(ctx)
	must(t, "Nodes", err)
	if len(nodes) != 0 {
		t.Fatalf("Nodes after removing all: %+v", nodes)
	}
}

func testRegisterConcurrent(t *testing.T, st store.Store) {
	registerRace(t, []store.Store{st}, 12)
}

// registerRace registers n distinct nodes at once, spread over stores: each
// gets its own slot, and together they fill slots 1..n.
func registerRace(t *testing.T, stores []store.Store, n int) {
	t.Helper()
	var wg sync.WaitGroup
	got := make([]store.Node, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = stores[i%len(stores)].RegisterNode(t.Context(), node(fmt.Sprintf("n%d", i), fmt.Sprintf("fp-%d", i), time.Now()), time.Minute)
		}()
	}
	wg.Wait()
	seen := map[int]string{}
	for i := range n {
		must(t, fmt.Sprintf("RegisterNode n%d", i), errs[i])
		if other, ok := seen[got[i].Slot]; ok {
			t.Fatalf("%s and %s both got slot %d", other, got[i].Name, got[i].Slot)
		}
		seen[got[i].Slot] = got[i].Name
		if got[i].Slot < 1 || got[i].Slot > n || got[i].Generation != 1 {
			t.Fatalf("%s: slot %d generation %d, want a slot in 1..%d at generation 1", got[i].Name, got[i].Slot, got[i].Generation, n)
		}
	}
}

func testHeartbeat(t *testing.T, st store.Store) {
	ctx := t.Context()
	t0 := ms(time.Now().Add(-time.Minute))
	n := register(t, st, node("n1", "fp", t0), time.Minute)
	for _, tc := range []struct {
		name       string
		node       string
		generation int64
		at         time.Time
		kind       error
		lastSeen   time.Time
	}{
		{"current", "n1", n.Generation, t0.Add(5 * time.Second), nil, t0.Add(5 * time.Second)},
		{"earlier does not move back", "n1", n.Generation, t0.Add(time.Second), nil, t0.Add(5 * time.Second)},
		{"stale generation", "n1", n.Generation - 1, t0.Add(9 * time.Second), errdefs.ErrFailedPrecondition, t0.Add(5 * time.Second)},
		{"future generation", "n1", n.Generation + 1, t0.Add(9 * time.Second), errdefs.ErrFailedPrecondition, t0.Add(5 * time.Second)},
		{"unknown node", "nope", 1, t0, errdefs.ErrNotFound, t0.Add(5 * time.Second)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := st.Heartbeat(ctx, tc.node, tc.generation, tc.at)
			if !errors.Is(err, tc.kind) || (tc.kind == nil && err != nil) {
				t.Fatalf("Heartbeat: %v, want %v", err, tc.kind)
			}
			got, err := st.NodeBySlot(ctx, n.Slot)
			must(t, "NodeBySlot", err)
			if !got.LastSeen.Equal(tc.lastSeen) {
				t.Fatalf("LastSeen %v, want %v", got.LastSeen, tc.lastSeen)
			}
		})
	}
	// A node that stopped beating is taken over once the window passes
	// from its last heartbeat, not from its registration.
	_, err := st.RegisterNode(ctx, node("n1", "fp-2", t0.Add(62*time.Second)), time.Minute)
	wantKind(t, "takeover within the window of the last heartbeat", err, errdefs.ErrAlreadyExists)
	register(t, st, node("n1", "fp-2", t0.Add(65*time.Second)), time.Minute)
}

func testRemoveNode(t *testing.T, st store.Store) {
	ctx := t.Context()
	wantKind(t, "RemoveNode of an unknown node", st.RemoveNode(ctx, "nope"), errdefs.ErrNotFound)
	n := register(t, st, node("n1", "fp", time.Now()), time.Minute)
	must(t, "RemoveNode", st.RemoveNode(ctx, "n1"))
	_, err := st.NodeBySlot(ctx, n.Slot)
	wantKind(t, "NodeBySlot after remove", err, errdefs.ErrNotFound)
	wantKind(t, "Heartbeat after remove", st.Heartbeat(ctx, "n1", n.Generation, time.Now()), errdefs.ErrNotFound)
	wantKind(t, "RemoveNode twice", st.RemoveNode(ctx, "n1"), errdefs.ErrNotFound)
}

// --- principals and tokens

func testPrincipals(t *testing.T, st store.Store) {
	ctx := t.Context()
	before := time.Now()
	p, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"})
	must(t, "CreatePrincipal", err)
	within(t, "Created", p.Created, before, time.Now())
	if p.ID == "" || p.Name != "trainer" || p.Project != "" || p.Kind != store.KindUser {
		t.Fatalf("principal %+v", p)
	}
	_, err = st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"})
	wantKind(t, "CreatePrincipal of a taken name", err, errdefs.ErrAlreadyExists)
	q, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "eval"})
	must(t, "CreatePrincipal eval", err)
	if q.ID == p.ID {
		t.Fatalf("two principals share ID %s", p.ID)
	}
	_, _, err = st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "nobody", Role: iam.Admin, TTL: 0})
	wantKind(t, "IssueToken for an unknown principal", err, errdefs.ErrNotFound)
	_, err = st.ListTokens(ctx, "nobody")
	wantKind(t, "ListTokens of an unknown principal", err, errdefs.ErrNotFound)
	toks, err := st.ListTokens(ctx, "eval")
	must(t, "ListTokens", err)
	if len(toks) != 0 {
		t.Fatalf("tokens of a new principal: %+v", toks)
	}
}

func issue(t *testing.T, st store.Store, principal string, ttl time.Duration) (string, store.TokenInfo) {
	t.Helper()
	tok, info, err := st.MintToken(t.Context(), iam.NodeAdmin(), store.TokenSpec{Principal: principal, Role: iam.Admin, TTL: ttl})
	must(t, "IssueToken", err)
	return tok, info
}

func authenticate(t *testing.T, st store.Store, tok string) iam.Authority {
	t.Helper()
	p, err := st.Authenticate(t.Context(), tok)
	must(t, "Authenticate", err)
	return p
}

func revoke(st store.Store, id string) error {
	_, _, err := st.RevokeToken(context.Background(), iam.NodeAdmin(), id)
	return err
}

func testTokenRoundTrip(t *testing.T, st store.Store) {
	ctx := t.Context()
	p, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"})
	must(t, "CreatePrincipal", err)
	before := time.Now()
	tok, info := issue(t, st, "trainer", 0)
	tok2, info2 := issue(t, st, "trainer", time.Hour)
	after := time.Now()
	for _, tk := range []string{tok, tok2} {
		// "dsec_" and at least 32 random bytes, base64url.
		if !strings.HasPrefix(tk, "dsec_") || len(tk) < len("dsec_")+43 || strings.ContainsAny(tk, "+/=") {
			t.Fatalf("token %q is not dsec_ followed by 32 bytes of base64url", tk)
		}
		if got := authenticate(t, st, tk); got.Principal != p.Name || got.Project != "" || got.Role != iam.Admin || got.Node {
			t.Fatalf("Authenticate: %+v", got)
		}
	}
	if tok == tok2 || info.ID == info2.ID {
		t.Fatal("two tokens are the same")
	}
	within(t, "Created", info.Created, before, after)
	if !info.Expires.IsZero() || !info.Revoked.IsZero() || info.Principal != "trainer" {
		t.Fatalf("token without ttl: %+v", info)
	}
	if want := info2.Created.Add(time.Hour); !info2.Expires.Equal(want) {
		t.Fatalf("Expires %v, want %v", info2.Expires, want)
	}
	list, err := st.ListTokens(ctx, "trainer")
	must(t, "ListTokens", err)
	if diff := cmp.Diff([]store.TokenInfo{info, info2}, list); diff != "" && cmp.Diff([]store.TokenInfo{info2, info}, list) != "" {
		t.Fatalf("ListTokens (-want +got):\n%s", diff)
	}
	for _, l := range list {
		if strings.Contains(l.ID, tok) || strings.Contains(l.ID, tok2) {
			t.Fatal("a token ID contains the token")
		}
	}
}

func testTokenExpiry(t *testing.T, st store.Store) {
	ctx := t.Context()
	_, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"})
	must(t, "CreatePrincipal", err)
	tok, _ := issue(t, st, "trainer", time.Millisecond)
	time.Sleep(20 * time.Millisecond)
	_, err = st.Authenticate(ctx, tok)
	wantKind(t, "Authenticate with an expired token", err, errdefs.ErrUnauthenticated)
	live, _ := issue(t, st, "trainer", time.Hour)
	authenticate(t, st, live)
}

func testTokenRevoke(t *testing.T, st store.Store) {
	ctx := t.Context()
	_, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"})
	must(t, "CreatePrincipal", err)
	tok, info := issue(t, st, "trainer", 0)
	other, _ := issue(t, st, "trainer", 0)
	before := time.Now()
	must(t, "RevokeToken", revoke(st, info.ID))
	after := time.Now()
	_, err = st.Authenticate(ctx, tok)
	wantKind(t, "Authenticate with a revoked token", err, errdefs.ErrUnauthenticated)
	authenticate(t, st, other)

	revokedAt := func() time.Time {
		list, err := st.ListTokens(ctx, "trainer")
		must(t, "ListTokens", err)
		for _, l := range list {
			if l.ID == info.ID {
				return l.Revoked
			}
		}
		t.Fatalf("ListTokens lost revoked token %s", info.ID)
		return time.Time{}
	}
	first := revokedAt()
	within(t, "Revoked", first, before, after)
	time.Sleep(5 * time.Millisecond)
	must(t, "RevokeToken again", revoke(st, info.ID))
	if again := revokedAt(); !again.Equal(first) {
		t.Fatalf("revoking again moved Revoked from %v to %v", first, again)
	}
	wantKind(t, "RevokeToken of an unknown ID", revoke(st, "tok-nope"), errdefs.ErrNotFound)
}

func testForgedTokens(t *testing.T, st store.Store) {
	ctx := t.Context()
	_, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"})
	must(t, "CreatePrincipal", err)
	tok, info := issue(t, st, "trainer", 0)
	flip := []byte(tok)
	if flip[10] == 'A' {
		flip[10] = 'B'
	} else {
		flip[10] = 'A'
	}
	for _, tc := range []struct{ name, token string }{
		{"empty", ""},
		{"prefix only", "dsec_"},
		{"one character changed", string(flip)},
		{"truncated", tok[:len(tok)-1]},
		{"extended", tok + "A"},
		{"no prefix", strings.TrimPrefix(tok, "dsec_")},
		{"another prefix", "dsek_" + strings.TrimPrefix(tok, "dsec_")},
		{"never issued", "dsec_" + strings.Repeat("A", 43)},
		{"the token's ID", info.ID},
		{"not base64url", "dsec_" + strings.Repeat("*", 43)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := st.Authenticate(ctx, tc.token)
			wantKind(t, "Authenticate", err, errdefs.ErrUnauthenticated)
		})
	}
	authenticate(t, st, tok)
}

// --- context

func testCancelled(t *testing.T, st store.Store) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	for _, tc := range []struct {
		name string
		call func() error
	}{
		{"ReserveCreate", func() error {
			_, _, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k", RequestHash: "h"})
			return err
		}},
		{"CompleteCreate", func() error { return st.CompleteCreate(ctx, "k", "", rows("k", "sb-1")) }},
		{"RegisterNode", func() error {
			_, err := st.RegisterNode(ctx, node("n1", "fp", time.Now()), time.Minute)
			return err
		}},
		{"Authenticate", func() error {
			_, err := st.Authenticate(ctx, "dsec_"+strings.Repeat("A", 43))
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			if err := tc.call(); err == nil {
				t.Fatal("a call with a cancelled context succeeded")
			}
			if d := time.Since(start); d > promptly {
				t.Fatalf("a call with a cancelled context took %s", d)
			}
		})
	}
	// Nothing was done.
	if _, reserved, err := st.ReserveCreate(t.Context(), store.CreateReservation{Key: "k", RequestHash: "h"}); err != nil || !reserved {
		t.Fatalf("a cancelled ReserveCreate left a reservation (reserved=%v, %v)", reserved, err)
	}
	if nodes, err := st.Nodes(t.Context()); err != nil || len(nodes) != 0 {
		t.Fatalf("Nodes after a cancelled RegisterNode: %+v, %v", nodes, err)
	}
}

// --- two replicas

func testReplicasReserveConcurrent(t *testing.T, a, b store.Store) {
	reserveRace(t, []store.Store{a, b}, 32)
}

func testReplicasCompleteSeen(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	res := reserve(t, a, "k", "h")
	// b sees a's pending reservation, and refuses another request under it.
	got, reserved, err := b.ReserveCreate(ctx, store.CreateReservation{Key: "k", RequestHash: "h", Owner: "api-2"})
	must(t, "ReserveCreate on b", err)
	if reserved || !cmp.Equal(res, got) {
		t.Fatalf("b's view of a's reservation: reserved=%v\n%s", reserved, cmp.Diff(res, got))
	}
	_, _, err = b.ReserveCreate(ctx, store.CreateReservation{Key: "k", RequestHash: "other"})
	wantKind(t, "ReserveCreate on b with another request", err, errdefs.ErrInvalidArgument)

	must(t, "CompleteCreate on a", a.CompleteCreate(ctx, "k", res.Nonce, rows("k", "sb-1", "sb-2")))
	rec, err := b.GetIdempotency(ctx, "k")
	must(t, "GetIdempotency on b", err)
	if !cmp.Equal(rec.IDs, []string{"sb-1", "sb-2"}) {
		t.Fatalf("b sees IDs %v", rec.IDs)
	}
	// A released key on one replica is free on the other.
	reserve(t, b, "k2", "h")
	must(t, "ReleaseCreate on a", a.ReleaseCreate(ctx, "k2"))
	reserve(t, b, "k2", "h")
}

func testReplicasCompleteConcurrent(t *testing.T, a, b store.Store) {
	completeRace(t, []store.Store{a, b})
}

// testReplicasAbandonVersusComplete: one replica completes a stale
// reservation while the other abandons it: exactly one of them wins, and
// the loser changed nothing.
func testReplicasAbandonVersusComplete(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	const n = 24
	for i := range n {
		key := fmt.Sprintf("k%d", i)
		r := reserveAt(t, a, key, time.Now().Add(-time.Hour))
		var completeErr, abandonErr error
		var abandoned bool
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			completeErr = a.CompleteCreate(ctx, key, r.Nonce, rows(key, "sb-"+key))
		}()
		go func() {
			defer wg.Done()
			abandoned, abandonErr = b.AbandonCreate(ctx, key, r.Nonce, time.Now(), []store.Doubt{{Node: "n1", Token: r.Nonce + "#", Prefix: true, Key: key}})
		}()
		wg.Wait()
		must(t, "AbandonCreate "+key, abandonErr)
		ds, err := a.Doubts(ctx)
		must(t, "Doubts", err)
		recorded := false
		for _, d := range ds {
			recorded = recorded || d.Key == key
		}
		switch {
		case abandoned:
			wantKind(t, "CompleteCreate that lost to AbandonCreate "+key, completeErr, errdefs.ErrNotFound)
			if ids := sandboxIDs(t, a, key); len(ids) != 0 || !recorded {
				t.Fatalf("%s abandoned: rows %v, doubt recorded %v", key, ids, recorded)
			}
		default:
			must(t, "CompleteCreate that beat AbandonCreate "+key, completeErr)
			if ids := sandboxIDs(t, a, key); len(ids) != 1 || recorded {
				t.Fatalf("%s completed: rows %v, doubt recorded %v", key, ids, recorded)
			}
		}
	}
}

func testReplicasRegisterConcurrent(t *testing.T, a, b store.Store) {
	registerRace(t, []store.Store{a, b}, 12)
	nodes, err := b.Nodes(t.Context())
	must(t, "Nodes on b", err)
	if len(nodes) != 12 {
		t.Fatalf("b sees %d nodes, want 12", len(nodes))
	}
}

func testReplicasIdentityConflict(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	at := ms(time.Now())
	n := register(t, a, node("n1", "fp-1", at), time.Minute)
	_, err := b.RegisterNode(ctx, node("n1", "fp-2", at.Add(time.Second)), time.Minute)
	wantKind(t, "RegisterNode on b with another identity", err, errdefs.ErrAlreadyExists)
	must(t, "Heartbeat on b", b.Heartbeat(ctx, "n1", n.Generation, at.Add(2*time.Second)))
	got, err := a.NodeBySlot(ctx, n.Slot)
	must(t, "NodeBySlot on a", err)
	if !got.LastSeen.Equal(at.Add(2 * time.Second)) {
		t.Fatalf("a sees LastSeen %v after b's heartbeat", got.LastSeen)
	}
}

func testReplicasToken(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	_, err := a.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"})
	must(t, "CreatePrincipal on a", err)
	_, err = b.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"})
	wantKind(t, "CreatePrincipal of the same name on b", err, errdefs.ErrAlreadyExists)
	tok, info := issue(t, a, "trainer", 0)
	authenticate(t, b, tok)
	must(t, "RevokeToken on b", revoke(b, info.ID))
	_, err = a.Authenticate(ctx, tok)
	wantKind(t, "Authenticate on a after b revoked", err, errdefs.ErrUnauthenticated)
}
