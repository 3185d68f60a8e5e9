package root

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	dsec "dsec.dev/dsec/sdk/go"
)

// TestSharedSnapshotProjects: a builder project builds a task layer with a
// reference answer and a snapshot of a sandbox graded on it, and shares
// the snapshot with a runner project; the runner project lists it and makes
// a real sandbox from it that reads the answer (the task layer comes with
// the snapshot, and is not usable alone); a third project
// sees none of it, cannot make a sandbox from it, and no project sees
// another's sandboxes.
func TestSharedSnapshotProjects(t *testing.T) {
	d := startDaemon(t)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	st, err := store.Open(ctx, d.DB())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	node := iam.NodeAdmin()
	people := []struct {
		name, project string
		role          iam.Role
	}{{"objs-builder", "objs-build", iam.Builder}, {"objs-runner", "objs-run", iam.Runner}, {"objs-outsider", "objs-other", iam.Runner}}
	clients := map[string]*dsec.Client{}
	for _, p := range people {
		if _, err := st.CreateProject(ctx, node, p.project); err != nil {
			t.Fatal(err)
		}
		if _, err := st.CreatePrincipal(ctx, node, store.PrincipalSpec{Name: p.name, Kind: store.KindService, Project: p.project}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, node, p.name, p.project, p.role); err != nil {
			t.Fatal(err)
		}
		tok, _, err := st.MintToken(ctx, node, store.TokenSpec{Principal: p.name, Project: p.project, Role: p.role})
		if err != nil {
			t.Fatal(err)
		}
		if clients[p.name], err = dsec.NewClient(d.Addr, dsec.WithToken(tok)); err != nil {
			t.Fatal(err)
		}
	}
	builder, runner, outsider := clients["objs-builder"], clients["objs-runner"], clients["objs-outsider"]

	// The builder's task layer, uploaded from here, with its reference
	// answer.
	tree := t.TempDir()
	if err := os.MkdirAll(filepath.Join(tree, "task"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tree, "task", "answer.txt"), []byte("42\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	layer, err := builder.ImportLayer(ctx, "objs-task:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, tree, &dsec.LayerOptions{Upload: true})
	if err != nil {
		t.Fatalf("the builder imports its layer: %v", err)
	}
	if layer.GetProject() != "objs-build" {
		t.Fatalf("the layer belongs to %q, want objs-build", layer.GetProject())
	}
	sb, err := builder.Create(ctx, env+"+objs-task:1", nil)
	if err != nil {
		t.Fatalf("the builder makes a sandbox of its layer: %v", err)
	}
	defer sb.Delete(context.WithoutCancel(ctx))
	if r, err := sb.Exec(ctx, dsec.Sh("echo graded > /task/grade.txt"), nil); err != nil || r.ExitCode != 0 {
		t.Fatalf("grade: %v %+v", err, r)
	}
	snap, err := builder.Snapshot(ctx, sb.ID, "objs-graded")
	if err != nil {
		t.Fatalf("the builder snapshots: %v", err)
	}
	defer builder.DeleteSnapshot(context.WithoutCancel(ctx), "objs-graded")
	if snap.GetProject() != "objs-build" || snap.GetSize() <= 0 {
		t.Fatalf("the snapshot: project %q, %d bytes", snap.GetProject(), snap.GetSize())
	}

	names := func(c *dsec.Client) []string {
		t.Helper()
		ls, err := c.ListLayers(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, l := range ls {
			out = append(out, l.GetRefs()...)
		}
		return out
	}
	if got := names(runner); slices.Contains(got, "objs-task:1") || slices.Contains(got, "snap:objs-graded") {
		t.Fatalf("the runner project lists the builder's layers before a share: %v", got)
	}
	if _, err := runner.Create(ctx, snap.GetEnvironment(), nil); !errors.Is(err, dsec.ErrNotFound) {
		t.Fatalf("the runner project makes a sandbox of an unshared snapshot: %v, want NotFound", err)
	}

	// Shared: the snapshot, which brings the task layer under it (and
	// only under it).
	if _, err := builder.ShareSnapshot(ctx, "objs-graded", "objs-run"); err != nil {
		t.Fatal(err)
	}
	if got := names(runner); slices.Contains(got, "objs-task:1") || !slices.Contains(got, "snap:objs-graded") || !slices.Contains(got, env) {
		t.Fatalf("the runner project lists %v once the snapshot is shared, want the snapshot and the root's %s, not the task layer", got, env)
	}
	if _, err := runner.Create(ctx, env+"+objs-task:1", nil); !errors.Is(err, dsec.ErrNotFound) {
		t.Fatalf("the runner project makes a sandbox of the task layer alone: %v, want NotFound", err)
	}
	mine, err := runner.Create(ctx, snap.GetEnvironment(), nil)
	if err != nil {
		t.Fatalf("the runner project makes a sandbox of the shared snapshot: %v", err)
	}
	defer mine.Delete(context.WithoutCancel(ctx))
	r, err := mine.Exec(ctx, dsec.Sh("cat /task/answer.txt /task/grade.txt"), nil)
	if err != nil || r.ExitCode != 0 || string(r.Stdout) != "42\ngraded\n" {
		t.Fatalf("the runner's sandbox reads %q (%v, %+v), want the answer and the grade", r.Stdout, err, r)
	}
	if _, err := runner.Get(ctx, sb.ID); !errors.Is(err, dsec.ErrNotFound) {
		t.Errorf("the runner project reads the builder's sandbox: %v, want NotFound", err)
	}
	if err := runner.DeleteSnapshot(ctx, "objs-graded"); !errors.Is(err, dsec.ErrPermissionDenied) {
		t.Errorf("the runner project deletes the shared snapshot: %v, want PermissionDenied", err)
	}

	// A third project sees nothing of it.
	if got := names(outsider); slices.Contains(got, "objs-task:1") || slices.Contains(got, "snap:objs-graded") {
		t.Errorf("a third project lists %v", got)
	}
	if sns, err := outsider.ListSnapshots(ctx); err != nil || len(sns) != 0 {
		t.Errorf("a third project lists snapshots %v (%v)", sns, err)
	}
	if _, err := outsider.Create(ctx, snap.GetEnvironment(), nil); !errors.Is(err, dsec.ErrNotFound) {
		t.Errorf("a third project makes a sandbox of the snapshot: %v, want NotFound", err)
	}
	sbs, err := outsider.List(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range sbs {
		if s.ID == sb.ID || s.ID == mine.ID {
			t.Errorf("a third project lists sandbox %s", s.ID)
		}
	}
	if err := outsider.Delete(ctx, mine.ID); err == nil || !strings.Contains(err.Error(), "no sandbox") {
		t.Errorf("a third project deletes the runner's sandbox: %v", err)
	}
}

// TestProjectObjects: through the CLI on a real node and store. Two layers
// of one tree (one blob) in a project are charged once; the project is not
// deleted while it owns them, and the refusal names them; with
// --objects-to-parent they go to its parent with their charge, and the
// parent's removing them gives back exactly what they cost.
func TestProjectObjects(t *testing.T) {
	d := startDaemon(t)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	st, err := store.Open(ctx, d.DB())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	cli := func(args ...string) {
		t.Helper()
		if out, errOut, code := d.CLI("", args...); code != 0 {
			t.Fatalf("dsec %s: exit %d: %s %s", strings.Join(args, " "), code, out, errOut)
		}
	}
	layerUse := func(project string) int64 {
		t.Helper()
		qs, err := st.Quota(ctx, project)
		if err != nil {
			t.Fatal(err)
		}
		return qs[0].Used[store.LayerBytes]
	}
	cli("project", "create", "objp")
	cli("project", "create", "objp/task")
	tree := t.TempDir()
	if err := os.WriteFile(filepath.Join(tree, "task.txt"), []byte(strings.Repeat("the task\n", 4096)), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, ref := range []string{"objp-a:1", "objp-b:1"} {
		cli("layer", "import", "--kind", "workspace", "--upload", "--project", "objp/task", ref, tree)
	}
	a, err := st.Object(ctx, "objp-a:1")
	if err != nil {
		t.Fatal(err)
	}
	b, err := st.Object(ctx, "objp-b:1")
	if err != nil {
		t.Fatal(err)
	}
	if len(a.Blobs) != 1 || !slices.Equal(a.Blobs, b.Blobs) || a.Bytes <= 0 {
		t.Fatalf("two layers of one tree hold %v and %v; want the same one blob", a.Blobs, b.Blobs)
	}
	if n := layerUse("objp/task"); n != a.Bytes {
		t.Fatalf("objp/task uses %d bytes of layers for two layers of one %d-byte blob, want it charged once", n, a.Bytes)
	}

	out, errOut, code := d.CLI("", "project", "rm", "objp/task")
	if code == 0 || !strings.Contains(errOut, "the project is in use: 2 layers (objp-a:1, objp-b:1)") {
		t.Fatalf("dsec project rm of a project owning layers: exit %d, %s %s; want a refusal naming them", code, out, errOut)
	}
	cli("project", "rm", "--objects-to-parent", "objp/task")
	if o, err := st.Object(ctx, "objp-a:1"); err != nil || o.Project != "objp" {
		t.Fatalf("objp-a:1 after its project's delete: %+v, %v; want objp's", o, err)
	}
	if n := layerUse("objp"); n != a.Bytes {
		t.Fatalf("objp uses %d bytes of layers once its child's are its own, want %d", n, a.Bytes)
	}
	cli("layer", "rm", "objp-a:1")
	if n := layerUse("objp"); n != a.Bytes {
		t.Fatalf("objp uses %d bytes of layers with objp-b:1 left on the same blob, want %d", n, a.Bytes)
	}
	cli("layer", "rm", "objp-b:1")
	if n := layerUse("objp"); n != 0 {
		t.Fatalf("objp uses %d bytes of layers with none left, want 0", n)
	}
	cli("project", "rm", "objp")
}
