package fake_test

import (
	"testing"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/backendtest"
	"dsec.dev/dsec/internal/edge/backend/fake"
)

// The fake's instances share nothing across roots, so its groups run four
// at once (Options.Parallel).
func TestConformance(t *testing.T) {
	backendtest.Run(t, backendtest.Options{NoCommands: true, Parallel: 4, New: func(t *testing.T, root string) backend.Runtime {
		rt := fake.New(root)
		t.Cleanup(rt.Close)
		return rt
	}})
}

// A fake that claims no features runs the suite too (its pause checks
// skip).
func TestConformanceWithoutFeatures(t *testing.T) {
	backendtest.Run(t, backendtest.Options{NoCommands: true, New: func(t *testing.T, root string) backend.Runtime {
		rt := fake.New(root, fake.WithFeatures(backend.Features{}))
		t.Cleanup(rt.Close)
		return rt
	}})
}
