package root

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	dsec "dsec.dev/dsec/sdk/go"
	"dsec.dev/dsec/sdk/go/webhook"
)

// delivery is one POST a webhook endpoint received.
type delivery struct {
	webhookID, eventID, count, signature string
	body                                 []byte
}

// deliveryBody is a batched delivery's JSON, as docs/events.md shows it.
type deliveryBody struct {
	Webhook string `json:"webhook"`
	Events  []struct {
		ID        int64  `json:"id"`
		Key       string `json:"key"`
		Project   string `json:"project"`
		SandboxID string `json:"sandbox_id"`
		Kind      string `json:"kind"`
	} `json:"events"`
}

// TestWebhookDelivery registers two webhooks on a real dsecd (the
// all-in-one, or an apiserver before an edge), one through the CLI and one
// through the Go SDK, each to an HTTP server of the test on loopback. A
// sandbox's life (created, paused, resumed, deleted) reaches the first in
// order, in batched deliveries ({"webhook", "events": [...]}, the last
// event's ID and the count in headers), each signed as docs/events.md
// says over its whole body: webhook.Verify
// accepts it, the HMAC computed by hand over the timestamp and the raw
// body equals v1, and a changed body does not verify. The second endpoint
// hangs on its first delivery: a create and the sandboxes' deletes return
// meanwhile, and their events reach the first endpoint while it hangs.
func TestWebhookDelivery(t *testing.T) {
	// The endpoints are on loopback (an apiserver's flag; the edge of the
	// cluster pass ignores it).
	t.Setenv("DSECD_WEBHOOK_ALLOW_PRIVATE", "true")
	d := startDaemon(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	var mu sync.Mutex
	var got []delivery
	record := func(w http.ResponseWriter, r *http.Request) (delivery, bool) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return delivery{}, false
		}
		return delivery{webhookID: r.Header.Get("Dsec-Webhook-Id"), eventID: r.Header.Get("Dsec-Event-Id"),
			count: r.Header.Get("Dsec-Event-Count"), signature: r.Header.Get(webhook.Header), body: body}, true
	}
	good := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if dl, ok := record(w, r); ok {
			mu.Lock()
			got = append(got, dl)
			mu.Unlock()
		}
	}))
	defer good.Close()
	hanging, release := make(chan struct{}), make(chan struct{})
	var hangOnce sync.Once
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hangOnce.Do(func() { close(hanging) })
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	// Released before the server closes (deferred calls run last first).
	defer hang.Close()
	var releaseOnce sync.Once
	unhang := func() { releaseOnce.Do(func() { close(release) }) }
	defer unhang()

	// The first through the CLI, with a secret of our own.
	const secret = "whsec_test_4c1f0e"
	out, errOut, code := d.CLI("", "--json", "webhook", "add", "--secret", secret, good.URL+"/dsec")
	if code != 0 {
		t.Fatalf("dsec webhook add: exit %d: %s%s", code, out, errOut)
	}
	var added struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal([]byte(out), &added); err != nil || added.ID == "" {
		t.Fatalf("dsec --json webhook add printed %q: %v", out, err)
	}
	// The second through the Go SDK.
	c := sdkClient(t, d.Addr, d.Token())
	if _, err := c.AddWebhook(ctx, hang.URL, nil); err != nil {
		t.Fatal(err)
	}

	sb, err := c.Create(ctx, env, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Delete(context.WithoutCancel(ctx)) })
	select {
	case <-hanging:
	case <-ctx.Done():
		t.Fatal("the hanging endpoint got no delivery")
	}
	// The endpoint hangs: the API's calls return all the same.
	other, err := c.Create(ctx, env, nil)
	if err != nil {
		t.Fatalf("create while a webhook endpoint hangs: %v", err)
	}
	if _, err := sb.Pause(ctx, false); err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*dsec.Sandbox{sb, other} {
		if err := s.Delete(ctx); err != nil {
			t.Fatalf("delete while a webhook endpoint hangs: %v", err)
		}
	}

	// The first endpoint gets both lives, in order, while the other hangs.
	kinds := func(bodies []deliveryBody, id string) []string {
		var out []string
		for _, b := range bodies {
			for _, ev := range b.Events {
				if ev.SandboxID == id {
					out = append(out, ev.Kind)
				}
			}
		}
		return out
	}
	life, short := []string{"created", "paused", "resumed", "deleted"}, []string{"created", "deleted"}
	var dls []delivery
	var bodies []deliveryBody
	for {
		mu.Lock()
		dls = slices.Clone(got)
		mu.Unlock()
		bodies = bodies[:0]
		for _, dl := range dls {
			var b deliveryBody
			if err := json.Unmarshal(dl.body, &b); err != nil {
				t.Fatalf("a delivery's body %q: %v", dl.body, err)
			}
			bodies = append(bodies, b)
		}
		if len(kinds(bodies, sb.ID)) >= len(life) && len(kinds(bodies, other.ID)) >= len(short) {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the endpoint got %q of %s and %q of %s, want %q and %q", kinds(bodies, sb.ID), sb.ID, kinds(bodies, other.ID), other.ID, life, short)
		case <-time.After(100 * time.Millisecond):
		}
	}
	select {
	case <-release:
		t.Fatal("the hanging endpoint was released early")
	default:
	}
	if k := kinds(bodies, sb.ID); !slices.Equal(k, life) {
		t.Fatalf("the endpoint got %q of %s, want %q", k, sb.ID, life)
	}
	if k := kinds(bodies, other.ID); !slices.Equal(k, short) {
		t.Fatalf("the endpoint got %q of %s, want %q", k, other.ID, short)
	}
	var prev int64
	for i, dl := range dls {
		b := bodies[i]
		if len(b.Events) == 0 {
			t.Fatalf("delivery %d carries no events: %s", i, dl.body)
		}
		for _, ev := range b.Events {
			if ev.ID <= prev || ev.Key == "" {
				t.Fatalf("delivery %d has event %d (key %q) after event %d: not in order", i, ev.ID, ev.Key, prev)
			}
			prev = ev.ID
		}
		// webhook.Events reads it as the test did.
		if evs, err := webhook.Events(dl.body); err != nil || len(evs) != len(b.Events) || evs[len(evs)-1].ID != prev {
			t.Fatalf("webhook.Events(delivery %d) = %+v, %v", i, evs, err)
		}
		if dl.webhookID != added.ID || b.Webhook != added.ID || dl.eventID != strconv.FormatInt(prev, 10) || dl.count != strconv.Itoa(len(b.Events)) {
			t.Fatalf("delivery %d: headers Dsec-Webhook-Id %q, Dsec-Event-Id %q, Dsec-Event-Count %q, body %s; want webhook %s", i,
				dl.webhookID, dl.eventID, dl.count, dl.body, added.ID)
		}
		// As a receiver verifies: the SDK's Verify, and by hand.
		if err := webhook.Verify(secret, dl.signature, dl.body, time.Now(), 0); err != nil {
			t.Fatalf("delivery %d (%s): %v", i, dl.signature, err)
		}
		var ts string
		var v1 []string
		for _, part := range strings.Split(dl.signature, ",") {
			k, v, _ := strings.Cut(part, "=")
			switch k {
			case "t":
				ts = v
			case "v1":
				v1 = append(v1, v)
			}
		}
		h := hmac.New(sha256.New, []byte(secret))
		h.Write([]byte(ts + "." + string(dl.body)))
		if want := hex.EncodeToString(h.Sum(nil)); len(v1) != 1 || v1[0] != want {
			t.Fatalf("delivery %d: v1 %q, want the HMAC-SHA256 of t.body %s", i, v1, want)
		}
		changed := append(slices.Clone(dl.body[:len(dl.body)-1]), ' ', '}')
		if err := webhook.Verify(secret, dl.signature, changed, time.Now(), 0); err == nil {
			t.Fatalf("delivery %d verifies with its body changed", i)
		}
	}

	// The webhook's listing shows the last acknowledged event.
	last := prev
	for {
		ws, err := c.Webhooks(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		i := slices.IndexFunc(ws, func(w dsec.Webhook) bool { return w.ID == added.ID })
		if i >= 0 && ws[i].Delivered >= last && ws[i].Failures == 0 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the webhooks: %+v, want %s delivered to %d", ws, added.ID, last)
		case <-time.After(100 * time.Millisecond):
		}
	}

	// Changed in place through the CLI: to single events of one kind,
	// then back to batches of every kind, its cursor kept each time.
	for _, c := range []struct {
		args  []string
		batch int
		kinds []string
	}{
		{[]string{"--single", "--kind", "deleted"}, 0, []string{"deleted"}},
		{[]string{"--batch", "50", "--all-kinds"}, 50, nil},
	} {
		out, errOut, code := d.CLI("", append(append([]string{"--json", "webhook", "set"}, c.args...), added.ID)...)
		if code != 0 {
			t.Fatalf("dsec webhook set %v: exit %d: %s%s", c.args, code, out, errOut)
		}
		var set struct {
			ID        string   `json:"id"`
			Batch     int      `json:"batch"`
			Kinds     []string `json:"kinds"`
			Delivered int64    `json:"delivered"`
			Secret    string   `json:"secret"`
		}
		if err := json.Unmarshal([]byte(out), &set); err != nil || set.ID != added.ID || set.Batch != c.batch ||
			!slices.Equal(set.Kinds, c.kinds) || set.Delivered < last || set.Secret != "" {
			t.Fatalf("dsec --json webhook set %v printed %q (%v); want %s at batch %d, kinds %v, delivered from %d on, no secret",
				c.args, out, err, added.ID, c.batch, c.kinds, last)
		}
	}
	if out, errOut, code := d.CLI("", "webhook", "set", added.ID); code == 0 {
		t.Errorf("dsec webhook set naming nothing to change: exit 0: %s%s", out, errOut)
	}
	unhang()
}
