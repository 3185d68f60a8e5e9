package storetest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// iamCases are the conformance cases of the IAM part (projects,
// principals, bindings, tokens, quotas, audit).
var iamCases = []struct {
	name string
	fn   func(t *testing.T, st store.Store)
}{
	{"ProjectTree", testProjectTree},
	{"ProjectDelete", testProjectDelete},
	{"RoleBindings", testRoleBindings},
	{"GrantEscalation", testGrantEscalation},
	{"TokenAuthority", testTokenAuthority},
	{"TokenChain", testTokenChain},
	{"AuthReasons", testAuthReasons},
	{"QuotaCharge", testQuotaCharge},
	{"QuotaFirstFull", testQuotaFirstFull},
	{"QuotaDelegation", testQuotaDelegation},
	{"QuotaEscalation", testQuotaEscalation},
	{"QuotaRate", testQuotaRate},
	{"SetUse", testSetUse},
	{"Audit", testAudit},
	{"Objects", testObjects},
	{"ObjectClaimRace", testObjectClaimRace},
	{"ObjectWriters", testObjectWriters},
	{"ObjectBlobs", testObjectBlobs},
	{"ObjectSweep", testObjectSweep},
	{"DeleteProjectObjects", testDeleteProjectObjects},
}

// iamReplicaCases need two Stores on one database.
var iamReplicaCases = []struct {
	name string
	fn   func(t *testing.T, a, b store.Store)
}{
	{"ChargeConcurrent", testReplicasChargeConcurrent},
	{"RevokeSeenByOther", testReplicasRevokeChain},
	{"RevokeRacesMint", testReplicasRevokeRacesMint},
	{"ObjectBlobsRace", testReplicasObjectBlobsRace},
	{"ObjectTakeRace", testReplicasObjectTakeRace},
}

func admin() iam.Authority { return iam.NodeAdmin() }

func mkProjects(t *testing.T, st store.Store, paths ...string) {
	t.Helper()
	for _, p := range paths {
		_, err := st.CreateProject(t.Context(), admin(), p)
		must(t, "CreateProject "+p, err)
	}
}

// person makes a principal (in project home) with the given bindings,
// project:role pairs.
func person(t *testing.T, st store.Store, name, home string, bindings ...string) {
	t.Helper()
	ctx := t.Context()
	_, err := st.CreatePrincipal(ctx, admin(), store.PrincipalSpec{Name: name, Project: home})
	must(t, "CreatePrincipal "+name, err)
	for _, b := range bindings {
		p, r, _ := strings.Cut(b, ":")
		role, err := iam.ParseRole(r)
		must(t, "ParseRole", err)
		must(t, "Grant "+b, st.Grant(ctx, admin(), name, p, role))
	}
}

// token mints a token as actor and authenticates it.
func token(t *testing.T, st store.Store, actor iam.Authority, principal, project string, role iam.Role, ttl time.Duration) (string, iam.Authority) {
	t.Helper()
	tok, _, err := st.MintToken(t.Context(), actor, store.TokenSpec{Principal: principal, Project: project, Role: role, TTL: ttl})
	must(t, fmt.Sprintf("MintToken %s %s on %s", principal, role, project), err)
	return tok, authenticate(t, st, tok)
}

func wantMessage(t *testing.T, what string, err error, kind error, text string) {
	t.Helper()
	wantKind(t, what, err, kind)
	if !strings.Contains(err.Error(), text) {
		t.Fatalf("%s: %q does not say %q", what, err, text)
	}
}

func testProjectTree(t *testing.T, st store.Store) {
	ctx := t.Context()
	root, err := st.Project(ctx, "/")
	must(t, "Project /", err)
	if root.ID != store.RootProject || root.Path != "" || root.Depth != 0 || root.Parent != "" {
		t.Fatalf("root %+v", root)
	}
	before := time.Now()
	ml, err := st.CreateProject(ctx, admin(), "ml")
	must(t, "CreateProject ml", err)
	run, err := st.CreateProject(ctx, admin(), "/ml/rl-run-42")
	must(t, "CreateProject ml/rl-run-42", err)
	within(t, "Created", run.Created, before, time.Now())
	if run.Parent != ml.ID || run.Name != "rl-run-42" || run.Path != "ml/rl-run-42" || run.Depth != 2 || ml.Parent != root.ID {
		t.Fatalf("projects %+v %+v", ml, run)
	}
	mkProjects(t, st, "cv", "ml/b", "mlx", "ml/b/c")
	got, err := st.Project(ctx, "ml/rl-run-42")
	must(t, "Project", err)
	byID, err := st.ProjectByID(ctx, run.ID)
	must(t, "ProjectByID", err)
	if got != run || byID != run {
		t.Fatalf("read back %+v, %+v; want %+v", got, byID, run)
	}
	paths := func(l []store.Project, err error) string {
		t.Helper()
		must(t, "ListProjects", err)
		var out []string
		for _, p := range l {
			out = append(out, p.Path)
		}
		return strings.Join(out, " ")
	}
	for _, tc := range []struct {
		path    string
		subtree bool
		want    string
	}{
		{"", false, "cv ml mlx"},
		{"", true, "cv ml ml/b ml/b/c ml/rl-run-42 mlx"},
		{"ml", false, "ml/b ml/rl-run-42"},
		{"ml", true, "ml/b ml/b/c ml/rl-run-42"},
		{"ml/b/c", true, ""},
	} {
		if got := paths(st.ListProjects(ctx, tc.path, tc.subtree)); got != tc.want {
			t.Errorf("ListProjects(%q, %v) = %q, want %q", tc.path, tc.subtree, got, tc.want)
		}
	}
	_, err = st.CreateProject(ctx, admin(), "ml/b")
	wantKind(t, "CreateProject of a taken name", err, errdefs.ErrAlreadyExists)
	_, err = st.CreateProject(ctx, admin(), "/")
	wantKind(t, "CreateProject of the root", err, errdefs.ErrAlreadyExists)
	_, err = st.CreateProject(ctx, admin(), "nope/x")
	wantKind(t, "CreateProject under a missing parent", err, errdefs.ErrNotFound)
	_, err = st.CreateProject(ctx, admin(), "Bad Name")
	wantKind(t, "CreateProject with a bad name", err, errdefs.ErrInvalidArgument)
	_, err = st.Project(ctx, "ml/nope")
	wantKind(t, "Project of a missing path", err, errdefs.ErrNotFound)
	_, err = st.ProjectByID(ctx, "prj-nope")
	wantKind(t, "ProjectByID of a missing ID", err, errdefs.ErrNotFound)

	deep := "d"
	for range iam.MaxDepth - 1 {
		mkProjects(t, st, deep)
		deep += "/d"
	}
	mkProjects(t, st, deep)
	p, err := st.Project(ctx, deep)
	must(t, "Project at the deepest level", err)
	if p.Depth != iam.MaxDepth {
		t.Fatalf("depth %d, want %d", p.Depth, iam.MaxDepth)
	}
	_, err = st.CreateProject(ctx, admin(), deep+"/d")
	wantKind(t, "CreateProject past the depth limit", err, errdefs.ErrInvalidArgument)
}

