package apiserver

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// Auditor appends records to the audit trail: the metadata store is one.
type Auditor interface {
	AppendAudit(ctx context.Context, recs ...store.AuditRecord) error
}

// auditQueue is how many records wait for the writer; past it a record is
// dropped (and counted) rather than slow the call down.
const auditQueue = 4096

// auditLog queues audit records for RunAudit, which writes them to the
// store apart from the calls, so no call waits on the audit trail. What is
// queued and not yet written (at most auditQueue records, normally the last
// few milliseconds' worth) is lost if the apiserver dies.
type auditLog struct {
	w       Auditor
	q       chan store.AuditRecord
	log     *slog.Logger
	dropped atomic.Int64
	failed  atomic.Int64
}

func newAuditLog(w Auditor, log *slog.Logger) *auditLog {
	if w == nil {
		return nil
	}
	return &auditLog{w: w, q: make(chan store.AuditRecord, auditQueue), log: log}
}

// audited reports whether a call of the procedure is recorded when it
// succeeds: the calls that change what exists or who may do what (a
// create, a delete, a pause, a layer, a snapshot, a pool, a network rule,
// every IAM call but the reads). Reads and the data plane inside a sandbox (exec, files,
// shells) are not; a refused call of any procedure is.
func audited(procedure string) bool {
	if op, ok := strings.CutPrefix(procedure, "/dsec.v1.IAMService/"); ok {
		// Its reads are not recorded.
		return !strings.HasPrefix(op, "Get") && !strings.HasPrefix(op, "List") && !strings.HasSuffix(op, "Audit")
	}
	switch procedure {
	case "/dsec.v1.SandboxService/Create", "/dsec.v1.SandboxService/Delete", "/dsec.v1.SandboxService/Pause",
		"/dsec.v1.SandboxService/Resume", "/dsec.v1.SandboxService/SetTimeout", "/dsec.v1.SandboxService/EndPhase",
		"/dsec.v1.SandboxService/Snapshot", "/dsec.v1.SandboxService/DeleteSnapshot",
		"/dsec.v1.SandboxService/Fork", "/dsec.v1.SandboxService/SetNetworkRules",
		"/dsec.v1.SandboxService/SetWarmPool", "/dsec.v1.SandboxService/AddWebhook", "/dsec.v1.SandboxService/RemoveWebhook",
		"/dsec.v1.SandboxService/RotateWebhookSecret",
		"/dsec.v1.LayerService/ImportLayer", "/dsec.v1.LayerService/UploadLayer",
		"/dsec.v1.LayerService/RemoveLayer", "/dsec.v1.LayerService/ImportImage",
		"/dsec.v1.LayerService/ShareLayer":
		return true
	}
	return false
}

// objectOf names what a call touched: the sandbox, snapshot or layer its
// request names, or the sandboxes a create made.
func objectOf(req any, resp connect.AnyResponse, err error) string {
	if err == nil && resp != nil {
		switch r := resp.Any().(type) {
		case *dsecv1.CreateResponse:
			ids := make([]string, 0, len(r.GetSandboxes()))
			for _, sb := range r.GetSandboxes() {
				ids = append(ids, sb.GetId())
			}
			return strings.Join(ids, ",")
		case *dsecv1.CreateTokenResponse:
			return r.GetInfo().GetId()
		}
	}
	// The IAM calls name what they change: the project, the limit set, the
	// principal granted a role, the principal a token is minted for.
	switch m := req.(type) {
	case *dsecv1.CreateProjectRequest:
		return iam.Display(strings.Trim(m.GetPath(), "/"))
	case *dsecv1.DeleteProjectRequest:
		return iam.Display(strings.Trim(m.GetPath(), "/"))
	case *dsecv1.SetQuotaRequest:
		if m.GetLimit() < 0 {
			return m.GetResource() + "=none"
		}
		return fmt.Sprintf("%s=%d", m.GetResource(), m.GetLimit())
	case *dsecv1.GrantRequest:
		return m.GetPrincipal() + " " + m.GetRole()
	case *dsecv1.UngrantRequest:
		return m.GetPrincipal()
	case *dsecv1.CreateTokenRequest:
		return m.GetPrincipal()
	}
	switch m := req.(type) {
	case interface{ GetSandboxId() string }:
		return m.GetSandboxId()
	case interface{ GetId() string }:
		return m.GetId()
	case interface{ GetRef() string }:
		return m.GetRef()
	case interface{ GetName() string }:
		return m.GetName()
	}
	return ""
}

// requestPart is the part of a stream's first message that names its
// object: an upload's header, a shell's start; req itself for others.
func requestPart(req any) any {
	switch m := req.(type) {
	case *dsecv1.UploadLayerRequest:
		if h := m.GetHeader(); h != nil {
			return h
		}
	case *dsecv1.ShellInput:
		if st := m.GetStart(); st != nil {
			return st
		}
	}
	return req
}

