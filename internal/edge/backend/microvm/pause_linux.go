package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"time"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/cgroups"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/qmp"
	"dsec.dev/dsec/internal/vm/vmnet"
	"dsec.dev/dsec/internal/vm/vmstate"
)

// The files of a VM's run dir for pauses (package vmstate).
const (
	memoryFile = "memory"    // the guest's RAM (qemu.Config.MemoryFile)
	savedFile  = "vmstate"   // a paused VM's device state, and vmstate's meta beside it
	configFile = "qemu.json" // the VM's filled-in QEMU config, which a resume runs again
)

var _ backend.Pauser = (*Runtime)(nil)

// Pause freezes VM id (QMP stop) and, with reclaim, saves it and ends its
// QEMU, its RAM written to its file and dropped from the host's memory
// (vmstate.Pause): a VM paused so costs disk, not RAM, and stays paused
// across an edge restart. A VM already saved is left as it is.
func (r *Runtime) Pause(ctx context.Context, id string, reclaim bool) (backend.PauseStats, error) {
	dir, err := r.existing(id, "pause")
	if err != nil {
		return backend.PauseStats{}, err
	}
	if vmstate.Saved(filepath.Join(dir, savedFile)) {
		return backend.PauseStats{}, nil
	}
	q, err := r.monitor(ctx, id, dir, "pause")
	if err != nil {
		return backend.PauseStats{}, err
	}
	defer q.Close()
	if !reclaim {
		t0 := time.Now()
		if err := q.Stop(ctx); err != nil {
			return backend.PauseStats{}, fmt.Errorf("pause sandbox %s: %w", id, err)
		}
		return backend.PauseStats{Frozen: time.Since(t0)}, nil
	}
	target, watched, err := r.running(id, dir)
	if err != nil {
		return backend.PauseStats{}, fmt.Errorf("pause sandbox %s: %w", id, err)
	}
	// The agent channel goes with QEMU: from here until the resume, a dial
	// waits for the resumed guest (or the VM's delete), so a command's
	// stream broken by the pause re-attaches to it then. The session stays
	// up until QEMU is gone: the guest is saved connected, and its resume
	// tells it the host left (vmstate.Resume).
	d := r.channels.get(filepath.Join(dir, qemu.ChannelSocket))
	if err := d.Suspend(ctx); err != nil {
		return backend.PauseStats{}, fmt.Errorf("pause sandbox %s: %w", id, err)
	}
	st, err := vmstate.Pause(ctx, target, q, filepath.Join(dir, savedFile), r.log)
	if err != nil {
		if release, herr := d.Hold(ctx); herr == nil {
			release() // still running: dials go on
		}
		return backend.PauseStats{}, fmt.Errorf("pause sandbox %s: %w", id, err)
	}
	d.EndSession()
	if watched != nil {
		<-watched // its watcher wrote QEMU's end as an exit: a pause is none
	}
	os.Remove(filepath.Join(dir, exitFile))
	return backend.PauseStats{
		Frozen: st.Stop, Reclaim: st.Save + st.Exit + st.Release,
		Resident: st.Resident, Released: st.Released,
		Kept: backend.KeptMemory{Cache: st.Kept},
	}, nil
}

