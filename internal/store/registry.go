package store

import (
	"context"
	"time"
)

// registryTx is what RegisterNode needs of one transaction on the node
// registry; each dialect implements it, and registerNode holds the rules.
// The transaction must exclude every other registration until it ends.
type registryTx interface {
	// node returns the node called name, if there is one.
	node(ctx context.Context, name string) (Node, bool, error)
	// freeSlot returns the lowest slot no node holds.
	freeSlot(ctx context.Context) (int, bool, error)
	// nextGeneration advances slot's generation counter (creating it at 1)
	// and returns the new value.
	nextGeneration(ctx context.Context, slot int) (int64, error)
	insertNode(ctx context.Context, n Node) error
	// updateNode overwrites every field of the node called n.Name.
	updateNode(ctx context.Context, n Node) error
}

// freeSlotSQL finds the lowest slot no node holds, in both dialects: slot 1
// or the slot after a held one whose successor is free.
const freeSlotSQL = `
SELECT s FROM (
	SELECT 1 AS s WHERE NOT EXISTS (SELECT 1 FROM nodes WHERE slot = 1)
	UNION ALL
	SELECT n.slot + 1 FROM nodes n
	WHERE n.slot < 65535 AND NOT EXISTS (SELECT 1 FROM nodes m WHERE m.slot = n.slot + 1)
) AS free ORDER BY s LIMIT 1`

// registerNode applies RegisterNode's rules inside tx.
func registerNode(ctx context.Context, tx registryTx, n Node, liveWindow time.Duration) (Node, error) {
	at := nowOr(n.LastSeen)
	n.LastSeen = at
	n.Backends = nilIfEmpty(n.Backends)
	old, found, err := tx.node(ctx, n.Name)
	if err != nil {
		return Node{}, err
	}
	switch {
	case found && old.Identity == n.Identity:
		// The same edge again (a restart): same slot, same generation.
		n.Slot, n.Generation, n.Registered = old.Slot, old.Generation, old.Registered
		if old.LastSeen.After(n.LastSeen) {
			n.LastSeen = old.LastSeen
		}
		return n, tx.updateNode(ctx, n)
	case found:
		if at.Sub(old.LastSeen) < liveWindow {
			return Node{}, identityConflict(n.Name, old.LastSeen, at)
		}
		// The old edge is gone: the new one takes its slot, and IDs the
		// old one minted no longer match.
		gen, err := tx.nextGeneration(ctx, old.Slot)
		if err != nil {
			return Node{}, err
		}
		n.Slot, n.Generation, n.Registered = old.Slot, gen, at
		return n, tx.updateNode(ctx, n)
	}
	slot, ok, err := tx.freeSlot(ctx)
	if err != nil {
		return Node{}, err
	}
	if !ok {
		return Node{}, slotsFull()
	}
	gen, err := tx.nextGeneration(ctx, slot)
	if err != nil {
		return Node{}, err
	}
	n.Slot, n.Generation, n.Registered = slot, gen, at
	return n, tx.insertNode(ctx, n)
}
