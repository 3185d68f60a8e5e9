package iam

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// fakeSource is a Source of fixed tokens that counts look-ups.
type fakeSource struct {
	mu      sync.Mutex
	tokens  map[string]Authority
	gen     int64
	lookups int
	genErr  error
}

func (f *fakeSource) Authenticate(ctx context.Context, tok string) (Authority, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lookups++
	a, ok := f.tokens[tok]
	if !ok {
		return Authority{}, errdefs.ErrUnauthenticated
	}
	return a, nil
}

func (f *fakeSource) Generation(ctx context.Context) (int64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.gen, f.genErr
}

func (f *fakeSource) revoke(tok string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.tokens, tok)
	f.gen++
}

func TestCache(t *testing.T) {
	ctx := context.Background()
	now := time.Unix(1000, 0)
	src := &fakeSource{tokens: map[string]Authority{
		"a": {TokenID: "tok-a", Role: Admin},
		"b": {TokenID: "tok-b", Role: Runner, Expires: now.Add(3 * time.Second)},
	}}
	c := NewCache(src, 10*time.Second, time.Second)
	c.now = func() time.Time { return now }
	check := func(tok string, wantOK bool, wantLookups int) {
		t.Helper()
		a, err := c.Authenticate(ctx, tok)
		if wantOK && (err != nil || a.TokenID != "tok-"+tok) {
			t.Fatalf("%s: %+v, %v", tok, a, err)
		}
		if !wantOK && !errors.Is(err, errdefs.ErrUnauthenticated) {
			t.Fatalf("%s: %v, want unauthenticated", tok, err)
		}
		if src.lookups != wantLookups {
			t.Fatalf("%s: %d look-ups, want %d", tok, src.lookups, wantLookups)
		}
	}
	check("a", true, 1)
	check("a", true, 1) // cached
	check("b", true, 2)
	check("x", false, 3)
	check("x", false, 4) // refusals are not cached

	now = now.Add(4 * time.Second) // past b's expiry, within a's TTL
	check("a", true, 4)
	check("b", true, 5) // the entry ended with the token; the fake still knows it

	// A revocation: seen at the next generation read, within a second.
	src.revoke("a")
	check("a", true, 5)
	now = now.Add(time.Second)
	check("a", false, 6)
	if c.Len() != 0 {
		t.Fatalf("%d entries after the generation grew", c.Len())
	}

	// Without the generation, entries still end at their TTL.
	src.tokens["a"] = Authority{TokenID: "tok-a"}
	src.genErr = errors.New("store away")
	check("a", true, 7)
	src.revoke("a")
	now = now.Add(5 * time.Second)
	check("a", true, 7)
	now = now.Add(6 * time.Second)
	check("a", false, 8)
}
