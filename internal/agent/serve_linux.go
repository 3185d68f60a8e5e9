package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"syscall"
	"time"
	"unsafe"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/api/gen/dsec/agent/v1/agentv1connect"
	"dsec.dev/dsec/internal/agent/diskfree"
	"dsec.dev/dsec/internal/agent/execwire"
	"dsec.dev/dsec/internal/agent/proc"
	"dsec.dev/dsec/internal/agent/session"
	"dsec.dev/dsec/internal/flushhold"
)

// StateDumpMain is the state-dump mode (see package session).
func StateDumpMain() int { return session.StateDumpMain() }

// swallowSignals makes the agent handle the given signals and throw them
// away. As pid 1 this keeps root inside the sandbox from stopping it with
// any signal it may send (SIGKILL and SIGSTOP from inside the namespace
// never reach its init), where Go's default handlers would exit. Handling
// rather than ignoring matters for commands: a handled signal is reset to
// its default in a forked child, an ignored one would stay ignored across
// exec.
func swallowSignals(sigs ...os.Signal) {
	ch := make(chan os.Signal, 64)
	signal.Notify(ch, sigs...)
	go func() {
		for range ch {
		}
	}()
}

// fatalSignals are the signals Go's runtime would die of, or stop on, when
// nobody asked for them: every signal but SIGKILL and SIGSTOP (which cannot
// be caught) and SIGCHLD, SIGURG and SIGWINCH, which the runtime already
// handles by doing nothing. Leaving those three out matters for speed:
// every command's exit raises SIGCHLD and the runtime preempts goroutines
// with SIGURG, and a notified signal wakes a goroutine each time.
func fatalSignals() []os.Signal {
	var sigs []os.Signal
	for sig := unix.Signal(1); sig <= unix.Signal(64); sig++ {
		switch sig {
		case unix.SIGKILL, unix.SIGSTOP, unix.SIGCHLD, unix.SIGURG, unix.SIGWINCH:
			continue
		}
		sigs = append(sigs, sig)
	}
	return sigs
}

// confinePtrace keeps CAP_SYS_PTRACE, which a sandbox grants the agent for
// its statfs supervisor alone (package diskfree), from everything else: it
// leaves the bounding and inheritable sets of every thread, so no command
// can hold it after execve (root's permitted set after execve is the two
// combined), and the effective set of every thread, so only the
// supervisor's thread, which raises it again, uses it. An agent that
// cannot drop it refuses to run.
func confinePtrace() error {
	const bit = 1 << unix.CAP_SYS_PTRACE
	bounding, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, unix.CAP_SYS_PTRACE, 0, 0, 0)
	if err != nil {
		return fmt.Errorf("read the bounding set: %w", err)
	}
	// Capabilities are per thread: change every thread of the agent.
	if bounding == 1 {
		if _, _, e := syscall.AllThreadsSyscall(unix.SYS_PRCTL, unix.PR_CAPBSET_DROP, unix.CAP_SYS_PTRACE, 0); e != 0 {
			return fmt.Errorf("drop CAP_SYS_PTRACE from the bounding set: %w", e)
		}
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var caps [2]unix.CapUserData
	if err := unix.Capget(&hdr, &caps[0]); err != nil {
		return fmt.Errorf("read capabilities: %w", err)
	}
	if (caps[0].Effective|caps[0].Inheritable)&bit == 0 {
		return nil
	}
	caps[0].Effective &^= bit
	caps[0].Inheritable &^= bit // and so the ambient set
	_, _, e := syscall.AllThreadsSyscall(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&caps[0])), 0)
	if e != 0 {
		return fmt.Errorf("drop CAP_SYS_PTRACE from the effective and inheritable sets: %w", e)
	}
	return nil
}

// Serve runs the agent on the listening socket cfg.ListenFD, or on one it
// makes at cfg.ListenPath, until ctx ends or the listener fails.
func Serve(ctx context.Context, cfg Config) error {
	ln, err := listen(cfg)
	if err != nil {
		return err
	}
	cfg.ListenFD = -1
	return ServeListener(ctx, cfg, ln)
}

// listen returns the agent's listener: the socket at cfg.ListenPath,
// made here (gVisor: the host links the file elsewhere and removes this
// name, so the listener must not remove what is there), or the listening
// fd cfg.ListenFD the runtime passed.
func listen(cfg Config) (net.Listener, error) {
	if cfg.ListenPath != "" {
		os.Remove(cfg.ListenPath)
		ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: cfg.ListenPath, Net: "unix"})
		if err != nil {
			return nil, fmt.Errorf("listen on %s: %w", cfg.ListenPath, err)
		}
		ln.SetUnlinkOnClose(false)
		return ln, nil
	}
	lf := os.NewFile(uintptr(cfg.ListenFD), "listener")
	ln, err := net.FileListener(lf)
	lf.Close()
	if err != nil {
		return nil, fmt.Errorf("use listening fd %d: %w", cfg.ListenFD, err)
	}
	return ln, nil
}