func testProjectDelete(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/a", "ml/a/b")
	person(t, st, "alice", "", "ml/a/b:runner")
	tok, _ := token(t, st, admin(), "alice", "ml/a/b", iam.Runner, 0)

	wantMessage(t, "DeleteProject with a child", st.DeleteProject(ctx, admin(), "ml/a", store.DeleteProjectOptions{}), errdefs.ErrFailedPrecondition, "1 child project")
	_, err := st.CreatePrincipal(ctx, admin(), store.PrincipalSpec{Name: "agent", Kind: store.KindService, Project: "ml/a/b"})
	must(t, "CreatePrincipal", err)
	wantMessage(t, "DeleteProject with a principal", st.DeleteProject(ctx, admin(), "ml/a/b", store.DeleteProjectOptions{}), errdefs.ErrFailedPrecondition, "1 principal")
	_, err = st.CreatePrincipal(ctx, admin(), store.PrincipalSpec{Name: "agent2", Kind: store.KindService, Project: "ml"})
	must(t, "CreatePrincipal", err)
	must(t, "Charge", st.Charge(ctx, "ml/a/b", store.Amounts{store.Sandboxes: 2, store.MemoryMB: 512}))
	wantMessage(t, "DeleteProject with a charge", st.DeleteProject(ctx, admin(), "ml/a/b", store.DeleteProjectOptions{}), errdefs.ErrFailedPrecondition,
		"2 sandboxes, 512 MiB of memory")
	must(t, "Release", st.Release(ctx, "ml/a/b", store.Amounts{store.Sandboxes: 2, store.MemoryMB: 512}))
	wantKind(t, "DeleteProject with a principal", st.DeleteProject(ctx, admin(), "ml/a/b", store.DeleteProjectOptions{}), errdefs.ErrFailedPrecondition)
	// The principal's tokens, and what they minted, go with it.
	must(t, "Grant agent", st.Grant(ctx, admin(), "agent", "ml/a/b", iam.Admin))
	agentTok, agent := token(t, st, admin(), "agent", "ml/a/b", iam.Admin, 0)
	must(t, "Grant agent2", st.Grant(ctx, admin(), "agent2", "ml", iam.Runner))
	_, err = st.CreatePrincipal(ctx, admin(), store.PrincipalSpec{Name: "sub", Kind: store.KindService, Project: "ml/a/b"})
	must(t, "CreatePrincipal sub", err)
	must(t, "Grant sub", st.Grant(ctx, admin(), "sub", "ml/a/b", iam.Runner))
	subTok, _ := token(t, st, agent, "sub", "ml/a/b", iam.Runner, 0)
	wantKind(t, "DeletePrincipal by a runner", st.DeletePrincipal(ctx, agent2Runner(t, st), "agent"), errdefs.ErrPermissionDenied)
	must(t, "DeletePrincipal", st.DeletePrincipal(ctx, admin(), "agent"))
	for _, tok := range []string{agentTok, subTok} {
		_, err := st.Authenticate(ctx, tok)
		wantKind(t, "a token of a deleted principal, or minted from one", err, errdefs.ErrUnauthenticated)
	}
	must(t, "DeletePrincipal sub", st.DeletePrincipal(ctx, admin(), "sub"))
	_, err = st.Principal(ctx, "agent")
	wantKind(t, "Principal after delete", err, errdefs.ErrNotFound)
	gen, err := st.Generation(ctx)
	must(t, "Generation", err)
	must(t, "DeleteProject", st.DeleteProject(ctx, admin(), "ml/a/b", store.DeleteProjectOptions{}))
	_, err = st.Project(ctx, "ml/a/b")
	wantKind(t, "Project after delete", err, errdefs.ErrNotFound)
	_, err = st.Authenticate(ctx, tok)
	wantKind(t, "a token of a deleted project", err, errdefs.ErrUnauthenticated)
	if b, err := st.Bindings(ctx, "alice"); err != nil || len(b) != 0 {
		t.Fatalf("bindings after the project went: %v, %v", b, err)
	}
	if g, err := st.Generation(ctx); err != nil || g <= gen {
		t.Fatalf("generation %d after a delete, was %d (%v)", g, gen, err)
	}
	must(t, "DeleteProject of the emptied parent", st.DeleteProject(ctx, admin(), "ml/a", store.DeleteProjectOptions{}))
	wantKind(t, "DeleteProject of the root", st.DeleteProject(ctx, admin(), "/", store.DeleteProjectOptions{}), errdefs.ErrFailedPrecondition)
	wantKind(t, "DeleteProject of a missing project", st.DeleteProject(ctx, admin(), "ml/a", store.DeleteProjectOptions{}), errdefs.ErrNotFound)

	// A token's admin deletes under it, not its own project or above.
	person(t, st, "bob", "", "ml:admin")
	_, bob := token(t, st, admin(), "bob", "ml", iam.Admin, 0)
	mkProjects(t, st, "ml/c")
	wantKind(t, "DeleteProject of its own project", st.DeleteProject(ctx, bob, "ml", store.DeleteProjectOptions{}), errdefs.ErrPermissionDenied)
	must(t, "DeleteProject under its own", st.DeleteProject(ctx, bob, "ml/c", store.DeleteProjectOptions{}))
}

