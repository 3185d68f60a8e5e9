package apiserver_test

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
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
	answer   func(key string, attempt int) int
	hang     chan struct{} // closed: a hanging answer returns
	hanging  chan struct{} // closed when the first hanging request arrived
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
	key := jsonField(string(body), "key")
	r.mu.Lock()
	r.attempts[key]++
	code := r.answer(key, r.attempts[key])
	if code == 0 {
		r.mu.Unlock()
		r.hangOnce.Do(func() { close(r.hanging) })
		<-r.hang
		return
	}
	if code/100 == 2 {
		r.acked = append(r.acked, key)
		r.kinds = append(r.kinds, jsonField(string(body), "kind")+":"+jsonField(string(body), "sandbox_id"))
	}
	r.mu.Unlock()
	w.WriteHeader(code)
}

// jsonField is the string value of "name" in a flat JSON object.
func jsonField(body, name string) string {
	_, rest, ok := strings.Cut(body, `"`+name+`":"`)
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
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
	if attempts[acked[0]] != 3 || attempts[acked[1]] != 1 {
		t.Fatalf("attempts %v: want 3 of the first (two failures, then acknowledged), 1 of the second", attempts)
	}
	ws := check(aAdmin.Webhooks(ctx, ""))(t)
	if len(ws) != 1 || ws[0].ID != wh.ID || ws[0].Secret != "" || ws[0].LastOK.IsZero() || ws[0].LastFailure.IsZero() ||
		ws[0].Failures != 0 || !strings.Contains(ws[0].LastError, "") {
		t.Fatalf("Webhooks: %+v", ws)
	}
	evs, _ := check2(a.Events(ctx, dsec.EventQuery{SandboxID: sb.ID}))(t)
	for deadline := time.Now().Add(10 * time.Second); ; {
		ws = check(aAdmin.Webhooks(ctx, ""))(t)
		if ws[0].Delivered == evs[len(evs)-1].ID || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if ws[0].Delivered != evs[len(evs)-1].ID {
		t.Fatalf("the webhook's cursor is %d, want the deleted event's %d", ws[0].Delivered, evs[len(evs)-1].ID)
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
