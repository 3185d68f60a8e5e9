package apiserver_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/apiserver/iamtest"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

func client(t *testing.T, url, token string) *dsec.Client {
	t.Helper()
	c, err := dsec.NewClient(url, dsec.WithToken(token))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// check(f())(t) is f's value, the test failing on its error.
func check[T any](v T, err error) func(*testing.T) T {
	return func(t *testing.T) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

func wantErr(t *testing.T, what string, err, kind error, words string) {
	t.Helper()
	if !errors.Is(err, kind) || !strings.Contains(err.Error(), words) {
		t.Fatalf("%s: got %v, want %v saying %q", what, err, kind, words)
	}
}

// TestIAMSDK drives the IAM service through the Go SDK on SQLite and
// PostgreSQL: projects, quotas, principals, bindings, tokens, an agent's
// token chain and the audit trail.
func TestIAMSDK(t *testing.T) {
	for name, dsn := range iamtest.Databases() {
		t.Run(name, func(t *testing.T) {
			srv := iamtest.Start(t, dsn(t))
			testIAMSurface(t, srv)
		})
	}
}

func testIAMSurface(t *testing.T, srv *iamtest.Server) {
	ctx := t.Context()
	admin := client(t, srv.URL, srv.AdminToken)

	// Projects.
	for _, p := range []string{"ml", "ml/run-1", "ml/run-2", "other"} {
		if got := check(admin.CreateProject(ctx, p))(t); got.Path != p || got.ID == "" {
			t.Fatalf("CreateProject(%s) = %+v", p, got)
		}
	}
	_, err := admin.CreateProject(ctx, "ml")
	wantErr(t, "create ml again", err, dsec.ErrAlreadyExists, "")
	_, err = admin.CreateProject(ctx, "nope/x")
	wantErr(t, "create under a missing parent", err, dsec.ErrNotFound, "nope")
	if p := check(admin.Project(ctx, "/ml/run-1"))(t); p.Path != "ml/run-1" || p.Depth != 2 {
		t.Fatalf("Project = %+v", p)
	}
	paths := func(ps []dsec.Project) []string {
		var out []string
		for _, p := range ps {
			out = append(out, p.Path)
		}
		return out
	}
	if got := paths(check(admin.Projects(ctx, "ml", false))(t)); !slices.Equal(got, []string{"ml/run-1", "ml/run-2"}) {
		t.Fatalf("Projects(ml) = %v", got)
	}
	if got := paths(check(admin.Projects(ctx, "", true))(t)); !slices.Equal(got, []string{"ml", "ml/run-1", "ml/run-2", "other"}) {
		t.Fatalf("Projects(/, subtree) = %v", got)
	}

	// Quotas: carved from the parent's, use shown for the project and its
	// children, a project in use not deleted.
	if err := admin.SetQuota(ctx, "ml", "sandboxes", 10); err != nil {
		t.Fatal(err)
	}
	if err := admin.SetQuota(ctx, "ml/run-1", "sandboxes", 6); err != nil {
		t.Fatal(err)
	}
	err = admin.SetQuota(ctx, "ml/run-2", "sandboxes", 6)
	wantErr(t, "hand down past the parent's", err, dsec.ErrOverloaded, "project ml holds 10 sandboxes and would hand down 12")
	err = admin.SetQuota(ctx, "ml", "bogus", 1)
	wantErr(t, "unknown resource", err, dsec.ErrInvalidArgument, "bogus")
	if err := srv.Store.Charge(ctx, "ml/run-1", store.Amounts{store.Sandboxes: 2, store.MemoryMB: 512}); err != nil {
		t.Fatal(err)
	}
	qs := check(admin.Quota(ctx, "ml"))(t)
	item := func(q dsec.ProjectQuota, r string) dsec.QuotaItem {
		for _, it := range q.Items {
			if it.Resource == r {
				return it
			}
		}
		t.Fatalf("quota of %s has no %s: %+v", q.Project, r, q)
		return dsec.QuotaItem{}
	}
	if len(qs) != 3 || qs[0].Project != "ml" || qs[1].Project != "ml/run-1" || qs[2].Project != "ml/run-2" {
		t.Fatalf("Quota(ml) = %+v", qs)
	}
	if it := item(qs[0], "sandboxes"); it.Limit != 10 || it.Used != 2 {
		t.Fatalf("ml sandboxes %+v", it)
	}
	if it := item(qs[1], "sandboxes"); it.Limit != 6 || it.Used != 2 {
		t.Fatalf("ml/run-1 sandboxes %+v", it)
	}
	if it := item(qs[2], "memory_mb"); it.Limit != dsec.NoLimit || it.Used != 0 {
		t.Fatalf("ml/run-2 memory %+v", it)
	}
	err = admin.SetQuota(ctx, "ml/run-1", "sandboxes", 1)
	wantErr(t, "take back what is in use", err, dsec.ErrFailedPrecondition, "2 sandboxes in use")
	err = admin.DeleteProject(ctx, "ml/run-1")
	wantErr(t, "delete a project in use", err, dsec.ErrFailedPrecondition, "2 sandboxes")
	if err := srv.Store.Release(ctx, "ml/run-1", store.Amounts{store.Sandboxes: 2, store.MemoryMB: 512}); err != nil {
		t.Fatal(err)
	}

	// Principals and bindings.
	h := check(admin.CreatePrincipal(ctx, "harness", dsec.KindService, "ml"))(t)
	if h.Kind != dsec.KindService || h.Project != "ml" {
		t.Fatalf("CreatePrincipal = %+v", h)
	}
	check(admin.CreatePrincipal(ctx, "alice", dsec.KindUser, "other"))(t)
	if err := admin.Grant(ctx, "harness", "ml", dsec.RoleAdmin); err != nil {
		t.Fatal(err)
	}
	if err := admin.Grant(ctx, "alice", "other", dsec.RoleViewer); err != nil {
		t.Fatal(err)
	}
	if bs := check(admin.Bindings(ctx, "harness"))(t); len(bs) != 1 || bs[0] != (dsec.RoleBinding{Principal: "harness", Project: "ml", Role: "admin"}) {
		t.Fatalf("Bindings(harness) = %+v", bs)
	}
	var names []string
	for _, p := range check(admin.Principals(ctx, "ml"))(t) {
		names = append(names, p.Name)
	}
	if !slices.Equal(names, []string{"harness"}) {
		t.Fatalf("Principals(ml) = %v", names)
	}

	// The harness's token: admin on ml for an hour.
	htok, hinfo := mint(t, admin, dsec.TokenOptions{Principal: "harness", Project: "ml", Role: dsec.RoleAdmin, TTL: time.Hour})
	if hinfo.Parent == "" || hinfo.Expires.IsZero() {
		t.Fatalf("harness token %+v: want a parent (the admin's token) and an expiry", hinfo)
	}
	harness := client(t, srv.URL, htok)
	if got := paths(check(harness.Projects(ctx, "", false))(t)); !slices.Equal(got, []string{"ml/run-1", "ml/run-2"}) {
		t.Fatalf("the harness's Projects() = %v", got)
	}
	if names := principalNames(check(harness.Principals(ctx, ""))(t)); !slices.Equal(names, []string{"harness"}) {
		t.Fatalf("the harness's Principals() = %v", names)
	}

	testEscalations(t, srv, admin, harness)
	testAgentChain(t, srv, harness, hinfo)
	testAudit(t, srv, admin)

	// Tokens listed without secrets, revoked ones marked.
	toks := check(admin.Tokens(ctx, "harness"))(t)
	if len(toks) < 2 {
		t.Fatalf("Tokens(harness) = %+v", toks)
	}
	for _, tk := range toks {
		if strings.Contains(tk.ID, htok) || tk.Revoked.IsZero() {
			t.Fatalf("token %+v: want revoked (the chain's revocation) and no secret", tk)
		}
	}

	// Ungrant, delete what was made.
	if err := admin.Ungrant(ctx, "alice", "other"); err != nil {
		t.Fatal(err)
	}
	err = admin.Ungrant(ctx, "alice", "other")
	wantErr(t, "ungrant again", err, dsec.ErrNotFound, "")
	if err := admin.DeletePrincipal(ctx, "alice"); err != nil {
		t.Fatal(err)
	}
	err = admin.DeleteProject(ctx, "ml")
	wantErr(t, "delete a parent", err, dsec.ErrFailedPrecondition, "child project")
	for _, p := range []string{"ml/run-1", "ml/run-2", "other"} {
		if err := admin.DeleteProject(ctx, p); err != nil {
			t.Fatalf("delete %s: %v", p, err)
		}
	}
}

func mint(t *testing.T, c *dsec.Client, o dsec.TokenOptions) (string, dsec.TokenInfo) {
	t.Helper()
	tok, info, err := c.CreateToken(t.Context(), o)
	if err != nil {
		t.Fatalf("mint %+v: %v", o, err)
	}
	return tok, info
}

func principalNames(ps []dsec.Principal) []string {
	var out []string
	for _, p := range ps {
		out = append(out, p.Name)
	}
	return out
}

// testEscalations: attempts to gain what a token does not hold, each
// refused through the API, and nothing changed.
func testEscalations(t *testing.T, srv *iamtest.Server, admin, harness *dsec.Client) {
	ctx := t.Context()
	// A runner token on ml/run-1, and a token of admin role for alice,
	// who is only a viewer of other.
	rtok, _ := mint(t, harness, dsec.TokenOptions{Project: "ml/run-1", Role: dsec.RoleRunner, TTL: 30 * time.Minute})
	runner := client(t, srv.URL, rtok)
	atok, ainfo := mint(t, admin, dsec.TokenOptions{Principal: "alice", Project: "other", Role: dsec.RoleAdmin, TTL: time.Hour})
	viewer := client(t, srv.URL, atok)
	_, sibling := mint(t, harness, dsec.TokenOptions{Project: "ml/run-1", Role: dsec.RoleRunner, TTL: 30 * time.Minute})

	for _, tc := range []struct {
		name  string
		call  func() error
		kind  error
		words string
	}{
		{"harness mints a token outliving its own", func() error {
			_, _, err := harness.CreateToken(ctx, dsec.TokenOptions{Role: dsec.RoleRunner, TTL: 2 * time.Hour})
			return err
		}, dsec.ErrPermissionDenied, "outlive"},
		{"harness mints a token without expiry", func() error {
			_, _, err := harness.CreateToken(ctx, dsec.TokenOptions{Role: dsec.RoleRunner})
			return err
		}, dsec.ErrPermissionDenied, "outlive"},
		{"harness mints a token on the root", func() error {
			_, _, err := harness.CreateToken(ctx, dsec.TokenOptions{Project: "/", TTL: time.Minute})
			return err
		}, dsec.ErrPermissionDenied, "mint token on project /"},
		{"harness mints for a principal it does not manage", func() error {
			_, _, err := harness.CreateToken(ctx, dsec.TokenOptions{Principal: "alice", Project: "ml", TTL: time.Minute})
			return err
		}, dsec.ErrNotFound, `principal "alice"`},
		{"harness grants itself admin on the root", func() error {
			return harness.Grant(ctx, "harness", "/", dsec.RoleAdmin)
		}, dsec.ErrPermissionDenied, "grant on project /"},
		{"harness raises its own project's quota", func() error {
			return harness.SetQuota(ctx, "ml", "sandboxes", 1000)
		}, dsec.ErrPermissionDenied, "only the quotas of projects under its own"},
		{"harness hands down more than its project holds", func() error {
			return harness.SetQuota(ctx, "ml/run-2", "sandboxes", 11)
		}, dsec.ErrOverloaded, "project ml holds 10 sandboxes"},
		{"harness reads another project", func() error {
			_, err := harness.Project(ctx, "other")
			return err
		}, dsec.ErrNotFound, "project other does not exist"},
		{"harness deletes another project", func() error {
			return harness.DeleteProject(ctx, "other")
		}, dsec.ErrNotFound, "project other does not exist"},
		{"harness makes a principal in another project", func() error {
			_, err := harness.CreatePrincipal(ctx, "mole", dsec.KindUser, "other")
			return err
		}, dsec.ErrNotFound, "project other does not exist"},
		{"harness lists another project's quota", func() error {
			_, err := harness.Quota(ctx, "other")
			return err
		}, dsec.ErrNotFound, "project other does not exist"},
		{"harness queries another project's audit", func() error {
			_, err := harness.Audit(ctx, dsec.AuditQuery{Project: "other"})
			return err
		}, dsec.ErrNotFound, "project other does not exist"},
		{"harness lists alice's tokens", func() error {
			_, err := harness.Tokens(ctx, "alice")
			return err
		}, dsec.ErrNotFound, `principal "alice"`},
		{"harness lists the root's admin's tokens", func() error {
			_, err := harness.Tokens(ctx, "admin")
			return err
		}, dsec.ErrNotFound, `principal "admin" does not exist`},
		{"harness deletes the root's admin", func() error {
			return harness.DeletePrincipal(ctx, "admin")
		}, dsec.ErrNotFound, `principal "admin" does not exist`},
		{"harness revokes a token of a project it cannot see", func() error {
			_, err := harness.RevokeToken(ctx, ainfo.ID)
			return err
		}, dsec.ErrNotFound, "no such token"},
		{"runner revokes a token of its parent's sibling", func() error {
			_, err := runner.RevokeToken(ctx, ainfo.ID)
			return err
		}, dsec.ErrNotFound, "no such token"},
		{"runner revokes another token of its project", func() error {
			_, err := runner.RevokeToken(ctx, sibling.ID)
			return err
		}, dsec.ErrPermissionDenied, "needs admin"},
		{"runner mints a token", func() error {
			_, _, err := runner.CreateToken(ctx, dsec.TokenOptions{Role: dsec.RoleViewer, TTL: time.Minute})
			return err
		}, dsec.ErrPermissionDenied, "needs admin"},
		{"runner grants a role", func() error {
			return runner.Grant(ctx, "harness", "ml/run-1", dsec.RoleViewer)
		}, dsec.ErrPermissionDenied, "needs admin"},
		{"runner sets a quota", func() error {
			return runner.SetQuota(ctx, "ml/run-1", "sandboxes", 1)
		}, dsec.ErrPermissionDenied, "needs admin"},
		{"runner makes a project", func() error {
			_, err := runner.CreateProject(ctx, "ml/run-1/sub")
			return err
		}, dsec.ErrPermissionDenied, "needs admin"},
		{"runner reads the audit trail", func() error {
			_, err := runner.Audit(ctx, dsec.AuditQuery{})
			return err
		}, dsec.ErrPermissionDenied, "needs admin"},
		{"runner reaches its parent project", func() error {
			_, err := runner.Project(ctx, "ml")
			return err
		}, dsec.ErrNotFound, "project ml does not exist"},
		{"an admin-role token of a viewer grants", func() error {
			return viewer.Grant(ctx, "alice", "other", dsec.RoleViewer)
		}, dsec.ErrPermissionDenied, "holds viewer"},
		{"an admin-role token of a viewer mints", func() error {
			_, _, err := viewer.CreateToken(ctx, dsec.TokenOptions{Role: dsec.RoleViewer, TTL: time.Minute})
			return err
		}, dsec.ErrPermissionDenied, "holds viewer"},
		{"a forged token", func() error {
			_, err := client(t, srv.URL, "dsec_forged").Projects(ctx, "", false)
			return err
		}, dsec.ErrUnauthenticated, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantErr(t, tc.name, tc.call(), tc.kind, tc.words)
		})
	}
	// Nothing changed.
	if _, err := viewer.Projects(ctx, "other", false); err != nil {
		t.Fatalf("alice's token after the refused revokes: %v", err)
	}
	// A runner lists its own principal's tokens and bindings, admin of none.
	if ts := check(runner.Tokens(ctx, ""))(t); !slices.ContainsFunc(ts, func(i dsec.TokenInfo) bool { return i.ID == sibling.ID }) {
		t.Fatalf("the runner's own tokens: %+v", ts)
	}
	if bs := check(runner.Bindings(ctx, ""))(t); len(bs) != 1 || bs[0].Project != "ml" {
		t.Fatalf("the runner's own bindings: %+v", bs)
	}
	if bs := check(admin.Bindings(ctx, "harness"))(t); len(bs) != 1 || bs[0].Project != "ml" {
		t.Fatalf("harness's bindings changed: %+v", bs)
	}
	qs := check(admin.Quota(ctx, "ml"))(t)
	for _, q := range qs {
		for _, it := range q.Items {
			want := dsec.NoLimit
			switch {
			case it.Resource != "sandboxes":
			case q.Project == "ml":
				want = 10
			case q.Project == "ml/run-1":
				want = 6
			}
			if it.Limit != want {
				t.Fatalf("quota of %s on %s is %d, want %d", q.Project, it.Resource, it.Limit, want)
			}
		}
	}
	if _, err := admin.Project(ctx, "ml/run-1/sub"); !errors.Is(err, dsec.ErrNotFound) {
		t.Fatalf("ml/run-1/sub: %v", err)
	}
	if names := principalNames(check(admin.Principals(ctx, "/"))(t)); slices.Contains(names, "mole") {
		t.Fatalf("principals %v: mole was made", names)
	}
}

// testAgentChain: an agent's harness mints a narrower token for a
// sub-agent, which works; revoking the harness's token revokes the
// sub-agent's, which stops working within the authentication cache's window.
func testAgentChain(t *testing.T, srv *iamtest.Server, harness *dsec.Client, hinfo dsec.TokenInfo) {
	ctx := t.Context()
	stok, sinfo := mint(t, harness, dsec.TokenOptions{Project: "ml/run-2", Role: dsec.RoleViewer, TTL: 10 * time.Minute})
	if sinfo.Parent != hinfo.ID || sinfo.Principal != "harness" || sinfo.Project != "ml/run-2" || sinfo.Role != dsec.RoleViewer {
		t.Fatalf("sub-agent token %+v (parent want %s)", sinfo, hinfo.ID)
	}
	sub := client(t, srv.URL, stok)
	if _, err := sub.Projects(ctx, "", false); err != nil {
		t.Fatalf("the sub-agent's token: %v", err)
	}
	n, err := harness.RevokeToken(ctx, hinfo.ID)
	if err != nil {
		t.Fatal(err)
	}
	if n < 3 { // the harness's, the runner's of testEscalations, the sub-agent's
		t.Fatalf("revoked %d tokens, want the harness's and the 2 it minted", n)
	}
	// The apiserver may trust a token it checked for its cache's window:
	// poll until the sub-agent is refused.
	deadline := time.Now().Add(time.Minute)
	for {
		_, err := sub.Projects(ctx, "", false)
		if errors.Is(err, dsec.ErrUnauthenticated) {
			break
		}
		if err != nil {
			t.Fatalf("the sub-agent after the revocation: %v", err)
		}
		if time.Now().After(deadline) {
			t.Fatal("the sub-agent's token still works a minute after its parent was revoked")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// testAudit: records of ml and under it, filtered by time and principal,
// exported whole as JSON lines.
func testAudit(t *testing.T, srv *iamtest.Server, admin *dsec.Client) {
	ctx := t.Context()
	// Records of projects and principals nothing else in the test touches,
	// so that records the apiserver may write of the test's own calls do
	// not count; "seedother" lies past "seed"'s subtree in the path order.
	t0 := time.Now().Add(-time.Hour).Truncate(time.Millisecond)
	for i, r := range []store.AuditRecord{
		{At: t0, Principal: "seed-h", Project: "seed", Operation: string(iam.OpCreateProject), Object: "a", Code: "ok"},
		{At: t0.Add(time.Minute), Principal: "seed-h", Project: "seed/x", Operation: string(iam.OpGrant), Object: "b", Code: "permission_denied", Peer: "198.18.0.2:1"},
		{At: t0.Add(2 * time.Minute), Principal: "seed-a", Project: "seedother", Operation: string(iam.OpCreateToken), Object: "c", Code: "ok"},
		{At: t0.Add(3 * time.Minute), Principal: "seed-admin", Project: "seed/y", Operation: string(iam.OpSetQuota), Object: "d", Code: "ok"},
	} {
		if err := srv.Store.AppendAudit(ctx, r); err != nil {
			t.Fatalf("append %d: %v", i, err)
		}
	}
	ops := func(rs []dsec.AuditRecord) []string {
		var out []string
		for _, r := range rs {
			out = append(out, r.Object+"@"+r.Project)
		}
		return out
	}
	if got := ops(check(admin.Audit(ctx, dsec.AuditQuery{Project: "seed"}))(t)); !slices.Equal(got, []string{"a@seed", "b@seed/x", "d@seed/y"}) {
		t.Fatalf("Audit(seed) = %v", got)
	}
	if got := ops(check(admin.Audit(ctx, dsec.AuditQuery{Project: "seed", Since: t0.Add(time.Minute), Until: t0.Add(3 * time.Minute)}))(t)); !slices.Equal(got, []string{"b@seed/x"}) {
		t.Fatalf("Audit(seed, a minute) = %v", got)
	}
	if got := check(admin.Audit(ctx, dsec.AuditQuery{Project: "/", Principal: "seed-a"}))(t); len(got) != 1 || got[0].Operation != string(iam.OpCreateToken) || !got[0].At.Equal(t0.Add(2*time.Minute)) {
		t.Fatalf("Audit(seed-a) = %+v", got)
	}
	var buf bytes.Buffer
	if err := admin.ExportAudit(ctx, dsec.AuditQuery{Project: "/"}, &buf); err != nil {
		t.Fatal(err)
	}
	var lines []store.AuditRecord
	sc := bufio.NewScanner(&buf)
	for sc.Scan() {
		var r store.AuditRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		if strings.HasPrefix(r.Principal, "seed-") {
			lines = append(lines, r)
		}
	}
	if len(lines) != 4 || lines[1].Code != "permission_denied" || lines[1].Peer != "198.18.0.2:1" || !lines[3].At.Equal(t0.Add(3*time.Minute)) {
		t.Fatalf("export = %+v", lines)
	}
	n, err := srv.Store.ExpireAudit(context.WithoutCancel(ctx), t0.Add(90*time.Second))
	if err != nil || n != 2 {
		t.Fatalf("ExpireAudit = %d, %v", n, err)
	}

	// An export longer than the server's page (1,000), with several
	// records in each millisecond at the pages' edges: every record once,
	// in order; and a limit.
	t1 := time.Now().Add(-30 * time.Minute).Truncate(time.Millisecond)
	const many = 2500
	for i := range many {
		r := store.AuditRecord{At: t1.Add(time.Duration(i/3) * time.Millisecond), Principal: "bulk", Project: "bulk",
			Operation: string(iam.OpGetQuota), Object: fmt.Sprint(i), Code: "ok"}
		if err := srv.Store.AppendAudit(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	for _, limit := range []int{0, 1500} {
		buf.Reset()
		if err := admin.ExportAudit(ctx, dsec.AuditQuery{Project: "bulk", Limit: limit}, &buf); err != nil {
			t.Fatal(err)
		}
		want := many
		if limit > 0 {
			want = limit
		}
		sc := bufio.NewScanner(&buf)
		i := 0
		for ; sc.Scan(); i++ {
			var r store.AuditRecord
			if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
				t.Fatal(err)
			}
			if r.Object != fmt.Sprint(i) {
				t.Fatalf("export (limit %d): line %d is record %s", limit, i, r.Object)
			}
		}
		if i != want {
			t.Fatalf("export (limit %d): %d lines, want %d", limit, i, want)
		}
	}
}

// TestIAMPython runs the Python SDK's IAM tests (sdk/python/tests/test_iam.py)
// and docs/python.md's IAM example against an apiserver on SQLite and one
// on PostgreSQL.
func TestIAMPython(t *testing.T) {
	py := testutil.RequireCommand(t, "python3")
	for name, dsn := range iamtest.Databases() {
		t.Run(name, func(t *testing.T) {
			srv := iamtest.Start(t, dsn(t))
			now := time.Now()
			for _, r := range []store.AuditRecord{
				{At: now.Add(-time.Hour), Principal: "admin", Project: "aud", Operation: string(iam.OpCreateProject), Object: "audit-a", Code: "ok"},
				{At: now.Add(-30 * time.Minute), Principal: "bob", Project: "aud/x", Operation: string(iam.OpGrant), Object: "audit-b", Code: "permission_denied"},
				{At: now.Add(-10 * time.Minute), Principal: "admin", Project: "elsewhere", Operation: string(iam.OpSetQuota), Object: "audit-c", Code: "ok"},
			} {
				if err := srv.Store.AppendAudit(t.Context(), r); err != nil {
					t.Fatal(err)
				}
			}
			tests := filepath.Join(testutil.RepoRoot(), "sdk", "python", "tests")
			cmd := exec.CommandContext(t.Context(), py, "-m", "unittest", "-v", "test_iam")
			cmd.Dir = tests
			cmd.Env = append(os.Environ(), "DSEC_TEST_IAM_ADDR="+srv.URL, "DSEC_TEST_IAM_TOKEN="+srv.AdminToken)
			out, err := cmd.CombinedOutput()
			if err != nil || !bytes.Contains(out, []byte("OK")) || bytes.Contains(out, []byte("skipped")) {
				t.Fatalf("python3 -m unittest test_iam: %v\n%s", err, out)
			}
			t.Logf("%s", out)

			example := pythonDocBlock(t, "create_token")
			cmd = exec.CommandContext(t.Context(), py, "-c", example)
			cmd.Env = append(os.Environ(), "DSEC_ADDR="+srv.URL, "DSEC_TOKEN="+srv.AdminToken, "DSEC_TOKEN_FILE=",
				"PYTHONPATH="+filepath.Dir(tests))
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("docs/python.md's IAM example: %v\n%s", err, out)
			}
		})
	}
}

// pythonDocBlock is the Python block of docs/python.md that holds word.
func pythonDocBlock(t *testing.T, word string) string {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join(testutil.RepoRoot(), "docs", "python.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile("(?s)```python\n(.*?)```").FindAllStringSubmatch(string(doc), -1) {
		if strings.Contains(m[1], word) {
			return m[1]
		}
	}
	t.Fatalf("docs/python.md has no Python block with %q", word)
	return ""
}
