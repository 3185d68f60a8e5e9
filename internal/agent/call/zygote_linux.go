package call

import (
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/proc"
)

//go:embed zygote.py
var zygoteSource string

// zygoteStart bounds how long the zygote may take to import its preloads.
const zygoteStart = 30 * time.Second

// zygote is the warm interpreter: one python3 that forks a child per run.
type zygote struct {
	p *proc.Process
	// ctrl is our end of the SOCK_SEQPACKET pair, on the runtime's poller:
	// a goroutine waiting for the zygote parks instead of holding a thread
	// in a blocking system call, which sysmon would hand its P away from.
	ctrl    *net.UnixConn
	devNull int // stdin of runs given none

	mu      sync.Mutex
	started chan startReply // the reply to the run being started
	exits   map[int]chan unix.WaitStatus
	early   map[int]unix.WaitStatus // exits that came before their waiter
	dead    chan struct{}           // closed when the control socket ends
}

type startReply struct {
	Pid   int    `json:"pid"`
	Error string `json:"error"`
}

type message struct {
	Pid    int    `json:"pid"`
	Error  string `json:"error"`
	Exit   int    `json:"exit"`
	Status *int   `json:"status"`
}

// zygote returns the runner's warm interpreter, starting it at the first
// call; nil when the environment has no python3 or it would not start.
func (r *Runner) zygote() *zygote {
	r.zygOnce.Do(func() {
		z, err := startZygote(r.cfg)
		if err != nil {
			r.log.Warn("no warm python interpreter: python runs start python3 each time", "err", err)
			return
		}
		r.zyg = z
	})
	if r.zyg != nil {
		select {
		case <-r.zyg.dead:
			return nil
		default:
		}
	}
	return r.zyg
}

func startZygote(cfg Config) (*zygote, error) {
	python := cfg.Python
	if python == "" {
		// The PATH the calls get, not the agent's own.
		for _, d := range strings.Split(defaultPath, ":") {
			if p := d + "/python3"; unix.Access(p, unix.X_OK) == nil {
				python = p
				break
			}
		}
		if python == "" {
			return nil, fmt.Errorf("find python3 on %s: %w", defaultPath, exec.ErrNotFound)
		}
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("make the zygote's socket: %w", err)
	}
	theirs := os.NewFile(uintptr(fds[1]), "zygote-ctrl")
	p, err := cfg.Procs.Start(context.Background(), proc.Spec{
		Argv: []string{python, "-I", "-c", zygoteSource, strings.Join(cfg.Preload, ",")},
		// What callEnv gives every call but HOME: a run then sets one
		// variable, not all.
		Env:         zygoteEnv(),
		Dir:         "/",
		Background:  true,
		Tag:         "dsec-zygote",
		StateFD:     theirs, // fd 9; Start closes our copy
		OutputLimit: 64 << 10,
	})
	if err != nil {
		unix.Close(fds[0])
		return nil, fmt.Errorf("start the zygote: %w", err)
	}
	if e := p.Exited(); e != nil && e.Status == dsecv1.ExitStatus_EXIT_STATUS_START_ERROR {
		unix.Close(fds[0])
		return nil, fmt.Errorf("start the zygote: %s", e.Message)
	}
	ctrl, err := unixConn(fds[0])
	if err != nil {
		p.KillTree()
		return nil, fmt.Errorf("the zygote's socket: %w", err)
	}
	devNull, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		p.KillTree()
		ctrl.Close()
		return nil, fmt.Errorf("open /dev/null for runs' stdin: %w", err)
	}
	z := &zygote{p: p, ctrl: ctrl, devNull: devNull, exits: map[int]chan unix.WaitStatus{}, early: map[int]unix.WaitStatus{}, dead: make(chan struct{})}
	// The zygote says "zygote: ready" on stderr once its preloads are in.
	deadline := time.Now().Add(zygoteStart)
	for from := 0; ; {
		chunks, exited, next, _ := p.Next(context.Background(), from, time.Until(deadline))
		for _, c := range chunks {
			if bytes.Contains(c.Data, []byte("zygote: ready")) {
				go z.read()
				return z, nil
			}
		}
		if exited != nil || time.Now().After(deadline) {
			p.KillTree()
			ctrl.Close()
			unix.Close(devNull)
			return nil, fmt.Errorf("the zygote did not start: %s", zygoteOutput(p))
		}
		from = next
	}
}

// unixConn makes fd, a connected socket, a *net.UnixConn on the
// runtime's poller; fd itself is closed (the conn holds a duplicate).
func unixConn(fd int) (*net.UnixConn, error) {
	f := os.NewFile(uintptr(fd), "zygote-ctrl")
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		c.Close()
		return nil, fmt.Errorf("fd %d is a %T, not a unix socket", fd, c)
	}
	return uc, nil
}

// zygoteEnv is the zygote's environment: callEnv's without HOME.
func zygoteEnv() []string {
	var env []string
	for _, kv := range callEnv("", nil) {
		if !strings.HasPrefix(kv, "HOME=") {
			env = append(env, kv)
		}
	}
	return env
}

