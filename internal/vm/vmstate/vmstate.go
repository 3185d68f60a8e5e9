// Package vmstate pauses, resumes and forks microVMs whose RAM is a file
// (qemu.Config.MemoryFile): the saved state of a VM is that RAM file, the
// devices' state QEMU writes by migration (a few tens of kilobytes, the
// RAM left out with the x-ignore-shared capability), and its disks.
//
// Pause stops the guest, saves the devices' state into a file, ends QEMU
// and drops the RAM file from the host's page cache once it is on disk, so
// a paused VM costs disk, not memory (the hosts have no swap). Resume
// starts a new QEMU with the same configuration that loads the state and
// runs on the same RAM file, its pages faulting back in from disk (or read
// ahead first: the pages resident at the pause). Fork copies a paused VM's
// RAM file and writable disks for a child (a reflink where the file system
// can, else a copy keeping holes), which Resume then runs; the caller
// gives each child its own identity through the agent afterwards
// (agentv1's Reidentify), since children start as copies of one memory.
//
// The agent's channel survives a resume: the new QEMU is handed a new
// listening socket at the same path, the guest's end of the port sees the
// host leave and come back, and the host's channel.Dialer connects again.
package vmstate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/qmp"
)

// ignoreShared is the migration capability that leaves RAM mapped shared
// from a file out of the stream: both sides find it in the file.
const ignoreShared = "x-ignore-shared"

// stateFD is the name the state file's descriptor has in QEMU (getfd).
const stateFD = "vmstate"

// channelResetWait bounds how long Resume waits for a restored guest to
// close its agent port (waitPortClosed). Past it Resume returns anyway: the host's
// dialer gets no hello then and disconnects and connects again itself,
// which costs it a second.
const channelResetWait = 10 * time.Second

// PauseStats is what Pause did.
type PauseStats struct {
	Stop    time.Duration // from the call to the vCPUs stopped
	Save    time.Duration // the devices' state written
	Exit    time.Duration // QEMU gone
	Release time.Duration // the RAM on disk and dropped from the page cache
	// Resident is QEMU's resident memory before the pause (its RSS: the
	// guest's RAM it touched and QEMU's own); Kept is what of the VM is
	// still in the host's RAM afterwards (the page cache of its RAM and
	// state files), and Released the difference.
	Resident, Released, Kept int64
	StateBytes               int64 // the devices' state file
	MemoryFileBytes          int64 // the RAM file's allocated size on disk
}

// VM is a running VM to pause: a *qemu.Process, or what an edge that
// re-adopted a VM started by an earlier one knows of it.
type VM interface {
	// Config is the VM's filled-in config (qemu.Process.Config); its
	// MemoryFile must be set.
	Config() qemu.Config
	Pid() int // QEMU's
	// Wait waits until QEMU has exited (an exit status is not an error
	// here) or ctx ends.
	Wait(ctx context.Context) error
}

