package apiserver

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/layerupload"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/watcher"
	dsec "dsec.dev/dsec/sdk/go"
)

// memLayer is a layer of memLayers: every one is memLayerSize bytes.
const memLayerSize = 1000

// memLayers is a node's layers in memory, by name (name:tag, snap:NAME):
// enough of an edge's layer service for the rules on who sees, uses and
// removes them.
type memLayers struct {
	dsecv1connect.UnimplementedLayerServiceHandler
	mu     sync.Mutex
	layers map[string]*dsecv1.Layer
	// importing, when set, is called with each ImportLayer's ref before
	// the layer is made (a test holds a call there).
	importing func(ref string)
	// imported, when set, is called as each ImportImageTo is done.
	imported func()
	// listFails makes ListLayers fail (Unavailable), as a node that
	// stopped answering.
	listFails atomic.Bool
}

func newMemLayers() *memLayers { return &memLayers{layers: map[string]*dsecv1.Layer{}} }

func digestOf(name string) string {
	sum := sha256.Sum256([]byte(name))
	return "sha256:" + hex.EncodeToString(sum[:])
}

func (m *memLayers) put(l *dsecv1.Layer, name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	l.Digest, l.Size = digestOf(name), memLayerSize
	m.layers[name] = l
}

func (m *memLayers) has(name string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.layers[name]
	return ok
}

