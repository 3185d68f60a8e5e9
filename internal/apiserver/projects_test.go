package apiserver

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// TestSandboxProjects: a sandbox belongs to the project it was made in (its
// token's, or one the create names), and a token of another project finds
// no such sandbox (NotFound, whatever the call: existence does not leak)
// and does not list it, and each attempt is audited under the sandbox's
// project; a viewer of its project sees it but may not run in
// it (PermissionDenied); a root token sees everything.
func TestSandboxProjects(t *testing.T) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for _, p := range []string{"a", "b", "a/sub"} {
		if _, err := st.CreateProject(ctx, iam.NodeAdmin(), p); err != nil {
			t.Fatal(err)
		}
	}
	mint := func(name, project string, role iam.Role) string {
		t.Helper()
		if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: name, Project: project}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, iam.NodeAdmin(), name, project, role); err != nil {
			t.Fatal(err)
		}
		tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: name, Project: project, Role: role})
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	runA, runB, viewA, root := mint("run-a", "a", iam.Runner), mint("run-b", "b", iam.Runner), mint("view-a", "a", iam.Viewer), mint("root", "", iam.Admin)
	audit := &recordingAuditor{}
	s := New(Config{Auth: st, Audit: audit}, st, watcher.NewFixed(nodesOf(newFakeEdge("n1"))...), slog.New(slog.DiscardHandler))
	actx, stopAudit := context.WithCancel(ctx)
	auditDone := make(chan struct{})
	go func() { defer close(auditDone); s.RunAudit(actx) }()
	defer func() { stopAudit(); <-auditDone }()
	hs := httptest.NewUnstartedServer(s.Handler())
	hs.Config.ConnContext = ConnContext
	hs.EnableHTTP2 = true
	hs.Start()
	defer hs.Close()
	client := func(tok string) dsecv1connect.SandboxServiceClient {
		return dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL, connect.WithInterceptors(bearerBoth(tok)))
	}
	create := func(tok string, labels map[string]string) (*dsecv1.Sandbox, error) {
		resp, err := client(tok).Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1", Labels: labels}}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetSandboxes()[0], nil
	}
	listed := func(tok string) []string {
		t.Helper()
		resp, err := client(tok).List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, sb := range resp.Msg.GetSandboxes() {
			ids = append(ids, sb.GetId())
		}
		return ids
	}

	sbA, err := create(runA, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := projectOf(sbA); got != "a" {
		t.Errorf("a runner of a made a sandbox of project %q", got)
	}
	sbSub, err := create(runA, map[string]string{ProjectLabel: "/a/sub"})
	if err != nil || projectOf(sbSub) != "a/sub" {
		t.Fatalf("create in a/sub by a runner of a: %v %v", err, sbSub)
	}
	sbRoot, err := create(root, nil)
	if err != nil || projectOf(sbRoot) != "" {
		t.Fatalf("create by a root token: %v %v", err, sbRoot)
	}
	if _, err := create(runA, map[string]string{ProjectLabel: "b"}); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a runner of a creating in b: %v, want not found", err)
	}
	if _, err := create(viewA, nil); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("a viewer creating: %v, want permission denied", err)
	}

	// Every call of b's runner on a's sandbox: NotFound, as for no sandbox.
	id := sbA.GetId()
	calls := map[string]func(tok string) error{
		"get": func(tok string) error {
			_, err := client(tok).Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
			return err
		},
		"delete": func(tok string) error {
			_, err := client(tok).Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
			return err
		},
		"pause": func(tok string) error {
			_, err := client(tok).Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: id}))
			return err
		},
		"read file": func(tok string) error {
			_, err := client(tok).ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: "/etc/hostname"}))
			return err
		},
		"exec": func(tok string) error {
			st, err := client(tok).Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: "true"}))
			if err != nil {
				return err
			}
			defer st.Close()
			for st.Receive() {
			}
			return st.Err()
		},
	}
	for name, call := range calls {
		if err := call(runB); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("%s of a's sandbox by b's runner: %v, want not found", name, err)
		}
	}
	// Each attempt is in the audit trail, reads and execs too, under a's
	// project (whose admins see who reached for their sandbox), not b's; a
	// sandbox that does not exist leaves no record of a read.
	if _, err := client(runB).Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: "sb-vm-nonesuch"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("get of no sandbox: %v, want not found", err)
	}
	stopAudit()
	<-auditDone
	audit.mu.Lock()
	tried := map[string]bool{}
	subCreate := false
	for _, rec := range audit.recs {
		if rec.Operation == "/dsec.v1.SandboxService/Create" && rec.Object == sbSub.GetId() {
			// Under the project it was made in, where a/sub's admins look.
			subCreate = rec.Project == "a/sub" && rec.Principal == "run-a"
		}
		if rec.Principal != "run-b" {
			continue
		}
		if rec.Object == "sb-vm-nonesuch" {
			t.Errorf("a get of no sandbox is audited: %+v", rec)
		}
		if rec.Object == id && rec.Code == "not_found" && rec.Project == "a" {
			tried[rec.Operation] = true
		}
	}
	audit.mu.Unlock()
	if !subCreate {
		t.Errorf("the create of %s in a/sub is not in the audit trail under a/sub", sbSub.GetId())
	}
	for _, op := range []string{"Get", "Delete", "Pause", "ReadFile", "Exec"} {
		if !tried["/dsec.v1.SandboxService/"+op] {
			t.Errorf("b's runner's %s of a's sandbox is not in the audit trail under project a (records %v)", op, tried)
		}
	}
	if err := calls["get"](viewA); err != nil {
		t.Errorf("get by a's viewer: %v", err)
	}
	for _, name := range []string{"pause", "exec", "delete"} {
		if err := calls[name](viewA); connect.CodeOf(err) != connect.CodePermissionDenied {
			t.Errorf("%s by a's viewer: %v, want permission denied", name, err)
		}
	}
	if err := calls["pause"](runA); connect.CodeOf(err) == connect.CodeNotFound || connect.CodeOf(err) == connect.CodePermissionDenied {
		t.Errorf("pause by a's runner: %v", err)
	}

	// Lists: each token its own subtree; the root token everything.
	for name, tc := range map[string]struct {
		tok  string
		want []string
	}{
		"a's runner": {runA, []string{sbA.GetId(), sbSub.GetId()}},
		"a's viewer": {viewA, []string{sbA.GetId(), sbSub.GetId()}},
		"b's runner": {runB, nil},
		"root":       {root, []string{sbA.GetId(), sbSub.GetId(), sbRoot.GetId()}},
	} {
		got := listed(tc.tok)
		slices.Sort(got)
		slices.Sort(tc.want)
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s lists %v, want %v", name, got, tc.want)
		}
	}
	if err := calls["delete"](runA); err != nil {
		t.Errorf("delete by a's runner: %v", err)
	}
}
