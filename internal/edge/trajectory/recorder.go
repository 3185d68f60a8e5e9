package trajectory

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/errdefs"
)

// Defaults for Config's zero fields.
const (
	DefaultRetention = 24 * time.Hour
	DefaultMaxBytes  = 16 << 20
	DefaultMaxOutput = 16 << 10
	DefaultMaxArgs   = 64 << 10
	// degradedArgs is the size of arguments a degraded line still keeps
	// (a command, a path), hashing larger ones (file contents).
	degradedArgs = 1 << 10
	sweepEvery   = 30 * time.Second
)

// Config configures a Recorder.
type Config struct {
	// Dir holds the trajectories, one <sandbox>.jsonl each.
	Dir string
	// Retention is how long a finished trajectory is kept (on the node and
	// in the blob store) after its sandbox is gone.
	Retention time.Duration
	// MaxBytes bounds a trajectory's full lines; past it lines keep hashes
	// and counts only, and past twice it calls are only counted.
	MaxBytes int64
	// MaxOutput is the bytes of each output stream a call's line keeps.
	MaxOutput int
	// MaxArgs is the largest request a line keeps whole; a larger one
	// (a big file write) is kept as its hash and size.
	MaxArgs int
	// Blobs, if set, receives each finished trajectory under
	// BlobKey(id), so that it outlives the node.
	Blobs blob.Store
	Log   *slog.Logger
}

// Source is what a Recorder needs of the node's edge.
type Source interface {
	Get(ctx context.Context, id string) (*dsecv1.Sandbox, error)
	NetworkLog(ctx context.Context, id string, since time.Time, limit int) ([]netpolicy.Event, error)
}

// BlobKey is the blob store key of sandbox id's finished trajectory.
func BlobKey(id string) string { return "trajectories/" + id + ".jsonl" }

// Recorder records the trajectories of one node's sandboxes. It is safe for
// concurrent use; calls on different sandboxes do not wait for each other.
type Recorder struct {
	cfg Config
	src Source
	log *slog.Logger

	mu      sync.Mutex
	open    map[string]*traj // sandboxes recorded (or not: off) while they live
	opening sync.Mutex       // held while a trajectory is opened

	uploads sync.WaitGroup
}

// traj is one sandbox's trajectory while its sandbox lives.
type traj struct {
	id  string
	off bool // recording is off for this sandbox: nothing is written

	mu       sync.Mutex
	f        *os.File
	size     int64
	seq      int64
	calls    int64
	net      int64
	netSince time.Time
	netOn    bool // the sandbox has network rules, so events to read
	dropped  Dropped
	ended    bool

	pending  []*Line      // queued for the file, in seq order
	flushing bool         // a flusher runs
	idle     *sync.Cond   // on mu: the flusher ended
	buf      bytes.Buffer // the flusher's
	log      *slog.Logger
}

func newTraj(id string, log *slog.Logger) *traj {
	t := &traj{id: id, log: log}
	t.idle = sync.NewCond(&t.mu)
	return t
}

// New returns a recorder writing under cfg.Dir.
func New(cfg Config, src Source) (*Recorder, error) {
	if cfg.Retention <= 0 {
		cfg.Retention = DefaultRetention
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultMaxBytes
	}
	if cfg.MaxOutput <= 0 {
		cfg.MaxOutput = DefaultMaxOutput
	}
	if cfg.MaxArgs <= 0 {
		cfg.MaxArgs = DefaultMaxArgs
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("make trajectory dir: %w", err)
	}
	return &Recorder{cfg: cfg, src: src, log: cfg.Log, open: map[string]*traj{}}, nil
}

func validID(id string) bool {
	return id != "" && len(id) <= 128 && !strings.ContainsAny(id, "/\\\x00") && id != "." && id != ".."
}

func (r *Recorder) path(id string) string { return filepath.Join(r.cfg.Dir, id+".jsonl") }

// get returns sandbox id's open trajectory, opening it (and writing its
// begin line) on the first call.
func (r *Recorder) get(ctx context.Context, id string) (*traj, error) {
	r.mu.Lock()
	t, ok := r.open[id]
	r.mu.Unlock()
	if ok {
		return t, nil
	}
	if !validID(id) {
		return nil, fmt.Errorf("sandbox id %q: %w", id, errdefs.ErrInvalidArgument)
	}
	// One opening at a time, so that two first calls write one begin line.
	r.opening.Lock()
	defer r.opening.Unlock()
	r.mu.Lock()
	t, ok = r.open[id]
	r.mu.Unlock()
	if ok {
		return t, nil
	}
	sb, err := r.src.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	t = newTraj(id, r.log)
	t.off, t.netOn = sb.GetSpec().GetNoTrajectory(), len(sb.GetSpec().GetNetworkRules()) > 0
	if !t.off {
		if err := r.openFile(t, sb); err != nil {
			return nil, err
		}
	}
	r.mu.Lock()
	r.open[id] = t
	r.mu.Unlock()
	return t, nil
}

