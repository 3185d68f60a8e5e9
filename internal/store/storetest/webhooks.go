package storetest

import (
	"errors"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

func webhookIDs(ws []store.Webhook) []string {
	var out []string
	for _, w := range ws {
		out = append(out, w.ID)
	}
	return out
}

func wantWebhooks(t *testing.T, what string, got []store.Webhook, want ...string) {
	t.Helper()
	if g := webhookIDs(got); !equalStrings(g, want) {
		t.Fatalf("%s: got webhooks %q, want %q", what, g, want)
	}
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// testWebhooks: webhooks are added, listed by project subtree with their
// fields, and removed only through their project.
func testWebhooks(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	for _, w := range []store.Webhook{
		{ID: "wh-1", Project: "a", URL: "https://a.example/hook", Kinds: []string{"failed", "expired"}, Secret: "s1", Created: now, Delivered: 7},
		{ID: "wh-2", Project: "a/b", URL: "https://b.example/hook", Secret: "s2", Batch: 250},
		{ID: "wh-3", Project: "ab", URL: "https://c.example/hook", Secret: "s3"},
	} {
		must(t, "AddWebhook "+w.ID, st.AddWebhook(ctx, w))
	}
	wantKind(t, "AddWebhook again", st.AddWebhook(ctx, store.Webhook{ID: "wh-1", Project: "a", URL: "https://x", Secret: "s"}), errdefs.ErrAlreadyExists)
	wantKind(t, "AddWebhook without a secret", st.AddWebhook(ctx, store.Webhook{ID: "wh-9", Project: "a", URL: "https://x"}), errdefs.ErrInvalidArgument)

	got, err := st.ListWebhooks(ctx, []string{"a"})
	must(t, "ListWebhooks a", err)
	wantWebhooks(t, "a", got, "wh-1", "wh-2")
	w := got[0]
	if w.Project != "a" || w.URL != "https://a.example/hook" || !equalStrings(w.Kinds, []string{"failed", "expired"}) || w.Secret != "s1" ||
		!w.Created.Equal(now) || w.Delivered != 7 || w.LeaseOwner != "" || !w.LastOK.IsZero() || !w.LastFailure.IsZero() {
		t.Fatalf("wh-1: %+v", w)
	}
	if got[1].Kinds != nil || got[1].Batch != 250 || w.Batch != 0 {
		t.Fatalf("wh-2's kinds: %q, want none (all); batches %d and %d, want 0 and 250", got[1].Kinds, w.Batch, got[1].Batch)
	}
	all, err := st.ListWebhooks(ctx, nil)
	must(t, "ListWebhooks", err)
	wantWebhooks(t, "all", all, "wh-1", "wh-2", "wh-3")

	// A rotation keeps the old secret beside the new until its end; one
	// without an overlap forgets it; another project's is not found.
	until := ms(time.Now().Add(time.Hour))
	must(t, "RotateWebhookSecret", st.RotateWebhookSecret(ctx, "a", "wh-1", "s1b", until))
	got, err = st.ListWebhooks(ctx, []string{"a"})
	must(t, "ListWebhooks after the rotation", err)
	if w := got[0]; w.Secret != "s1b" || w.PrevSecret != "s1" || !w.PrevUntil.Equal(until) {
		t.Fatalf("wh-1 after the rotation: secret %q, previous %q until %v", w.Secret, w.PrevSecret, w.PrevUntil)
	}
	must(t, "RotateWebhookSecret without overlap", st.RotateWebhookSecret(ctx, "a", "wh-1", "s1c", time.Time{}))
	got, err = st.ListWebhooks(ctx, []string{"a"})
	must(t, "ListWebhooks after the second rotation", err)
	if w := got[0]; w.Secret != "s1c" || w.PrevSecret != "" || !w.PrevUntil.IsZero() {
		t.Fatalf("wh-1 after a rotation without overlap: secret %q, previous %q until %v", w.Secret, w.PrevSecret, w.PrevUntil)
	}
	wantKind(t, "RotateWebhookSecret through another project", st.RotateWebhookSecret(ctx, "ab", "wh-1", "x", until), errdefs.ErrNotFound)
	wantKind(t, "RemoveWebhook through another project", st.RemoveWebhook(ctx, "ab", "wh-1"), errdefs.ErrNotFound)
	must(t, "RemoveWebhook wh-2 through a", st.RemoveWebhook(ctx, "a", "wh-2"))
	err = st.RemoveWebhook(ctx, "a", "wh-2")
	wantKind(t, "RemoveWebhook again", err, errdefs.ErrNotFound)
	if err == nil || !strings.Contains(err.Error(), "no webhook wh-2 in project a") {
		t.Errorf("RemoveWebhook again: %v, want it to name the webhook and the project", err)
	}
	all, err = st.ListWebhooks(ctx, []string{""})
	must(t, "ListWebhooks /", err)
	wantWebhooks(t, "after the remove", all, "wh-1", "wh-3")
}

// testWebhookUpdate: an update changes what it sets of a webhook (a batch
// from 0, the format before batches, kinds, the URL) and nothing else: its
// cursor, secrets, lease and history stay; one through another project,
// or of an unknown webhook, is not found.
func testWebhookUpdate(t *testing.T, st store.Store) {
	ctx := t.Context()
	now := ms(time.Now())
	must(t, "AddWebhook", st.AddWebhook(ctx, store.Webhook{ID: "wh-u", Project: "u/v", URL: "https://u.example/hook",
		Kinds: []string{"failed"}, Secret: "s0", Created: now, Delivered: 41}))
	must(t, "RotateWebhookSecret", st.RotateWebhookSecret(ctx, "u", "wh-u", "s1", ms(now.Add(time.Hour))))
	held, err := st.ClaimWebhooks(ctx, "api1/x", now, now.Add(time.Minute))
	must(t, "ClaimWebhooks", err)
	wantWebhooks(t, "claimed", held, "wh-u")
	must(t, "AdvanceWebhook", st.AdvanceWebhook(ctx, "wh-u", "api1/x", 42, now, nil))
	before := held[0]
	before.Delivered, before.LastOK = 42, now

	batch := 100
	w, err := st.UpdateWebhook(ctx, "u", "wh-u", store.WebhookUpdate{Batch: &batch})
	must(t, "UpdateWebhook batch", err)
	want := before
	want.Batch = 100
	if !sameWebhook(w, want) {
		t.Fatalf("after a batch's update: %+v, want %+v", w, want)
	}
	url, kinds := "https://u2.example/hook", []string{"created", "deleted"}
	w, err = st.UpdateWebhook(ctx, "u/v", "wh-u", store.WebhookUpdate{URL: &url, Kinds: &kinds})
	must(t, "UpdateWebhook url and kinds", err)
	want.URL, want.Kinds = url, kinds
	if !sameWebhook(w, want) {
		t.Fatalf("after a url's and kinds' update: %+v, want %+v", w, want)
	}
	none, single := []string{}, 0
	w, err = st.UpdateWebhook(ctx, "u", "wh-u", store.WebhookUpdate{Kinds: &none, Batch: &single})
	must(t, "UpdateWebhook to every kind, single", err)
	want.Kinds, want.Batch = nil, 0
	if !sameWebhook(w, want) {
		t.Fatalf("after every kind, single: %+v, want %+v", w, want)
	}
	got, err := st.ListWebhooks(ctx, []string{"u"})
	must(t, "ListWebhooks", err)
	if len(got) != 1 || !sameWebhook(got[0], want) {
		t.Fatalf("listed after the updates: %+v, want %+v", got, want)
	}
	if w, err := st.UpdateWebhook(ctx, "u", "wh-u", store.WebhookUpdate{}); err != nil || !sameWebhook(w, want) {
		t.Errorf("an update of nothing: %+v, %v; want it as it was", w, err)
	}
	_, err = st.UpdateWebhook(ctx, "uv", "wh-u", store.WebhookUpdate{Batch: &batch})
	wantKind(t, "UpdateWebhook through another project", err, errdefs.ErrNotFound)
	_, err = st.UpdateWebhook(ctx, "u", "wh-none", store.WebhookUpdate{Batch: &batch})
	wantKind(t, "UpdateWebhook of an unknown webhook", err, errdefs.ErrNotFound)
	neg := -1
	_, err = st.UpdateWebhook(ctx, "u", "wh-u", store.WebhookUpdate{Batch: &neg})
	wantKind(t, "UpdateWebhook to a negative batch", err, errdefs.ErrInvalidArgument)
	must(t, "RemoveWebhook", st.RemoveWebhook(ctx, "u", "wh-u"))
}

// sameWebhook compares every field of two webhooks, times to the
// millisecond.
func sameWebhook(a, b store.Webhook) bool {
	return a.ID == b.ID && a.Project == b.Project && a.URL == b.URL && equalStrings(a.Kinds, b.Kinds) && a.Secret == b.Secret &&
		a.PrevSecret == b.PrevSecret && a.PrevUntil.Equal(b.PrevUntil) && a.Batch == b.Batch && a.Created.Equal(b.Created) &&
		a.Delivered == b.Delivered && a.LeaseOwner == b.LeaseOwner && a.LeaseUntil.Equal(b.LeaseUntil) &&
		a.LastOK.Equal(b.LastOK) && a.LastFailure.Equal(b.LastFailure) && a.Failures == b.Failures && a.LastError == b.LastError
}

// testReplicasWebhookLease: one store's lease keeps the other off a
// webhook until it lapses; then the other takes it, and the first can no
// longer advance it. Advances record successes and failures.
func testReplicasWebhookLease(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	must(t, "AddWebhook", a.AddWebhook(ctx, store.Webhook{ID: "wh", Project: "p", URL: "https://x.example", Secret: "s"}))
	now := ms(time.Now())
	got, err := a.ClaimWebhooks(ctx, "api-a", now, now.Add(10*time.Second))
	must(t, "a claims", err)
	wantWebhooks(t, "a's claim", got, "wh")
	got, err = b.ClaimWebhooks(ctx, "api-b", now.Add(time.Second), now.Add(11*time.Second))
	must(t, "b claims", err)
	wantWebhooks(t, "b's claim within a's lease", got)
	got, err = a.ClaimWebhooks(ctx, "api-a", now.Add(2*time.Second), now.Add(12*time.Second))
	must(t, "a renews", err)
	wantWebhooks(t, "a's renewal", got, "wh")

	must(t, "a fails a delivery", a.AdvanceWebhook(ctx, "wh", "api-a", 0, now, errors.New("endpoint answered 500")))
	must(t, "a fails again", a.AdvanceWebhook(ctx, "wh", "api-a", 0, now.Add(time.Second), errors.New("endpoint answered 502")))
	ws, err := b.ListWebhooks(ctx, nil)
	must(t, "ListWebhooks", err)
	if w := ws[0]; w.Failures != 2 || w.LastError != "endpoint answered 502" || !w.LastFailure.Equal(now.Add(time.Second)) || w.Delivered != 0 {
		t.Fatalf("after two failures: %+v", w)
	}
	must(t, "a delivers", a.AdvanceWebhook(ctx, "wh", "api-a", 5, now.Add(2*time.Second), nil))

	// a's lease lapses: b takes it, a can no longer advance.
	got, err = b.ClaimWebhooks(ctx, "api-b", now.Add(13*time.Second), now.Add(23*time.Second))
	must(t, "b claims after the lapse", err)
	wantWebhooks(t, "b's claim", got, "wh")
	if w := got[0]; w.Delivered != 5 || w.Failures != 0 || w.LastError != "" || !w.LastOK.Equal(now.Add(2*time.Second)) || w.LeaseOwner != "api-b" {
		t.Fatalf("b's claim: %+v", w)
	}
	wantKind(t, "a advancing b's webhook", a.AdvanceWebhook(ctx, "wh", "api-a", 6, now, nil), errdefs.ErrFailedPrecondition)
	must(t, "b advances", b.AdvanceWebhook(ctx, "wh", "api-b", 6, now.Add(14*time.Second), nil))

	// b releases it (stopping): a takes it at once, within b's lease.
	must(t, "b releases", b.ReleaseWebhooks(ctx, "api-b"))
	got, err = a.ClaimWebhooks(ctx, "api-a", now.Add(15*time.Second), now.Add(25*time.Second))
	must(t, "a claims after the release", err)
	wantWebhooks(t, "a's claim after the release", got, "wh")
}
