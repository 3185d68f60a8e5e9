package storetest

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

// holdCases are the conformance cases of quota holds, releases of one
// sandbox and the reconciler's provable corrections.
var holdCases = []struct {
	name string
	fn   func(t *testing.T, st store.Store)
}{
	{"QuotaHolds", testQuotaHolds},
	{"ReleaseSandboxOnce", testReleaseSandboxOnce},
	{"CorrectUse", testCorrectUse},
	{"ExpireHolds", testExpireHolds},
	{"ReserveCharged", testReserveCharged},
	{"ReserveChargedGroup", testReserveChargedGroup},
	{"ReleaseHold", testReleaseHold},
}

// holdReplicaCases need two Stores on one database.
var holdReplicaCases = []struct {
	name string
	fn   func(t *testing.T, a, b store.Store)
}{
	{"ReleaseSandboxRace", testReplicasReleaseRace},
	{"ReserveChargedRace", testReplicasReserveCharged},
	{"ReserveChargedGroupRace", testReplicasReserveChargedGroup},
}

// own is project's own use of r as Uses reads it, and the row's
// generation.
func own(t *testing.T, st store.Store, project string, r store.Resource) store.Use {
	t.Helper()
	us, err := st.Uses(t.Context(), []store.Resource{r})
	must(t, "Uses", err)
	for _, u := range us {
		if u.Project == project {
			return u
		}
	}
	t.Fatalf("Uses has no row of %q", project)
	return store.Use{}
}

// testQuotaHolds: a charge with holds; settled without release the use
// stays, with release it goes; a hold's ID is held once; settling an ID
// no longer held changes nothing.
func testQuotaHolds(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/a")
	limit(t, st, "ml", store.Sandboxes, 10)
	sb := store.Amounts{store.Sandboxes: 2, store.MemoryMB: 1024}
	must(t, "ChargeHeld", st.ChargeHeld(ctx, "ml/a", store.Amounts{store.Sandboxes: 2, store.MemoryMB: 1024, store.CreatesPerSecond: 2},
		[]store.Hold{{ID: "c1", Amounts: sb}}))
	if u := own(t, st, "ml/a", store.Sandboxes); u.Own != 2 || u.Held != 2 {
		t.Fatalf("after a held charge: %+v", u)
	}
	wantKind(t, "a hold held twice", st.ChargeHeld(ctx, "ml/a", store.Amounts{store.Sandboxes: 1}, []store.Hold{{ID: "c1", Amounts: store.Amounts{store.Sandboxes: 1}}}),
		errdefs.ErrAlreadyExists)
	if u := used(t, st, "ml", store.Sandboxes); u != 2 {
		t.Fatalf("a refused hold charged: use %d", u)
	}
	before := own(t, st, "ml/a", store.Sandboxes)
	must(t, "Settle kept", st.Settle(ctx, []string{"c1"}, false))
	u := own(t, st, "ml/a", store.Sandboxes)
	if u.Own != 2 || u.Held != 0 {
		t.Fatalf("after settling without release: %+v", u)
	}
	// A correction from a read before the settle (the sandboxes made after
	// the reconciler listed the edges, say) is refused.
	if ok, err := st.CorrectUse(ctx, before, 0); err != nil || ok {
		t.Fatalf("a correction across a settle: %v, %v", ok, err)
	}
	must(t, "ChargeHeld", st.ChargeHeld(ctx, "ml/a", sb, []store.Hold{{ID: "c2", Amounts: sb}}))
	must(t, "Settle released", st.Settle(ctx, []string{"c2", "never-held"}, true))
	must(t, "Settle again", st.Settle(ctx, []string{"c2"}, true))
	for p, want := range map[string]int64{"ml/a": 2, "ml": 2, "": 2} {
		if got := used(t, st, p, store.Sandboxes); got != want {
			t.Errorf("sandboxes of %q after a release settled twice: %d, want %d", p, got, want)
		}
		if got := used(t, st, p, store.MemoryMB); got != 1024 {
			t.Errorf("memory of %q after a release settled twice: %d, want 1024", p, got)
		}
	}
}

