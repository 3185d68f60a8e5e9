package session

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/agent/proc"
	"dsec.dev/dsec/internal/errdefs"
)

// StateDumpArg selects the state-dump mode of the agent binary.
const StateDumpArg = "state-dump"

// stateMagic starts each state frame: magic, 8 hex digits of length, payload
// (cwd NUL env NUL env ...).
const stateMagic = "DSECSTATE"

// maxState bounds the state a session may carry over.
const maxState = 4 << 20

// StateDumpMain is the state-dump mode: it writes the calling shell's
// working directory and environment to fd proc.StateFDNumber.
func StateDumpMain() int {
	cwd, err := os.Getwd()
	if err != nil {
		return 1
	}
	var payload bytes.Buffer
	payload.WriteString(cwd)
	for _, kv := range os.Environ() {
		payload.WriteByte(0)
		payload.WriteString(kv)
	}
	frame := fmt.Sprintf("%s%08x", stateMagic, payload.Len())
	f := os.NewFile(proc.StateFDNumber, "state")
	if _, err := f.Write(append([]byte(frame), payload.Bytes()...)); err != nil {
		return 1
	}
	return 0
}

// parseState finds the last complete frame in b.
func parseState(b []byte) (cwd string, env []string, ok bool) {
	for len(b) > 0 {
		i := bytes.Index(b, []byte(stateMagic))
		if i < 0 || len(b) < i+len(stateMagic)+8 {
			break
		}
		b = b[i+len(stateMagic):]
		n, err := strconv.ParseUint(string(b[:8]), 16, 32)
		if err != nil || uint64(len(b)-8) < n {
			continue
		}
		parts := strings.Split(string(b[8:8+n]), "\x00")
		cwd, env, ok = parts[0], nil, true
		for _, kv := range parts[1:] {
			if strings.HasPrefix(kv, "_=") || strings.HasPrefix(kv, "SHLVL=") || !strings.Contains(kv, "=") {
				continue
			}
			env = append(env, kv)
		}
		b = b[8+n:]
	}
	return cwd, env, ok
}

// Base is what a new session starts from: the shell (Argv[0]), credentials,
// environment and directory. Argv beyond [0] is ignored.
type Base = proc.Spec

// Resolver makes the Base of a new session for a user and shell ("" = defaults).
type Resolver func(user, shell string) (Base, error)

// Manager holds the sessions of one agent.
type Manager struct {
	procs     *proc.Manager
	resolve   Resolver
	agentPath string // the agent binary as seen inside the sandbox

	mu       sync.Mutex
	sessions map[string]*session
}

type session struct {
	base    Base
	cwd     string
	env     []string
	running *Run
}

// NewManager makes a session manager; agentPath is the agent binary that
// shells run in their EXIT trap.
func NewManager(procs *proc.Manager, resolve Resolver, agentPath string) *Manager {
	return &Manager{procs: procs, resolve: resolve, agentPath: agentPath, sessions: map[string]*session{}}
}

// Run is one command running in a session.
type Run struct {
	// Process is followed from its start: the caller must Close its
	// Follower when its stream ends.
	Process *proc.Process
	// Finished is closed once the session's state has been updated after
	// the process ended; only then may the exit be reported.
	Finished chan struct{}
}

// RunRequest is one SessionRun.
type RunRequest struct {
	Session     string
	Command     string
	Timeout     time.Duration
	Stdin       []byte
	Shell       string // only when the session is made
	User        string // only when the session is made
	OutputLimit int64
}

