package apiserver

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// iamService serves dsec.v1.IAMService: projects, quotas, principals, role
// bindings, tokens and the audit trail. Every change goes through the
// store's IAM methods with the caller's authority, which decide with package
// iam's rules in their transaction, so no caller grants, mints or hands down
// more than it holds; the reads, which the store does not decide, are
// decided here with iam.Allow. A project the caller cannot see answers
// NotFound with the store's words for one that does not exist.
type iamService struct {
	st  store.IAM
	log *slog.Logger
	// pools lists the warm pools of every node (nil: none to check).
	pools func(ctx context.Context) ([]*dsecv1.WarmPool, error)
}

// actor is the caller's authority, which the auth interceptor puts in
// the context of every call of the service (the node's administrator's
// over the Unix socket or in process). A call without one holds no role.
func actor(ctx context.Context) iam.Authority {
	a, _ := iam.AuthorityFrom(ctx)
	return a
}

// notFound is the answer for a project that does not exist or that the
// caller cannot see: the same words for both.
func notFound(path string) error {
	return fmt.Errorf("project %s does not exist: %w", iam.Display(path), errdefs.ErrNotFound)
}

// see refuses a project the caller holds no role on as if it did not exist.
// Everyone knows the root exists: a refusal there is the store's or Allow's
// PermissionDenied.
func see(a iam.Authority, path string) error {
	if path != "" && a.On(path) == iam.None {
		return notFound(path)
	}
	return nil
}

// allow decides a read the store does not decide: NotFound for a project
// the caller cannot see, else iam.Allow.
func allow(a iam.Authority, op iam.Op, path string) error {
	if err := see(a, path); err != nil {
		return err
	}
	return iam.Allow(a, op, path)
}

// projectOr cleans path, or the caller's token's project when p is nil.
func projectOr(a iam.Authority, p *string) (string, error) {
	if p == nil {
		if a.Node {
			return "", nil
		}
		return a.Project, nil
	}
	return iam.CleanPath(*p)
}

func unixMs(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMilli()
}

func timeOf(ms int64) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

func projectMsg(p store.Project) *dsecv1.Project {
	return &dsecv1.Project{Path: p.Path, Id: p.ID, Depth: int32(p.Depth), CreatedUnixMs: unixMs(p.Created)}
}

func principalMsg(p store.Principal) *dsecv1.Principal {
	return &dsecv1.Principal{Name: p.Name, Kind: p.Kind, Project: p.Project, Id: p.ID, CreatedUnixMs: unixMs(p.Created)}
}

func tokenMsg(t store.TokenInfo) *dsecv1.TokenInfo {
	return &dsecv1.TokenInfo{Id: t.ID, Principal: t.Principal, Project: t.Project, Role: t.Role.String(), Parent: t.Parent,
		CreatedUnixMs: unixMs(t.Created), ExpiresUnixMs: unixMs(t.Expires), RevokedUnixMs: unixMs(t.Revoked)}
}

func auditMsg(r store.AuditRecord) *dsecv1.AuditRecord {
	return &dsecv1.AuditRecord{Id: r.ID, AtUnixMs: unixMs(r.At), Principal: r.Principal, TokenId: r.TokenID, Project: r.Project,
		Operation: r.Operation, Object: r.Object, Code: r.Code, Peer: r.Peer, Message: r.Message}
}

