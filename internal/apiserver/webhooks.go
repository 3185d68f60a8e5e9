package apiserver

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/sdk/go/webhook"
)

// Webhooks (docs/events.md). Every apiserver runs RunWebhooks: it takes
// the lease of each webhook no other apiserver holds (the store's
// ClaimWebhooks), renews it while it delivers, and delivers each leased
// webhook's events in its own goroutine, one at a time and in order, from
// the last acknowledged: a POST of the events waiting (up to the
// webhook's batch, or one event alone for a webhook added single) as
// JSON, signed, bounded in time, retried with backoff until the endpoint
// answers 2xx, then the webhook's cursor advanced in the store past them. So an event is delivered at
// least once (twice only when an apiserver dies between an endpoint's 2xx
// and its record), two apiservers never deliver one webhook at once, and a
// restarted apiserver (or another, once the lease lapses) resumes after
// the last acknowledged. A hanging or failing endpoint holds only its own
// goroutine: the API's calls never wait on a delivery.

const (
	// DefaultWebhookTimeout bounds one delivery attempt.
	DefaultWebhookTimeout = 10 * time.Second
	// DefaultWebhookMaxActive is how many webhooks one apiserver delivers
	// at once.
	DefaultWebhookMaxActive = 256
	// webhookLease is how long a claim holds a webhook; claims renew it
	// every webhookClaimEvery.
	webhookLease      = 15 * time.Second
	webhookClaimEvery = 2 * time.Second
	// webhookPage is how many events a delivery loop reads at a time (a
	// larger batch reads its batch).
	webhookPage = 100
	// webhookMaxBackoff caps the wait between attempts of one event.
	webhookMaxBackoff = time.Minute
)

// WebhookStore is what the apiserver needs of the store for webhooks.
type WebhookStore interface {
	store.Webhooks
	ListEvents(ctx context.Context, q store.EventQuery) ([]store.Event, error)
	LastEventID(ctx context.Context) (int64, error)
}

// webhookState counts deliveries for /metrics; claim asks RunWebhooks to
// claim at once (a webhook changed through this apiserver).
type webhookState struct {
	delivered atomic.Int64
	failed    atomic.Int64
	claim     chan struct{}
}

// Webhook batches: a delivery carries up to a webhook's batch of the
// events waiting (DefaultWebhookBatch unless its AddWebhook said).
const (
	DefaultWebhookBatch = 100
	MaxWebhookBatch     = 1000
)

// eventKinds are the kinds an edge records (package eventlog's; a test
// checks they agree).
var eventKinds = []string{"created", "paused", "resumed", "phase_ended", "forked", "snapshot", "deleted", "expired", "failed"}

