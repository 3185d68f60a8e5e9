package proc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// DefaultOutputLimit is the output retained per stream when neither the
// agent's configuration nor the request says otherwise.
const DefaultOutputLimit = 16 << 20

// outputGrace is how long a finished process's pipes may stay open (held by
// children it left running) before the agent stops waiting for their EOF.
const outputGrace = time.Second

// keptOutputs is how many exited background processes keep their retained
// output for Attach; older ones keep only their exit record.
const keptOutputs = 8

// Config configures a Manager.
type Config struct {
	// CgroupFD is the sandbox's cgroup dir (freezer on v1, unified on v2), or -1.
	CgroupFD int
	// MemoryCgroupFD is the sandbox's memory cgroup dir, or -1.
	MemoryCgroupFD int
	// PidsCgroupFD is a cgroup v1 pids dir that every command joins, or -1.
	// Its limit is the sandbox's; the agent stays in the parent, whose
	// limit has room to spare, so a fork bomb cannot starve the agent of
	// the threads it needs.
	PidsCgroupFD int
	// NodeOOM says that an OOM kill with no OOM at the sandbox's own limit
	// came from a limit above the sandbox (the node's memory, or the
	// cgroup of every sandbox on it): the platform's fault, not the
	// task's. True in a container; false in a microVM, whose memory is the
	// sandbox's own.
	NodeOOM bool
	// KeepExited bounds how many exited processes ListProcesses remembers.
	KeepExited int
	// OnExit is called after every process exit (activity tracking).
	OnExit func()
	Log    *slog.Logger
}

// Manager starts, reaps, tracks and kills the agent's processes. There is
// one per agent; it owns wait4 for the whole agent process.
type Manager struct {
	cfg     Config
	mem     memCgroup
	devNull *os.File // stdin of commands given none; nil if /dev/null is missing
	tasks   tasksFiles
	// cgroupV2 says cfg.CgroupFD is on cgroup v2, read once: commands'
	// cgroups are on the same hierarchy.
	cgroupV2 bool

	mu       sync.Mutex
	waiters  map[int]chan unix.WaitStatus
	procs    map[string]*Process
	order    []*Process // start order, running and exited
	leftover []*cgroup  // child cgroups that still had processes at exit
	kick     chan struct{}
	// readBufs are the output readers' buffers: two per command would
	// otherwise be 64 KiB of garbage for every exec.
	readBufs sync.Pool
}

// NewManager makes the manager and starts its reaper. When the agent is not
// pid 1 it becomes a child subreaper so orphans of its commands come back to it.
func NewManager(cfg Config) (*Manager, error) {
	if cfg.KeepExited <= 0 {
		cfg.KeepExited = 256
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if os.Getpid() != 1 {
		if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
			return nil, fmt.Errorf("become child subreaper: %w", err)
		}
	}
	m := &Manager{
		cfg:     cfg,
		mem:     openMemCgroup(cfg.MemoryCgroupFD),
		waiters: make(map[int]chan unix.WaitStatus),
		procs:   make(map[string]*Process),
		kick:    make(chan struct{}, 1),
	}
	m.readBufs.New = func() any {
		b := make([]byte, 32<<10)
		return &b
	}
	if f, err := os.Open(os.DevNull); err == nil {
		m.devNull = f
	}
	m.cgroupV2 = cfg.CgroupFD >= 0 && isV2(cfg.CgroupFD)
	freezer := -1 // the v1 cgroup that commands' cgroups are made in
	if cfg.CgroupFD >= 0 && !m.cgroupV2 {
		freezer = cfg.CgroupFD
	}
	t, err := openTasksFiles(freezer, cfg.PidsCgroupFD)
	if err != nil {
		return nil, err
	}
	m.tasks = t
	go m.reap()
	return m, nil
}