func (v *iamService) CreateProject(ctx context.Context, req *connect.Request[dsecv1.CreateProjectRequest]) (*connect.Response[dsecv1.Project], error) {
	a := actor(ctx)
	path, err := iam.CleanPath(req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if parent, ok := iam.Parent(path); ok {
		if err := see(a, parent); err != nil {
			return nil, err
		}
	}
	p, err := v.st.CreateProject(ctx, a, path)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(projectMsg(p)), nil
}

func (v *iamService) GetProject(ctx context.Context, req *connect.Request[dsecv1.GetProjectRequest]) (*connect.Response[dsecv1.Project], error) {
	a := actor(ctx)
	path, err := iam.CleanPath(req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if err := allow(a, iam.OpGetProject, path); err != nil {
		return nil, err
	}
	p, err := v.st.Project(ctx, path)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(projectMsg(p)), nil
}

func (v *iamService) ListProjects(ctx context.Context, req *connect.Request[dsecv1.ListProjectsRequest]) (*connect.Response[dsecv1.ListProjectsResponse], error) {
	a := actor(ctx)
	path, err := projectOr(a, req.Msg.Path)
	if err != nil {
		return nil, err
	}
	if err := allow(a, iam.OpListProjects, path); err != nil {
		return nil, err
	}
	ps, err := v.st.ListProjects(ctx, path, req.Msg.GetSubtree())
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListProjectsResponse{}
	for _, p := range ps {
		out.Projects = append(out.Projects, projectMsg(p))
	}
	return connect.NewResponse(out), nil
}

func (v *iamService) DeleteProject(ctx context.Context, req *connect.Request[dsecv1.DeleteProjectRequest]) (*connect.Response[dsecv1.DeleteProjectResponse], error) {
	a := actor(ctx)
	path, err := iam.CleanPath(req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if err := see(a, path); err != nil {
		return nil, err
	}
	if err := v.poolsOf(ctx, path); err != nil {
		return nil, err
	}
	opts := store.DeleteProjectOptions{ObjectsToParent: req.Msg.GetObjectsToParent()}
	if err := v.st.DeleteProject(ctx, a, path, opts); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.DeleteProjectResponse{}), nil
}

// poolsOf refuses the deletion of a project that warm pools serve: their
// sandboxes carry its path, and they are removed, not handed on.
func (v *iamService) poolsOf(ctx context.Context, path string) error {
	if v.pools == nil {
		return nil
	}
	pools, err := v.pools(ctx)
	if err != nil {
		return fmt.Errorf("delete project %s: list its warm pools: %w", iam.Display(path), err)
	}
	var envs []string
	for _, p := range pools {
		inUse := p.GetSize() > 0 || p.GetReady() > 0 || p.GetStarting() > 0
		env := p.GetSpec().GetEnvironment()
		if inUse && projectOf(&dsecv1.Sandbox{Spec: p.GetSpec()}) == path && !slices.Contains(envs, env) {
			envs = append(envs, env)
		}
	}
	if len(envs) == 0 {
		return nil
	}
	what := "a warm pool"
	if len(envs) > 1 {
		what = fmt.Sprintf("%d warm pools", len(envs))
	}
	return fmt.Errorf("delete project %s: the project is in use: %s of %s: set their size to 0 first: %w",
		iam.Display(path), what, strings.Join(envs, ", "), errdefs.ErrFailedPrecondition)
}

func (v *iamService) GetQuota(ctx context.Context, req *connect.Request[dsecv1.GetQuotaRequest]) (*connect.Response[dsecv1.GetQuotaResponse], error) {
	a := actor(ctx)
	path, err := projectOr(a, req.Msg.Project)
	if err != nil {
		return nil, err
	}
	if err := allow(a, iam.OpGetQuota, path); err != nil {
		return nil, err
	}
	qs, err := v.st.Quota(ctx, path)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.GetQuotaResponse{}
	for _, q := range qs {
		pq := &dsecv1.ProjectQuota{Project: q.Project}
		for _, r := range store.Resources {
			lim, ok := q.Limits[r]
			if !ok {
				lim = store.Unlimited
			}
			pq.Items = append(pq.Items, &dsecv1.QuotaItem{Resource: string(r), Limit: lim, Used: q.Used[r]})
		}
		out.Projects = append(out.Projects, pq)
	}
	return connect.NewResponse(out), nil
}

func (v *iamService) SetQuota(ctx context.Context, req *connect.Request[dsecv1.SetQuotaRequest]) (*connect.Response[dsecv1.SetQuotaResponse], error) {
	a := actor(ctx)
	path, err := iam.CleanPath(req.Msg.GetProject())
	if err != nil {
		return nil, err
	}
	r, err := store.ParseResource(req.Msg.GetResource())
	if err != nil {
		return nil, err
	}
	if lim := req.Msg.GetLimit(); lim < store.Unlimited {
		return nil, fmt.Errorf("limit %d: want 0 or more, or -1 for none of its own: %w", lim, errdefs.ErrInvalidArgument)
	}
	if err := see(a, path); err != nil {
		return nil, err
	}
	if err := v.st.SetLimit(ctx, a, path, r, req.Msg.GetLimit()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.SetQuotaResponse{}), nil
}

func (v *iamService) CreatePrincipal(ctx context.Context, req *connect.Request[dsecv1.CreatePrincipalRequest]) (*connect.Response[dsecv1.Principal], error) {
	a := actor(ctx)
	// Without a project, the token's, as every IAM call takes it: a
	// harness on ml makes its agents at home there, not in the root.
	path := a.Project
	if a.Node || req.Msg.GetProject() != "" {
		var err error
		if path, err = iam.CleanPath(req.Msg.GetProject()); err != nil {
			return nil, err
		}
	}
	if err := see(a, path); err != nil {
		return nil, err
	}
	p, err := v.st.CreatePrincipal(ctx, a, store.PrincipalSpec{Name: req.Msg.GetName(), Kind: req.Msg.GetKind(), Project: path})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(principalMsg(p)), nil
}

func (v *iamService) ListPrincipals(ctx context.Context, req *connect.Request[dsecv1.ListPrincipalsRequest]) (*connect.Response[dsecv1.ListPrincipalsResponse], error) {
	a := actor(ctx)
	under, err := projectOr(a, req.Msg.Project)
	if err != nil {
		return nil, err
	}
	if err := allow(a, iam.OpListPrincipals, under); err != nil {
		return nil, err
	}
	ps, err := v.st.ListPrincipals(ctx)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListPrincipalsResponse{}
	for _, p := range ps {
		if iam.Within(p.Project, under) && a.On(p.Project) >= iam.Admin {
			out.Principals = append(out.Principals, principalMsg(p))
		}
	}
	return connect.NewResponse(out), nil
}

// principal reads the principal called name for a, as if it did not exist
// when a holds no role on its home project: the root's too (see lets every
// token name the root, which exists in every cluster; its principals, the
// root's admins among them, are not everyone's to learn of).
func (v *iamService) principal(ctx context.Context, a iam.Authority, name string) (store.Principal, error) {
	p, err := v.st.Principal(ctx, name)
	if err != nil {
		return store.Principal{}, err
	}
	if name != a.Principal && a.On(p.Project) == iam.None {
		return store.Principal{}, fmt.Errorf("principal %q does not exist: %w", name, errdefs.ErrNotFound)
	}
	return p, nil
}

// callerOr is name, or the caller's own principal when name is "".
func callerOr(a iam.Authority, name string) (string, error) {
	if name != "" {
		return name, nil
	}
	if a.Node {
		return "", fmt.Errorf("the node's administrator is no principal: name one: %w", errdefs.ErrInvalidArgument)
	}
	return a.Principal, nil
}

func (v *iamService) DeletePrincipal(ctx context.Context, req *connect.Request[dsecv1.DeletePrincipalRequest]) (*connect.Response[dsecv1.DeletePrincipalResponse], error) {
	a := actor(ctx)
	p, err := v.principal(ctx, a, req.Msg.GetName())
	if err != nil {
		return nil, err
	}
	if err := v.st.DeletePrincipal(ctx, a, req.Msg.GetName()); err != nil {
		return nil, err
	}
	noteAuditProject(ctx, p.Project)
	return connect.NewResponse(&dsecv1.DeletePrincipalResponse{}), nil
}

func (v *iamService) Grant(ctx context.Context, req *connect.Request[dsecv1.GrantRequest]) (*connect.Response[dsecv1.GrantResponse], error) {
	a := actor(ctx)
	path, err := iam.CleanPath(req.Msg.GetProject())
	if err != nil {
		return nil, err
	}
	role, err := iam.ParseRole(req.Msg.GetRole())
	if err != nil {
		return nil, err
	}
	if err := see(a, path); err != nil {
		return nil, err
	}
	if err := v.st.Grant(ctx, a, req.Msg.GetPrincipal(), path, role); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.GrantResponse{}), nil
}

func (v *iamService) Ungrant(ctx context.Context, req *connect.Request[dsecv1.UngrantRequest]) (*connect.Response[dsecv1.UngrantResponse], error) {
	a := actor(ctx)
	path, err := iam.CleanPath(req.Msg.GetProject())
	if err != nil {
		return nil, err
	}
	if err := see(a, path); err != nil {
		return nil, err
	}
	if err := v.st.Ungrant(ctx, a, req.Msg.GetPrincipal(), path); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.UngrantResponse{}), nil
}