func (m *memLayers) ImportLayer(ctx context.Context, req *connect.Request[dsecv1.ImportLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	m.mu.Lock()
	importing := m.importing
	m.mu.Unlock()
	if importing != nil {
		importing(req.Msg.GetRef())
	}
	l := &dsecv1.Layer{Refs: []string{req.Msg.GetRef()}}
	m.put(l, req.Msg.GetRef())
	return connect.NewResponse(l), nil
}

func (m *memLayers) ListLayers(ctx context.Context, req *connect.Request[dsecv1.ListLayersRequest]) (*connect.Response[dsecv1.ListLayersResponse], error) {
	if m.listFails.Load() {
		return nil, fmt.Errorf("list layers: the node does not answer: %w", errdefs.ErrUnavailable)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	out := &dsecv1.ListLayersResponse{}
	for _, l := range m.layers {
		out.Layers = append(out.Layers, cloneLayer(l))
	}
	sort.Slice(out.Layers, func(i, j int) bool { return out.Layers[i].GetDigest() < out.Layers[j].GetDigest() })
	return connect.NewResponse(out), nil
}

func cloneLayer(l *dsecv1.Layer) *dsecv1.Layer {
	c := &dsecv1.Layer{Digest: l.Digest, Size: l.Size, Refs: slices.Clone(l.Refs), Images: slices.Clone(l.Images)}
	for _, sn := range l.Snapshots {
		c.Snapshots = append(c.Snapshots, &dsecv1.SnapshotInfo{Name: sn.Name, Layer: sn.Layer, Environment: sn.Environment, Size: sn.Size})
	}
	return c
}

func (m *memLayers) RemoveLayer(ctx context.Context, req *connect.Request[dsecv1.RemoveLayerRequest]) (*connect.Response[dsecv1.RemoveLayerResponse], error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	removed := false
	for name, l := range m.layers {
		if !strings.HasPrefix(name, "blob:") || !slices.Contains(l.Images, req.Msg.GetRef()) {
			continue
		}
		removed = true
		if l.Images = slices.DeleteFunc(l.Images, func(i string) bool { return i == req.Msg.GetRef() }); len(l.Images) == 0 {
			delete(m.layers, name)
		}
	}
	if removed {
		return connect.NewResponse(&dsecv1.RemoveLayerResponse{}), nil
	}
	for name, l := range m.layers {
		if name == req.Msg.GetRef() || objectName(name) == objectName(req.Msg.GetRef()) || l.Digest == req.Msg.GetRef() {
			delete(m.layers, name)
			return connect.NewResponse(&dsecv1.RemoveLayerResponse{}), nil
		}
	}
	return nil, fmt.Errorf("layer %s: %w", req.Msg.GetRef(), errdefs.ErrNotFound)
}

// ImportImageTo makes an image of one layer of its own, or, from a source
// "layers:A,B", of the layers blob:A and blob:B, shared with every image
// that names them (as an edge keeps a layer once by digest).
func (m *memLayers) ImportImageTo(ctx context.Context, req *dsecv1.ImportImageRequest, send func(*dsecv1.ImportImageProgress) error) error {
	m.mu.Lock()
	imported := m.imported
	m.mu.Unlock()
	if imported != nil {
		defer imported()
	}
	parts, ok := strings.CutPrefix(req.GetSource(), "layers:")
	if !ok {
		l := &dsecv1.Layer{Images: []string{req.GetRef()}}
		m.put(l, req.GetRef())
		return send(&dsecv1.ImportImageProgress{Phase: "done", Done: true, LayerDigests: []string{l.Digest}})
	}
	var digests []string
	for _, p := range strings.Split(parts, ",") {
		name := "blob:" + p
		m.mu.Lock()
		l, have := m.layers[name]
		if have && !slices.Contains(l.Images, req.GetRef()) {
			l.Images = append(l.Images, req.GetRef())
		}
		m.mu.Unlock()
		if !have {
			l = &dsecv1.Layer{Images: []string{req.GetRef()}}
			m.put(l, name)
		}
		digests = append(digests, l.Digest)
	}
	return send(&dsecv1.ImportImageProgress{Phase: "done", Done: true, LayerDigests: digests})
}

func (m *memLayers) UploadLayerFrom(ctx context.Context, in layerupload.Stream) (*dsecv1.Layer, error) {
	return nil, fmt.Errorf("memLayers takes no uploads: %w", errdefs.ErrNotSupported)
}
func (m *memLayers) AdoptLayers(ctx context.Context, ref string, digests []string) error { return nil }
func (m *memLayers) BlobStore() string                                                   { return "mem" }

// RenameRef moves to onto what from names, a layer or an image; to's old
// version goes (a real edge keeps its layers nameless until removed).
func (m *memLayers) RenameRef(ctx context.Context, from, to string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	from, to = objectName(from), objectName(to)
	found := false
	for name, l := range m.layers {
		if strings.HasPrefix(name, "blob:") && slices.Contains(l.Images, from) {
			found = true
		}
		if objectName(name) == from {
			found = true
		}
	}
	if !found {
		return fmt.Errorf("rename %s: %w", from, errdefs.ErrNotFound)
	}
	for name, l := range m.layers {
		l.Images = slices.DeleteFunc(l.Images, func(i string) bool { return objectName(i) == to })
		if strings.HasPrefix(name, "blob:") && len(l.Images) == 0 || objectName(name) == to {
			delete(m.layers, name)
		}
	}
	for name, l := range m.layers {
		for i, r := range l.Images {
			if objectName(r) == from {
				l.Images[i] = to
			}
		}
		if objectName(name) == from {
			for i, r := range l.Refs {
				if objectName(r) == from {
					l.Refs[i] = to
				}
			}
			delete(m.layers, name)
			m.layers[to] = l
		}
	}
	return nil
}

// snapEdge is a fake edge whose snapshots become layers of its memLayers.
type snapEdge struct {
	*fakeEdge
	layers *memLayers
}

func (e snapEdge) Snapshot(ctx context.Context, id, name string, sel snapshot.Select) (*dsecv1.SnapshotInfo, error) {
	sb, err := e.fakeEdge.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	e.layers.mu.Lock()
	_, taken := e.layers.layers["snap:"+name]
	e.layers.mu.Unlock()
	if taken {
		return nil, fmt.Errorf("snapshot %s: %w", name, errdefs.ErrAlreadyExists)
	}
	info := &dsecv1.SnapshotInfo{Name: name, Layer: "snap:" + name, Environment: sb.GetSpec().GetEnvironment() + "+snap:" + name,
		Size: memLayerSize, SourceSandbox: id}
	e.layers.put(&dsecv1.Layer{Refs: []string{"snap:" + name}, Snapshots: []*dsecv1.SnapshotInfo{info}}, "snap:"+name)
	return info, nil
}

// objectRig is an apiserver on a real store whose one node keeps layers in
// memory, with tokens of the root's admin and of a project's builder,
// runner and others.
type objectRig struct {
	srv    *Server
	layers *memLayers
	st     store.Store
	url    string
	tokens map[string]string // by principal
}

func startObjectRig(t *testing.T, dsn string) *objectRig {
	t.Helper()
	ctx := t.Context()
	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	node := iam.NodeAdmin()
	for _, p := range []string{"build", "run", "other"} {
		if _, err := st.CreateProject(ctx, node, p); err != nil {
			t.Fatal(err)
		}
	}
	// principal -> (project, role)
	people := map[string]struct {
		project string
		role    iam.Role
	}{
		"admin":       {"", iam.Admin},
		"builder":     {"build", iam.Builder},
		"runner":      {"run", iam.Runner},
		"run-builder": {"run", iam.Builder}, // a builder of the receiving project
		"outsider":    {"other", iam.Builder},
	}
	r := &objectRig{st: st, tokens: map[string]string{}}
	for name, p := range people {
		if _, err := st.CreatePrincipal(ctx, node, store.PrincipalSpec{Name: name, Project: p.project}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, node, name, p.project, p.role); err != nil {
			t.Fatal(err)
		}
		tok, _, err := st.MintToken(ctx, node, store.TokenSpec{Principal: name, Project: p.project, Role: p.role})
		if err != nil {
			t.Fatal(err)
		}
		r.tokens[name] = tok
	}
	layers := newMemLayers()
	e := snapEdge{fakeEdge: newFakeEdge("n1"), layers: layers}
	nodes := []watcher.Node{{Member: watcher.Member{Name: "n1"}, Edge: edgesvc.New(e, layers, slog.New(slog.DiscardHandler))}}
	s := New(Config{Name: "objects", Auth: st, IAM: st, Quotas: st, Objects: st, CreateConcurrency: 4}, st, watcher.NewFixed(nodes...), slog.New(slog.DiscardHandler))
	hs := httptest.NewUnstartedServer(s.Handler())
	hs.Config.Protocols = new(http.Protocols)
	hs.Config.Protocols.SetHTTP1(true)
	hs.Config.Protocols.SetUnencryptedHTTP2(true)
	hs.Start()
	t.Cleanup(hs.Close)
	r.url, r.layers, r.srv = hs.URL, layers, s
	return r
}

func (r *objectRig) client(t *testing.T, principal string) *dsec.Client {
	t.Helper()
	c, err := dsec.NewClient(r.url, dsec.WithToken(r.tokens[principal]))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// objectDatabases are the stores the object tests run on.
func objectDatabases() map[string]func(t *testing.T) string {
	return map[string]func(t *testing.T) string{
		"sqlite":   func(t *testing.T) string { return filepath.Join(t.TempDir(), "meta.db") },
		"postgres": func(t *testing.T) string { return testutil.StartPostgres(t) },
	}
}

func refsOf(ls []*dsecv1.Layer) []string {
	var out []string
	for _, l := range ls {
		out = append(out, layerNames(l)...)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

func snapNames(sns []*dsecv1.SnapshotInfo) []string {
	var out []string
	for _, sn := range sns {
		out = append(out, sn.GetName())
	}
	slices.Sort(out)
	return out
}

// TestObjectProjects: layers, images and snapshots belong to the project
// that made them; another project sees and uses them only once shared,
// read-only; the escalation attempts of issue 31 are refused (a table),
// and bytes are charged to the owner's quota and given back on delete. On
// SQLite and PostgreSQL, through the Go SDK.
func TestObjectProjects(t *testing.T) {
	for name, dsn := range objectDatabases() {
		t.Run(name, func(t *testing.T) { testObjectProjects(t, startObjectRig(t, dsn(t))) })
	}
}

func testObjectProjects(t *testing.T, r *objectRig) {
	ctx := t.Context()
	admin, builder, runner := r.client(t, "admin"), r.client(t, "builder"), r.client(t, "runner")
	runBuilder, outsider := r.client(t, "run-builder"), r.client(t, "outsider")
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}

	// A layer the node holds with no record (made before layers had
	// projects) is the root's.
	r.layers.put(&dsecv1.Layer{Refs: []string{"legacy:1"}}, "legacy:1")
	// The root's base, as the demo's and CI's: everyone sees and uses it.
	_, err := admin.ImportLayer(ctx, "base:1", dsecv1.LayerKind_LAYER_KIND_BASE, "/base", nil)
	must("admin imports base:1", err)
	// The builder's environment, with the reference answer in a snapshot.
	l, err := builder.ImportLayer(ctx, "env:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/env", nil)
	must("builder imports env:1", err)
	if l.GetProject() != "build" {
		t.Fatalf("env:1 belongs to %q, want build", l.GetProject())
	}
	_, err = builder.ImportImage(ctx, "img:1", "oci:/img", nil)
	must("builder imports img:1", err)
	sb, err := builder.Create(ctx, "base:1+env:1", nil)
	must("builder creates from its layer", err)
	snap, err := builder.Snapshot(ctx, sb.ID, "answer")
	must("builder snapshots", err)
	if snap.GetProject() != "build" {
		t.Fatalf("snapshot belongs to %q, want build", snap.GetProject())
	}
	fork, children, err := builder.Fork(ctx, sb.ID, 1)
	must("builder forks", err)
	if len(children) != 1 || children[0].Err != nil {
		t.Fatalf("fork children %+v", children)
	}

	// What each sees before any share.
	seen := func(c *dsec.Client) []string {
		t.Helper()
		ls, err := c.ListLayers(ctx)
		must("ListLayers", err)
		return refsOf(ls)
	}
	if got, want := seen(builder), []string{"base:1", "env:1", "img:1", "legacy:1", "snap:answer", "snap:" + fork.GetName()}; !slices.Equal(got, want) {
		t.Fatalf("the builder sees %v, want %v", got, want)
	}
	if got := seen(runner); !slices.Equal(got, []string{"base:1", "legacy:1"}) {
		t.Fatalf("a runner of another project sees %v, want only the root's base:1", got)
	}
	if got := seen(admin); len(got) != 6 {
		t.Fatalf("the root's admin sees %v, want all 6", got)
	}

	// The escalation attempts, each refused with nothing changed.
	snapEnv := snap.GetEnvironment()
	attempts := []struct {
		name  string
		call  func() error
		kind  error
		words string
	}{
		{"a runner lists another project's layers", func() error {
			if got := seen(runner); slices.Contains(got, "env:1") {
				return fmt.Errorf("listed %v", got)
			}
			sns, err := runner.ListSnapshots(ctx)
			if err == nil && len(sns) > 0 {
				return fmt.Errorf("listed snapshots %v", snapNames(sns))
			}
			return fmt.Errorf("hidden: %w", dsec.ErrNotFound)
		}, dsec.ErrNotFound, "hidden"},
		{"a runner builds a layer", func() error {
			_, err := runner.ImportLayer(ctx, "mine:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/x", nil)
			return err
		}, dsec.ErrPermissionDenied, "needs builder"},
		{"a runner builds a layer into the builder's project", func() error {
			_, err := runner.ImportLayer(ctx, "mine:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/x", &dsec.LayerOptions{Project: "build"})
			return err
		}, dsec.ErrPermissionDenied, "needs builder"},
		{"a builder of another project builds into the builder's", func() error {
			_, err := runBuilder.ImportLayer(ctx, "mine:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/x", &dsec.LayerOptions{Project: "build"})
			return err
		}, dsec.ErrNotFound, "project build"},
		{"a runner shares the builder's snapshot", func() error {
			_, err := runner.ShareSnapshot(ctx, "answer", "run")
			return err
		}, dsec.ErrPermissionDenied, "needs builder"},
		{"a builder of another project shares the builder's snapshot", func() error {
			_, err := runBuilder.ShareSnapshot(ctx, "answer", "run")
			return err
		}, dsec.ErrNotFound, "no snapshot snap:answer"},
		{"a runner makes a sandbox of an unshared layer", func() error {
			_, err := runner.Create(ctx, "base:1+env:1", nil)
			return err
		}, dsec.ErrNotFound, "env:1"},
		{"a runner makes a sandbox of an unshared snapshot", func() error {
			_, err := runner.Create(ctx, snapEnv, nil)
			return err
		}, dsec.ErrNotFound, "snap:answer"},
		{"a runner makes a sandbox of an unshared layer by digest", func() error {
			_, err := runner.Create(ctx, "base:1+"+digestOf("env:1"), nil)
			return err
		}, dsec.ErrNotFound, digestOf("env:1")},
		{"a builder of another project removes the builder's layer", func() error {
			return runBuilder.RemoveLayer(ctx, "env:1")
		}, dsec.ErrNotFound, "no layer env:1"},
		{"a builder of another project removes it by digest", func() error {
			return runBuilder.RemoveLayer(ctx, digestOf("env:1"))
		}, dsec.ErrNotFound, "no layer"},
		{"a builder of another project deletes the builder's snapshot", func() error {
			return runBuilder.DeleteSnapshot(ctx, "answer")
		}, dsec.ErrNotFound, "answer"},
		{"a builder of another project takes the name of the builder's layer", func() error {
			_, err := runBuilder.ImportLayer(ctx, "env:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/x", nil)
			return err
		}, dsec.ErrAlreadyExists, "taken by another project"},
		{"a builder of another project overwrites the root's layer", func() error {
			_, err := runBuilder.ImportLayer(ctx, "base:1", dsecv1.LayerKind_LAYER_KIND_BASE, "/x", nil)
			return err
		}, dsec.ErrAlreadyExists, "belongs to project /,"},
		{"a builder of another project overwrites a layer made before projects", func() error {
			_, err := runBuilder.ImportLayer(ctx, "legacy:1", dsecv1.LayerKind_LAYER_KIND_BASE, "/x", nil)
			return err
		}, dsec.ErrPermissionDenied, "belongs to the root project"},
		{"a builder of another project removes a layer made before projects", func() error {
			return runBuilder.RemoveLayer(ctx, "legacy:1")
		}, dsec.ErrPermissionDenied, "read-only"},
		{"a runner reads the builder's sandbox", func() error {
			_, err := runner.Get(ctx, sb.ID)
			return err
		}, dsec.ErrNotFound, sb.ID},
	}
	for _, a := range attempts {
		err := a.call()
		if !errors.Is(err, a.kind) || !strings.Contains(err.Error(), a.words) {
			t.Errorf("%s: got %v, want %v saying %q", a.name, err, a.kind, a.words)
		}
	}
	if got, want := seen(builder), []string{"base:1", "env:1", "img:1", "legacy:1", "snap:answer", "snap:" + fork.GetName()}; !slices.Equal(got, want) {
		t.Fatalf("after the attempts the builder sees %v, want %v", got, want)
	}

	// Shared read-only with run: listed, used, forked; never removed,
	// overwritten or shared on. A shared snapshot brings the layers it
	// was taken on, under it only.
	_, err = builder.ShareSnapshot(ctx, "answer", "/run")
	must("share the snapshot", err)
	if got := seen(runner); !slices.Equal(got, []string{"base:1", "legacy:1", "snap:answer"}) {
		t.Fatalf("the runner sees %v once the snapshot is shared, want base:1, legacy:1, snap:answer", got)
	}
	under, err := runner.Create(ctx, snapEnv, nil)
	must("the runner makes a sandbox of the shared snapshot, on the layer under it", err)
	must("delete it", runner.Delete(ctx, under.ID))
	if _, err := runner.Create(ctx, "base:1+env:1", nil); !errors.Is(err, dsec.ErrNotFound) {
		t.Errorf("a shared snapshot lets the layer under it be used alone: %v", err)
	}
	if _, err := runner.Create(ctx, "img:1+snap:answer", nil); !errors.Is(err, dsec.ErrNotFound) || !strings.Contains(err.Error(), "img:1") {
		t.Errorf("a shared snapshot lets another of the builder's objects under it: %v", err)
	}
	with, err := builder.ShareLayer(ctx, "env:1", "run")
	must("share env:1", err)
	if !slices.Equal(with, []string{"run"}) {
		t.Fatalf("env:1 shared with %v", with)
	}
	if got := seen(runner); !slices.Equal(got, []string{"base:1", "env:1", "legacy:1", "snap:answer"}) {
		t.Fatalf("the runner sees %v once shared, want base:1, env:1, snap:answer", got)
	}
	sns, err := runner.ListSnapshots(ctx)
	must("runner lists snapshots", err)
	if len(sns) != 1 || sns[0].GetProject() != "build" || !slices.Equal(sns[0].GetSharedWith(), []string{"run"}) {
		t.Fatalf("the runner's snapshots: %v", sns)
	}
	got, err := runner.Create(ctx, snapEnv, nil)
	must("the runner makes a sandbox of the shared snapshot", err)
	if _, children, err := runner.Fork(ctx, got.ID, 1); err != nil || children[0].Err != nil {
		t.Fatalf("the runner forks it: %v %+v", err, children)
	}
	if _, err := runner.Create(ctx, "img:1", nil); !errors.Is(err, dsec.ErrNotFound) {
		t.Errorf("an unshared image is usable once a layer is shared: %v", err)
	}
	if sbs, err := runner.List(ctx, nil); err != nil || slices.ContainsFunc(sbs, func(s *dsec.Sandbox) bool { return s.ID == sb.ID }) {
		t.Errorf("the runner lists the builder's sandbox once layers are shared: %v", err)
	}
	shared := []struct {
		name  string
		call  func() error
		kind  error
		words string
	}{
		{"the receiving project deletes a shared layer", func() error { return runBuilder.RemoveLayer(ctx, "env:1") },
			dsec.ErrPermissionDenied, "read-only"},
		{"the receiving project deletes a shared snapshot", func() error { return runBuilder.DeleteSnapshot(ctx, "answer") },
			dsec.ErrPermissionDenied, "read-only"},
		{"the receiving project shares it on", func() error { _, err := runBuilder.ShareLayer(ctx, "env:1", "other"); return err },
			dsec.ErrPermissionDenied, "read-only"},
		{"the receiving project overwrites it", func() error {
			_, err := runBuilder.ImportLayer(ctx, "env:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/x", nil)
			return err
		}, dsec.ErrAlreadyExists, "belongs to project build"},
		{"a third project uses it", func() error { _, err := outsider.Create(ctx, snapEnv, nil); return err },
			dsec.ErrNotFound, "snap:answer"},
		{"a share with a project that does not exist", func() error { _, err := builder.ShareLayer(ctx, "env:1", "nowhere"); return err },
			dsec.ErrNotFound, "nowhere"},
	}
	for _, a := range shared {
		err := a.call()
		if !errors.Is(err, a.kind) || !strings.Contains(err.Error(), a.words) {
			t.Errorf("%s: got %v, want %v saying %q", a.name, err, a.kind, a.words)
		}
	}
	if got := seen(outsider); !slices.Equal(got, []string{"base:1", "legacy:1"}) {
		t.Fatalf("a third project sees %v, want only the root's base:1", got)
	}

	// Unshared: gone from the runner again.
	_, err = builder.UnshareSnapshot(ctx, "answer", "run")
	must("unshare", err)
	if _, err := runner.Create(ctx, snapEnv, nil); !errors.Is(err, dsec.ErrNotFound) {
		t.Fatalf("create from an unshared snapshot: %v", err)
	}

	// Bytes: charged to the owner, refused past its quota in the issue's
	// words, given back on delete.
	used := func(project, res string) int64 {
		t.Helper()
		qs, err := admin.Quota(ctx, project)
		must("Quota", err)
		for _, q := range qs {
			if q.Project != project {
				continue
			}
			for _, it := range q.Items {
				if it.Resource == res {
					return it.Used
				}
			}
			return 0
		}
		return -1
	}
	if n := used("build", "layer_bytes"); n != 2*memLayerSize {
		t.Fatalf("build's layer_bytes %d, want %d (env:1 and img:1)", n, 2*memLayerSize)
	}
	if n := used("build", "snapshot_bytes"); n != 2*memLayerSize {
		t.Fatalf("build's snapshot_bytes %d, want %d (answer and the fork's)", n, 2*memLayerSize)
	}
	if n := used("run", "snapshot_bytes"); n != memLayerSize {
		t.Fatalf("run's snapshot_bytes %d, want %d (its sandbox's fork)", n, memLayerSize)
	}
	must("limit build's layer bytes", admin.SetQuota(ctx, "build", "layer_bytes", 2*memLayerSize+500))
	_, err = builder.ImportLayer(ctx, "env:2", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/env2", nil)
	if !errors.Is(err, dsec.ErrOverloaded) || !strings.Contains(err.Error(), "quota of project build: 2000 of 2500 bytes of layers in use") {
		t.Fatalf("import past the quota: %v", err)
	}
	if got := seen(builder); slices.Contains(got, "env:2") {
		t.Fatalf("a layer refused by the quota stays: %v", got)
	}
	must("remove env:1", builder.RemoveLayer(ctx, "env:1"))
	_, err = builder.ImportLayer(ctx, "env:2", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/env2", nil)
	must("import within the quota once env:1 is gone", err)
	must("delete the snapshot", builder.DeleteSnapshot(ctx, "answer"))
	if n := used("build", "snapshot_bytes"); n != memLayerSize {
		t.Fatalf("build's snapshot_bytes after a delete %d, want %d", n, memLayerSize)
	}
}

// TestSnapshotAgainAtQuota: a snapshot taken again under its name while
// its project is at its snapshot_bytes quota is refused AlreadyExists
// before any node is asked, and the snapshot keeps its layer, record and
// charge and still makes sandboxes; a name another call is taking (its
// record claimed, no blobs yet) is refused alike and its record kept
// (before, the second call made the name, was refused the charge and
// removed the name with the first call's record); a record whose
// snapshot no node holds any more is taken over, charged in the
// transaction that gives back what the old record alone held.
func TestSnapshotAgainAtQuota(t *testing.T) {
	r := startObjectRig(t, filepath.Join(t.TempDir(), "meta.db"))
	ctx := t.Context()
	admin, builder := r.client(t, "admin"), r.client(t, "builder")
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	snapUse := func() int64 {
		t.Helper()
		qs, err := r.st.Quota(ctx, "build")
		must("Quota", err)
		return qs[0].Used[store.SnapshotBytes]
	}
	_, err := admin.ImportLayer(ctx, "base:1", dsecv1.LayerKind_LAYER_KIND_BASE, "/base", nil)
	must("admin imports base:1", err)
	sb, err := builder.Create(ctx, "base:1", nil)
	must("builder creates", err)
	_, err = builder.Snapshot(ctx, sb.ID, "s")
	must("builder snapshots s", err)
	must("limit build's snapshot bytes to its use", admin.SetQuota(ctx, "build", "snapshot_bytes", memLayerSize))

	_, err = builder.Snapshot(ctx, sb.ID, "s")
	if !errors.Is(err, dsec.ErrAlreadyExists) || !strings.Contains(err.Error(), "snapshot s") {
		t.Fatalf("snapshot s again at the quota: %v; want AlreadyExists naming s", err)
	}
	if o, err := r.st.Object(ctx, "snap:s"); err != nil || len(o.Blobs) != 1 || snapUse() != memLayerSize {
		t.Fatalf("after the refusal: the record of snap:s %+v (%v), build uses %d snapshot bytes; want it whole, charged %d", o, err, snapUse(), memLayerSize)
	}
	if _, err := builder.Create(ctx, "base:1+snap:s", nil); err != nil {
		t.Fatalf("a sandbox of snapshot s after the refusal: %v", err)
	}

	// Another call is taking t: its record is claimed, nothing made yet.
	if _, claimed, err := r.st.ClaimObject(ctx, store.Object{Name: "snap:t", Kind: store.ObjectSnapshot, Project: "build",
		Writer: "another", WriterUntil: time.Now().Add(time.Hour)}); err != nil || !claimed {
		t.Fatalf("claim snap:t as another call would: %v, %v", claimed, err)
	}
	_, err = builder.Snapshot(ctx, sb.ID, "t")
	if !errors.Is(err, dsec.ErrAlreadyExists) || !strings.Contains(err.Error(), "being taken by another call") {
		t.Fatalf("snapshot t while another call takes it: %v; want AlreadyExists", err)
	}
	if _, err := r.st.Object(ctx, "snap:t"); err != nil {
		t.Fatalf("the other call's record of snap:t after the refusal: %v", err)
	}
	if r.layers.has("snap:t") {
		t.Fatal("the node holds snap:t after a refused call")
	}
	must("delete the record a stopped call left", builder.DeleteSnapshot(ctx, "t"))
	if _, err := r.st.Object(ctx, "snap:t"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("the record of snap:t once deleted: %v", err)
	}

	// s's node loses it (replaced): its record, naming nothing, is taken
	// over by a snapshot that fits once the record's bytes are given back.
	r.layers.mu.Lock()
	delete(r.layers.layers, "snap:s")
	r.layers.mu.Unlock()
	_, err = builder.Snapshot(ctx, sb.ID, "s")
	must("snapshot s again once no node holds it, at the quota", err)
	if n := snapUse(); n != memLayerSize {
		t.Fatalf("build uses %d snapshot bytes after s is taken again, want %d", n, memLayerSize)
	}
}

// TestOneWriter: a name has one writer at a time, decided in the store
// (issue 31): an overwrite of a layer while another is under way is
// refused (FailedPrecondition, try again) and the first one's version is
// what the name's record, its project's charge and the node all hold
// (before, both renamed their staging refs onto the name, and the record
// could hold the other's blobs); a claim past its deadline (its call
// died, its apiserver killed) is taken over, one before it refused; and a
// snapshot's pending record past its deadline is taken over by a later
// take of the name, one before it still refused (before, a pending record
// refused every take until deleted). On SQLite and PostgreSQL.
func TestOneWriter(t *testing.T) {
	for name, dsn := range objectDatabases() {
		t.Run(name, func(t *testing.T) { testOneWriter(t, startObjectRig(t, dsn(t))) })
	}
}

func testOneWriter(t *testing.T, r *objectRig) {
	ctx := t.Context()
	builder := r.client(t, "builder")
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	base := dsecv1.LayerKind_LAYER_KIND_BASE
	// agree checks that env:1's record holds the blob the node names
	// env:1 by, charged once, with no writer and no staging ref left.
	agree := func(when string) {
		t.Helper()
		o, err := r.st.Object(ctx, "env:1")
		must("the record of env:1 "+when, err)
		r.layers.mu.Lock()
		node, held := r.layers.layers["env:1"]
		var staged []string
		for name := range r.layers.layers {
			if strings.HasPrefix(name, stagingPrefix) {
				staged = append(staged, name)
			}
		}
		r.layers.mu.Unlock()
		if !held || len(o.Blobs) != 1 || o.Blobs[0].Digest != node.GetDigest() || o.Writer != "" || len(staged) > 0 {
			t.Fatalf("%s: the record of env:1 holds %v (writer %q), the node %v (held %v), staging refs left %v; want one blob, the node's",
				when, o.Blobs, o.Writer, node, held, staged)
		}
		qs, err := r.st.Quota(ctx, "build")
		must("Quota", err)
		if n := qs[0].Used[store.LayerBytes]; n != memLayerSize {
			t.Fatalf("%s: build uses %d bytes of layers, want %d", when, n, memLayerSize)
		}
	}
	_, err := builder.ImportLayer(ctx, "env:1", base, "/env", nil)
	must("builder imports env:1", err)

	// Two overwrites at once: the first is held on the node while it
	// makes its staging ref; the second is refused before any node is
	// asked.
	arrived, release := make(chan struct{}), make(chan struct{})
	var held atomic.Bool
	r.layers.mu.Lock()
	r.layers.importing = func(ref string) {
		if held.CompareAndSwap(false, true) {
			close(arrived)
			<-release
		}
	}
	r.layers.mu.Unlock()
	first := make(chan error, 1)
	go func() {
		_, err := builder.ImportLayer(ctx, "env:1", base, "/env-a", nil)
		first <- err
	}()
	select {
	case <-arrived:
	case err := <-first:
		close(release)
		t.Fatalf("the first overwrite of env:1 ended before it reached the node: %v", err)
	}
	_, err = r.client(t, "builder").ImportLayer(ctx, "env:1", base, "/env-b", nil)
	close(release)
	if !errors.Is(err, dsec.ErrFailedPrecondition) || !strings.Contains(err.Error(), "layer env:1 is being made again by another call; try again") {
		t.Fatalf("a second overwrite of env:1 while the first is under way: %v; want FailedPrecondition, try again", err)
	}
	must("the first overwrite of env:1", <-first)
	agree("after two overwrites at once")
	_, err = builder.ImportLayer(ctx, "env:1", base, "/env-c", nil)
	must("an overwrite once the first is done", err)
	agree("after an overwrite once the first is done")

	// A call making env:1 again died (its apiserver killed) with its
	// claim live: refused until its deadline, taken over after it.
	_, err = r.st.TakeObject(ctx, "env:1", "dead", time.Now().Add(time.Hour))
	must("a dead call's live claim of env:1", err)
	_, err = builder.ImportLayer(ctx, "env:1", base, "/env-d", nil)
	if !errors.Is(err, dsec.ErrFailedPrecondition) {
		t.Fatalf("an overwrite of env:1 while a dead call's claim is live: %v; want FailedPrecondition", err)
	}
	_, err = r.st.TakeObject(ctx, "env:1", "dead", time.Now().Add(-time.Second))
	must("the dead call's claim of env:1, lapsed", err)
	_, err = builder.ImportLayer(ctx, "env:1", base, "/env-e", nil)
	must("an overwrite of env:1 once the dead call's claim lapsed", err)
	agree("after taking over a lapsed claim")

	// Snapshots: a record a dead call left pending (claimed, no blobs),
	// before and after its deadline.
	sb, err := builder.Create(ctx, "env:1", nil)
	must("builder creates", err)
	pending := func(name string, until time.Time) {
		t.Helper()
		if _, claimed, err := r.st.ClaimObject(ctx, store.Object{Name: "snap:" + name, Kind: store.ObjectSnapshot, Project: "build",
			Writer: "dead", WriterUntil: until}); err != nil || !claimed {
			t.Fatalf("claim snap:%s as a call that died would: %v, %v", name, claimed, err)
		}
	}
	pending("live", time.Now().Add(time.Hour))
	_, err = builder.Snapshot(ctx, sb.ID, "live")
	if !errors.Is(err, dsec.ErrAlreadyExists) || !strings.Contains(err.Error(), "being taken by another call") {
		t.Fatalf("snapshot live while a dead call's claim is live: %v; want AlreadyExists", err)
	}
	if r.layers.has("snap:live") {
		t.Fatal("the node holds snap:live after a refused call")
	}
	pending("lapsed", time.Now().Add(-time.Second))
	_, err = builder.Snapshot(ctx, sb.ID, "lapsed")
	must("snapshot lapsed, its pending record's claim past its deadline", err)
	if o, err := r.st.Object(ctx, "snap:lapsed"); err != nil || len(o.Blobs) != 1 || o.Writer != "" || !r.layers.has("snap:lapsed") {
		t.Fatalf("snap:lapsed taken over: record %+v (%v), node holds it %v; want one blob, no writer, on the node", o, err, r.layers.has("snap:lapsed"))
	}
	qs, err := r.st.Quota(ctx, "build")
	must("Quota", err)
	if n := qs[0].Used[store.SnapshotBytes]; n != memLayerSize {
		t.Fatalf("build uses %d snapshot bytes, want %d (snap:lapsed once)", n, memLayerSize)
	}
}

// TestStagingRefOfADeadCall: a call that died making a layer or image
// again (its apiserver killed) leaves its staging ref on the node; it is
// removed once the call's claim lapses, by the next list or by the call
// that takes the name over, and no one (the root's admin included) ever
// lists it. Before, it stayed until removed by hand, and the root's admin
// listed it.
func TestStagingRefOfADeadCall(t *testing.T) {
	r := startObjectRig(t, filepath.Join(t.TempDir(), "meta.db"))
	ctx := t.Context()
	admin, builder := r.client(t, "admin"), r.client(t, "builder")
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	base := dsecv1.LayerKind_LAYER_KIND_BASE
	_, err := builder.ImportLayer(ctx, "env:1", base, "/env", nil)
	must("builder imports env:1", err)
	// died makes writer env:1's claim, until until, and puts the staging
	// ref it would have made on the node, as a call that died after
	// making it.
	died := func(writer string, until time.Time) string {
		t.Helper()
		_, err := r.st.TakeObject(ctx, "env:1", writer, until)
		must("claim env:1 as "+writer, err)
		ref := stagingRef(writer)
		r.layers.put(&dsecv1.Layer{Refs: []string{ref}}, ref)
		return ref
	}
	list := func(c *dsec.Client, who string) {
		t.Helper()
		ls, err := c.ListLayers(ctx)
		must(who+" lists layers", err)
		for _, n := range refsOf(ls) {
			if strings.HasPrefix(n, stagingPrefix) {
				t.Fatalf("%s lists the staging ref %s", who, n)
			}
		}
	}

	// Its claim live: the call may still be running; kept, and listed to
	// no one.
	ref := died("objects/00000000000000aa", time.Now().Add(time.Hour))
	list(admin, "the root's admin")
	list(builder, "the builder")
	if !r.layers.has(ref) {
		t.Fatal("a list removed the staging ref of a call whose claim is live")
	}
	// Its claim lapsed: the next list removes it.
	died("objects/00000000000000aa", time.Now().Add(-time.Second))
	list(builder, "the builder")
	if r.layers.has(ref) {
		t.Fatal("a list left the staging ref of a call whose claim lapsed")
	}
	// An image's staging ref no claim holds (its call was done, but its
	// removal failed): the next list removes it.
	img := stagingRef("objects/00000000000000cc")
	r.layers.put(&dsecv1.Layer{Images: []string{img}}, "blob:cc")
	list(admin, "the root's admin")
	if r.layers.has("blob:cc") {
		t.Fatal("a list left an image's staging ref no claim holds")
	}
	// A call that takes the name over removes the dead call's staging ref.
	ref = died("objects/00000000000000bb", time.Now().Add(-time.Second))
	_, err = builder.ImportLayer(ctx, "env:1", base, "/env-b", nil)
	must("an overwrite of env:1 once the dead call's claim lapsed", err)
	if r.layers.has(ref) {
		t.Fatal("taking env:1 over left the dead call's staging ref")
	}
	o, err := r.st.Object(ctx, "env:1")
	must("the record of env:1", err)
	r.layers.mu.Lock()
	node := r.layers.layers["env:1"].GetDigest()
	r.layers.mu.Unlock()
	if len(o.Blobs) != 1 || o.Blobs[0].Digest != node || node == digestOf("env:1") || o.Writer != "" {
		t.Fatalf("the record of env:1 after the take-over: %+v, the node's %s; want the new version's blob, no writer", o, node)
	}
}

// TestObjectBlobsCharged: a project is charged each layer once, however
// many of its images hold it (issue 31: every layer belongs to a project
// and is charged to its quota): two images on one base layer use the
// base's bytes once, a quota that holds the pair admits the second
// image, and removing one image gives back only the layer the other does
// not hold. On SQLite and PostgreSQL, through the Go SDK.
func TestObjectBlobsCharged(t *testing.T) {
	for name, dsn := range objectDatabases() {
		t.Run(name, func(t *testing.T) { testObjectBlobsCharged(t, startObjectRig(t, dsn(t))) })
	}
}

func testObjectBlobsCharged(t *testing.T, r *objectRig) {
	ctx := t.Context()
	admin, builder := r.client(t, "admin"), r.client(t, "builder")
	// Room for three layers: base, a and b (not four, as charging per
	// image would need).
	if err := admin.SetQuota(ctx, "build", "layer_bytes", 3*memLayerSize); err != nil {
		t.Fatal(err)
	}
	for _, img := range []struct{ ref, source string }{{"py:a", "layers:base,a"}, {"py:b", "layers:base,b"}} {
		if _, err := builder.ImportImage(ctx, img.ref, img.source, nil); err != nil {
			t.Fatalf("import %s: %v", img.ref, err)
		}
	}
	used := func() int64 {
		t.Helper()
		qs, err := admin.Quota(ctx, "build")
		if err != nil {
			t.Fatal(err)
		}
		for _, it := range qs[0].Items {
			if it.Resource == "layer_bytes" {
				return it.Used
			}
		}
		return 0
	}
	if n := used(); n != 3*memLayerSize {
		t.Fatalf("build's layer_bytes %d with two images on one base, want %d (base, a, b once each)", n, 3*memLayerSize)
	}
	if err := builder.RemoveLayer(ctx, "py:a"); err != nil {
		t.Fatalf("remove py:a: %v", err)
	}
	if n := used(); n != 2*memLayerSize {
		t.Fatalf("build's layer_bytes %d once py:a is gone, want %d (py:b's base and b)", n, 2*memLayerSize)
	}
	// An overwrite past the quota (base, c, d and e: more than the quota
	// holds once b is given back) is refused by name with the numbers,
	// and the old py:b is kept whole: its layers, its record, its charge.
	// It was made under a staging ref, which is gone again.
	imageOf := func(ref string) (digests []string) {
		t.Helper()
		layers, err := admin.ListLayers(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range layers {
			for _, i := range l.GetImages() {
				if i == ref {
					digests = append(digests, l.GetDigest())
				}
				if strings.HasPrefix(i, stagingPrefix) {
					t.Errorf("a staging ref is left: layer %s of %s", l.GetDigest(), i)
				}
			}
		}
		slices.Sort(digests)
		return digests
	}
	before := imageOf("py:b")
	_, err := builder.ImportImage(ctx, "py:b", "layers:base,c,d,e", nil)
	if !errors.Is(err, dsec.ErrOverloaded) || !strings.Contains(err.Error(), "image py:b (4000 bytes, replacing 2000)") ||
		!strings.Contains(err.Error(), "quota of project build: 2000 of 3000 bytes of layers in use") ||
		!strings.Contains(err.Error(), "the image before is kept") {
		t.Fatalf("an overwrite past the quota: %v", err)
	}
	if n := used(); n != 2*memLayerSize {
		t.Fatalf("build's layer_bytes %d after a refused overwrite, want %d (py:b as it was)", n, 2*memLayerSize)
	}
	if got := imageOf("py:b"); !slices.Equal(got, before) {
		t.Fatalf("py:b after a refused overwrite is made of %v, want %v", got, before)
	}
	if o, err := r.st.Object(ctx, "py:b"); err != nil || o.Bytes != 2*memLayerSize || len(o.Blobs) != 2 {
		t.Fatalf("py:b's record after a refused overwrite: %+v, %v; want its two blobs", o, err)
	}
	// At the quota, an overwrite that fits once the old version's own
	// layer is given back (base and c for base and b) is admitted: it is
	// charged in the transaction that gives b back.
	if err := admin.SetQuota(ctx, "build", "layer_bytes", 2*memLayerSize); err != nil {
		t.Fatal(err)
	}
	if _, err := builder.ImportImage(ctx, "py:b", "layers:base,c", nil); err != nil {
		t.Fatalf("an overwrite at the quota that fits: %v", err)
	}
	if n := used(); n != 2*memLayerSize {
		t.Fatalf("build's layer_bytes %d after the overwrite, want %d (base and c)", n, 2*memLayerSize)
	}
	if got, want := imageOf("py:b"), []string{digestOf("blob:base"), digestOf("blob:c")}; !slices.Equal(got, sortedCopy(want)) {
		t.Fatalf("py:b after the overwrite is made of %v, want %v", got, want)
	}
	// A name no node holds any more (its node was replaced) is removed
	// all the same: its record goes and its bytes are given back, where
	// before the removal answered NotFound and the charge stayed.
	r.layers.mu.Lock()
	for name, l := range r.layers.layers {
		if strings.HasPrefix(name, "blob:") && slices.Contains(l.Images, "py:b") {
			delete(r.layers.layers, name)
		}
	}
	r.layers.mu.Unlock()
	if err := builder.RemoveLayer(ctx, "py:b"); err != nil {
		t.Fatalf("remove py:b, which no node holds: %v", err)
	}
	if _, err := r.st.Object(ctx, "py:b"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("py:b's record after its removal: %v", err)
	}
	if n := used(); n != 0 {
		t.Fatalf("build's layer_bytes %d once py:b is removed, want 0", n)
	}
	if err := builder.RemoveLayer(ctx, "py:b"); !errors.Is(err, dsec.ErrNotFound) {
		t.Fatalf("remove py:b again: %v, want not found", err)
	}

	// No caller names a staging ref.
	if _, err := builder.ImportLayer(ctx, stagingPrefix+"x:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/x", nil); !errors.Is(err, dsec.ErrInvalidArgument) {
		t.Fatalf("import under a staging ref: %v, want invalid argument", err)
	}
}

func sortedCopy(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// TestDeleteProjectObjects: a project that owns layers, images or
// snapshots is not deleted, and the refusal names them (before, the
// records stayed, seen only from the root, and a project made again at
// the path inherited the shares); handed to the parent, they are its
// parent's with their shares and charge; shares with a deleted project go
// with it; a project a warm pool serves is refused either way. On SQLite
// and PostgreSQL, through the Go SDK.
func TestDeleteProjectObjects(t *testing.T) {
	for name, dsn := range objectDatabases() {
		t.Run(name, func(t *testing.T) { testDeleteProjectObjects(t, startObjectRig(t, dsn(t))) })
	}
}

func testDeleteProjectObjects(t *testing.T, r *objectRig) {
	ctx := t.Context()
	admin, builder, outsider := r.client(t, "admin"), r.client(t, "builder"), r.client(t, "outsider")
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	if _, err := admin.ImportLayer(ctx, "base:1", dsecv1.LayerKind_LAYER_KIND_BASE, "/base", nil); err != nil {
		t.Fatal(err)
	}
	_, err := admin.CreateProject(ctx, "build/task")
	must("create build/task", err)
	_, err = builder.ImportLayer(ctx, "task:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/task", &dsec.LayerOptions{Project: "build/task"})
	must("import task:1 into build/task", err)
	_, err = builder.ShareLayer(ctx, "task:1", "other")
	must("share task:1 with other", err)
	_, err = outsider.ImportLayer(ctx, "theirs:1", dsecv1.LayerKind_LAYER_KIND_WORKSPACE, "/theirs", nil)
	must("import theirs:1", err)
	_, err = outsider.ShareLayer(ctx, "theirs:1", "build/task")
	must("share theirs:1 with build/task", err)

	err = admin.DeleteProject(ctx, "build/task")
	if !errors.Is(err, dsec.ErrFailedPrecondition) || !strings.Contains(err.Error(), "the project is in use: 1 layer (task:1)") {
		t.Fatalf("delete a project owning a layer: %v; want FailedPrecondition naming task:1", err)
	}
	// A warm pool of the project refuses it even with its objects handed on.
	_, err = builder.SetWarmPool(ctx, "base:1", 1, &dsec.CreateOptions{Labels: map[string]string{iam.ProjectLabel: "build/task"}})
	must("a warm pool of build/task", err)
	err = admin.DeleteProjectWith(ctx, "build/task", dsec.DeleteProjectOptions{ObjectsToParent: true})
	if !errors.Is(err, dsec.ErrFailedPrecondition) || !strings.Contains(err.Error(), "warm pool") {
		t.Fatalf("delete a project a warm pool serves: %v; want FailedPrecondition naming the pool", err)
	}
	_, err = builder.SetWarmPool(ctx, "base:1", 0, &dsec.CreateOptions{Labels: map[string]string{iam.ProjectLabel: "build/task"}})
	must("remove the warm pool", err)

	must("delete build/task, its objects to build",
		admin.DeleteProjectWith(ctx, "build/task", dsec.DeleteProjectOptions{ObjectsToParent: true}))
	ls, err := builder.ListLayers(ctx)
	must("builder lists", err)
	i := slices.IndexFunc(ls, func(l *dsecv1.Layer) bool { return slices.Contains(l.GetRefs(), "task:1") })
	if i < 0 || ls[i].GetProject() != "build" || !slices.Equal(ls[i].GetSharedWith(), []string{"other"}) {
		t.Fatalf("task:1 after its project's delete: %v; want build's, shared with other", ls)
	}
	qs, err := admin.Quota(ctx, "build")
	must("Quota", err)
	for _, it := range qs[0].Items {
		if it.Resource == "layer_bytes" && it.Used != memLayerSize {
			t.Fatalf("build's layer_bytes %d, want %d (task:1, handed to it)", it.Used, memLayerSize)
		}
	}
	// The share with the deleted project went with it: a project made
	// again at its path does not see theirs:1.
	_, err = admin.CreateProject(ctx, "build/task")
	must("create build/task again", err)
	ls, err = outsider.ListLayers(ctx)
	must("outsider lists", err)
	for _, l := range ls {
		if slices.Contains(l.GetRefs(), "theirs:1") && len(l.GetSharedWith()) != 0 {
			t.Fatalf("theirs:1 still shared with %v after build/task's delete", l.GetSharedWith())
		}
	}
	must("remove task:1 as build's", builder.RemoveLayer(ctx, "task:1"))
	qs, err = admin.Quota(ctx, "build")
	must("Quota", err)
	for _, it := range qs[0].Items {
		if it.Resource == "layer_bytes" && it.Used != 0 {
			t.Fatalf("build's layer_bytes %d after task:1's removal, want 0", it.Used)
		}
	}
	must("delete the emptied build/task", admin.DeleteProject(ctx, "build/task"))
}

// TestObjectsPython runs sdk/python/tests/test_objects.py: the Python
// SDK's layer and snapshot calls with projects and shares.
func TestObjectsPython(t *testing.T) {
	py := testutil.RequireCommand(t, "python3")
	r := startObjectRig(t, filepath.Join(t.TempDir(), "meta.db"))
	if _, err := r.client(t, "admin").ImportLayer(t.Context(), "base:1", dsecv1.LayerKind_LAYER_KIND_BASE, "/base", nil); err != nil {
		t.Fatal(err)
	}
	tests := filepath.Join(testutil.RepoRoot(), "sdk", "python", "tests")
	cmd := exec.CommandContext(t.Context(), py, "-m", "unittest", "-v", "test_objects")
	cmd.Dir = tests
	cmd.Env = append(os.Environ(), "DSEC_TEST_OBJ_ADDR="+r.url, "DSEC_TEST_OBJ_ADMIN="+r.tokens["admin"], "DSEC_TEST_OBJ_BUILDER="+r.tokens["builder"],
		"DSEC_TEST_OBJ_RUNNER="+r.tokens["runner"], "DSEC_TEST_OBJ_RUN_BUILDER="+r.tokens["run-builder"], "DSEC_TOKEN_FILE=")
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("OK")) || bytes.Contains(out, []byte("skipped")) {
		t.Fatalf("python3 -m unittest test_objects: %v\n%s", err, out)
	}
}

// TestObjectRemovedWhileMade: a name removed while the call making it is
// still at work (dsec layer rm or snapshot rm, which nameBusy suggests to
// free a name a dead call holds, forgets a record no node holds yet) ends
// that call with an error and without what it made: before, the layer
// stayed on the node with no record, the root's by default, charged to no
// one and no longer the project's to remove.
func TestObjectRemovedWhileMade(t *testing.T) {
	r := startObjectRig(t, filepath.Join(t.TempDir(), "meta.db"))
	ctx := t.Context()
	builder := r.client(t, "builder")
	arrived, release := make(chan struct{}), make(chan struct{})
	r.layers.mu.Lock()
	r.layers.importing = func(ref string) {
		close(arrived)
		<-release
	}
	r.layers.mu.Unlock()
	made := make(chan error, 1)
	go func() {
		_, err := builder.ImportLayer(ctx, "env:2", dsecv1.LayerKind_LAYER_KIND_BASE, "/env", nil)
		made <- err
	}()
	select {
	case <-arrived:
	case err := <-made:
		close(release)
		t.Fatalf("the import of env:2 ended before it reached the node: %v", err)
	}
	rmErr := builder.RemoveLayer(ctx, "env:2")
	close(release)
	err := <-made
	if rmErr != nil {
		t.Fatalf("remove env:2 while it is made: %v", rmErr)
	}
	if err == nil {
		t.Error("the import of env:2, removed while it was made, succeeded")
	}
	if r.layers.has("env:2") {
		t.Fatalf("the node holds env:2 after its record was removed while it was made (import: %v): a layer of no project's", err)
	}
	if _, err := r.st.Object(ctx, "env:2"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("the record of env:2: %v, want none", err)
	}
}

// TestImageNotCounted: an image import whose layers cannot be counted
// afterwards (a node stopped answering ListLayers) fails and leaves
// nothing behind: a new name's image and record go, an overwrite's
// staging ref goes and the version before is kept. Before, the new
// image stayed on the node with an empty record (charged nothing), and
// an overwrite's staging ref stayed on the nodes for ever.
func TestImageNotCounted(t *testing.T) {
	r := startObjectRig(t, filepath.Join(t.TempDir(), "meta.db"))
	ctx := t.Context()
	builder := r.client(t, "builder")
	if _, err := builder.ImportImage(ctx, "img:1", "oci:/img", nil); err != nil {
		t.Fatal(err)
	}
	r.layers.mu.Lock()
	r.layers.imported = func() { r.layers.listFails.Store(true) }
	r.layers.mu.Unlock()
	staged := func() []string {
		r.layers.mu.Lock()
		defer r.layers.mu.Unlock()
		var out []string
		for name, l := range r.layers.layers {
			for _, ref := range append(slices.Clone(l.Images), name) {
				if strings.Contains(ref, stagingPrefix) {
					out = append(out, ref)
				}
			}
		}
		return out
	}

	if _, err := builder.ImportImage(ctx, "img:2", "oci:/img", nil); err == nil {
		t.Fatal("importing img:2, its layers not countable: no error")
	}
	r.layers.listFails.Store(false)
	if r.layers.has("img:2") {
		t.Error("the node holds img:2 after its import failed")
	}
	if _, err := r.st.Object(ctx, "img:2"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("the record of img:2 after its import failed: %v, want none", err)
	}

	if _, err := builder.ImportImage(ctx, "img:1", "oci:/img-b", nil); err == nil {
		t.Fatal("overwriting img:1, its layers not countable: no error")
	}
	r.layers.listFails.Store(false)
	if s := staged(); len(s) > 0 {
		t.Errorf("staging refs left on the node after a failed overwrite of img:1: %v", s)
	}
	if o, err := r.st.Object(ctx, "img:1"); err != nil || len(o.Blobs) != 1 || o.Writer != "" {
		t.Errorf("the record of img:1 after a failed overwrite: %+v, %v; want its version before, no writer", o, err)
	}
}