func testRoleBindings(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/a", "cv")
	person(t, st, "alice", "", ":viewer", "ml:builder", "ml/a:admin")
	b, err := st.Bindings(ctx, "alice")
	must(t, "Bindings", err)
	want := []iam.Binding{{Project: "", Role: iam.Viewer}, {Project: "ml", Role: iam.Builder}, {Project: "ml/a", Role: iam.Admin}}
	if fmt.Sprint(b) != fmt.Sprint(want) {
		t.Fatalf("Bindings = %v, want %v", b, want)
	}
	_, a := token(t, st, admin(), "alice", "", iam.Admin, 0)
	for path, role := range map[string]iam.Role{"": iam.Viewer, "cv": iam.Viewer, "ml": iam.Builder, "ml/a": iam.Admin} {
		if got := a.On(path); got != role {
			t.Errorf("alice's role on %q = %s, want %s", path, got, role)
		}
	}
	// Granting again replaces; lowering grows the generation.
	gen, _ := st.Generation(ctx)
	must(t, "Grant lower", st.Grant(ctx, admin(), "alice", "ml", iam.Runner))
	if g, _ := st.Generation(ctx); g <= gen {
		t.Fatal("lowering a binding left the generation")
	}
	a = authenticate(t, st, mustToken(t, st, "alice"))
	if got := a.On("ml"); got != iam.Runner {
		t.Fatalf("after lowering: %s", got)
	}
	must(t, "Ungrant", st.Ungrant(ctx, admin(), "alice", "ml/a"))
	wantKind(t, "Ungrant again", st.Ungrant(ctx, admin(), "alice", "ml/a"), errdefs.ErrNotFound)
	wantKind(t, "Grant to nobody", st.Grant(ctx, admin(), "nobody", "ml", iam.Viewer), errdefs.ErrNotFound)
	wantKind(t, "Grant on a missing project", st.Grant(ctx, admin(), "alice", "nope", iam.Viewer), errdefs.ErrNotFound)

	_, err = st.CreatePrincipal(ctx, admin(), store.PrincipalSpec{Name: "agent", Kind: store.KindService, Project: "ml/a"})
	must(t, "CreatePrincipal service", err)
	p, err := st.Principal(ctx, "agent")
	must(t, "Principal", err)
	if p.Kind != store.KindService || p.Project != "ml/a" {
		t.Fatalf("principal %+v", p)
	}
	_, err = st.CreatePrincipal(ctx, admin(), store.PrincipalSpec{Name: "x", Kind: "robot"})
	wantKind(t, "CreatePrincipal of an unknown kind", err, errdefs.ErrInvalidArgument)
	list, err := st.ListPrincipals(ctx)
	must(t, "ListPrincipals", err)
	if len(list) != 2 || list[0].Name != "agent" || list[1].Name != "alice" {
		t.Fatalf("ListPrincipals %+v", list)
	}
}

// mustToken mints a no-expiry admin token on the root for principal.
func mustToken(t *testing.T, st store.Store, principal string) string {
	t.Helper()
	tok, _, err := st.MintToken(t.Context(), admin(), store.TokenSpec{Principal: principal, Role: iam.Admin})
	must(t, "MintToken", err)
	return tok
}

// testGrantEscalation: a token grants only what it holds, where it holds
// admin; each refusal changes nothing.
func testGrantEscalation(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/a", "cv")
	person(t, st, "lead", "", "ml:admin")
	person(t, st, "dev", "ml")
	_, lead := token(t, st, admin(), "lead", "ml", iam.Admin, 0)
	_, leadBuilder := token(t, st, admin(), "lead", "ml", iam.Builder, 0)
	_, leadDown := token(t, st, admin(), "lead", "ml/a", iam.Admin, 0)

	must(t, "Grant admin below", st.Grant(ctx, lead, "dev", "ml/a", iam.Admin))
	must(t, "Grant runner on ml", st.Grant(ctx, lead, "dev", "ml", iam.Runner))
	for _, tc := range []struct {
		name    string
		actor   iam.Authority
		project string
		role    iam.Role
	}{
		{"above its project", lead, "", iam.Viewer},
		{"a sibling", lead, "cv", iam.Viewer},
		{"as a builder token", leadBuilder, "ml/a", iam.Viewer},
		{"above a narrower token", leadDown, "ml", iam.Viewer},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantKind(t, "Grant", st.Grant(ctx, tc.actor, "dev", tc.project, tc.role), errdefs.ErrPermissionDenied)
		})
	}
	// The dev, admin on ml/a but runner on ml, cannot lift itself.
	_, dev := token(t, st, lead, "dev", "ml", iam.Runner, 0)
	wantKind(t, "a runner token granting", st.Grant(ctx, dev, "dev", "ml", iam.Admin), errdefs.ErrPermissionDenied)
	b, err := st.Bindings(ctx, "dev")
	must(t, "Bindings", err)
	if fmt.Sprint(b) != fmt.Sprint([]iam.Binding{{Project: "ml", Role: iam.Runner}, {Project: "ml/a", Role: iam.Admin}}) {
		t.Fatalf("refusals changed the bindings: %v", b)
	}
	// A binding the actor could not grant, it cannot remove either.
	must(t, "Grant root viewer", st.Grant(ctx, admin(), "dev", "", iam.Viewer))
	wantKind(t, "Ungrant above its project", st.Ungrant(ctx, lead, "dev", ""), errdefs.ErrPermissionDenied)
	// An actor whose binding is gone is refused at once.
	must(t, "Ungrant the lead", st.Ungrant(ctx, admin(), "lead", "ml"))
	wantKind(t, "Grant after losing admin", st.Grant(ctx, lead, "dev", "ml/a", iam.Viewer), errdefs.ErrPermissionDenied)
}

