package sandboxpage

import (
	"cmp"
	"slices"
	"strings"

	"google.golang.org/protobuf/proto"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/iam"
)

// Query is what a node's List answers (edgev1.ListRequest): the sandboxes
// that match its filter and, paged, the first Size of them after After.
type Query struct {
	Labels map[string]string // all must match
	States []dsecv1.State    // any of these; empty: every state
	// Scoped: only the sandboxes of a project in one of Projects'
	// subtrees (iam.Within), none when Projects is empty.
	Scoped   bool
	Projects []string
	// Exclude: a sandbox with a label of one of these keys is left out.
	Exclude []string
	// Size > 0 pages: at most Size sandboxes, the first after After (nil:
	// from the newest) in Sort's order. Size 0: every match.
	Size  int
	After *dsecv1.Sandbox
	// Tally, when set, takes every match instead of the page: the page is
	// empty, Total still counts them.
	Tally Tally
}

// QueryOf is the query an edge's List request asks.
func QueryOf(req *edgev1.ListRequest) Query {
	q := Query{Labels: req.GetLabels(), States: req.GetStates(), Scoped: req.GetScoped(), Projects: req.GetProjects(),
		Exclude: req.GetExcludeLabels(), Size: max(0, int(req.GetPageSize()))}
	if req.GetTally() {
		q.Tally = Tally{}
	}
	if req.GetAfterId() != "" {
		q.After = &dsecv1.Sandbox{Id: req.GetAfterId(), CreatedUnixMs: req.GetAfterCreatedUnixMs()}
	}
	return q
}

// Match reports whether sb passes the query's filter (its page aside).
func (q Query) Match(sb *dsecv1.Sandbox) bool {
	if len(q.States) > 0 && !slices.Contains(q.States, sb.GetState()) {
		return false
	}
	labels := sb.GetSpec().GetLabels()
	for k, v := range q.Labels {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	for _, k := range q.Exclude {
		if _, ok := labels[k]; ok {
			return false
		}
	}
	if q.Scoped {
		project := labels[iam.ProjectLabel]
		if !slices.ContainsFunc(q.Projects, func(root string) bool { return iam.Within(project, root) }) {
			return false
		}
	}
	return true
}

// Pick gathers a node's answer to a query from its records: Offer each
// one (under whatever lock guards it, nothing is copied), then Page. V is
// what the node keeps of a record to read it again.
type Pick[V any] struct {
	q     Query
	total int
	kept  []picked[V]
}

type picked[V any] struct {
	at int64
	id string
	v  V
}

// before reports whether the record (at, id) comes before cur in Sort's
// order: newer, or as new with a lower ID.
func before(at int64, id string, cur *dsecv1.Sandbox) bool {
	if at != cur.GetCreatedUnixMs() {
		return at > cur.GetCreatedUnixMs()
	}
	return id < cur.GetId()
}

// NewPick starts gathering the answer to q.
func NewPick[V any](q Query) *Pick[V] { return &Pick[V]{q: q} }

// Offer counts sb when it matches, and then tallies it (a query with a
// Tally) or keeps v when it lies after the cursor. sb's ID and created
// time must not change (they do not).
func (p *Pick[V]) Offer(sb *dsecv1.Sandbox, v V) {
	if !p.q.Match(sb) {
		return
	}
	p.total++
	if p.q.Tally != nil {
		p.q.Tally.Add(sb)
		return
	}
	at, id := sb.GetCreatedUnixMs(), sb.GetId()
	if p.q.After != nil && (before(at, id, p.q.After) || id == p.q.After.GetId() && at == p.q.After.GetCreatedUnixMs()) {
		return
	}
	p.kept = append(p.kept, picked[V]{at, id, v})
}

// Total is how many records matched, before the cursor and after it.
func (p *Pick[V]) Total() int { return p.total }

// Page is what answers: paged, the first Size kept in Sort's order (newest
// first); else every one kept, oldest first, the ID breaking ties (as a
// node listed before pages).
func (p *Pick[V]) Page() []V {
	kept := p.kept
	newest := p.q.Size > 0
	slices.SortFunc(kept, func(a, b picked[V]) int {
		c := cmp.Compare(a.at, b.at)
		if newest {
			c = -c
		}
		if c != 0 {
			return c
		}
		return strings.Compare(a.id, b.id)
	})
	if newest {
		kept = kept[:min(len(kept), p.q.Size)]
	}
	out := make([]V, len(kept))
	for i, k := range kept {
		out[i] = k.v
	}
	return out
}

// PickRecords answers q from a node that keeps its sandboxes as their
// records (a hollow edge, a test's fake): the page, each record a copy,
// and how many matched.
func PickRecords(q Query, sbs map[string]*dsecv1.Sandbox) ([]*dsecv1.Sandbox, int) {
	pick := NewPick[*dsecv1.Sandbox](q)
	for _, sb := range sbs {
		pick.Offer(sb, sb)
	}
	page := pick.Page()
	for i, sb := range page {
		page[i] = proto.Clone(sb).(*dsecv1.Sandbox)
	}
	return page, pick.Total()
}
