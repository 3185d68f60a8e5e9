package dsec

import (
	"context"
	"fmt"
	"iter"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Event kinds (docs/events.md).
const (
	EventCreated    = "created"     // made, or taken from a warm pool for a create
	EventPaused     = "paused"      //
	EventResumed    = "resumed"     //
	EventPhaseEnded = "phase_ended" // Reason names the phase that ended
	EventForked     = "forked"      // the parent; Message lists the children
	EventSnapshot   = "snapshot"    // Message names the snapshot's layer
	EventDeleted    = "deleted"     // by a caller
	EventExpired    = "expired"     // Reason ttl, idle or paused_too_long
	EventFailed     = "failed"      // Reason oom, agent_lost, start_error, node_lost…
)

// SandboxEvent is one step of a sandbox's life, as its node saw it.
type SandboxEvent struct {
	ID        int64     `json:"id"` // the cursor: EventQuery.After
	Key       string    `json:"key"`
	At        time.Time `json:"at"`
	Project   string    `json:"project"`
	SandboxID string    `json:"sandbox_id"`
	Kind      string    `json:"kind"`
	Node      string    `json:"node,omitempty"`
	Reason    string    `json:"reason,omitempty"`
	Message   string    `json:"message,omitempty"`
}

// EventQuery selects events; zero fields select everything the token may
// see.
type EventQuery struct {
	// Project, when set, reads that project's events and those of the
	// projects under it; unset, the token's project's.
	Project   string
	After     int64 // a cursor: events with a larger ID
	Since     time.Time
	SandboxID string
	Kinds     []string
	// Limit bounds a page of Events (0: the server's 1,000); FollowEvents
	// ends after that many (0: never).
	Limit int
}

func (q EventQuery) msg() *dsecv1.ListEventsRequest {
	m := &dsecv1.ListEventsRequest{Project: optPath(q.Project), After: q.After, SandboxId: q.SandboxID, Kinds: q.Kinds, Limit: int32(q.Limit)}
	if !q.Since.IsZero() {
		m.SinceUnixMs = q.Since.UnixMilli()
	}
	return m
}

func eventOf(e *dsecv1.Event) SandboxEvent {
	return SandboxEvent{ID: e.GetId(), Key: e.GetKey(), At: msTime(e.GetAtUnixMs()), Project: e.GetProject(), SandboxID: e.GetSandboxId(),
		Kind: e.GetKind(), Node: e.GetNode(), Reason: e.GetReason(), Message: e.GetMessage()}
}

// Events returns a page of the events q selects, oldest first, and the
// cursor after it (q.After when the page is empty): pass it as the next
// query's After.
func (c *Client) Events(ctx context.Context, q EventQuery) ([]SandboxEvent, int64, error) {
	r, err := iamCall(ctx, c, true, "list events", c.sb.ListEvents, q.msg())
	if err != nil {
		return nil, 0, err
	}
	out := make([]SandboxEvent, 0, len(r.GetEvents()))
	for _, e := range r.GetEvents() {
		out = append(out, eventOf(e))
	}
	return out, r.GetNext(), nil
}

// FollowEvents yields the events q selects, then each new one as the
// server stores it (within about a second of its node seeing it), until
// ctx ends, q.Limit events came, or the stream breaks: then it yields the
// error and stops. To go on after a break, follow again with After the
// last event's ID: nothing is missed or seen twice.
func (c *Client) FollowEvents(ctx context.Context, q EventQuery) iter.Seq2[SandboxEvent, error] {
	return func(yield func(SandboxEvent, error) bool) {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		stream, err := c.sb.FollowEvents(ctx, connect.NewRequest(q.msg()))
		if err != nil {
			yield(SandboxEvent{}, fmt.Errorf("follow events: %w", fromConnect(err, false)))
			return
		}
		defer stream.Close()
		for stream.Receive() {
			if !yield(eventOf(stream.Msg()), nil) {
				return
			}
		}
		if err := stream.Err(); err != nil && ctx.Err() == nil {
			yield(SandboxEvent{}, fmt.Errorf("follow events: %w", fromConnect(err, false)))
		}
	}
}

// Webhook is an endpoint a project registered for its events
// (docs/events.md): its events are POSTed to it as JSON, up to Batch in a
// delivery, signed with its secret (verify and read them with package
// dsec.dev/dsec/sdk/go/webhook), at least once, in order.
type Webhook struct {
	ID      string
	Project string
	URL     string
	Kinds   []string // none: every kind
	// Batch is the most events one delivery carries, as {"webhook": ID,
	// "events": [...]}; 0: one event a delivery, the event itself as the
	// body (added with Single, or before deliveries carried batches).
	Batch   int
	Created time.Time
	// Delivered is the ID of the last event its endpoint acknowledged;
	// LastOK and LastFailure the times of the last acknowledged and failed
	// attempts, Failures the failed attempts since the last success,
	// LastError the last failure's words.
	Delivered   int64
	LastOK      time.Time
	LastFailure time.Time
	Failures    int
	LastError   string
	// Secret is the signing secret: in AddWebhook's and
	// RotateWebhookSecret's answers only.
	Secret string
	// PreviousSecretUntil, after a rotation, is when the previous secret
	// stops signing beside the current one (zero: no rotation under way).
	PreviousSecretUntil time.Time
}

// WebhookOptions are AddWebhook's options.
type WebhookOptions struct {
	Project string   // unset: the token's project
	Kinds   []string // none: every kind
	Secret  string   // "": the server makes one (in the answer, once)
	// Batch is the most events one delivery carries: 0 is 100, at most
	// 1,000. A delivery carries the events waiting, up to it.
	Batch int
	// Single makes each delivery one event, the event object itself as
	// the body, for a receiver written for that format (Batch must be 0).
	Single bool
}

func webhookOf(w *dsecv1.Webhook) Webhook {
	return Webhook{ID: w.GetId(), Project: w.GetProject(), URL: w.GetUrl(), Kinds: w.GetKinds(), Batch: int(w.GetBatch()), Created: msTime(w.GetCreatedUnixMs()),
		Delivered: w.GetDelivered(), LastOK: msTime(w.GetLastOkUnixMs()), LastFailure: msTime(w.GetLastFailureUnixMs()),
		Failures: int(w.GetFailures()), LastError: w.GetLastError(), Secret: w.GetSecret(),
		PreviousSecretUntil: msTime(w.GetPreviousSecretUntilUnixMs())}
}

// AddWebhook registers url for the events of a project (an admin's) and
// those under it, from now on. The server refuses http:// and loopback
// or private addresses unless its operator allowed them.
func (c *Client) AddWebhook(ctx context.Context, url string, o *WebhookOptions) (Webhook, error) {
	if o == nil {
		o = &WebhookOptions{}
	}
	r, err := iamCall(ctx, c, false, "add webhook", c.sb.AddWebhook,
		&dsecv1.AddWebhookRequest{Project: optPath(o.Project), Url: url, Kinds: o.Kinds, Secret: o.Secret,
			Batch: int32(o.Batch), Single: o.Single})
	if err != nil {
		return Webhook{}, err
	}
	return webhookOf(r), nil
}

// Webhooks lists the webhooks of a project ("" the token's) and those
// under it, with how far their deliveries got.
func (c *Client) Webhooks(ctx context.Context, project string) ([]Webhook, error) {
	r, err := iamCall(ctx, c, true, "list webhooks", c.sb.ListWebhooks, &dsecv1.ListWebhooksRequest{Project: optPath(project)})
	if err != nil {
		return nil, err
	}
	out := make([]Webhook, 0, len(r.GetWebhooks()))
	for _, w := range r.GetWebhooks() {
		out = append(out, webhookOf(w))
	}
	return out, nil
}

// RemoveWebhook removes webhook id of a project ("" the token's) or one
// under it.
func (c *Client) RemoveWebhook(ctx context.Context, project, id string) error {
	_, err := iamCall(ctx, c, true, "remove webhook "+id, c.sb.RemoveWebhook, &dsecv1.RemoveWebhookRequest{Project: optPath(project), Id: id})
	return err
}

// WebhookUpdate is what UpdateWebhook changes; what it leaves nil (and
// Single false) stays.
type WebhookUpdate struct {
	Project string  // unset: the token's project
	URL     *string // a new endpoint, checked as AddWebhook checks it
	// Kinds, when not nil, replaces the kinds it gets (empty: every kind).
	Kinds []string
	// Batch, when not nil, is the most events one delivery carries: 0 is
	// 100, at most 1,000. A webhook added before batches (Batch 0) moves
	// to them so, keeping its cursor and secret.
	Batch *int
	// Single makes each delivery one event, bare (Batch must be nil).
	Single bool
}

// UpdateWebhook changes webhook id in place and returns it as it now is:
// its cursor (no event skipped or sent twice for the change), secret and
// history stay; its deliveries take the change within seconds.
func (c *Client) UpdateWebhook(ctx context.Context, id string, u WebhookUpdate) (Webhook, error) {
	req := &dsecv1.UpdateWebhookRequest{Project: optPath(u.Project), Id: id, Url: u.URL, Single: u.Single}
	if u.Kinds != nil {
		req.SetKinds, req.Kinds = true, u.Kinds
	}
	if u.Batch != nil {
		b := int32(*u.Batch)
		req.Batch = &b
	}
	r, err := iamCall(ctx, c, true, "update webhook "+id, c.sb.UpdateWebhook, req)
	if err != nil {
		return Webhook{}, err
	}
	return webhookOf(r), nil
}

// RotateOptions are RotateWebhookSecret's options.
type RotateOptions struct {
	Project string // unset: the token's project
	Secret  string // "": the server makes one (in the answer, once)
	// Overlap is how long the old secret signs deliveries beside the new
	// one (two v1= entries), while receivers move over: 0 is 24 hours, a
	// negative value retires the old secret at once.
	Overlap time.Duration
}

// RotateWebhookSecret gives webhook id a new signing secret, returned in
// the answer's Secret; for the overlap each delivery is signed with both,
// so a receiver verifying with either keeps working
// (webhook.Verify accepts any matching v1).
func (c *Client) RotateWebhookSecret(ctx context.Context, id string, o *RotateOptions) (Webhook, error) {
	if o == nil {
		o = &RotateOptions{}
	}
	secs := int64(o.Overlap / time.Second)
	if o.Overlap < 0 {
		secs = -1
	} else if o.Overlap > 0 && secs == 0 {
		secs = 1
	}
	r, err := iamCall(ctx, c, false, "rotate webhook "+id+"'s secret", c.sb.RotateWebhookSecret,
		&dsecv1.RotateWebhookSecretRequest{Project: optPath(o.Project), Id: id, Secret: o.Secret, OverlapSeconds: secs})
	if err != nil {
		return Webhook{}, err
	}
	return webhookOf(r), nil
}
