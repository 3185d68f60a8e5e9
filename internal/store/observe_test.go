package store_test

import (
	"path/filepath"
	"sync"
	"testing"

	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/store/storetest"
)

// failures counts an observed store's failures by op.
type failures struct {
	mu sync.Mutex
	by map[string]int
}

func (f *failures) add(op string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.by == nil {
		f.by = map[string]int{}
	}
	f.by[op]++
}

func (f *failures) of(op string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.by[op]
}

// TestObservedSQLite: a store wrapped for its error counter passes the
// conformance suite, its answers (not found, already exists, refusals)
// are not counted as failures, and a store that cannot answer is.
func TestObservedSQLite(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store {
		return store.Observe(openSQLite(t, filepath.Join(t.TempDir(), "meta.db")), func(string) {})
	})

	var f failures
	ctx := t.Context()
	raw, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	st := store.Observe(raw, f.add)
	if _, err := st.GetIdempotency(ctx, "no-such-key"); err == nil {
		t.Fatal("GetIdempotency of a missing key succeeded")
	}
	if _, err := st.Project(ctx, "no/such/project"); err == nil {
		t.Fatal("Project of a missing project succeeded")
	}
	if f.of("GetIdempotency") != 0 || f.of("Project") != 0 {
		t.Errorf("answers counted as failures: %v", f.by)
	}
	raw.Close()
	if _, err := st.Nodes(ctx); err == nil {
		t.Fatal("Nodes of a closed store succeeded")
	}
	if got := f.of("Nodes"); got != 1 {
		t.Errorf("a closed store's Nodes counted %d failures, want 1 (%v)", got, f.by)
	}
	if store.Backend("postgres://u@h/db") != "postgres" || store.Backend("/var/lib/dsec/meta.db") != "sqlite" {
		t.Errorf("Backend: %q %q", store.Backend("postgres://u@h/db"), store.Backend("/var/lib/dsec/meta.db"))
	}
}