// checkEventKinds refuses a kind no edge records: a webhook or a filter
// on one would wait for events that never come.
func checkEventKinds(kinds []string) error {
	for _, k := range kinds {
		if !slices.Contains(eventKinds, k) {
			return fmt.Errorf("event kind %q is not one of %s: %w", k, strings.Join(eventKinds, ", "), errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// checkWebhookURL refuses what an operator would not want by default: a
// scheme other than https, or a host that is an address on loopback, a
// private network, link-local or unspecified (a delivery also refuses to
// connect to one, whatever the name resolved to). allowPrivate
// (--webhook-allow-private) allows http and those addresses.
func checkWebhookURL(raw string, allowPrivate bool) error {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http") {
		return fmt.Errorf("webhook url %q: want https://HOST/PATH: %w", raw, errdefs.ErrInvalidArgument)
	}
	if allowPrivate {
		return nil
	}
	if u.Scheme != "https" {
		return fmt.Errorf("webhook url %q: only https (the server allows http with --webhook-allow-private): %w", raw, errdefs.ErrInvalidArgument)
	}
	if ip, err := netip.ParseAddr(u.Hostname()); err == nil && privateAddr(ip) {
		return fmt.Errorf("webhook url %q: %s is a loopback, private or link-local address (the server allows them with --webhook-allow-private): %w", raw, ip, errdefs.ErrInvalidArgument)
	}
	if u.Hostname() == "localhost" {
		return fmt.Errorf("webhook url %q: localhost (the server allows it with --webhook-allow-private): %w", raw, errdefs.ErrInvalidArgument)
	}
	return nil
}

func privateAddr(ip netip.Addr) bool {
	ip = ip.Unmap()
	return ip.IsLoopback() || ip.IsPrivate() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() || ip.IsUnspecified() ||
		ip.IsMulticast() || ip.IsInterfaceLocalMulticast()
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func webhookMsg(w store.Webhook) *dsecv1.Webhook {
	out := &dsecv1.Webhook{Id: w.ID, Project: w.Project, Url: w.URL, Kinds: w.Kinds, Batch: int32(w.Batch), CreatedUnixMs: unixMs(w.Created),
		Delivered: w.Delivered, LastOkUnixMs: unixMs(w.LastOK), LastFailureUnixMs: unixMs(w.LastFailure),
		Failures: int32(w.Failures), LastError: w.LastError}
	if w.PrevSecret != "" && w.PrevUntil.After(time.Now()) {
		out.PreviousSecretUntilUnixMs = unixMs(w.PrevUntil)
	}
	return out
}

// DefaultWebhookOverlap is how long a rotated-out secret still signs.
const DefaultWebhookOverlap = 24 * time.Hour

// RotateWebhookSecret gives a webhook a new secret (returned once); the
// old one signs beside it for the overlap. Deliveries pick it up within a
// lease renewal (webhookClaimEvery).
func (s *Server) RotateWebhookSecret(ctx context.Context, req *connect.Request[dsecv1.RotateWebhookSecretRequest]) (*connect.Response[dsecv1.Webhook], error) {
	m := req.Msg
	path, err := s.webhookProject(ctx, dsecv1connect.SandboxServiceRotateWebhookSecretProcedure, m.Project)
	if err != nil {
		return nil, err
	}
	secret := m.GetSecret()
	if secret == "" {
		secret = "whsec_" + randomHex(24)
	}
	overlap := time.Duration(m.GetOverlapSeconds()) * time.Second
	if m.GetOverlapSeconds() == 0 {
		overlap = DefaultWebhookOverlap
	}
	var until time.Time
	if overlap > 0 {
		until = time.Now().Add(overlap)
	}
	if err := s.cfg.Webhooks.RotateWebhookSecret(ctx, path, m.GetId(), secret, until); err != nil {
		return nil, err
	}
	ws, err := s.cfg.Webhooks.ListWebhooks(ctx, []string{path})
	if err != nil {
		return nil, err
	}
	for _, w := range ws {
		if w.ID == m.GetId() {
			out := webhookMsg(w)
			out.Secret = secret
			return connect.NewResponse(out), nil
		}
	}
	return nil, fmt.Errorf("webhook %s: %w", m.GetId(), errdefs.ErrNotFound)
}

// webhookProject is the project a webhook call acts on, checked for op.
func (s *Server) webhookProject(ctx context.Context, op string, p *string) (string, error) {
	if s.cfg.Webhooks == nil {
		return "", fmt.Errorf("webhooks: this server keeps no metadata store: %w", errdefs.ErrNotSupported)
	}
	a := actor(ctx)
	path, err := projectOr(a, p)
	if err != nil {
		return "", err
	}
	return path, allow(a, iam.Op(op), path)
}

// AddWebhook registers an endpoint for the events of a project and those
// under it, from now on.
func (s *Server) AddWebhook(ctx context.Context, req *connect.Request[dsecv1.AddWebhookRequest]) (*connect.Response[dsecv1.Webhook], error) {
	m := req.Msg
	path, err := s.webhookProject(ctx, dsecv1connect.SandboxServiceAddWebhookProcedure, m.Project)
	if err != nil {
		return nil, err
	}
	if err := checkWebhookURL(m.GetUrl(), s.cfg.WebhookAllowPrivate); err != nil {
		return nil, err
	}
	if err := checkEventKinds(m.GetKinds()); err != nil {
		return nil, err
	}
	batch, err := webhookBatch(int(m.GetBatch()), m.GetSingle())
	if err != nil {
		return nil, err
	}
	secret := m.GetSecret()
	if secret == "" {
		secret = "whsec_" + randomHex(24)
	}
	last, err := s.cfg.Webhooks.LastEventID(ctx)
	if err != nil {
		return nil, err
	}
	w := store.Webhook{ID: "wh-" + randomHex(6), Project: path, URL: m.GetUrl(), Kinds: m.GetKinds(), Secret: secret,
		Batch: batch, Created: time.Now(), Delivered: last}
	if err := s.cfg.Webhooks.AddWebhook(ctx, w); err != nil {
		return nil, err
	}
	out := webhookMsg(w)
	out.Secret = secret
	return connect.NewResponse(out), nil
}

// webhookBatch is the batch column of a webhook asked for batch (0: the
// default) or single events.
func webhookBatch(batch int, single bool) (int, error) {
	switch {
	case single && batch != 0:
		return 0, fmt.Errorf("a webhook of single events and a batch of %d: name one: %w", batch, errdefs.ErrInvalidArgument)
	case batch < 0 || batch > MaxWebhookBatch:
		return 0, fmt.Errorf("a webhook's batch of %d: want 1 to %d (0: %d): %w", batch, MaxWebhookBatch, DefaultWebhookBatch, errdefs.ErrInvalidArgument)
	case single:
		return 0, nil // stored as the webhooks before batches: an event a delivery, bare
	case batch == 0:
		return DefaultWebhookBatch, nil
	}
	return batch, nil
}

// UpdateWebhook changes a webhook of a project (or one under it) in place:
// its batch or single events, kinds, URL, each checked as AddWebhook
// checks them. Its cursor and secret stay, so a webhook added before
// batches moves to them without losing its place; its deliveries take the
// change at once when this apiserver holds its lease, else at the holder's
// next claim (RunWebhooks).
func (s *Server) UpdateWebhook(ctx context.Context, req *connect.Request[dsecv1.UpdateWebhookRequest]) (*connect.Response[dsecv1.Webhook], error) {
	m := req.Msg
	path, err := s.webhookProject(ctx, dsecv1connect.SandboxServiceUpdateWebhookProcedure, m.Project)
	if err != nil {
		return nil, err
	}
	if m.GetId() == "" {
		return nil, fmt.Errorf("update a webhook: no id: %w", errdefs.ErrInvalidArgument)
	}
	var u store.WebhookUpdate
	if m.Url != nil {
		if err := checkWebhookURL(m.GetUrl(), s.cfg.WebhookAllowPrivate); err != nil {
			return nil, err
		}
		u.URL = m.Url
	}
	if m.GetSetKinds() {
		if err := checkEventKinds(m.GetKinds()); err != nil {
			return nil, err
		}
		kinds := m.GetKinds()
		u.Kinds = &kinds
	} else if len(m.GetKinds()) > 0 {
		return nil, fmt.Errorf("update webhook %s: kinds without set_kinds: %w", m.GetId(), errdefs.ErrInvalidArgument)
	}
	if m.Batch != nil || m.GetSingle() {
		batch, err := webhookBatch(int(m.GetBatch()), m.GetSingle())
		if err != nil {
			return nil, err
		}
		u.Batch = &batch
	}
	w, err := s.cfg.Webhooks.UpdateWebhook(ctx, path, m.GetId(), u)
	if err != nil {
		return nil, err
	}
	select { // if this apiserver delivers it, at once
	case s.webhooks.claim <- struct{}{}:
	default:
	}
	return connect.NewResponse(webhookMsg(w)), nil
}

// ListWebhooks lists the webhooks of a project and those under it, with
// how far their deliveries got.
func (s *Server) ListWebhooks(ctx context.Context, req *connect.Request[dsecv1.ListWebhooksRequest]) (*connect.Response[dsecv1.ListWebhooksResponse], error) {
	path, err := s.webhookProject(ctx, dsecv1connect.SandboxServiceListWebhooksProcedure, req.Msg.Project)
	if err != nil {
		return nil, err
	}
	ws, err := s.cfg.Webhooks.ListWebhooks(ctx, []string{path})
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListWebhooksResponse{}
	for _, w := range ws {
		out.Webhooks = append(out.Webhooks, webhookMsg(w))
	}
	return connect.NewResponse(out), nil
}

// RemoveWebhook removes a webhook of a project (or one under it); its
// deliveries stop within a lease renewal.
func (s *Server) RemoveWebhook(ctx context.Context, req *connect.Request[dsecv1.RemoveWebhookRequest]) (*connect.Response[dsecv1.RemoveWebhookResponse], error) {
	path, err := s.webhookProject(ctx, dsecv1connect.SandboxServiceRemoveWebhookProcedure, req.Msg.Project)
	if err != nil {
		return nil, err
	}
	if err := s.cfg.Webhooks.RemoveWebhook(ctx, path, req.Msg.GetId()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.RemoveWebhookResponse{}), nil
}

// RunWebhooks delivers the webhooks this apiserver holds the lease of
// until ctx ends (at once without Config.Webhooks).
func (s *Server) RunWebhooks(ctx context.Context) {
	if s.cfg.Webhooks == nil {
		return
	}
	owner := s.cfg.Name + "/" + randomHex(6)
	client := s.webhookClient()
	defer client.CloseIdleConnections()
	var wg sync.WaitGroup
	running := map[string]context.CancelFunc{}
	// current is each running webhook's row as last claimed: a rotated
	// secret or a new URL reaches its deliveries with the next claim. A
	// delivery loop reads the batch and kinds at its start, so one whose
	// row's changed (UpdateWebhook) is stopped and starts again with them
	// at the claim after, from the cursor stored.
	current := map[string]*atomic.Pointer[store.Webhook]{}
	done := make(chan string, 16)
	changed := map[string]bool{} // stopped for a change: claimed again once stopped
	t := time.NewTicker(webhookClaimEvery)
	defer t.Stop()
	for {
		now := time.Now()
		ws, err := s.cfg.Webhooks.ClaimWebhooks(ctx, owner, now, now.Add(webhookLease))
		if err != nil && ctx.Err() == nil {
			s.log.Warn("claim webhooks", "err", err)
		}
		held := map[string]bool{}
		for _, w := range ws {
			held[w.ID] = true
			if running[w.ID] != nil {
				if old := current[w.ID].Swap(&w); old.Batch != w.Batch || !slices.Equal(old.Kinds, w.Kinds) {
					running[w.ID]()
					changed[w.ID] = true
				}
				continue
			}
			if len(running) >= s.cfg.WebhookMaxActive {
				s.log.Warn("webhooks held past the cap: not delivered by this apiserver now", "webhook", w.ID, "cap", s.cfg.WebhookMaxActive)
				continue
			}
			wctx, cancel := context.WithCancel(ctx)
			running[w.ID] = cancel
			cur := new(atomic.Pointer[store.Webhook])
			cur.Store(&w)
			current[w.ID] = cur
			wg.Go(func() {
				defer func() { done <- w.ID }()
				s.deliver(wctx, client, owner, cur)
			})
		}
		// Webhooks removed or no longer this apiserver's stop.
		if err == nil {
			for id, cancel := range running {
				if !held[id] {
					cancel()
				}
			}
		}
		for wait := true; wait; {
			select {
			case <-ctx.Done():
				for _, cancel := range running {
					cancel()
				}
				go func() {
					for range done {
					}
				}()
				wg.Wait()
				close(done)
				// Handed over at once: another apiserver need not wait
				// for the leases to lapse.
				if err := s.cfg.Webhooks.ReleaseWebhooks(context.WithoutCancel(ctx), owner); err != nil {
					s.log.Warn("release webhooks", "err", err)
				}
				return
			case id := <-done:
				running[id]()
				delete(running, id)
				delete(current, id)
				if changed[id] {
					delete(changed, id)
					wait = false
				}
			case <-t.C:
				wait = false
			case <-s.webhooks.claim:
				wait = false
			}
		}
	}
}

// webhookClient posts deliveries: each attempt bounded by the configured
// timeout, and, unless private addresses are allowed, never connecting to
// one, whatever a name resolved to.
func (s *Server) webhookClient() *http.Client {
	dialer := &net.Dialer{Timeout: s.cfg.WebhookTimeout}
	if !s.cfg.WebhookAllowPrivate {
		dialer.Control = func(network, address string, _ syscall.RawConn) error {
			ap, err := netip.ParseAddrPort(address)
			if err != nil {
				return err
			}
			if privateAddr(ap.Addr()) {
				return fmt.Errorf("webhook endpoint %s is a loopback, private or link-local address (--webhook-allow-private allows it)", ap.Addr())
			}
			return nil
		}
	}
	tr := &http.Transport{DialContext: dialer.DialContext, MaxIdleConnsPerHost: 2, IdleConnTimeout: time.Minute,
		TLSHandshakeTimeout: s.cfg.WebhookTimeout, ResponseHeaderTimeout: s.cfg.WebhookTimeout}
	return &http.Client{Transport: tr, Timeout: s.cfg.WebhookTimeout,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// deliver sends w's events after its cursor, in order, each delivery
// (up to w's batch of the events waiting) until its endpoint acknowledges
// it, until ctx ends or the lease is lost.
func (s *Server) deliver(ctx context.Context, client *http.Client, owner string, cur *atomic.Pointer[store.Webhook]) {
	w := *cur.Load()
	cursor := w.Delivered
	batch := max(w.Batch, 1)
	page := max(webhookPage, batch)
	for ctx.Err() == nil {
		changed := *s.events.changed.Load()
		evs, err := s.cfg.Webhooks.ListEvents(ctx, store.EventQuery{Projects: []string{w.Project}, After: cursor, Kinds: w.Kinds, Limit: page})
		if err != nil {
			if ctx.Err() == nil {
				s.log.Warn("read a webhook's events", "webhook", w.ID, "err", err)
			}
			sleepCtx(ctx, time.Second)
			continue
		}
		for rest := evs; len(rest) > 0; {
			n := min(len(rest), batch)
			if !s.deliverOne(ctx, client, owner, cur, rest[:n]) {
				return
			}
			cursor = rest[n-1].ID
			rest = rest[n:]
		}
		if len(evs) == page {
			continue
		}
		t := time.NewTimer(followPoll)
		select {
		case <-ctx.Done():
		case <-changed:
		case <-t.C:
		}
		t.Stop()
	}
}

// deliveryBody is what a delivery of evs to w POSTs: an envelope of them,
// or for a webhook of single events (Batch 0) the one event itself.
func deliveryBody(w store.Webhook, evs []store.Event) ([]byte, error) {
	out := make([]webhook.Event, 0, len(evs))
	for _, ev := range evs {
		out = append(out, webhook.Event{ID: ev.ID, Key: ev.Key, At: ev.At.UTC(), Project: ev.Project,
			SandboxID: ev.SandboxID, Kind: ev.Kind, Node: ev.Node, Reason: ev.Reason, Message: ev.Message})
	}
	if w.Batch == 0 {
		if len(out) != 1 {
			return nil, fmt.Errorf("webhook %s takes one event a delivery, not %d", w.ID, len(out))
		}
		out[0].Webhook = w.ID
		return json.Marshal(out[0])
	}
	return json.Marshal(webhook.Delivery{Webhook: w.ID, Events: out})
}

// deliverOne posts evs (in ID order) to w's endpoint in one delivery until
// it answers 2xx, recording each attempt; it returns false when ctx ended
// or the lease is lost. The cursor advances past the last of evs only on
// the endpoint's acknowledgement.
func (s *Server) deliverOne(ctx context.Context, client *http.Client, owner string, cur *atomic.Pointer[store.Webhook], evs []store.Event) bool {
	w := *cur.Load()
	last := evs[len(evs)-1].ID
	body, err := deliveryBody(w, evs)
	if err != nil {
		s.log.Error("encode a webhook's events", "webhook", w.ID, "event", last, "err", err)
		return false
	}
	for attempt := 0; ; attempt++ {
		err := s.post(ctx, client, *cur.Load(), evs[0].ID, last, len(evs), body)
		if ctx.Err() != nil {
			return false
		}
		if err == nil {
			s.webhooks.delivered.Add(1)
		} else {
			s.webhooks.failed.Add(1)
		}
		if aerr := s.cfg.Webhooks.AdvanceWebhook(context.WithoutCancel(ctx), w.ID, owner, last, time.Now(), err); aerr != nil {
			if errors.Is(aerr, errdefs.ErrFailedPrecondition) {
				return false // another apiserver's now, or removed
			}
			s.log.Warn("record a webhook delivery", "webhook", w.ID, "event", last, "err", aerr)
		}
		if err == nil {
			return true
		}
		s.log.Debug("webhook delivery failed", "webhook", w.ID, "event", last, "attempt", attempt+1, "err", err)
		if !sleepCtx(ctx, backoff(s.cfg.WebhookBackoff, attempt)) {
			return false
		}
	}
}

// backoff is the wait after the attempt-th failure: base doubled each
// time, capped at webhookMaxBackoff.
func backoff(base time.Duration, attempt int) time.Duration {
	d := base << min(attempt, 20)
	if d <= 0 || d > webhookMaxBackoff {
		d = webhookMaxBackoff
	}
	return d
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// post makes one attempt at a delivery of n events, first to last: the
// endpoint must answer 2xx within the timeout.
func (s *Server) post(ctx context.Context, client *http.Client, w store.Webhook, first, last int64, n int, body []byte) error {
	what := fmt.Sprintf("event %d", last)
	if n > 1 {
		what = fmt.Sprintf("events %d to %d (%d)", first, last, n)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.URL, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "dsec-webhook/1")
	now := time.Now()
	var prev []string
	if w.PrevSecret != "" && now.Before(w.PrevUntil) {
		prev = append(prev, w.PrevSecret) // rotating: both sign
	}
	req.Header.Set(webhook.Header, webhook.Sign(w.Secret, now, body, prev...))
	req.Header.Set("Dsec-Webhook-Id", w.ID)
	req.Header.Set("Dsec-Event-Id", fmt.Sprint(last))
	req.Header.Set("Dsec-Event-Count", fmt.Sprint(n))
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("post %s: %w", what, err)
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("post %s: the endpoint answered %s", what, resp.Status)
	}
	return nil
}
