package agent

import (
	"context"
	"dsec.dev/dsec/internal/agent/child"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/api/gen/dsec/agent/v1/agentv1connect"
	"dsec.dev/dsec/internal/agent/proc"
	"dsec.dev/dsec/internal/agent/session"
)

// ChildMain is the child mode (see package child).
func ChildMain() int { return child.Main() }

// StateDumpMain is the state-dump mode (see package session).
func StateDumpMain() int { return session.StateDumpMain() }

// asyncSignals are ignored by pid 1 so the kernel drops them: a namespace's
// init only receives signals it handles, and Go's default handlers would
// otherwise let root inside the sandbox stop the agent.
var asyncSignals = []os.Signal{
	unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGQUIT, unix.SIGUSR1, unix.SIGUSR2,
	unix.SIGPIPE, unix.SIGTSTP, unix.SIGTTIN, unix.SIGTTOU, unix.SIGALRM, unix.SIGVTALRM,
	unix.SIGPROF, unix.SIGWINCH, unix.SIGIO, unix.SIGPWR, unix.SIGXCPU, unix.SIGXFSZ,
	unix.SIGURG, unix.SIGSTKFLT,
}

// Serve runs the agent until ctx ends or the listener fails.
func Serve(ctx context.Context, cfg Config) error {
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

	pid1 := os.Getpid() == 1
	if pid1 {
		signal.Ignore(asyncSignals...)
		if cfg.Hostname != "" {
			if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
				cfg.Log.Warn("set hostname", "err", err)
			}
		}
	} else {
		signal.Ignore(unix.SIGPIPE)
	}
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("make agent non-dumpable: %w", err)
	}
	unix.Umask(0o022)
	for _, fd := range []int{cfg.ListenFD, cfg.CgroupFD, cfg.MemoryCgroupFD, cfg.PidsCgroupFD} {
		if fd >= 0 {
			unix.CloseOnExec(fd)
		}
	}

	lf := os.NewFile(uintptr(cfg.ListenFD), "listener")
	ln, err := net.FileListener(lf)
	lf.Close()
	if err != nil {
		return fmt.Errorf("use listening fd %d: %w", cfg.ListenFD, err)
	}
	defer ln.Close()

	agentPath, err := os.Executable()
	if err != nil {
		agentPath = "/.dsec/bin/dsec-agent"
	}
	h, err := newHandler(cfg, agentPath)
	if err != nil {
		return err
	}

	mux := http.NewServeMux()
	path, handler := agentv1connect.NewAgentServiceHandler(h)
	mux.Handle(path, handler)
	pingPath := agentv1connect.AgentServicePingProcedure
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != pingPath {
				h.touch()
			}
			mux.ServeHTTP(w, r)
		}),
		Protocols:         protocols,
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