// reap waits for every child of the agent: statuses of processes it started
// go to their waiters, orphans are reaped silently.
func (m *Manager) reap() {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if errors.Is(err, unix.ECHILD) {
			<-m.kick
			continue
		}
		if err != nil {
			m.cfg.Log.Error("wait for children", "err", err)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		m.mu.Lock()
		ch := m.waiters[pid]
		delete(m.waiters, pid)
		left := m.leftover
		m.leftover = nil
		m.mu.Unlock()
		if ch != nil {
			ch <- ws
		}
		var still []*cgroup
		for _, cg := range left {
			if cg.remove() != nil {
				still = append(still, cg)
			}
		}
		if len(still) > 0 {
			m.mu.Lock()
			m.leftover = append(m.leftover, still...)
			m.mu.Unlock()
		}
	}
}

// OOMKills is the sandbox memory cgroup's OOM kill count.
func (m *Manager) OOMKills() int64 { return m.mem.oomKills() }

// Running counts processes that have not exited.
func (m *Manager) Running() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, p := range m.order {
		if !p.Done() {
			n++
		}
	}
	return n
}

// Spec says what to start and how.
type Spec struct {
	Argv   []string // argv[0] is looked up on the PATH of Env unless it has a slash
	Env    []string
	Dir    string
	UID    uint32
	GID    uint32
	Groups []uint32

	Stdin         []byte
	KeepStdinOpen bool
	Timeout       time.Duration // 0 = none
	Background    bool
	Tag           string
	OutputLimit   int64 // retained per stream; 0 = DefaultOutputLimit
	// Followed says the caller streams the process's output from its
	// start: the process then has a Follower from the moment it exists
	// (Process.Follower), which the caller must Close when its stream ends.
	Followed bool

	// TTY, when set, is the process's stdin, stdout, stderr and controlling
	// terminal; output is then not captured (the caller reads the master).
	TTY *os.File
	// StateFD, when set, becomes fd 9 of the process (sessions' state pipe).
	StateFD *os.File

	// Join are more cgroup v1 cgroups the process starts in (a fncall
	// call's memory, CPU and pids cgroups), after the command's own
	// freezer cgroup and the commands' pids cgroup: in a hierarchy both
	// name, Join wins.
	Join []Join
	// KillOnExit kills what the process left running as soon as it exits,
	// rather than waiting up to a second for them to close its output.
	KillOnExit bool
}

// Join is one cgroup v1 cgroup a process starts in: the forking thread
// writes itself into Enter's tasks file, forks, and returns through Back's.
type Join struct{ Enter, Back int }

// StateFDNumber is the fd number Spec.StateFD gets in the process.
const StateFDNumber = 9

