package storetest

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

// slicedCharge is a keyed create's charge of n sandboxes of project.
func slicedCharge(project string, n int64) *store.QuotaCharge {
	a := store.Amounts{store.Sandboxes: n}
	return &store.QuotaCharge{Project: project, Amounts: a, Held: a, Expires: time.Now().Add(time.Minute)}
}

// testQuotaSlices: a slice is a quarter of the headroom and not use;
// creates charged to it are use, held until settled, a repeat charges
// nothing; a released one gives the slice its room back; a reconciler
// that read the use before a charge to a slice corrects nothing; an exact
// charge that fits only without the slice's headroom takes it back (the
// slice is spent), and its refusal names the true use; near the limit no
// slice is leased; a slice leased again is resized in place; an expired
// one is returned by ExpireHolds, what it spent staying charged.
func testQuotaSlices(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml")
	limit(t, st, "ml", store.Sandboxes, 100)
	one := store.Amounts{store.Sandboxes: 1}
	sl, err := st.LeaseSlice(ctx, "a", "ml", "", store.Amounts{store.Sandboxes: 40}, one, time.Now().Add(time.Minute))
	must(t, "LeaseSlice", err)
	if sl.ID == "" || sl.Size[store.Sandboxes] != 25 {
		t.Fatalf("a slice of 40 of a headroom of 100: %+v, want 25", sl)
	}
	if u := used(t, st, "ml", store.Sandboxes); u != 0 {
		t.Fatalf("use %d with a slice leased and nothing charged, want 0", u)
	}
	read := own(t, st, "ml", store.Sandboxes)
	nonces := map[string]string{}
	for _, k := range []string{"k1", "k2", "k3"} {
		got, reserved, err := st.ReserveSliced(ctx, sl.ID, store.CreateReservation{Key: k, RequestHash: "h", Owner: "a", Charge: slicedCharge("ml", 1)})
		if err != nil || !reserved {
			t.Fatalf("ReserveSliced %s: reserved %v, %v", k, reserved, err)
		}
		nonces[k] = got.Nonce
	}
	if _, again, err := st.ReserveSliced(ctx, sl.ID, store.CreateReservation{Key: "k1", RequestHash: "h", Owner: "b", Charge: slicedCharge("ml", 1)}); err != nil || again {
		t.Fatalf("a repeat: reserved %v, %v", again, err)
	}
	if u, o := used(t, st, "ml", store.Sandboxes), own(t, st, "ml", store.Sandboxes); u != 3 || o.Own != 3 || o.Held != 3 {
		t.Fatalf("three creates charged to a slice: use %d, own %+v; want 3, held 3", u, o)
	}
	if ok, err := st.CorrectUse(ctx, read, 0); err != nil || ok {
		t.Fatalf("a correction read before charges to a slice: corrected %v, %v", ok, err)
	}
	must(t, "Settle", st.Settle(ctx, []string{store.ReservationHold("k1", nonces["k1"])}, false))
	must(t, "Settle", st.Settle(ctx, []string{store.ReservationHold("k2", nonces["k2"])}, true))
	if u, o := used(t, st, "ml", store.Sandboxes), own(t, st, "ml", store.Sandboxes); u != 2 || o.Held != 1 {
		t.Fatalf("one create kept, one released: use %d, held %d; want 2 and 1", u, o.Held)
	}
	// 98 fit only without the slice's unspent 23.
	must(t, "Charge", st.Charge(ctx, "ml", store.Amounts{store.Sandboxes: 98}))
	if u := used(t, st, "ml", store.Sandboxes); u != 100 {
		t.Fatalf("use %d after a charge of 98 beside 2, want 100", u)
	}
	_, _, err = st.ReserveSliced(ctx, sl.ID, store.CreateReservation{Key: "k4", RequestHash: "h", Owner: "a", Charge: slicedCharge("ml", 1)})
	if !errors.Is(err, store.ErrSliceSpent) {
		t.Fatalf("a charge to a slice taken back: %v, want ErrSliceSpent", err)
	}
	if _, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k4", RequestHash: "h", Owner: "a"}); err != nil || !reserved {
		t.Fatalf("k4 after its refused sliced reservation: reserved %v, %v (the refusal reserved it)", reserved, err)
	}
	wantMessage(t, "a charge past the limit", st.Charge(ctx, "ml", one), errdefs.ErrResourceExhausted, "quota of project ml: 100 of 100 sandboxes in use")
	near, err := st.LeaseSlice(ctx, "a", "ml", sl.ID, store.Amounts{store.Sandboxes: 40}, one, time.Now().Add(time.Minute))
	must(t, "LeaseSlice", err)
	if near.ID != "" || used(t, st, "ml", store.Sandboxes) != 100 {
		t.Fatalf("a slice with no headroom left: %+v, use %d; want none, 100", near, used(t, st, "ml", store.Sandboxes))
	}
	must(t, "Release", st.Release(ctx, "ml", store.Amounts{store.Sandboxes: 97}))
	sl, err = st.LeaseSlice(ctx, "a", "ml", "", store.Amounts{store.Sandboxes: 40}, one, time.Now().Add(time.Second))
	must(t, "LeaseSlice", err)
	if sl.Size[store.Sandboxes] != 24 {
		t.Fatalf("a slice of 40 of a headroom of 97: %+v, want 24", sl)
	}
	if _, reserved, err := st.ReserveSliced(ctx, sl.ID, store.CreateReservation{Key: "k5", RequestHash: "h", Owner: "a", Charge: slicedCharge("ml", 1)}); err != nil || !reserved {
		t.Fatalf("ReserveSliced k5: reserved %v, %v", reserved, err)
	}
	// Leased again: resized in place, so creates charging it go on.
	resized, err := st.LeaseSlice(ctx, "a", "ml", sl.ID, store.Amounts{store.Sandboxes: 8}, one, time.Now().Add(time.Second))
	must(t, "LeaseSlice", err)
	if resized.ID != sl.ID || resized.Size[store.Sandboxes] != 8 || used(t, st, "ml", store.Sandboxes) != 4 {
		t.Fatalf("a slice leased again: %+v (was %s), use %d; want it resized to 8, use 4", resized, sl.ID, used(t, st, "ml", store.Sandboxes))
	}
	if _, reserved, err := st.ReserveSliced(ctx, sl.ID, store.CreateReservation{Key: "k6", RequestHash: "h", Owner: "a", Charge: slicedCharge("ml", 1)}); err != nil || !reserved {
		t.Fatalf("ReserveSliced k6: reserved %v, %v", reserved, err)
	}
	// Its apiserver gone: the slice expires, what it spent stays (its
	// holds expire later), k3's hold too.
	if _, err := st.ExpireHolds(ctx, time.Now().Add(30*time.Second)); err != nil {
		t.Fatal(err)
	}
	if u, o := used(t, st, "ml", store.Sandboxes), own(t, st, "ml", store.Sandboxes); u != 5 || o.Own != 5 || o.Held != 3 {
		t.Fatalf("a slice expired: use %d, own %+v; want 5, held 3", u, o)
	}
	if _, _, err := st.ReserveSliced(ctx, sl.ID, store.CreateReservation{Key: "k7", RequestHash: "h", Owner: "a", Charge: slicedCharge("ml", 1)}); !errors.Is(err, store.ErrSliceSpent) {
		t.Fatalf("a charge to an expired slice: %v, want ErrSliceSpent", err)
	}
	if _, err := st.ExpireHolds(ctx, time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if u := used(t, st, "ml", store.Sandboxes); u != 2 {
		t.Fatalf("use %d once the holds expired, want 2 (k1 and the 1 left of the exact charge)", u)
	}
}