func testTokenAuthority(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/a")
	person(t, st, "alice", "", "ml:builder")
	before := time.Now()
	tok, info, err := st.MintToken(ctx, admin(), store.TokenSpec{Principal: "alice", Project: "ml", Role: iam.Admin, TTL: time.Hour})
	must(t, "MintToken", err)
	a := authenticate(t, st, tok)
	if a.TokenID != info.ID || a.Principal != "alice" || a.Project != "ml" || a.Role != iam.Admin || !a.Expires.Equal(info.Expires) ||
		info.Parent != "" || info.Project != "ml" || a.Node {
		t.Fatalf("authority %+v of token %+v", a, info)
	}
	within(t, "Expires", a.Expires, before.Add(time.Hour), time.Now().Add(time.Hour))
	// The token says admin; the principal holds builder: builder it is.
	if a.On("ml/a") != iam.Builder || a.On("") != iam.None {
		t.Fatalf("On: ml/a %s, root %s", a.On("ml/a"), a.On(""))
	}
	list, err := st.ListTokens(ctx, "alice")
	must(t, "ListTokens", err)
	if len(list) != 1 || list[0].ID != info.ID || list[0].Project != "ml" || list[0].Role != iam.Admin {
		t.Fatalf("ListTokens %+v", list)
	}
	_, _, err = st.MintToken(ctx, admin(), store.TokenSpec{Principal: "alice", Project: "nope", Role: iam.Viewer})
	wantKind(t, "MintToken on a missing project", err, errdefs.ErrNotFound)
	_, _, err = st.MintToken(ctx, admin(), store.TokenSpec{Principal: "alice", Project: "ml", Role: iam.None})
	wantKind(t, "MintToken without a role", err, errdefs.ErrInvalidArgument)
}

// testTokenChain: a chain of three tokens, each minted from the one
// before, narrower each time; the escalations refused; revoking the first
// revokes all three, and the revoked one mints nothing.
func testTokenChain(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/rl", "ml/rl/sub", "cv")
	person(t, st, "harness", "", "ml:admin")
	person(t, st, "agent", "ml/rl")
	must(t, "Grant agent", st.Grant(ctx, admin(), "agent", "ml/rl", iam.Admin))
	person(t, st, "outsider", "cv")

	t1, a1 := token(t, st, admin(), "harness", "ml", iam.Admin, time.Hour)
	t2, a2 := token(t, st, a1, "agent", "ml/rl", iam.Admin, 30*time.Minute)
	t3, a3 := token(t, st, a2, "agent", "ml/rl/sub", iam.Runner, 10*time.Minute)
	list, err := st.ListTokens(ctx, "agent")
	must(t, "ListTokens", err)
	parents := map[string]string{}
	for _, l := range list {
		parents[l.ID] = l.Parent
	}
	if len(list) != 2 || parents[a2.TokenID] != a1.TokenID || parents[a3.TokenID] != a2.TokenID {
		t.Fatalf("parents: %+v", list)
	}
	if a3.On("ml/rl/sub") != iam.Runner || a3.On("ml/rl") != iam.None {
		t.Fatalf("the third token's authority: %+v", a3)
	}

	for _, tc := range []struct {
		name  string
		actor iam.Authority
		spec  store.TokenSpec
	}{
		{"outside its subtree", a2, store.TokenSpec{Principal: "agent", Project: "ml", Role: iam.Runner, TTL: time.Minute}},
		{"outliving its minter", a2, store.TokenSpec{Principal: "agent", Project: "ml/rl", Role: iam.Runner, TTL: 2 * time.Hour}},
		{"without expiry from an expiring token", a2, store.TokenSpec{Principal: "agent", Project: "ml/rl", Role: iam.Runner}},
		{"from a runner token", a3, store.TokenSpec{Principal: "agent", Project: "ml/rl/sub", Role: iam.Runner, TTL: time.Minute}},
		{"for a principal it does not manage", a2, store.TokenSpec{Principal: "outsider", Project: "ml/rl", Role: iam.Viewer, TTL: time.Minute}},
		{"a role above the principal's", a1, store.TokenSpec{Principal: "harness", Project: "", Role: iam.Viewer, TTL: time.Minute}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := st.MintToken(ctx, tc.actor, tc.spec)
			wantKind(t, "MintToken", err, errdefs.ErrPermissionDenied)
		})
	}
	if list, _ := st.ListTokens(ctx, "agent"); len(list) != 2 {
		t.Fatalf("refused mints left tokens: %+v", list)
	}

	n, project, err := st.RevokeToken(ctx, admin(), a1.TokenID)
	must(t, "RevokeToken", err)
	if n != 3 || project != "ml" {
		t.Fatalf("revoking the first of a chain of 3 revoked %d, of project %q; want 3, of ml (the token's)", n, project)
	}
	for i, tok := range []string{t1, t2, t3} {
		_, err := st.Authenticate(ctx, tok)
		if store.AuthFailure(err) != store.AuthRevoked {
			t.Fatalf("token %d after revoking the chain: %v (%q)", i+1, err, store.AuthFailure(err))
		}
	}
	_, _, err = st.MintToken(ctx, a1, store.TokenSpec{Principal: "harness", Project: "ml", Role: iam.Viewer, TTL: time.Minute})
	wantKind(t, "MintToken from a revoked token", err, errdefs.ErrUnauthenticated)
	if n, _, err := st.RevokeToken(ctx, admin(), a1.TokenID); err != nil || n != 0 {
		t.Fatalf("revoking again: %d, %v", n, err)
	}
	// A token revokes itself without admin; a runner token nothing else.
	_, r1 := token(t, st, admin(), "harness", "ml", iam.Runner, 0)
	_, r2 := token(t, st, admin(), "harness", "ml", iam.Runner, 0)
	_, _, err = st.RevokeToken(ctx, r1, r2.TokenID)
	wantKind(t, "a runner revoking another token", err, errdefs.ErrPermissionDenied)
	if n, _, err := st.RevokeToken(ctx, r1, r1.TokenID); err != nil || n != 1 {
		t.Fatalf("a token revoking itself: %d, %v", n, err)
	}
}

