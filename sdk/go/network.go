package dsec

import (
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Address is the sandbox's IPv4 address when it was made with network
// rules, else "" (loopback only).
func (s *Sandbox) Address() string { return s.info.GetAddress() }

// Warnings are what the node warned about when it made the sandbox, e.g. a
// network rule that allows nothing on that node. Nothing was refused for
// them, but the sandbox may reach less than its rules read as.
func (s *Sandbox) Warnings() []string { return s.info.GetWarnings() }

// SetNetworkRules replaces the sandbox's network rules (the same mapping as
// CreateOptions.NetworkRules). New connections follow them at once; with cut,
// established connections no longer allowed are broken. It returns the
// node's warnings, such as a service it knows no hosts for.
func (s *Sandbox) SetNetworkRules(ctx context.Context, rules map[string]bool, cut bool) ([]string, error) {
	var warnings []string
	err := s.c.unary(ctx, true, func(ctx context.Context) error {
		r, err := s.c.sb.SetNetworkRules(ctx, connect.NewRequest(&dsecv1.SetNetworkRulesRequest{
			SandboxId: s.ID, Rules: rules, Cut: cut}))
		if err == nil {
			warnings = r.Msg.GetWarnings()
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("set network rules of %s: %w", s.ID, err)
	}
	return warnings, nil
}

// NetworkEvent is one audit record: a connection attempt or a DNS query.
type NetworkEvent struct {
	Time        time.Time
	Kind        string // "connect" or "dns"
	Verdict     string // "allow" or "deny"
	Protocol    string
	Destination string
	Port        int
	Name        string
	BytesOut    int64
	BytesIn     int64
	Rule        string // the rules key that decided, if any
}

// NetworkLog returns the sandbox's network audit records since the given
// time (zero: all kept), oldest first; limit 0 means the node's default.
func (s *Sandbox) NetworkLog(ctx context.Context, since time.Time, limit int) ([]NetworkEvent, error) {
	req := &dsecv1.NetworkLogRequest{SandboxId: s.ID, Limit: int32(limit)}
	if !since.IsZero() {
		req.SinceUnixMs = since.UnixMilli()
	}
	var out []NetworkEvent
	err := s.c.unary(ctx, true, func(ctx context.Context) error {
		r, err := s.c.sb.NetworkLog(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		out = out[:0]
		for _, e := range r.Msg.GetEvents() {
			out = append(out, NetworkEvent{
				Time: time.UnixMilli(e.GetTimeUnixMs()), Kind: e.GetKind(), Verdict: e.GetVerdict(),
				Protocol: e.GetProtocol(), Destination: e.GetDestination(), Port: int(e.GetPort()), Name: e.GetName(),
				BytesOut: e.GetBytesOut(), BytesIn: e.GetBytesIn(), Rule: e.GetRule(),
			})
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("network log of %s: %w", s.ID, err)
	}
	return out, nil
}

// ImageOptions tune ImportImage.
type ImageOptions struct {
	Insecure      bool  // plain HTTP to the registry
	CollapseBelow int64 // merge consecutive layers below this total; 0 node default, <0 never
	AllowSetuid   bool
	// Project is the project the image belongs to (a path; "" the
	// token's), on which the caller holds builder; the bytes of its
	// layers are charged to the project's quota (layer_bytes).
	Project string
	// Progress, if set, gets every progress message.
	Progress func(*dsecv1.ImportImageProgress)
}

// ImportImage imports an OCI image as the environment ref. source is
// oci:DIR[:TAG] or docker-archive:FILE (on the daemon's host) or
// docker://HOST[:PORT]/REPO:TAG. It returns the final message, whose
// LayerDigests are the environment's layers, bottom first.
func (c *Client) ImportImage(ctx context.Context, ref, source string, o *ImageOptions) (*dsecv1.ImportImageProgress, error) {
	if o == nil {
		o = &ImageOptions{}
	}
	ctx, cancel := withTimeout(ctx, time.Hour)
	defer cancel()
	stream, err := c.layers.ImportImage(ctx, connect.NewRequest(&dsecv1.ImportImageRequest{
		Ref: ref, Source: source, Insecure: o.Insecure, CollapseBelowBytes: o.CollapseBelow, AllowSetuid: o.AllowSetuid, Project: o.Project}))
	if err != nil {
		return nil, fmt.Errorf("import image %s: %w", ref, fromConnect(err, false))
	}
	defer stream.Close()
	var last *dsecv1.ImportImageProgress
	for stream.Receive() {
		last = stream.Msg()
		if o.Progress != nil && !last.GetDone() {
			o.Progress(last)
		}
	}
	if err := stream.Err(); err != nil {
		return nil, fmt.Errorf("import image %s: %w", ref, fromConnect(err, false))
	}
	if last == nil || !last.GetDone() {
		return nil, &Error{Kind: ErrInternal, Message: "import image " + ref + ": the stream ended without a result"}
	}
	return last, nil
}

// LayerStats reports what sandboxes read of each layer and environment.
func (c *Client) LayerStats(ctx context.Context) (*dsecv1.LayerStatsResponse, error) {
	var out *dsecv1.LayerStatsResponse
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.layers.LayerStats(ctx, connect.NewRequest(&dsecv1.LayerStatsRequest{}))
		if err == nil {
			out = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("layer stats: %w", err)
	}
	return out, nil
}