// Start starts a process. It closes spec.TTY and spec.StateFD (the parent's
// copies of the child's ends). A process that could not be executed is
// returned already done, with status EXIT_STATUS_START_ERROR.
func (m *Manager) Start(ctx context.Context, spec Spec) (*Process, error) {
	defer func() {
		if spec.TTY != nil {
			spec.TTY.Close()
		}
		if spec.StateFD != nil {
			spec.StateFD.Close()
		}
	}()
	if len(spec.Argv) == 0 {
		return nil, fmt.Errorf("start process: empty argv: %w", errdefs.ErrInvalidArgument)
	}
	if spec.Tag != "" {
		if p, err := m.Get(spec.Tag); err == nil && !p.Done() {
			return nil, fmt.Errorf("start process: tag %q is used by running process %s: %w", spec.Tag, p.ID, errdefs.ErrAlreadyExists)
		}
	}
	limit := spec.OutputLimit
	if limit <= 0 {
		limit = DefaultOutputLimit
	}
	p := &Process{
		m:          m,
		ID:         newID(),
		Tag:        spec.Tag,
		Argv:       spec.Argv,
		Background: spec.Background,
		limit:      limit,
		notify:     make(chan struct{}),
		room:       make(chan struct{}),
		done:       make(chan struct{}),
	}
	if spec.Followed {
		p.first = &Follower{p: p}
		p.followers = []*Follower{p.first}
	}

	var closeAfter []*os.File
	defer func() {
		for _, f := range closeAfter {
			f.Close()
		}
	}()
	pipe := func() (*os.File, *os.File, error) {
		r, w, err := os.Pipe()
		if err != nil {
			return nil, nil, fmt.Errorf("make pipe: %w", err)
		}
		return r, w, nil
	}
	var stdio [3]*os.File
	var outR, errR *os.File
	if spec.TTY != nil {
		stdio = [3]*os.File{spec.TTY, spec.TTY, spec.TTY}
	} else {
		// Without input to give, stdin is /dev/null rather than a pipe
		// closed at once: both read as end of file.
		inR := m.devNull
		if inR == nil || len(spec.Stdin) > 0 || spec.KeepStdinOpen {
			r, w, err := pipe()
			if err != nil {
				return nil, err
			}
			closeAfter = append(closeAfter, r)
			p.stdin, p.stdinFile = w, w
			inR = r
		}
		closeIn := func() {
			if p.stdin != nil {
				p.stdin.Close()
			}
		}
		oR, oW, err := pipe()
		if err != nil {
			closeIn()
			return nil, err
		}
		closeAfter = append(closeAfter, oW)
		eR, eW, err := pipe()
		if err != nil {
			closeIn()
			oR.Close()
			return nil, err
		}
		closeAfter = append(closeAfter, eW)
		stdio = [3]*os.File{inR, oW, eW}
		outR, errR = oR, eR
	}
	closeOurs := func() {
		for _, f := range []*os.File{p.stdin, outR, errR} {
			if f != nil {
				f.Close()
			}
		}
	}
	if m.cfg.CgroupFD >= 0 {
		cg, err := newCgroup(m.cfg.CgroupFD, "dsec-"+p.ID, m.cgroupV2)
		if err != nil {
			closeOurs()
			return nil, fmt.Errorf("start process: %w", err)
		}
		p.cg = cg
	}

	files := []uintptr{stdio[0].Fd(), stdio[1].Fd(), stdio[2].Fd()}
	if spec.StateFD != nil {
		for len(files) < StateFDNumber {
			files = append(files, ^uintptr(0))
		}
		files = append(files, spec.StateFD.Fd())
	}
	exitCh := make(chan unix.WaitStatus, 1)
	var startErr error
	path, err := lookPath(spec.Argv[0], spec.Env, spec.Dir)
	if err == nil && spec.Dir != "" {
		if st, serr := os.Stat(spec.Dir); serr != nil {
			err = fmt.Errorf("change directory to %s: %w", spec.Dir, serr)
		} else if !st.IsDir() {
			err = fmt.Errorf("change directory to %s: not a directory", spec.Dir)
		}
	}
	if err != nil {
		startErr = err
	} else {
		attr := &syscall.ProcAttr{
			Dir:   spec.Dir,
			Env:   spec.Env,
			Files: files,
			Sys: &syscall.SysProcAttr{
				Setsid: true, Setctty: spec.TTY != nil, Ctty: 0,
				Credential: &syscall.Credential{Uid: spec.UID, Gid: spec.GID, Groups: spec.Groups},
			},
		}
		if os.Geteuid() != 0 {
			if uint32(os.Geteuid()) != spec.UID {
				startErr = fmt.Errorf("run as uid %d: the agent is not root", spec.UID)
			}
			attr.Sys.Credential = nil
		}
		if startErr == nil {
			// The reaper looks waiters up under m.mu: holding it across the
			// fork means the exit status cannot be reaped before it is expected.
			m.mu.Lock()
			pid, err := m.spawn(p.cg, spec.Join, path, spec.Argv, attr)
			if err == nil {
				m.waiters[pid] = exitCh
			}
			m.mu.Unlock()
			if err != nil {
				startErr = fmt.Errorf("execute %s: %w", path, err)
			} else {
				select {
				case m.kick <- struct{}{}:
				default:
				}
				p.Pid = pid
			}
		}
	}
	for _, f := range closeAfter {
		f.Close()
	}
	closeAfter = nil

	p.mem0, p.oom0 = m.mem.oomKills(), m.mem.limitHits()
	p.Started = time.Now()
	m.mu.Lock()
	m.procs[p.ID] = p
	m.order = append(m.order, p)
	m.mu.Unlock()

	if startErr != nil {
		closeOurs()
		p.stdin, p.stdinFile = nil, nil
		p.finish(&dsecv1.ExecExited{ExitCode: 127, Status: dsecv1.ExitStatus_EXIT_STATUS_START_ERROR,
			Message: "could not start: " + startErr.Error()})
		return p, nil
	}

	var readers sync.WaitGroup
	if outR != nil {
		readers.Add(2)
		go p.readOutput(outR, Stdout, &readers)
		go p.readOutput(errR, Stderr, &readers)
	}
	if p.stdin != nil {
		if len(spec.Stdin) > 0 || !spec.KeepStdinOpen {
			go func() {
				if len(spec.Stdin) > 0 {
					p.WriteStdin(spec.Stdin, !spec.KeepStdinOpen)
				} else {
					p.WriteStdin(nil, true)
				}
			}()
		}
	}
	if spec.Timeout > 0 {
		p.timer = time.AfterFunc(spec.Timeout, func() {
			p.mu.Lock()
			p.timedOut = true
			p.mu.Unlock()
			p.KillTree()
		})
	}
	go p.wait(exitCh, &readers, spec.Timeout, spec.KillOnExit)
	return p, nil
}

