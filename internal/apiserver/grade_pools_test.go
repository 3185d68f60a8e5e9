package apiserver

import (
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TestGradePoolsIdle: a grade sets its shape's pool once per renewal
// period, and a pool no grade used for gradePoolIdle is handed back for
// removal, by the next grade or by the periodic sweep, once.
func TestGradePoolsIdle(t *testing.T) {
	var g gradePools
	t0 := time.Unix(1_000_000, 0)
	a := &dsecv1.SandboxSpec{Environment: "a:1"}
	b := &dsecv1.SandboxSpec{Environment: "b:1"}

	set, drop, _ := g.use("n1", a, t0)
	if set == nil || len(drop) != 0 {
		t.Fatalf("first grade of a shape: set %v, drop %v; want the pool set, nothing dropped", set, drop)
	}
	if set, _, _ = g.use("n1", a, t0.Add(time.Second)); set != nil {
		t.Fatalf("a second grade within the renewal period set the pool again")
	}
	if set, _, _ = g.use("n1", a, t0.Add(gradePoolRenew)); set == nil {
		t.Fatalf("a grade after the renewal period did not renew the pool")
	}
	g.use("n2", b, t0.Add(gradePoolRenew))

	if drop, _ := g.idle(t0.Add(gradePoolRenew + gradePoolIdle - time.Second)); len(drop) != 0 {
		t.Fatalf("pools used within gradePoolIdle were dropped: %v", drop)
	}
	drop, specs := g.idle(t0.Add(gradePoolRenew + gradePoolIdle))
	if len(drop) != 2 || len(specs) != 2 {
		t.Fatalf("after gradePoolIdle unused: dropped %v, want both pools", drop)
	}
	for i, k := range drop {
		if want := map[string]string{"n1": "a:1", "n2": "b:1"}[k.node]; specs[i].GetEnvironment() != want {
			t.Errorf("dropped pool on %s has environment %q, want %q", k.node, specs[i].GetEnvironment(), want)
		}
	}
	if drop, _ := g.idle(t0.Add(2 * (gradePoolRenew + gradePoolIdle))); len(drop) != 0 {
		t.Fatalf("a dropped pool was dropped again: %v", drop)
	}
	// A grade after the drop sets its pool anew.
	if set, _, _ := g.use("n1", a, t0.Add(3*gradePoolIdle)); set == nil {
		t.Fatalf("a grade after its pool was dropped did not set it again")
	}
}
