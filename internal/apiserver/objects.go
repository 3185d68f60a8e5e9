package apiserver

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// Layers, images and snapshots belong to projects (docs/iam.md, "Layers,
// images, snapshots and pools"). The metadata store records each by the
// name an environment gives it (store.Objects) with its project, the bytes
// charged for it and the projects it is shared with; the edges and the
// blob store keep the bytes and know nothing of projects. The rules:
//
//   - an object is seen and used (listed, named in an environment, forked
//     from) from its project and everything under it, from every project
//     it is shared with and everything under those, and from the projects
//     above it; the root's objects (and a name no record holds, made
//     before objects were recorded) are seen and used by everyone;
//   - it is removed, overwritten and shared by a builder of its project;
//   - one a caller cannot see answers NotFound, whatever the call.
//
// Warm pools carry their project as sandboxes do, in the spec's
// ProjectLabel (warmpool.go).

// objectScoped are the operations the interceptor cannot decide on the
// token's project, since they name their object's project: it checks that
// the token holds the role somewhere, and the handler decides on the
// object's project.
var objectScoped = map[string]bool{
	"/dsec.v1.LayerService/ImportLayer":      true,
	"/dsec.v1.LayerService/UploadLayer":      true,
	"/dsec.v1.LayerService/ImportImage":      true,
	"/dsec.v1.LayerService/RemoveLayer":      true,
	"/dsec.v1.LayerService/ShareLayer":       true,
	"/dsec.v1.SandboxService/Snapshot":       true,
	"/dsec.v1.SandboxService/DeleteSnapshot": true,
	"/dsec.v1.SandboxService/SetWarmPool":    true,
}

// reaches reports whether a holds need on some project: its token's role
// is need or more, and so is a binding on the token's project, above it or
// under it.
func reaches(a iam.Authority, need iam.Role) bool {
	if a.Node {
		return true
	}
	if a.Role < need {
		return false
	}
	for _, b := range a.Bindings {
		if b.Role >= need && (iam.Within(b.Project, a.Project) || iam.Within(a.Project, b.Project)) {
			return true
		}
	}
	return false
}

// allowSomewhere is the interceptor's check of an object-scoped operation.
func allowSomewhere(a iam.Authority, op iam.Op) error {
	need, ok := iam.Need(op)
	if !ok {
		return fmt.Errorf("operation %s has no role in the IAM table: %w", op, errdefs.ErrPermissionDenied)
	}
	if !reaches(a, need) {
		return fmt.Errorf("%s needs %s on the project it names, token %s of %s holds %s: %w",
			op, need, a.TokenID, a.Principal, min(a.Role, a.On(a.Project)), errdefs.ErrPermissionDenied)
	}
	return nil
}

// objectName is ref as the store records it: name:tag (":latest" when the
// tag is left out), snap:NAME; a digest is kept as it is.
func objectName(ref string) string {
	ref = strings.TrimSpace(ref)
	if ref == "" || strings.HasPrefix(ref, "sha256:") {
		return ref
	}
	if i := strings.LastIndex(ref, ":"); i < 0 || strings.Contains(ref[i:], "/") {
		return ref + ":latest"
	}
	return ref
}

// kindOf is the kind of object a name is: snap:NAME a snapshot, else def.
func kindOf(name, def string) string {
	if strings.HasPrefix(name, "snap:") {
		return store.ObjectSnapshot
	}
	return def
}

// caller is the call's authority, and whether it must be checked: false
// for the node's administrator, a call without the interceptor, or a token
// whose role on the root is need or more.
func caller(ctx context.Context, need iam.Role) (iam.Authority, bool) {
	a, found := iam.AuthorityFrom(ctx)
	if !found || a.Node || a.On("") >= need {
		return a, false
	}
	return a, true
}

// sees reports whether a may see (list, use) o.
func sees(a iam.Authority, o store.Object) bool {
	if strings.HasPrefix(o.Name, stagingPrefix) {
		return false // an overwrite under way: not yet anyone's to use
	}
	if o.Project == "" || a.On(o.Project) >= iam.Viewer {
		return true
	}
	for _, p := range o.SharedWith {
		if a.On(p) >= iam.Viewer || iam.Within(a.Project, p) {
			return true
		}
	}
	return false
}

