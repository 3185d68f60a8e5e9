package sandbox

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Snapshots is what the edge needs to turn a packed writable layer into a
// layer every node can start sandboxes on. *layers.Service implements it.
type Snapshots interface {
	// HasRef reports whether a layer is named ref.
	HasRef(ref string) bool
	// StagePath is where the layer file of snapshot name is built: on the
	// layer store's file system, so AddSnapshot moves it in by rename, and
	// where a restarted node removes what a killed one left.
	StagePath(name string) string
	// AddSnapshot adds the EROFS file, built at StagePath, as layer ref of
	// kind snapshot (taking the file: it is moved, not copied), records
	// info with it, and publishes it to the blob store.
	AddSnapshot(ctx context.Context, ref, file string, info *dsecv1.SnapshotInfo) error
}

var snapshotName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$`)

// SnapshotLayer is the ref of snapshot name's layer.
func SnapshotLayer(name string) string { return "snap:" + name }

// Snapshot captures sandbox id's writable layer and publishes it as layer
// snap:NAME, keeping the changes sel selects (snapshot.Select: include,
// exclude, trusted; see snapshot.PackOptions). The sandbox stands still
// only while its upper is captured (a btrfs snapshot, a reflink walk or a
// copy); the layer is built afterwards while it runs on. A paused sandbox is
// resumed first, as for any call that runs in it.
func (m *Manager) Snapshot(ctx context.Context, id, name string, sel snapshot.Select) (*dsecv1.SnapshotInfo, error) {
	if m.snaps == nil {
		return nil, fmt.Errorf("snapshot: node %s keeps no layers: %w", m.cfg.Node, errdefs.ErrNotSupported)
	}
	if !snapshotName.MatchString(name) {
		return nil, fmt.Errorf("snapshot name %q: letters, digits and . _ - only, at most 100, starting with a letter or digit: %w", name, errdefs.ErrInvalidArgument)
	}
	if err := sel.Check(); err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", name, err)
	}
	ref := SnapshotLayer(name)
	if m.snaps.HasRef(ref) {
		return nil, fmt.Errorf("snapshot %s: a layer is named %s already: %w", name, ref, errdefs.ErrAlreadyExists)
	}
	if sb, err := m.lookup(id); err != nil {
		return nil, err
	} else if _, _, err := m.snapshotter(sb); err != nil {
		return nil, fmt.Errorf("snapshot %s of %s: %w", name, id, err)
	}
	var sb *sandbox
	if err := m.use(ctx, id, func(s *sandbox) error { sb = s; return nil }); err != nil {
		return nil, err
	}
	tree, rec, frozen, err := m.capture(ctx, sb, name)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := tree.Remove(); err != nil {
			m.log.Warn("remove snapshot capture", "snapshot", name, "err", err)
		}
	}()

	// The layers below are mounted for the snapshot on their own: the
	// sandbox may go while its layer is built.
	job := id + ".snap." + name
	defer m.images.Release(context.WithoutCancel(ctx), job)
	var lower []string
	for _, d := range rec.GetLayerDigests() {
		l, err := m.images.Mount(ctx, job, d)
		if err != nil {
			return nil, fmt.Errorf("snapshot %s: mount layer %s: %w", name, d, err)
		}
		if l.Dir == "" {
			return nil, fmt.Errorf("snapshot %s: layer %s is not mounted on the host", name, d)
		}
		lower = append(lower, l.Dir)
	}
	// Built beside the layer store rather than the capture: the move in
	// is then a rename, and mkfs.erofs writes to the store's file system
	// instead of the sandboxes' upper one (a loop-mounted btrfs on some
	// nodes, where writing the file took twice as long).
	out := m.snaps.StagePath(name)
	packed, err := snapshot.Pack(ctx, tree, out, snapshot.PackOptions{Lower: lower, Exclude: sel.Exclude, Include: sel.Include, Trusted: sel.Trusted})
	if err != nil {
		return nil, fmt.Errorf("snapshot %s of %s: %w", name, id, err)
	}
	defer os.Remove(out) // moved away on success
	info := &dsecv1.SnapshotInfo{
		Name: name, Layer: ref, Environment: rec.GetSpec().GetEnvironment() + "+" + ref,
		Digest: packed.Digest, Size: packed.Size, SourceSandbox: id, Node: m.cfg.Node,
		CreatedUnixMs: time.Now().UnixMilli(), FrozenUs: frozen.Microseconds(),
		CaptureMethod: string(tree.Method), PackMs: packed.Took.Milliseconds(),
		Excluded: packed.Excluded, Warnings: packed.Warnings,
		Included: packed.Included, Cleared: packed.Cleared,
	}
	if err := m.snaps.AddSnapshot(ctx, ref, packed.File, info); err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", name, err)
	}
	m.cfg.Events.Add(eventlog.Snapshot, id, rec.GetSpec().GetLabels()[iam.ProjectLabel], "", ref)
	m.cfg.Ledger.AddSnapshot(id, packed.Size)
	m.log.Info("snapshot taken", "id", id, "snapshot", name, "digest", packed.Digest, "frozen", frozen,
		"method", tree.Method, "entries", packed.Entries, "pack", packed.Took, "build", packed.Build)
	return info, nil
}

// capture freezes the running sandbox, has its runtime capture its
// writable layer and thaws it, as one transition: a pause, resume
// or stop meanwhile waits. It returns the capture, the sandbox's record and
// how long it stood still.
func (m *Manager) capture(ctx context.Context, sb *sandbox, name string) (*snapshot.Tree, *dsecv1.Sandbox, time.Duration, error) {
	ctx = context.WithoutCancel(ctx) // a frozen sandbox must be thawed
	sb.op.Lock()
	defer sb.op.Unlock()
	sb.mu.Lock()
	rec := cloneRec(sb.rec)
	v := decide(sb.phaseOf(), callUse)
	sb.mu.Unlock()
	if v != allow {
		// Paused or stopped since use() looked.
		return nil, nil, 0, fmt.Errorf("snapshot %s: %w", name, refusal(rec, refuseGone, callUse))
	}
	id := rec.GetId()
	pz, sn, err := m.snapshotter(sb)
	if err != nil {
		return nil, nil, 0, err
	}
	start := time.Now()
	if err := pz.Freeze(ctx, id); err != nil {
		return nil, nil, 0, fmt.Errorf("snapshot %s of %s: %w", name, id, err)
	}
	tree, cerr := sn.Capture(ctx, id, name)
	terr := pz.Thaw(ctx, id)
	frozen := time.Since(start)
	if terr != nil {
		m.log.Error("thaw after a snapshot's capture failed: the sandbox stays frozen", "id", id, "err", terr)
	}
	if cerr != nil {
		return nil, nil, 0, fmt.Errorf("snapshot %s of %s: %w", name, id, cerr)
	}
	return tree, rec, frozen, nil
}

// Lay captures sandbox id's writable layer as Snapshot does and lays the
// paths sel.Include names into running sandbox room of this node
// (snapshot.Lay) instead of packing a layer: a grade's capture laid into a
// clean room started ahead on the source's layers (a grade pool's), so the
// grade pays neither a layer's build nor a create. The room must run on
// the source's layers and have a root file system the host sees (a
// container under runc or crun; anything else is ErrNotSupported, and the
// grade packs a layer instead). The digest of what was laid is kept in the
// room's record (laid_digest), so its node can vouch for the workspace
// the room's grader ran on; sel.Files (the grade's tests and reward file)
// are written into the room then (snapshot.WriteFiles), outside that
// digest. The returned SnapshotInfo names no layer.
func (m *Manager) Lay(ctx context.Context, id, room, name string, sel snapshot.Select) (*dsecv1.SnapshotInfo, error) {
	if len(sel.Include) == 0 {
		return nil, fmt.Errorf("lay %s of %s: include names no path: %w", name, id, errdefs.ErrInvalidArgument)
	}
	if !snapshotName.MatchString(name) {
		return nil, fmt.Errorf("capture name %q: letters, digits and . _ - only, at most 100, starting with a letter or digit: %w", name, errdefs.ErrInvalidArgument)
	}
	if err := sel.Check(); err != nil {
		return nil, fmt.Errorf("lay %s: %w", name, err)
	}
	if sb, err := m.lookup(id); err != nil {
		return nil, err
	} else if _, _, err := m.snapshotter(sb); err != nil {
		return nil, fmt.Errorf("lay %s of %s: %w", name, id, err)
	}
	rsb, err := m.lookup(room)
	if err != nil {
		return nil, fmt.Errorf("lay %s of %s into %s: %w", name, id, room, err)
	}
	in, ok := rsb.rt.(backend.Inspector)
	if !ok {
		return nil, fmt.Errorf("lay %s into %s: its runtime shows the host no root file system: %w", name, room, errdefs.ErrNotSupported)
	}
	root, _, err := in.Root(ctx, room)
	if err != nil {
		return nil, fmt.Errorf("lay %s into %s: %w", name, room, err)
	}
	var sb *sandbox
	if err := m.use(ctx, id, func(s *sandbox) error { sb = s; return nil }); err != nil {
		return nil, err
	}
	srcLayers := sb.record().GetLayerDigests()
	roomRec := rsb.record()
	if !slices.Equal(srcLayers, roomRec.GetLayerDigests()) {
		return nil, fmt.Errorf("lay %s of %s into %s: the room runs on layers %v, the sandbox on %v: %w",
			name, id, room, roomRec.GetLayerDigests(), srcLayers, errdefs.ErrFailedPrecondition)
	}
	opts := snapshot.PackOptions{Include: sel.Include, Exclude: sel.Exclude, Trusted: sel.Trusted}
	var (
		laid   snapshot.Laid
		rec    *dsecv1.Sandbox
		frozen time.Duration
		method snapshot.Method
	)
	if upper, ok := m.liveUpper(sb); ok {
		// The source's writable layer is read where it is while the
		// source stands still: a workspace of a few files is laid in
		// less time than a btrfs snapshot of the whole layer commits.
		method = snapshot.MethodFrozen
		rec, frozen, err = m.standStill(ctx, sb, name, func() error {
			laid, err = snapshot.Lay(ctx, snapshot.NewTree(upper, method, 0, func() error { return nil }), root, opts)
			return err
		})
	} else {
		var tree *snapshot.Tree
		tree, rec, frozen, err = m.capture(ctx, sb, name)
		if err != nil {
			return nil, err
		}
		method = tree.Method
		laid, err = snapshot.Lay(ctx, tree, root, opts)
		if rerr := tree.Remove(); rerr != nil {
			m.log.Warn("remove capture", "capture", name, "err", rerr)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("lay %s of %s into %s: %w", name, id, room, err)
	}
	if len(sel.Files) > 0 {
		if err := snapshot.WriteFiles(root, sel.Files); err != nil {
			return nil, fmt.Errorf("lay %s into %s: %w", name, room, err)
		}
	}
	rsb.mu.Lock()
	if !rsb.gone.IsZero() || !Live(rsb.rec.GetState()) {
		rsb.mu.Unlock()
		return nil, fmt.Errorf("lay %s into %s: %w", name, room, GoneError(rsb.rec))
	}
	rsb.rec.LaidDigest = laid.Digest
	m.save(rsb.rec)
	rsb.mu.Unlock()
	m.log.Info("capture laid", "id", id, "room", room, "capture", name, "digest", laid.Digest, "frozen", frozen,
		"method", method, "entries", laid.Entries, "took", laid.Took)
	return &dsecv1.SnapshotInfo{
		Name: name, Environment: roomRec.GetSpec().GetEnvironment(),
		Digest: laid.Digest, Size: laid.Bytes, SourceSandbox: rec.GetId(), Node: m.cfg.Node,
		CreatedUnixMs: time.Now().UnixMilli(), FrozenUs: frozen.Microseconds(),
		CaptureMethod: string(method), PackMs: laid.Took.Milliseconds(),
		Warnings: laid.Warnings, Included: laid.Included, Cleared: laid.Cleared,
	}, nil
}

// liveUpper is sb's writable layer where the host sees it live (a
// container's overlay upper dir), for a capture read in place while sb is
// frozen.
func (m *Manager) liveUpper(sb *sandbox) (string, bool) {
	in, ok := sb.rt.(backend.Inspector)
	if !ok {
		return "", false
	}
	upper, err := in.Upper(sb.record().GetId())
	return upper, err == nil
}

// standStill runs f while sb stands still, as capture does: frozen, f, thawed,
// one transition (a pause, resume or stop meanwhile waits). It returns
// sb's record and how long it stood still.
func (m *Manager) standStill(ctx context.Context, sb *sandbox, name string, f func() error) (*dsecv1.Sandbox, time.Duration, error) {
	ctx = context.WithoutCancel(ctx) // a frozen sandbox must be thawed
	sb.op.Lock()
	defer sb.op.Unlock()
	sb.mu.Lock()
	rec := cloneRec(sb.rec)
	v := decide(sb.phaseOf(), callUse)
	sb.mu.Unlock()
	if v != allow {
		return nil, 0, fmt.Errorf("capture %s: %w", name, refusal(rec, refuseGone, callUse))
	}
	id := rec.GetId()
	pz, err := m.pauser(sb)
	if err != nil {
		return nil, 0, err
	}
	start := time.Now()
	if err := pz.Freeze(ctx, id); err != nil {
		return nil, 0, fmt.Errorf("capture %s of %s: %w", name, id, err)
	}
	ferr := f()
	terr := pz.Thaw(ctx, id)
	took := time.Since(start)
	if terr != nil {
		m.log.Error("thaw after a capture failed: the sandbox stays frozen", "id", id, "err", terr)
	}
	if ferr != nil {
		return nil, 0, ferr
	}
	return rec, took, nil
}
