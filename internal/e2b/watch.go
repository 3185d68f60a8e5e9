package e2b

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"path"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	fspb "dsec.dev/dsec/api/gen/e2b/filesystem"
)

// Watching is dsec's WatchDir: inotify inside the sandbox, run by its
// agent as the request's user, relayed here event by event. Its changes
// are envd's event types one for one (envd watches with inotify too): a
// file made and written is CREATE then WRITE, a rename RENAME of the old
// name and CREATE of the new. That was chosen over polling listings from
// here: a poll costs a listing of every watched directory each round and
// still misses changes that undo themselves between rounds, writes that
// keep a file's size and time, and which new name a rename went to.
const (
	// maxWatchers bounds the watchers of CreateWatcher on one handler.
	maxWatchers = 1024
	// maxWatcherEvents bounds the events a watcher holds between
	// GetWatcherEvents calls; older ones are dropped past it.
	maxWatcherEvents = 10_000
	// watcherIdle is how long a CreateWatcher watcher lives with nobody
	// fetching its events.
	watcherIdle = 10 * time.Minute
	// defaultKeepalive is the keepalive interval of WatchDir when the
	// client names none (Keepalive-Ping-Interval, seconds).
	defaultKeepalive = 30 * time.Second
)

// eventTypes maps dsec's changes onto envd's events.
var eventTypes = map[dsecv1.FileChange]fspb.EventType{
	dsecv1.FileChange_FILE_CHANGE_CREATE: fspb.EventType_EVENT_TYPE_CREATE,
	dsecv1.FileChange_FILE_CHANGE_WRITE:  fspb.EventType_EVENT_TYPE_WRITE,
	dsecv1.FileChange_FILE_CHANGE_REMOVE: fspb.EventType_EVENT_TYPE_REMOVE,
	dsecv1.FileChange_FILE_CHANGE_RENAME: fspb.EventType_EVENT_TYPE_RENAME,
	dsecv1.FileChange_FILE_CHANGE_CHMOD:  fspb.EventType_EVENT_TYPE_CHMOD,
}

// watch is one watched directory: dsec's event stream, started.
type watch struct {
	s            *fsService
	t            target
	root         string // absolute, symlinks followed
	includeEntry bool
	stream       *connect.ServerStreamForClient[dsecv1.WatchEvent]
}

// startWatch checks that p is a directory (a symlink to one is followed),
// as envd does, and starts dsec's watch of it, which lasts as long as
// ctx.
func (s *fsService) startWatch(ctx context.Context, t target, p string, recursive, includeEntry bool) (*watch, error) {
	p = abs(t, p)
	fi, err := s.stat(ctx, t, p)
	if err != nil {
		return nil, connectErr(err)
	}
	root := p
	if fi.GetType() == "symlink" {
		root, fi = s.follow(ctx, t, p, fi)
		if fi == nil {
			return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("path not found: %s is a broken symlink", p))
		}
	}
	if fi.GetType() != "dir" {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %s is not a directory", p))
	}
	stream, err := s.h.api.WatchDir(ctx, connect.NewRequest(&dsecv1.WatchDirRequest{SandboxId: t.ID, Path: root, Recursive: recursive, User: userOf(t)}))
	if err != nil {
		return nil, connectErr(err)
	}
	if !stream.Receive() {
		err := stream.Err()
		stream.Close()
		if err == nil {
			err = errors.New("the watch ended before it started")
		}
		return nil, connectErr(err)
	}
	if !stream.Msg().GetStarted() {
		stream.Close()
		return nil, connect.NewError(connect.CodeInternal, errors.New("the watch's first event is not its start"))
	}
	return &watch{s: s, t: t, root: root, includeEntry: includeEntry, stream: stream}, nil
}