// Pause saves the VM p into stateFile and ends its QEMU, then releases
// the guest's RAM from the host. q is a QMP connection to p (the monitor
// takes one client at a time, so the caller's own). The writable drives' page cache is dropped too. A failure before
// QEMU ends leaves the guest stopped (q.Cont runs it again); after that
// the VM is saved and only the release failed.
func Pause(ctx context.Context, p VM, q *qmp.Client, stateFile string, log *slog.Logger) (PauseStats, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cfg := p.Config()
	if cfg.MemoryFile == "" {
		return PauseStats{}, fmt.Errorf("pause vm: its RAM is not a file (qemu.Config.MemoryFile)")
	}
	var st PauseStats
	st.Resident = processRSS(p.Pid())
	var m meta
	var err error
	if m.ChannelConnected, err = channelConnected(ctx, q); err != nil {
		return st, fmt.Errorf("pause vm: %w", err)
	}
	t0 := time.Now()
	if err := q.Stop(ctx); err != nil {
		return st, fmt.Errorf("pause vm: %w", err)
	}
	st.Stop = time.Since(t0)

	t0 = time.Now()
	if err := save(ctx, q, stateFile); err != nil {
		return st, fmt.Errorf("pause vm: %w", err)
	}
	st.Save = time.Since(t0)

	t0 = time.Now()
	if err := q.Quit(ctx); err != nil {
		return st, fmt.Errorf("pause vm: %w", err)
	}
	if err := p.Wait(ctx); err != nil && !isExitStatus(err) {
		return st, fmt.Errorf("pause vm: wait for qemu: %w", err)
	}
	st.Exit = time.Since(t0)

	t0 = time.Now()
	if m.Resident, err = residentRanges(cfg.MemoryFile); err != nil {
		return st, fmt.Errorf("pause vm: %w", err)
	}
	if err := writeMeta(stateFile, m); err != nil {
		return st, fmt.Errorf("pause vm: %w", err)
	}
	files := []string{cfg.MemoryFile, stateFile}
	for _, d := range cfg.Drives {
		if !d.ReadOnly { // read-only layers are shared with other VMs
			files = append(files, d.Path)
		}
	}
	for _, f := range files {
		if err := dropCache(f); err != nil {
			return st, fmt.Errorf("pause vm: release its memory: %w", err)
		}
	}
	st.Release = time.Since(t0)
	for _, f := range []string{cfg.MemoryFile, stateFile} {
		n, err := cachedBytes(f)
		if err != nil {
			return st, fmt.Errorf("pause vm: %w", err)
		}
		st.Kept += n
	}
	st.Released = max(st.Resident-st.Kept, 0)
	st.StateBytes = fileSize(stateFile)
	st.MemoryFileBytes = allocatedBytes(cfg.MemoryFile)
	log.Info("vm paused", "dir", cfg.Dir, "resident", st.Resident, "released", st.Released, "kept", st.Kept,
		"state_bytes", st.StateBytes, "stop", st.Stop, "save", st.Save, "exit", st.Exit, "release", st.Release)
	return st, nil
}

