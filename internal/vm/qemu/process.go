package qemu

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// Process is one running QEMU. Its methods may be called from several
// goroutines.
type Process struct {
	cfg     Config
	cmd     *exec.Cmd
	console *consoleLog
	log     *slog.Logger

	done    chan struct{} // closed once QEMU exited and its console is read to the end
	waitErr error         // QEMU's exit; set before done closes
}

// Start starts QEMU for cfg and returns once it runs; the guest boots
// meanwhile (WaitBoot watches it). ctx bounds the start only: the VM
// outlives it. What Start made is removed again when it fails.
func Start(ctx context.Context, cfg Config, log *slog.Logger) (p *Process, err error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	bin, err := exec.LookPath(cfg.Binary)
	if err != nil {
		return nil, fmt.Errorf("start vm: QEMU %s is not installed (Debian's qemu-system-x86): %w", cfg.Binary, errdefs.ErrFailedPrecondition)
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("start vm: %w", err)
	}

	// QEMU inherits the listening sockets; ours are closed once it runs.
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	for _, name := range []string{QMPSocket, ChannelSocket, ConsoleSocket} { // fds 3, 4, 5
		f, err := listen(filepath.Join(cfg.Dir, name))
		if err != nil {
			return nil, fmt.Errorf("start vm: %w", err)
		}
		files = append(files, f)
	}
	defer func() {
		if err != nil {
			for _, name := range []string{QMPSocket, ChannelSocket, ConsoleSocket} {
				os.Remove(filepath.Join(cfg.Dir, name))
			}
		}
	}()
	// Connected before QEMU starts (the connection waits in the socket's
	// backlog), so QEMU, told to wait for the console's client, goes on at
	// once and the first line of the boot is kept.
	var d net.Dialer
	consoleConn, err := d.DialContext(ctx, "unix", filepath.Join(cfg.Dir, ConsoleSocket))
	if err != nil {
		return nil, fmt.Errorf("start vm: connect to the console: %w", err)
	}
	console, err := openConsoleLog(filepath.Join(cfg.Dir, ConsoleLog), cfg.ConsoleLimit)
	if err != nil {
		consoleConn.Close()
		return nil, fmt.Errorf("start vm: %w", err)
	}
	stderr, err := os.OpenFile(filepath.Join(cfg.Dir, QEMULog), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		consoleConn.Close()
		console.Close()
		return nil, fmt.Errorf("start vm: %w", err)
	}
	defer stderr.Close()

	cmd := exec.Command(bin, cfg.Args()...)
	cmd.Dir = cfg.Dir
	cmd.Stdout = stderr
	cmd.Stderr = stderr
	cmd.ExtraFiles = files
	if cfg.NIC != nil {
		cmd.ExtraFiles = append(cmd.ExtraFiles, cfg.NIC.Tap) // nicFD
	}
	// Its own session: the VM lives on when the edge that started it exits
	// (and is re-adopted by the next one), and a terminal's signals do not
	// reach it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		consoleConn.Close()
		console.Close()
		return nil, fmt.Errorf("start vm: run %s: %w", bin, err)
	}
	p = &Process{cfg: cfg, cmd: cmd, console: console, log: log, done: make(chan struct{})}
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		io.Copy(console, consoleConn)
		consoleConn.Close()
	}()
	go func() {
		p.waitErr = cmd.Wait()
		// QEMU's end closed the console: what it printed last is logged
		// once done closes.
		select {
		case <-copied:
		case <-time.After(5 * time.Second):
			consoleConn.Close()
			<-copied
		}
		console.Close()
		close(p.done)
	}()
	log.Info("vm started", "pid", cmd.Process.Pid, "accel", cfg.Accel, "memory_mib", cfg.MemoryMiB, "vcpus", cfg.VCPUs, "dir", cfg.Dir)
	return p, nil
}

// listen binds a Unix socket at path and returns it as a file for QEMU to
// inherit. The socket file stays when the listener is closed.
func listen(path string) (*os.File, error) {
	os.Remove(path)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false)
	f, err := ln.File()
	ln.Close()
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	return f, nil
}

// Config is the filled-in configuration the VM runs with.
func (p *Process) Config() Config { return p.cfg }

// Pid is QEMU's process ID.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// QMPPath is the QMP monitor's socket (qmp.Dial).
func (p *Process) QMPPath() string { return filepath.Join(p.cfg.Dir, QMPSocket) }

// ChannelPath is the socket of the agent's virtio-serial port
// (channel.NewDialer).
func (p *Process) ChannelPath() string { return filepath.Join(p.cfg.Dir, ChannelSocket) }

// Done is closed once QEMU has exited and its console's output is logged.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err is how QEMU exited (nil for status 0), once Done is closed.
func (p *Process) Err() error {
	select {
	case <-p.done:
		return p.waitErr
	default:
		return nil
	}
}

// Kill ends QEMU at once (SIGKILL). Wait for Done before removing the run
// directory.
func (p *Process) Kill() error {
	if err := p.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("kill qemu %d: %w", p.Pid(), err)
	}
	return nil
}

// Wait waits for QEMU to exit and returns how it exited, or ctx's error.
func (p *Process) Wait(ctx context.Context) error {
	select {
	case <-p.done:
		return p.waitErr
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ConsoleTail is the console's last lines, at most n of them.
func (p *Process) ConsoleTail(n int) string { return p.console.Tail(n) }

// consoleTailLines is how much of the console a boot failure quotes.
const consoleTailLines = 20

// WaitBoot is the boot watchdog. It calls ready until it succeeds (ready
// may block until its context ends; it is called again after an error
// that comes sooner) and returns nil then. When timeout passes first, ctx
// ends or QEMU exits, it kills QEMU, waits for it, and returns why, with
// the console's last lines: a guest that hangs at boot fails with what it
// printed.
func (p *Process) WaitBoot(ctx context.Context, timeout time.Duration, ready func(ctx context.Context) error) error {
	start := time.Now()
	bootCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	result := make(chan error, 1)
	go func() { result <- retry(bootCtx, ready) }()

	var why error
	select {
	case err := <-result:
		if err == nil {
			p.log.Info("vm booted", "pid", p.Pid(), "took", time.Since(start).Round(time.Millisecond))
			return nil
		}
		switch {
		case ctx.Err() != nil:
			why = fmt.Errorf("boot vm: %w (last probe: %v)", ctx.Err(), err)
		default:
			why = fmt.Errorf("boot vm: the guest was not ready after %s (last probe: %v): %w", timeout, err, errdefs.ErrDeadlineExceeded)
		}
	case <-p.done:
		cancel()
		<-result
		why = fmt.Errorf("boot vm: qemu exited during the boot (%v): %w", exitReason(p.waitErr), errdefs.ErrUnavailable)
	}
	p.Kill()
	<-p.done
	panicked, lines := Explain(p.ConsoleTail(consoleScanLines), consoleTailLines)
	if panicked != "" {
		why = fmt.Errorf("%w: the guest kernel panicked: %s", why, panicked)
	}
	return fmt.Errorf("%w\nconsole:\n%s", why, lines)
}

// consoleScanLines is how much of the console a failure is looked for in.
const consoleScanLines = 200

// exitReason says how QEMU exited, for people.
func exitReason(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
}

// retry calls ready until it succeeds or ctx ends, and returns its last
// error.
func retry(ctx context.Context, ready func(ctx context.Context) error) error {
	for {
		err := ready(ctx)
		if err == nil || ctx.Err() != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(50 * time.Millisecond):
		}
	}
}