// Start runs a command in the named session, making the session on first use.
func (m *Manager) Start(ctx context.Context, req RunRequest) (*Run, error) {
	if req.Session == "" {
		return nil, fmt.Errorf("run in session: empty session name: %w", errdefs.ErrInvalidArgument)
	}
	m.mu.Lock()
	s := m.sessions[req.Session]
	if s == nil {
		base, err := m.resolve(req.User, req.Shell)
		if err != nil {
			m.mu.Unlock()
			return nil, err
		}
		s = &session{base: base, cwd: base.Dir, env: base.Env}
		m.sessions[req.Session] = s
	}
	if s.running != nil {
		m.mu.Unlock()
		return nil, fmt.Errorf("run in session %q: a command is already running: %w", req.Session, errdefs.ErrFailedPrecondition)
	}
	run := &Run{Finished: make(chan struct{})}
	s.running = run
	cwd, env := s.cwd, s.env
	m.mu.Unlock()

	if st, err := os.Stat(cwd); err != nil || !st.IsDir() {
		cwd = "/"
	}
	stateR, stateW, err := os.Pipe()
	if err != nil {
		m.clear(req.Session, s)
		return nil, fmt.Errorf("run in session %q: make pipe: %w", req.Session, err)
	}
	trap := fmt.Sprintf("trap '__dsec_st=$?; %s %s; exit $__dsec_st' EXIT\n", shellQuoteInTrap(m.agentPath), StateDumpArg)
	spec := s.base
	spec.Argv = []string{s.base.Argv[0], "-c", trap + req.Command}
	spec.Env = env
	spec.Dir = cwd
	spec.Stdin = req.Stdin
	spec.Timeout = req.Timeout
	spec.OutputLimit = req.OutputLimit
	spec.Tag = ""
	spec.Background = false
	spec.Followed = true // SessionRun streams it from its start
	spec.StateFD = stateW
	p, err := m.procs.Start(ctx, spec)
	if err != nil {
		stateR.Close()
		m.clear(req.Session, s)
		return nil, fmt.Errorf("run in session %q: %w", req.Session, err)
	}
	run.Process = p

	var buf bytes.Buffer
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		b := make([]byte, 32<<10)
		for {
			n, err := stateR.Read(b)
			if buf.Len()+n <= maxState {
				buf.Write(b[:n])
			}
			if err != nil {
				return
			}
		}
	}()
	go func() {
		<-p.DoneC()
		select {
		case <-readDone:
		case <-time.After(200 * time.Millisecond):
		}
		stateR.Close()
		<-readDone
		m.mu.Lock()
		if c, e, ok := parseState(buf.Bytes()); ok {
			s.cwd, s.env = c, e
		}
		if s.running == run {
			s.running = nil
		}
		m.mu.Unlock()
		close(run.Finished)
	}()
	return run, nil
}

func (m *Manager) clear(name string, s *session) {
	m.mu.Lock()
	s.running = nil
	m.mu.Unlock()
}

// shellQuoteInTrap quotes p for use inside the single-quoted trap action.
func shellQuoteInTrap(p string) string {
	// The trap text is itself in single quotes, so use double quotes and
	// escape what is special inside them.
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, "$", `\$`, "`", "\\`", "'", `'"'"'`)
	return `"` + r.Replace(p) + `"`
}

// Interrupt sends SIGINT to the tree of the session's running command.
func (m *Manager) Interrupt(name string) error {
	m.mu.Lock()
	s := m.sessions[name]
	var run *Run
	if s != nil {
		run = s.running
	}
	m.mu.Unlock()
	if s == nil {
		return fmt.Errorf("interrupt session %q: %w", name, errdefs.ErrNotFound)
	}
	if run == nil || run.Process == nil {
		return nil
	}
	if err := run.Process.Signal(unix.SIGINT); err != nil && !errors.Is(err, errdefs.ErrFailedPrecondition) {
		return fmt.Errorf("interrupt session %q: %w", name, err)
	}
	return nil
}

// Close kills what runs in the session and forgets it.
func (m *Manager) Close(name string) error {
	m.mu.Lock()
	s := m.sessions[name]
	delete(m.sessions, name)
	var run *Run
	if s != nil {
		run = s.running
	}
	m.mu.Unlock()
	if s == nil {
		return fmt.Errorf("close session %q: %w", name, errdefs.ErrNotFound)
	}
	if run != nil && run.Process != nil {
		run.Process.KillTree()
		<-run.Finished
	}
	return nil
}
