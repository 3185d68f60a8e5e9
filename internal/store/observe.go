package store

import (
	"context"
	"errors"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Observe returns s with every failed call reported to failed, named by
// its method (the op: a fixed set, so a bounded metric label), for the
// metadata store's error counter (docs/operations.md). A failure is an
// error that is not the store's verdict on the request: not found, already
// exists, invalid, a failed precondition, a quota exhausted, permission or
// authentication refused, and not the caller giving up (its context
// cancelled). Those are answers, not faults of the database.
//
// A method added to Store later passes through uncounted until it is
// listed here.
func Observe(s Store, failed func(op string)) Store {
	return observed{Store: s, failed: failed}
}

// Backend names the store a DSN opens, "sqlite" or "postgres", for the
// error counter's label; "" for a DSN Open refuses.
func Backend(dsn string) string {
	kind, _, err := parseDSN(dsn)
	if err != nil {
		return ""
	}
	return kind
}

type observed struct {
	Store
	failed func(op string)
}

// verdicts are the errors a store answers with about the request, not
// about itself.
var verdicts = []error{errdefs.ErrNotFound, errdefs.ErrAlreadyExists, errdefs.ErrInvalidArgument, errdefs.ErrFailedPrecondition,
	errdefs.ErrResourceExhausted, errdefs.ErrPermissionDenied, errdefs.ErrUnauthenticated, context.Canceled}

// Failed reports whether err, a store method's error, is a failure of the
// store (see Observe) rather than its answer.
func Failed(err error) bool {
	if err == nil {
		return false
	}
	for _, v := range verdicts {
		if errors.Is(err, v) {
			return false
		}
	}
	return true
}

func (x observed) done(op string, err error) {
	if Failed(err) {
		x.failed(op)
	}
}

func (x observed) GetIdempotency(ctx context.Context, key string) (Idempotency, error) {
	r0, err := x.Store.GetIdempotency(ctx, key)
	x.done("GetIdempotency", err)
	return r0, err
}

func (x observed) PutIdempotency(ctx context.Context, rec Idempotency) error {
	err := x.Store.PutIdempotency(ctx, rec)
	x.done("PutIdempotency", err)
	return err
}

func (x observed) ExpireIdempotency(ctx context.Context, olderThan time.Time) (int, error) {
	r0, err := x.Store.ExpireIdempotency(ctx, olderThan)
	x.done("ExpireIdempotency", err)
	return r0, err
}

func (x observed) ReserveCreate(ctx context.Context, r CreateReservation) (CreateReservation, bool, error) {
	r0, r1, err := x.Store.ReserveCreate(ctx, r)
	x.done("ReserveCreate", err)
	return r0, r1, err
}

func (x observed) CompleteCreate(ctx context.Context, key, nonce string, sbs []SandboxRow) error {
	err := x.Store.CompleteCreate(ctx, key, nonce, sbs)
	x.done("CompleteCreate", err)
	return err
}

func (x observed) ReleaseCreate(ctx context.Context, key string) error {
	err := x.Store.ReleaseCreate(ctx, key)
	x.done("ReleaseCreate", err)
	return err
}

func (x observed) Reservation(ctx context.Context, key string) (CreateReservation, error) {
	r0, err := x.Store.Reservation(ctx, key)
	x.done("Reservation", err)
	return r0, err
}

func (x observed) TouchCreate(ctx context.Context, key, nonce string) error {
	err := x.Store.TouchCreate(ctx, key, nonce)
	x.done("TouchCreate", err)
	return err
}

func (x observed) StaleCreates(ctx context.Context, before time.Time, limit int) ([]CreateReservation, error) {
	r0, err := x.Store.StaleCreates(ctx, before, limit)
	x.done("StaleCreates", err)
	return r0, err
}

func (x observed) AbandonCreate(ctx context.Context, key, nonce string, before time.Time, doubts []Doubt) (bool, error) {
	r0, err := x.Store.AbandonCreate(ctx, key, nonce, before, doubts)
	x.done("AbandonCreate", err)
	return r0, err
}

func (x observed) SandboxRows(ctx context.Context, key string) ([]SandboxRow, error) {
	r0, err := x.Store.SandboxRows(ctx, key)
	x.done("SandboxRows", err)
	return r0, err
}

func (x observed) NodeSandboxRows(ctx context.Context, node string) ([]SandboxRow, error) {
	r0, err := x.Store.NodeSandboxRows(ctx, node)
	x.done("NodeSandboxRows", err)
	return r0, err
}

func (x observed) DeleteSandboxRows(ctx context.Context, ids []string) error {
	err := x.Store.DeleteSandboxRows(ctx, ids)
	x.done("DeleteSandboxRows", err)
	return err
}

func (x observed) AddDoubts(ctx context.Context, doubts []Doubt) error {
	err := x.Store.AddDoubts(ctx, doubts)
	x.done("AddDoubts", err)
	return err
}

func (x observed) Doubts(ctx context.Context) ([]Doubt, error) {
	r0, err := x.Store.Doubts(ctx)
	x.done("Doubts", err)
	return r0, err
}

func (x observed) ClearDoubts(ctx context.Context, doubts []Doubt) error {
	err := x.Store.ClearDoubts(ctx, doubts)
	x.done("ClearDoubts", err)
	return err
}

func (x observed) RegisterNode(ctx context.Context, n Node, liveWindow time.Duration) (Node, error) {
	r0, err := x.Store.RegisterNode(ctx, n, liveWindow)
	x.done("RegisterNode", err)
	return r0, err
}

func (x observed) Heartbeat(ctx context.Context, name string, generation int64, at time.Time) error {
	err := x.Store.Heartbeat(ctx, name, generation, at)
	x.done("Heartbeat", err)
	return err
}

func (x observed) Nodes(ctx context.Context) ([]Node, error) {
	r0, err := x.Store.Nodes(ctx)
	x.done("Nodes", err)
	return r0, err
}

func (x observed) NodeBySlot(ctx context.Context, slot int) (Node, error) {
	r0, err := x.Store.NodeBySlot(ctx, slot)
	x.done("NodeBySlot", err)
	return r0, err
}

func (x observed) RemoveNode(ctx context.Context, name string) error {
	err := x.Store.RemoveNode(ctx, name)
	x.done("RemoveNode", err)
	return err
}

func (x observed) CreateProject(ctx context.Context, actor iam.Authority, path string) (Project, error) {
	r0, err := x.Store.CreateProject(ctx, actor, path)
	x.done("CreateProject", err)
	return r0, err
}

func (x observed) Project(ctx context.Context, path string) (Project, error) {
	r0, err := x.Store.Project(ctx, path)
	x.done("Project", err)
	return r0, err
}

func (x observed) ProjectByID(ctx context.Context, id string) (Project, error) {
	r0, err := x.Store.ProjectByID(ctx, id)
	x.done("ProjectByID", err)
	return r0, err
}

func (x observed) ListProjects(ctx context.Context, path string, subtree bool) ([]Project, error) {
	r0, err := x.Store.ListProjects(ctx, path, subtree)
	x.done("ListProjects", err)
	return r0, err
}

func (x observed) DeleteProject(ctx context.Context, actor iam.Authority, path string, opts DeleteProjectOptions) error {
	err := x.Store.DeleteProject(ctx, actor, path, opts)
	x.done("DeleteProject", err)
	return err
}

func (x observed) CreatePrincipal(ctx context.Context, actor iam.Authority, spec PrincipalSpec) (Principal, error) {
	r0, err := x.Store.CreatePrincipal(ctx, actor, spec)
	x.done("CreatePrincipal", err)
	return r0, err
}

func (x observed) DeletePrincipal(ctx context.Context, actor iam.Authority, name string) error {
	err := x.Store.DeletePrincipal(ctx, actor, name)
	x.done("DeletePrincipal", err)
	return err
}

func (x observed) Principal(ctx context.Context, name string) (Principal, error) {
	r0, err := x.Store.Principal(ctx, name)
	x.done("Principal", err)
	return r0, err
}

func (x observed) ListPrincipals(ctx context.Context) ([]Principal, error) {
	r0, err := x.Store.ListPrincipals(ctx)
	x.done("ListPrincipals", err)
	return r0, err
}

func (x observed) Grant(ctx context.Context, actor iam.Authority, principal, project string, role iam.Role) error {
	err := x.Store.Grant(ctx, actor, principal, project, role)
	x.done("Grant", err)
	return err
}

func (x observed) Ungrant(ctx context.Context, actor iam.Authority, principal, project string) error {
	err := x.Store.Ungrant(ctx, actor, principal, project)
	x.done("Ungrant", err)
	return err
}

func (x observed) Bindings(ctx context.Context, principal string) ([]iam.Binding, error) {
	r0, err := x.Store.Bindings(ctx, principal)
	x.done("Bindings", err)
	return r0, err
}

func (x observed) MintToken(ctx context.Context, actor iam.Authority, spec TokenSpec) (string, TokenInfo, error) {
	r0, r1, err := x.Store.MintToken(ctx, actor, spec)
	x.done("MintToken", err)
	return r0, r1, err
}

func (x observed) Authenticate(ctx context.Context, token string) (iam.Authority, error) {
	r0, err := x.Store.Authenticate(ctx, token)
	x.done("Authenticate", err)
	return r0, err
}

func (x observed) RevokeToken(ctx context.Context, actor iam.Authority, tokenID string) (int, string, error) {
	r0, r1, err := x.Store.RevokeToken(ctx, actor, tokenID)
	x.done("RevokeToken", err)
	return r0, r1, err
}

func (x observed) ListTokens(ctx context.Context, principal string) ([]TokenInfo, error) {
	r0, err := x.Store.ListTokens(ctx, principal)
	x.done("ListTokens", err)
	return r0, err
}

func (x observed) Generation(ctx context.Context) (int64, error) {
	r0, err := x.Store.Generation(ctx)
	x.done("Generation", err)
	return r0, err
}

func (x observed) SetLimit(ctx context.Context, actor iam.Authority, project string, resource Resource, limit int64) error {
	err := x.Store.SetLimit(ctx, actor, project, resource, limit)
	x.done("SetLimit", err)
	return err
}

func (x observed) Quota(ctx context.Context, project string) ([]ProjectQuota, error) {
	r0, err := x.Store.Quota(ctx, project)
	x.done("Quota", err)
	return r0, err
}

func (x observed) Charge(ctx context.Context, project string, amounts Amounts) error {
	err := x.Store.Charge(ctx, project, amounts)
	x.done("Charge", err)
	return err
}

func (x observed) Release(ctx context.Context, project string, amounts Amounts) error {
	err := x.Store.Release(ctx, project, amounts)
	x.done("Release", err)
	return err
}

func (x observed) SetUse(ctx context.Context, project string, resource Resource, n int64) error {
	err := x.Store.SetUse(ctx, project, resource, n)
	x.done("SetUse", err)
	return err
}

func (x observed) ChargeHeld(ctx context.Context, project string, amounts Amounts, holds []Hold) error {
	err := x.Store.ChargeHeld(ctx, project, amounts, holds)
	x.done("ChargeHeld", err)
	return err
}

func (x observed) ReserveCharged(ctx context.Context, project string, amounts Amounts, holds []Hold, rs []CreateReservation) ([]CreateReservation, []bool, error) {
	r0, r1, err := x.Store.ReserveCharged(ctx, project, amounts, holds, rs)
	x.done("ReserveCharged", err)
	return r0, r1, err
}

func (x observed) Settle(ctx context.Context, ids []string, release bool) error {
	err := x.Store.Settle(ctx, ids, release)
	x.done("Settle", err)
	return err
}

func (x observed) ReleaseSandbox(ctx context.Context, project, id string, amounts Amounts) (bool, error) {
	r0, err := x.Store.ReleaseSandbox(ctx, project, id, amounts)
	x.done("ReleaseSandbox", err)
	return r0, err
}

func (x observed) HoldRelease(ctx context.Context, project, sandbox string, amounts Amounts, expires time.Time) error {
	err := x.Store.HoldRelease(ctx, project, sandbox, amounts, expires)
	x.done("HoldRelease", err)
	return err
}

func (x observed) Uses(ctx context.Context, resources []Resource) ([]Use, error) {
	r0, err := x.Store.Uses(ctx, resources)
	x.done("Uses", err)
	return r0, err
}

func (x observed) CorrectUse(ctx context.Context, read Use, n int64) (bool, error) {
	r0, err := x.Store.CorrectUse(ctx, read, n)
	x.done("CorrectUse", err)
	return r0, err
}

func (x observed) ExpireHolds(ctx context.Context, now time.Time) (int, error) {
	r0, err := x.Store.ExpireHolds(ctx, now)
	x.done("ExpireHolds", err)
	return r0, err
}

func (x observed) AppendAudit(ctx context.Context, recs ...AuditRecord) error {
	err := x.Store.AppendAudit(ctx, recs...)
	x.done("AppendAudit", err)
	return err
}

func (x observed) QueryAudit(ctx context.Context, q AuditQuery) ([]AuditRecord, error) {
	r0, err := x.Store.QueryAudit(ctx, q)
	x.done("QueryAudit", err)
	return r0, err
}

func (x observed) ExpireAudit(ctx context.Context, olderThan time.Time) (int, error) {
	r0, err := x.Store.ExpireAudit(ctx, olderThan)
	x.done("ExpireAudit", err)
	return r0, err
}

func (x observed) ClaimObject(ctx context.Context, o Object) (Object, bool, error) {
	r0, r1, err := x.Store.ClaimObject(ctx, o)
	x.done("ClaimObject", err)
	return r0, r1, err
}

func (x observed) TakeObject(ctx context.Context, name, writer string, until time.Time) (Object, error) {
	r0, err := x.Store.TakeObject(ctx, name, writer, until)
	x.done("TakeObject", err)
	return r0, err
}

func (x observed) SetObjectBlobs(ctx context.Context, name, writer string, blobs []Blob) (int64, error) {
	r0, err := x.Store.SetObjectBlobs(ctx, name, writer, blobs)
	x.done("SetObjectBlobs", err)
	return r0, err
}

func (x observed) ReleaseObject(ctx context.Context, name, writer string, forget bool) error {
	err := x.Store.ReleaseObject(ctx, name, writer, forget)
	x.done("ReleaseObject", err)
	return err
}

func (x observed) Object(ctx context.Context, name string) (Object, error) {
	r0, err := x.Store.Object(ctx, name)
	x.done("Object", err)
	return r0, err
}

func (x observed) ListObjects(ctx context.Context) ([]Object, error) {
	r0, err := x.Store.ListObjects(ctx)
	x.done("ListObjects", err)
	return r0, err
}

func (x observed) DeleteObject(ctx context.Context, name string) (Object, int64, error) {
	r0, r1, err := x.Store.DeleteObject(ctx, name)
	x.done("DeleteObject", err)
	return r0, r1, err
}

func (x observed) ShareObject(ctx context.Context, name, project string) error {
	err := x.Store.ShareObject(ctx, name, project)
	x.done("ShareObject", err)
	return err
}

func (x observed) UnshareObject(ctx context.Context, name, project string) error {
	err := x.Store.UnshareObject(ctx, name, project)
	x.done("UnshareObject", err)
	return err
}

func (x observed) LapsedObjects(ctx context.Context, before time.Time) ([]Object, error) {
	r0, err := x.Store.LapsedObjects(ctx, before)
	x.done("LapsedObjects", err)
	return r0, err
}

func (x observed) SweepObject(ctx context.Context, name string, before time.Time) (bool, error) {
	r0, err := x.Store.SweepObject(ctx, name, before)
	x.done("SweepObject", err)
	return r0, err
}

func (x observed) AppendEvents(ctx context.Context, evs ...Event) (int, error) {
	r0, err := x.Store.AppendEvents(ctx, evs...)
	x.done("AppendEvents", err)
	return r0, err
}

func (x observed) ListEvents(ctx context.Context, q EventQuery) ([]Event, error) {
	r0, err := x.Store.ListEvents(ctx, q)
	x.done("ListEvents", err)
	return r0, err
}

func (x observed) ExpireEvents(ctx context.Context, olderThan time.Time) (int, error) {
	r0, err := x.Store.ExpireEvents(ctx, olderThan)
	x.done("ExpireEvents", err)
	return r0, err
}

func (x observed) LastEventID(ctx context.Context) (int64, error) {
	r0, err := x.Store.LastEventID(ctx)
	x.done("LastEventID", err)
	return r0, err
}

func (x observed) AddWebhook(ctx context.Context, w Webhook) error {
	err := x.Store.AddWebhook(ctx, w)
	x.done("AddWebhook", err)
	return err
}

func (x observed) ListWebhooks(ctx context.Context, projects []string) ([]Webhook, error) {
	r0, err := x.Store.ListWebhooks(ctx, projects)
	x.done("ListWebhooks", err)
	return r0, err
}

func (x observed) RemoveWebhook(ctx context.Context, project, id string) error {
	err := x.Store.RemoveWebhook(ctx, project, id)
	x.done("RemoveWebhook", err)
	return err
}

func (x observed) ClaimWebhooks(ctx context.Context, owner string, now, until time.Time) ([]Webhook, error) {
	r0, err := x.Store.ClaimWebhooks(ctx, owner, now, until)
	x.done("ClaimWebhooks", err)
	return r0, err
}

func (x observed) AdvanceWebhook(ctx context.Context, id, owner string, delivered int64, at time.Time, failure error) error {
	err := x.Store.AdvanceWebhook(ctx, id, owner, delivered, at, failure)
	x.done("AdvanceWebhook", err)
	return err
}

func (x observed) ForgetDoubts(ctx context.Context, keep []string, before time.Time) (int, error) {
	r0, err := x.Store.ForgetDoubts(ctx, keep, before)
	x.done("ForgetDoubts", err)
	return r0, err
}

func (x observed) UpdateWebhook(ctx context.Context, project, id string, u WebhookUpdate) (Webhook, error) {
	r0, err := x.Store.UpdateWebhook(ctx, project, id, u)
	x.done("UpdateWebhook", err)
	return r0, err
}

func (x observed) ReleaseWebhooks(ctx context.Context, owner string) error {
	err := x.Store.ReleaseWebhooks(ctx, owner)
	x.done("ReleaseWebhooks", err)
	return err
}

func (x observed) PutConsoleSession(ctx context.Context, s ConsoleSession) error {
	err := x.Store.PutConsoleSession(ctx, s)
	x.done("PutConsoleSession", err)
	return err
}

func (x observed) ConsoleSession(ctx context.Context, id string, now time.Time) (ConsoleSession, error) {
	r0, err := x.Store.ConsoleSession(ctx, id, now)
	x.done("ConsoleSession", err)
	return r0, err
}

func (x observed) DeleteConsoleSession(ctx context.Context, id string) error {
	err := x.Store.DeleteConsoleSession(ctx, id)
	x.done("DeleteConsoleSession", err)
	return err
}

func (x observed) ExpireConsoleSessions(ctx context.Context, now time.Time) (int, error) {
	r0, err := x.Store.ExpireConsoleSessions(ctx, now)
	x.done("ExpireConsoleSessions", err)
	return r0, err
}
