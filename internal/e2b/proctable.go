package e2b

import (
	"hash/fnv"
	"sync"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	processpb "dsec.dev/dsec/api/gen/e2b/process"
)

// procTable is what envd's process service keeps between calls, per
// sandbox: which dsec process a pid is (so a call by pid costs no lookup),
// the config it was started with (List answers it), and the terminals
// this apiserver holds. Apart from the terminals it is a cache: a process
// it does not know is found again with dsec's ListProcesses.
type procTable struct {
	mu  sync.Mutex
	sbs map[string]*sandboxProcs
	// ptyStarts serialize the starts of terminals in a sandbox (striped by
	// its ID), so each finds its own process among dsec's (see startPTY).
	ptyStarts [64]sync.Mutex
}

// sandboxProcs is one sandbox's part of the table.
type sandboxProcs struct {
	byPid map[uint32]*procEntry
}

// procEntry is one process envd's service has seen.
type procEntry struct {
	id     string // dsec's process ID
	pid    uint32 // in the sandbox
	tag    string
	config *processpb.ProcessConfig
	pty    *ptySession // nil unless the process runs in a terminal held here
	added  time.Time
}

// Bounds of the table: a sandbox with more entries loses those without a
// terminal, as does the table when it holds too many sandboxes (they are
// found again through ListProcesses, without the envs and cwd they were
// started with).
const (
	procsPerSandbox = 4096
	procSandboxes   = 10000
)

func newProcTable() *procTable { return &procTable{sbs: map[string]*sandboxProcs{}} }

// sandbox is sb's part of the table, made on first use. Callers hold t.mu.
func (t *procTable) sandbox(sb string) *sandboxProcs {
	s := t.sbs[sb]
	if s == nil {
		if len(t.sbs) >= procSandboxes {
			for id, o := range t.sbs {
				if !o.hasPTY() {
					delete(t.sbs, id)
				}
			}
		}
		s = &sandboxProcs{byPid: map[uint32]*procEntry{}}
		t.sbs[sb] = s
	}
	return s
}

func (s *sandboxProcs) hasPTY() bool {
	for _, e := range s.byPid {
		if e.pty != nil {
			return true
		}
	}
	return false
}

// put records e, replacing what the table knew of its pid.
func (t *procTable) put(sb string, e *procEntry) {
	if e.added.IsZero() {
		e.added = time.Now()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.sandbox(sb)
	if len(s.byPid) >= procsPerSandbox {
		for pid, o := range s.byPid {
			if o.pty == nil {
				delete(s.byPid, pid)
			}
		}
	}
	s.byPid[e.pid] = e
}

// get is the entry of pid, or nil.
func (t *procTable) get(sb string, pid uint32) *procEntry {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.sbs[sb]; s != nil {
		return s.byPid[pid]
	}
	return nil
}

// ptyByTag is the newest entry of a running terminal tagged tag, or nil: dsec
// knows no tags of terminals, so only the table finds them.
func (t *procTable) ptyByTag(sb, tag string) *procEntry {
	t.mu.Lock()
	defer t.mu.Unlock()
	var found *procEntry
	if s := t.sbs[sb]; s != nil {
		for _, e := range s.byPid {
			if e.pty != nil && e.tag == tag && !e.pty.ended() && (found == nil || e.added.After(found.added)) {
				found = e
			}
		}
	}
	return found
}

// byID is the entry of dsec's process id, or nil.
func (t *procTable) byID(sb, id string) *procEntry {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.sbs[sb]; s != nil {
		for _, e := range s.byPid {
			if e.id == id {
				return e
			}
		}
	}
	return nil
}

// drop forgets pid if it is still dsec's process id.
func (t *procTable) drop(sb string, pid uint32, id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.sbs[sb]
	if s == nil {
		return
	}
	if e := s.byPid[pid]; e != nil && e.id == id {
		delete(s.byPid, pid)
	}
	if len(s.byPid) == 0 {
		delete(t.sbs, sb)
	}
}

// ptyLock is the lock that serializes sb's terminal starts.
func (t *procTable) ptyLock(sb string) *sync.Mutex {
	h := fnv.New32a()
	h.Write([]byte(sb))
	return &t.ptyStarts[h.Sum32()%uint32(len(t.ptyStarts))]
}

// claimed reports whether the table holds dsec's process id for sb.
func (t *procTable) claimed(sb, id string) bool { return t.byID(sb, id) != nil }

// prune forgets sb's processes that dsec no longer runs (running holds the
// IDs of those it does, as of a list asked for at asked): entries added
// since may be newer than the list, and terminals leave on their own.
func (t *procTable) prune(sb string, running map[string]bool, asked time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.sbs[sb]
	if s == nil {
		return
	}
	for pid, e := range s.byPid {
		if e.pty == nil && !running[e.id] && e.added.Before(asked) {
			delete(s.byPid, pid)
		}
	}
}

// configOf is the config a listed process was started with, as far as the
// table knows it, else what its argv tells.
func configOf(e *procEntry, p *dsecv1.ProcessInfo) *processpb.ProcessConfig {
	if e != nil && e.config != nil {
		return e.config
	}
	c := &processpb.ProcessConfig{}
	if argv := p.GetArgv(); len(argv) > 0 {
		c.Cmd, c.Args = argv[0], argv[1:]
	}
	return c
}

// exitedWithin is how long after its exit Connect still answers a process
// (with its start and end), as envd retains the end of one.
const exitedWithin = 30 * time.Second

// pick is the process sel names among dsec's list: by pid, the running
// one, else one that exited within window before now; by tag, the newest
// running one so tagged (else the newest that exited within window).
func pick(list []*dsecv1.ProcessInfo, sel *processpb.ProcessSelector, window time.Duration, now time.Time) *dsecv1.ProcessInfo {
	match := func(p *dsecv1.ProcessInfo) bool {
		switch s := sel.GetSelector().(type) {
		case *processpb.ProcessSelector_Pid:
			return p.GetPid() > 0 && uint32(p.GetPid()) == s.Pid
		case *processpb.ProcessSelector_Tag:
			return s.Tag != "" && p.GetTag() == s.Tag
		}
		return false
	}
	var running, exited *dsecv1.ProcessInfo
	for _, p := range list { // oldest first: the last match is the newest
		if !match(p) {
			continue
		}
		if p.GetRunning() {
			running = p
			continue
		}
		end := time.UnixMilli(p.GetStartedUnixMs()).Add(time.Duration(p.GetExited().GetDurationSeconds() * float64(time.Second)))
		if window > 0 && now.Sub(end) <= window {
			exited = p
		}
	}
	if running != nil {
		return running
	}
	return exited
}
