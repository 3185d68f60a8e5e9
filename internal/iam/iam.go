// Package iam holds dsec's authorisation rules: the roles, the role each API
// operation needs, what a token's authority is on a project, and the
// no-escalation rules for granting roles, minting tokens and setting quotas.
//
// Everything here is pure: the store (package store) gathers the facts — a
// token's project and role, its principal's role bindings — into an
// Authority, and the apiserver asks Allow before it serves a call. Projects
// are named by their path below the root project ("ml/rl-run-42"); the root
// project's path is "" (shown as "/").
package iam

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// Role is what a principal may do on a project and everything under it.
// Roles are ordered: each holds every right of the ones below it.
type Role int

const (
	// None is no role at all.
	None Role = iota
	// Viewer reads: lists and describes sandboxes, layers, snapshots, pools.
	Viewer
	// Runner also runs sandboxes: create, exec, files, FnCall.
	Runner
	// Builder also makes layers, images, snapshots and pools.
	Builder
	// Admin also manages projects, quotas, principals, role bindings and
	// tokens.
	Admin
)

var roleNames = [...]string{None: "none", Viewer: "viewer", Runner: "runner", Builder: "builder", Admin: "admin"}

func (r Role) String() string {
	if r < None || r > Admin {
		return fmt.Sprintf("role(%d)", int(r))
	}
	return roleNames[r]
}

// ParseRole reads a role's name (viewer, runner, builder, admin).
func ParseRole(s string) (Role, error) {
	for r := Viewer; r <= Admin; r++ {
		if roleNames[r] == s {
			return r, nil
		}
	}
	return None, fmt.Errorf("role %q: want viewer, runner, builder or admin: %w", s, errdefs.ErrInvalidArgument)
}

// Binding gives a principal a role on a project and everything under it.
type Binding struct {
	Project string // path
	Role    Role
}

// Authority is what one token may do: the facts Allow decides on. Its
// principal's bindings are the ones in force when the Authority was read.
type Authority struct {
	// Node is the node's administrator (the local Unix socket, dsecd's own
	// commands): every operation is allowed and none of the fields below
	// apply.
	Node bool

	TokenID   string
	Principal string
	// Project is the path of the project the token was minted for: it
	// reaches that project and everything under it.
	Project string
	// Role is the token's role: the most it grants anywhere.
	Role Role
	// Expires is the token's expiry; zero: never.
	Expires time.Time
	// Bindings are the principal's role bindings.
	Bindings []Binding
}

// NodeAdmin is the node administrator's authority.
func NodeAdmin() Authority { return Authority{Node: true, Principal: "node", Role: Admin} }

// Effective is the highest role bindings give on project: the highest
// binding on it or on any project above it.
func Effective(bindings []Binding, project string) Role {
	r := None
	for _, b := range bindings {
		if Within(project, b.Project) && b.Role > r {
			r = b.Role
		}
	}
	return r
}

// On is the authority's role on project: none outside the token's project's
// subtree, else the lower of the token's role and its principal's effective
// role there now.
func (a Authority) On(project string) Role {
	if a.Node {
		return Admin
	}
	if !Within(project, a.Project) {
		return None
	}
	return min(a.Role, Effective(a.Bindings, project))
}

// Reach names where the authority holds at least role r: the projects
// whose subtrees (each project and those under it, Within) make up every
// project p with a.On(p) >= r, none of them under another. All is true
// when that is every project (then projects is nil); an empty projects
// with all false is none. A node's list filters by it before a page is
// cut, where On would need each sandbox's project in the caller's hands.
func (a Authority) Reach(r Role) (projects []string, all bool) {
	if a.On("") >= r {
		return nil, true
	}
	if a.Role < r {
		return nil, false
	}
	// On(p) >= r where p is under the token's project and under a binding
	// of at least r: the deeper of the two, when one holds the other.
	var roots []string
	for _, b := range a.Bindings {
		switch {
		case b.Role < r:
		case Within(b.Project, a.Project):
			roots = append(roots, b.Project)
		case Within(a.Project, b.Project):
			roots = append(roots, a.Project)
		}
	}
	slices.Sort(roots)
	roots = slices.Compact(roots)
	var out []string
	for _, p := range roots {
		// Sorted, an ancestor comes before what lies under it.
		if !slices.ContainsFunc(out, func(o string) bool { return Within(p, o) }) {
			out = append(out, p)
		}
	}
	return out, false
}

// Within reports whether the project at path is ancestor or lies under it.
func Within(path, ancestor string) bool {
	return ancestor == "" || path == ancestor || strings.HasPrefix(path, ancestor+"/")
}

// Ancestors lists the paths from the root down to path, path included.
func Ancestors(path string) []string {
	out := []string{""}
	if path == "" {
		return out
	}
	for i := range len(path) {
		if path[i] == '/' {
			out = append(out, path[:i])
		}
	}
	return append(out, path)
}

// Parent is the path of path's parent ("" for a child of the root); the
// root has none (ok false).
func Parent(path string) (string, bool) {
	if path == "" {
		return "", false
	}
	i := strings.LastIndexByte(path, '/')
	if i < 0 {
		return "", true
	}
	return path[:i], true
}

// Display is how a path is shown to people: the root as "/".
func Display(path string) string {
	if path == "" {
		return "/"
	}
	return path
}