// managed is the principal whose bindings or tokens a reads through op:
// name, or a's own when name is "". a may read its own, or any principal
// whose home project it administers.
func (v *iamService) managed(ctx context.Context, a iam.Authority, op iam.Op, name string) (string, error) {
	name, err := callerOr(a, name)
	if err != nil {
		return "", err
	}
	p, err := v.principal(ctx, a, name)
	if err != nil {
		return "", err
	}
	if p.Name == a.Principal && !a.Node {
		return name, nil
	}
	if err := allow(a, op, p.Project); err != nil {
		return "", err
	}
	return name, nil
}

func (v *iamService) ListBindings(ctx context.Context, req *connect.Request[dsecv1.ListBindingsRequest]) (*connect.Response[dsecv1.ListBindingsResponse], error) {
	name, err := v.managed(ctx, actor(ctx), iam.OpListBindings, req.Msg.GetPrincipal())
	if err != nil {
		return nil, err
	}
	bs, err := v.st.Bindings(ctx, name)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListBindingsResponse{}
	for _, b := range bs {
		out.Bindings = append(out.Bindings, &dsecv1.RoleBinding{Principal: name, Project: b.Project, Role: b.Role.String()})
	}
	return connect.NewResponse(out), nil
}

func (v *iamService) CreateToken(ctx context.Context, req *connect.Request[dsecv1.CreateTokenRequest]) (*connect.Response[dsecv1.CreateTokenResponse], error) {
	a := actor(ctx)
	m := req.Msg
	name, err := callerOr(a, m.GetPrincipal())
	if err != nil {
		return nil, err
	}
	path := a.Project
	if a.Node || m.GetProject() != "" {
		if path, err = iam.CleanPath(m.GetProject()); err != nil {
			return nil, err
		}
	}
	role := a.Role
	if m.GetRole() != "" {
		if role, err = iam.ParseRole(m.GetRole()); err != nil {
			return nil, err
		}
	}
	if m.GetTtlSeconds() < 0 {
		return nil, fmt.Errorf("ttl %d s: want 0 (no expiry) or more: %w", m.GetTtlSeconds(), errdefs.ErrInvalidArgument)
	}
	if err := see(a, path); err != nil {
		return nil, err
	}
	if _, err := v.principal(ctx, a, name); err != nil {
		return nil, err
	}
	tok, info, err := v.st.MintToken(ctx, a, store.TokenSpec{Principal: name, Project: path, Role: role,
		TTL: time.Duration(m.GetTtlSeconds()) * time.Second})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.CreateTokenResponse{Token: tok, Info: tokenMsg(info)}), nil
}