// openFile opens t's file: a new one with its begin line, or the one an
// earlier instance of the node left (carrying on after its last line).
func (r *Recorder) openFile(t *traj, sb *dsecv1.Sandbox) error {
	f, err := os.OpenFile(r.path(t.id), os.O_RDWR|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("open trajectory of %s: %w", t.id, err)
	}
	t.f = f
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("open trajectory of %s: %w", t.id, err)
	}
	if st.Size() > 0 {
		return t.resume(f)
	}
	spec := sb.GetSpec()
	begin := &Sandbox{ID: t.id, Node: sb.GetNode(), Project: sb.GetSpec().GetLabels()["dsec.dev/project"],
		Environment: spec.GetEnvironment(), NetworkRules: spec.GetNetworkRules()}
	if iso := spec.GetIsolation(); iso != dsecv1.Isolation_ISOLATION_UNSPECIFIED {
		begin.Isolation = strings.ToLower(strings.TrimPrefix(iso.String(), "ISOLATION_"))
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.netSince = time.Now()
	t.write(&Line{Type: TypeBegin, Time: time.Now(), Sandbox: begin})
	return nil
}

// resume reads what an earlier instance wrote: its size, last seq, counts.
func (t *traj) resume(f *os.File) error {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return err
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		var l Line
		if json.Unmarshal(sc.Bytes(), &l) != nil {
			continue
		}
		t.size += int64(len(sc.Bytes())) + 1
		t.seq = l.Seq
		switch l.Type {
		case TypeCall:
			t.calls++
		case TypeNet:
			t.net++
			t.netSince = l.Time
		case TypeEnd:
			t.ended = true
		}
	}
	return sc.Err()
}

// write queues l for t's file, numbered next; the caller holds t.mu. A
// flusher of t's own encodes and writes what is queued, off the path of the
// call recorded; sync waits for it. Until then t.size counts l at an
// estimate of its size.
func (t *traj) write(l *Line) {
	t.seq++
	l.Seq = t.seq
	l.est = int64(300 + len(l.Args))
	for _, o := range []*Output{l.Stdout, l.Stderr, l.Stdin} {
		if o != nil {
			l.est += int64(len(o.Text) + len(o.Base64))
		}
	}
	t.size += l.est
	t.pending = append(t.pending, l)
	if !t.flushing {
		t.flushing = true
		go t.flush()
	}
}

// flush writes the queued lines until none is left.
func (t *traj) flush() {
	t.mu.Lock()
	for len(t.pending) > 0 {
		batch := t.pending
		t.pending = nil
		t.mu.Unlock()
		t.buf.Reset()
		enc := json.NewEncoder(&t.buf)
		enc.SetEscapeHTML(false)
		var est int64
		for _, l := range batch {
			est += l.est
			if err := enc.Encode(l); err != nil {
				t.log.Warn("encode a trajectory line", "sandbox", t.id, "err", err)
			}
		}
		n, err := t.f.Write(t.buf.Bytes())
		if err != nil {
			t.log.Warn("write a trajectory", "sandbox", t.id, "err", err)
		}
		t.mu.Lock()
		t.size += int64(n) - est
	}
	t.flushing = false
	t.idle.Broadcast()
	t.mu.Unlock()
}

// sync waits until t's queued lines are written; the caller holds t.mu.
func (t *traj) sync() {
	for t.flushing {
		t.idle.Wait()
	}
}

// Step is one call being recorded. A nil Step records nothing; its methods
// are safe to call on nil.
type Step struct {
	r     *Recorder
	t     *traj
	line  Line
	args  []byte
	start time.Time
	out   [3]stream // stdout, stderr, stdin
}

type stream struct {
	h    hash.Hash
	n    int64
	kept []byte
}

func (s *stream) add(p []byte, max int) {
	if s.h == nil {
		s.h = sha256.New()
	}
	s.h.Write(p)
	s.n += int64(len(p))
	if room := max - len(s.kept); room > 0 {
		s.kept = append(s.kept, p[:min(room, len(p))]...)
	}
}

