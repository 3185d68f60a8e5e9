package apiserver_test

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"dsec.dev/dsec/internal/apiserver/iamtest"
	dsec "dsec.dev/dsec/sdk/go"
	"dsec.dev/dsec/sdk/go/webhook"
)

// receiver is a webhook endpoint on loopback: it verifies each delivery's
// signature, answers as answer says, and keeps what it acknowledged.
type receiver struct {
	t      *testing.T
	secret string
	// v1s is how many v1 signatures the last delivery carried.
	v1s    int
	header string // the last delivery's signature and body
	body   []byte
	srv    *httptest.Server

	mu       sync.Mutex
	attempts map[string]int // event key -> attempts
	acked    []string       // event keys acknowledged, in order
	kinds    []string       // their kinds
	ids      []int64        // their IDs
	shapes   []delivery     // every POST, in order
	answer   func(key string, attempt int) int
	hang     chan struct{} // closed: a hanging answer returns
	hanging  chan struct{} // closed when the first hanging request arrived
	// gate, when set, holds every request until it is closed (hanging is
	// closed as the first arrives).
	gate     chan struct{}
	hangOnce sync.Once
}

func newReceiver(t *testing.T, answer func(key string, attempt int) int) *receiver {
	r := &receiver{t: t, attempts: map[string]int{}, answer: answer, hang: make(chan struct{}), hanging: make(chan struct{})}
	r.srv = httptest.NewServer(http.HandlerFunc(r.serve))
	t.Cleanup(func() {
		close(r.hang)
		r.srv.Close()
	})
	return r
}

func (r *receiver) serve(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	if r.gate != nil {
		r.hangOnce.Do(func() { close(r.hanging) })
		<-r.gate
	}
	r.mu.Lock()
	secret := r.secret
	r.v1s = strings.Count(req.Header.Get(webhook.Header), "v1=")
	r.header, r.body = req.Header.Get(webhook.Header), body
	r.mu.Unlock()
	if secret != "" { // "": the test checks the signatures itself
		if err := webhook.Verify(secret, req.Header.Get(webhook.Header), body, time.Now(), 0); err != nil {
			r.t.Errorf("a delivery does not verify: %v", err)
			http.Error(w, err.Error(), http.StatusUnauthorized)
			return
		}
		tampered := []byte(strings.Replace(string(body), `"kind":"`, `"kind":"x`, 1))
		if err := webhook.Verify(secret, req.Header.Get(webhook.Header), tampered, time.Now(), 0); !errors.Is(err, webhook.ErrSignature) {
			r.t.Errorf("a tampered delivery verified: %v", err)
		}
	}
	evs, err := webhook.Events(body)
	if err != nil || len(evs) == 0 {
		r.t.Errorf("a delivery's body %q: %v", body, err)
		http.Error(w, "unreadable", http.StatusBadRequest)
		return
	}
	if got := req.Header.Get("Dsec-Event-Id"); got != strconv.FormatInt(evs[len(evs)-1].ID, 10) {
		r.t.Errorf("a delivery of events %d to %d says Dsec-Event-Id %s", evs[0].ID, evs[len(evs)-1].ID, got)
	}
	// An attempt is counted on the delivery's first event; a retry sends
	// the same events again.
	key := evs[0].Key
	r.mu.Lock()
	r.attempts[key]++
	r.shapes = append(r.shapes, delivery{batched: strings.Contains(string(body), `"events":[`), events: len(evs)})
	code := r.answer(key, r.attempts[key])
	if code == 0 {
		r.mu.Unlock()
		r.hangOnce.Do(func() { close(r.hanging) })
		<-r.hang
		return
	}
	if code/100 == 2 {
		for _, ev := range evs {
			r.acked = append(r.acked, ev.Key)
			r.kinds = append(r.kinds, ev.Kind+":"+ev.SandboxID)
			r.ids = append(r.ids, ev.ID)
		}
	}
	r.mu.Unlock()
	w.WriteHeader(code)
}

// delivery is one POST a receiver got: batched (an envelope) or a single
// event's body, and how many events it carried.
type delivery struct {
	batched bool
	events  int
}

func (r *receiver) snapshot() (acked, kinds []string, attempts map[string]int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	at := map[string]int{}
	for k, v := range r.attempts {
		at[k] = v
	}
	return slices.Clone(r.acked), slices.Clone(r.kinds), at
}