func zygoteOutput(p *proc.Process) string {
	var b []byte
	chunks, _, _, _ := p.Next(context.Background(), 0, 0)
	for _, c := range chunks {
		b = append(b, c.Data...)
	}
	return strings.TrimSpace(string(b))
}

// read dispatches the zygote's messages until its socket ends.
func (z *zygote) read() {
	defer close(z.dead)
	buf := make([]byte, 4096)
	for {
		n, err := z.ctrl.Read(buf)
		if err != nil || n == 0 {
			z.mu.Lock()
			if z.started != nil {
				z.started <- startReply{Error: "the zygote stopped"}
				z.started = nil
			}
			z.mu.Unlock()
			return
		}
		var m message
		if err := json.Unmarshal(buf[:n], &m); err != nil {
			continue
		}
		z.mu.Lock()
		switch {
		case m.Status != nil:
			ws := unix.WaitStatus(*m.Status)
			if ch, ok := z.exits[m.Exit]; ok {
				ch <- ws
				delete(z.exits, m.Exit)
			} else {
				z.early[m.Exit] = ws
			}
		case z.started != nil:
			z.started <- startReply{Pid: m.Pid, Error: m.Error}
			z.started = nil
		}
		z.mu.Unlock()
	}
}

func (z *zygote) close() {
	z.ctrl.Close()
	z.p.KillTree()
	unix.Close(z.devNull)
}

type zygoteRun struct {
	file, cwd string
	uid       uint32
	env       []string
	stdin     []byte
	timeout   time.Duration
	limit     int64 // output kept per stream
	// data is the run's RLIMIT_DATA (0 = none): the call's memory
	// limit, so that asking for more private memory than the call may
	// hold fails at once (MemoryError) instead of faulting pages in
	// until the memory cgroup's OOM killer strikes.
	data int64
}

// run forks a run of file off the zygote and waits for it; the run and
// everything it started are killed when it exits or times out.
func (z *zygote) run(ctx context.Context, cg *cgroups, run zygoteRun) *agentv1.CallStepResult {
	fail := func(msg string) *agentv1.CallStepResult {
		return &agentv1.CallStepResult{Zygote: true, Exited: &dsecv1.ExecExited{ExitCode: 127,
			Status: dsecv1.ExitStatus_EXIT_STATUS_START_ERROR, Message: msg}}
	}
	// The run's ends of its stdio are raw fds, handed to the zygote and
	// closed here at once; only the agent's ends become os.Files, made
	// non-blocking first so that their reads and writes wait on the
	// runtime's poller, not in a thread each.
	var theirs []int
	closeTheirs := func() {
		for _, fd := range theirs {
			unix.Close(fd)
		}
		theirs = nil
	}
	defer closeTheirs()
	stdinW := -1
	stdinR := z.devNull
	if len(run.stdin) > 0 {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			return fail("make pipes: " + err.Error())
		}
		stdinR, stdinW = p[0], p[1]
		theirs = append(theirs, p[0])
		if err := unix.SetNonblock(stdinW, true); err != nil {
			unix.Close(stdinW)
			return fail("make pipes: " + err.Error())
		}
	}
	var outs [2]*os.File
	defer func() {
		for _, f := range outs {
			if f != nil {
				f.Close()
			}
		}
	}()
	var outW [2]int
	for i := range outs {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			if stdinW >= 0 {
				unix.Close(stdinW)
			}
			return fail("make pipes: " + err.Error())
		}
		// The read end is an open file of its own: the run's write end
		// stays blocking.
		outW[i] = p[1]
		theirs = append(theirs, p[1])
		if err := unix.SetNonblock(p[0], true); err != nil {
			unix.Close(p[0])
			if stdinW >= 0 {
				unix.Close(stdinW)
			}
			return fail("make pipes: " + err.Error())
		}
		outs[i] = os.NewFile(uintptr(p[0]), "run-output")
	}
	hdr := zygoteHeader(run)
	fds := []int{stdinR, outW[0], outW[1]}
	fds = append(fds, cg.zygoteTasks()...)

	started := make(chan startReply, 1)
	z.mu.Lock()
	z.started = started
	z.mu.Unlock()
	t0 := time.Now()
	if _, _, err := z.ctrl.WriteMsgUnix(hdr, unix.UnixRights(fds...), nil); err != nil {
		z.mu.Lock()
		z.started = nil
		z.mu.Unlock()
		if stdinW >= 0 {
			unix.Close(stdinW)
		}
		return fail("hand the run to the zygote: " + err.Error())
	}
	// The child has its copies now (the zygote's, then the fork's).
	closeTheirs()

	var reply startReply
	select {
	case reply = <-started:
	case <-z.dead:
		if stdinW >= 0 {
			unix.Close(stdinW)
		}
		return fail("the zygote stopped")
	}
	if reply.Error != "" || reply.Pid <= 0 {
		if stdinW >= 0 {
			unix.Close(stdinW)
		}
		return fail("the zygote could not fork: " + reply.Error)
	}
	exitCh := make(chan unix.WaitStatus, 1)
	z.mu.Lock()
	if ws, ok := z.early[reply.Pid]; ok {
		exitCh <- ws
		delete(z.early, reply.Pid)
	} else {
		z.exits[reply.Pid] = exitCh
	}
	z.mu.Unlock()

	if stdinW >= 0 {
		w := os.NewFile(uintptr(stdinW), "run-stdin")
		go func() {
			w.Write(run.stdin)
			w.Close()
		}()
	}
	var out, errOut capture
	var readers sync.WaitGroup
	readers.Add(2)
	go out.read(outs[0], run.limit, &readers)
	go errOut.read(outs[1], run.limit, &readers)
	outs = [2]*os.File{} // the readers close them

	timer := time.NewTimer(run.timeout)
	defer timer.Stop()
	timedOut := false
	var ws unix.WaitStatus
	select {
	case ws = <-exitCh:
	case <-timer.C:
		timedOut = true
		cg.killZygoteRuns()
		ws = waitExit(exitCh, z.dead)
	case <-ctx.Done():
		cg.killZygoteRuns()
		ws = waitExit(exitCh, z.dead)
	case <-z.dead:
		cg.killZygoteRuns()
		ws = unix.WaitStatus(unix.SIGKILL)
	}
	end := time.Now()
	cg.killZygoteRuns() // what the run left running
	done := make(chan struct{})
	go func() { readers.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Second):
	}
	e := exitRecord(ws, end.Sub(t0), timedOut, run.timeout)
	e.StdoutBytes, e.StderrBytes = out.total, errOut.total
	e.StdoutTruncated, e.StderrTruncated = out.total > int64(len(out.buf)), errOut.total > int64(len(errOut.buf))
	return &agentv1.CallStepResult{Zygote: true, Exited: e, Stdout: out.bytes(), Stderr: errOut.bytes()}
}