// testReplicasQuotaSlices: two apiservers (owners, each with its Store)
// race 400 keyed creates for a quota of 100, each charging its own slice
// (leased again when spent) and exactly once it cannot: exactly 100 are
// reserved, the others refused by name, and the use is 100.
func testReplicasQuotaSlices(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	mkProjects(t, a, "team")
	limit(t, a, "team", store.Sandboxes, 100)
	one := store.Amounts{store.Sandboxes: 1}
	var mu sync.Mutex
	reserved, refused := 0, 0
	var other []error
	var wg sync.WaitGroup
	for o, st := range []store.Store{a, b} {
		owner := fmt.Sprint("apiserver-", o)
		var smu sync.Mutex
		slice, near := "", false // near: no slice fits, charge exactly
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 25 {
					key := fmt.Sprintf("%s-%d-%d", owner, w, i)
					r := store.CreateReservation{Key: key, RequestHash: "h", Owner: owner, Charge: slicedCharge("team", 1)}
					smu.Lock()
					sl := slice
					smu.Unlock()
					var ok bool
					var err error
					if sl != "" {
						_, ok, err = st.ReserveSliced(ctx, sl, r)
					}
					if sl == "" || errors.Is(err, store.ErrSliceSpent) {
						smu.Lock()
						if slice == sl && !near {
							next, lerr := st.LeaseSlice(ctx, owner, "team", sl, store.Amounts{store.Sandboxes: 10}, one, time.Now().Add(time.Minute))
							if lerr != nil {
								t.Error(lerr)
							}
							slice, near = next.ID, next.ID == ""
						}
						smu.Unlock()
						_, ok, err = st.ReserveCreate(ctx, r)
					}
					mu.Lock()
					switch {
					case err == nil && ok:
						reserved++
					case errors.Is(err, errdefs.ErrResourceExhausted) && strings.Contains(err.Error(), "quota of project team: 100 of 100 sandboxes in use"):
						refused++
					default:
						other = append(other, fmt.Errorf("%s reserved %v: %w", key, ok, err))
					}
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	if len(other) > 0 {
		t.Fatalf("%d reservations failed otherwise, first: %v", len(other), other[0])
	}
	if u := used(t, b, "team", store.Sandboxes); reserved != 100 || refused != 300 || u != 100 {
		t.Fatalf("%d reserved, %d refused, use %d; want 100, 300, 100", reserved, refused, u)
	}
}
