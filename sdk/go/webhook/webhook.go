// Package webhook signs and verifies dsec's webhook deliveries
// (docs/events.md), and reads their events. Each delivery is an HTTP POST
// of JSON, {"webhook": ID, "events": [...]} with the events waiting (up to
// the webhook's batch), or for a webhook added with single one event
// object; either way with the header
//
//	Dsec-Signature: t=UNIX_SECONDS,v1=HEX
//
// where HEX is the HMAC-SHA256, keyed with the webhook's secret, of the
// decimal timestamp, a dot, and the body's exact bytes. A receiver checks
// it with Verify before trusting the body, and refuses a timestamp too far
// from its clock (a replayed delivery); then Events reads the body, of
// either form. It sits beside the SDK so a receiver needs no server code;
// apiservers sign with Sign.
package webhook

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Header is the name of the signature's header.
const Header = "Dsec-Signature"

// DefaultTolerance is how far a delivery's timestamp may be from the
// receiver's clock.
const DefaultTolerance = 5 * time.Minute

// ErrSignature is returned (wrapped) for a delivery that does not verify.
var ErrSignature = errors.New("webhook signature does not verify")

func mac(secret string, t int64, body []byte) []byte {
	h := hmac.New(sha256.New, []byte(secret))
	h.Write([]byte(strconv.FormatInt(t, 10)))
	h.Write([]byte("."))
	h.Write(body)
	return h.Sum(nil)
}

// Sign returns the Dsec-Signature header's value for body sent at t,
// with a v1 signature for each secret: more than one while a webhook's
// secret is rotated (the new, then the old), so a receiver holding either
// verifies it.
func Sign(secret string, t time.Time, body []byte, more ...string) string {
	ts := t.Unix()
	var b strings.Builder
	fmt.Fprintf(&b, "t=%d", ts)
	for _, s := range append([]string{secret}, more...) {
		b.WriteString(",v1=")
		b.WriteString(hex.EncodeToString(mac(s, ts, body)))
	}
	return b.String()
}

// Verify checks header (the Dsec-Signature value) against body and
// secret, and that its timestamp lies within tolerance of now (0:
// DefaultTolerance). Any v1 signature in the header may match (a secret
// being rotated).
func Verify(secret, header string, body []byte, now time.Time, tolerance time.Duration) error {
	if tolerance == 0 {
		tolerance = DefaultTolerance
	}
	var ts int64 = -1
	var sigs [][]byte
	for _, part := range strings.Split(header, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			continue
		}
		switch k {
		case "t":
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return fmt.Errorf("%w: timestamp %q", ErrSignature, v)
			}
			ts = n
		case "v1":
			b, err := hex.DecodeString(v)
			if err == nil {
				sigs = append(sigs, b)
			}
		}
	}
	if ts < 0 || len(sigs) == 0 {
		return fmt.Errorf("%w: header %q has no t= and v1=", ErrSignature, header)
	}
	if d := now.Sub(time.Unix(ts, 0)); d > tolerance || d < -tolerance {
		return fmt.Errorf("%w: signed at %s, %s from now (tolerance %s)", ErrSignature, time.Unix(ts, 0).UTC().Format(time.RFC3339), d.Round(time.Second), tolerance)
	}
	want := mac(secret, ts, body)
	for _, s := range sigs {
		if hmac.Equal(s, want) {
			return nil
		}
	}
	return fmt.Errorf("%w: no v1 signature matches the body", ErrSignature)
}

// Event is one event of a delivery.
type Event struct {
	// Webhook is the webhook's ID in a single event's delivery; in a
	// batch the envelope names it.
	Webhook string `json:"webhook,omitempty"`
	// ID is the event's cursor: it only grows. A receiver deduplicates by
	// it (or Key): an event is delivered at least once.
	ID        int64     `json:"id"`
	Key       string    `json:"key"` // NODE/EPOCH/SEQ
	At        time.Time `json:"at"`
	Project   string    `json:"project"`
	SandboxID string    `json:"sandbox_id"`
	Kind      string    `json:"kind"`
	Node      string    `json:"node,omitempty"`
	Reason    string    `json:"reason,omitempty"`
	Message   string    `json:"message,omitempty"`
}

// Delivery is a batched delivery's body: the webhook's events in ID
// order, at most its batch.
type Delivery struct {
	Webhook string  `json:"webhook"`
	Events  []Event `json:"events"`
}

// Events reads a delivery's body (verified first with Verify): a batch's
// events in order, or a single event's delivery as one.
func Events(body []byte) ([]Event, error) {
	var d struct {
		Webhook string   `json:"webhook"`
		Events  *[]Event `json:"events"`
	}
	if err := json.Unmarshal(body, &d); err != nil {
		return nil, fmt.Errorf("read a webhook delivery: %w", err)
	}
	if d.Events != nil {
		evs := *d.Events
		for i := range evs {
			evs[i].Webhook = d.Webhook
		}
		return evs, nil
	}
	var e Event
	if err := json.Unmarshal(body, &e); err != nil {
		return nil, fmt.Errorf("read a webhook delivery: %w", err)
	}
	if e.ID == 0 {
		return nil, fmt.Errorf("read a webhook delivery: neither events nor an event's id in %.80q", body)
	}
	return []Event{e}, nil
}