// zygoteHeader is a run's header as zygote.py's header() reads it: the
// file, the directory, the uid and gid, the data limit, then each
// variable's name and value, every field ended by a NUL. None can hold a
// NUL: validate refuses one in a file's name or the environment.
func zygoteHeader(run zygoteRun) []byte {
	var b []byte
	field := func(s string) {
		b = append(b, s...)
		b = append(b, 0)
	}
	id := strconv.FormatUint(uint64(run.uid), 10)
	for _, f := range []string{run.file, run.cwd, id, id, strconv.FormatInt(max(run.data, 0), 10)} {
		field(f)
	}
	for _, kv := range run.env {
		k, v, _ := strings.Cut(kv, "=")
		field(k)
		field(v)
	}
	return b
}

// waitExit waits for the killed run's status, a second at most.
func waitExit(ch chan unix.WaitStatus, dead chan struct{}) unix.WaitStatus {
	select {
	case ws := <-ch:
		return ws
	case <-dead:
	case <-time.After(time.Second):
	}
	return unix.WaitStatus(unix.SIGKILL)
}

func exitRecord(ws unix.WaitStatus, took time.Duration, timedOut bool, timeout time.Duration) *dsecv1.ExecExited {
	e := &dsecv1.ExecExited{DurationSeconds: took.Seconds()}
	switch {
	case timedOut:
		e.ExitCode, e.Signal = -1, int32(unix.SIGKILL)
		e.Status = dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT
		e.Message = fmt.Sprintf("killed at its timeout of %s", timeout)
	case ws.Exited():
		e.ExitCode = int32(ws.ExitStatus())
		e.Status = dsecv1.ExitStatus_EXIT_STATUS_OK
		if e.ExitCode != 0 {
			e.Status = dsecv1.ExitStatus_EXIT_STATUS_NONZERO
			e.Message = fmt.Sprintf("exited with code %d", e.ExitCode)
		}
	case ws.Signaled():
		e.ExitCode, e.Signal = -1, int32(ws.Signal())
		e.Status = dsecv1.ExitStatus_EXIT_STATUS_KILLED
		e.Message = fmt.Sprintf("killed by signal %d (%s)", e.Signal, strings.ToUpper(unix.SignalName(ws.Signal())))
	}
	return e
}

// capture keeps the first limit bytes of a stream and counts the rest.
type capture struct {
	buf   []byte
	total int64
}

func (c *capture) read(f *os.File, limit int64, wg *sync.WaitGroup) {
	defer wg.Done()
	defer f.Close()
	b := make([]byte, 32<<10)
	for {
		n, err := f.Read(b)
		if n > 0 {
			c.total += int64(n)
			if room := limit - int64(len(c.buf)); room > 0 {
				c.buf = append(c.buf, b[:min(int64(n), room)]...)
			}
		}
		if err != nil {
			return
		}
	}
}

func (c *capture) bytes() []byte { return c.buf }
