package sandbox

import (
	"context"
	"fmt"
	"maps"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/netctl"
	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/errdefs"
)

// Network gives sandboxes with network rules their own network and enforces
// the rules. *netctl.Controller implements it.
type Network interface {
	Attach(ctx context.Context, id string, rules map[string]bool) (*netctl.Attachment, error)
	Update(ctx context.Context, id string, rules map[string]bool, cut bool) ([]string, error)
	Log(id string, since time.Time, limit int) ([]netpolicy.Event, error)
	// Detach removes the sandbox's network; its audit log stays readable
	// until Forget.
	Detach(ctx context.Context, id string) error
	Forget(id string)
	// Recover keeps the networks of these sandboxes and removes every other.
	Recover(ctx context.Context, keep map[string]map[string]bool) error
}

func (m *Manager) detachNetwork(ctx context.Context, rec *dsecv1.Sandbox) {
	if m.net == nil || len(rec.GetSpec().GetNetworkRules()) == 0 {
		return
	}
	if err := m.net.Detach(ctx, rec.GetId()); err != nil {
		m.log.Warn("detach sandbox network", "id", rec.GetId(), "err", err)
	}
}

// SetNetworkRules replaces the network rules of a running sandbox. A sandbox
// made without rules has no network of its own and cannot be given one; make
// it with a rule (even a deny-all one such as {"0.0.0.0/0": false}) to change
// its rules later.
func (m *Manager) SetNetworkRules(ctx context.Context, id string, rules map[string]bool, cut bool) ([]string, error) {
	sb, err := m.lookup(id)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if !sb.gone.IsZero() || sb.stopping || sb.rec.GetState() != dsecv1.State_STATE_RUNNING {
		return nil, fmt.Errorf("set network rules: %w", GoneError(sb.rec))
	}
	if len(sb.rec.GetSpec().GetNetworkRules()) == 0 || m.net == nil {
		return nil, fmt.Errorf("sandbox %s was made without network rules, so it has loopback only and no network to apply rules to; create it with rules (a deny-all {\"0.0.0.0/0\": false} will do) to change them later: %w", id, errdefs.ErrFailedPrecondition)
	}
	if len(rules) == 0 {
		// No rules on a networked sandbox means nothing allowed, as at create.
		rules = map[string]bool{"0.0.0.0/0": false}
	}
	warnings, err := m.net.Update(ctx, id, rules, cut)
	if err != nil {
		return nil, fmt.Errorf("set network rules of %s: %w", id, err)
	}
	sb.rec.Spec.NetworkRules = maps.Clone(rules)
	if err := m.states.Save(sb.rec); err != nil {
		return warnings, fmt.Errorf("set network rules of %s: the rules apply but were not saved: %w", id, err)
	}
	sb.lastActive = time.Now()
	return warnings, nil
}

// NetworkLog returns a sandbox's network audit records since the given time.
// Records of a stopped sandbox remain readable while its tombstone lasts.
func (m *Manager) NetworkLog(ctx context.Context, id string, since time.Time, limit int) ([]netpolicy.Event, error) {
	sb, err := m.lookup(id)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	networked := len(sb.rec.GetSpec().GetNetworkRules()) > 0
	sb.mu.Unlock()
	if m.net == nil || !networked {
		return nil, nil
	}
	return m.net.Log(id, since, limit)
}
