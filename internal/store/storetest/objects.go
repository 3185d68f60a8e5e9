package storetest

import (
	"errors"
	"slices"
	"sync"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

// testObjects: a name is claimed once, by one project; its bytes, shares
// and deletion round-trip; shares name existing projects only.
func testObjects(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "build", "run", "run/sub")
	o, claimed, err := st.ClaimObject(ctx, store.Object{Name: "env:1", Kind: store.ObjectLayer, Project: "/build"})
	must(t, "ClaimObject", err)
	if !claimed || o.Project != "build" || o.Kind != store.ObjectLayer || o.Created.IsZero() {
		t.Fatalf("claim: %+v claimed %v", o, claimed)
	}
	again, claimed, err := st.ClaimObject(ctx, store.Object{Name: "env:1", Kind: store.ObjectLayer, Project: "run"})
	must(t, "ClaimObject again", err)
	if claimed || again.Project != "build" {
		t.Fatalf("second claim by another project: %+v claimed %v; want build's, not claimed", again, claimed)
	}
	if _, _, err := st.ClaimObject(ctx, store.Object{Name: "x", Kind: "table", Project: "run"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("claim of an unknown kind: %v", err)
	}
	old, err := st.SetObjectBytes(ctx, "env:1", 4096)
	must(t, "SetObjectBytes", err)
	if old != 0 {
		t.Fatalf("old bytes %d, want 0", old)
	}
	if old, err = st.SetObjectBytes(ctx, "env:1", 100); err != nil || old != 4096 {
		t.Fatalf("SetObjectBytes again: old %d, %v; want 4096", old, err)
	}
	if _, err := st.SetObjectBytes(ctx, "nope:1", 1); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("SetObjectBytes of an unknown name: %v", err)
	}
	must(t, "ShareObject", st.ShareObject(ctx, "env:1", "run"))
	must(t, "ShareObject again", st.ShareObject(ctx, "env:1", "/run"))
	must(t, "ShareObject sub", st.ShareObject(ctx, "env:1", "run/sub"))
	if err := st.ShareObject(ctx, "env:1", "nowhere"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("share with a project that does not exist: %v", err)
	}
	if err := st.ShareObject(ctx, "nope:1", "run"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("share of an unknown name: %v", err)
	}
	got, err := st.Object(ctx, "env:1")
	must(t, "Object", err)
	if got.Bytes != 100 || !slices.Equal(got.SharedWith, []string{"run", "run/sub"}) {
		t.Fatalf("object %+v; want 100 bytes, shared with run and run/sub", got)
	}
	must(t, "UnshareObject", st.UnshareObject(ctx, "env:1", "run/sub"))
	must(t, "UnshareObject again", st.UnshareObject(ctx, "env:1", "run/sub"))
	_, _, err = st.ClaimObject(ctx, store.Object{Name: "snap:a", Kind: store.ObjectSnapshot, Project: "run"})
	must(t, "ClaimObject snap:a", err)
	all, err := st.ListObjects(ctx)
	must(t, "ListObjects", err)
	if len(all) != 2 || all[0].Name != "env:1" || !slices.Equal(all[0].SharedWith, []string{"run"}) || all[1].Name != "snap:a" || all[1].SharedWith != nil {
		t.Fatalf("ListObjects: %+v", all)
	}
	gone, err := st.DeleteObject(ctx, "env:1")
	must(t, "DeleteObject", err)
	if gone.Bytes != 100 || gone.Project != "build" {
		t.Fatalf("deleted %+v", gone)
	}
	if _, err := st.Object(ctx, "env:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Object after delete: %v", err)
	}
	if _, err := st.DeleteObject(ctx, "env:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("DeleteObject again: %v", err)
	}
	// The name is free again, and its old shares are gone with it.
	o, claimed, err = st.ClaimObject(ctx, store.Object{Name: "env:1", Kind: store.ObjectImage, Project: "run"})
	if err != nil || !claimed || o.SharedWith != nil {
		t.Fatalf("claim after delete: %+v %v %v", o, claimed, err)
	}
}

// testObjectClaimRace: of 16 projects claiming one name at once, one wins
// and every other is told the winner.
func testObjectClaimRace(t *testing.T, st store.Store) {
	ctx := t.Context()
	names := []string{"p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8", "p9", "p10", "p11", "p12", "p13", "p14", "p15"}
	mkProjects(t, st, names...)
	var mu sync.Mutex
	winners := 0
	owners := map[string]bool{}
	var wg sync.WaitGroup
	for _, p := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o, claimed, err := st.ClaimObject(ctx, store.Object{Name: "race:1", Kind: store.ObjectLayer, Project: p})
			if err != nil {
				t.Errorf("ClaimObject by %s: %v", p, err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			owners[o.Project] = true
			if claimed {
				winners++
			}
		}()
	}
	wg.Wait()
	if winners != 1 || len(owners) != 1 {
		t.Fatalf("%d claims won, owners seen %v; want one", winners, owners)
	}
}