// what names an object kind for messages.
func what(kind string) string {
	if kind == "" {
		return "layer"
	}
	return kind
}

// hiddenObject is what a caller who may not see an object is told.
func hiddenObject(kind, name string) error {
	return fmt.Errorf("no %s %s: %w", what(kind), name, errdefs.ErrNotFound)
}

// object returns the record of name; a name without one is the root's
// (found false).
func (s *Server) object(ctx context.Context, name string) (o store.Object, found bool, err error) {
	if s.cfg.Objects == nil {
		return store.Object{Name: name}, false, nil
	}
	o, err = s.cfg.Objects.Object(ctx, name)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return store.Object{Name: name}, false, nil
	case err != nil:
		return store.Object{}, false, err
	}
	return o, true, nil
}

// objectTTL is how long a create may decide on a record read before: a
// share taken away reaches the creates of every apiserver within it.
const objectTTL = time.Second

// objectCache keeps the records creates read (a create by a token
// without a root-wide role reads one per part of its environment), for
// objectTTL; a change this apiserver makes drops the name at once.
type objectCache struct {
	mu sync.Mutex
	m  map[string]objectEntry
}

type objectEntry struct {
	o     store.Object
	found bool
	at    time.Time
}

const maxCachedObjects = 1 << 16

func (c *objectCache) get(name string, now time.Time) (objectEntry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[name]
	return e, ok && now.Sub(e.at) < objectTTL
}

func (c *objectCache) put(name string, e objectEntry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || len(c.m) >= maxCachedObjects {
		c.m = map[string]objectEntry{}
	}
	c.m[name] = e
}

func (c *objectCache) drop(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.m, name)
}

// cachedObject is object, through the cache.
func (s *Server) cachedObject(ctx context.Context, name string) (store.Object, error) {
	now := time.Now()
	if e, ok := s.objects.get(name, now); ok {
		return e.o, nil
	}
	o, found, err := s.object(ctx, name)
	if err != nil {
		return store.Object{}, err
	}
	s.objects.put(name, objectEntry{o: o, found: found, at: now})
	return o, nil
}

// manage decides whether the caller may remove, overwrite or share the
// object called name (kind for messages): NotFound when it cannot see it,
// PermissionDenied when it sees it read-only. It returns the record.
func (s *Server) manage(ctx context.Context, kind, name string) (store.Object, bool, error) {
	o, found, err := s.object(ctx, name)
	if err != nil {
		return o, found, err
	}
	a, check := caller(ctx, iam.Builder)
	if !check {
		return o, found, nil
	}
	if !sees(a, o) {
		return o, found, hiddenObject(kind, name)
	}
	if !found {
		// The root's, or no object at all: say which.
		if exists, err := s.nameExists(ctx, name); err != nil || !exists {
			if err == nil {
				err = hiddenObject(kind, name)
			}
			return o, found, err
		}
	}
	if have := a.On(o.Project); have < iam.Builder {
		return o, found, fmt.Errorf("%s %s of project %s is read-only to token %s of %s (it holds %s there; removing, overwriting and sharing need builder): %w",
			what(kind), name, iam.Display(o.Project), a.TokenID, a.Principal, have, errdefs.ErrPermissionDenied)
	}
	return o, found, nil
}

// targetProject is the project a new object goes to: named (a path), else
// the token's; the caller must hold builder there (NotFound for a project
// it cannot see).
func targetProject(ctx context.Context, op iam.Op, named string) (string, error) {
	a, found := iam.AuthorityFrom(ctx)
	project := ""
	if found {
		project = a.Project
	}
	if named != "" {
		p, err := iam.CleanPath(named)
		if err != nil {
			return "", err
		}
		project = p
	}
	if !found {
		return project, nil
	}
	if err := iam.Allow(a, op, project); err != nil {
		if errors.Is(err, errdefs.ErrPermissionDenied) && a.On(project) < iam.Viewer {
			return "", fmt.Errorf("project %s: %w", iam.Display(project), errdefs.ErrNotFound)
		}
		return "", err
	}
	return project, nil
}