func newID() string {
	b := make([]byte, 8)
	rand.Read(b)
	return "p-" + hex.EncodeToString(b)
}

// Get finds a process by ID, or by tag (the newest process with that tag).
func (m *Manager) Get(idOrTag string) (*Process, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if p, ok := m.procs[idOrTag]; ok {
		return p, nil
	}
	for i := len(m.order) - 1; i >= 0; i-- {
		if p := m.order[i]; p.Tag != "" && p.Tag == idOrTag {
			return p, nil
		}
	}
	return nil, fmt.Errorf("find process %q: %w", idOrTag, errdefs.ErrNotFound)
}

// List returns running and recently exited processes, oldest first.
func (m *Manager) List() []*Process {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]*Process(nil), m.order...)
}

// forget drops exited processes beyond the configured bound and frees the
// output of all but the newest few exited background processes.
func (m *Manager) forget() {
	m.mu.Lock()
	defer m.mu.Unlock()
	exited := 0
	for _, p := range m.order {
		if p.Done() {
			exited++
		}
	}
	kept := m.order[:0]
	withOutput := 0
	for i := len(m.order) - 1; i >= 0; i-- {
		p := m.order[i]
		if p.Done() && p.Background {
			withOutput++
			if withOutput > keptOutputs {
				p.Release()
			}
		}
	}
	for _, p := range m.order {
		if p.Done() && exited > m.cfg.KeepExited {
			exited--
			delete(m.procs, p.ID)
			p.Release()
			continue
		}
		kept = append(kept, p)
	}
	for i := len(kept); i < len(m.order); i++ {
		m.order[i] = nil
	}
	m.order = kept
}

// Process is one started command.
type Process struct {
	m          *Manager
	ID         string
	Tag        string
	Pid        int
	Argv       []string
	Background bool
	Started    time.Time

	cg    *cgroup
	mem0  int64
	oom0  int64 // limitHits at the start, or -1
	timer *time.Timer
	limit int64

	stdinFile *os.File // set once at start; closed at exit
	stdinMu   sync.Mutex
	stdin     *os.File // nil once closed

	first *Follower // made at Start for Spec.Followed

	mu        sync.Mutex
	chunks    []Chunk // retained output: the first limit bytes of each stream
	released  bool
	followers []*Follower // streams following the output (Follow, Spec.Followed)
	release   bool        // a Release came while followers read: done by the last Close
	retained  [3]int64
	total     [3]int64
	truncated [3]bool // output past the retained part was read
	detached  bool    // output no longer taken: the process finished
	timedOut  bool
	exited    *dsecv1.ExecExited
	notify    chan struct{} // closed and renewed when output or the exit arrives
	// room is closed and renewed, while readers wait on it, when a
	// follower catches up or leaves, or the process finishes.
	room chan struct{}
	// throttled is how long readers have waited on followers (see
	// awaitReaders); throttling counts those waiting now, since throttleStart.
	throttled     time.Duration
	throttling    int
	throttleStart time.Time
	done          chan struct{}
}