// testReleaseSandboxOnce: a sandbox's release gives back once.
func testReleaseSandboxOnce(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml")
	must(t, "Charge", st.Charge(ctx, "ml", store.Amounts{store.Sandboxes: 2}))
	for i, want := range []bool{true, false} {
		got, err := st.ReleaseSandbox(ctx, "ml", "sb-1", store.Amounts{store.Sandboxes: 1})
		must(t, "ReleaseSandbox", err)
		if got != want {
			t.Fatalf("release %d of sb-1: %v, want %v", i+1, got, want)
		}
	}
	if u := used(t, st, "ml", store.Sandboxes); u != 1 {
		t.Fatalf("use %d after releasing one of 2 sandboxes twice, want 1", u)
	}
}

// testCorrectUse: a correction holds only if the project's own use did not
// change since it was read; it counts the holds; a child's charge does not
// move its parent's generation.
func testCorrectUse(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/a")
	must(t, "Charge", st.Charge(ctx, "ml", store.Amounts{store.Sandboxes: 5}))
	read := own(t, st, "ml", store.Sandboxes)
	// A create charged between the read and the correction (its sandbox
	// not in the truth the reconciler listed): the correction must not
	// take it away.
	must(t, "Charge", st.Charge(ctx, "ml", store.Amounts{store.Sandboxes: 1}))
	ok, err := st.CorrectUse(ctx, read, 3)
	must(t, "CorrectUse", err)
	if ok || used(t, st, "ml", store.Sandboxes) != 6 {
		t.Fatalf("a correction across a charge: %v, use %d", ok, used(t, st, "ml", store.Sandboxes))
	}
	// A child's charge leaves ml's own use and generation as they were.
	read = own(t, st, "ml", store.Sandboxes)
	must(t, "Charge ml/a", st.ChargeHeld(ctx, "ml/a", store.Amounts{store.Sandboxes: 2}, []store.Hold{{ID: "a1", Amounts: store.Amounts{store.Sandboxes: 2}}}))
	if u := own(t, st, "ml", store.Sandboxes); u.Gen != read.Gen || u.Own != 6 {
		t.Fatalf("ml after its child's charge: %+v, was %+v", u, read)
	}
	ok, err = st.CorrectUse(ctx, read, 3)
	must(t, "CorrectUse", err)
	if !ok {
		t.Fatal("a correction with nothing between refused")
	}
	// ml/a's truth is 0 sandboxes listed, but its hold counts.
	a := own(t, st, "ml/a", store.Sandboxes)
	ok, err = st.CorrectUse(ctx, a, 0)
	must(t, "CorrectUse ml/a", err)
	for p, want := range map[string]int64{"ml/a": 2, "ml": 5, "": 5} {
		if got := used(t, st, p, store.Sandboxes); got != want || !ok {
			t.Errorf("use of %q after the corrections: %d (%v), want %d", p, got, ok, want)
		}
	}
	_, err = st.CorrectUse(ctx, store.Use{Project: "ml", Resource: store.CreatesPerSecond}, 1)
	wantKind(t, "CorrectUse of a rate", err, errdefs.ErrInvalidArgument)
}

// testExpireHolds: holds are released once they expire, those without an
// expiry of their own after store.DefaultHoldExpiry.
func testExpireHolds(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml")
	h := store.Amounts{store.Sandboxes: 1, store.VCPUs: 1000}
	now := time.Now()
	must(t, "ChargeHeld", st.ChargeHeld(ctx, "ml", h, []store.Hold{{ID: "soon", Amounts: h, Expires: now.Add(time.Minute)}}))
	must(t, "ChargeHeld", st.ChargeHeld(ctx, "ml", h, []store.Hold{{ID: "default", Amounts: h}}))
	n, err := st.ExpireHolds(ctx, now)
	must(t, "ExpireHolds", err)
	if n != 0 || used(t, st, "ml", store.Sandboxes) != 2 {
		t.Fatalf("a hold expired early: %d", n)
	}
	n, err = st.ExpireHolds(ctx, now.Add(2*time.Minute))
	must(t, "ExpireHolds", err)
	if n != 1 || used(t, st, "ml", store.Sandboxes) != 1 || own(t, st, "ml", store.Sandboxes).Held != 1 {
		t.Fatalf("expired %d holds a minute after the first's expiry, use %d", n, used(t, st, "ml", store.Sandboxes))
	}
	n, err = st.ExpireHolds(ctx, now.Add(store.DefaultHoldExpiry+time.Minute))
	must(t, "ExpireHolds", err)
	if n != 1 || used(t, st, "ml", store.Sandboxes) != 0 || used(t, st, "", store.VCPUs) != 0 || own(t, st, "ml", store.Sandboxes).Held != 0 {
		t.Fatalf("expired %d holds past the default expiry, use %d", n, used(t, st, "ml", store.Sandboxes))
	}
}