// claim is an object a call is about to make or overwrite under name in
// project, recorded before the edges make it so that two projects never
// make one name. The call is the record's one writer (store.Object.Writer)
// until done or fail, so that two calls never make one name at once,
// whichever apiservers serve them. Its done records the bytes made and
// charges them; fail forgets a name the call claimed anew.
type claim struct {
	s       *Server
	o       store.Object // with the blobs it held when claimed
	claimed bool         // the record is this call's
	writer  string       // this call's claim of the record, "" for none
	staged  string       // the ref the new version is made under, for an overwrite
	stop    func()       // ends the renewal of the claim
}

// claimLife is how long a call without a deadline holds its claim of a
// name past its last renewal: it renews the claim each claimLife/4 while
// it runs, so a call that died (its apiserver killed) holds the name at
// most claimLife longer. A call with a deadline holds it until its
// deadline and holdMargin, as a quota hold.
const claimLife = 2 * time.Minute

// claimUntil is when a claim made now for the call of ctx lapses, and
// whether the call must renew it.
func claimUntil(ctx context.Context) (time.Time, bool) {
	if d, ok := ctx.Deadline(); ok {
		return d.Add(holdMargin), false
	}
	return time.Now().Add(claimLife), true
}

// stagingPrefix begins the refs an overwrite is made under until its
// charge is taken (see stage); no caller may name one.
const stagingPrefix = "dsec-staging/"

// stage returns the ref the edges are to make the object under: for an
// overwrite of a name recorded already, a staging ref of its own, so that
// the name keeps its old version, whole, until done has charged the new
// one (in the transaction that gives back what the old one alone held) and
// moved the name onto it; else ref itself.
func (c *claim) stage(ref string) string {
	if c.s.cfg.Objects == nil || c.claimed || c.o.Name == "" || c.o.Kind == store.ObjectSnapshot {
		return ref
	}
	c.staged = stagingRef(c.writer)
	return c.staged
}

// stagingRef is the staging ref of the call whose claim of a name is
// writer: named after the claim, so that a staging ref is known as a dead
// call's once its claim has lapsed or gone (dropStaging, sweepStaging).
func stagingRef(writer string) string {
	return stagingPrefix + writer[strings.LastIndex(writer, "/")+1:] + ":1"
}

// dropStaging removes from every node the staging ref ref of a call, if
// the call made it: the call died (its apiserver killed)
// before it moved the name onto it or removed it.
func (s *Server) dropStaging(ctx context.Context, ref string) {
	_, err := (&layerService{s: s}).removeLayer(context.WithoutCancel(ctx), connect.NewRequest(&dsecv1.RemoveLayerRequest{Ref: ref}))
	switch {
	case err == nil:
		s.log.Info("removed the staging ref of a call that died", "ref", ref)
	case !errors.Is(err, errdefs.ErrNotFound):
		s.log.Warn("remove the staging ref of a call that died", "ref", ref, "err", err)
	}
}

// sweepStaging removes the staging refs among layers (read before ix)
// whose call's claim is neither in ix nor live: calls that died before
// they were done. A call that finished between the two reads moved or
// removed its ref already (the node answers NotFound).
func (s *Server) sweepStaging(ctx context.Context, ix objectIndex, layers []*dsecv1.Layer) {
	live := map[string]bool{}
	now := time.Now()
	for _, o := range ix {
		if o.Writer != "" && now.Before(o.WriterUntil) {
			live[stagingRef(o.Writer)] = true
		}
	}
	for _, l := range layers {
		for _, name := range layerNames(l) {
			if strings.HasPrefix(name, stagingPrefix) && !live[name] {
				s.dropStaging(ctx, name)
			}
		}
	}
}