// auditNote is what a handler learns of its call's object that the
// request does not say (the project of the token a revoke names, of the
// principal a delete names), for the call's audit record.
type auditNote struct {
	mu      sync.Mutex
	project string
	noted   bool
}

type auditNoteKey struct{}

func withAuditNote(ctx context.Context) (context.Context, *auditNote) {
	n := &auditNote{}
	return context.WithValue(ctx, auditNoteKey{}, n), n
}

// noteAuditProject says that the call of ctx acts on an object of project
// (a path): it is recorded under that project, so its admins see it, when
// the token reaches it (a root-wide token revoking a token of ml/b: under
// ml/b, not the root).
func noteAuditProject(ctx context.Context, project string) {
	n, ok := ctx.Value(auditNoteKey{}).(*auditNote)
	if !ok {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.project, n.noted = project, true
}

func (n *auditNote) get() (string, bool) {
	if n == nil {
		return "", false
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.project, n.noted
}

// auditProject is the project a call is recorded under: the one its
// request names for what it makes or changes (a sandbox's project label, a
// layer's or snapshot's project, the project an IAM call creates, grants
// on, sets a limit of or mints a token for), so that project's admins see
// it, when the caller's token reaches that project; else the token's own.
// A share names the project it shares with, not its object's, so it stays
// under the token's. A call on a sandbox (a delete, a pause, a snapshot) is
// recorded under the sandbox's project when this apiserver knows it (it
// looked it up to decide a token without a root-wide role).
func auditProject(au iam.Authority, req any, known *sandboxProjects) string {
	var named string
	switch m := req.(type) {
	case *dsecv1.SnapshotRequest:
		named = m.GetProject()
		if named == "" {
			named = knownProject(known, m.GetSandboxId())
		}
	case *dsecv1.CreateRequest:
		named = m.GetSpec().GetLabels()[ProjectLabel]
	case *dsecv1.CreateProjectRequest:
		named = m.GetPath()
	case *dsecv1.DeleteProjectRequest:
		named = m.GetPath()
	case *dsecv1.ShareLayerRequest:
	case interface{ GetProject() string }:
		named = m.GetProject()
	case interface{ GetSandboxId() string }:
		named = knownProject(known, m.GetSandboxId())
	case *dsecv1.DeleteRequest:
		named = knownProject(known, m.GetId())
	}
	if named == "" {
		return au.Project
	}
	p, err := iam.CleanPath(named)
	if err != nil || !iam.Within(p, au.Project) {
		return au.Project
	}
	return p
}

// knownProject is the path of sandbox id's project if known, "/" for the
// root's, "" when unknown.
func knownProject(known *sandboxProjects, id string) string {
	if known == nil || id == "" {
		return ""
	}
	p, ok := known.get(id)
	if !ok {
		return ""
	}
	return iam.Display(p)
}

// add queues a record of a call by au of op on object; err is its result.
func (l *auditLog) add(au iam.Authority, op, object, peer string, err error) {
	if l == nil {
		return
	}
	rec := store.AuditRecord{At: time.Now(), Principal: au.Principal, TokenID: au.TokenID, Project: au.Project,
		Operation: op, Object: object, Code: "ok", Peer: peer}
	if err != nil {
		rec.Code = connect.CodeOf(errdefs.ToConnect(err)).String()
		rec.Message = err.Error()
		if len(rec.Message) > 1000 {
			rec.Message = rec.Message[:1000]
		}
	}
	if len(rec.Object) > 1000 {
		rec.Object = rec.Object[:1000]
	}
	select {
	case l.q <- rec:
	default:
		l.dropped.Add(1)
	}
}

// RunAudit writes the queued audit records to the store until ctx ends,
// then writes what is still queued (for at most a few seconds). It takes
// what has queued up at once, up to auditWriteBatch records, and appends
// them in one call: under a burst of creates the trail costs a statement
// per batch, not per call. Without an Auditor it returns at once.
func (s *Server) RunAudit(ctx context.Context) {
	l := s.audit
	if l == nil {
		return
	}
	batch := make([]store.AuditRecord, 0, auditWriteBatch)
	write := func(ctx context.Context) {
		if err := l.w.AppendAudit(ctx, batch...); err != nil {
			if n := l.failed.Add(int64(len(batch))); n == int64(len(batch)) || n%1000 < int64(len(batch)) {
				l.log.Warn("audit records lost", "records", len(batch), "err", err, "lost", n)
			}
		}
		batch = batch[:0]
	}
	// drain adds what is queued, without waiting, to the batch.
	drain := func() {
		for len(batch) < auditWriteBatch {
			select {
			case rec := <-l.q:
				batch = append(batch, rec)
			default:
				return
			}
		}
	}
	for {
		select {
		case rec := <-l.q:
			batch = append(batch, rec)
			drain()
			write(ctx)
		case <-ctx.Done():
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 3*time.Second)
			defer cancel()
			for {
				drain()
				if len(batch) == 0 {
					return
				}
				write(fctx)
			}
		}
	}
}

// auditWriteBatch is the most records RunAudit appends in one call.
const auditWriteBatch = 256