// Done reports whether the process has exited and its record is final.
func (p *Process) Done() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// DoneC is closed when the process has exited and its record is final.
func (p *Process) DoneC() <-chan struct{} { return p.done }

// Exited is the exit record, or nil while running.
func (p *Process) Exited() *dsecv1.ExecExited {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exited
}

func (p *Process) readOutput(f *os.File, s Stream, wg *sync.WaitGroup) {
	defer wg.Done()
	defer f.Close()
	bp := p.m.readBufs.Get().(*[]byte)
	defer p.m.readBufs.Put(bp)
	buf := *bp
	for {
		n, err := f.Read(buf)
		if n > 0 {
			p.appendOutput(s, buf[:n])
		}
		if err != nil {
			return
		}
	}
}

// appendOutput takes b, just read from stream s: the part within the
// retained limit is kept, and all of it goes to every follower. Past the
// limit it first waits, with p.mu released, while a follower lags
// liveWindow behind (the command's pipe fills meanwhile, which slows the
// command); with no follower, what is past the limit is counted and dropped.
func (p *Process) appendOutput(s Stream, b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	keep := min(int64(len(b)), max(p.limit-p.retained[s], 0))
	if keep < int64(len(b)) {
		p.waitForFollowers()
	}
	if p.detached {
		return
	}
	p.total[s] += int64(len(b))
	var kept []byte
	if keep > 0 {
		p.retained[s] += keep
		if !p.released {
			kept = append([]byte(nil), b[:keep]...)
			p.chunks = append(p.chunks, Chunk{Stream: s, Data: kept})
		}
	}
	if keep < int64(len(b)) {
		p.truncated[s] = true
	}
	if len(p.followers) > 0 {
		live := kept
		if int64(len(kept)) < int64(len(b)) {
			live = append([]byte(nil), b...)
		}
		for _, f := range p.followers {
			f.queue = append(f.queue, Chunk{Stream: s, Data: live})
			f.lag += int64(len(b)) - keep
		}
	} else if kept == nil {
		return // nothing kept, nobody to tell
	}
	close(p.notify)
	p.notify = make(chan struct{})
}

// waitForFollowers waits, p.mu held, until no follower lags liveWindow
// behind on output past the retained part, or the process is detached.
func (p *Process) waitForFollowers() {
	for !p.detached && p.lagging() {
		if p.throttling == 0 {
			p.throttleStart = time.Now()
		}
		p.throttling++
		room := p.room
		p.mu.Unlock()
		<-room
		p.mu.Lock()
		p.throttling--
		if p.throttling == 0 {
			p.throttled += time.Since(p.throttleStart)
		}
	}
}

func (p *Process) lagging() bool {
	for _, f := range p.followers {
		if f.lag >= liveWindow {
			return true
		}
	}
	return false
}

// makeRoom wakes readers waiting for followers, p.mu held.
func (p *Process) makeRoom() {
	if p.throttling > 0 {
		close(p.room)
		p.room = make(chan struct{})
	}
}

// throttledFor is how long readers have waited on followers so far.
func (p *Process) throttledFor() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	d := p.throttled
	if p.throttling > 0 {
		d += time.Since(p.throttleStart)
	}
	return d
}

// Next returns retained chunks from index from on, waiting up to wait for
// some to arrive: what a replay gets, not what a stream following the
// process gets (see Follow). It returns the index to continue from, and the
// exit record once every chunk before it has been returned.
func (p *Process) Next(ctx context.Context, from int, wait time.Duration) ([]Chunk, *dsecv1.ExecExited, int, error) {
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		p.mu.Lock()
		if from < len(p.chunks) {
			c := p.chunks[from:]
			p.mu.Unlock()
			return c, nil, from + len(c), nil
		}
		if p.exited != nil {
			e := p.exited
			p.mu.Unlock()
			return nil, e, from, nil
		}
		ch := p.notify
		p.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, nil, from, ctx.Err()
		case <-t.C:
			return nil, nil, from, nil
		case <-ch:
		}
	}
}

