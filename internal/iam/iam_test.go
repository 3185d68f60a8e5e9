package iam_test

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/reflect/protoreflect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Every RPC of the public API's services has a role in the table.
func TestEveryRPCHasARole(t *testing.T) {
	n := 0
	for _, f := range []protoreflect.FileDescriptor{dsecv1.File_dsec_v1_dsec_proto, dsecv1.File_dsec_v1_iam_proto} {
		n += checkRoles(t, f.Services())
	}
	if n < 57 {
		t.Fatalf("found only %d RPCs in dsec.v1", n)
	}
}

func checkRoles(t *testing.T, svcs protoreflect.ServiceDescriptors) int {
	t.Helper()
	n := 0
	for i := range svcs.Len() {
		svc := svcs.Get(i)
		for j := range svc.Methods().Len() {
			op := iam.Op("/" + string(svc.FullName()) + "/" + string(svc.Methods().Get(j).Name()))
			if _, ok := iam.Need(op); !ok {
				t.Errorf("%s has no role in the IAM table", op)
			}
			n++
		}
	}
	return n
}

func TestRoles(t *testing.T) {
	for _, s := range []string{"viewer", "runner", "builder", "admin"} {
		r, err := iam.ParseRole(s)
		if err != nil || r.String() != s {
			t.Fatalf("ParseRole(%q) = %v, %v", s, r, err)
		}
	}
	for _, s := range []string{"", "none", "root", "Admin"} {
		if _, err := iam.ParseRole(s); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Fatalf("ParseRole(%q): %v", s, err)
		}
	}
	if !(iam.Viewer < iam.Runner && iam.Runner < iam.Builder && iam.Builder < iam.Admin) {
		t.Fatal("roles out of order")
	}
}

