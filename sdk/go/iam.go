package dsec

import (
	"context"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Projects, quotas, principals, role bindings, tokens and the audit trail
// (docs/iam.md). Projects are named by their path below the root
// ("ml/rl-run-42"; the root is "/" or ""). Every call acts with the
// client's token: no one grants a role, mints a token or hands down a
// quota they do not hold (ErrPermissionDenied); a project the token cannot
// see is ErrNotFound.

// Project is a node of the project tree.
type Project struct {
	Path    string // "" for the root
	ID      string
	Depth   int // the root's is 0
	Created time.Time
}

// Principal is a person (KindUser) or a service account (KindService: a
// harness, an agent, a builder) at home in a project, whose admins manage
// it.
type Principal struct {
	Name    string
	Kind    string
	Project string
	ID      string
	Created time.Time
}

// Principal kinds.
const (
	KindUser    = "user"
	KindService = "service"
)

// Roles, each holding every right of the ones before it.
const (
	RoleViewer  = "viewer"  // read
	RoleRunner  = "runner"  // also sandboxes, exec, files, FnCall
	RoleBuilder = "builder" // also layers, images, snapshots, pools
	RoleAdmin   = "admin"   // also projects, quotas, principals, tokens, audit
)

// ProjectLabel is the label that puts a sandbox in a project: a create
// whose Labels give it a path (Labels: {ProjectLabel: "ml/rl-run-42"}) makes
// its sandboxes there, charged to that project's quota, which the token
// must hold runner on; without it they belong to the token's project.
const ProjectLabel = "dsec.dev/project"

// RoleBinding gives a principal a role on a project and everything under it.
type RoleBinding struct {
	Principal string
	Project   string
	Role      string
}

// TokenInfo describes an API token; its secret is never shown again.
type TokenInfo struct {
	ID        string
	Principal string
	Project   string
	Role      string
	Parent    string // the token that minted it; "" the node's administrator
	Created   time.Time
	Expires   time.Time // zero: never
	Revoked   time.Time // zero: not revoked
}

// QuotaItem is one resource of a project's quota: Limit is NoLimit when the
// project has none of its own (its ancestors' bound it); Used counts the
// project and everything under it.
type QuotaItem struct {
	Resource string
	Limit    int64
	Used     int64
}

// NoLimit is the limit of a project without one of its own.
const NoLimit int64 = -1

// ProjectQuota is a project's quota, a QuotaItem per resource.
type ProjectQuota struct {
	Project string
	Items   []QuotaItem
}

// AuditRecord is one management call.
type AuditRecord struct {
	ID        int64
	At        time.Time
	Principal string
	TokenID   string
	Project   string
	Operation string
	Object    string
	Code      string // "ok", or the error's code (permission_denied…)
	Peer      string
	Message   string
}

// AuditQuery selects audit records; zero fields select everything.
type AuditQuery struct {
	// Project selects a project and everything under it; "" the token's
	// own project. Use "/" for the root.
	Project   string
	Since     time.Time
	Until     time.Time // exclusive
	Principal string
	Limit     int // 0: the server's default (1,000) for Audit, all for ExportAudit
}

// TokenOptions describe a token to mint. Zero fields take the minting
// token's own: its principal, its project, its role.
type TokenOptions struct {
	Principal string
	Project   string
	Role      string
	// TTL is the token's lifetime; 0 never expires, which only a token
	// without expiry may mint.
	TTL time.Duration
}

func msTime(ms int64) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

func projectOf(p *dsecv1.Project) Project {
	return Project{Path: p.GetPath(), ID: p.GetId(), Depth: int(p.GetDepth()), Created: msTime(p.GetCreatedUnixMs())}
}

func principalOf(p *dsecv1.Principal) Principal {
	return Principal{Name: p.GetName(), Kind: p.GetKind(), Project: p.GetProject(), ID: p.GetId(), Created: msTime(p.GetCreatedUnixMs())}
}

func tokenInfoOf(t *dsecv1.TokenInfo) TokenInfo {
	return TokenInfo{ID: t.GetId(), Principal: t.GetPrincipal(), Project: t.GetProject(), Role: t.GetRole(), Parent: t.GetParent(),
		Created: msTime(t.GetCreatedUnixMs()), Expires: msTime(t.GetExpiresUnixMs()), Revoked: msTime(t.GetRevokedUnixMs())}
}

// optPath is p for a request's optional project: unset when "".
func optPath(p string) *string {
	if p == "" {
		return nil
	}
	return &p
}

// call runs one unary IAM call; idempotent calls may be retried.
func iamCall[Req, Resp any](ctx context.Context, c *Client, idempotent bool, what string,
	fn func(context.Context, *connect.Request[Req]) (*connect.Response[Resp], error), req *Req) (*Resp, error) {
	var out *Resp
	err := c.unary(ctx, idempotent, func(ctx context.Context) error {
		r, err := fn(ctx, connect.NewRequest(req))
		if err == nil {
			out = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return out, nil
}

// CreateProject makes the project at path under its existing parent; the
// token needs admin on the parent.
func (c *Client) CreateProject(ctx context.Context, path string) (Project, error) {
	p, err := iamCall(ctx, c, false, "create project "+path, c.iam.CreateProject, &dsecv1.CreateProjectRequest{Path: path})
	if err != nil {
		return Project{}, err
	}
	return projectOf(p), nil
}

// Project describes the project at path.
func (c *Client) Project(ctx context.Context, path string) (Project, error) {
	p, err := iamCall(ctx, c, true, "get project "+path, c.iam.GetProject, &dsecv1.GetProjectRequest{Path: path})
	if err != nil {
		return Project{}, err
	}
	return projectOf(p), nil
}

// Projects lists the children of the project at path ("" the token's own
// project), or with subtree every project under it.
func (c *Client) Projects(ctx context.Context, path string, subtree bool) ([]Project, error) {
	r, err := iamCall(ctx, c, true, "list projects", c.iam.ListProjects, &dsecv1.ListProjectsRequest{Path: optPath(path), Subtree: subtree})
	if err != nil {
		return nil, err
	}
	out := make([]Project, 0, len(r.GetProjects()))
	for _, p := range r.GetProjects() {
		out = append(out, projectOf(p))
	}
	return out, nil
}

// DeleteProject deletes an empty project with its role bindings and tokens;
// one in use (its layers, images and snapshots included) is
// ErrFailedPrecondition saying what uses it.
func (c *Client) DeleteProject(ctx context.Context, path string) error {
	return c.DeleteProjectWith(ctx, path, DeleteProjectOptions{})
}

// DeleteProjectOptions are how a project's deletion treats what it owns.
type DeleteProjectOptions struct {
	// ObjectsToParent hands the project's layers, images and snapshots
	// (their names, shares and bytes' charge) to its parent instead of
	// refusing while it owns any.
	ObjectsToParent bool
}

// DeleteProjectWith is DeleteProject with options.
func (c *Client) DeleteProjectWith(ctx context.Context, path string, opts DeleteProjectOptions) error {
	_, err := iamCall(ctx, c, false, "delete project "+path, c.iam.DeleteProject,
		&dsecv1.DeleteProjectRequest{Path: path, ObjectsToParent: opts.ObjectsToParent})
	return err
}

// Quota returns the quota of the project at path ("" the token's own) and of
// each of its children, the project first.
func (c *Client) Quota(ctx context.Context, path string) ([]ProjectQuota, error) {
	r, err := iamCall(ctx, c, true, "get quota", c.iam.GetQuota, &dsecv1.GetQuotaRequest{Project: optPath(path)})
	if err != nil {
		return nil, err
	}
	out := make([]ProjectQuota, 0, len(r.GetProjects()))
	for _, p := range r.GetProjects() {
		q := ProjectQuota{Project: p.GetProject()}
		for _, it := range p.GetItems() {
			q.Items = append(q.Items, QuotaItem{Resource: it.GetResource(), Limit: it.GetLimit(), Used: it.GetUsed()})
		}
		out = append(out, q)
	}
	return out, nil
}

// SetQuota sets the limit of the project at path on resource (sandboxes,
// vcpus, memory_mb, disk_mb, snapshot_bytes, layer_bytes, fncall_inflight,
// creates_per_second); NoLimit removes its own. The limit is carved from
// the nearest limited ancestor's: past what it has left is
// ErrResourceExhausted, below what is in use ErrFailedPrecondition.
func (c *Client) SetQuota(ctx context.Context, path, resource string, limit int64) error {
	_, err := iamCall(ctx, c, true, fmt.Sprintf("set quota of %s on %s", path, resource), c.iam.SetQuota,
		&dsecv1.SetQuotaRequest{Project: path, Resource: resource, Limit: limit})
	return err
}

// CreatePrincipal makes a principal of kind (KindUser, KindService) at home
// in the project at path ("" the token's project).
func (c *Client) CreatePrincipal(ctx context.Context, name, kind, path string) (Principal, error) {
	p, err := iamCall(ctx, c, false, "create principal "+name, c.iam.CreatePrincipal,
		&dsecv1.CreatePrincipalRequest{Name: name, Kind: kind, Project: path})
	if err != nil {
		return Principal{}, err
	}
	return principalOf(p), nil
}

// Principals lists the principals at home in the project at path ("" the
// token's own) or under it that the token administers.
func (c *Client) Principals(ctx context.Context, path string) ([]Principal, error) {
	r, err := iamCall(ctx, c, true, "list principals", c.iam.ListPrincipals, &dsecv1.ListPrincipalsRequest{Project: optPath(path)})
	if err != nil {
		return nil, err
	}
	out := make([]Principal, 0, len(r.GetPrincipals()))
	for _, p := range r.GetPrincipals() {
		out = append(out, principalOf(p))
	}
	return out, nil
}

// DeletePrincipal deletes a principal, its role bindings, its tokens and
// the tokens minted from them.
func (c *Client) DeletePrincipal(ctx context.Context, name string) error {
	_, err := iamCall(ctx, c, false, "delete principal "+name, c.iam.DeletePrincipal, &dsecv1.DeletePrincipalRequest{Name: name})
	return err
}

// Grant gives principal role on the project at path and everything under
// it, replacing a binding it has there. The token needs admin there and at
// least role.
func (c *Client) Grant(ctx context.Context, principal, path, role string) error {
	_, err := iamCall(ctx, c, true, fmt.Sprintf("grant %s %s on %s", principal, role, path), c.iam.Grant,
		&dsecv1.GrantRequest{Principal: principal, Project: path, Role: role})
	return err
}

// Ungrant removes principal's role binding on the project at path.
func (c *Client) Ungrant(ctx context.Context, principal, path string) error {
	_, err := iamCall(ctx, c, false, fmt.Sprintf("revoke %s's role on %s", principal, path), c.iam.Ungrant,
		&dsecv1.UngrantRequest{Principal: principal, Project: path})
	return err
}

// Bindings lists principal's role bindings ("" the token's own principal).
func (c *Client) Bindings(ctx context.Context, principal string) ([]RoleBinding, error) {
	r, err := iamCall(ctx, c, true, "list role bindings", c.iam.ListBindings, &dsecv1.ListBindingsRequest{Principal: principal})
	if err != nil {
		return nil, err
	}
	out := make([]RoleBinding, 0, len(r.GetBindings()))
	for _, b := range r.GetBindings() {
		out = append(out, RoleBinding{Principal: b.GetPrincipal(), Project: b.GetProject(), Role: b.GetRole()})
	}
	return out, nil
}

// CreateToken mints a token as o describes, no more than the client's own
// token holds: a project in its subtree, a role at most its own, a
// lifetime ending no later. It returns the token, which is shown once, and
// its description. An agent mints a narrower token for a sub-agent this
// way; revoking the agent's token revokes it too.
func (c *Client) CreateToken(ctx context.Context, o TokenOptions) (string, TokenInfo, error) {
	if o.TTL < 0 {
		return "", TokenInfo{}, invalid("token TTL must not be negative")
	}
	ttl := int64(o.TTL / time.Second)
	if o.TTL > 0 && ttl == 0 {
		ttl = 1
	}
	r, err := iamCall(ctx, c, false, "create token", c.iam.CreateToken,
		&dsecv1.CreateTokenRequest{Principal: o.Principal, Project: o.Project, Role: o.Role, TtlSeconds: ttl})
	if err != nil {
		return "", TokenInfo{}, err
	}
	return r.GetToken(), tokenInfoOf(r.GetInfo()), nil
}

// RevokeToken revokes the token with id and every token minted from it, and
// returns how many it revoked now.
func (c *Client) RevokeToken(ctx context.Context, id string) (int, error) {
	r, err := iamCall(ctx, c, true, "revoke token "+id, c.iam.RevokeToken, &dsecv1.RevokeTokenRequest{Id: id})
	if err != nil {
		return 0, err
	}
	return int(r.GetRevoked()), nil
}

// Tokens lists principal's tokens ("" the token's own principal), revoked
// and expired ones included, oldest first, without their secrets.
func (c *Client) Tokens(ctx context.Context, principal string) ([]TokenInfo, error) {
	r, err := iamCall(ctx, c, true, "list tokens", c.iam.ListTokens, &dsecv1.ListTokensRequest{Principal: principal})
	if err != nil {
		return nil, err
	}
	out := make([]TokenInfo, 0, len(r.GetTokens()))
	for _, t := range r.GetTokens() {
		out = append(out, tokenInfoOf(t))
	}
	return out, nil
}

func (q AuditQuery) msg() *dsecv1.QueryAuditRequest {
	m := &dsecv1.QueryAuditRequest{Project: optPath(q.Project), Principal: q.Principal, Limit: int32(q.Limit)}
	if !q.Since.IsZero() {
		m.SinceUnixMs = q.Since.UnixMilli()
	}
	if !q.Until.IsZero() {
		m.UntilUnixMs = q.Until.UnixMilli()
	}
	return m
}

// Audit returns the audit records q selects, oldest first.
func (c *Client) Audit(ctx context.Context, q AuditQuery) ([]AuditRecord, error) {
	r, err := iamCall(ctx, c, true, "query the audit trail", c.iam.QueryAudit, q.msg())
	if err != nil {
		return nil, err
	}
	out := make([]AuditRecord, 0, len(r.GetRecords()))
	for _, a := range r.GetRecords() {
		out = append(out, AuditRecord{ID: a.GetId(), At: msTime(a.GetAtUnixMs()), Principal: a.GetPrincipal(), TokenID: a.GetTokenId(),
			Project: a.GetProject(), Operation: a.GetOperation(), Object: a.GetObject(), Code: a.GetCode(), Peer: a.GetPeer(), Message: a.GetMessage()})
	}
	return out, nil
}

// ExportAudit writes every record q selects (all, unless q.Limit) to w as
// JSON lines, one object a line, as the server streams them. It is not
// retried: w may hold part of the export when it fails.
func (c *Client) ExportAudit(ctx context.Context, q AuditQuery, w io.Writer) error {
	ctx, cancel := withTimeout(ctx, 10*c.timeout)
	defer cancel()
	stream, err := c.iam.ExportAudit(ctx, connect.NewRequest(q.msg()))
	if err != nil {
		return fmt.Errorf("export the audit trail: %w", fromConnect(err, false))
	}
	defer stream.Close()
	for stream.Receive() {
		if _, err := w.Write(stream.Msg().GetData()); err != nil {
			return fmt.Errorf("export the audit trail: %w", err)
		}
	}
	if err := stream.Err(); err != nil {
		return fmt.Errorf("export the audit trail: %w", fromConnect(err, false))
	}
	return nil
}