// testReserveCharged: a reservation with a charge charges in its own
// transaction: reserved and charged, a repeat charges nothing, a refusal
// reserves nothing; a fork's charge in parts settles a child at a time.
func testReserveCharged(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml")
	limit(t, st, "ml", store.Sandboxes, 3)
	charge := func(n int64) *store.QuotaCharge {
		a := store.Amounts{store.Sandboxes: n}
		return &store.QuotaCharge{Project: "ml", Amounts: a, Held: a}
	}
	got, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k1", RequestHash: "h", Owner: "a", Charge: charge(2)})
	must(t, "ReserveCreate", err)
	if !reserved || used(t, st, "ml", store.Sandboxes) != 2 || own(t, st, "ml", store.Sandboxes).Held != 2 {
		t.Fatalf("reserved %v, use %d", reserved, used(t, st, "ml", store.Sandboxes))
	}
	if _, again, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k1", RequestHash: "h", Owner: "b", Charge: charge(2)}); err != nil || again {
		t.Fatalf("a repeat: reserved %v, %v", again, err)
	}
	if u := used(t, st, "ml", store.Sandboxes); u != 2 {
		t.Fatalf("a repeat of a reserved key charged: use %d", u)
	}
	_, _, err = st.ReserveCreate(ctx, store.CreateReservation{Key: "k2", RequestHash: "h", Owner: "a", Charge: charge(2)})
	wantMessage(t, "a reservation over the quota", err, errdefs.ErrResourceExhausted, "quota of project ml: 2 of 3 sandboxes in use, 2 asked")
	// The quota's words are the whole message: a trainer's user reads them
	// as they are, not behind the store's account of its statement.
	if !strings.HasPrefix(err.Error(), "quota of project ml: ") {
		t.Errorf("a reservation over the quota: %q does not start with the quota's words", err)
	}
	if _, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k2", RequestHash: "h", Owner: "a"}); err != nil || !reserved {
		t.Fatalf("k2 after its refused reservation: reserved %v, %v (the refusal reserved it)", reserved, err)
	}
	must(t, "Settle", st.Settle(ctx, []string{store.ReservationHold("k1", got.Nonce)}, true))
	if u := used(t, st, "ml", store.Sandboxes); u != 0 {
		t.Fatalf("use %d after the reservation's hold was released", u)
	}
	// A fork's children: one hold per child, settled one by one.
	two := store.Amounts{store.Sandboxes: 2}
	got, reserved, err = st.ReserveCreate(ctx, store.CreateReservation{Key: "fork:f1", RequestHash: "h", Owner: "a",
		Charge: &store.QuotaCharge{Project: "ml", Amounts: two, Held: two, Parts: 2}})
	if err != nil || !reserved || used(t, st, "ml", store.Sandboxes) != 2 || own(t, st, "ml", store.Sandboxes).Held != 2 {
		t.Fatalf("a fork of 2: reserved %v, use %d, %v", reserved, used(t, st, "ml", store.Sandboxes), err)
	}
	must(t, "Settle", st.Settle(ctx, []string{store.ReservationPart("fork:f1", got.Nonce, 1)}, true))
	must(t, "Settle", st.Settle(ctx, []string{store.ReservationPart("fork:f1", got.Nonce, 0)}, false))
	if u, h := used(t, st, "ml", store.Sandboxes), own(t, st, "ml", store.Sandboxes).Held; u != 1 || h != 0 {
		t.Fatalf("use %d, held %d after a child refused and one made: want 1 and 0", u, h)
	}
}

// testReplicasReleaseRace: two deletes of each of 50 sandboxes race
// through two Stores: each sandbox is given back once.
func testReplicasReleaseRace(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	mkProjects(t, a, "team")
	must(t, "Charge", a.Charge(ctx, "team", store.Amounts{store.Sandboxes: 60}))
	var wg sync.WaitGroup
	var released atomic.Int64
	for i := range 50 {
		for _, st := range []store.Store{a, b} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ok, err := st.ReleaseSandbox(ctx, "team", fmt.Sprintf("sb-%d", i), store.Amounts{store.Sandboxes: 1})
				if err != nil {
					t.Error(err)
				}
				if ok {
					released.Add(1)
				}
			}()
		}
	}
	wg.Wait()
	if n, u := released.Load(), used(t, a, "team", store.Sandboxes); n != 50 || u != 10 {
		t.Fatalf("%d releases of 50 sandboxes, use %d: want 50 and 10", n, u)
	}
}