// made is the ref the edges made the object under: the staging ref, or
// the name.
func (c *claim) made() string {
	if c.staged != "" {
		return c.staged
	}
	return c.o.Name
}

// claimObject records name (of kind) for project before the call makes
// it, the call its one writer. A name of another project is refused:
// AlreadyExists when the caller cannot see it (names are one namespace),
// PermissionDenied when it sees it read-only. A name without a record
// that the edges already hold is the root's, overwritten by the root's
// builders only. A name its project's record holds is taken for the call
// (an overwrite) unless another call is making it and its claim is live:
// FailedPrecondition, to try again once that call is done (AlreadyExists
// for a snapshot, which is not taken again under its name; see
// snapshotTaken); a claim past its deadline is a call that died, and is
// taken over. A record removed between the claim and the take (a
// removal, or the sweep of a dead call's record, sweepObjects) leaves the
// name free: it is claimed again, once.
func (s *Server) claimObject(ctx context.Context, kind, name, project string) (*claim, error) {
	c, err := s.claimObjectOnce(ctx, kind, name, project)
	if _, gone := errors.AsType[recordGone](err); gone {
		c, err = s.claimObjectOnce(ctx, kind, name, project)
	}
	return c, err
}

// recordGone is claimObjectOnce's error for a record removed between its
// claim and its take.
type recordGone struct{ error }

func (e recordGone) Unwrap() error { return e.error }

func (s *Server) claimObjectOnce(ctx context.Context, kind, name, project string) (*claim, error) {
	if strings.HasPrefix(name, stagingPrefix) {
		return nil, fmt.Errorf("%s %s: names beginning %s are the apiserver's own (an overwrite is made under one): %w", what(kind), name, stagingPrefix, errdefs.ErrInvalidArgument)
	}
	if s.cfg.Objects == nil || name == "" {
		return &claim{s: s}, nil
	}
	writer := fmt.Sprintf("%s/%016x", s.cfg.Name, rand.Uint64())
	until, renew := claimUntil(ctx)
	o, claimed, err := s.cfg.Objects.ClaimObject(ctx, store.Object{Name: name, Kind: kind, Project: project, Writer: writer, WriterUntil: until})
	if err != nil {
		return nil, err
	}
	s.objects.drop(name)
	c := &claim{s: s, o: o, claimed: claimed, stop: func() {}}
	if claimed {
		c.writer = writer
	}
	if !claimed && o.Project != project {
		a, _ := iam.AuthorityFrom(ctx)
		if !sees(a, o) {
			return nil, fmt.Errorf("%s %s: the name is taken by another project: %w", what(kind), name, errdefs.ErrAlreadyExists)
		}
		return nil, fmt.Errorf("%s %s belongs to project %s, not %s: remove it there first, or name another: %w",
			what(kind), name, iam.Display(o.Project), iam.Display(project), errdefs.ErrAlreadyExists)
	}
	if claimed && project != "" {
		exists, err := s.nameExists(ctx, name)
		if err == nil && exists {
			err = fmt.Errorf("%s %s belongs to the root project, read-only to project %s: %w", what(kind), name, iam.Display(project), errdefs.ErrPermissionDenied)
		}
		if err != nil {
			c.fail(ctx)
			return nil, err
		}
	}
	if !claimed {
		if o.Writer != "" && time.Now().Before(o.WriterUntil) {
			return nil, nameBusy(o)
		}
		if kind == store.ObjectSnapshot {
			if err := s.snapshotTaken(ctx, o); err != nil {
				return nil, err
			}
		}
		taken, err := s.cfg.Objects.TakeObject(ctx, name, writer, until)
		if errors.Is(err, errdefs.ErrFailedPrecondition) {
			return nil, nameBusy(taken)
		}
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, recordGone{fmt.Errorf("%s %s was removed while this call took it; try again: %w", what(kind), name, errdefs.ErrFailedPrecondition)}
		}
		if err != nil {
			return nil, err
		}
		if taken.Writer != "" {
			s.log.Info("take over a name whose call's claim lapsed", "name", name, "writer", taken.Writer, "until", taken.WriterUntil)
			s.dropStaging(ctx, stagingRef(taken.Writer))
		}
		c.o, c.writer = taken, writer
		s.objects.drop(name)
	}
	if renew {
		c.stop = c.renew(ctx, until, claimLife/4)
	}
	return c, nil
}

