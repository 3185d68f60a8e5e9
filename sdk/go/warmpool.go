package dsec

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// FromWarmPool says whether the sandbox was taken from a warm pool rather
// than started for its create.
func (s *Sandbox) FromWarmPool() bool { return s.info.GetFromWarmPool() }

// WarmPool is a node's pool of started, idle sandboxes of one shape.
type WarmPool struct {
	Key         string              // the shape's key
	Node        string              // the node holding the pool (every node keeps its own)
	Environment string              // the shape's environment
	Spec        *dsecv1.SandboxSpec // the shape, node defaults filled in
	Size        int                 // sandboxes kept ready
	Ready       int                 // started, idle and waiting to be taken
	Starting    int                 // being started to refill the pool
	Taken       int64               // creates served from the pool
	Missed      int64               // creates of this shape that found it empty
	LastError   string              // why the last refill failed; "" when it did not
}

func warmPoolOf(p *dsecv1.WarmPool) *WarmPool {
	return &WarmPool{
		Key: p.GetKey(), Node: p.GetNode(), Environment: p.GetSpec().GetEnvironment(), Spec: p.GetSpec(),
		Size: int(p.GetSize()), Ready: int(p.GetReady()), Starting: int(p.GetStarting()),
		Taken: p.GetTaken(), Missed: p.GetMissed(), LastError: p.GetLastError(),
	}
}

// SetWarmPool keeps size sandboxes of env with options o started and idle,
// so that a Create of the same shape takes one instead of starting a
// container. The shape is the spec without Labels, TTL and IdleTimeout
// (after node defaults), so those may differ between the pool and a Create,
// but for the label dsec.dev/project: a pool belongs to a project (the one
// that label names, else the token's; the caller holds builder there) and
// serves that project's creates only.
// Size 0 removes the pool and its idle sandboxes. NetworkRules must be
// empty; o's Timeout and IdempotencyKey are not used.
func (c *Client) SetWarmPool(ctx context.Context, env string, size int, o *CreateOptions) (*WarmPool, error) {
	if size < 0 {
		return nil, invalid("warm pool size must not be negative")
	}
	spec, err := o.spec(env)
	if err != nil {
		return nil, err
	}
	var out *dsecv1.WarmPool
	err = c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.sb.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: spec, Size: int32(size)}))
		if err == nil {
			out = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("set warm pool of %s: %w", env, err)
	}
	return warmPoolOf(out), nil
}

// WarmPools lists the warm pools and how full they are.
func (c *Client) WarmPools(ctx context.Context) ([]*WarmPool, error) {
	var resp *dsecv1.ListWarmPoolsResponse
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.sb.ListWarmPools(ctx, connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
		if err == nil {
			resp = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list warm pools: %w", err)
	}
	out := make([]*WarmPool, 0, len(resp.GetPools()))
	for _, p := range resp.GetPools() {
		out = append(out, warmPoolOf(p))
	}
	return out, nil
}
