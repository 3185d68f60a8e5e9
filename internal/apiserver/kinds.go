package apiserver

import (
	"fmt"
	"slices"
	"strings"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/placement"
	"dsec.dev/dsec/internal/watcher"
)

// isolationName is an isolation as users write it ("container", "gvisor",
// "microvm"); placement's name for the sandboxes of that isolation.
func isolationName(i dsecv1.Isolation) string {
	if i == dsecv1.Isolation_ISOLATION_UNSPECIFIED {
		return placement.DefaultBackend
	}
	return strings.ToLower(strings.TrimPrefix(i.String(), "ISOLATION_"))
}

// kindName is a kind as placement names it: the isolation's name for the
// sandbox profile, ISOLATION/PROFILE for another ("container/fncall").
func kindName(k *dsecv1.SandboxKind) string {
	if p := k.GetProfile(); p != dsecv1.Backend_BACKEND_UNSPECIFIED && p != dsecv1.Backend_BACKEND_CONTAINER {
		return isolationName(k.GetIsolation()) + "/" + backendName(p)
	}
	return isolationName(k.GetIsolation())
}

// offeredKinds are the kinds a node's report offers, as placement names
// them. An edge older than isolations reports only its backends: its
// sandbox profile is the container isolation.
func offeredKinds(st *edgev1.NodeStatus) []string {
	var out []string
	for _, k := range st.GetKinds() {
		out = append(out, kindName(k))
	}
	if len(st.GetKinds()) > 0 {
		return out
	}
	for _, b := range st.GetBackends() {
		out = append(out, backendName(b))
	}
	return out
}

// offerer is an edge that says what it offers without a watcher's
// report: the all-in-one dsecd's in-process edge, which nothing polls.
type offerer interface {
	Offers() *edgev1.NodeStatus
}

// statusOf is node n's last report, or for an in-process edge its status
// now; nil for a node that has not reported yet.
func statusOf(n watcher.Node) *edgev1.NodeStatus {
	if n.Status != nil {
		return n.Status
	}
	if o, ok := n.Edge.(offerer); ok {
		return o.Offers()
	}
	return nil
}

// offers reports whether node n offers sandboxes of spec's isolation; a
// node that has not reported yet is taken to offer containers only.
func offers(n watcher.Node, spec *dsecv1.SandboxSpec) bool {
	want := isolationName(spec.GetIsolation())
	st := statusOf(n)
	if st == nil {
		return want == placement.DefaultBackend
	}
	return slices.Contains(offeredKinds(st), want)
}

// missingOn says, for the first few healthy nodes that lack the isolation
// of that name, why each does in its own words ("node n1: no runsc: ..."),
// so a refusal names what to install.
func (s *Server) missingOn(name string) string {
	var why []string
	for _, n := range s.fleet.Nodes() {
		st := statusOf(n)
		if !n.Healthy || st == nil || len(why) == 3 {
			continue
		}
		if m := st.GetMissing()[name]; m != "" {
			why = append(why, fmt.Sprintf("node %s: %s", n.Name, m))
		}
	}
	return strings.Join(why, "; ")
}

// nodeInfos are the nodes as GetServerInfo lists them.
func (s *Server) nodeInfos() []*dsecv1.NodeInfo {
	var out []*dsecv1.NodeInfo
	for _, n := range s.fleet.Nodes() {
		ni := &dsecv1.NodeInfo{Name: n.Name, Healthy: n.Healthy}
		if !n.LastSeen.IsZero() {
			ni.LastSeenUnixMs = n.LastSeen.UnixMilli()
		}
		if !n.Healthy {
			ni.UnreachableReason = n.LastErr
		}
		if st := statusOf(n); st != nil {
			ni.Kinds, ni.Missing = st.GetKinds(), st.GetMissing()
			ni.Live, ni.MaxSandboxes = st.GetLive(), st.GetMaxSandboxes()
			ni.CoreScheduling = st.GetCoreScheduling()
			ni.Cpus, ni.CpuBusy = st.GetCpus(), st.GetCpuBusy()
			if ni.Cpus == 0 {
				ni.CpuBusy = -1 // a node that reports no CPUs (hollow, older)
			}
			ni.MemoryMb, ni.MemoryAvailableMb = st.GetMemTotalMb(), st.GetMemAvailableMb()
			if len(ni.Kinds) == 0 {
				for _, b := range st.GetBackends() {
					ni.Kinds = append(ni.Kinds, &dsecv1.SandboxKind{Isolation: dsecv1.Isolation_ISOLATION_CONTAINER, Profile: b})
				}
			}
		}
		out = append(out, ni)
	}
	slices.SortFunc(out, func(a, b *dsecv1.NodeInfo) int { return strings.Compare(a.GetName(), b.GetName()) })
	return out
}