func TestPaths(t *testing.T) {
	for in, want := range map[string]string{"/": "", "": "", "ml": "ml", "/ml/rl-run-42": "ml/rl-run-42", "a.b/c-1": "a.b/c-1"} {
		if got, err := iam.CleanPath(in); err != nil || got != want {
			t.Errorf("CleanPath(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	deep := "a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a"
	if _, err := iam.CleanPath(deep); err != nil {
		t.Errorf("16 levels: %v", err)
	}
	for _, in := range []string{"ml//x", "ML", "-a", "a b", "a_b", "ml/", deep + "/a", "x/" + string(make([]byte, 64))} {
		if _, err := iam.CleanPath(in); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("CleanPath(%q): %v, want invalid", in, err)
		}
	}
	if got := iam.Ancestors("a/b/c"); len(got) != 4 || got[0] != "" || got[1] != "a" || got[2] != "a/b" || got[3] != "a/b/c" {
		t.Errorf("Ancestors = %q", got)
	}
	if iam.Within("ab", "a") || !iam.Within("a/b", "a") || !iam.Within("a", "") || iam.Within("a", "a/b") {
		t.Error("Within")
	}
}

// tok is a token of principal alice on project with role, her bindings
// given.
func tok(project string, role iam.Role, bindings ...iam.Binding) iam.Authority {
	return iam.Authority{TokenID: "tok-1", Principal: "alice", Project: project, Role: role, Bindings: bindings}
}

// TestReach checks Reach against On over every project of a small tree:
// a project is in one of Reach's subtrees exactly when On gives it the
// role, and no subtree lies in another.
func TestReach(t *testing.T) {
	projects := []string{"", "a", "a-b", "a/b", "a/b/c", "a/d", "e", "e/f"}
	for _, a := range []iam.Authority{
		iam.NodeAdmin(),
		tok("", iam.Admin, iam.Binding{Project: "", Role: iam.Viewer}),
		tok("", iam.Admin, iam.Binding{Project: "a", Role: iam.Viewer}, iam.Binding{Project: "a/b", Role: iam.Admin}, iam.Binding{Project: "e/f", Role: iam.Runner}),
		tok("a", iam.Viewer, iam.Binding{Project: "", Role: iam.Admin}),
		tok("a/b", iam.Runner, iam.Binding{Project: "a", Role: iam.Viewer}, iam.Binding{Project: "e", Role: iam.Admin}),
		tok("a", iam.Admin, iam.Binding{Project: "a/b", Role: iam.Viewer}, iam.Binding{Project: "a/d", Role: iam.Builder}, iam.Binding{Project: "a-b", Role: iam.Admin}),
		tok("a", iam.Viewer),
		tok("", iam.None, iam.Binding{Project: "", Role: iam.Admin}),
	} {
		for _, r := range []iam.Role{iam.Viewer, iam.Runner, iam.Admin} {
			roots, all := a.Reach(r)
			if all && roots != nil {
				t.Errorf("%+v Reach(%v) = %q and all", a, r, roots)
			}
			for _, p := range projects {
				in := all || slices.ContainsFunc(roots, func(root string) bool { return iam.Within(p, root) })
				if want := a.On(p) >= r; in != want {
					t.Errorf("%+v Reach(%v) = %q, %v: holds %q is %v, On says %v", a, r, roots, all, p, in, want)
				}
			}
			for i, x := range roots {
				for j, y := range roots {
					if i != j && iam.Within(x, y) {
						t.Errorf("%+v Reach(%v) = %q: %q lies in %q", a, r, roots, x, y)
					}
				}
			}
		}
	}
}

func TestAllow(t *testing.T) {
	adminML := iam.Binding{Project: "ml", Role: iam.Admin}
	viewerRoot := iam.Binding{Project: "", Role: iam.Viewer}
	tests := []struct {
		name    string
		a       iam.Authority
		op      iam.Op
		project string
		ok      bool
	}{
		{"admin token on its project", tok("ml", iam.Admin, adminML), "/dsec.v1.SandboxService/Create", "ml", true},
		{"reaches below", tok("ml", iam.Runner, adminML), "/dsec.v1.SandboxService/Exec", "ml/rl/a", true},
		{"not above", tok("ml/rl", iam.Admin, adminML), "/dsec.v1.SandboxService/List", "ml", false},
		{"not a sibling", tok("ml", iam.Admin, adminML), "/dsec.v1.SandboxService/Get", "mlx", false},
		{"token role caps", tok("ml", iam.Viewer, adminML), "/dsec.v1.SandboxService/Exec", "ml", false},
		{"viewer reads", tok("ml", iam.Viewer, adminML), "/dsec.v1.SandboxService/List", "ml", true},
		{"principal caps", tok("", iam.Admin, viewerRoot), "/dsec.v1.SandboxService/Create", "ml", false},
		{"binding lower down", tok("", iam.Admin, viewerRoot, adminML), "/dsec.v1.LayerService/ImportLayer", "ml/x", true},
		{"binding elsewhere", tok("", iam.Admin, viewerRoot, adminML), "/dsec.v1.LayerService/ImportLayer", "cv", false},
		{"no binding", tok("", iam.Admin), "/dsec.v1.SandboxService/List", "", false},
		{"runner cannot build", tok("ml", iam.Runner, adminML), "/dsec.v1.SandboxService/Snapshot", "ml", false},
		{"builder builds", tok("ml", iam.Builder, adminML), "/dsec.v1.SandboxService/SetWarmPool", "ml", true},
		{"runner cannot mint", tok("ml", iam.Runner, adminML), iam.OpCreateToken, "ml", false},
		{"runner cannot grant", tok("ml", iam.Runner, adminML), iam.OpGrant, "ml", false},
		{"runner cannot set quota", tok("ml", iam.Runner, adminML), iam.OpSetQuota, "ml/x", false},
		{"unknown op", tok("ml", iam.Admin, adminML), "/dsec.v1.SandboxService/Nope", "ml", false},
		{"node", iam.NodeAdmin(), iam.OpDeleteProject, "ml", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := iam.Allow(tc.a, tc.op, tc.project)
			if tc.ok && err != nil {
				t.Fatalf("refused: %v", err)
			}
			if !tc.ok && !errors.Is(err, errdefs.ErrPermissionDenied) {
				t.Fatalf("got %v, want permission denied", err)
			}
		})
	}
}

// TestNoEscalation: the ways an actor might grant, mint or set a quota it
// does not hold, each refused; and the narrower ones allowed.
func TestNoEscalation(t *testing.T) {
	hour := time.Now().Add(time.Hour)
	adminML := iam.Binding{Project: "ml", Role: iam.Admin}
	builderML := iam.Binding{Project: "ml", Role: iam.Builder}
	adminMLRL := iam.Binding{Project: "ml/rl", Role: iam.Admin}
	expiring := tok("ml", iam.Admin, adminML)
	expiring.Expires = hour
	tests := []struct {
		name  string
		check func() error
		ok    bool
	}{
		{"grant admin below own", func() error { return iam.CheckGrant(tok("ml", iam.Admin, adminML), "ml/rl", iam.Admin) }, true},
		{"grant runner", func() error { return iam.CheckGrant(tok("ml", iam.Admin, adminML), "ml", iam.Runner) }, true},
		{"grant above own project", func() error { return iam.CheckGrant(tok("ml", iam.Admin, adminML), "", iam.Viewer) }, false},
		{"grant on a sibling", func() error { return iam.CheckGrant(tok("ml", iam.Admin, adminML), "cv", iam.Viewer) }, false},
		{"builder grants", func() error { return iam.CheckGrant(tok("ml", iam.Builder, builderML), "ml", iam.Viewer) }, false},
		{"admin token, builder principal", func() error { return iam.CheckGrant(tok("ml", iam.Admin, builderML), "ml", iam.Viewer) }, false},
		{"grant past the token's role", func() error {
			// Admin on ml/rl through her binding, but the token holds admin
			// only below ml/rl: on ml she has builder, can grant nothing there.
			return iam.CheckGrant(tok("ml", iam.Admin, builderML, adminMLRL), "ml", iam.Builder)
		}, false},
		{"grant invalid role", func() error { return iam.CheckGrant(tok("ml", iam.Admin, adminML), "ml", iam.Role(9)) }, false},

		{"mint narrower", func() error {
			return iam.CheckMint(tok("ml", iam.Admin, adminML), iam.Mint{Project: "ml/rl", Role: iam.Runner, Principal: "alice"})
		}, true},
		{"mint outside subtree", func() error {
			return iam.CheckMint(tok("ml/rl", iam.Admin, adminML), iam.Mint{Project: "ml", Role: iam.Runner, Principal: "alice"})
		}, false},
		{"runner mints", func() error {
			return iam.CheckMint(tok("ml", iam.Runner, adminML), iam.Mint{Project: "ml", Role: iam.Runner, Principal: "alice"})
		}, false},
		{"mint more than principal holds", func() error {
			return iam.CheckMint(tok("", iam.Admin, adminML, iam.Binding{Project: "", Role: iam.Viewer}),
				iam.Mint{Project: "cv", Role: iam.Runner, Principal: "alice"})
		}, false},
		{"mint longer than own", func() error {
			return iam.CheckMint(expiring, iam.Mint{Project: "ml", Role: iam.Runner, Expires: hour.Add(time.Second), Principal: "alice"})
		}, false},
		{"mint without expiry from expiring", func() error {
			return iam.CheckMint(expiring, iam.Mint{Project: "ml", Role: iam.Runner, Principal: "alice"})
		}, false},
		{"mint shorter", func() error {
			return iam.CheckMint(expiring, iam.Mint{Project: "ml", Role: iam.Runner, Expires: hour, Principal: "alice"})
		}, true},
		{"no-expiry token mints any", func() error {
			return iam.CheckMint(tok("ml", iam.Admin, adminML), iam.Mint{Project: "ml", Role: iam.Admin, Principal: "alice"})
		}, true},
		{"mint for a principal of own project", func() error {
			return iam.CheckMint(tok("ml", iam.Admin, adminML), iam.Mint{Project: "ml/rl", Role: iam.Runner, Principal: "agent", PrincipalProject: "ml/rl"})
		}, true},
		{"mint for a principal elsewhere", func() error {
			return iam.CheckMint(tok("ml", iam.Admin, adminML), iam.Mint{Project: "ml", Role: iam.Runner, Principal: "bob", PrincipalProject: ""})
		}, false},

		{"quota of a child", func() error { return iam.CheckQuota(tok("ml", iam.Admin, adminML), "ml/rl") }, true},
		{"quota of own project", func() error { return iam.CheckQuota(tok("ml", iam.Admin, adminML), "ml") }, false},
		{"quota of the parent", func() error { return iam.CheckQuota(tok("ml", iam.Admin, adminML), "") }, false},
		{"quota as builder", func() error { return iam.CheckQuota(tok("ml", iam.Builder, adminML), "ml/rl") }, false},
		{"root admin sets root's", func() error {
			return iam.CheckQuota(tok("", iam.Admin, iam.Binding{Project: "", Role: iam.Admin}), "")
		}, true},
		{"node sets any", func() error { return iam.CheckQuota(iam.NodeAdmin(), "") }, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.check()
			if tc.ok && err != nil {
				t.Fatalf("refused: %v", err)
			}
			if !tc.ok && err == nil {
				t.Fatal("allowed")
			}
			if !tc.ok && !errors.Is(err, errdefs.ErrPermissionDenied) && !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("got %v, want permission denied", err)
			}
		})
	}
}

// TestMintWithoutTTL: a mint without a ttl from a token that expires is
// refused saying to give it one, and how long it may be at most.
func TestMintWithoutTTL(t *testing.T) {
	a := iam.Authority{TokenID: "tok-1", Principal: "harness", Project: "ml", Role: iam.Admin,
		Expires: time.Now().Add(2 * time.Hour), Bindings: []iam.Binding{{Project: "ml", Role: iam.Admin}}}
	err := iam.CheckMint(a, iam.Mint{Project: "ml", Role: iam.Runner, Principal: "harness", PrincipalProject: "ml"})
	if !errors.Is(err, errdefs.ErrPermissionDenied) || !strings.Contains(err.Error(), "one without expiry would outlive token tok-1") ||
		!strings.Contains(err.Error(), "give it a ttl of at most 1h59m") {
		t.Fatalf("mint without a ttl: %v", err)
	}
}
