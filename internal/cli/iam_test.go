package cli

import (
	"bufio"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"dsec.dev/dsec/internal/apiserver/iamtest"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// TestIAMCommands runs the IAM commands against an apiserver on SQLite and
// on PostgreSQL: projects, quotas, principals, grants, tokens (an agent's
// chain included), escalations refused, the audit trail.
func TestIAMCommands(t *testing.T) {
	for name, dsn := range iamtest.Databases() {
		t.Run(name, func(t *testing.T) {
			testIAMCommands(t, iamtest.Start(t, dsn(t)))
		})
	}
}

func testIAMCommands(t *testing.T, srv *iamtest.Server) {
	t.Setenv("DSEC_TOKEN", "")
	t.Setenv("DSEC_TOKEN_FILE", "")
	as := func(token string, args ...string) (string, string, error) {
		return runCLIErr(t, srv.URL, append([]string{"--token", token}, args...)...)
	}
	ok := func(token string, args ...string) string {
		t.Helper()
		out, stderr, err := as(token, args...)
		if err != nil {
			t.Fatalf("dsec %s: %v (%s)", strings.Join(args, " "), err, stderr)
		}
		return out
	}
	refused := func(token string, code connect.Code, words string, args ...string) {
		t.Helper()
		_, _, err := as(token, args...)
		if connect.CodeOf(err) != code || !strings.Contains(describe(err), words) {
			t.Fatalf("dsec %s: got %v, want %v saying %q", strings.Join(args, " "), err, code, words)
		}
	}
	admin := srv.AdminToken

	// No token: the refusal says once how to send one.
	_, _, err := runCLIErr(t, srv.URL, "ls")
	if connect.CodeOf(err) != connect.CodeUnauthenticated || strings.Count(describe(err), "DSEC_TOKEN_FILE") != 1 {
		t.Fatalf("dsec ls without a token: %v, want one hint of $DSEC_TOKEN_FILE", describe(err))
	}

	ok(admin, "project", "create", "ml")
	ok(admin, "project", "create", "ml/run-1")
	ok(admin, "project", "create", "team")
	if out := ok(admin, "project", "ls"); !strings.Contains(out, "ml\n") && !strings.Contains(out, "ml ") || strings.Contains(out, "ml/run-1") {
		t.Fatalf("project ls:\n%s", out)
	}
	if out := ok(admin, "project", "ls", "--all"); !strings.Contains(out, "ml/run-1") || !strings.Contains(out, "team") {
		t.Fatalf("project ls --all:\n%s", out)
	}
	ok(admin, "project", "quota", "ml", "sandboxes=64", "memory_mb=65536")
	refused(admin, connect.CodeResourceExhausted, "project ml holds 64 sandboxes and would hand down 65", "project", "quota", "ml/run-1", "sandboxes=65")
	ok(admin, "project", "quota", "ml/run-1", "sandboxes=64")
	if err := srv.Store.Charge(t.Context(), "ml/run-1", store.Amounts{store.Sandboxes: 64}); err != nil {
		t.Fatal(err)
	}
	out := ok(admin, "quota", "--project", "ml")
	want := [][]string{
		{"PROJECT", "SANDBOXES", "VCPUS", "MEMORY_MB", "DISK_MB", "SNAPSHOT_BYTES", "LAYER_BYTES", "FNCALL_INFLIGHT", "CREATES_PER_SECOND"},
		{"ml", "64/64", "0", "0/65536", "0", "0", "0", "0", "-"},
		{"ml/run-1", "64/64", "0", "0", "0", "0", "0", "0", "-"},
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != len(want) {
		t.Fatalf("quota --project ml:\n%s", out)
	}
	for i, l := range lines {
		if !slices.Equal(strings.Fields(l), want[i]) {
			t.Fatalf("quota --project ml, line %d: %q, want %q", i, l, want[i])
		}
	}
	if again := ok(admin, "project", "quota", "ml"); again != out {
		t.Fatalf("project quota ml:\n%s\nwant as quota --project ml:\n%s", again, out)
	}
	refused(admin, connect.CodeFailedPrecondition, "64 sandboxes", "project", "rm", "ml/run-1")
	if err := srv.Store.Release(t.Context(), "ml/run-1", store.Amounts{store.Sandboxes: 64}); err != nil {
		t.Fatal(err)
	}

	ok(admin, "principal", "create", "harness", "--kind", "service", "--project", "ml")
	ok(admin, "principal", "create", "bob", "--project", "team")
	if out := ok(admin, "principal", "ls", "--project", "ml"); !strings.Contains(out, "harness") || strings.Contains(out, "bob") {
		t.Fatalf("principal ls --project ml:\n%s", out)
	}
	ok(admin, "grant", "harness", "admin", "--project", "ml")
	ok(admin, "grant", "bob", "runner", "--project", "team")
	if out := ok(admin, "principal", "roles", "harness"); !strings.Contains(out, "ml") || !strings.Contains(out, "admin") {
		t.Fatalf("principal roles harness:\n%s", out)
	}

	// The harness's token, and the narrower one it mints for a sub-agent.
	htok := strings.TrimSpace(ok(admin, "token", "create", "--principal", "harness", "--project", "ml", "--role", "admin", "--ttl", "1h"))
	stok := strings.TrimSpace(ok(htok, "token", "create", "--project", "ml/run-1", "--role", "runner", "--ttl", "10m"))
	if htok == "" || stok == "" || strings.ContainsAny(stok, " \n") {
		t.Fatalf("tokens %q, %q", htok, stok)
	}
	if out := ok(stok, "project", "ls"); !strings.Contains(out, "PROJECT") {
		t.Fatalf("the sub-agent's project ls:\n%s", out)
	}
	// A principal made without --project is at home in the token's
	// project, as every IAM command defaults to it (it was the root's,
	// where the harness holds nothing).
	ok(htok, "principal", "create", "--kind", "service", "agent-1")
	if out := ok(htok, "principal", "ls"); !strings.Contains(out, "agent-1") || !strings.Contains(out, "ml") {
		t.Fatalf("the harness's principal ls after a create without --project:\n%s", out)
	}
	ok(htok, "principal", "rm", "agent-1")
	// Escalations.
	refused(stok, connect.CodePermissionDenied, "needs admin", "token", "create", "--role", "viewer", "--ttl", "1m")
	refused(stok, connect.CodePermissionDenied, "needs admin", "grant", "harness", "viewer", "--project", "ml/run-1")
	refused(stok, connect.CodePermissionDenied, "needs admin", "project", "quota", "ml/run-1", "sandboxes=1")
	refused(htok, connect.CodePermissionDenied, "outlive", "token", "create", "--role", "runner", "--ttl", "2h")
	refused(htok, connect.CodePermissionDenied, "grant on project /", "grant", "harness", "admin", "--project", "/")
	refused(htok, connect.CodeNotFound, "project team does not exist", "project", "rm", "team")
	refused(htok, connect.CodeNotFound, "project team does not exist", "quota", "--project", "team")

	out = ok(admin, "token", "ls", "--principal", "harness")
	if strings.Contains(out, htok) || strings.Contains(out, stok) || strings.Count(out, "\n") != 3 {
		t.Fatalf("token ls:\n%s", out)
	}
	id := strings.Fields(strings.Split(out, "\n")[1])[0]
	if out := ok(htok, "token", "revoke", id); !strings.Contains(out, "revoked 2 token(s)") {
		t.Fatalf("token revoke: %s", out)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		_, _, err := as(stok, "project", "ls")
		if connect.CodeOf(err) == connect.CodeUnauthenticated {
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

	// The audit trail: a table, and JSON lines with --json. The records are
	// of projects and principals the test's own calls (which the apiserver
	// may record) do not touch.
	now := time.Now()
	for _, r := range []store.AuditRecord{
		{At: now.Add(-2 * time.Hour), Principal: "seed-b", Project: "seed", Operation: string(iam.OpGrant), Code: "permission_denied"},
		{At: now.Add(-30 * time.Minute), Principal: "seed-h", Project: "seedml/run-1", Operation: string(iam.OpCreateToken), Object: "tok-1", Code: "ok"},
		{At: now.Add(-10 * time.Minute), Principal: "seed-a", Project: "seed", Operation: string(iam.OpSetQuota), Code: "ok"},
	} {
		if err := srv.Store.AppendAudit(t.Context(), r); err != nil {
			t.Fatal(err)
		}
	}
	out = ok(admin, "audit", "--project", "seedml", "--since", "1h")
	if !strings.Contains(out, "CreateToken") || !strings.Contains(out, "tok-1") || strings.Count(out, "\n") != 2 {
		t.Fatalf("audit --project seedml --since 1h:\n%s", out)
	}
	if out := ok(admin, "audit", "--project", "seed", "--since", "1h"); !strings.Contains(out, "SetQuota") || strings.Contains(out, "Grant") {
		t.Fatalf("audit --project seed --since 1h:\n%s", out)
	}
	out = ok(admin, "--json", "audit", "--since", "3h")
	var recs []store.AuditRecord
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		var r store.AuditRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		if strings.HasPrefix(r.Principal, "seed-") {
			recs = append(recs, r)
		}
	}
	if len(recs) != 3 || recs[0].Principal != "seed-b" || recs[2].Operation != string(iam.OpSetQuota) {
		t.Fatalf("audit --json:\n%s", out)
	}
	if _, _, err := as(admin, "audit", "--since", "yesterday"); err == nil || !strings.Contains(err.Error(), "want a duration ago") {
		t.Fatalf("audit --since yesterday: %v", err)
	}

	ok(admin, "revoke", "bob", "--project", "team")
	refused(admin, connect.CodeNotFound, "", "revoke", "bob", "--project", "team")
	ok(admin, "principal", "rm", "bob")
	ok(admin, "project", "rm", "team")
	refused(admin, connect.CodeNotFound, "project team does not exist", "project", "rm", "team")
}

// TestParseDays: --ttl and --since take whole days as well as Go durations.
func TestParseDays(t *testing.T) {
	for in, want := range map[string]time.Duration{"30d": 30 * 24 * time.Hour, "90m": 90 * time.Minute, "1h30m": 90 * time.Minute, "0d": 0} {
		if got, err := parseDays(in); err != nil || got != want {
			t.Errorf("parseDays(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"d", "-1d", "1.5d", "x", ""} {
		if _, err := parseDays(in); err == nil {
			t.Errorf("parseDays(%q): no error", in)
		}
	}
	now := time.Now()
	if got, err := pointInTime("7d", now); err != nil || !got.Equal(now.Add(-7*24*time.Hour)) {
		t.Errorf("pointInTime(7d) = %v, %v", got, err)
	}
	if got, err := pointInTime("2026-12-01T10:00:00Z", now); err != nil || !got.Equal(time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)) {
		t.Errorf("pointInTime(RFC 3339) = %v, %v", got, err)
	}
}