func testAuthReasons(t *testing.T, st store.Store) {
	ctx := t.Context()
	person(t, st, "alice", "", ":admin")
	short, _, err := st.MintToken(ctx, admin(), store.TokenSpec{Principal: "alice", Role: iam.Admin, TTL: time.Millisecond})
	must(t, "MintToken", err)
	time.Sleep(20 * time.Millisecond)
	for _, tc := range []struct{ token, reason string }{
		{short, store.AuthExpired},
		{"dsec_" + strings.Repeat("A", 43), store.AuthUnknown},
		{"nope", store.AuthMalformed},
	} {
		_, err := st.Authenticate(ctx, tc.token)
		wantKind(t, "Authenticate", err, errdefs.ErrUnauthenticated)
		if got := store.AuthFailure(err); got != tc.reason {
			t.Errorf("reason %q, want %q", got, tc.reason)
		}
		if err.Error() != (&store.AuthError{}).Error() {
			t.Errorf("the message %q tells the caller more than the others", err)
		}
	}
}

func limit(t *testing.T, st store.Store, project string, r store.Resource, n int64) {
	t.Helper()
	must(t, fmt.Sprintf("SetLimit %s %s %d", project, r, n), st.SetLimit(t.Context(), admin(), project, r, n))
}

// used returns project's use of r.
func used(t *testing.T, st store.Store, project string, r store.Resource) int64 {
	t.Helper()
	qs, err := st.Quota(t.Context(), project)
	must(t, "Quota", err)
	return qs[0].Used[r]
}

func testQuotaCharge(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/rl-run-42", "ml/b")
	limit(t, st, "", store.Sandboxes, 100)
	limit(t, st, "ml", store.Sandboxes, 64)
	limit(t, st, "ml/rl-run-42", store.Sandboxes, 64)
	must(t, "Charge", st.Charge(ctx, "ml/rl-run-42", store.Amounts{store.Sandboxes: 64, store.VCPUs: 64000}))
	err := st.Charge(ctx, "ml/rl-run-42", store.Amounts{store.Sandboxes: 1, store.VCPUs: 1000})
	wantKind(t, "Charge past the limit", err, errdefs.ErrResourceExhausted)
	// ml is as full, and above: the first from the top is named.
	if !strings.Contains(err.Error(), "quota of project ml: 64 of 64 sandboxes in use") {
		t.Fatalf("refusal %q", err)
	}
	err = st.Charge(ctx, "ml/b", store.Amounts{store.Sandboxes: 1})
	wantMessage(t, "Charge of a sibling", err, errdefs.ErrResourceExhausted, "quota of project ml: 64 of 64 sandboxes in use")
	if used(t, st, "ml/rl-run-42", store.VCPUs) != 64000 || used(t, st, "", store.Sandboxes) != 64 {
		t.Fatal("a refused charge changed the use")
	}
	qs, err := st.Quota(ctx, "ml")
	must(t, "Quota", err)
	if len(qs) != 3 || qs[0].Project != "ml" || qs[1].Project != "ml/b" || qs[2].Project != "ml/rl-run-42" ||
		qs[0].Limits[store.Sandboxes] != 64 || qs[0].Used[store.Sandboxes] != 64 || qs[1].Limits[store.Sandboxes] != store.Unlimited ||
		qs[2].Used[store.VCPUs] != 64000 || qs[0].Limits[store.VCPUs] != store.Unlimited {
		t.Fatalf("Quota %+v", qs)
	}
	must(t, "Release", st.Release(ctx, "ml/rl-run-42", store.Amounts{store.Sandboxes: 64, store.VCPUs: 64000}))
	for _, p := range []string{"", "ml", "ml/rl-run-42"} {
		if u := used(t, st, p, store.Sandboxes); u != 0 {
			t.Fatalf("use of %q after release: %d", p, u)
		}
	}
	must(t, "Release more than charged", st.Release(ctx, "ml/b", store.Amounts{store.Sandboxes: 5}))
	if u := used(t, st, "ml", store.Sandboxes); u != 0 {
		t.Fatalf("use went to %d", u)
	}
	wantKind(t, "Charge of a missing project", st.Charge(ctx, "nope", store.Amounts{store.Sandboxes: 1}), errdefs.ErrNotFound)
	wantKind(t, "Charge of a negative amount", st.Charge(ctx, "ml", store.Amounts{store.Sandboxes: -1}), errdefs.ErrInvalidArgument)
	wantKind(t, "Charge of an unknown resource", st.Charge(ctx, "ml", store.Amounts{"gpus": 1}), errdefs.ErrInvalidArgument)
}

