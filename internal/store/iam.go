package store

import (
	"context"
	"errors"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// DeleteProjectOptions are how DeleteProject treats what the project
// still owns.
type DeleteProjectOptions struct {
	// ObjectsToParent hands the project's layers, images and snapshots
	// (their records, their bytes' charge and their shares) to its
	// parent, in the transaction that deletes it, instead of refusing;
	// not to the root, whose objects every project sees.
	ObjectsToParent bool
}

// IAM is the store's part for identity and access: the project tree,
// principals, role bindings, tokens, quotas and the audit trail. Projects
// are named by path ("ml/rl-run-42"; the root is "" or "/").
//
// The methods that change authority take the actor's iam.Authority (as
// Authenticate returned it, or iam.NodeAdmin() for the node's
// administrator) and decide with package iam's rules inside their
// transaction, on the actor's token as it is then (read again: a token
// revoked or a binding removed since the actor authenticated counts).
type IAM interface {
	// CreateProject makes the project at path under its existing parent.
	// The actor needs admin on the parent. A path deeper than iam.MaxDepth,
	// or a name taken among its siblings (errdefs.ErrAlreadyExists), is
	// refused.
	CreateProject(ctx context.Context, actor iam.Authority, path string) (Project, error)
	// Project returns the project at path, or errdefs.ErrNotFound.
	Project(ctx context.Context, path string) (Project, error)
	// ProjectByID returns the project with id, or errdefs.ErrNotFound.
	ProjectByID(ctx context.Context, id string) (Project, error)
	// ListProjects lists the children of the project at path, or with
	// subtree every project under it, by path.
	ListProjects(ctx context.Context, path string, subtree bool) ([]Project, error)
	// DeleteProject deletes an empty project: no children, no principals
	// at home in it, no layers, images or snapshots (unless
	// opts.ObjectsToParent hands them to the parent) and nothing charged
	// (errdefs.ErrFailedPrecondition naming what is in use). Its role
	// bindings, tokens and the shares of objects with it go with it. The
	// actor needs admin on the parent; the root is never deleted.
	DeleteProject(ctx context.Context, actor iam.Authority, path string, opts DeleteProjectOptions) error

	// CreatePrincipal makes a principal in a project (whose admins manage
	// it); the actor needs admin there. A name already taken is
	// errdefs.ErrAlreadyExists.
	CreatePrincipal(ctx context.Context, actor iam.Authority, spec PrincipalSpec) (Principal, error)
	// DeletePrincipal deletes a principal with its role bindings and its
	// tokens, and the tokens minted from those; the actor needs admin on
	// its home project.
	DeletePrincipal(ctx context.Context, actor iam.Authority, name string) error
	// Principal returns the principal called name, or errdefs.ErrNotFound.
	Principal(ctx context.Context, name string) (Principal, error)
	// ListPrincipals lists every principal by name.
	ListPrincipals(ctx context.Context) ([]Principal, error)
	// Grant gives principal role on project (replacing a binding it has
	// there). The actor needs admin on project and at least role, and, to
	// replace a binding, at least the replaced role (iam.CheckGrant).
	Grant(ctx context.Context, actor iam.Authority, principal, project string, role iam.Role) error
	// Ungrant removes principal's binding on project (errdefs.ErrNotFound
	// when it has none); the actor needs what granting it takes.
	Ungrant(ctx context.Context, actor iam.Authority, principal, project string) error
	// Bindings lists principal's role bindings by project path.
	Bindings(ctx context.Context, principal string) ([]iam.Binding, error)

	// MintToken mints a token as iam.CheckMint allows the actor. A token
	// minted by a token records it as its parent; the node administrator's
	// have none. The token is returned once; only its SHA-256 is stored.
	MintToken(ctx context.Context, actor iam.Authority, spec TokenSpec) (token string, info TokenInfo, err error)
	// Authenticate returns the authority of a token, with its principal's
	// bindings as they are now. A token that is not valid now is an
	// *AuthError, which wraps errdefs.ErrUnauthenticated and says why.
	Authenticate(ctx context.Context, token string) (iam.Authority, error)
	// RevokeToken revokes a token and every token minted from it,
	// transitively, at once (not at check time), and returns how many it
	// revoked that were not already. A token may revoke itself; otherwise
	// the actor needs admin on the token's project. It returns the
	// token's project (a path) too, which the call is audited under. An
	// unknown ID is errdefs.ErrNotFound; revoking again revokes nothing
	// more.
	RevokeToken(ctx context.Context, actor iam.Authority, tokenID string) (revoked int, project string, err error)
	// ListTokens lists a principal's tokens, revoked and expired ones
	// included, oldest first.
	ListTokens(ctx context.Context, principal string) ([]TokenInfo, error)
	// Generation is a number that grows whenever authority is taken away
	// (a token revoked, a binding lowered or removed, a project deleted):
	// a cache of authentications valid at one generation may be kept until
	// it changes.
	Generation(ctx context.Context) (int64, error)

	// SetLimit sets project's limit on resource (Unlimited: none of its
	// own). A limit is carved from the nearest ancestor's with one: the
	// limits handed down under a project never sum past its own
	// (errdefs.ErrResourceExhausted), nor a limit below what the projects
	// under it hold or below the project's use (errdefs.ErrFailedPrecondition,
	// saying how much). The actor needs admin on the project and, but for
	// the root, a token on a project above it (iam.CheckQuota).
	SetLimit(ctx context.Context, actor iam.Authority, project string, resource Resource, limit int64) error
	// Quota returns the limits and use of project and of its children.
	Quota(ctx context.Context, project string) ([]ProjectQuota, error)
	// Charge adds amounts to the use of project and of every ancestor in
	// one transaction, or nothing when any would pass its limit:
	// errdefs.ErrResourceExhausted naming the highest such project ("quota
	// of project ml/rl-run-42: 64 of 64 sandboxes in use"). It holds under
	// any concurrency, across Stores on one database.
	Charge(ctx context.Context, project string, amounts Amounts) error
	// Release takes amounts off the use of project and its ancestors (never
	// below zero). creates_per_second is not released.
	Release(ctx context.Context, project string, amounts Amounts) error
	// SetUse makes the use of resource by project's own objects (not its
	// descendants') n, adjusting its ancestors by the same difference: a
	// reconciler's correction from the truth.
	SetUse(ctx context.Context, project string, resource Resource, n int64) error
	// ChargeHeld is Charge, and records holds in the same transaction:
	// what something under way holds of the charge (a create until its
	// sandboxes exist, a FnCall call until it ends), each under its own ID
	// (errdefs.ErrAlreadyExists for one held already), until Settle.
	ChargeHeld(ctx context.Context, project string, amounts Amounts, holds []Hold) error
	// ReserveCharged reserves, in one transaction, the keys of rs no
	// reservation holds yet and charges project amounts (held under
	// holds) plus the Charge of each reservation it makes (held under
	// ReservationHold(key, nonce)): the charges of concurrent creates of
	// one project, keyed or not, go to the store together. It returns rs
	// as reserved (nonces filled in) and which of them it reserved; one it
	// did not (its key is held: a retry, another replica's) charged
	// nothing, and its caller reads the reservation that holds it with
	// ReserveCreate. When the sum does not fit nothing is reserved nor
	// charged: errdefs.ErrResourceExhausted.
	ReserveCharged(ctx context.Context, project string, amounts Amounts, holds []Hold, rs []CreateReservation) ([]CreateReservation, []bool, error)
	// Settle ends the holds of ids (of any project; an ID no longer held
	// is skipped). With release what they held is given back (the create
	// failed, the call ended); without, it stays charged (the sandboxes
	// now exist, and hold it).
	Settle(ctx context.Context, ids []string, release bool) error
	// ReleaseSandbox gives back what sandbox id of project held, once:
	// a second release of the same ID (two deletes at once) changes
	// nothing and reports false. It ends the sandbox's HoldRelease hold
	// either way.
	ReleaseSandbox(ctx context.Context, project, id string, amounts Amounts) (bool, error)
	// HoldRelease records, before a live sandbox is deleted, a hold of
	// what it holds without charging it (ReleaseHold(sandbox)), until
	// ReleaseSandbox gives it back and ends the hold: a sweep that lists
	// the edges once the sandbox is gone, but read the use before its
	// release, counts it by the hold and so takes nothing away twice. One
	// that expires (its apiserver died) just goes.
	HoldRelease(ctx context.Context, project, sandbox string, amounts Amounts, expires time.Time) error
	// Uses reads, as of one moment, every project's own use of resources,
	// what its holds hold and its generation, for a reconciler to compare
	// with the truth before correcting it with CorrectUse.
	Uses(ctx context.Context, resources []Resource) ([]Use, error)
	// CorrectUse makes read's project's own use of read's resource n (the
	// truth the edges showed) plus what its holds hold, adjusting its
	// ancestors by the same difference, but only if the project's own use
	// and holds are as Uses read them (the generation and what is held):
	// it reports false, changing nothing, when a charge, release or
	// settle came between.
	CorrectUse(ctx context.Context, read Use, n int64) (bool, error)
	// ExpireHolds releases the holds that expired before now (their
	// creates or calls died with their apiserver) and forgets the
	// sandboxes released an hour before it; it returns how many holds it
	// released.
	ExpireHolds(ctx context.Context, now time.Time) (int, error)

	// AppendAudit records management calls (At defaults to now), in as
	// few statements as it can; on error some may have been stored.
	AppendAudit(ctx context.Context, recs ...AuditRecord) error
	// QueryAudit returns the records q selects, oldest first.
	QueryAudit(ctx context.Context, q AuditQuery) ([]AuditRecord, error)
	// ExpireAudit forgets the records older than olderThan and returns how
	// many.
	ExpireAudit(ctx context.Context, olderThan time.Time) (int, error)
}

// Project is a node of the project tree.
type Project struct {
	ID     string
	Parent string // the parent's ID; "" for the root
	Name   string
	// Path names the project from below the root: "ml/rl-run-42"; the
	// root's is "".
	Path    string
	Depth   int // the root's is 0
	Created time.Time
}

// RootProject is the ID of the root project.
const RootProject = "root"

// Principal kinds.
const (
	KindUser    = "user"    // a person
	KindService = "service" // a harness, an agent, a builder
)

// PrincipalSpec describes a principal to make.
type PrincipalSpec struct {
	Name    string
	Kind    string // KindUser (the default) or KindService
	Project string // path of the project whose admins manage it; "" the root
}

// Principal is an identity that holds role bindings and API tokens.
type Principal struct {
	ID      string
	Name    string
	Kind    string
	Project string // path
	Created time.Time
}

// TokenSpec describes a token to mint.
type TokenSpec struct {
	Principal string
	Project   string // path
	Role      iam.Role
	TTL       time.Duration // 0: no expiry
}

// TokenInfo describes an API token; the token itself is never stored.
type TokenInfo struct {
	ID        string
	Principal string // the principal's name
	Project   string // path
	Role      iam.Role
	// Parent is the ID of the token that minted this one; "" for one the
	// node's administrator minted.
	Parent  string
	Created time.Time
	Expires time.Time // zero: never
	Revoked time.Time // zero: not revoked
}

// Why a token was refused.
const (
	AuthMalformed = "malformed" // not a token dsec mints
	AuthUnknown   = "unknown"   // no such token
	AuthExpired   = "expired"
	AuthRevoked   = "revoked" // itself, or a token it was minted from
)

// AuthError is a token that is not valid now. Callers answer every one
// alike (errdefs.ErrUnauthenticated, one message); Reason is for the audit
// log.
type AuthError struct {
	Reason  string
	TokenID string // when the token is known
}

func (e *AuthError) Error() string { return "invalid, expired or revoked token" }

func (e *AuthError) Unwrap() error { return errdefs.ErrUnauthenticated }

// AuthFailure is why err refused a token ("" when it is no *AuthError).
func AuthFailure(err error) string {
	var ae *AuthError
	if errors.As(err, &ae) {
		return ae.Reason
	}
	return ""
}