// testReplicasReserveCharged: 400 keyed reservations with charges race for
// a quota of 100 through two Stores: exactly 100 are reserved (and
// charged), the others refused by name and not reserved.
func testReplicasReserveCharged(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	mkProjects(t, a, "team")
	limit(t, a, "team", store.Sandboxes, 100)
	var wg sync.WaitGroup
	var mu sync.Mutex
	ok, refused := 0, 0
	var other []error
	for i := range 400 {
		st := a
		if i%2 == 1 {
			st = b
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			one := store.Amounts{store.Sandboxes: 1}
			_, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: fmt.Sprint("key-", i), RequestHash: "h", Owner: "x",
				Charge: &store.QuotaCharge{Project: "team", Amounts: one, Held: one}})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && reserved:
				ok++
			case errors.Is(err, errdefs.ErrResourceExhausted) && strings.Contains(err.Error(), "quota of project team: 100 of 100 sandboxes in use"):
				refused++
			default:
				other = append(other, fmt.Errorf("reserved %v: %w", reserved, err))
			}
		}()
	}
	wg.Wait()
	if len(other) > 0 {
		t.Fatalf("%d reservations failed otherwise, first: %v", len(other), other[0])
	}
	if ok != 100 || refused != 300 || used(t, b, "team", store.Sandboxes) != 100 {
		t.Fatalf("%d reserved, %d refused, use %d; want 100, 300, 100", ok, refused, used(t, b, "team", store.Sandboxes))
	}
}

// testReserveChargedGroup: one transaction reserves the keys no
// reservation holds and charges them with an unkeyed charge; a key held
// already (before, or twice in the group) is not reserved nor charged; a
// group past the limit reserves and charges nothing.
func testReserveChargedGroup(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml")
	limit(t, st, "ml", store.Sandboxes, 4)
	one := store.Amounts{store.Sandboxes: 1}
	keyed := func(key string) store.CreateReservation {
		return store.CreateReservation{Key: key, RequestHash: "h", Owner: "a", Charge: &store.QuotaCharge{Project: "ml", Amounts: one, Held: one}}
	}
	_, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k0", RequestHash: "h", Owner: "a"})
	if err != nil || !reserved {
		t.Fatalf("ReserveCreate k0: reserved %v, %v", reserved, err)
	}
	got, made, err := st.ReserveCharged(ctx, "ml", one, []store.Hold{{ID: "u1", Amounts: one}},
		[]store.CreateReservation{keyed("k2"), keyed("k1"), keyed("k1"), keyed("k0")})
	must(t, "ReserveCharged", err)
	if want := []bool{true, true, false, false}; fmt.Sprint(made) != fmt.Sprint(want) {
		t.Fatalf("reserved %v, want %v", made, want)
	}
	if u, h := used(t, st, "ml", store.Sandboxes), own(t, st, "ml", store.Sandboxes).Held; u != 3 || h != 3 {
		t.Fatalf("use %d, held %d after a group of one unkeyed and two new keys: want 3 and 3", u, h)
	}
	if r, _, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k1", RequestHash: "h", Owner: "b"}); err != nil || r.Nonce != got[1].Nonce {
		t.Fatalf("k1's reservation: nonce %q, want the group's %q: %v", r.Nonce, got[1].Nonce, err)
	}
	_, _, err = st.ReserveCharged(ctx, "ml", one, []store.Hold{{ID: "u2", Amounts: one}}, []store.CreateReservation{keyed("k3")})
	wantMessage(t, "a group over the quota", err, errdefs.ErrResourceExhausted, "quota of project ml: 3 of 4 sandboxes in use, 2 asked")
	if _, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k3", RequestHash: "h", Owner: "a"}); err != nil || !reserved {
		t.Fatalf("k3 after its refused group: reserved %v, %v (the refusal reserved it)", reserved, err)
	}
	must(t, "Settle", st.Settle(ctx, []string{"u1", store.ReservationHold("k1", got[1].Nonce)}, true))
	must(t, "Settle", st.Settle(ctx, []string{store.ReservationHold("k2", got[0].Nonce)}, false))
	if u, h := used(t, st, "ml", store.Sandboxes), own(t, st, "ml", store.Sandboxes).Held; u != 1 || h != 0 {
		t.Fatalf("use %d, held %d after two holds released and one kept: want 1 and 0", u, h)
	}
}

