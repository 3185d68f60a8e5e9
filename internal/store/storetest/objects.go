package storetest

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

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
	change, err := st.SetObjectBlobs(ctx, "env:1", "", []store.Blob{{Digest: "sha256:a", Bytes: 4096}})
	must(t, "SetObjectBlobs", err)
	if change != 4096 {
		t.Fatalf("change %d, want 4096", change)
	}
	if change, err = st.SetObjectBlobs(ctx, "env:1", "", []store.Blob{{Digest: "sha256:b", Bytes: 100}}); err != nil || change != -3996 {
		t.Fatalf("SetObjectBlobs again: change %d, %v; want -3996", change, err)
	}
	if _, err := st.SetObjectBlobs(ctx, "nope:1", "", nil); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("SetObjectBlobs of an unknown name: %v", err)
	}
	if _, err := st.SetObjectBlobs(ctx, "env:1", "", []store.Blob{{Digest: "sha256:b", Bytes: 1}, {Digest: "sha256:b", Bytes: 1}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("SetObjectBlobs with a blob twice: %v", err)
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
	if got.Bytes != 100 || !slices.Equal(got.SharedWith, []string{"run", "run/sub"}) || !slices.Equal(got.Blobs, []store.Blob{{Digest: "sha256:b", Bytes: 100}}) {
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
	gone, release, err := st.DeleteObject(ctx, "env:1")
	must(t, "DeleteObject", err)
	if gone.Bytes != 100 || gone.Project != "build" || release != 100 {
		t.Fatalf("deleted %+v, release %d", gone, release)
	}
	if _, err := st.Object(ctx, "env:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Object after delete: %v", err)
	}
	if _, _, err := st.DeleteObject(ctx, "env:1"); !errors.Is(err, errdefs.ErrNotFound) {
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

// testObjectWriters: a name has one writer at a time. A claim records
// its writer; another's take is refused (FailedPrecondition) while the
// claim is live, the record unchanged; a lapsed claim (its call died) is
// taken over, and the lapsed writer's SetObjectBlobs is then refused and
// changes nothing, while the new writer's records and charges; a release
// by a writer that lost the name leaves it alone, the writer's own ends
// its claim, and a release with forget removes the record and gives its
// bytes back.
func testObjectWriters(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "build")
	live, lapsed := time.Now().Add(time.Hour), time.Now().Add(-time.Second)
	o, claimed, err := st.ClaimObject(ctx, store.Object{Name: "env:1", Kind: store.ObjectLayer, Project: "build", Writer: "a", WriterUntil: live})
	if err != nil || !claimed || o.Writer != "a" {
		t.Fatalf("ClaimObject by a: %+v, %v, %v", o, claimed, err)
	}
	got, _, err := st.ClaimObject(ctx, store.Object{Name: "env:1", Kind: store.ObjectLayer, Project: "build", Writer: "b", WriterUntil: live})
	if err != nil || got.Writer != "a" || !got.WriterUntil.Equal(live.Truncate(time.Millisecond)) {
		t.Fatalf("ClaimObject by b: %+v, %v; want a's record, writer a until %s", got, err, live)
	}
	got, err = st.TakeObject(ctx, "env:1", "b", live)
	wantKind(t, "TakeObject by b while a's claim is live", err, errdefs.ErrFailedPrecondition)
	if got.Writer != "a" {
		t.Fatalf("the record a refused take returns: %+v; want writer a", got)
	}
	_, err = st.TakeObject(ctx, "env:1", "a", live.Add(time.Hour))
	must(t, "TakeObject by a again (renewed)", err)
	_, err = st.SetObjectBlobs(ctx, "env:1", "b", []store.Blob{{Digest: "sha256:b", Bytes: 7}})
	wantKind(t, "SetObjectBlobs by b, not the writer", err, errdefs.ErrFailedPrecondition)
	_, err = st.SetObjectBlobs(ctx, "env:1", "a", []store.Blob{{Digest: "sha256:a", Bytes: 100}})
	must(t, "SetObjectBlobs by a", err)
	must(t, "ReleaseObject by a", st.ReleaseObject(ctx, "env:1", "a", false))
	if o, err := st.Object(ctx, "env:1"); err != nil || o.Writer != "" || len(o.Blobs) != 1 {
		t.Fatalf("env:1 released: %+v, %v; want no writer, one blob", o, err)
	}

	// c takes it to make it again and dies: its claim lapses.
	_, err = st.TakeObject(ctx, "env:1", "c", lapsed)
	must(t, "TakeObject by c", err)
	before, err := st.TakeObject(ctx, "env:1", "d", live)
	must(t, "TakeObject by d once c's claim lapsed", err)
	if before.Writer != "c" || len(before.Blobs) != 1 || before.Blobs[0].Digest != "sha256:a" {
		t.Fatalf("the record d took over: %+v; want writer c, blob sha256:a", before)
	}
	_, err = st.SetObjectBlobs(ctx, "env:1", "c", []store.Blob{{Digest: "sha256:c", Bytes: 1}})
	wantKind(t, "SetObjectBlobs by c, whose claim lapsed", err, errdefs.ErrFailedPrecondition)
	must(t, "ReleaseObject by c, whose claim lapsed", st.ReleaseObject(ctx, "env:1", "c", true))
	wantUse(t, st, "build", store.LayerBytes, 100)
	_, err = st.SetObjectBlobs(ctx, "env:1", "d", []store.Blob{{Digest: "sha256:d", Bytes: 30}})
	must(t, "SetObjectBlobs by d", err)
	wantUse(t, st, "build", store.LayerBytes, 30)
	must(t, "ReleaseObject by d, forgetting it", st.ReleaseObject(ctx, "env:1", "d", true))
	if _, err := st.Object(ctx, "env:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("env:1 released with forget: %v; want NotFound", err)
	}
	wantUse(t, st, "build", store.LayerBytes, 0)
	_, err = st.TakeObject(ctx, "env:1", "e", live)
	wantKind(t, "TakeObject of an unknown name", err, errdefs.ErrNotFound)
	must(t, "ReleaseObject of an unknown name", st.ReleaseObject(ctx, "env:1", "e", false))
}

// testObjectSweep: the records a call claimed and never filled, its claim
// lapsed before the cutoff, are listed and swept; a live claim, a record
// with blobs, a pool, a record with no writer and one that lapsed after
// the cutoff (a slow call inside the margin) are neither. A record taken
// over between the listing and the sweep is kept.
func testObjectSweep(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "build")
	now := time.Now()
	cutoff := now.Add(-time.Hour)
	dead, inMargin, live := cutoff.Add(-time.Minute), cutoff.Add(time.Minute), now.Add(time.Hour)
	claim := func(name, kind, writer string, until time.Time) {
		t.Helper()
		if _, claimed, err := st.ClaimObject(ctx, store.Object{Name: name, Kind: kind, Project: "build", Writer: writer, WriterUntil: until}); err != nil || !claimed {
			t.Fatalf("ClaimObject %s: %v, %v", name, claimed, err)
		}
	}
	claim("env:dead", store.ObjectLayer, "w1", dead)
	claim("py:dead", store.ObjectImage, "w2", dead)
	claim("snap:dead", store.ObjectSnapshot, "w3", dead)
	claim("env:live", store.ObjectLayer, "w4", live)
	claim("env:margin", store.ObjectLayer, "w5", inMargin)
	claim("pool:dead", store.ObjectPool, "w6", dead)
	claim("env:nowriter", store.ObjectLayer, "", time.Time{})
	claim("env:full", store.ObjectLayer, "w7", live)
	_, err := st.SetObjectBlobs(ctx, "env:full", "w7", []store.Blob{{Digest: "sha256:f", Bytes: 10}})
	must(t, "SetObjectBlobs env:full", err)
	_, err = st.TakeObject(ctx, "env:full", "w7", dead)
	must(t, "TakeObject env:full (its claim lapsed)", err)
	claim("env:taken", store.ObjectLayer, "w8", dead)

	got, err := st.LapsedObjects(ctx, cutoff)
	must(t, "LapsedObjects", err)
	var names []string
	for _, o := range got {
		names = append(names, o.Name)
	}
	want := []string{"env:dead", "env:taken", "py:dead", "snap:dead"}
	if !slices.Equal(names, want) {
		t.Fatalf("LapsedObjects: %v, want %v", names, want)
	}
	if o := got[0]; o.Kind != store.ObjectLayer || o.Project != "build" || o.Writer != "w1" || !o.WriterUntil.Equal(dead.Truncate(time.Millisecond)) {
		t.Errorf("LapsedObjects' env:dead: %+v", o)
	}

	// A call takes env:taken over between the listing and the sweep.
	_, err = st.TakeObject(ctx, "env:taken", "w9", live)
	must(t, "TakeObject env:taken", err)
	for _, name := range append(want, "env:live", "env:margin", "pool:dead", "env:nowriter", "env:full", "env:unknown") {
		swept, err := st.SweepObject(ctx, name, cutoff)
		must(t, "SweepObject "+name, err)
		wantSwept := name == "env:dead" || name == "py:dead" || name == "snap:dead"
		if swept != wantSwept {
			t.Errorf("SweepObject %s: swept %v, want %v", name, swept, wantSwept)
		}
		_, err = st.Object(ctx, name)
		if gone := errors.Is(err, errdefs.ErrNotFound); gone != (wantSwept || name == "env:unknown") {
			t.Errorf("%s after the sweep: %v", name, err)
		}
	}
	if got, err := st.LapsedObjects(ctx, cutoff); err != nil || len(got) != 0 {
		t.Errorf("LapsedObjects after the sweep: %+v, %v; want none", got, err)
	}
	wantUse(t, st, "build", store.LayerBytes, 10)
	// The name swept is free: a new call claims it anew.
	claim("env:dead", store.ObjectLayer, "w10", live)
}

// testReplicasObjectTakeRace: 16 calls taking one name at once through
// two stores (two apiservers making a layer again): exactly one is its
// writer.
func testReplicasObjectTakeRace(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	mkProjects(t, a, "team")
	if _, _, err := a.ClaimObject(ctx, store.Object{Name: "env:1", Kind: store.ObjectLayer, Project: "team"}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var taken []string
	var other []error
	for i := range 16 {
		st := a
		if i%2 == 1 {
			st = b
		}
		writer := fmt.Sprintf("w%d", i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := st.TakeObject(ctx, "env:1", writer, time.Now().Add(time.Hour))
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				taken = append(taken, writer)
			case !errors.Is(err, errdefs.ErrFailedPrecondition):
				other = append(other, err)
			}
		}()
	}
	wg.Wait()
	if len(taken) != 1 || len(other) > 0 {
		t.Fatalf("taken by %v, other errors %v; want one writer", taken, other)
	}
	if o, err := b.Object(ctx, "env:1"); err != nil || o.Writer != taken[0] {
		t.Fatalf("env:1's writer: %+v, %v; want %s", o, err, taken[0])
	}
}

// testObjectBlobs: a project is charged each blob once, however many of
// its objects hold it: two images on one base layer pay for the base
// once, and removing one gives back only what the other does not hold.
// Another project holding the same blob pays for it itself; a snapshot's
// blob is charged apart from layers'.
func testObjectBlobs(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "build", "other")
	base := store.Blob{Digest: "sha256:base", Bytes: 1000}
	set := func(name, kind, project string, want int64, blobs ...store.Blob) {
		t.Helper()
		if _, _, err := st.ClaimObject(ctx, store.Object{Name: name, Kind: kind, Project: project}); err != nil {
			t.Fatalf("claim %s: %v", name, err)
		}
		change, err := st.SetObjectBlobs(ctx, name, "", blobs)
		if err != nil || change != want {
			t.Fatalf("SetObjectBlobs %s: change %d, %v; want %d", name, change, err, want)
		}
	}
	set("img:1", store.ObjectImage, "build", 1100, base, store.Blob{Digest: "sha256:one", Bytes: 100})
	set("img:2", store.ObjectImage, "build", 200, base, store.Blob{Digest: "sha256:two", Bytes: 200})
	set("base:1", store.ObjectLayer, "build", 0, base)
	set("img:3", store.ObjectImage, "other", 1000, base)
	set("snap:a", store.ObjectSnapshot, "build", 1000, base)
	// Overwriting img:2 with a blob of its own frees nothing img:1 holds.
	set("img:2", store.ObjectImage, "build", 300, store.Blob{Digest: "sha256:two", Bytes: 500})
	// Charged in the same transaction: build holds base, one, two (1600
	// bytes) and the snapshot apart; other the base.
	wantUse(t, st, "build", store.LayerBytes, 1600)
	wantUse(t, st, "build", store.SnapshotBytes, 1000)
	wantUse(t, st, "other", store.LayerBytes, 1000)
	wantUse(t, st, "", store.LayerBytes, 2600)
	// Past a limit: refused in Charge's words, nothing changed.
	limit(t, st, "build", store.LayerBytes, 2000)
	_, err := st.SetObjectBlobs(ctx, "img:2", "", []store.Blob{base, {Digest: "sha256:big", Bytes: 1000}})
	wantMessage(t, "SetObjectBlobs past the limit", err, errdefs.ErrResourceExhausted, "quota of project build: 1600 of 2000 bytes of layers in use")
	if o, err := st.Object(ctx, "img:2"); err != nil || !slices.Equal(o.Blobs, []store.Blob{{Digest: "sha256:two", Bytes: 500}}) || o.Bytes != 500 {
		t.Fatalf("img:2 after a refused charge: %+v, %v; want its one blob of 500 bytes", o, err)
	}
	wantUse(t, st, "build", store.LayerBytes, 1600)
	for _, c := range []struct {
		name string
		want int64
	}{
		{"img:1", 100},   // base is held by base:1 still
		{"base:1", 1000}, // the last holder of base in build's layers
		{"img:2", 500},
		{"img:3", 1000},
		{"snap:a", 1000},
	} {
		_, release, err := st.DeleteObject(ctx, c.name)
		if err != nil || release != c.want {
			t.Fatalf("DeleteObject %s: release %d, %v; want %d", c.name, release, err, c.want)
		}
	}
	wantUse(t, st, "", store.LayerBytes, 0)
	wantUse(t, st, "", store.SnapshotBytes, 0)
}