// MaxDepth is how deep projects nest below the root.
const MaxDepth = 16

// CleanPath checks a project path as a user writes it ("ml/rl-run-42",
// "/ml/rl-run-42", "/" for the root) and returns its stored form. A name
// is 1–63 of a-z, 0-9, '-' and '.', starting with a letter or digit.
func CleanPath(p string) (string, error) {
	p = strings.TrimPrefix(p, "/")
	if p == "" {
		return "", nil
	}
	names := strings.Split(p, "/")
	if len(names) > MaxDepth {
		return "", fmt.Errorf("project %q: %d levels deep, at most %d: %w", p, len(names), MaxDepth, errdefs.ErrInvalidArgument)
	}
	for _, n := range names {
		if err := checkName(n); err != nil {
			return "", fmt.Errorf("project %q: %w", p, err)
		}
	}
	return p, nil
}

func checkName(n string) error {
	ok := len(n) >= 1 && len(n) <= 63
	for i := 0; ok && i < len(n); i++ {
		c := n[i]
		ok = c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || i > 0 && (c == '-' || c == '.')
	}
	if !ok {
		return fmt.Errorf("name %q: 1-63 of a-z, 0-9, '-' and '.', starting with a letter or digit: %w", n, errdefs.ErrInvalidArgument)
	}
	return nil
}

// denied is the refusal of op on project, saying what was needed.
func denied(a Authority, what, project string, need, have Role) error {
	return fmt.Errorf("%s on project %s needs %s, token %s of %s holds %s there: %w",
		what, Display(project), need, a.TokenID, a.Principal, have, errdefs.ErrPermissionDenied)
}

// Allow decides whether a may perform op on project (a path). An operation
// not in the table is refused, so a new RPC must be given a role first.
func Allow(a Authority, op Op, project string) error {
	need, ok := Need(op)
	if !ok {
		return fmt.Errorf("operation %s has no role in the IAM table: %w", op, errdefs.ErrPermissionDenied)
	}
	if have := a.On(project); have < need {
		return denied(a, string(op), project, need, have)
	}
	return nil
}

// CheckGrant decides whether a may give a principal role on project: a
// must hold admin there and at least role (no escalation through granting).
func CheckGrant(a Authority, project string, role Role) error {
	if role < Viewer || role > Admin {
		return fmt.Errorf("grant %s: %w", role, errdefs.ErrInvalidArgument)
	}
	have := a.On(project)
	if have < Admin {
		return denied(a, "grant", project, Admin, have)
	}
	if have < role {
		return denied(a, "grant "+role.String(), project, role, have)
	}
	return nil
}

// Mint is a token about to be minted.
type Mint struct {
	Project string // path
	Role    Role
	Expires time.Time // zero: never
	// Principal is the principal the token is for, and PrincipalProject
	// the path of that principal's project.
	Principal        string
	PrincipalProject string
}

// CheckMint decides whether a may mint m: a holds admin on m's project,
// which lies in a's token's subtree, and at least m's role there; m expires
// no later than a's token (a token without expiry may mint any); and m is
// for a's own principal or for one whose project a holds admin on.
func CheckMint(a Authority, m Mint) error {
	if m.Role < Viewer || m.Role > Admin {
		return fmt.Errorf("mint token with role %s: %w", m.Role, errdefs.ErrInvalidArgument)
	}
	if a.Node {
		return nil
	}
	have := a.On(m.Project)
	if have < Admin {
		return denied(a, "mint token", m.Project, Admin, have)
	}
	if have < m.Role {
		return denied(a, "mint "+m.Role.String()+" token", m.Project, m.Role, have)
	}
	if !a.Expires.IsZero() && m.Expires.IsZero() {
		// No ttl is no expiry, not the minter's: say what to ask for.
		return fmt.Errorf("mint token: one without expiry would outlive token %s, which expires %s: give it a ttl of at most %s: %w",
			a.TokenID, a.Expires.UTC().Format(time.RFC3339), time.Until(a.Expires).Truncate(time.Second), errdefs.ErrPermissionDenied)
	}
	if !a.Expires.IsZero() && m.Expires.After(a.Expires) {
		return fmt.Errorf("mint token: it would outlive token %s, which expires %s: %w",
			a.TokenID, a.Expires.UTC().Format(time.RFC3339), errdefs.ErrPermissionDenied)
	}
	if m.Principal != a.Principal {
		if have := a.On(m.PrincipalProject); have < Admin {
			return fmt.Errorf("mint token for principal %s: needs admin on its project %s, token %s holds %s there: %w",
				m.Principal, Display(m.PrincipalProject), a.TokenID, have, errdefs.ErrPermissionDenied)
		}
	}
	return nil
}

// CheckQuota decides whether a may set project's quota: a holds admin on
// it, and the project lies strictly under a's token's project, so the quota
// is carved from what a's project holds (a token on the root, or the node,
// sets the root's own).
func CheckQuota(a Authority, project string) error {
	if a.Node {
		return nil
	}
	if have := a.On(project); have < Admin {
		return denied(a, "set quota", project, Admin, have)
	}
	if project == a.Project && project != "" {
		// Its callers say what was set ("set the sandboxes limit of project ml").
		return fmt.Errorf("a token may set only the quotas of projects under its own (%s): %w",
			Display(a.Project), errdefs.ErrPermissionDenied)
	}
	return nil
}