// ServeListener runs the agent on ln until ctx ends or ln fails; it closes
// ln. A microVM's agent serves the streams of its virtio-serial port this
// way (package agent/guest).
func ServeListener(ctx context.Context, cfg Config, ln net.Listener) error {
	defer ln.Close()
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Shell == "" {
		cfg.Shell = DefaultShell
	}
	if cfg.OutputLimit <= 0 {
		cfg.OutputLimit = proc.DefaultOutputLimit
	}
	// Thousands of agents share a node: keep the heap small.
	debug.SetGCPercent(50)
	debug.SetMemoryLimit(64 << 20)
	// One P: the agent relays, its commands do the work, and its CPU time
	// is the sandbox's. A second P only adds threads that wake and spin on
	// every hand-off between goroutines: exec of `true` took 0.1 to 0.3 ms
	// longer with two, side by side on the same node.
	runtime.GOMAXPROCS(1)

	pid1 := os.Getpid() == 1
	if pid1 {
		swallowSignals(fatalSignals()...)
		if cfg.Hostname != "" {
			if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
				cfg.Log.Warn("set hostname", "err", err)
			}
		}
		if err := writeHostFiles(currentHostname(), cfg.Address); err != nil {
			// A sandbox without them still runs; "localhost" may not resolve.
			cfg.Log.Warn("write /etc/hosts and /etc/hostname", "err", err)
		}
	} else {
		swallowSignals(unix.SIGPIPE)
	}
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("make agent non-dumpable: %w", err)
	}
	if err := confinePtrace(); err != nil {
		return err
	}
	// Before any command starts: commands inherit the filters installed.
	if cfg.LogRefusals {
		if err := logRefusals(); err != nil {
			return err
		}
	}
	if cfg.DiskQgroup != "" {
		if err := diskfree.Start(diskfree.Config{Root: "/", Qgroup: cfg.DiskQgroup, Log: cfg.Log}); err != nil {
			cfg.Log.Warn("statfs in the sandbox reports the node's disk, not the sandbox's limit", "err", err)
		}
	}
	if cfg.CgroupPath != "" && cfg.CgroupFD < 0 {
		fd, err := commandsCgroup(cfg.CgroupPath, cfg.PidsMax)
		if err != nil {
			return err
		}
		cfg.CgroupFD = fd
	}
	unix.Umask(0o022)
	for _, fd := range []int{cfg.ListenFD, cfg.CgroupFD, cfg.MemoryCgroupFD, cfg.PidsCgroupFD, cfg.CPUCgroupFD} {
		if fd >= 0 {
			unix.CloseOnExec(fd)
		}
	}

	agentPath := cfg.AgentPath
	if agentPath == "" {
		var err error
		if agentPath, err = os.Executable(); err != nil {
			agentPath = "/.dsec/bin/dsec-agent"
		}
	}
	h, err := newHandler(cfg, agentPath)
	if err != nil {
		return err
	}
	h.fg = newForeground(ln, cfg.Log)
	if h.calls != nil {
		// A fncall container answers once its warm interpreter is up, so
		// its first python call costs what the others do; it started at
		// a raised CPU weight for that, and goes back to the default.
		h.calls.Warm()
		if err := h.calls.Settle(); err != nil {
			cfg.Log.Warn("fncall container", "err", err)
		}
	}

	// Exec calls may come framed, without HTTP (package execwire); every
	// other connection is the Connect service's.
	// Each call's context carries its connection, whose end with the whole
	// agent channel (a microVM's) keeps a foreground command (foreground).
	ln = execwire.Split(ln, func(c net.Conn) { execwire.ServeConn(withConn(ctx, c), c, h.execFramed, cfg.Log) }, cfg.Log)

	mux := http.NewServeMux()
	// The edge's client asks for no compression; should another ask, only
	// large messages are worth it on a local socket.
	path, handler := agentv1connect.NewAgentServiceHandler(h, connect.WithCompressMinBytes(64<<10))
	mux.Handle(path, handler)
	pingPath := agentv1connect.AgentServicePingProcedure
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Handler: flushhold.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != pingPath {
				h.touch()
			}
			mux.ServeHTTP(w, r)
		})),
		Protocols:         protocols,
		ConnContext:       withConn,
		ReadHeaderTimeout: 30 * time.Second,
		ErrorLog:          slog.NewLogLogger(cfg.Log.Handler(), slog.LevelWarn),
	}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	cfg.Log.Info("agent serving", "pid", os.Getpid(), "cgroup", cfg.CgroupFD >= 0)
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve agent: %w", err)
	}
	return nil
}
