package edgetest

import (
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/iam"
)

// testLiveUsage: LiveUsage answers the ledger's record of each live
// sandbox of the projects asked (and those under them), and only theirs:
// its sandbox's ID, project, labels and node, started when the sandbox
// was made, one sandbox's figures; none asked reads every project. A
// sandbox deleted a moment ago is still read, ended. An edge without a
// ledger (Options.NoLedger) answers none.
func testLiveUsage(t *testing.T, e *edge) {
	ctx := t.Context()
	create := func(project, token string) *dsecv1.Sandbox {
		t.Helper()
		spec := e.spec()
		spec.Labels[iam.ProjectLabel] = project
		spec.Labels["edgetest-usage"] = token
		resp, err := e.h.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec, CreateToken: token + "@" + e.node}))
		if err != nil {
			t.Fatalf("Create in project %s: %v", project, err)
		}
		return resp.Msg
	}
	a := create("edgetest-a", "edgetest-usage#0")
	b := create("edgetest-b/sub", "edgetest-usage#1")
	live := func(projects ...string) []*dsecv1.UsageRecord {
		t.Helper()
		resp, err := e.h.LiveUsage(ctx, connect.NewRequest(&edgev1.LiveUsageRequest{Projects: projects}))
		if err != nil {
			t.Fatalf("LiveUsage of %v: %v", projects, err)
		}
		return resp.Msg.GetUsage()
	}
	if e.o.NoLedger {
		if got := live(); len(got) != 0 {
			t.Errorf("LiveUsage of an edge without a ledger: %v, want none", got)
		}
		return
	}
	// only checks that recs is exactly sb's record, as it stands.
	only := func(what string, recs []*dsecv1.UsageRecord, sb *dsecv1.Sandbox, project string, ended bool) {
		t.Helper()
		if len(recs) != 1 {
			t.Fatalf("LiveUsage of %s: %d records %v, want %s's alone", what, len(recs), recs, sb.GetId())
		}
		r := recs[0]
		label := map[string]string{a.GetId(): "edgetest-usage#0", b.GetId(): "edgetest-usage#1"}[sb.GetId()]
		if r.GetSandboxId() != sb.GetId() || r.GetProject() != project || r.GetNode() != e.node ||
			r.GetLabels()["edgetest-usage"] != label {
			t.Errorf("LiveUsage of %s: sandbox %s of project %q on %q labelled %v; want %s of %q on %q labelled edgetest-usage=%s",
				what, r.GetSandboxId(), r.GetProject(), r.GetNode(), r.GetLabels(), sb.GetId(), project, e.node, label)
		}
		// A sandbox counts from when it was made (a moment after its
		// record's millisecond, when a hollow edge starts it).
		started, made := time.UnixMilli(r.GetStartedUnixMs()), time.UnixMilli(sb.GetCreatedUnixMs())
		if started.Before(made.Add(-time.Second)) || started.After(time.Now()) {
			t.Errorf("LiveUsage of %s: %s started at %v, want when it was made, %v", what, sb.GetId(), started, made)
		}
		if u := r.GetUsage(); u.GetSandboxes() != 1 || u.GetCpuUsec() < 0 || u.GetMemoryGibSeconds() < 0 {
			t.Errorf("LiveUsage of %s: figures %v, want one sandbox's", what, u)
		}
		if got := r.GetEndedUnixMs() != 0; got != ended {
			t.Errorf("LiveUsage of %s: %s ended %v (at %d), want %v", what, sb.GetId(), got, r.GetEndedUnixMs(), ended)
		}
	}
	only("edgetest-a", live("edgetest-a"), a, "edgetest-a", false)
	only("edgetest-b, under which b's project is", live("edgetest-b"), b, "edgetest-b/sub", false)
	if got := live("edgetest-none"); len(got) != 0 {
		t.Errorf("LiveUsage of a project without sandboxes: %v, want none", got)
	}
	var ids []string
	for _, r := range live() {
		ids = append(ids, r.GetSandboxId())
	}
	if !slices.Contains(ids, a.GetId()) || !slices.Contains(ids, b.GetId()) {
		t.Errorf("LiveUsage of every project: %v, want %s and %s among them", ids, a.GetId(), b.GetId())
	}
	if err := e.delete(ctx, a.GetId()); err != nil {
		t.Fatalf("Delete %s: %v", a.GetId(), err)
	}
	only("edgetest-a after its sandbox's delete", live("edgetest-a"), a, "edgetest-a", true)
	only("edgetest-b after a's delete", live("edgetest-b"), b, "edgetest-b/sub", false)
}