// run sends w's events on the channel it returns, which is closed when
// the watch ends; err then says why (nil: its context ended).
func (w *watch) run(ctx context.Context) (<-chan *fspb.FilesystemEvent, *error) {
	ch := make(chan *fspb.FilesystemEvent, 64)
	var werr error
	go func() {
		defer close(ch)
		defer w.stream.Close()
		for w.stream.Receive() {
			m := w.stream.Msg()
			typ, ok := eventTypes[m.GetChange()]
			if !ok {
				continue
			}
			ev := &fspb.FilesystemEvent{Name: m.GetName(), Type: typ}
			if w.includeEntry && carriesEntry(typ) {
				p := path.Join(w.root, m.GetName())
				if fi, err := w.s.stat(ctx, w.t, p); err == nil {
					ev.Entry = w.s.entry(ctx, w.t, p, fi)
				}
			}
			select {
			case ch <- ev:
			case <-ctx.Done():
				return
			}
		}
		if ctx.Err() == nil {
			werr = connectErr(w.stream.Err())
			if werr == nil {
				werr = connect.NewError(connect.CodeUnavailable, errors.New("the watch ended"))
			}
		}
	}()
	return ch, &werr
}

// carriesEntry says whether an event's path still names its entry: not
// for a remove or a rename, whose entry is gone from it.
func carriesEntry(t fspb.EventType) bool {
	return t == fspb.EventType_EVENT_TYPE_CREATE || t == fspb.EventType_EVENT_TYPE_WRITE || t == fspb.EventType_EVENT_TYPE_CHMOD
}

