package sandbox

import (
	"context"
	"fmt"
	"maps"
	"time"

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

// SetNetworkRules replaces the network rules of a running sandbox. A sandbox
// made without rules has no network of its own and cannot be given one; make
// it with a rule (even a deny-all one such as {"0.0.0.0/0": false}) to change
// its rules later.
func (m *Manager) SetNetworkRules(ctx context.Context, id string, rules map[string]bool, cut bool) (warnings []string, err error) {
	err = m.use(ctx, id, func(sb *sandbox) error {
		if len(sb.rec.GetSpec().GetNetworkRules()) == 0 || m.net == nil {
			return fmt.Errorf("sandbox %s was made without network rules, so it has loopback only and no network to apply rules to; create it with rules (a deny-all {\"0.0.0.0/0\": false} will do) to change them later: %w", id, errdefs.ErrFailedPrecondition)
		}
		if len(rules) == 0 {
			// No rules on a networked sandbox means nothing allowed, as at create.
			rules = map[string]bool{"0.0.0.0/0": false}
		}
		warnings, err = m.net.Update(ctx, id, rules, cut)
		if err != nil {
			return fmt.Errorf("set network rules of %s: %w", id, err)
		}
		sb.rec.Spec.NetworkRules = maps.Clone(rules)
		if err := m.states.Save(sb.rec); err != nil {
			return fmt.Errorf("set network rules of %s: the rules apply but were not saved: %w", id, err)
		}
		sb.lastActive = time.Now()
		return nil
	})
	return warnings, err
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