func testQuotaFirstFull(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/a")
	limit(t, st, "", store.MemoryMB, 3000)
	limit(t, st, "ml/a", store.MemoryMB, 2000)
	must(t, "Charge", st.Charge(ctx, "ml/a", store.Amounts{store.MemoryMB: 2000}))
	err := st.Charge(ctx, "ml/a", store.Amounts{store.MemoryMB: 1})
	wantMessage(t, "Charge of the full child", err, errdefs.ErrResourceExhausted, "quota of project ml/a: 2000 of 2000 MiB of memory in use")
	must(t, "Charge of the root", st.Charge(ctx, "/", store.Amounts{store.MemoryMB: 1000}))
	err = st.Charge(ctx, "ml/a", store.Amounts{store.MemoryMB: 1})
	wantMessage(t, "Charge when both are full", err, errdefs.ErrResourceExhausted, "quota of project /: 3000 of 3000 MiB of memory in use")
	// A charge past what is left of a limit says what it asked, or the
	// numbers read as a contradiction (0 of 2 in use, and refused).
	limit(t, st, "ml", store.Sandboxes, 2)
	err = st.Charge(ctx, "ml/a", store.Amounts{store.Sandboxes: 3})
	wantMessage(t, "Charge of a batch past the limit", err, errdefs.ErrResourceExhausted, "quota of project ml: 0 of 2 sandboxes in use, 3 asked: ")
	limit(t, st, "ml", store.FnCallInflight, 1)
	must(t, "Charge of a call", st.Charge(ctx, "ml/a", store.Amounts{store.FnCallInflight: 1}))
	err = st.Charge(ctx, "ml/a", store.Amounts{store.FnCallInflight: 1})
	wantMessage(t, "Charge of a second call", err, errdefs.ErrResourceExhausted, "quota of project ml: 1 of 1 FnCall call in flight: ")
}

func testQuotaDelegation(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/a", "ml/b", "ml/c", "cv")
	limit(t, st, "", store.Sandboxes, 100)
	limit(t, st, "ml", store.Sandboxes, 60)
	wantKind(t, "a child past its parent", st.SetLimit(ctx, admin(), "cv", store.Sandboxes, 50), errdefs.ErrResourceExhausted)
	limit(t, st, "cv", store.Sandboxes, 40)
	wantKind(t, "a grandchild past its parent", st.SetLimit(ctx, admin(), "ml/a", store.Sandboxes, 70), errdefs.ErrResourceExhausted)
	limit(t, st, "ml/a", store.Sandboxes, 30)
	limit(t, st, "ml/b", store.Sandboxes, 30)
	wantKind(t, "a third child of a full parent", st.SetLimit(ctx, admin(), "ml/c", store.Sandboxes, 1), errdefs.ErrResourceExhausted)
	wantMessage(t, "lowering a parent below its children", st.SetLimit(ctx, admin(), "ml", store.Sandboxes, 50),
		errdefs.ErrFailedPrecondition, "the projects under it hold 60 sandboxes")
	wantKind(t, "lowering the root below its children", st.SetLimit(ctx, admin(), "", store.Sandboxes, 99), errdefs.ErrFailedPrecondition)
	must(t, "Charge", st.Charge(ctx, "ml/a", store.Amounts{store.Sandboxes: 10}))
	// Said once: "set the sandboxes limit of project ml/a to 5: 10 sandboxes in use".
	wantMessage(t, "taking back what is in use", st.SetLimit(ctx, admin(), "ml/a", store.Sandboxes, 5),
		errdefs.ErrFailedPrecondition, "set the sandboxes limit of project ml/a to 5: 10 sandboxes in use: ")
	wantMessage(t, "lowering a parent below its children, said once", st.SetLimit(ctx, admin(), "ml", store.Sandboxes, 50),
		errdefs.ErrFailedPrecondition, "set the sandboxes limit of project ml to 50: the projects")
	must(t, "Charge", st.Charge(ctx, "ml/c", store.Amounts{store.Sandboxes: 1}))
	wantMessage(t, "taking back the one in use", st.SetLimit(ctx, admin(), "ml/c", store.Sandboxes, 0),
		errdefs.ErrFailedPrecondition, "to 0: 1 sandbox in use: ")
	must(t, "Release", st.Release(ctx, "ml/c", store.Amounts{store.Sandboxes: 1}))
	if err := st.SetLimit(ctx, admin(), "ml/a", store.Sandboxes, 5); strings.Count(err.Error(), "limit of project") != 1 {
		t.Fatalf("taking back what is in use: %q says what it set more than once", err)
	}
	limit(t, st, "ml/a", store.Sandboxes, 10)
	// ml without a limit of its own: its children's count against the root.
	limit(t, st, "ml", store.Sandboxes, store.Unlimited)
	limit(t, st, "ml/c", store.Sandboxes, 20)
	wantKind(t, "past the root through an unlimited parent", st.SetLimit(ctx, admin(), "ml/c", store.Sandboxes, 21), errdefs.ErrResourceExhausted)
	wantKind(t, "a negative limit", st.SetLimit(ctx, admin(), "ml/c", store.Sandboxes, -2), errdefs.ErrInvalidArgument)
	wantKind(t, "a missing project", st.SetLimit(ctx, admin(), "nope", store.Sandboxes, 1), errdefs.ErrNotFound)
}

