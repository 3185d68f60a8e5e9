package apiserver

import (
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/iam"
)

// TestAuditProjectAndObject: a management call is recorded under the
// project its request names, when the token reaches it, so that project's
// admins find it in dsec audit -p; and an IAM call names what it changed.
func TestAuditProjectAndObject(t *testing.T) {
	ml := iam.Authority{Principal: "harness", Project: "ml", Role: iam.Admin}
	root := iam.Authority{Principal: "admin", Role: iam.Admin}
	known := &sandboxProjects{}
	known.put("sb-b", "ml/b")
	known.put("sb-root", "")
	known.put("sb-other", "other")
	for _, tc := range []struct {
		name    string
		au      iam.Authority
		req     any
		resp    connect.AnyResponse
		project string
		object  string
	}{
		{"a create in a sub-project", ml, &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Labels: map[string]string{ProjectLabel: "/ml/b"}}},
			connect.NewResponse(&dsecv1.CreateResponse{Sandboxes: []*dsecv1.Sandbox{{Id: "sb-1"}}}), "ml/b", "sb-1"},
		{"a create in the token's project", ml, &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{}}, nil, "ml", ""},
		{"a create naming a project out of reach", ml, &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Labels: map[string]string{ProjectLabel: "other"}}}, nil, "ml", ""},
		{"a bad path", ml, &dsecv1.SetQuotaRequest{Project: "ml/B!", Resource: "sandboxes", Limit: 1}, nil, "ml", "sandboxes=1"},
		{"a project created", ml, &dsecv1.CreateProjectRequest{Path: "ml/rl-run-42"}, nil, "ml/rl-run-42", "ml/rl-run-42"},
		{"a project deleted by a root token", root, &dsecv1.DeleteProjectRequest{Path: "/ml/x"}, nil, "ml/x", "ml/x"},
		{"a limit set", ml, &dsecv1.SetQuotaRequest{Project: "ml/b", Resource: "memory_mb", Limit: 4096}, nil, "ml/b", "memory_mb=4096"},
		{"a limit removed", ml, &dsecv1.SetQuotaRequest{Project: "ml/b", Resource: "sandboxes", Limit: -1}, nil, "ml/b", "sandboxes=none"},
		{"a grant", ml, &dsecv1.GrantRequest{Principal: "alice", Project: "ml/b", Role: "viewer"}, nil, "ml/b", "alice viewer"},
		{"a binding removed", ml, &dsecv1.UngrantRequest{Principal: "alice", Project: "ml/b"}, nil, "ml/b", "alice"},
		{"a token minted", ml, &dsecv1.CreateTokenRequest{Project: "ml/b", Role: "runner"},
			connect.NewResponse(&dsecv1.CreateTokenResponse{Info: &dsecv1.TokenInfo{Id: "tok-1"}}), "ml/b", "tok-1"},
		{"a token refused", ml, &dsecv1.CreateTokenRequest{Principal: "bob", Project: "/"}, nil, "ml", "bob"},
		{"a principal made", ml, &dsecv1.CreatePrincipalRequest{Name: "bob", Project: "ml"}, nil, "ml", "bob"},
		{"a layer imported", ml, &dsecv1.ImportLayerRequest{Ref: "ws:1", Project: "ml/b"}, nil, "ml/b", "ws:1"},
		{"a share, which names its recipient", ml, &dsecv1.ShareLayerRequest{Ref: "ws:1", Project: "ml/c"}, nil, "ml", "ws:1"},
		{"a delete of a sandbox of a sub-project", ml, &dsecv1.DeleteRequest{Id: "sb-b"}, nil, "ml/b", "sb-b"},
		{"a pause of a sandbox of a sub-project", ml, &dsecv1.PauseRequest{SandboxId: "sb-b"}, nil, "ml/b", "sb-b"},
		{"a delete of a sandbox not looked up", ml, &dsecv1.DeleteRequest{Id: "sb-new"}, nil, "ml", "sb-new"},
		{"a delete of the root's sandbox by a root token", root, &dsecv1.DeleteRequest{Id: "sb-root"}, nil, "", "sb-root"},
		{"a sandbox out of reach", ml, &dsecv1.PauseRequest{SandboxId: "sb-other"}, nil, "ml", "sb-other"},
		{"a snapshot of a sandbox of a sub-project", ml, &dsecv1.SnapshotRequest{SandboxId: "sb-b", Name: "s"}, nil, "ml/b", "sb-b"},
		{"a snapshot naming its project", ml, &dsecv1.SnapshotRequest{SandboxId: "sb-b", Name: "s", Project: "ml/c"}, nil, "ml/c", "sb-b"},
		// Streams: their first message.
		{"an upload's header", ml, &dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Header{Header: &dsecv1.UploadLayerHeader{Ref: "up:1", Project: "ml/b"}}}, nil, "ml/b", "up:1"},
		{"a shell's start", ml, &dsecv1.ShellInput{Input: &dsecv1.ShellInput_Start{Start: &dsecv1.ShellStart{SandboxId: "sb-b"}}}, nil, "ml/b", "sb-b"},
		{"an exec", ml, &dsecv1.ExecRequest{SandboxId: "sb-b"}, nil, "ml/b", "sb-b"},
		{"a download", ml, &dsecv1.DownloadRequest{SandboxId: "sb-b"}, nil, "ml/b", "sb-b"},
		{"an image import", ml, &dsecv1.ImportImageRequest{Ref: "img:1", Project: "ml/b"}, nil, "ml/b", "img:1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := requestPart(tc.req)
			if got := auditProject(tc.au, req, known); got != tc.project {
				t.Errorf("project %q, want %q", got, tc.project)
			}
			if got := objectOf(req, tc.resp, nil); got != tc.object {
				t.Errorf("object %q, want %q", got, tc.object)
			}
		})
	}
}
