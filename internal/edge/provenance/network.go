package provenance

import (
	"sort"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/netpolicy"
)

// Network summarises a sandbox's network audit records: one entry per
// kind, verdict, host, port and deciding rule, with its count.
func Network(events []netpolicy.Event) []*dsecv1.ProvenanceNet {
	type key struct {
		kind, verdict, host, rule string
		port                      uint16
	}
	counts := map[key]int64{}
	for _, e := range events {
		host := e.Name
		if host == "" && e.Dest.IsValid() {
			host = e.Dest.String()
		}
		counts[key{e.Kind, e.Verdict, host, e.Rule, e.Port}]++
	}
	out := make([]*dsecv1.ProvenanceNet, 0, len(counts))
	for k, n := range counts {
		out = append(out, &dsecv1.ProvenanceNet{Kind: k.kind, Verdict: k.verdict, Host: k.host, Service: k.rule, Port: int32(k.port), Count: n})
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Host != b.Host {
			return a.Host < b.Host
		}
		if a.Kind != b.Kind {
			return a.Kind < b.Kind
		}
		if a.Verdict != b.Verdict {
			return a.Verdict < b.Verdict
		}
		return a.Port < b.Port
	})
	return out
}