// nameBusy refuses a name another call is making: FailedPrecondition (the
// caller tries again once it is done), AlreadyExists for a snapshot.
func nameBusy(o store.Object) error {
	if o.Kind == store.ObjectSnapshot {
		return fmt.Errorf("snapshot %s is being taken by another call (a call that stopped before it was done holds the name until %s: delete it to free the name now): %w",
			strings.TrimPrefix(o.Name, "snap:"), o.WriterUntil.UTC().Format(time.TimeOnly), errdefs.ErrAlreadyExists)
	}
	again := " again"
	if len(o.Blobs) == 0 {
		again = ""
	}
	return fmt.Errorf("%s %s is being made%s by another call; try again (a call that stopped before it was done holds the name until %s UTC): %w",
		what(o.Kind), o.Name, again, o.WriterUntil.UTC().Format(time.TimeOnly), errdefs.ErrFailedPrecondition)
}

// renew renews c's claim each every while the call of ctx runs, until the
// returned stop is called. stop ends a renewal under way (its context is
// cancelled) and returns once none can follow, so that the release after
// it is the claim's last word: a renewal that landed after the release
// held the name for claimLife more.
func (c *claim) renew(ctx context.Context, until time.Time, every time.Duration) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			next := time.Now().Add(claimLife)
			if _, err := c.s.cfg.Objects.TakeObject(ctx, c.o.Name, c.writer, next); err != nil {
				if ctx.Err() != nil {
					return
				}
				c.s.log.Warn("renew the claim of a name", "name", c.o.Name, "until", until, "err", err)
				continue
			}
			until = next
		}
	}()
	return sync.OnceFunc(func() {
		cancel()
		<-exited
	})
}

// release ends the call's claim of the name; with forget the record goes
// too (its bytes given back). A claim the call lost (it lapsed, and
// another call took the name over) is left alone.
func (c *claim) release(ctx context.Context, forget bool) {
	if c.s.cfg.Objects == nil || c.writer == "" {
		return
	}
	c.stop()
	defer c.s.objects.drop(c.o.Name)
	if err := c.s.cfg.Objects.ReleaseObject(context.WithoutCancel(ctx), c.o.Name, c.writer, forget); err != nil {
		c.s.log.Warn("release the claim of a name", "name", c.o.Name, "forget", forget, "err", err)
	}
}

// nameExists reports whether some node holds a layer, image or snapshot
// called name.
func (s *Server) nameExists(ctx context.Context, name string) (bool, error) {
	ls := &layerService{s: s}
	all, err := ls.allLayers(ctx)
	if err != nil {
		return false, err
	}
	for _, l := range all {
		if slices.Contains(layerNames(l), name) {
			return true, nil
		}
	}
	return false, nil
}

// fail ends the claim of a call that made nothing: a record the call made
// is forgotten, one it took for an overwrite is left as it was.
func (c *claim) fail(ctx context.Context) {
	c.release(ctx, c.claimed)
}

