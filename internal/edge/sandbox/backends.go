package sandbox

import (
	"context"
	"fmt"
	"slices"
	"strings"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// backendOf is the backend a spec asks for: container when it names none
// (records older than backends were all containers).
func backendOf(spec *dsecv1.SandboxSpec) dsecv1.Backend {
	if b := spec.GetBackend(); b != dsecv1.Backend_BACKEND_UNSPECIFIED {
		return b
	}
	return dsecv1.Backend_BACKEND_CONTAINER
}

// BackendName is a backend as users write it: "container", "fncall".
func BackendName(b dsecv1.Backend) string {
	if b == dsecv1.Backend_BACKEND_UNSPECIFIED {
		b = dsecv1.Backend_BACKEND_CONTAINER
	}
	return strings.ToLower(strings.TrimPrefix(b.String(), "BACKEND_"))
}

// runtimeOf is the node's runtime of backend b.
func (m *Manager) runtimeOf(b dsecv1.Backend) (backend.Runtime, error) {
	if b == dsecv1.Backend_BACKEND_UNSPECIFIED {
		b = dsecv1.Backend_BACKEND_CONTAINER
	}
	rt, ok := m.runtimes[b]
	if !ok {
		return nil, fmt.Errorf("backend %s is not available on node %s (it has %s): %w",
			BackendName(b), m.cfg.Node, strings.Join(m.backendNames(), ", "), errdefs.ErrNotSupported)
	}
	return rt, nil
}

// Backends are the backends the node offers, in the enum's order.
func (m *Manager) Backends() []dsecv1.Backend {
	var bs []dsecv1.Backend
	for b := range m.runtimes {
		bs = append(bs, b)
	}
	slices.Sort(bs)
	return bs
}

func (m *Manager) backendNames() []string {
	var names []string
	for _, b := range m.Backends() {
		names = append(names, BackendName(b))
	}
	return names
}

// lacks is the refusal of what backend b's runtime cannot do on this node.
func (m *Manager) lacks(b dsecv1.Backend, what string) error {
	return fmt.Errorf("backend %s of node %s cannot %s: %w", BackendName(b), m.cfg.Node, what, errdefs.ErrNotSupported)
}

// pauser is sb's runtime as a Pauser, or the refusal naming its backend.
func (m *Manager) pauser(sb *sandbox) (backend.Pauser, error) {
	if sb.rt != nil && sb.rt.Features().Pause {
		if p, ok := sb.rt.(backend.Pauser); ok {
			return p, nil
		}
	}
	return nil, m.lacks(backendOf(sb.rec.GetSpec()), "pause")
}

// snapshotter is sb's runtime as a Pauser and Snapshotter, or the refusal
// naming its backend.
func (m *Manager) snapshotter(sb *sandbox) (backend.Pauser, backend.Snapshotter, error) {
	p, err := m.pauser(sb)
	if err != nil {
		return nil, nil, m.lacks(backendOf(sb.rec.GetSpec()), "snapshot a sandbox")
	}
	if sb.rt.Features().Snapshot {
		if sn, ok := sb.rt.(backend.Snapshotter); ok {
			return p, sn, nil
		}
	}
	return nil, nil, m.lacks(backendOf(sb.rec.GetSpec()), "snapshot a sandbox")
}

// frozen reports whether sb's runtime has it frozen; never, for a backend
// that cannot pause.
func (m *Manager) frozen(ctx context.Context, sb *sandbox) (bool, error) {
	p, err := m.pauser(sb)
	if err != nil {
		return false, nil
	}
	return p.Frozen(ctx, sb.rec.GetId())
}
