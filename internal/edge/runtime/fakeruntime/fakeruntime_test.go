package fakeruntime_test

import (
	"testing"

	"dsec.dev/dsec/internal/edge/runtime"
	"dsec.dev/dsec/internal/edge/runtime/fakeruntime"
	"dsec.dev/dsec/internal/edge/runtime/runtimetest"
)

func TestConformance(t *testing.T) {
	runtimetest.Run(t, nil, func(t *testing.T, root string) runtime.Runtime {
		rt := fakeruntime.New(root)
		t.Cleanup(rt.Close)
		return rt
	})
}

// A fake that claims no features runs the suite too (its pause checks
// skip).
func TestConformanceWithoutFeatures(t *testing.T) {
	runtimetest.Run(t, nil, func(t *testing.T, root string) runtime.Runtime {
		rt := fakeruntime.New(root, fakeruntime.WithFeatures(runtime.Features{}))
		t.Cleanup(rt.Close)
		return rt
	})
}
