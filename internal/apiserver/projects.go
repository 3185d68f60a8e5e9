package apiserver

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// ProjectLabel is the label holding the path of the project a sandbox
// belongs to; a sandbox without it belongs to the root project. A create
// may name a project with it (one the token may create sandboxes in);
// without it the sandbox goes to the token's project. The edge keeps it
// with the sandbox's spec, through restarts, and a fork's children inherit
// it with the source's spec.
const ProjectLabel = iam.ProjectLabel

// projectOf is the project a sandbox belongs to.
func projectOf(sb *dsecv1.Sandbox) string { return sb.GetSpec().GetLabels()[ProjectLabel] }

type opKey struct{}

// withOp is ctx carrying the operation the interceptor authorised.
func withOp(ctx context.Context, op iam.Op) context.Context {
	return context.WithValue(ctx, opKey{}, op)
}

// hidden is what a caller who may not see sandbox id, of project, is told:
// what an edge says of a sandbox it never made, so existence does not
// leak. The error also carries the project for the audit trail, which
// records the attempt whatever the call (a read, an exec) under that
// project, where its admins see who reached for their sandbox, and not
// under the caller's, whose admins would learn that the ID exists.
func hidden(id, project string) error {
	return &hiddenError{err: fmt.Errorf("no sandbox %s: %w", id, errdefs.ErrNotFound), id: id, project: project}
}

type hiddenError struct {
	err         error
	id, project string
}

func (h *hiddenError) Error() string { return h.err.Error() }
func (h *hiddenError) Unwrap() error { return h.err }

// hiddenFrom is, if err hid a sandbox from its caller au, the sandbox and
// au as the audit trail records the attempt: in the sandbox's project.
func hiddenFrom(au iam.Authority, err error) (iam.Authority, string, bool) {
	var h *hiddenError
	if !errors.As(err, &h) {
		return au, "", false
	}
	au.Project = h.project
	return au, h.id, true
}

// callerRole is the role the call's authority needs for its operation, and
// the authority; ok is false when every project is open to it (the node's
// administrator, a call without the interceptor, or a token whose role on
// the root suffices), so no sandbox's project need be looked up.
func callerRole(ctx context.Context) (a iam.Authority, need iam.Role, ok bool) {
	a, found := iam.AuthorityFrom(ctx)
	if !found || a.Node {
		return a, iam.None, false
	}
	op, _ := ctx.Value(opKey{}).(iam.Op)
	need, _ = iam.Need(op)
	if need == iam.None {
		need = iam.Admin // an operation the table lacks is the most guarded
	}
	if a.On("") >= need {
		return a, need, false
	}
	return a, need, true
}

// admit decides whether the caller may do its call's operation on a
// sandbox of project: NotFound when it may not see the project at all,
// PermissionDenied when it sees it but its role there is too low.
func admit(a iam.Authority, need iam.Role, id, project string) error {
	have := a.On(project)
	if have < iam.Viewer {
		return hidden(id, project)
	}
	if have < need {
		return fmt.Errorf("sandbox %s of project %s: the call needs %s there, token %s of %s holds %s: %w",
			id, iam.Display(project), need, a.TokenID, a.Principal, have, errdefs.ErrPermissionDenied)
	}
	return nil
}

// sandboxProjects remembers the project of sandboxes looked up, so a call
// on a sandbox by a token without a root-wide role costs one Get the first
// time on this apiserver only (a sandbox never changes project).
type sandboxProjects struct {
	mu sync.Mutex
	m  map[string]string
}

const maxSandboxProjects = 1 << 18

func (p *sandboxProjects) get(id string) (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pr, ok := p.m[id]
	return pr, ok
}

func (p *sandboxProjects) put(id, project string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil || len(p.m) >= maxSandboxProjects {
		p.m = map[string]string{}
	}
	p.m[id] = project
}

// sandboxEdge routes a sandbox ID to its node's edge, once the caller may
// do its call's operation on the sandbox.
func (s *Server) sandboxEdge(ctx context.Context, id string) (Edge, error) {
	e, err := s.edgeFor(id)
	if err != nil {
		return nil, err
	}
	a, need, check := callerRole(ctx)
	if !check {
		return e, nil
	}
	project, ok := s.projects.get(id)
	if !ok {
		resp, err := e.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
		if err != nil {
			return nil, err
		}
		project = projectOf(resp.Msg)
		s.projects.put(id, project)
	}
	if err := admit(a, need, id, project); err != nil {
		return nil, err
	}
	return e, nil
}

// visible filters sandboxes to those the caller may see.
func visible(ctx context.Context, sbs []*dsecv1.Sandbox) []*dsecv1.Sandbox {
	a, _, check := callerRole(ctx)
	if !check {
		return sbs
	}
	out := sbs[:0]
	for _, sb := range sbs {
		if a.On(projectOf(sb)) >= iam.Viewer {
			out = append(out, sb)
		}
	}
	return out
}

// placeInProject sets the project of the sandboxes a create makes: the
// one its spec's ProjectLabel names, else the caller's token's; the caller
// must hold the role the call needs there. The root's sandboxes carry no
// label, so what the node's administrator and root tokens make is as
// before.
func placeInProject(ctx context.Context, spec *dsecv1.SandboxSpec) error {
	a, found := iam.AuthorityFrom(ctx)
	if !found {
		return nil
	}
	project := a.Project
	if named, ok := spec.GetLabels()[ProjectLabel]; ok {
		p, err := iam.CleanPath(named)
		if err != nil {
			return fmt.Errorf("label %s: %w", ProjectLabel, err)
		}
		project = p
	}
	op, _ := ctx.Value(opKey{}).(iam.Op)
	if op == "" {
		op = "/dsec.v1.SandboxService/Create"
	}
	if err := iam.Allow(a, op, project); err != nil {
		if errors.Is(err, errdefs.ErrPermissionDenied) && a.On(project) < iam.Viewer {
			return fmt.Errorf("project %s: %w", iam.Display(project), errdefs.ErrNotFound)
		}
		return err
	}
	if project == "" {
		delete(spec.Labels, ProjectLabel)
		return nil
	}
	if spec.Labels == nil {
		spec.Labels = map[string]string{}
	}
	spec.Labels[ProjectLabel] = project
	return nil
}
