package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/fncall"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/errdefs"
)

// FnCallConfig is the node's fncall backend (package fncall).
type FnCallConfig struct {
	Disabled bool
	// Languages is a JSON file of languages registered on top of the
	// builtin ones (fncall.LoadLanguages).
	Languages string
	Pools     fncall.PoolConfig
}

// fncallSandboxes gives the fncall pools the edge's sandboxes.
type fncallSandboxes struct {
	m   *sandbox.Manager
	ttl time.Duration
}

func (s fncallSandboxes) Create(ctx context.Context, spec *dsecv1.SandboxSpec) (string, error) {
	spec.TtlSeconds = int64(s.ttl / time.Second)
	rec, err := s.m.Create(ctx, spec, "")
	if err != nil {
		return "", err
	}
	return rec.GetId(), nil
}

func (s fncallSandboxes) Delete(ctx context.Context, id string) error { return s.m.Delete(ctx, id) }

func (s fncallSandboxes) List(ctx context.Context) ([]string, error) {
	recs, err := s.m.List(ctx, nil, nil)
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, r := range recs {
		if _, ok := r.GetSpec().GetLabels()[fncall.PoolLabel]; ok {
			ids = append(ids, r.GetId())
		}
	}
	return ids, nil
}

func (s fncallSandboxes) Call(ctx context.Context, id string, req *agentv1.CallRequest) (*agentv1.CallResponse, error) {
	client, release, err := s.m.Agent(ctx, id)
	if err != nil {
		return nil, err
	}
	defer release()
	resp, err := client.Call(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("call in fncall container %s: %w", id, errdefs.FromConnect(err))
	}
	return resp.Msg, nil
}

func (s fncallSandboxes) SetNetworkRules(ctx context.Context, id string, rules map[string]bool) error {
	_, err := s.m.SetNetworkRules(ctx, id, rules, true)
	return err
}

// startFnCall starts the node's fncall backend; nil when it is disabled.
func (n *node) startFnCall(ctx context.Context, log *slog.Logger) (*fncall.Service, error) {
	fc := n.cfg.FnCall
	if fc.Disabled {
		return nil, nil
	}
	langs := fncall.Builtin()
	if fc.Languages != "" {
		f, err := os.Open(fc.Languages)
		if err != nil {
			return nil, fmt.Errorf("read fncall languages: %w", err)
		}
		extra, err := fncall.LoadLanguages(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("read fncall languages %s: %w", fc.Languages, err)
		}
		for name, l := range extra {
			langs[name] = l
		}
	}
	sb := fncallSandboxes{m: n.edge, ttl: n.cfg.Limits.MaxTTL}
	// Pooled containers a dsecd that stopped left running belong to no
	// pool now.
	if ids, err := sb.List(ctx); err == nil {
		for _, id := range ids {
			if err := sb.Delete(ctx, id); err != nil {
				log.Warn("remove a fncall container left by an earlier dsecd", "id", id, "err", err)
			}
		}
	}
	// The gauges read the service's load, which exists only once it is
	// made, after its metrics.
	var svc atomic.Pointer[fncall.Service]
	fm := n.cfg.metrics.FnCall(func() (busy, queue, idle int) {
		if s := svc.Load(); s != nil {
			return s.Load()
		}
		return 0, 0, 0
	})
	s := fncall.NewService(sb, fncall.Config{Node: n.cfg.Node, Pools: fc.Pools, Languages: langs, Log: log, Metrics: fm})
	svc.Store(s)
	return s, nil
}
