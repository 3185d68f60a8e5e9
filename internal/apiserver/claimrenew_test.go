package apiserver

import (
	"context"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// holdTake is a store whose first TakeObject waits, once it began, until
// proceed is closed (or its ctx ends, as a store's call does).
type holdTake struct {
	store.Store
	once             sync.Once
	entered, proceed chan struct{}
	done             chan error
}

func (h *holdTake) TakeObject(ctx context.Context, name, writer string, until time.Time) (store.Object, error) {
	first := false
	h.once.Do(func() { first = true })
	if !first {
		return h.Store.TakeObject(ctx, name, writer, until)
	}
	close(h.entered)
	select {
	case <-h.proceed:
	case <-ctx.Done():
		h.done <- ctx.Err()
		return store.Object{}, ctx.Err()
	}
	o, err := h.Store.TakeObject(ctx, name, writer, until)
	h.done <- err
	return o, err
}

// TestClaimRenewStops: a call's claim of a name, renewed while the call
// runs (it has no deadline), ends with the call: a renewal under way when
// the claim is released is over before the release, so it never claims
// the name again after it (before, it could, and the name was refused to
// every other call as "being made again" for two more minutes).
func TestClaimRenewStops(t *testing.T) {
	ctx := t.Context()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	h := &holdTake{Store: st, entered: make(chan struct{}), proceed: make(chan struct{}), done: make(chan error, 1)}
	s := New(Config{Name: "a", Auth: st, IAM: st, Objects: h, Metrics: metrics.New()}, st, watcher.NewFixed(), slog.New(slog.DiscardHandler))
	until := time.Now().Add(time.Hour)
	o, claimed, err := st.ClaimObject(ctx, store.Object{Name: "env:1", Kind: store.ObjectLayer, Writer: "a/1", WriterUntil: until})
	if err != nil || !claimed {
		t.Fatalf("claim env:1: %v, %v", claimed, err)
	}
	c := &claim{s: s, o: o, claimed: true, writer: "a/1"}
	c.stop = c.renew(ctx, until, time.Millisecond)
	<-h.entered // a renewal under way
	c.release(ctx, false)
	close(h.proceed)
	<-h.done
	if o, err := st.Object(ctx, "env:1"); err != nil || o.Writer != "" {
		t.Fatalf("env:1 after its call released it: writer %q until %s (%v); want none", o.Writer, o.WriterUntil, err)
	}
}