// done records the blobs the object now holds and, in the same store
// transaction, charges its project's quota (layer_bytes, or
// snapshot_bytes for a snapshot) what they add: a blob another object of
// the project holds is charged once, and an overwrite is charged what it
// adds less what the version it replaces alone held. A staged overwrite
// then has its name moved onto the new version on every node, the call
// still the name's one writer, so that record, charge and nodes agree;
// then the claim ends. A refusal is the store's ResourceExhausted and
// changes no record: the caller's undo then removes what it made (the
// staging ref), and a staged overwrite's old version is kept as it was.
// A call whose claim lapsed and was taken over by another is refused
// (FailedPrecondition) and removes what it made under a staging ref; one
// whose record was removed meanwhile (NotFound) removes what it made.
func (c *claim) done(ctx context.Context, blobs []store.Blob, undo func(context.Context) error) error {
	if c.s.cfg.Objects == nil || c.o.Name == "" {
		return nil
	}
	ctx = context.WithoutCancel(ctx)
	defer c.s.objects.drop(c.o.Name)
	undoing := func() {
		if undo == nil {
			return
		}
		if err := undo(ctx); err != nil {
			c.s.log.Warn("remove what a refused charge made", "name", c.o.Name, "ref", c.made(), "err", err)
		}
	}
	_, cerr := c.s.cfg.Objects.SetObjectBlobs(ctx, c.o.Name, c.writer, blobs)
	if cerr == nil {
		if c.staged == "" {
			c.release(ctx, false)
			return nil
		}
		err := (&layerService{s: c.s}).renameRef(ctx, c.staged, c.o.Name)
		if err == nil {
			c.release(ctx, false)
			return nil
		}
		// The name still names the old version: its record says so again.
		if _, rerr := c.s.cfg.Objects.SetObjectBlobs(ctx, c.o.Name, c.writer, c.o.Blobs); rerr != nil {
			c.s.log.Warn("record an overwrite's old blobs again", "name", c.o.Name, "err", rerr)
		}
		undoing()
		c.release(ctx, false)
		return fmt.Errorf("%s %s: move the name onto the new version: %w (the version before is kept)", what(c.o.Kind), c.o.Name, err)
	}
	removed := errors.Is(cerr, errdefs.ErrNotFound)
	if !errors.Is(cerr, errdefs.ErrResourceExhausted) && !removed && c.staged == "" {
		c.release(ctx, false)
		return cerr
	}
	undoing()
	switch {
	case removed:
		// Its record was removed while the call made it (dsec layer rm or
		// snapshot rm): what it made goes too, or it would stay on the
		// nodes with no record, the root's, charged to no one.
		c.release(ctx, false)
		return fmt.Errorf("%s %s was removed while this call made it: %w (what this call made is removed)", what(c.o.Kind), c.o.Name, cerr)
	case !errors.Is(cerr, errdefs.ErrResourceExhausted):
		c.release(ctx, false)
		return fmt.Errorf("%s %s: %w (what this call made is removed)", what(c.o.Kind), c.o.Name, cerr)
	case c.claimed:
		c.release(ctx, true)
		return fmt.Errorf("%s %s (%d bytes): %w", what(c.o.Kind), c.o.Name, blobBytes(blobs), cerr)
	case c.staged != "":
		c.release(ctx, false)
		return fmt.Errorf("%s %s (%d bytes, replacing %d): %w (the %s before is kept)",
			what(c.o.Kind), c.o.Name, blobBytes(blobs), blobBytes(c.o.Blobs), cerr, what(c.o.Kind))
	}
	// A snapshot's record taken over (snapshotTaken: no node held the
	// snapshot it named): what this call made is removed, and the record,
	// which names nothing, goes with its charge.
	c.release(ctx, true)
	return fmt.Errorf("%s %s (%d bytes): %w (no node held the %s its record named: the record is removed)",
		what(c.o.Kind), c.o.Name, blobBytes(blobs), cerr, what(c.o.Kind))
}

// blobBytes is the size of blobs.
func blobBytes(blobs []store.Blob) int64 {
	var n int64
	for _, b := range blobs {
		n += b.Bytes
	}
	return n
}

// forget drops the record of a removed object; the store gives back, in
// the same transaction, the bytes of its blobs no other object of its
// project holds.
func (s *Server) forget(ctx context.Context, name string) {
	if s.cfg.Objects == nil {
		return
	}
	defer s.objects.drop(name)
	_, _, err := s.cfg.Objects.DeleteObject(context.WithoutCancel(ctx), name)
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		s.log.Warn("forget object", "name", name, "err", err)
	}
}

