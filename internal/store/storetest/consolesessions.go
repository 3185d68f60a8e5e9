package storetest

import (
	"fmt"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

var consoleCases = []struct {
	name string
	fn   func(t *testing.T, st store.Store)
}{
	{"ConsoleSessions", testConsoleSessions},
	{"ConsoleSessionsPerToken", testConsoleSessionsPerToken},
}

var consoleReplicaCases = []struct {
	name string
	fn   func(t *testing.T, a, b store.Store)
}{
	{"ConsoleSessionSeenByOther", testReplicasConsoleSession},
}

// testConsoleSessions: a session reads back as stored until it ends, an
// ID is stored once, a deleted or expired one is gone, and revoking a
// token ends its sessions, not another token's.
func testConsoleSessions(t *testing.T, st store.Store) {
	ctx := t.Context()
	_, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "web"})
	must(t, "CreatePrincipal", err)
	_, tok := issue(t, st, "web", 0)
	_, other := issue(t, st, "web", 0)
	now := ms(time.Now())
	s1 := store.ConsoleSession{ID: "h1", TokenID: tok.ID, Sealed: "sealed-1", Created: now, Expires: now.Add(time.Hour)}
	must(t, "PutConsoleSession", st.PutConsoleSession(ctx, s1))
	wantKind(t, "PutConsoleSession of a stored ID", st.PutConsoleSession(ctx, s1), errdefs.ErrAlreadyExists)
	wantKind(t, "PutConsoleSession without a sealed token", st.PutConsoleSession(ctx, store.ConsoleSession{ID: "h9", Expires: now.Add(time.Hour)}), errdefs.ErrInvalidArgument)
	got, err := st.ConsoleSession(ctx, "h1", now)
	must(t, "ConsoleSession", err)
	if !(got.ID == s1.ID && got.TokenID == s1.TokenID && got.Sealed == s1.Sealed && got.Created.Equal(s1.Created) && got.Expires.Equal(s1.Expires)) {
		t.Fatalf("ConsoleSession = %+v, want %+v", got, s1)
	}
	_, err = st.ConsoleSession(ctx, "h1", now.Add(time.Hour))
	wantKind(t, "ConsoleSession at its end", err, errdefs.ErrNotFound)
	_, err = st.ConsoleSession(ctx, "nope", now)
	wantKind(t, "ConsoleSession of an unknown ID", err, errdefs.ErrNotFound)

	must(t, "PutConsoleSession h2", st.PutConsoleSession(ctx, store.ConsoleSession{ID: "h2", TokenID: tok.ID, Sealed: "s2", Created: now, Expires: now.Add(time.Minute)}))
	must(t, "PutConsoleSession h3", st.PutConsoleSession(ctx, store.ConsoleSession{ID: "h3", TokenID: other.ID, Sealed: "s3", Created: now, Expires: now.Add(time.Hour)}))
	n, err := st.ExpireConsoleSessions(ctx, now.Add(2*time.Minute))
	must(t, "ExpireConsoleSessions", err)
	if n != 1 {
		t.Fatalf("ExpireConsoleSessions removed %d, want 1 (h2)", n)
	}
	must(t, "DeleteConsoleSession", st.DeleteConsoleSession(ctx, "h3"))
	must(t, "DeleteConsoleSession of an unknown ID", st.DeleteConsoleSession(ctx, "h3"))
	_, err = st.ConsoleSession(ctx, "h3", now)
	wantKind(t, "ConsoleSession deleted", err, errdefs.ErrNotFound)

	must(t, "PutConsoleSession h4", st.PutConsoleSession(ctx, store.ConsoleSession{ID: "h4", TokenID: other.ID, Sealed: "s4", Created: now, Expires: now.Add(time.Hour)}))
	must(t, "RevokeToken", revoke(st, tok.ID))
	_, err = st.ConsoleSession(ctx, "h1", now)
	wantKind(t, "ConsoleSession of a revoked token", err, errdefs.ErrNotFound)
	_, err = st.ConsoleSession(ctx, "h4", now)
	must(t, "ConsoleSession of another token after a revocation", err)
}

// testConsoleSessionsPerToken: a token keeps its newest
// store.MaxConsoleSessionsPerToken sessions, however often it signs in
// (each sign-in is a row that lives 12 hours), and another token's are
// not touched.
func testConsoleSessionsPerToken(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	put := func(id, token string, created time.Time) {
		t.Helper()
		must(t, "PutConsoleSession "+id, st.PutConsoleSession(ctx, store.ConsoleSession{ID: id, TokenID: token, Sealed: "s", Created: created, Expires: now.Add(time.Hour)}))
	}
	put("other", "tok-2", now)
	n := store.MaxConsoleSessionsPerToken + 2
	for i := range n {
		put(fmt.Sprintf("h%03d", i), "tok-1", now.Add(time.Duration(i)*time.Millisecond))
	}
	for i := range n {
		_, err := st.ConsoleSession(ctx, fmt.Sprintf("h%03d", i), now)
		if i < 2 {
			wantKind(t, fmt.Sprintf("session %d of %d of one token", i+1, n), err, errdefs.ErrNotFound)
		} else {
			must(t, fmt.Sprintf("session %d of %d of one token", i+1, n), err)
		}
	}
	_, err := st.ConsoleSession(ctx, "other", now)
	must(t, "another token's session", err)
}

// testReplicasConsoleSession: a session one replica stores the other
// reads, and a delete on one ends it on both.
func testReplicasConsoleSession(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	must(t, "a puts", a.PutConsoleSession(ctx, store.ConsoleSession{ID: "h1", TokenID: "tok-1", Sealed: "s", Created: now, Expires: now.Add(time.Hour)}))
	if _, err := b.ConsoleSession(ctx, "h1", now); err != nil {
		t.Fatalf("b reads a's session: %v", err)
	}
	must(t, "b deletes", b.DeleteConsoleSession(ctx, "h1"))
	_, err := a.ConsoleSession(ctx, "h1", now)
	wantKind(t, "a reads the session b deleted", err, errdefs.ErrNotFound)
}