// Release frees the retained output (the exit record stays). While a
// stream follows the process, the output is freed when the last one ends:
// a burst of background commands that exit before their streams read
// them must not lose their output to the bound on exited ones that keep it.
func (p *Process) Release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.followers) > 0 {
		p.release = true
		return
	}
	p.chunks = nil
	p.released = true
}

// WriteStdin writes data to the process's stdin and closes it when close is set.
func (p *Process) WriteStdin(data []byte, closeIt bool) error {
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin == nil {
		if len(data) == 0 && closeIt {
			return nil
		}
		return fmt.Errorf("write stdin of %s: stdin is closed: %w", p.ID, errdefs.ErrFailedPrecondition)
	}
	var err error
	if len(data) > 0 {
		_, err = p.stdin.Write(data)
	}
	if closeIt || err != nil {
		p.stdin.Close()
		p.stdin = nil
	}
	if err != nil {
		return fmt.Errorf("write stdin of %s: %w: %w", p.ID, err, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// KillTree SIGKILLs the process and everything it started.
func (p *Process) KillTree() {
	if p.cg != nil {
		p.cg.kill()
		return
	}
	pids := descendants(p.Pid)
	unix.Kill(-p.Pid, unix.SIGKILL)
	for _, d := range pids {
		unix.Kill(d, unix.SIGKILL)
	}
}

// Signal sends sig to the process's whole tree; 0 means KillTree.
func (p *Process) Signal(sig unix.Signal) error {
	if sig == 0 || sig == unix.SIGKILL {
		p.KillTree()
		return nil
	}
	if p.Done() && (p.cg == nil || len(p.cg.pids()) == 0) {
		return fmt.Errorf("signal process %s: it has exited: %w", p.ID, errdefs.ErrFailedPrecondition)
	}
	if p.cg != nil {
		p.cg.signal(sig)
		return nil
	}
	if err := unix.Kill(-p.Pid, sig); err != nil {
		unix.Kill(p.Pid, sig)
	}
	for _, d := range descendants(p.Pid) {
		unix.Kill(d, sig)
	}
	return nil
}

func (p *Process) wait(exitCh chan unix.WaitStatus, readers *sync.WaitGroup, timeout time.Duration, killOnExit bool) {
	ws := <-exitCh
	end := time.Now()
	if killOnExit {
		p.KillTree()
	}
	readersDone := make(chan struct{})
	go func() { readers.Wait(); close(readersDone) }()
	p.awaitReaders(readersDone)
	if p.timer != nil {
		p.timer.Stop()
	}
	p.mu.Lock()
	timedOut := p.timedOut
	p.mu.Unlock()
	e := &dsecv1.ExecExited{DurationSeconds: end.Sub(p.Started).Seconds()}
	switch {
	case ws.Exited():
		e.ExitCode = int32(ws.ExitStatus())
		e.Status = dsecv1.ExitStatus_EXIT_STATUS_OK
		if e.ExitCode != 0 {
			e.Status = dsecv1.ExitStatus_EXIT_STATUS_NONZERO
			e.Message = fmt.Sprintf("exited with code %d", e.ExitCode)
		}
	case ws.Signaled():
		e.ExitCode = -1
		e.Signal = int32(ws.Signal())
		e.Status = dsecv1.ExitStatus_EXIT_STATUS_KILLED
		e.Message = fmt.Sprintf("killed by signal %d (%s)", e.Signal, strings.ToUpper(unix.SignalName(ws.Signal())))
	}
	// A command whose own process, or one it started (a shell's pipeline
	// member, say), was OOM-killed failed for want of memory, whatever code
	// its shell then exited with. The sandbox's count is shared, so a kill
	// in a concurrent command is attributed to this one too.
	if e.Status != dsecv1.ExitStatus_EXIT_STATUS_OK && p.m.mem.oomKills() > p.mem0 {
		e.Status = dsecv1.ExitStatus_EXIT_STATUS_OOM
		e.Message = "killed by the OOM killer"
		if !ws.Signaled() {
			e.Message = fmt.Sprintf("a process it started was killed by the OOM killer; it exited with code %d", e.ExitCode)
		}
		if l := p.m.mem.limit(); l > 0 {
			e.Message += " (memory limit " + humanBytes(l) + ")"
		}
		if p.m.cfg.NodeOOM && p.oom0 >= 0 && p.m.mem.limitHits() == p.oom0 && !p.m.mem.peakAtLimit() {
			// Killed, yet the sandbox never reached its own limit: the
			// OOM killer acted for memory above it.
			e.Fault = dsecv1.Fault_FAULT_NODE_MEMORY_PRESSURE
			e.Message += "; the sandbox did not reach its own limit: the node ran short of memory"
		}
	}
	if timedOut {
		e.Status = dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT
		e.Message = fmt.Sprintf("killed at its timeout of %s", timeout)
	}
	p.finish(e)
}

// awaitReaders waits for the output readers to reach the end of the
// command's pipes, which children it left running may hold open: it gives
// up after outputGrace of reading, not counting the time the readers waited
// for a slow follower (that output is the command's own, still draining).
func (p *Process) awaitReaders(done <-chan struct{}) {
	start, base := time.Now(), p.throttledFor()
	t := time.NewTimer(outputGrace)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
		}
		left := outputGrace - (time.Since(start) - (p.throttledFor() - base))
		if left <= 0 {
			return
		}
		t.Reset(left)
	}
}

func (p *Process) finish(e *dsecv1.ExecExited) {
	if f := p.stdinFile; f != nil {
		f.Close() // unblocks a WriteStdin stuck on a full pipe
	}
	p.stdinMu.Lock()
	p.stdin = nil
	p.stdinMu.Unlock()
	p.mu.Lock()
	e.StdoutBytes, e.StderrBytes = p.total[Stdout], p.total[Stderr]
	e.StdoutTruncated, e.StderrTruncated = p.truncated[Stdout], p.truncated[Stderr]
	p.detached = true
	p.exited = e
	close(p.notify)
	p.notify = make(chan struct{})
	p.makeRoom()
	p.mu.Unlock()
	close(p.done)
	// Let the goroutine that streams the process send its exit before the
	// cleanup below (the rmdir of its cgroup takes 0.05 ms): the agent has
	// one P, and the waker would otherwise run on.
	runtime.Gosched()
	if p.cg != nil && p.cg.remove() != nil {
		p.m.mu.Lock()
		p.m.leftover = append(p.m.leftover, p.cg)
		p.m.mu.Unlock()
	}
	p.m.forget()
	if p.m.cfg.OnExit != nil {
		p.m.cfg.OnExit()
	}
}

// Info is the process's ListProcesses record.
func (p *Process) Info() *dsecv1.ProcessInfo {
	e := p.Exited()
	return &dsecv1.ProcessInfo{
		ProcessId:     p.ID,
		Pid:           int32(p.Pid),
		Tag:           p.Tag,
		Argv:          p.Argv,
		Running:       e == nil,
		Exited:        e,
		StartedUnixMs: p.Started.UnixMilli(),
	}
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return strconv.FormatInt(n>>30, 10) + " GiB"
	case n >= 1<<20:
		return strconv.FormatInt(n>>20, 10) + " MiB"
	case n >= 1<<10:
		return strconv.FormatInt(n>>10, 10) + " KiB"
	}
	return strconv.FormatInt(n, 10) + " B"
}

// descendants lists the live descendants of pid from /proc (best effort: a
// process whose parent already died was re-parented to the agent).
func descendants(pid int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	children := map[int][]int{}
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) < 2 {
			continue
		}
		pp, _ := strconv.Atoi(f[1])
		children[pp] = append(children[pp], n)
	}
	var out []int
	queue := []int{pid}
	for len(queue) > 0 {
		c := queue[0]
		queue = queue[1:]
		for _, k := range children[c] {
			out = append(out, k)
			queue = append(queue, k)
		}
	}
	return out
}
