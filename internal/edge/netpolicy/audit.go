package netpolicy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// DefaultAuditEvents is the per-sandbox bound used when NewAuditLog gets a
// non-positive maxPerSandbox.
const DefaultAuditEvents = 1024

// AuditLog keeps the network audit events of a node's sandboxes: the newest
// maxPerSandbox events of each sandbox in memory, and the same events as JSON
// lines in dir/<id>.jsonl so that they survive a daemon restart. A file
// grows to at most twice the bound, then is rewritten with the newest
// maxPerSandbox events. Memory is about 250 bytes per event kept, the file
// about as much per line. It is safe for concurrent use; sandboxes do not
// wait for each other.
type AuditLog struct {
	// Log receives write errors (Record cannot return them). Nil: discarded.
	Log *slog.Logger

	dir string
	max int

	mu    sync.Mutex // guards rings only; each ring has its own lock
	rings map[string]*auditRing
}

type auditRing struct {
	mu      sync.Mutex // held for loading, recording, reading and writing the file
	loaded  bool
	removed bool

	events    []Event // at most max; once full, a circle starting at head
	head      int     // index of the oldest event when full
	fileLines int     // lines in the file, -1 when unknown
}

func (r *auditRing) add(e Event, max int) {
	if len(r.events) < max {
		r.events = append(r.events, e)
		return
	}
	r.events[r.head] = e
	r.head = (r.head + 1) % len(r.events)
}

// each calls fn on the events oldest first until it returns false.
func (r *auditRing) each(fn func(Event) bool) {
	for i := range r.events {
		if !fn(r.events[(r.head+i)%len(r.events)]) {
			return
		}
	}
}

// NewAuditLog returns a log keeping maxPerSandbox events per sandbox under
// dir (created on first write). An empty dir keeps events in memory only.
func NewAuditLog(dir string, maxPerSandbox int) *AuditLog {
	if maxPerSandbox <= 0 {
		maxPerSandbox = DefaultAuditEvents
	}
	return &AuditLog{dir: dir, max: maxPerSandbox, rings: map[string]*auditRing{}}
}

// validID keeps sandbox IDs usable as file names.
func validID(id string) bool {
	if id == "" || len(id) > 128 || id == "." || id == ".." {
		return false
	}
	for _, r := range id {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return false
		}
	}
	return true
}

func (a *AuditLog) logger() *slog.Logger {
	if a.Log != nil {
		return a.Log
	}
	return slog.New(slog.DiscardHandler)
}

func (a *AuditLog) path(id string) string { return filepath.Join(a.dir, id+".jsonl") }

// lockedRing returns id's ring locked and loaded from its file, or nil
// when id has no ring and no file and create is false, or when the ring was
// removed while waiting for its lock. With create, a file that cannot be
// read still yields the (empty) ring, with the error. The caller unlocks r.mu.
func (a *AuditLog) lockedRing(id string, create bool) (*auditRing, error) {
	a.mu.Lock()
	r, ok := a.rings[id]
	if !ok {
		if !create {
			if a.dir == "" {
				a.mu.Unlock()
				return nil, nil
			}
			if _, err := os.Stat(a.path(id)); errors.Is(err, os.ErrNotExist) {
				a.mu.Unlock()
				return nil, nil
			}
		}
		r = &auditRing{}
		a.rings[id] = r
	}
	a.mu.Unlock()

	r.mu.Lock()
	if r.removed {
		r.mu.Unlock()
		return nil, nil
	}
	if !r.loaded && a.dir != "" {
		events, lines, err := a.load(id)
		if err != nil {
			if !create {
				r.mu.Unlock()
				return nil, err
			}
			// Record keeps going: the ring starts empty and the next
			// write replaces the unreadable file.
			r.loaded, r.fileLines = true, -1
			return r, err
		}
		r.events, r.fileLines = events, lines
	}
	r.loaded = true
	return r, nil
}

// load reads the newest a.max events of id's file and counts its lines
// (-1 when the file must be rewritten). Lines that do not parse are skipped.
func (a *AuditLog) load(id string) ([]Event, int, error) {
	f, err := os.Open(a.path(id))
	if errors.Is(err, os.ErrNotExist) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("open audit log: %w", err)
	}
	defer f.Close()
	var events []Event
	lines := 0
	br := bufio.NewReader(f)
	for {
		line, err := br.ReadBytes('\n')
		if len(bytes.TrimSpace(line)) > 0 {
			if lines >= 0 {
				lines++
			}
			var e Event
			if json.Unmarshal(line, &e) == nil {
				events = append(events, e)
				if len(events) > 2*a.max {
					events = append(events[:0], events[len(events)-a.max:]...)
				}
			}
		}
		if err == io.EOF {
			if len(line) > 0 {
				// A torn last write: appending would glue the next event
				// to it, so have the next Record rewrite the file.
				lines = -1
			}
			break
		}
		if err != nil {
			return nil, 0, fmt.Errorf("read audit log: %w", err)
		}
	}
	if len(events) > a.max {
		events = append([]Event(nil), events[len(events)-a.max:]...)
	}
	return events, lines, nil
}