// WatchDir streams a directory's changes: a start event once the first
// listing is taken, then its events, and a keepalive every
// Keepalive-Ping-Interval seconds. It ends when the client goes, or with
// an error when the directory or its sandbox does.
func (s *fsService) WatchDir(ctx context.Context, req *connect.Request[fspb.WatchDirRequest], out *connect.ServerStream[fspb.WatchDirResponse]) error {
	t := targetOf(ctx)
	w, err := s.startWatch(ctx, t, req.Msg.GetPath(), req.Msg.GetRecursive(), req.Msg.GetIncludeEntry())
	if err != nil {
		return err
	}
	if err := out.Send(&fspb.WatchDirResponse{Event: &fspb.WatchDirResponse_Start{Start: &fspb.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	keepalive := defaultKeepalive
	if n, err := strconv.Atoi(req.Header().Get("Keepalive-Ping-Interval")); err == nil && n > 0 {
		keepalive = time.Duration(min(n, 3600)) * time.Second
	}
	events, werr := w.run(ctx)
	ka := time.NewTicker(keepalive)
	defer ka.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ka.C:
			if err := out.Send(&fspb.WatchDirResponse{Event: &fspb.WatchDirResponse_Keepalive{Keepalive: &fspb.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
		case ev, ok := <-events:
			if !ok {
				return *werr
			}
			if err := out.Send(&fspb.WatchDirResponse{Event: &fspb.WatchDirResponse_Filesystem{Filesystem: ev}}); err != nil {
				return err
			}
		}
	}
}

// watchTable holds the watchers of CreateWatcher: each watches on its own
// until RemoveWatcher, until nobody fetched its events for watcherIdle, or
// until its directory or sandbox is gone (a watcher dies with its
// sandbox). At most maxWatchers live at once.
type watchTable struct {
	mu sync.Mutex
	m  map[string]*watcher
}

func newWatchTable() *watchTable { return &watchTable{m: map[string]*watcher{}} }

// watcher is one watch of CreateWatcher, with the events it gathered.
type watcher struct {
	sandbox string
	cancel  context.CancelFunc

	mu      sync.Mutex
	events  []*fspb.FilesystemEvent
	err     error // why it stopped; set once
	fetched time.Time
}

func (wt *watchTable) add(w *watcher) (string, error) {
	b := make([]byte, 16)
	rand.Read(b)
	id := hex.EncodeToString(b)
	wt.mu.Lock()
	defer wt.mu.Unlock()
	for k, old := range wt.m {
		old.mu.Lock()
		stale := old.err != nil && time.Since(old.fetched) > watcherIdle
		old.mu.Unlock()
		if stale {
			delete(wt.m, k)
		}
	}
	if len(wt.m) >= maxWatchers {
		return "", connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("%d watchers are live, the most this server keeps; remove some with RemoveWatcher", maxWatchers))
	}
	wt.m[id] = w
	return id, nil
}

// get is the watcher id of the dsec sandbox sandbox.
func (wt *watchTable) get(id, sandbox string) (*watcher, error) {
	wt.mu.Lock()
	w, ok := wt.m[id]
	wt.mu.Unlock()
	if !ok || w.sandbox != sandbox {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher with id %s not found", id))
	}
	return w, nil
}

func (wt *watchTable) remove(id string) *watcher {
	wt.mu.Lock()
	defer wt.mu.Unlock()
	w := wt.m[id]
	delete(wt.m, id)
	return w
}

func (s *fsService) CreateWatcher(ctx context.Context, req *connect.Request[fspb.CreateWatcherRequest]) (*connect.Response[fspb.CreateWatcherResponse], error) {
	t := targetOf(ctx)
	// The watch outlives this request.
	wctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	w, err := s.startWatch(wctx, t, req.Msg.GetPath(), req.Msg.GetRecursive(), req.Msg.GetIncludeEntry())
	if err != nil {
		cancel()
		return nil, err
	}
	wr := &watcher{sandbox: t.ID, cancel: cancel, fetched: time.Now()}
	id, err := s.h.watches.add(wr)
	if err != nil {
		cancel()
		w.stream.Close()
		return nil, err
	}
	go s.runWatcher(wctx, id, w, wr)
	return connect.NewResponse(&fspb.CreateWatcherResponse{WatcherId: id}), nil
}

// watcherCheck is how often a watcher looks whether it went idle.
const watcherCheck = 10 * time.Second

// runWatcher gathers w's events for wr until its context ends, it goes
// idle, or the watch fails. A failed watcher stays for one more fetch,
// which reports why, unless its sandbox is gone: a watcher dies with its
// sandbox.
func (s *fsService) runWatcher(ctx context.Context, id string, w *watch, wr *watcher) {
	defer wr.cancel()
	events, werr := w.run(ctx)
	tick := time.NewTicker(watcherCheck)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			wr.mu.Lock()
			idle := time.Since(wr.fetched) > watcherIdle
			wr.mu.Unlock()
			if idle {
				s.h.watches.remove(id)
				return
			}
		case ev, ok := <-events:
			if !ok {
				err := *werr
				if err == nil {
					return
				}
				s.h.log.Debug("E2B watcher stopped", "watcher", id, "sandbox", wr.sandbox, "err", err)
				wr.mu.Lock()
				wr.err = err
				wr.mu.Unlock()
				s.h.forget(wr.sandbox)
				if s.h.live(context.WithoutCancel(ctx), wr.sandbox) != nil {
					s.h.watches.remove(id)
				}
				return
			}
			wr.mu.Lock()
			wr.events = append(wr.events, ev)
			if len(wr.events) > maxWatcherEvents {
				wr.events = append([]*fspb.FilesystemEvent(nil), wr.events[len(wr.events)-maxWatcherEvents:]...)
			}
			wr.mu.Unlock()
		}
	}
}

func (s *fsService) GetWatcherEvents(ctx context.Context, req *connect.Request[fspb.GetWatcherEventsRequest]) (*connect.Response[fspb.GetWatcherEventsResponse], error) {
	t := targetOf(ctx)
	wr, err := s.h.watches.get(req.Msg.GetWatcherId(), t.ID)
	if err != nil {
		return nil, err
	}
	wr.mu.Lock()
	evs, werr := wr.events, wr.err
	wr.events, wr.fetched = nil, time.Now()
	wr.mu.Unlock()
	if werr != nil && len(evs) == 0 {
		s.h.watches.remove(req.Msg.GetWatcherId())
		var ce *connect.Error
		if errors.As(werr, &ce) {
			return nil, connect.NewError(ce.Code(), fmt.Errorf("the watcher stopped: %s", ce.Message()))
		}
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("the watcher stopped: %w", werr))
	}
	return connect.NewResponse(&fspb.GetWatcherEventsResponse{Events: evs}), nil
}

func (s *fsService) RemoveWatcher(ctx context.Context, req *connect.Request[fspb.RemoveWatcherRequest]) (*connect.Response[fspb.RemoveWatcherResponse], error) {
	t := targetOf(ctx)
	if _, err := s.h.watches.get(req.Msg.GetWatcherId(), t.ID); err != nil {
		return nil, err
	}
	if w := s.h.watches.remove(req.Msg.GetWatcherId()); w != nil {
		w.cancel()
	}
	return connect.NewResponse(&fspb.RemoveWatcherResponse{}), nil
}
