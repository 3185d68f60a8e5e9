package apiserver

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"dsec.dev/dsec/internal/store"
)

// TestAuditExpiry: the expiry loop forgets the records older than the
// retention and keeps the others.
func TestAuditExpiry(t *testing.T) {
	ctx := t.Context()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	now := time.Now()
	for _, r := range []store.AuditRecord{
		{At: now.Add(-48 * time.Hour), Principal: "a", Operation: "old", Code: "ok"},
		{At: now.Add(-25 * time.Hour), Principal: "a", Operation: "old", Code: "ok"},
		{At: now.Add(-time.Hour), Principal: "a", Operation: "new", Code: "ok"},
	} {
		if err := st.AppendAudit(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	loop, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		expireEvery(loop, "audit records", 24*time.Hour, 10*time.Millisecond, slog.New(slog.NewTextHandler(io.Discard, nil)), st.ExpireAudit)
	}()
	defer func() { stop(); <-done }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		recs, err := st.QueryAudit(ctx, store.AuditQuery{})
		if err != nil {
			t.Fatal(err)
		}
		if len(recs) == 1 {
			if recs[0].Operation != "new" {
				t.Fatalf("kept %+v, want the record of an hour ago", recs[0])
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d records left 30 s on, want 1", len(recs))
		}
		time.Sleep(10 * time.Millisecond)
	}
}