// save writes the stopped VM's device state into path by migration.
func save(ctx context.Context, q *qmp.Client, path string) error {
	if err := q.SetMigrationCapabilities(ctx, map[string]bool{ignoreShared: true}); err != nil {
		return fmt.Errorf("save state: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("save state: %w", err)
	}
	defer f.Close()
	if err := q.SendFD(ctx, stateFD, f); err != nil {
		return fmt.Errorf("save state: %w", err)
	}
	if err := q.Migrate(ctx, "fd:"+stateFD); err != nil {
		return fmt.Errorf("save state: %w", err)
	}
	if _, err := q.WaitMigration(ctx); err != nil {
		return fmt.Errorf("save state: %w", err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("save state: %w", err)
	}
	return f.Close()
}

// ResumeStats is what Resume did.
type ResumeStats struct {
	Prefetch     time.Duration // asking the kernel to read the hot set ahead
	PrefetchSize int64         // the bytes asked for
	Start        time.Duration // the new QEMU running, waiting for the state
	Load         time.Duration // the state loaded
	Cont         time.Duration // the vCPUs running
	Channel      time.Duration // the guest's agent port closed, its new session waiting for the host
}

// ResumeOptions tune Resume.
type ResumeOptions struct {
	// Started, when set, is called with the new QEMU before it loads the
	// state (the guest's RAM not touched yet): the place to put it in its
	// cgroup, so the pages it faults in are charged there. An error
	// fails the resume.
	Started func(p *qemu.Process) error
	// Prefetch reads the RAM file's pages resident at the pause ahead
	// (asynchronously, while QEMU starts), so the guest's first steps
	// fault fewer pages in from disk one at a time. The page cache it
	// fills is charged to the caller's cgroup, not QEMU's; under TCG here
	// it made no difference (docs/microvm.md).
	Prefetch bool
}

// Resume starts the VM saved in stateFile (by Pause, or a Fork of it)
// again in a new QEMU: cfg is the saved VM's config (for a fork, the
// child's), its MemoryFile the saved RAM. It returns once the guest runs.
// A failure kills the new QEMU; the saved state stays.
func Resume(ctx context.Context, cfg qemu.Config, stateFile string, opts ResumeOptions, log *slog.Logger) (*qemu.Process, ResumeStats, error) {
	var st ResumeStats
	if cfg.MemoryFile == "" {
		return nil, st, fmt.Errorf("resume vm: no memory file (qemu.Config.MemoryFile)")
	}
	state, err := os.Open(stateFile)
	if err != nil {
		return nil, st, fmt.Errorf("resume vm: %w", err)
	}
	defer state.Close()
	m, err := readMeta(stateFile)
	if err != nil {
		return nil, st, fmt.Errorf("resume vm: %w", err)
	}
	if opts.Prefetch {
		t0 := time.Now()
		n, err := prefetch(cfg.MemoryFile, m.Resident)
		if err != nil {
			return nil, st, fmt.Errorf("resume vm: %w", err)
		}
		st.Prefetch, st.PrefetchSize = time.Since(t0), n
	}

	t0 := time.Now()
	cfg.Incoming, cfg.Paused = true, true
	p, err := qemu.Start(ctx, cfg, log)
	if err != nil {
		return nil, st, fmt.Errorf("resume vm: %w", err)
	}
	fail := func(err error) (*qemu.Process, ResumeStats, error) {
		p.Kill()
		<-p.Done()
		return nil, st, fmt.Errorf("resume vm: %w (qemu: %s)", err, lastLine(filepath.Join(cfg.Dir, qemu.QEMULog)))
	}
	if opts.Started != nil {
		if err := opts.Started(p); err != nil {
			return fail(err)
		}
	}
	q, err := qmp.Dial(ctx, p.QMPPath())
	if err != nil {
		return fail(err)
	}
	defer q.Close()
	st.Start = time.Since(t0)

	t0 = time.Now()
	if err := q.SetMigrationCapabilities(ctx, map[string]bool{ignoreShared: true}); err != nil {
		return fail(err)
	}
	if err := q.SendFD(ctx, stateFD, state); err != nil {
		return fail(err)
	}
	if err := q.MigrateIncoming(ctx, "fd:"+stateFD); err != nil {
		return fail(err)
	}
	if _, err := q.WaitMigration(ctx); err != nil {
		return fail(err)
	}
	st.Load = time.Since(t0)

	if m.ChannelConnected {
		// The restored guest still believes the host connected: tell it
		// the host left, while its vCPUs are stopped.
		if err := disconnectChannel(ctx, q, p.ChannelPath()); err != nil {
			return fail(err)
		}
	}

	drainEvents(q) // what loading the state sent: waitPortClosed reads those after cont
	t0 = time.Now()
	if err := q.Cont(ctx); err != nil {
		return fail(err)
	}
	st.Cont = time.Since(t0)

	if m.ChannelConnected {
		t0 = time.Now()
		if err := waitPortClosed(ctx, q); err != nil {
			log.Warn("resume vm: the guest did not close its agent port; the first dial will retry", "dir", cfg.Dir, "err", err)
		}
		st.Channel = time.Since(t0)
	}
	return p, st, nil
}

// channelConnected reports whether a host is connected to the agent
// port's socket of the QEMU q monitors.
func channelConnected(ctx context.Context, q *qmp.Client) (bool, error) {
	cs, err := q.QueryChardevs(ctx)
	if err != nil {
		return false, err
	}
	for _, c := range cs {
		if c.Label == qemu.ChannelChardev {
			return !strings.HasPrefix(c.Filename, "disconnected:"), nil
		}
	}
	return false, fmt.Errorf("query chardevs: no chardev %q", qemu.ChannelChardev)
}

// disconnectChannel makes QEMU tell the guest the host left its agent
// port: a VM restored from a state saved while the host was connected
// starts believing it still is, though the new QEMU has no client, and
// the guest would read on in the old session. It connects to the port's
// socket and, once QEMU took the connection (query-chardev), disconnects
// and waits for QEMU to see that.
func disconnectChannel(ctx context.Context, q *qmp.Client, path string) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return fmt.Errorf("reset agent channel: %w", err)
	}
	if err := waitChannel(ctx, q, true); err != nil {
		conn.Close()
		return err
	}
	conn.Close()
	return waitChannel(ctx, q, false)
}

