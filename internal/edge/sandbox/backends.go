package sandbox

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// Kind is one sort of sandbox a node offers: an isolation (what keeps the
// sandbox apart from the node: container, gvisor, microvm) and a profile
// (what it serves: a sandbox, or fncall's pooled reward-code runners). The
// node keeps one runtime per kind; a sandbox's record names its kind
// through its spec's isolation and backend (KindOf).
type Kind struct {
	Isolation dsecv1.Isolation // never ISOLATION_UNSPECIFIED
	Profile   dsecv1.Backend   // never BACKEND_UNSPECIFIED
}

// The kinds every node knows by name.
var (
	ContainerKind = Kind{dsecv1.Isolation_ISOLATION_CONTAINER, dsecv1.Backend_BACKEND_CONTAINER}
	FnCallKind    = Kind{dsecv1.Isolation_ISOLATION_CONTAINER, dsecv1.Backend_BACKEND_FNCALL}
	GVisorKind    = Kind{dsecv1.Isolation_ISOLATION_GVISOR, dsecv1.Backend_BACKEND_CONTAINER}
	MicroVMKind   = Kind{dsecv1.Isolation_ISOLATION_MICROVM, dsecv1.Backend_BACKEND_CONTAINER}
)

// KindOf is the kind a spec asks for, unset fields read as container and
// the sandbox profile (records older than either were containers).
func KindOf(spec *dsecv1.SandboxSpec) Kind {
	return Kind{spec.GetIsolation(), spec.GetBackend()}.normal()
}

func (k Kind) normal() Kind {
	if k.Isolation == dsecv1.Isolation_ISOLATION_UNSPECIFIED {
		k.Isolation = dsecv1.Isolation_ISOLATION_CONTAINER
	}
	if k.Profile == dsecv1.Backend_BACKEND_UNSPECIFIED {
		k.Profile = dsecv1.Backend_BACKEND_CONTAINER
	}
	return k
}

// String is the kind as users write it: the isolation's name for the
// sandbox profile ("container", "gvisor"), ISOLATION/PROFILE for another
// ("container/fncall").
func (k Kind) String() string {
	k = k.normal()
	if k.Profile == dsecv1.Backend_BACKEND_CONTAINER {
		return IsolationName(k.Isolation)
	}
	return IsolationName(k.Isolation) + "/" + BackendName(k.Profile)
}

func (k Kind) compare(o Kind) int {
	return cmp.Or(cmp.Compare(k.Isolation, o.Isolation), cmp.Compare(k.Profile, o.Profile))
}

// IsolationName is an isolation as users write it: "container", "gvisor",
// "microvm".
func IsolationName(i dsecv1.Isolation) string {
	if i == dsecv1.Isolation_ISOLATION_UNSPECIFIED {
		i = dsecv1.Isolation_ISOLATION_CONTAINER
	}
	return strings.ToLower(strings.TrimPrefix(i.String(), "ISOLATION_"))
}

// BackendName is a profile as users write it: "container" (the sandbox
// profile, named for the enum it keeps), "fncall".
func BackendName(b dsecv1.Backend) string {
	if b == dsecv1.Backend_BACKEND_UNSPECIFIED {
		b = dsecv1.Backend_BACKEND_CONTAINER
	}
	return strings.ToLower(strings.TrimPrefix(b.String(), "BACKEND_"))
}

// runtimeOf is the node's runtime of kind k, or the refusal naming what
// the node offers and, for an isolation it lacks, what it is missing.
func (m *Manager) runtimeOf(k Kind) (backend.Runtime, error) {
	k = k.normal()
	if rt, ok := m.runtimes[k]; ok {
		return rt, nil
	}
	offers := strings.Join(m.kindNames(), ", ")
	if slices.ContainsFunc(m.Kinds(), func(o Kind) bool { return o.Isolation == k.Isolation }) {
		return nil, fmt.Errorf("profile %s is not available under isolation %s on node %s (it offers %s): %w",
			BackendName(k.Profile), IsolationName(k.Isolation), m.cfg.Node, offers, errdefs.ErrNotSupported)
	}
	why := m.cfg.Missing[k.Isolation]
	if why == "" {
		why = "this dsecd has no " + IsolationName(k.Isolation) + " backend"
	}
	return nil, fmt.Errorf("isolation %s is not available on node %s (it offers %s): %s: %w",
		IsolationName(k.Isolation), m.cfg.Node, offers, why, errdefs.ErrNotSupported)
}

// Kinds are the kinds the node offers, isolation by isolation in the
// enums' order.
func (m *Manager) Kinds() []Kind {
	var ks []Kind
	for k := range m.runtimes {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, Kind.compare)
	return ks
}

// Backends are the profiles the node offers, in the enum's order.
func (m *Manager) Backends() []dsecv1.Backend {
	var bs []dsecv1.Backend
	for k := range m.runtimes {
		bs = append(bs, k.Profile)
	}
	slices.Sort(bs)
	return slices.Compact(bs)
}

// Missing says why the node lacks each isolation it lacks, by name
// ("gvisor": "no runsc: ..."), as its daemon found out.
func (m *Manager) Missing() map[string]string {
	out := map[string]string{}
	for i, why := range m.cfg.Missing {
		if !slices.ContainsFunc(m.Kinds(), func(k Kind) bool { return k.Isolation == i }) {
			out[IsolationName(i)] = why
		}
	}
	return out
}

// kindInfos are the node's kinds as its status reports them.
func (m *Manager) kindInfos() []*dsecv1.SandboxKind {
	var out []*dsecv1.SandboxKind
	for _, k := range m.Kinds() {
		out = append(out, &dsecv1.SandboxKind{Isolation: k.Isolation, Profile: k.Profile,
			Accelerator: m.runtimes[k].Features().Accelerator})
	}
	return out
}

func (m *Manager) kindNames() []string {
	var names []string
	for _, k := range m.Kinds() {
		names = append(names, k.String())
	}
	return names
}

// lacks is the refusal of what kind k's runtime cannot do on this node.
func (m *Manager) lacks(k Kind, what string) error {
	return fmt.Errorf("backend %s of node %s cannot %s: %w", k, m.cfg.Node, what, errdefs.ErrNotSupported)
}

// pauser is sb's runtime as a Pauser, or the refusal naming its kind.
func (m *Manager) pauser(sb *sandbox) (backend.Pauser, error) {
	if sb.rt != nil && sb.rt.Features().Pause {
		if p, ok := sb.rt.(backend.Pauser); ok {
			return p, nil
		}
	}
	return nil, m.lacks(KindOf(sb.rec.GetSpec()), "pause")
}

// snapshotter is sb's runtime as a Pauser and Snapshotter, or the refusal
// naming its kind.
func (m *Manager) snapshotter(sb *sandbox) (backend.Pauser, backend.Snapshotter, error) {
	p, err := m.pauser(sb)
	if err != nil {
		return nil, nil, m.lacks(KindOf(sb.rec.GetSpec()), "snapshot a sandbox")
	}
	if sb.rt.Features().Snapshot {
		if sn, ok := sb.rt.(backend.Snapshotter); ok {
			return p, sn, nil
		}
	}
	return nil, nil, m.lacks(KindOf(sb.rec.GetSpec()), "snapshot a sandbox")
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