// testReplicasObjectBlobsRace: 32 objects of one project, each holding a
// blob they share and one of its own, are recorded at once through two
// stores under a limit that holds the shared blob and 8 of their own:
// exactly 8 are charged, the shared blob once, and the use is 0 once they
// are deleted.
func testReplicasObjectBlobsRace(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	mkProjects(t, a, "team")
	limit(t, a, "team", store.LayerBytes, 1000+8*10)
	shared := store.Blob{Digest: "sha256:shared", Bytes: 1000}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var charged []string
	refused := 0
	var other []error
	for i := range 32 {
		st := a
		if i%2 == 1 {
			st = b
		}
		name := fmt.Sprintf("race-%d:1", i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, _, err := st.ClaimObject(ctx, store.Object{Name: name, Kind: store.ObjectImage, Project: "team"}); err != nil {
				mu.Lock()
				other = append(other, err)
				mu.Unlock()
				return
			}
			_, err := st.SetObjectBlobs(ctx, name, "", []store.Blob{shared, {Digest: "sha256:own-" + name, Bytes: 10}})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				charged = append(charged, name)
			case errors.Is(err, errdefs.ErrResourceExhausted):
				refused++
			default:
				other = append(other, err)
			}
		}()
	}
	wg.Wait()
	if len(other) > 0 || len(charged) != 8 || refused != 24 {
		t.Fatalf("%d charged, %d refused, other errors %v; want 8 and 24", len(charged), refused, other)
	}
	wantUse(t, a, "team", store.LayerBytes, 1080)
	for i, name := range charged {
		st := a
		if i%2 == 1 {
			st = b
		}
		if _, _, err := st.DeleteObject(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	wantUse(t, b, "team", store.LayerBytes, 0)
}

// testDeleteProjectObjects: a project that owns layers, images or
// snapshots is not deleted, and the refusal names them; handed to the
// parent, they go there with their shares and their bytes' charge (a blob
// the parent holds too charged once); shares with a deleted project go
// with it, so a project made again at its path sees none of them.
func testDeleteProjectObjects(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/run", "ml/run/sub", "eval")
	claim := func(name, kind, project string, blobs ...store.Blob) {
		t.Helper()
		if _, _, err := st.ClaimObject(ctx, store.Object{Name: name, Kind: kind, Project: project}); err != nil {
			t.Fatalf("claim %s: %v", name, err)
		}
		_, err := st.SetObjectBlobs(ctx, name, "", blobs)
		must(t, "SetObjectBlobs "+name, err)
	}
	base := store.Blob{Digest: "sha256:base", Bytes: 1000}
	claim("base:1", store.ObjectLayer, "ml", base)
	claim("env:1", store.ObjectImage, "ml/run", base, store.Blob{Digest: "sha256:env", Bytes: 200})
	claim("snap:a", store.ObjectSnapshot, "ml/run", store.Blob{Digest: "sha256:snap", Bytes: 50})
	claim("theirs:1", store.ObjectLayer, "eval", store.Blob{Digest: "sha256:theirs", Bytes: 10})
	must(t, "ShareObject with ml/run", st.ShareObject(ctx, "theirs:1", "ml/run"))
	must(t, "ShareObject snap:a with eval", st.ShareObject(ctx, "snap:a", "eval"))
	must(t, "DeleteProject ml/run/sub", st.DeleteProject(ctx, admin(), "ml/run/sub", store.DeleteProjectOptions{}))

	wantMessage(t, "DeleteProject owning objects", st.DeleteProject(ctx, admin(), "ml/run", store.DeleteProjectOptions{}),
		errdefs.ErrFailedPrecondition, "1 image (env:1), 1 snapshot (snap:a)")
	// Never to the root: every project sees the root's objects.
	wantMessage(t, "DeleteProject handing objects to the root", st.DeleteProject(ctx, admin(), "eval", store.DeleteProjectOptions{ObjectsToParent: true}),
		errdefs.ErrFailedPrecondition, "its parent is the root")
	if o, err := st.Object(ctx, "theirs:1"); err != nil || o.Project != "eval" {
		t.Fatalf("theirs:1 after a refused delete: %+v, %v", o, err)
	}
	if o, err := st.Object(ctx, "env:1"); err != nil || o.Project != "ml/run" {
		t.Fatalf("env:1 after a refused delete: %+v, %v", o, err)
	}
	must(t, "DeleteProject handing objects to the parent",
		st.DeleteProject(ctx, admin(), "ml/run", store.DeleteProjectOptions{ObjectsToParent: true}))
	for _, name := range []string{"env:1", "snap:a"} {
		o, err := st.Object(ctx, name)
		if err != nil || o.Project != "ml" {
			t.Fatalf("%s after its project's delete: %+v, %v; want it in ml", name, o, err)
		}
	}
	if o, _ := st.Object(ctx, "snap:a"); !slices.Equal(o.SharedWith, []string{"eval"}) {
		t.Fatalf("snap:a's shares: %v, want eval's kept", o.SharedWith)
	}
	if o, _ := st.Object(ctx, "theirs:1"); o.SharedWith != nil {
		t.Fatalf("theirs:1 still shared with %v after ml/run's delete", o.SharedWith)
	}
	// ml holds base once (base:1 and env:1), env's and the snapshot's.
	wantUse(t, st, "ml", store.LayerBytes, 1200)
	wantUse(t, st, "ml", store.SnapshotBytes, 50)
	wantUse(t, st, "", store.LayerBytes, 1210)
	// Given back from ml exactly: env:1's own blob, then base with base:1.
	for _, c := range []struct {
		name string
		want int64
	}{{"env:1", 200}, {"base:1", 1000}, {"snap:a", 50}} {
		_, release, err := st.DeleteObject(ctx, c.name)
		if err != nil || release != c.want {
			t.Fatalf("DeleteObject %s: release %d, %v; want %d", c.name, release, err, c.want)
		}
	}
	wantUse(t, st, "ml", store.LayerBytes, 0)
	wantUse(t, st, "ml", store.SnapshotBytes, 0)
	// A project made again at the path has none of the old shares.
	mkProjects(t, st, "ml/run")
	if o, _ := st.Object(ctx, "theirs:1"); o.SharedWith != nil {
		t.Fatalf("theirs:1 shared with %v, want no one", o.SharedWith)
	}
}

// wantUse checks a project's use of a resource.
func wantUse(t *testing.T, st store.Store, project string, r store.Resource, want int64) {
	t.Helper()
	qs, err := st.Quota(t.Context(), project)
	must(t, "Quota "+project, err)
	for _, q := range qs {
		if q.Project == project {
			if got := q.Used[r]; got != want {
				t.Fatalf("project %q uses %d %s, want %d", project, got, r, want)
			}
			return
		}
	}
	t.Fatalf("project %q: not in its quota %+v", project, qs)
}