// testQuotaEscalation: a token sets the quotas of the projects under its
// own, carved from what its project holds, and no other.
func testQuotaEscalation(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/a")
	limit(t, st, "ml", store.Sandboxes, 10)
	person(t, st, "lead", "", "ml:admin")
	_, lead := token(t, st, admin(), "lead", "ml", iam.Admin, 0)
	_, runner := token(t, st, admin(), "lead", "ml", iam.Runner, 0)
	must(t, "SetLimit of a child", st.SetLimit(ctx, lead, "ml/a", store.Sandboxes, 10))
	wantKind(t, "raising its own", st.SetLimit(ctx, lead, "ml", store.Sandboxes, 1000), errdefs.ErrPermissionDenied)
	wantKind(t, "raising the root's", st.SetLimit(ctx, lead, "", store.Sandboxes, 1000), errdefs.ErrPermissionDenied)
	wantKind(t, "a runner", st.SetLimit(ctx, runner, "ml/a", store.Sandboxes, 5), errdefs.ErrPermissionDenied)
	wantKind(t, "more than its project holds", st.SetLimit(ctx, lead, "ml/a", store.Sandboxes, 11), errdefs.ErrResourceExhausted)
	qs, err := st.Quota(ctx, "ml")
	must(t, "Quota", err)
	if qs[0].Limits[store.Sandboxes] != 10 || qs[1].Limits[store.Sandboxes] != 10 {
		t.Fatalf("refusals changed limits: %+v", qs)
	}
}

func testQuotaRate(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml")
	limit(t, st, "ml", store.CreatesPerSecond, 1)
	must(t, "Charge a create", st.Charge(ctx, "ml", store.Amounts{store.CreatesPerSecond: 1, store.Sandboxes: 1}))
	err := st.Charge(ctx, "ml", store.Amounts{store.CreatesPerSecond: 1, store.Sandboxes: 1})
	wantMessage(t, "a second create within the second", err, errdefs.ErrResourceExhausted, "quota of project ml: more than 1 creates per second")
	if u := used(t, st, "ml", store.Sandboxes); u != 1 {
		t.Fatalf("a refused create charged sandboxes: %d", u)
	}
	time.Sleep(1100 * time.Millisecond)
	must(t, "Charge after the bucket refilled", st.Charge(ctx, "ml", store.Amounts{store.CreatesPerSecond: 1}))
}

func testSetUse(t *testing.T, st store.Store) {
	ctx := t.Context()
	mkProjects(t, st, "ml", "ml/a")
	must(t, "Charge", st.Charge(ctx, "ml/a", store.Amounts{store.Sandboxes: 3}))
	must(t, "Charge ml", st.Charge(ctx, "ml", store.Amounts{store.Sandboxes: 2}))
	// The reconciler counts 1 sandbox in ml/a and 4 of ml's own.
	must(t, "SetUse ml/a", st.SetUse(ctx, "ml/a", store.Sandboxes, 1))
	must(t, "SetUse ml", st.SetUse(ctx, "ml", store.Sandboxes, 4))
	for p, want := range map[string]int64{"ml/a": 1, "ml": 5, "": 5} {
		if got := used(t, st, p, store.Sandboxes); got != want {
			t.Errorf("use of %q = %d, want %d", p, got, want)
		}
	}
	wantKind(t, "SetUse of a rate", st.SetUse(ctx, "ml", store.CreatesPerSecond, 1), errdefs.ErrInvalidArgument)
}

