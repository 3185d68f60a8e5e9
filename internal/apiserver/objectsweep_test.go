package apiserver

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

// TestSweepObjects: the sweep removes the record a call that died claimed
// anew and never filled, its claim lapsed past objectSweepAfter, with the
// staging ref it left on the node; it keeps a snapshot's pending record
// whose snapshot a node holds (its removal would pass the snapshot to the
// root), one lapsed within the margin, and every record while a node does
// not answer (it may hold the names). Before, such a record stayed until
// removed by hand.
func TestSweepObjects(t *testing.T) {
	r := startObjectRig(t, filepath.Join(t.TempDir(), "meta.db"))
	ctx := t.Context()
	now := time.Now()
	dead, inMargin := now.Add(-objectSweepAfter-time.Minute), now.Add(-objectSweepAfter/2)
	claim := func(name, kind, writer string, until time.Time) {
		t.Helper()
		if _, claimed, err := r.st.ClaimObject(ctx, store.Object{Name: name, Kind: kind, Project: "build", Writer: writer, WriterUntil: until}); err != nil || !claimed {
			t.Fatalf("claim %s as a call that died would: %v, %v", name, claimed, err)
		}
	}
	const deadWriter = "objects/00000000000000dd"
	claim("env:dead", store.ObjectLayer, deadWriter, dead)
	staged := stagingRef(deadWriter)
	r.layers.put(&dsecv1.Layer{Refs: []string{staged}}, staged)
	claim("snap:held", store.ObjectSnapshot, "objects/00000000000000ee", dead)
	r.layers.put(&dsecv1.Layer{Snapshots: []*dsecv1.SnapshotInfo{{Name: "held"}}}, "snap:held")
	claim("env:margin", store.ObjectLayer, "objects/00000000000000ff", inMargin)
	kept := func(name string, want bool) {
		t.Helper()
		_, err := r.st.Object(ctx, name)
		if got := !errors.Is(err, errdefs.ErrNotFound); got != want || (err != nil && got) {
			t.Errorf("the record of %s: %v; want kept %v", name, err, want)
		}
	}

	r.layers.listFails.Store(true)
	r.srv.sweepObjects(ctx, now)
	r.layers.listFails.Store(false)
	kept("env:dead", true)
	if !r.layers.has(staged) {
		t.Error("a sweep while the node does not answer removed a staging ref")
	}

	r.srv.sweepObjects(ctx, now)
	kept("env:dead", false)
	kept("snap:held", true)
	kept("env:margin", true)
	if r.layers.has(staged) {
		t.Error("the sweep left the dead call's staging ref on the node")
	}
	if !r.layers.has("snap:held") {
		t.Error("the sweep removed the snapshot the node holds")
	}
}

// sweptOnTake is a store whose next TakeObject finds its record swept
// just before (the sweep won the race for the project's row).
type sweptOnTake struct {
	store.Objects
	sweep bool
}

func (w *sweptOnTake) TakeObject(ctx context.Context, name, writer string, until time.Time) (store.Object, error) {
	if w.sweep {
		w.sweep = false
		if _, err := w.Objects.SweepObject(ctx, name, time.Now()); err != nil {
			return store.Object{}, err
		}
	}
	return w.Objects.TakeObject(ctx, name, writer, until)
}

// TestClaimAfterSweep: a call that finds a dead call's record and has it
// swept from under it before it takes the name claims the name anew,
// where it failed (NotFound).
func TestClaimAfterSweep(t *testing.T) {
	r := startObjectRig(t, filepath.Join(t.TempDir(), "meta.db"))
	ctx := t.Context()
	if _, claimed, err := r.st.ClaimObject(ctx, store.Object{Name: "env:1", Kind: store.ObjectLayer, Project: "build",
		Writer: "objects/00000000000000dd", WriterUntil: time.Now().Add(-objectSweepAfter)}); err != nil || !claimed {
		t.Fatalf("claim env:1 as a call that died would: %v, %v", claimed, err)
	}
	r.srv.cfg.Objects = &sweptOnTake{Objects: r.st, sweep: true}
	c, err := r.srv.claimObject(ctx, store.ObjectLayer, "env:1", "build")
	if err != nil {
		t.Fatalf("claim env:1 as its record is swept: %v; want it claimed anew", err)
	}
	o, err := r.st.Object(ctx, "env:1")
	if err != nil || !c.claimed || o.Writer != c.writer || c.writer == "" {
		t.Fatalf("env:1 claimed anew: claim %+v, record %+v, %v; want the call its writer", c, o, err)
	}
	c.fail(ctx)
	if _, err := r.st.Object(ctx, "env:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("env:1 after the call failed: %v; want its record gone", err)
	}
}