// layerNames are the names a layer goes by: its refs, its images, its
// snapshots' snap:NAME.
func layerNames(l *dsecv1.Layer) []string {
	var out []string
	for _, r := range l.GetRefs() {
		out = append(out, objectName(r))
	}
	for _, r := range l.GetImages() {
		out = append(out, objectName(r))
	}
	for _, sn := range l.GetSnapshots() {
		out = append(out, "snap:"+sn.GetName())
	}
	if len(l.GetSnapshots()) == 0 && l.GetSnapshot() != nil {
		out = append(out, "snap:"+l.GetSnapshot().GetName())
	}
	return out
}

// objectIndex is every record, by name.
type objectIndex map[string]store.Object

func (s *Server) objectIndex(ctx context.Context) (objectIndex, error) {
	if s.cfg.Objects == nil {
		return nil, nil
	}
	all, err := s.cfg.Objects.ListObjects(ctx)
	if err != nil {
		return nil, err
	}
	ix := objectIndex{}
	for _, o := range all {
		ix[o.Name] = o
	}
	return ix, nil
}

// of is the record of name; the root's when there is none.
func (ix objectIndex) of(name string) store.Object {
	if o, ok := ix[name]; ok {
		return o
	}
	return store.Object{Name: name}
}

// filterLayers keeps what a may see of each layer (the refs, images and
// snapshots it sees; a layer with none left is dropped, and a layer with
// no name at all is the root's viewers') and sets each one's project and
// shares from its first name's record. check false keeps everything but
// staging refs, which no one lists (an overwrite under way, not yet
// anyone's): a layer named by one alone is left out.
func filterLayers(a iam.Authority, check bool, ix objectIndex, layers []*dsecv1.Layer) []*dsecv1.Layer {
	out := layers[:0]
	for _, l := range layers {
		if check && len(layerNames(l)) == 0 {
			if a.On("") >= iam.Viewer {
				out = append(out, l)
			}
			continue
		}
		staging := slices.ContainsFunc(layerNames(l), func(n string) bool { return strings.HasPrefix(n, stagingPrefix) })
		ok := func(name string) bool {
			return !strings.HasPrefix(name, stagingPrefix) && (!check || sees(a, ix.of(name)))
		}
		l.Refs = slices.DeleteFunc(l.Refs, func(r string) bool { return !ok(objectName(r)) })
		l.Images = slices.DeleteFunc(l.Images, func(r string) bool { return !ok(objectName(r)) })
		l.Snapshots = slices.DeleteFunc(l.Snapshots, func(sn *dsecv1.SnapshotInfo) bool { return !ok("snap:" + sn.GetName()) })
		if l.Snapshot != nil && !ok("snap:"+l.Snapshot.GetName()) {
			l.Snapshot = nil
			if len(l.Snapshots) > 0 {
				l.Snapshot = l.Snapshots[0]
			}
		}
		names := layerNames(l)
		if len(names) == 0 {
			if !check && !staging {
				out = append(out, l) // nameless (an overwritten version): removed by digest
			}
			continue
		}
		first := ix.of(names[0])
		l.Project, l.SharedWith = first.Project, first.SharedWith
		for _, sn := range l.Snapshots {
			o := ix.of("snap:" + sn.GetName())
			sn.Project, sn.SharedWith = o.Project, o.SharedWith
		}
		if l.Snapshot != nil {
			o := ix.of("snap:" + l.Snapshot.GetName())
			l.Snapshot.Project, l.Snapshot.SharedWith = o.Project, o.SharedWith
		}
		out = append(out, l)
	}
	return out
}