// testReplicasReserveChargedGroup: groups of keyed reservations drawn
// from one set of 60 keys, each in its own order, race through two
// Stores: every key is reserved (and charged) exactly once, and no two
// groups deadlock.
func testReplicasReserveChargedGroup(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	mkProjects(t, a, "team")
	limit(t, a, "team", store.Sandboxes, 1000)
	one := store.Amounts{store.Sandboxes: 1}
	var wg sync.WaitGroup
	var reservedN atomic.Int64
	for i := range 40 {
		st := a
		if i%2 == 1 {
			st = b
		}
		var rs []store.CreateReservation
		for j := range 15 {
			k := (i*7 + j*(1+i%5)) % 60
			rs = append(rs, store.CreateReservation{Key: fmt.Sprint("key-", k), RequestHash: "h", Owner: "x",
				Charge: &store.QuotaCharge{Project: "team", Amounts: one, Held: one}})
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, made, err := st.ReserveCharged(ctx, "team", nil, nil, rs)
			if err != nil {
				t.Error(err)
			}
			for _, m := range made {
				if m {
					reservedN.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	var keys int64
	for k := range 60 {
		if _, reserved, err := a.ReserveCreate(ctx, store.CreateReservation{Key: fmt.Sprint("key-", k), RequestHash: "h", Owner: "y"}); err != nil {
			t.Fatal(err)
		} else if !reserved {
			keys++
		}
	}
	if n, u := reservedN.Load(), used(t, b, "team", store.Sandboxes); n != keys || u != keys {
		t.Fatalf("%d reserved by the groups, use %d, %d keys held: want them equal", n, u, keys)
	}
}

// testReleaseHold: a delete's hold counts the sandbox as held, charging
// nothing, so a correction read before it is refused; the release gives
// the sandbox back once and ends the hold, a second delete's too; one
// that expires just goes.
func testReleaseHold(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml")
	limit(t, st, "ml", store.Sandboxes, 10)
	one := store.Amounts{store.Sandboxes: 1}
	must(t, "Charge", st.Charge(ctx, "ml", store.Amounts{store.Sandboxes: 2}))
	before := own(t, st, "ml", store.Sandboxes)
	must(t, "HoldRelease", st.HoldRelease(ctx, "ml", "sb1", one, time.Now().Add(time.Minute)))
	if u, h := used(t, st, "ml", store.Sandboxes), own(t, st, "ml", store.Sandboxes).Held; u != 2 || h != 1 {
		t.Fatalf("use %d, held %d with a release under way: want 2 and 1", u, h)
	}
	if ok, err := st.CorrectUse(ctx, before, 1); err != nil || ok {
		t.Fatalf("a correction read before the release's hold: %v, %v; want refused", ok, err)
	}
	for i := range 2 { // two deletes, one after the other
		must(t, "HoldRelease", st.HoldRelease(ctx, "ml", "sb1", one, time.Now().Add(time.Minute)))
		released, err := st.ReleaseSandbox(ctx, "ml", "sb1", one)
		must(t, "ReleaseSandbox", err)
		if released != (i == 0) {
			t.Fatalf("release %d: released %v", i+1, released)
		}
		if u, h := used(t, st, "ml", store.Sandboxes), own(t, st, "ml", store.Sandboxes).Held; u != 1 || h != 0 {
			t.Fatalf("use %d, held %d after release %d: want 1 and 0", u, h, i+1)
		}
	}
	must(t, "HoldRelease", st.HoldRelease(ctx, "ml", "sb2", one, time.Now().Add(-time.Second)))
	if _, err := st.ExpireHolds(ctx, time.Now()); err != nil {
		t.Fatal(err)
	}
	if u, h := used(t, st, "ml", store.Sandboxes), own(t, st, "ml", store.Sandboxes).Held; u != 1 || h != 0 {
		t.Fatalf("use %d, held %d after a delete's hold expired: want 1 (nothing given back) and 0", u, h)
	}
}