func testAudit(t *testing.T, st store.Store) {
	ctx := t.Context()
	base := ms(time.Now().Add(-time.Hour))
	recs := []store.AuditRecord{
		{At: base, Principal: "alice", TokenID: "tok-1", Project: "ml", Operation: string(iam.OpCreateProject), Object: "ml/a", Code: "ok", Peer: "198.18.0.1:5000"},
		{At: base.Add(time.Minute), Principal: "bob", Project: "ml/a", Operation: string(iam.OpGrant), Object: "carol", Code: "permission_denied", Message: "needs admin"},
		{At: base.Add(2 * time.Minute), Principal: "alice", Project: "mlx", Operation: string(iam.OpSetQuota), Code: "ok"},
		{At: base.Add(3 * time.Minute), Principal: "alice", Project: "", Operation: string(iam.OpCreateToken), Code: "ok"},
	}
	must(t, "AppendAudit", st.AppendAudit(ctx, recs[0]))
	must(t, "AppendAudit of several", st.AppendAudit(ctx, recs[1:]...))
	ops := func(q store.AuditQuery) string {
		t.Helper()
		got, err := st.QueryAudit(ctx, q)
		must(t, "QueryAudit", err)
		var out []string
		for _, r := range got {
			out = append(out, r.Principal+"@"+iam.Display(r.Project))
		}
		return strings.Join(out, " ")
	}
	for _, tc := range []struct {
		name string
		q    store.AuditQuery
		want string
	}{
		{"all", store.AuditQuery{}, "alice@ml bob@ml/a alice@mlx alice@/"},
		{"subtree", store.AuditQuery{Project: "ml"}, "alice@ml bob@ml/a"},
		{"since", store.AuditQuery{Since: base.Add(time.Minute)}, "bob@ml/a alice@mlx alice@/"},
		{"until", store.AuditQuery{Until: base.Add(time.Minute)}, "alice@ml"},
		{"principal", store.AuditQuery{Principal: "alice", Project: "/"}, "alice@ml alice@mlx alice@/"},
		{"limit", store.AuditQuery{Limit: 2}, "alice@ml bob@ml/a"},
	} {
		if got := ops(tc.q); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
	got, err := st.QueryAudit(ctx, store.AuditQuery{Project: "ml/a"})
	must(t, "QueryAudit", err)
	if len(got) != 1 || got[0].Code != "permission_denied" || got[0].Message != "needs admin" || got[0].Object != "carol" ||
		!got[0].At.Equal(recs[1].At) || got[0].ID == 0 {
		t.Fatalf("record %+v", got)
	}
	var buf bytes.Buffer
	must(t, "WriteAuditJSON", store.WriteAuditJSON(&buf, got))
	var line map[string]any
	if err := json.Unmarshal(bytes.TrimSpace(buf.Bytes()), &line); err != nil || line["principal"] != "bob" || line["code"] != "permission_denied" {
		t.Fatalf("JSON line %q: %v", buf.String(), err)
	}
	n, err := st.ExpireAudit(ctx, base.Add(2*time.Minute))
	must(t, "ExpireAudit", err)
	if n != 2 || ops(store.AuditQuery{}) != "alice@mlx alice@/" {
		t.Fatalf("ExpireAudit removed %d", n)
	}
}

// testReplicasChargeConcurrent: 1,000 charges of one sandbox race for a
// quota of 100 through two Stores: exactly 100 succeed, every other is
// refused by name, and the use is back to 0 once they are released.
func testReplicasChargeConcurrent(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	mkProjects(t, a, "team", "team/job")
	limit(t, a, "team", store.Sandboxes, 100)
	const n = 1000
	var wg sync.WaitGroup
	var mu sync.Mutex
	ok, refused := 0, 0
	var other []error
	for i := range n {
		st := a
		if i%2 == 1 {
			st = b
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := st.Charge(ctx, "team/job", store.Amounts{store.Sandboxes: 1, store.VCPUs: 500})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				ok++
			case errors.Is(err, errdefs.ErrResourceExhausted) && strings.Contains(err.Error(), "quota of project team: 100 of 100 sandboxes in use"):
				refused++
			default:
				other = append(other, err)
			}
		}()
	}
	wg.Wait()
	if len(other) > 0 {
		t.Fatalf("%d charges failed otherwise, first: %v", len(other), other[0])
	}
	if ok != 100 || refused != n-100 {
		t.Fatalf("%d charges succeeded, %d refused; want 100 and %d", ok, refused, n-100)
	}
	if u := used(t, b, "team", store.Sandboxes); u != 100 {
		t.Fatalf("use %d after the race", u)
	}
	for i := range ok {
		st := a
		if i%2 == 1 {
			st = b
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := st.Release(ctx, "team/job", store.Amounts{store.Sandboxes: 1, store.VCPUs: 500}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	for _, p := range []string{"", "team", "team/job"} {
		for _, r := range []store.Resource{store.Sandboxes, store.VCPUs} {
			if u := used(t, a, p, r); u != 0 {
				t.Fatalf("%s of %q after every release: %d", r, p, u)
			}
		}
	}
}

// testReplicasRevokeChain: a chain minted on one Store, revoked on the
// other, is refused on both.
func testReplicasRevokeChain(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	mkProjects(t, a, "ml", "ml/a")
	person(t, a, "harness", "", "ml:admin")
	t1, a1 := token(t, a, admin(), "harness", "ml", iam.Admin, 0)
	t2, a2 := token(t, b, a1, "harness", "ml/a", iam.Admin, time.Hour)
	t3, _ := token(t, a, a2, "harness", "ml/a", iam.Runner, time.Minute)
	gen, err := a.Generation(ctx)
	must(t, "Generation", err)
	if n, _, err := b.RevokeToken(ctx, a1, t1Of(a1)); err != nil || n != 3 {
		t.Fatalf("revoking the chain on b: %d, %v", n, err)
	}
	for _, tok := range []string{t1, t2, t3} {
		_, err := a.Authenticate(ctx, tok)
		wantKind(t, "Authenticate on a", err, errdefs.ErrUnauthenticated)
	}
	if g, err := a.Generation(ctx); err != nil || g <= gen {
		t.Fatalf("generation on a %d, was %d (%v)", g, gen, err)
	}
}

func t1Of(a iam.Authority) string { return a.TokenID }

// testReplicasRevokeRacesMint: tokens minted on one Store from the second
// of a chain while the first is revoked on the other are either refused or
// revoked with it: none outlives the revocation.
func testReplicasRevokeRacesMint(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	mkProjects(t, a, "ml")
	person(t, a, "harness", "", "ml:admin")
	_, a1 := token(t, a, admin(), "harness", "ml", iam.Admin, 0)
	_, a2 := token(t, a, a1, "harness", "ml", iam.Admin, 0)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var minted []string
	stop := make(chan struct{})
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				tok, _, err := b.MintToken(ctx, a2, store.TokenSpec{Principal: "harness", Project: "ml", Role: iam.Runner})
				if err != nil {
					if !errors.Is(err, errdefs.ErrUnauthenticated) {
						t.Error(err)
					}
					return
				}
				mu.Lock()
				minted = append(minted, tok)
				mu.Unlock()
			}
		}()
	}
	time.Sleep(50 * time.Millisecond)
	_, _, err := a.RevokeToken(ctx, admin(), a1.TokenID)
	must(t, "RevokeToken", err)
	close(stop)
	wg.Wait()
	if len(minted) == 0 {
		t.Fatal("no mint ran before the revocation")
	}
	for _, tok := range minted {
		if _, err := a.Authenticate(ctx, tok); !errors.Is(err, errdefs.ErrUnauthenticated) {
			t.Fatalf("a token minted during the revocation survived it (%d minted): %v", len(minted), err)
		}
	}
}

// agent2Runner is a runner token of principal agent2 on ml.
func agent2Runner(t *testing.T, st store.Store) iam.Authority {
	_, a := token(t, st, admin(), "agent2", "ml", iam.Runner, 0)
	return a
}