// usable checks that the caller may make sandboxes of env
// (BASE[+LAYER...]): every part is a name it sees (NotFound otherwise,
// what a node says of a name it does not hold), or a digest of a layer
// with such a name, or a part of the environment a snapshot it sees was
// taken on (a shared snapshot brings the layers under it, and no others).
func (s *Server) usable(ctx context.Context, env string) error {
	if s.cfg.Objects == nil {
		return nil
	}
	a, check := caller(ctx, iam.Viewer)
	if !check {
		return nil
	}
	var digests, hidden, snaps []string
	for _, part := range strings.Split(env, "+") {
		name := objectName(part)
		if strings.HasPrefix(name, "sha256:") {
			digests = append(digests, name)
			continue
		}
		o, err := s.cachedObject(ctx, name)
		if err != nil {
			return err
		}
		switch {
		case !sees(a, o):
			hidden = append(hidden, name)
		case strings.HasPrefix(name, "snap:"):
			snaps = append(snaps, name)
		}
	}
	if len(hidden) == 0 && len(digests) == 0 {
		return nil
	}
	ls := &layerService{s: s}
	all, err := ls.allLayers(ctx)
	if err != nil {
		return err
	}
	under := map[string]bool{} // the parts of the environments of the snapshots it sees
	for _, l := range all {
		for _, sn := range l.GetSnapshots() {
			if !slices.Contains(snaps, "snap:"+sn.GetName()) {
				continue
			}
			for _, part := range strings.Split(sn.GetEnvironment(), "+") {
				under[objectName(part)] = true
			}
		}
	}
	for _, name := range hidden {
		if !under[name] {
			return fmt.Errorf("resolve environment %q: %w", env, hiddenObject(kindOf(name, store.ObjectLayer), name))
		}
	}
	if len(digests) == 0 {
		return nil
	}
	ix, err := s.objectIndex(ctx)
	if err != nil {
		return err
	}
	seen := filterLayers(a, true, ix, all)
	for _, d := range digests {
		if !under[d] && !slices.ContainsFunc(seen, func(l *dsecv1.Layer) bool { return l.GetDigest() == d }) {
			return fmt.Errorf("resolve environment %q: %w", env, hiddenObject(store.ObjectLayer, d))
		}
	}
	return nil
}

// visibleEnv reports whether every part of env is a name a sees.
func visibleEnv(a iam.Authority, ix objectIndex, env string) bool {
	for _, part := range strings.Split(env, "+") {
		name := objectName(part)
		if strings.HasPrefix(name, "sha256:") {
			if a.On("") < iam.Viewer {
				return false
			}
			continue
		}
		if !sees(a, ix.of(name)) {
			return false
		}
	}
	return true
}

// ShareLayer shares a layer, image or snapshot of a project the caller
// holds builder on with another project, read-only, or takes the share
// away.
func (ls *layerService) ShareLayer(ctx context.Context, req *connect.Request[dsecv1.ShareLayerRequest]) (*connect.Response[dsecv1.ShareLayerResponse], error) {
	s := ls.s
	name := objectName(req.Msg.GetRef())
	if name == "" || strings.HasPrefix(name, "sha256:") {
		return nil, fmt.Errorf("share: ref %q: want a layer's or image's name:tag, or snap:NAME: %w", req.Msg.GetRef(), errdefs.ErrInvalidArgument)
	}
	project, err := iam.CleanPath(req.Msg.GetProject())
	if err != nil {
		return nil, err
	}
	if s.cfg.Objects == nil {
		return nil, fmt.Errorf("share %s: this apiserver records no projects of layers: %w", name, errdefs.ErrNotSupported)
	}
	kind := kindOf(name, store.ObjectLayer)
	o, found, err := s.manage(ctx, kind, name)
	if err != nil {
		return nil, err
	}
	if !found {
		exists, err := s.nameExists(ctx, name)
		if err != nil {
			return nil, err
		}
		if !exists {
			return nil, hiddenObject(kind, name)
		}
		return nil, fmt.Errorf("%s %s belongs to the root project, whose layers, images and snapshots every project sees already: %w",
			what(kind), name, errdefs.ErrFailedPrecondition)
	}
	if req.Msg.GetUnshare() {
		err = s.cfg.Objects.UnshareObject(ctx, name, project)
	} else {
		err = s.cfg.Objects.ShareObject(ctx, name, project)
	}
	s.objects.drop(name)
	if err != nil {
		return nil, err
	}
	if o, err = s.cfg.Objects.Object(ctx, name); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ShareLayerResponse{SharedWith: o.SharedWith}), nil
}
