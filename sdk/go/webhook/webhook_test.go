package webhook

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestVerify: a signed body verifies; a tampered body, another secret, a
// stale or future timestamp, and a malformed header do not.
func TestVerify(t *testing.T) {
	body := []byte(`{"id":7,"kind":"deleted","sandbox_id":"sb-n1-a"}`)
	at := time.Unix(1_800_000_000, 0)
	h := Sign("s3cret", at, body)
	if !strings.HasPrefix(h, "t=1800000000,v1=") {
		t.Fatalf("header %q", h)
	}
	if err := Verify("s3cret", h, body, at.Add(time.Minute), 0); err != nil {
		t.Fatalf("a signed body: %v", err)
	}
	if err := Verify("s3cret", "v1=00,"+h, body, at, 0); err != nil {
		t.Fatalf("with another v1 beside: %v", err)
	}
	// Rotating: signed with the new and the old secret, either verifies.
	both := Sign("new", at, body, "s3cret")
	if strings.Count(both, "v1=") != 2 {
		t.Fatalf("rotating header %q, want two v1 entries", both)
	}
	for _, s := range []string{"new", "s3cret"} {
		if err := Verify(s, both, body, at, 0); err != nil {
			t.Fatalf("rotating, secret %s: %v", s, err)
		}
	}
	if err := Verify("third", both, body, at, 0); !errors.Is(err, ErrSignature) {
		t.Fatalf("rotating, a third secret: %v", err)
	}
	tampered := []byte(strings.Replace(string(body), "deleted", "created", 1))
	for _, tc := range []struct {
		name, secret, header string
		body                 []byte
		now                  time.Time
	}{
		{"tampered body", "s3cret", h, tampered, at},
		{"another secret", "other", h, body, at},
		{"stale", "s3cret", h, body, at.Add(6 * time.Minute)},
		{"future", "s3cret", h, body, at.Add(-6 * time.Minute)},
		{"no signature", "s3cret", "t=1800000000", body, at},
		{"garbage", "s3cret", "nonsense", body, at},
		{"another timestamp", "s3cret", strings.Replace(h, "t=1800000000", "t=1800000001", 1), body, at},
	} {
		if err := Verify(tc.secret, tc.header, tc.body, tc.now, 0); !errors.Is(err, ErrSignature) {
			t.Errorf("%s: %v, want ErrSignature", tc.name, err)
		}
	}
}

// TestEvents: Events reads a batch's envelope in order (each event naming
// the webhook) and a single event's body as one; other bodies are errors.
func TestEvents(t *testing.T) {
	batch := []byte(`{"webhook":"wh-1","events":[{"id":7,"key":"n1/e/1","at":"2026-12-06T10:02:11.204123456Z","project":"ml",` +
		`"sandbox_id":"sb-n1-a","kind":"created"},{"id":9,"key":"n1/e/2","at":"2026-12-06T10:02:12Z","project":"ml",` +
		`"sandbox_id":"sb-n1-a","kind":"failed","node":"n1","reason":"oom","message":"its agent was OOM-killed"}]}`)
	evs, err := Events(batch)
	if err != nil {
		t.Fatal(err)
	}
	want := []Event{
		{Webhook: "wh-1", ID: 7, Key: "n1/e/1", At: time.Date(2026, 12, 6, 10, 2, 11, 204123456, time.UTC), Project: "ml", SandboxID: "sb-n1-a", Kind: "created"},
		{Webhook: "wh-1", ID: 9, Key: "n1/e/2", At: time.Date(2026, 12, 6, 10, 2, 12, 0, time.UTC), Project: "ml", SandboxID: "sb-n1-a", Kind: "failed",
			Node: "n1", Reason: "oom", Message: "its agent was OOM-killed"},
	}
	if len(evs) != 2 || !reflect.DeepEqual(evs, want) {
		t.Fatalf("Events(batch) = %+v, want %+v", evs, want)
	}
	single := []byte(`{"webhook":"wh-1","id":7,"key":"n1/e/1","at":"2026-12-06T10:02:11Z","project":"ml","sandbox_id":"sb-n1-a","kind":"created"}`)
	evs, err = Events(single)
	if err != nil || len(evs) != 1 || evs[0].ID != 7 || evs[0].Webhook != "wh-1" || evs[0].Kind != "created" {
		t.Fatalf("Events(single) = %+v, %v", evs, err)
	}
	if evs, err := Events([]byte(`{"webhook":"wh-1","events":[]}`)); err != nil || len(evs) != 0 {
		t.Fatalf("Events(an empty batch) = %+v, %v", evs, err)
	}
	for _, body := range []string{`nonsense`, `{"kind":"created"}`, `[1,2]`} {
		if _, err := Events([]byte(body)); err == nil {
			t.Errorf("Events(%s) took it", body)
		}
	}
}