// waitAcked waits until the receiver acknowledged n deliveries.
func (r *receiver) waitAcked(t *testing.T, n int) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; {
		acked, kinds, _ := r.snapshot()
		if len(acked) >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the endpoint acknowledged %d deliveries (%q), want %d", len(acked), kinds, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestWebhooks: a project's admin registers an endpoint; it fails the
// first event twice then acknowledges: each event is acknowledged once, in
// order, the retries seen, signatures verified (a tampered body fails),
// another project's events never sent; ListWebhooks shows the cursor and
// the last success and failure; a hanging endpoint does not hold creates
// or another webhook; an apiserver started again, and two at once, resume
// after the last acknowledged without sending one twice. SQLite and
// PostgreSQL.
func TestWebhooks(t *testing.T) {
	for name, dsn := range iamtest.Databases() {
		t.Run(name, func(t *testing.T) { testWebhooks(t, dsn(t)) })
	}
}

func testWebhooks(t *testing.T, dsn string) {
	ctx := t.Context()
	e := startEventsEnv(t, dsn)
	aAdmin, a, b := client(t, e.url, e.aAdmin), client(t, e.url, e.a), client(t, e.url, e.b)

	// Only an admin registers, only what the server allows.
	_, err := a.AddWebhook(ctx, "http://127.0.0.1:1/hook", nil)
	wantErr(t, "a runner adds a webhook", err, dsec.ErrPermissionDenied, "")
	_, err = aAdmin.AddWebhook(ctx, "ftp://example.com/hook", nil)
	wantErr(t, "an ftp webhook", err, dsec.ErrInvalidArgument, "https")
	_, err = aAdmin.AddWebhook(ctx, "https://example.com/hook", &dsec.WebhookOptions{Kinds: []string{"exploded"}})
	wantErr(t, "an unknown kind", err, dsec.ErrInvalidArgument, "exploded")
	_, err = aAdmin.AddWebhook(ctx, "https://example.com/hook", &dsec.WebhookOptions{Project: "b"})
	wantErr(t, "a's admin adds one to b", err, dsec.ErrNotFound, "")

	first := ""
	flaky := newReceiver(t, func(key string, attempt int) int {
		if first == "" {
			first = key
		}
		if key == first && attempt <= 2 {
			return http.StatusInternalServerError
		}
		return http.StatusOK
	})
	wh, err := aAdmin.AddWebhook(ctx, flaky.srv.URL+"/hook", nil)
	if err != nil {
		t.Fatal(err)
	}
	if wh.Secret == "" || wh.Project != "a" || wh.ID == "" {
		t.Fatalf("AddWebhook: %+v", wh)
	}
	flaky.mu.Lock()
	flaky.secret = wh.Secret
	flaky.mu.Unlock()

	sb := check(a.Create(ctx, "busybox", nil))(t)
	if err := sb.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	other := check(b.Create(ctx, "busybox", nil))(t)
	flaky.waitAcked(t, 2)
	acked, kinds, attempts := flaky.snapshot()
	if want := []string{"created:" + sb.ID, "deleted:" + sb.ID}; !slices.Equal(kinds, want) {
		t.Fatalf("acknowledged %q, want %q", kinds, want)
	}
	// The second event may have ridden in the first's delivery.
	if attempts[acked[0]] != 3 || attempts[acked[1]] > 1 {
		t.Fatalf("attempts %v: want 3 of the first (two failures, then acknowledged), at most 1 of the second", attempts)
	}
	// The receiver has answered; the apiserver records the answer (the
	// cursor, the success) just after.
	evs, _ := check2(a.Events(ctx, dsec.EventQuery{SandboxID: sb.ID}))(t)
	var ws []dsec.Webhook
	for deadline := time.Now().Add(10 * time.Second); ; {
		ws = check(aAdmin.Webhooks(ctx, ""))(t)
		if len(ws) != 1 || ws[0].Delivered == evs[len(evs)-1].ID || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if len(ws) != 1 || ws[0].Delivered != evs[len(evs)-1].ID {
		t.Fatalf("the webhook's cursor: %+v, want the deleted event's %d", ws, evs[len(evs)-1].ID)
	}
	if ws[0].ID != wh.ID || ws[0].Secret != "" || ws[0].LastOK.IsZero() || ws[0].LastFailure.IsZero() || ws[0].Failures != 0 {
		t.Fatalf("Webhooks after two failures and a success: %+v", ws)
	}

	// A hanging endpoint holds neither the creates nor another webhook.
	stuck := newReceiver(t, func(string, int) int { return 0 })
	stuckWh := check(aAdmin.AddWebhook(ctx, stuck.srv.URL, &dsec.WebhookOptions{Secret: "stuck-secret"}))(t)
	stuck.secret = stuckWh.Secret
	sb2 := check(a.Create(ctx, "busybox", nil))(t)
	<-stuck.hanging // its first delivery hangs from here on
	for range 3 {
		s := check(a.Create(ctx, "busybox", nil))(t)
		if err := s.Delete(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := sb2.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	flaky.waitAcked(t, 2+8) // sb2's two events and the three sandboxes' six reached the other webhook

	// A restart: the apiserver stops, a sandbox lives meanwhile; a new one
	// resumes after the last acknowledged; then two at once.
	e.stop()
	sb3 := check(a.Create(ctx, "busybox", nil))(t)
	if err := sb3.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	e.start(t)
	flaky.waitAcked(t, 12)
	second := e.startAnother(t)
	sb4 := check(client(t, second, e.a).Create(ctx, "busybox", nil))(t)
	if err := sb4.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	flaky.waitAcked(t, 14)
	time.Sleep(500 * time.Millisecond) // room for a second delivery, were there one
	acked, kinds, _ = flaky.snapshot()
	seen := map[string]bool{}
	for _, k := range acked {
		if seen[k] {
			t.Fatalf("event %s acknowledged twice: %q", k, kinds)
		}
		seen[k] = true
	}
	for _, k := range kinds {
		if strings.HasSuffix(k, other.ID) {
			t.Fatalf("project b's event was delivered to a's webhook: %q", kinds)
		}
	}
	if len(acked) != 14 {
		t.Fatalf("acknowledged %d, want 14: %q", len(acked), kinds)
	}
	if err := aAdmin.RemoveWebhook(ctx, "", stuckWh.ID); err != nil {
		t.Fatal(err)
	}
	err = aAdmin.RemoveWebhook(ctx, "", stuckWh.ID)
	wantErr(t, "remove it again", err, dsec.ErrNotFound, "")

	// A rotation: during the overlap each delivery is signed with the new
	// secret and the old (a receiver holding either verifies it); retired
	// at once, with the new alone. A runner cannot rotate.
	_, err = a.RotateWebhookSecret(ctx, wh.ID, nil)
	wantErr(t, "a runner rotates a webhook", err, dsec.ErrPermissionDenied, "")
	rot := check(aAdmin.RotateWebhookSecret(ctx, wh.ID, &dsec.RotateOptions{Overlap: time.Hour}))(t)
	if rot.Secret == "" || rot.Secret == wh.Secret || rot.PreviousSecretUntil.Before(time.Now().Add(59*time.Minute)) {
		t.Fatalf("RotateWebhookSecret: %+v", rot)
	}
	flaky.mu.Lock()
	flaky.secret = "" // the test checks the signatures itself now
	flaky.mu.Unlock()
	n := 14
	// signedWith makes events until one is delivered with want v1
	// signatures (a claim, every 2 s, brings the rotation to the
	// deliveries), then checks it verifies with each of secrets.
	signedWith := func(want int, secrets ...string) {
		t.Helper()
		for range 20 {
			sb := check(a.Create(ctx, "busybox", nil))(t)
			n++
			flaky.waitAcked(t, n)
			flaky.mu.Lock()
			header, body, v1s := flaky.header, flaky.body, flaky.v1s
			flaky.mu.Unlock()
			if v1s == want {
				for _, s := range secrets {
					if err := webhook.Verify(s, header, body, time.Now(), 0); err != nil {
						t.Fatalf("a delivery with %d v1 signatures, secret %q: %v", want, s, err)
					}
				}
				sb.Delete(ctx)
				n++
				flaky.waitAcked(t, n)
				return
			}
			if err := sb.Delete(ctx); err != nil {
				t.Fatal(err)
			}
			n++
			flaky.waitAcked(t, n)
		}
		t.Fatalf("no delivery carried %d v1 signatures", want)
	}
	signedWith(2, wh.Secret, rot.Secret)
	rot2 := check(aAdmin.RotateWebhookSecret(ctx, wh.ID, &dsec.RotateOptions{Secret: "third-secret", Overlap: -1}))(t)
	if rot2.Secret != "third-secret" || !rot2.PreviousSecretUntil.IsZero() {
		t.Fatalf("RotateWebhookSecret without overlap: %+v", rot2)
	}
	signedWith(1, "third-secret")
}

// TestWebhookBatches: a burst (30 sandboxes made and deleted while the
// endpoint holds its first delivery) reaches a webhook of batches of 20 in
// three deliveries after the first, each an envelope of at most 20 events
// signed over the whole body, in ID order, none twice, the cursor at the
// last; a webhook of single events gets each event alone, as before
// batches; batches the server does not take are refused.
func TestWebhookBatches(t *testing.T) {
	ctx := t.Context()
	e := startEventsEnv(t, filepath.Join(t.TempDir(), "meta.db"))
	aAdmin, a := client(t, e.url, e.aAdmin), client(t, e.url, e.a)
	for _, o := range []dsec.WebhookOptions{{Batch: 1001}, {Batch: -1}, {Batch: 5, Single: true}} {
		_, err := aAdmin.AddWebhook(ctx, "http://127.0.0.1:1/hook", &o)
		wantErr(t, fmt.Sprintf("a webhook with %+v", o), err, dsec.ErrInvalidArgument, "batch")
	}
	ok := func(string, int) int { return http.StatusOK }
	batched, single := newReceiver(t, ok), newReceiver(t, ok)
	batched.gate = make(chan struct{})
	bw := check(aAdmin.AddWebhook(ctx, batched.srv.URL, &dsec.WebhookOptions{Batch: 20, Secret: "batch-secret"}))(t)
	sw := check(aAdmin.AddWebhook(ctx, single.srv.URL, &dsec.WebhookOptions{Single: true, Secret: "single-secret"}))(t)
	batched.secret, single.secret = bw.Secret, sw.Secret
	ws := check(aAdmin.Webhooks(ctx, ""))(t)
	batches := map[string]int{}
	for _, w := range ws {
		batches[w.ID] = w.Batch
	}
	if batches[bw.ID] != 20 || batches[sw.ID] != 0 || bw.Batch != 20 || sw.Batch != 0 {
		t.Fatalf("batches %v (added %d and %d), want 20 and 0", batches, bw.Batch, sw.Batch)
	}

	first := check(a.Create(ctx, "busybox", nil))(t)
	<-batched.hanging // its first delivery, first's created alone, waits at the gate
	stored := burstStored(t, a, first)
	close(batched.gate)
	batched.waitAcked(t, 61)
	single.waitAcked(t, 61)
	var want []int64
	for _, ev := range stored {
		want = append(want, ev.ID)
	}
	for name, r := range map[string]*receiver{"batched": batched, "single": single} {
		r.mu.Lock()
		ids, shapes := slices.Clone(r.ids), slices.Clone(r.shapes)
		r.mu.Unlock()
		if !slices.Equal(ids, want) {
			t.Errorf("%s: acknowledged %v, want the 61 stored once each in order %v", name, ids, want)
		}
		if name == "single" {
			for _, d := range shapes {
				if d.batched || d.events != 1 {
					t.Fatalf("single: a delivery %+v, want one event's own body", d)
				}
			}
			continue
		}
		if len(shapes) != 4 || shapes[0] != (delivery{true, 1}) {
			t.Fatalf("batched: deliveries %+v, want the first's created alone then the burst's 60 in three of 20", shapes)
		}
		for _, d := range shapes[1:] {
			if !d.batched || d.events != 20 {
				t.Fatalf("batched: deliveries %+v, want the burst's 60 in three of 20", shapes)
			}
		}
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ws = check(aAdmin.Webhooks(ctx, ""))(t)
		if ws[0].Delivered == want[60] && ws[1].Delivered == want[60] {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("cursors %d and %d, want the last event's %d", ws[0].Delivered, ws[1].Delivered, want[60])
		}
	}
}

// TestWebhookUpdate: a webhook added single (as those added before
// batches are) moves to batches in place: the events that waited while it
// changed are all delivered once each, none lost as a delete and re-add
// would lose them, in batches once its deliveries took the change (the
// endpoint refuses single ones meanwhile), signed with the secret it had,
// and its cursor goes on; a URL, kinds and single events are changed the same
// way, each checked as AddWebhook checks it; a runner, another project
// and an unknown webhook are refused.
func TestWebhookUpdate(t *testing.T) {
	ctx := t.Context()
	e := startEventsEnv(t, filepath.Join(t.TempDir(), "meta.db"))
	aAdmin, a := client(t, e.url, e.aAdmin), client(t, e.url, e.a)
	var r *receiver
	r = newReceiver(t, func(string, int) int {
		if !r.shapes[len(r.shapes)-1].batched { // serve holds r.mu
			return http.StatusServiceUnavailable
		}
		return http.StatusOK
	})
	r.gate = make(chan struct{})
	wh := check(aAdmin.AddWebhook(ctx, r.srv.URL, &dsec.WebhookOptions{Single: true, Secret: "kept-secret"}))(t)
	r.secret = wh.Secret

	first := check(a.Create(ctx, "busybox", nil))(t)
	<-r.hanging // its created, a single event's delivery, waits at the gate
	twenty := 20
	up := check(aAdmin.UpdateWebhook(ctx, wh.ID, dsec.WebhookUpdate{Batch: &twenty}))(t)
	if up.Batch != 20 || up.URL != wh.URL || up.Delivered != wh.Delivered || up.Secret != "" {
		t.Fatalf("UpdateWebhook to a batch of 20: %+v, want batch 20, the URL and cursor it had, no secret", up)
	}
	stored := burstStored(t, a, first)
	close(r.gate)
	var want []int64
	for _, ev := range stored {
		want = append(want, ev.ID)
	}
	r.waitAcked(t, 61)
	r.mu.Lock()
	ids, shapes := slices.Clone(r.ids), slices.Clone(r.shapes)
	r.mu.Unlock()
	if !slices.Equal(ids, want) {
		t.Fatalf("acknowledged %v, want the 61 stored once each in order: %v", ids, want)
	}
	for _, d := range shapes {
		if d.events > 20 {
			t.Errorf("a delivery %+v, want at most the batch of 20", d)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ws := check(aAdmin.Webhooks(ctx, ""))(t)
		if len(ws) == 1 && ws[0].Delivered == want[60] && ws[0].Batch == 20 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("webhooks %+v, want %s at batch 20 with its cursor at the last event's %d", ws, wh.ID, want[60])
		}
	}

	// The URL, kinds and single events, each left as it is unless named.
	url := "https://hooks.example/dsec"
	up = check(aAdmin.UpdateWebhook(ctx, wh.ID, dsec.WebhookUpdate{URL: &url, Kinds: []string{"deleted", "failed"}}))(t)
	if up.URL != url || !slices.Equal(up.Kinds, []string{"deleted", "failed"}) || up.Batch != 20 {
		t.Errorf("UpdateWebhook of the URL and kinds: %+v", up)
	}
	up = check(aAdmin.UpdateWebhook(ctx, wh.ID, dsec.WebhookUpdate{Single: true, Kinds: []string{}}))(t)
	if up.URL != url || len(up.Kinds) != 0 || up.Batch != 0 || up.Delivered != want[60] {
		t.Errorf("UpdateWebhook to single events of every kind: %+v", up)
	}
	for _, c := range []struct {
		u    dsec.WebhookUpdate
		want string
	}{
		{dsec.WebhookUpdate{Batch: new(int(1001))}, "batch"},
		{dsec.WebhookUpdate{Batch: &twenty, Single: true}, "single"},
		{dsec.WebhookUpdate{URL: new("ftp://hooks.example/x")}, "url"},
		{dsec.WebhookUpdate{Kinds: []string{"exploded"}}, "exploded"},
	} {
		_, err := aAdmin.UpdateWebhook(ctx, wh.ID, c.u)
		wantErr(t, fmt.Sprintf("UpdateWebhook %+v", c.u), err, dsec.ErrInvalidArgument, c.want)
	}
	_, err := aAdmin.UpdateWebhook(ctx, "wh-none", dsec.WebhookUpdate{Batch: &twenty})
	wantErr(t, "UpdateWebhook of an unknown webhook", err, dsec.ErrNotFound, "wh-none")
	_, err = a.UpdateWebhook(ctx, wh.ID, dsec.WebhookUpdate{Batch: &twenty})
	wantErr(t, "UpdateWebhook by a runner", err, dsec.ErrPermissionDenied, "")
	_, err = client(t, e.url, e.admin).UpdateWebhook(ctx, wh.ID, dsec.WebhookUpdate{Project: "b", Batch: &twenty})
	wantErr(t, "UpdateWebhook through another project", err, dsec.ErrNotFound, wh.ID)
}

// burstStored makes 30 sandboxes through a and deletes them, waits until
// the store holds their 60 events after first's created, and returns the
// 61 events stored.
func burstStored(t *testing.T, a *dsec.Client, first *dsec.Sandbox) []dsec.SandboxEvent {
	t.Helper()
	ctx := t.Context()
	burst := check(a.CreateMany(ctx, 30, "busybox", nil))(t)
	for _, sb := range burst {
		if err := sb.Delete(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var stored []dsec.SandboxEvent
	for deadline := time.Now().Add(20 * time.Second); len(stored) < 61; time.Sleep(20 * time.Millisecond) {
		stored, _ = check2(a.Events(ctx, dsec.EventQuery{}))(t)
		if time.Now().After(deadline) {
			t.Fatalf("%d events stored, want 61", len(stored))
		}
	}
	if stored[0].SandboxID != first.ID || stored[0].Kind != "created" {
		t.Fatalf("the first event stored is %+v, want %s's created", stored[0], first.ID)
	}
	return stored
}