// Begin starts recording call on sandbox id, with its request. It returns
// nil (record nothing) when recording is off for the sandbox or the
// recorder is nil, and when the sandbox cannot be looked up (the call
// fails the same way and records nothing).
func (r *Recorder) Begin(ctx context.Context, id, call string, req proto.Message) *Step {
	if r == nil || id == "" {
		return nil
	}
	t, err := r.get(ctx, id)
	if err != nil || t.off {
		return nil
	}
	s := &Step{r: r, t: t, start: time.Now(), line: Line{Type: TypeCall, Call: call}}
	if req != nil {
		s.args, err = protojson.MarshalOptions{UseProtoNames: true}.Marshal(req)
		if err != nil {
			r.log.Warn("encode a call's arguments", "sandbox", id, "call", call, "err", err)
		}
	}
	return s
}

// Stdout adds bytes the call's command wrote to its stdout.
func (s *Step) Stdout(p []byte) {
	if s != nil {
		s.out[0].add(p, s.r.cfg.MaxOutput)
	}
}

// Stderr adds bytes the call's command wrote to its stderr.
func (s *Step) Stderr(p []byte) {
	if s != nil {
		s.out[1].add(p, s.r.cfg.MaxOutput)
	}
}

// Stdin adds bytes sent to the call's command (a shell's input).
func (s *Step) Stdin(p []byte) {
	if s != nil {
		s.out[2].add(p, s.r.cfg.MaxOutput)
	}
}

// Exit records the exit code of the call's command.
func (s *Step) Exit(code int32) {
	if s != nil {
		s.line.Exit = &code
	}
}

// Event feeds one event of a command's stream (exec, session run).
func (s *Step) Event(e *dsecv1.ExecEvent) {
	if s == nil {
		return
	}
	switch ev := e.GetEvent().(type) {
	case *dsecv1.ExecEvent_Stdout:
		s.Stdout(ev.Stdout)
	case *dsecv1.ExecEvent_Stderr:
		s.Stderr(ev.Stderr)
	case *dsecv1.ExecEvent_Exited:
		s.Exit(ev.Exited.GetExitCode())
	}
}

// End records the call as ended with err (nil: it succeeded).
func (s *Step) End(ctx context.Context, err error) {
	if s == nil {
		return
	}
	l := &s.line
	l.Time = s.start
	l.DurationMs = float64(time.Since(s.start).Microseconds()) / 1000
	if err != nil {
		l.Error = err.Error()
	}
	t := s.t
	max := s.r.cfg.MaxBytes
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ended || t.f == nil {
		return
	}
	s.r.pullNet(ctx, t)
	if t.size >= 2*max {
		t.dropped.Calls++
		for _, o := range s.out {
			t.dropped.OutputBytes += o.n
		}
		return
	}
	degraded := t.size >= max
	keepArgs := s.r.cfg.MaxArgs
	if degraded {
		keepArgs = degradedArgs
		l.Degraded = true
		t.dropped.Degraded++
	}
	if len(s.args) <= keepArgs {
		l.Args = s.args
	} else if s.args != nil {
		sum := sha256.Sum256(s.args)
		l.ArgsSHA256, l.ArgsBytes = hex.EncodeToString(sum[:]), len(s.args)
	}
	for i, o := range s.out {
		if o.h == nil {
			continue
		}
		out := &Output{Bytes: o.n, SHA256: hex.EncodeToString(o.h.Sum(nil))}
		kept := o.kept
		if degraded {
			kept = nil
		}
		out.setData(kept)
		out.Truncated = int64(len(kept)) < o.n
		t.dropped.OutputBytes += o.n - int64(len(kept))
		switch i {
		case 0:
			l.Stdout = out
		case 1:
			l.Stderr = out
		case 2:
			l.Stdin = out
		}
	}
	t.calls++
	t.write(l)
}

// pullNet writes the network events the sandbox's audit log holds since
// the last one written; the caller holds t.mu.
func (r *Recorder) pullNet(ctx context.Context, t *traj) {
	if !t.netOn {
		return
	}
	events, err := r.src.NetworkLog(ctx, t.id, t.netSince, 0)
	if err != nil {
		return // the sandbox is gone, or its log: nothing more to read
	}
	for i := range events {
		e := events[i]
		t.netSince = e.Time
		if t.size >= 2*r.cfg.MaxBytes {
			t.dropped.Net++
			continue
		}
		t.net++
		t.write(&Line{Type: TypeNet, Time: e.Time, Net: &e})
	}
}

// NetworkRules tells the recorder whether sandbox id has network rules now
// (so whether its network log is read), after a change of its rules.
func (r *Recorder) NetworkRules(id string, on bool) {
	if r == nil {
		return
	}
	r.mu.Lock()
	t := r.open[id]
	r.mu.Unlock()
	if t != nil {
		t.mu.Lock()
		t.netOn = t.netOn || on
		t.mu.Unlock()
	}
}