// Record adds e to its sandbox's log (e.SandboxID), stamping Time if zero.
// Events of IDs that cannot be file names are dropped and logged.
func (a *AuditLog) Record(e Event) {
	if !validID(e.SandboxID) {
		a.logger().Warn("drop audit event with bad sandbox id", "sandbox", e.SandboxID)
		return
	}
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	r, err := a.lockedRing(e.SandboxID, true)
	if err != nil {
		a.logger().Warn("load audit log", "sandbox", e.SandboxID, "err", err)
	}
	if r == nil {
		return // removed meanwhile
	}
	defer r.mu.Unlock()
	r.add(e, a.max)
	if a.dir == "" {
		return
	}
	if err := a.write(e.SandboxID, r, e); err != nil {
		a.logger().Warn("write audit log", "sandbox", e.SandboxID, "err", err)
	}
}

// write appends e to the file, or rewrites the file from the ring when it
// has grown past twice the bound (or its length is unknown). r.mu held.
func (a *AuditLog) write(id string, r *auditRing, e Event) error {
	if r.fileLines >= 0 && r.fileLines < 2*a.max {
		line, err := json.Marshal(e)
		if err != nil {
			return fmt.Errorf("encode audit event: %w", err)
		}
		if err := os.MkdirAll(a.dir, 0o700); err != nil {
			return fmt.Errorf("create audit dir: %w", err)
		}
		f, err := os.OpenFile(a.path(id), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
		if err != nil {
			return fmt.Errorf("open audit log: %w", err)
		}
		_, werr := f.Write(append(line, '\n'))
		cerr := f.Close()
		if werr != nil || cerr != nil {
			r.fileLines = -1 // rewrite next time
			return fmt.Errorf("append audit log: %w", errors.Join(werr, cerr))
		}
		r.fileLines++
		return nil
	}
	var buf bytes.Buffer
	var encErr error
	r.each(func(ev Event) bool {
		line, err := json.Marshal(ev)
		if err != nil {
			encErr = fmt.Errorf("encode audit event: %w", err)
			return false
		}
		buf.Write(line)
		buf.WriteByte('\n')
		return true
	})
	if encErr != nil {
		return encErr
	}
	if err := os.MkdirAll(a.dir, 0o700); err != nil {
		return fmt.Errorf("create audit dir: %w", err)
	}
	tmp := a.path(id) + ".tmp"
	if err := os.WriteFile(tmp, buf.Bytes(), 0o600); err != nil {
		return fmt.Errorf("rewrite audit log: %w", err)
	}
	if err := os.Rename(tmp, a.path(id)); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("rewrite audit log: %w", err)
	}
	r.fileLines = len(r.events)
	return nil
}

// Read returns up to limit of id's events with Time strictly after since,
// oldest first (limit <= 0: all kept). A sandbox without events returns an
// empty list, not an error, since a sandbox that made no connection has none.
func (a *AuditLog) Read(id string, since time.Time, limit int) ([]Event, error) {
	if !validID(id) {
		return nil, fmt.Errorf("read audit log: sandbox id %q: %w", id, errdefs.ErrInvalidArgument)
	}
	out := []Event{}
	r, err := a.lockedRing(id, false)
	if err != nil {
		return nil, fmt.Errorf("read audit log %s: %w", id, err)
	}
	if r == nil {
		return out, nil
	}
	defer r.mu.Unlock()
	r.each(func(e Event) bool {
		if e.Time.After(since) {
			out = append(out, e)
		}
		return limit <= 0 || len(out) < limit
	})
	return out, nil
}

// Remove forgets id's events in memory and on disk (for a destroyed
// sandbox). Call it once the sandbox's event sources have stopped: an event
// racing with Remove is dropped, and one recorded after it starts a new log.
func (a *AuditLog) Remove(id string) error {
	if !validID(id) {
		return fmt.Errorf("remove audit log: sandbox id %q: %w", id, errdefs.ErrInvalidArgument)
	}
	a.mu.Lock()
	r := a.rings[id]
	delete(a.rings, id)
	a.mu.Unlock()
	if r != nil {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.removed, r.events = true, nil
	}
	if a.dir == "" {
		return nil
	}
	if err := os.Remove(a.path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove audit log %s: %w", id, err)
	}
	return nil
}
