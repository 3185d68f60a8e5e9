package sandboxpage

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

func sb(id string, at int64) *dsecv1.Sandbox { return &dsecv1.Sandbox{Id: id, CreatedUnixMs: at} }

func ids(sbs []*dsecv1.Sandbox) string {
	s := ""
	for _, x := range sbs {
		s += x.GetId() + " "
	}
	return s
}

// TestCut: pages newest first, IDs breaking ties, walked by their tokens
// to the end; a sandbox made after the first page was read does not shift
// the next, nor does the cursor's own sandbox going away; a forged token
// is InvalidArgument.
func TestCut(t *testing.T) {
	all := []*dsecv1.Sandbox{sb("a", 1), sb("b", 3), sb("c", 2), sb("d", 3), sb("e", 5)}
	Sort(all)
	if got := ids(all); got != "e b d c a " {
		t.Fatalf("sorted: %s", got)
	}
	var walked string
	token, pages := "", 0
	for {
		page, next, err := Cut(all, 2, token)
		if err != nil {
			t.Fatal(err)
		}
		walked += ids(page)
		pages++
		if next == "" {
			break
		}
		token = next
	}
	if walked != "e b d c a " || pages != 3 {
		t.Fatalf("walked %q in %d pages, want every sandbox once in 3", walked, pages)
	}

	first, next, _ := Cut(all, 2, "")
	if ids(first) != "e b " {
		t.Fatalf("first page %s", ids(first))
	}
	// A newer sandbox arrives, and b (the cursor's) goes.
	moved := []*dsecv1.Sandbox{sb("f", 9), sb("e", 5), sb("d", 3), sb("c", 2), sb("a", 1)}
	page, _, err := Cut(moved, 2, next)
	if err != nil || ids(page) != "d c " {
		t.Fatalf("the page after b once b is gone and f is new: %s (%v), want d c", ids(page), err)
	}
	for _, bad := range []string{"!!", "bm8tc2xhc2g", fmt.Sprint("eA")} {
		if _, _, err := Cut(all, 2, bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("token %q: %v, want InvalidArgument", bad, err)
		}
	}
	if _, _, err := Cut(all, 0, ""); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("page size 0: %v", err)
	}
	if page, next, _ := Cut(nil, 5, ""); len(page) != 0 || next != "" {
		t.Errorf("no sandboxes: %v %q", page, next)
	}
}

// TestPick: a list split over three nodes, each answering its Pick of a
// page (one more than the page, as the apiserver asks) after the cursor,
// merged and cut, walks the same pages with the same tokens as Cut over
// the whole list; each node's total counts its matches wherever the
// cursor; an unpaged Pick is every match, oldest first.
func TestPick(t *testing.T) {
	var all []*dsecv1.Sandbox
	nodes := make([][]*dsecv1.Sandbox, 3)
	for i := range 50 {
		x := sb(fmt.Sprintf("sb-%02d", (i*17)%50), int64(i/3))
		x.Spec = &dsecv1.SandboxSpec{Labels: map[string]string{"dsec.dev/project": []string{"", "a", "a/b", "ab"}[i%4]}}
		if i%9 == 0 {
			x.Spec.Labels["pool"] = "1"
		}
		nodes[i%3] = append(nodes[i%3], x)
		all = append(all, x)
	}
	q := Query{Scoped: true, Projects: []string{"a"}, Exclude: []string{"pool"}}
	var want []*dsecv1.Sandbox
	for _, x := range all {
		if q.Match(x) {
			want = append(want, x)
		}
	}
	Sort(want)
	const size = 4
	for token := ""; ; {
		wantPage, wantNext, _ := Cut(want, size, token)
		after, err := Check(size, token)
		if err != nil {
			t.Fatal(err)
		}
		pq := q
		pq.Size, pq.After = size+1, after
		var merged []*dsecv1.Sandbox
		total := 0
		for _, n := range nodes {
			p := NewPick[*dsecv1.Sandbox](pq)
			for _, x := range n {
				p.Offer(x, x)
			}
			merged = append(merged, p.Page()...)
			total += p.Total()
		}
		Sort(merged)
		page, next, err := Cut(merged, size, token)
		if err != nil || ids(page) != ids(wantPage) || next != wantNext || total != len(want) {
			t.Fatalf("after %q: %s next %q total %d (%v), want %s next %q total %d", token, ids(page), next, total, err, ids(wantPage), wantNext, len(want))
		}
		if token = next; token == "" {
			break
		}
	}
	p := NewPick[*dsecv1.Sandbox](q)
	for _, x := range all {
		p.Offer(x, x)
	}
	got := p.Page()
	oldest := slices.Clone(want)
	slices.SortFunc(oldest, func(a, b *dsecv1.Sandbox) int {
		if a.GetCreatedUnixMs() != b.GetCreatedUnixMs() {
			return int(a.GetCreatedUnixMs() - b.GetCreatedUnixMs())
		}
		return strings.Compare(a.GetId(), b.GetId())
	})
	if ids(got) != ids(oldest) {
		t.Errorf("unpaged: %s, want oldest first %s", ids(got), ids(oldest))
	}
}

// TestTally: a query with a tally answers no page but its matches summed
// by project, CPUs rounded up a sandbox and the specs that ask nothing
// counted apart; the filter and the count apply as to a page.
func TestTally(t *testing.T) {
	mk := func(id, project string, spec *dsecv1.SandboxSpec, st dsecv1.State) *dsecv1.Sandbox {
		spec.Labels = map[string]string{}
		if project != "" {
			spec.Labels["dsec.dev/project"] = project
		}
		return &dsecv1.Sandbox{Id: id, State: st, Spec: spec}
	}
	run := dsecv1.State_STATE_RUNNING
	all := []*dsecv1.Sandbox{
		mk("1", "a", &dsecv1.SandboxSpec{Cpus: 0.0001, MemoryMb: 100}, run),
		mk("2", "a", &dsecv1.SandboxSpec{Cpus: 1.5, DiskMb: 10}, run),
		mk("3", "a/b", &dsecv1.SandboxSpec{}, run),
		mk("4", "", &dsecv1.SandboxSpec{Cpus: 2}, run),
		mk("5", "a", &dsecv1.SandboxSpec{Cpus: 8}, dsecv1.State_STATE_STOPPED),
		mk("6", "z", &dsecv1.SandboxSpec{Cpus: 8}, run),
	}
	q := Query{States: []dsecv1.State{run}, Scoped: true, Projects: []string{"a", "b"}, Tally: Tally{}}
	p := NewPick[*dsecv1.Sandbox](q)
	for _, x := range all {
		p.Offer(x, x)
	}
	if page := p.Page(); len(page) != 0 || p.Total() != 3 {
		t.Errorf("a tally's page %s, total %d; want none and 3", ids(page), p.Total())
	}
	got := q.Tally.List()
	want := []*edgev1.ProjectTally{
		{Project: "a", Sandboxes: 2, MilliCpus: 1 + 1500, MemoryMb: 100, MemoryUnset: 1, DiskMb: 10, DiskUnset: 1},
		{Project: "a/b", Sandboxes: 1, CpusUnset: 1, MemoryUnset: 1, DiskUnset: 1},
	}
	if !slices.EqualFunc(got, want, func(a, b *edgev1.ProjectTally) bool { return proto.Equal(a, b) }) {
		t.Errorf("tallies %v, want %v", got, want)
	}
}