// Resume runs a paused VM again: a VM saved by Pause in a new QEMU that
// loads its state (vmstate.Resume; prefetch reads the RAM it had resident
// ahead), placed in the VM's cgroup before it touches the guest's RAM; a
// frozen one with QMP cont. The agent's dialer reaches the new QEMU by the
// same socket.
func (r *Runtime) Resume(ctx context.Context, id string, prefetch bool) (backend.ResumeStats, error) {
	dir, err := r.existing(id, "resume")
	if err != nil {
		return backend.ResumeStats{}, err
	}
	stateFile := filepath.Join(dir, savedFile)
	if !vmstate.Saved(stateFile) {
		t0 := time.Now()
		if err := r.cont(ctx, id, dir); err != nil {
			return backend.ResumeStats{}, fmt.Errorf("resume sandbox %s: %w", id, err)
		}
		return backend.ResumeStats{Thaw: time.Since(t0)}, nil
	}
	cfg, err := readConfig(dir)
	if err != nil {
		return backend.ResumeStats{}, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	if err := attachSaved(ctx, dir, &cfg); err != nil {
		return backend.ResumeStats{}, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	if cfg.NIC != nil {
		defer cfg.NIC.Tap.Close() // QEMU holds its own once started
	}
	st, err := readState(dir)
	if err != nil {
		return backend.ResumeStats{}, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	if r.layout == nil {
		return backend.ResumeStats{}, fmt.Errorf("resume sandbox %s: the microvm runtime is not initialised: %w", id, errdefs.ErrFailedPrecondition)
	}
	// No session until the restored guest has seen the host leave: the
	// edge's dials (its watch of the agent among them, and the streams the
	// pause broke) wait meanwhile. Hold takes over the pause's suspension.
	release, err := r.channels.get(filepath.Join(dir, qemu.ChannelSocket)).Hold(ctx)
	if err != nil {
		return backend.ResumeStats{}, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	defer release()
	p, rs, err := vmstate.Resume(ctx, cfg, stateFile, vmstate.ResumeOptions{
		Prefetch: prefetch,
		// The cgroup and its limits are the VM's since Start.
		Started: func(p *qemu.Process) error { return r.layout.Place(r.cgroupRel(id), p.Pid(), cgroups.Limits{}) },
	}, r.log)
	if err != nil {
		return backend.ResumeStats{}, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	v := &vm{p: p, watched: make(chan struct{})}
	r.mu.Lock()
	r.vms[id] = v
	r.mu.Unlock()
	go r.watch(id, v)
	st.Pid = p.Pid()
	if st.StartTicks, err = startTicks(p.Pid()); err == nil {
		err = writeState(dir, st)
	}
	if err != nil {
		// The VM runs, but no later instance could find it: end it; the
		// saved state is kept for another try.
		p.Kill()
		<-v.watched
		os.Remove(filepath.Join(dir, exitFile))
		return backend.ResumeStats{}, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	if err := vmstate.Discard(stateFile); err != nil {
		r.log.Warn("discard a resumed vm's state", "id", id, "err", err)
	}
	r.setFrozen(id, false)
	r.log.Info("vm sandbox resumed", "id", id, "pid", p.Pid(), "start", rs.Start, "load", rs.Load, "channel", rs.Channel,
		"prefetched", rs.PrefetchSize)
	return backend.ResumeStats{
		Prefetch: rs.Prefetch, Thaw: rs.Start + rs.Load + rs.Cont + rs.Channel, Advised: rs.PrefetchSize,
	}, nil
}

// Frozen reports whether VM id is paused: saved, or its vCPUs stopped.
func (r *Runtime) Frozen(ctx context.Context, id string) (bool, error) {
	dir, err := r.existing(id, "read the state of")
	if err != nil {
		return false, err
	}
	if st, err := readState(dir); err == nil && !alive(st.Pid, st.StartTicks) {
		return vmstate.Saved(filepath.Join(dir, savedFile)), nil
	}
	q, err := r.monitor(ctx, id, dir, "read the state of")
	if err != nil {
		return false, err
	}
	defer q.Close()
	s, err := q.QueryStatus(ctx)
	if err != nil {
		return false, fmt.Errorf("read the state of sandbox %s: %w", id, err)
	}
	return !s.Running, nil
}

// Freeze stops VM id's vCPUs, its memory kept (a capture of its disk). A
// running guest first syncs (syncGuest), so its writable disk holds what
// the sandbox wrote; QMP stop then flushes QEMU's block layer to the
// disk's file. A VM saved by Pause is frozen already.
func (r *Runtime) Freeze(ctx context.Context, id string) error {
	dir, err := r.existing(id, "freeze")
	if err != nil {
		return err
	}
	if vmstate.Saved(filepath.Join(dir, savedFile)) {
		return nil
	}
	q, err := r.monitor(ctx, id, dir, "freeze")
	if err != nil {
		return err
	}
	st, err := q.QueryStatus(ctx)
	q.Close() // QEMU's monitor takes one client at a time: not held through the sync
	if err != nil {
		return fmt.Errorf("freeze sandbox %s: %w", id, err)
	}
	if st.Running {
		r.syncGuest(ctx, id, dir)
	}
	if q, err = r.monitor(ctx, id, dir, "freeze"); err != nil {
		return err
	}
	defer q.Close()
	if err := q.Stop(ctx); err != nil {
		return fmt.Errorf("freeze sandbox %s: %w", id, err)
	}
	r.setFrozen(id, true)
	return nil
}

// setFrozen records whether Freeze stopped VM id's vCPUs: Status asks
// the agent of a VM that is not.
func (r *Runtime) setFrozen(id string, frozen bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if frozen {
		r.frozen[id] = true
	} else {
		delete(r.frozen, id)
	}
}

// Thaw runs VM id's vCPUs again; a VM saved by Pause is resumed.
func (r *Runtime) Thaw(ctx context.Context, id string) error {
	dir, err := r.existing(id, "thaw")
	if err != nil {
		return err
	}
	if vmstate.Saved(filepath.Join(dir, savedFile)) {
		_, err := r.Resume(ctx, id, false)
		return err
	}
	if err := r.cont(ctx, id, dir); err != nil {
		return fmt.Errorf("thaw sandbox %s: %w", id, err)
	}
	return nil
}

func (r *Runtime) cont(ctx context.Context, id, dir string) error {
	q, err := r.monitor(ctx, id, dir, "thaw")
	if err != nil {
		return err
	}
	defer q.Close()
	if err := q.Cont(ctx); err != nil {
		return err
	}
	r.setFrozen(id, false)
	return nil
}

// existing is VM id's run dir, or NotFound.
func (r *Runtime) existing(id, verb string) (string, error) {
	if !backend.ValidID(id) {
		return "", fmt.Errorf("%s sandbox %q: %w", verb, id, errdefs.ErrNotFound)
	}
	dir := r.vmDir(id)
	if _, err := os.Stat(filepath.Join(dir, stateFile)); err != nil {
		return "", fmt.Errorf("%s sandbox %s: %w", verb, id, errdefs.ErrNotFound)
	}
	return dir, nil
}

// monitor connects to VM id's QMP monitor; a VM whose QEMU is gone (and
// not saved) cannot be frozen or thawed (FailedPrecondition).
func (r *Runtime) monitor(ctx context.Context, id, dir, verb string) (*qmp.Client, error) {
	st, err := readState(dir)
	if err != nil || !alive(st.Pid, st.StartTicks) {
		return nil, fmt.Errorf("%s sandbox %s: its QEMU is not running: %w", verb, id, errdefs.ErrFailedPrecondition)
	}
	q, err := qmp.Dial(ctx, filepath.Join(dir, qemu.QMPSocket))
	if err != nil {
		return nil, fmt.Errorf("%s sandbox %s: %w", verb, id, err)
	}
	return q, nil
}

// running is VM id's QEMU for vmstate.Pause: the process this instance
// started (with the channel its watcher closes once it recorded the end),
// else one an earlier instance started, known by its run dir.
func (r *Runtime) running(id, dir string) (vmstate.VM, <-chan struct{}, error) {
	r.mu.Lock()
	v := r.vms[id]
	r.mu.Unlock()
	if v != nil {
		return v.p, v.watched, nil
	}
	cfg, err := readConfig(dir)
	if err != nil {
		return nil, nil, err
	}
	st, err := readState(dir)
	if err != nil {
		return nil, nil, err
	}
	return adopted{cfg: cfg, st: st}, nil, nil
}

// adopted is a VM an earlier instance started: its QEMU is no child of
// ours, so its end is seen in /proc.
type adopted struct {
	cfg qemu.Config
	st  state
}

func (a adopted) Config() qemu.Config { return a.cfg }
func (a adopted) Pid() int            { return a.st.Pid }

func (a adopted) Wait(ctx context.Context) error {
	for alive(a.st.Pid, a.st.StartTicks) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for qemu %d: %w", a.st.Pid, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// savedConfig is the VM's filled-in QEMU config as its run dir keeps it:
// a resume, by this instance or a later one, starts QEMU with the same.
type savedConfig struct {
	QEMU qemu.Config `json:"qemu"`
	// NICMAC is the MAC of the VM's network card, "" without one. Its tap,
	// a descriptor, is not kept: a resume attaches the VM's namespace
	// again (vmnet.Attach opens the same persistent tap).
	NICMAC string `json:"nic_mac,omitempty"`
}

func writeConfig(dir string, cfg qemu.Config) error {
	sc := savedConfig{QEMU: cfg}
	if cfg.NIC != nil {
		sc.NICMAC = cfg.NIC.MAC.String()
	}
	sc.QEMU.NIC = nil
	b, err := json.Marshal(sc)
	if err != nil {
		return fmt.Errorf("write vm config: %w", err)
	}
	tmp := filepath.Join(dir, configFile+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write vm config: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, configFile)); err != nil {
		return fmt.Errorf("write vm config: %w", err)
	}
	return nil
}

// readConfig reads the config writeConfig wrote. A VM with a network card
// has one without its tap (NIC.Tap nil) until attachSaved.
func readConfig(dir string) (qemu.Config, error) {
	var sc savedConfig
	b, err := os.ReadFile(filepath.Join(dir, configFile))
	if errors.Is(err, fs.ErrNotExist) {
		return sc.QEMU, fmt.Errorf("read vm config: the VM was started without one (before pauses existed): %w", errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return sc.QEMU, fmt.Errorf("read vm config: %w", err)
	}
	if err := json.Unmarshal(b, &sc); err != nil {
		return sc.QEMU, fmt.Errorf("read vm config %s: %w", dir, err)
	}
	if sc.NICMAC != "" {
		mac, err := net.ParseMAC(sc.NICMAC)
		if err != nil {
			return sc.QEMU, fmt.Errorf("read vm config %s: %w", dir, err)
		}
		sc.QEMU.NIC = &qemu.NIC{MAC: mac}
	}
	return sc.QEMU, nil
}

// attachSaved gives a saved VM's network card its tap again, in the
// namespace Start recorded; the caller closes the tap once QEMU started.
func attachSaved(ctx context.Context, dir string, cfg *qemu.Config) error {
	if cfg.NIC == nil {
		return nil
	}
	ns, err := os.ReadFile(filepath.Join(dir, netnsFile))
	if err != nil {
		return fmt.Errorf("attach network: %w", err)
	}
	link, err := vmnet.Attach(ctx, string(ns))
	if err != nil {
		return err
	}
	cfg.NIC.Tap = link.Tap
	return nil
}