func (v *iamService) RevokeToken(ctx context.Context, req *connect.Request[dsecv1.RevokeTokenRequest]) (*connect.Response[dsecv1.RevokeTokenResponse], error) {
	n, project, err := v.st.RevokeToken(ctx, actor(ctx), req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	noteAuditProject(ctx, project)
	return connect.NewResponse(&dsecv1.RevokeTokenResponse{Revoked: int32(n)}), nil
}

func (v *iamService) ListTokens(ctx context.Context, req *connect.Request[dsecv1.ListTokensRequest]) (*connect.Response[dsecv1.ListTokensResponse], error) {
	name, err := v.managed(ctx, actor(ctx), iam.OpListTokens, req.Msg.GetPrincipal())
	if err != nil {
		return nil, err
	}
	ts, err := v.st.ListTokens(ctx, name)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListTokensResponse{}
	for _, t := range ts {
		out.Tokens = append(out.Tokens, tokenMsg(t))
	}
	return connect.NewResponse(out), nil
}

// auditQuery reads a QueryAuditRequest as a store query a may run.
func auditQuery(a iam.Authority, op iam.Op, m *dsecv1.QueryAuditRequest) (store.AuditQuery, error) {
	path, err := projectOr(a, m.Project)
	if err != nil {
		return store.AuditQuery{}, err
	}
	if err := allow(a, op, path); err != nil {
		return store.AuditQuery{}, err
	}
	if m.GetLimit() < 0 {
		return store.AuditQuery{}, fmt.Errorf("limit %d: want 0 (the default) or more: %w", m.GetLimit(), errdefs.ErrInvalidArgument)
	}
	return store.AuditQuery{Project: path, Since: timeOf(m.GetSinceUnixMs()), Until: timeOf(m.GetUntilUnixMs()),
		Principal: m.GetPrincipal(), Limit: int(m.GetLimit())}, nil
}

func (v *iamService) QueryAudit(ctx context.Context, req *connect.Request[dsecv1.QueryAuditRequest]) (*connect.Response[dsecv1.QueryAuditResponse], error) {
	q, err := auditQuery(actor(ctx), iam.OpQueryAudit, req.Msg)
	if err != nil {
		return nil, err
	}
	recs, err := v.st.QueryAudit(ctx, q)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.QueryAuditResponse{}
	for _, r := range recs {
		out.Records = append(out.Records, auditMsg(r))
	}
	return connect.NewResponse(out), nil
}

// auditPage is how many records ExportAudit reads and sends at a time.
const auditPage = 1000

// ExportAudit sends every record the query selects (up to its limit, when
// it has one), a page at a time, each page one chunk of JSON lines. A page
// starts at the time of the last record sent, skipping those it sent.
func (v *iamService) ExportAudit(ctx context.Context, req *connect.Request[dsecv1.QueryAuditRequest], stream *connect.ServerStream[dsecv1.AuditChunk]) error {
	q, err := auditQuery(actor(ctx), iam.OpExportAudit, req.Msg)
	if err != nil {
		return err
	}
	left := q.Limit // 0: all
	var last store.AuditRecord
	for sent := false; ; sent = true {
		q.Limit = auditPage
		recs, err := v.st.QueryAudit(ctx, q)
		if err != nil {
			return err
		}
		page := recs[:0]
		for _, r := range recs {
			if !sent || r.At.After(last.At) || r.ID > last.ID {
				page = append(page, r)
			}
		}
		if left > 0 && len(page) > left {
			page = page[:left]
		}
		if len(page) == 0 {
			if len(recs) == auditPage {
				return fmt.Errorf("export audit: more than %d records at %s: %w", auditPage, last.At.UTC().Format(time.RFC3339Nano), errdefs.ErrResourceExhausted)
			}
			return nil
		}
		var buf bytes.Buffer
		if err := store.WriteAuditJSON(&buf, page); err != nil {
			return err
		}
		if err := stream.Send(&dsecv1.AuditChunk{Data: buf.Bytes()}); err != nil {
			return err
		}
		last = page[len(page)-1]
		if left > 0 {
			if left -= len(page); left == 0 {
				return nil
			}
		}
		if len(recs) < auditPage {
			return nil
		}
		q.Since = last.At
	}
}

// DefaultAuditRetention is how long audit records are kept by default.
const DefaultAuditRetention = 30 * 24 * time.Hour

// auditExpiryEvery is how often RunAuditExpiry expires records.
const auditExpiryEvery = time.Hour

// RunAuditExpiry forgets the audit records older than the configured
// retention, about once an hour at random times, until ctx ends (at once
// when there is no IAM store or records are kept forever). Every apiserver
// runs it; no lock is needed: a delete of the records older than a time is
// idempotent, so two apiservers expiring at once cost a second scan and
// nothing else, and with random times they seldom do.
func (s *Server) RunAuditExpiry(ctx context.Context) {
	retention := s.cfg.AuditRetention
	if retention == 0 {
		retention = DefaultAuditRetention
	}
	if s.cfg.IAM == nil || retention < 0 {
		return
	}
	expireEvery(ctx, "audit records", retention, auditExpiryEvery, s.log, s.cfg.IAM.ExpireAudit)
}

// expireEvery deletes what expire finds older than retention, about
// every every (at random times, so apiservers seldom expire at once),
// until ctx ends, logging what it expired as what (the audit records, the
// events, the ledger's rows).
func expireEvery(ctx context.Context, what string, retention, every time.Duration, log *slog.Logger,
	expire func(ctx context.Context, olderThan time.Time) (int, error)) {
	t := time.NewTimer(rand.N(every/4) + 1)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if n, err := expire(ctx, time.Now().Add(-retention)); err != nil {
			log.Warn("expire "+what, "err", err)
		} else if n > 0 {
			log.Info("expired "+what, "count", n, "retention", retention)
		}
		t.Reset(every/2 + rand.N(every))
	}
}