// waitChannel waits until query-chardev says the host is connected to
// the agent port's socket (or not).
func waitChannel(ctx context.Context, q *qmp.Client, connected bool) error {
	for {
		is, err := channelConnected(ctx, q)
		if err != nil {
			return fmt.Errorf("reset agent channel: %w", err)
		}
		if is == connected {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("reset agent channel: wait for connected=%v: %w", connected, ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
}

// waitPortClosed waits until the guest has closed its agent port: a
// guest told the host left ends the channel's session and closes the port
// before it opens it again for a new one, whose hello waits for the host.
// Once it has, the host's dialer connects and gets that hello at once; a
// dialer that connected earlier could come back before the guest read
// the old session's end, and the guest would miss the host leaving.
//
// It polls query-chardev's frontend-open, which is the guest's side of
// the port, and follows the port's VSERPORT_CHANGE events: the guest's
// listener waits 10 ms before it opens the port again, which polling
// alone missed under load (several restores at once on a busy host: a
// query's round trip took longer), and the resume then waited
// channelResetWait. QEMU sends the port's state once when the restored
// VM first runs (virtio-serial's post-load: open, as saved), then its
// changes, rate-limited to one a second per port (a close followed by an
// open within it comes as the open alone, up to a second late): an event
// saying closed, or a second event, means the guest closed the port.
func waitPortClosed(ctx context.Context, q *qmp.Client) error {
	ctx, cancel := context.WithTimeout(ctx, channelResetWait)
	defer cancel()
	events := 0
	for {
		cs, err := q.QueryChardevs(ctx)
		if err != nil {
			return fmt.Errorf("wait for the agent port to close: %w", err)
		}
		for _, c := range cs {
			if c.Label == qemu.ChannelChardev && !c.FrontendOpen {
				return nil
			}
		}
		n, closed := portEvents(q)
		if events += n; closed || events >= 2 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for the agent port to close: %w", ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
}

// portEvents reads q's pending events (dropping the others) and returns
// how many were VSERPORT_CHANGE events of the agent's port and whether one
// said the guest closed it.
func portEvents(q *qmp.Client) (n int, closed bool) {
	for {
		select {
		case ev, ok := <-q.Events():
			if !ok {
				return n, closed
			}
			var d struct {
				ID   string `json:"id"`
				Open bool   `json:"open"`
			}
			if ev.Event == "VSERPORT_CHANGE" && json.Unmarshal(ev.Data, &d) == nil && d.ID == qemu.ChannelPortID {
				n++
				closed = closed || !d.Open
			}
		default:
			return n, closed
		}
	}
}

// drainEvents drops q's pending events.
func drainEvents(q *qmp.Client) { portEvents(q) }

// isExitStatus reports whether err is QEMU's exit status rather than a
// failure to wait: a QEMU told to quit may exit with a status.
func isExitStatus(err error) bool {
	var ee interface{ ExitCode() int }
	return errors.As(err, &ee)
}

// lastLine is the last line of the file at path (QEMU's error), for
// messages.
func lastLine(path string) string {
	b, _ := os.ReadFile(path)
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == '\r') {
		b = b[:len(b)-1]
	}
	for i := len(b) - 1; i >= 0; i-- {
		if b[i] == '\n' {
			return string(b[i+1:])
		}
	}
	return string(b)
}