// Finish ends sandbox id's trajectory (it was deleted or is gone): its
// last network events and the end line are written, the file closed and
// copied to the blob store in the background. Finishing one not open is
// a no-op.
func (r *Recorder) Finish(ctx context.Context, id, reason string) {
	if r == nil {
		return
	}
	r.mu.Lock()
	t := r.open[id]
	delete(r.open, id)
	r.mu.Unlock()
	if t == nil || t.off {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ended {
		t.sync()
		t.f.Close()
		return
	}
	r.pullNet(ctx, t)
	t.write(&Line{Type: TypeEnd, Time: time.Now(), End: &End{Reason: reason, Calls: t.calls, Net: t.net, Dropped: t.dropped}})
	t.ended = true
	t.sync()
	t.f.Close()
	if r.cfg.Blobs != nil {
		r.uploads.Add(1)
		go func() {
			defer r.uploads.Done()
			if err := r.upload(context.WithoutCancel(ctx), id); err != nil {
				r.log.Warn("copy a trajectory to the blob store", "sandbox", id, "err", err)
			}
		}()
	}
}

func (r *Recorder) upload(ctx context.Context, id string) error {
	f, err := os.Open(r.path(id))
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	return r.cfg.Blobs.Put(ctx, BlobKey(id), f, st.Size())
}

// Wait waits for the copies to the blob store under way.
func (r *Recorder) Wait() { r.uploads.Wait() }

// Close writes what every open trajectory has queued and waits for the
// copies under way; the trajectories stay open on disk, for the node's
// next instance to carry on.
func (r *Recorder) Close() {
	r.mu.Lock()
	open := make([]*traj, 0, len(r.open))
	for _, t := range r.open {
		open = append(open, t)
	}
	r.mu.Unlock()
	for _, t := range open {
		t.mu.Lock()
		t.sync()
		t.mu.Unlock()
	}
	r.Wait()
}

// Read is a read of a trajectory from an offset.
type Read struct {
	Lines      []byte
	NextOffset int64
	Size       int64
	Ended      bool
	SHA256     string // of bytes [0, Size)
	Project    string
}

// DefaultReadBytes bounds a Read's lines unless asked otherwise.
const DefaultReadBytes = 4 << 20

// Read returns whole lines of sandbox id's trajectory from offset, at most
// limit bytes of them (but always one line, if one is there): this node's
// file, or else the blob store's copy. A live trajectory first takes in
// the sandbox's network events so far.
func (r *Recorder) Read(ctx context.Context, id string, offset int64, limit int) (*Read, error) {
	if !validID(id) {
		return nil, fmt.Errorf("sandbox id %q: %w", id, errdefs.ErrInvalidArgument)
	}
	if offset < 0 {
		return nil, fmt.Errorf("offset %d must not be negative: %w", offset, errdefs.ErrInvalidArgument)
	}
	if limit <= 0 {
		limit = DefaultReadBytes
	}
	r.mu.Lock()
	t := r.open[id]
	r.mu.Unlock()
	if t != nil && !t.off {
		t.mu.Lock()
		if !t.ended {
			r.pullNet(ctx, t)
		}
		t.sync()
		t.mu.Unlock()
	}
	data, err := os.ReadFile(r.path(id))
	switch {
	case errors.Is(err, os.ErrNotExist):
		data, err = r.readBlob(ctx, id)
		if err != nil {
			return nil, err
		}
	case err != nil:
		return nil, fmt.Errorf("read trajectory of %s: %w", id, err)
	}
	return cut(data, offset, limit)
}

func (r *Recorder) readBlob(ctx context.Context, id string) ([]byte, error) {
	if r.cfg.Blobs == nil {
		return nil, fmt.Errorf("no trajectory of sandbox %s on this node: %w", id, errdefs.ErrNotFound)
	}
	rc, err := r.cfg.Blobs.Get(ctx, BlobKey(id))
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, fmt.Errorf("no trajectory of sandbox %s (none recorded, or past its retention): %w", id, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("read trajectory of %s from the blob store: %w", id, err)
	}
	defer rc.Close()
	return io.ReadAll(rc)
}

// cut returns the read of data (whole lines only) from offset.
func cut(data []byte, offset int64, limit int) (*Read, error) {
	// Only whole lines count: a line being written is not there yet.
	size := int64(bytes.LastIndexByte(data, '\n') + 1)
	data = data[:size]
	if offset > size {
		return nil, fmt.Errorf("offset %d is past the trajectory's %d bytes: %w", offset, size, errdefs.ErrInvalidArgument)
	}
	sum := sha256.Sum256(data)
	rd := &Read{Size: size, SHA256: hex.EncodeToString(sum[:])}
	if i := bytes.IndexByte(data, '\n'); i >= 0 {
		var first Line
		if json.Unmarshal(data[:i], &first) == nil && first.Sandbox != nil {
			rd.Project = first.Sandbox.Project
		}
	}
	rest := data[offset:]
	end := len(rest)
	if end > limit {
		end = bytes.LastIndexByte(rest[:limit], '\n') + 1
		if end == 0 { // one line longer than limit: send it whole
			end = bytes.IndexByte(rest, '\n') + 1
		}
	}
	rd.Lines = rest[:end]
	rd.NextOffset = offset + int64(end)
	if j := bytes.LastIndexByte(data[:max(size-1, 0)], '\n'); size > 0 {
		var last Line
		if json.Unmarshal(data[j+1:size], &last) == nil && last.Type == TypeEnd {
			rd.Ended = true
		}
	}
	return rd, nil
}

// Sweep finishes the trajectories of sandboxes that are gone (ended by
// their TTL, or before this instance of the node), and removes finished
// trajectories past their retention, here and in the blob store.
func (r *Recorder) Sweep(ctx context.Context) {
	r.mu.Lock()
	ids := make([]string, 0, len(r.open))
	for id := range r.open {
		ids = append(ids, id)
	}
	r.mu.Unlock()
	for _, id := range ids {
		if r.gone(ctx, id) {
			r.Finish(ctx, id, "gone")
		}
	}
	entries, err := os.ReadDir(r.cfg.Dir)
	if err != nil {
		r.log.Warn("sweep trajectories", "err", err)
		return
	}
	for _, e := range entries {
		id, ok := strings.CutSuffix(e.Name(), ".jsonl")
		if !ok {
			continue
		}
		r.mu.Lock()
		_, live := r.open[id]
		r.mu.Unlock()
		if live {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue
		}
		if time.Since(info.ModTime()) > r.cfg.Retention {
			r.remove(ctx, id)
			continue
		}
		if !r.ended(id) && r.gone(ctx, id) { // left open by an earlier instance
			if _, err := r.get(ctx, id); err == nil {
				r.Finish(ctx, id, "gone")
			} else {
				r.finishOrphan(ctx, id)
			}
		}
	}
}

// finishOrphan ends a file whose sandbox is no longer known at all.
func (r *Recorder) finishOrphan(ctx context.Context, id string) {
	t := newTraj(id, r.log)
	f, err := os.OpenFile(r.path(id), os.O_RDWR|os.O_APPEND, 0o600)
	if err != nil {
		return
	}
	t.f = f
	if t.resume(f) != nil {
		f.Close()
		return
	}
	r.mu.Lock()
	r.open[id] = t
	r.mu.Unlock()
	r.Finish(ctx, id, "gone")
}

func (r *Recorder) ended(id string) bool {
	f, err := os.Open(r.path(id))
	if err != nil {
		return true
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return true
	}
	tail := min(st.Size(), 4096)
	buf := make([]byte, tail)
	if _, err := f.ReadAt(buf, st.Size()-tail); err != nil {
		return true
	}
	return bytes.Contains(buf, []byte(`"type":"end"`))
}

// gone says whether sandbox id no longer lives.
func (r *Recorder) gone(ctx context.Context, id string) bool {
	sb, err := r.src.Get(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return true
	}
	if err != nil {
		return false
	}
	switch sb.GetState() {
	case dsecv1.State_STATE_STOPPED, dsecv1.State_STATE_FAILED:
		return true
	}
	return false
}

func (r *Recorder) remove(ctx context.Context, id string) {
	if err := os.Remove(r.path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		r.log.Warn("remove a trajectory past its retention", "sandbox", id, "err", err)
	}
	if r.cfg.Blobs != nil {
		if err := r.cfg.Blobs.Delete(ctx, BlobKey(id)); err != nil {
			r.log.Warn("remove a trajectory past its retention from the blob store", "sandbox", id, "err", err)
		}
	}
}

// Run sweeps every 30 s until ctx is done, then closes the recorder.
func (r *Recorder) Run(ctx context.Context) {
	tick := time.NewTicker(sweepEvery)
	defer tick.Stop()
	r.Sweep(ctx)
	for {
		select {
		case <-ctx.Done():
			r.Close()
			return
		case <-tick.C:
			r.Sweep(ctx)
		}
	}
}
