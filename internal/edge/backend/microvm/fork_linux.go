package microvm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/vmnet"
	"dsec.dev/dsec/internal/vm/vmstate"
)

var _ backend.Forker = (*Runtime)(nil)

// A save for forks (SaveFork) is a directory of forksDir laid out as a
// VM's run dir: its RAM file (memoryFile), writable disk (upperDisk),
// devices' state (savedFile), QEMU config (configFile) and what it was
// given (stateFile, no pid). Children copy the RAM file and the disk and
// share the state file, which Resume only reads.

func (r *Runtime) forksDir() string           { return filepath.Join(r.cfg.StateDir, "forks") }
func (r *Runtime) forkDir(name string) string { return filepath.Join(r.forksDir(), name) }

// SaveFork saves running VM id as save name for StartFork: vmstate.Snapshot
// stops its vCPUs, writes its devices' state and, still stopped, its RAM
// file and writable disk are cloned into the save (reflinks where the file
// system shares extents, else sparse copies); then it runs on in the same
// QEMU, its agent's channel untouched. A VM paused to disk is saved
// already: its state, RAM file and disk are cloned into the save as they
// are, and it stays paused (it stood still for none of it: 0). A VM
// frozen in memory (a pause that kept it) is refused (FailedPrecondition):
// the save's run-again would thaw it; the edge resumes it first.
func (r *Runtime) SaveFork(ctx context.Context, id, name string) (time.Duration, error) {
	dir, err := r.existing(id, "fork")
	if err != nil {
		return 0, err
	}
	if !backend.ValidID(name) {
		return 0, fmt.Errorf("fork sandbox %s: save name %q: %w", id, name, errdefs.ErrInvalidArgument)
	}
	paused := vmstate.Saved(filepath.Join(dir, savedFile))
	cfg, err := readConfig(dir)
	if err != nil {
		return 0, fmt.Errorf("fork sandbox %s: %w", id, err)
	}
	st, err := readState(dir)
	if err != nil {
		return 0, fmt.Errorf("fork sandbox %s: %w", id, err)
	}
	if err := os.MkdirAll(r.forksDir(), 0o700); err != nil {
		return 0, fmt.Errorf("fork sandbox %s: %w", id, err)
	}
	save := r.forkDir(name)
	if err := os.Mkdir(save, 0o700); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return 0, fmt.Errorf("fork sandbox %s: save %s: %w", id, name, errdefs.ErrAlreadyExists)
		}
		return 0, fmt.Errorf("fork sandbox %s: %w", id, err)
	}
	defer func() {
		if err != nil {
			os.RemoveAll(save)
		}
	}()
	saved := cfg
	saved.Dir = save
	var frozen time.Duration
	if paused {
		// Its files stand still: the edge holds the sandbox's transition.
		saved, err = cloneVMFiles(cfg, save)
		for _, f := range []string{savedFile, savedFile + vmstate.MetaSuffix} {
			if err == nil {
				err = vmstate.Clone(filepath.Join(dir, f), filepath.Join(save, f))
			}
		}
	} else {
		frozen, err = r.snapshotRunning(ctx, id, dir, save, cfg, &saved)
	}
	if err != nil {
		return frozen, fmt.Errorf("fork sandbox %s: %w", id, err)
	}
	st.Pid, st.StartTicks = 0, 0
	if err = writeConfig(save, saved); err == nil {
		err = writeState(save, st)
	}
	if err != nil {
		return frozen, fmt.Errorf("fork sandbox %s: %w", id, err)
	}
	r.log.Info("vm saved for forks", "id", id, "save", name, "frozen", frozen, "paused", paused)
	return frozen, nil
}

// snapshotRunning saves running VM id (run dir dir, QEMU config cfg) into
// save for forks (vmstate.Snapshot), its files cloned there as *saved.
func (r *Runtime) snapshotRunning(ctx context.Context, id, dir, save string, cfg qemu.Config, saved *qemu.Config) (time.Duration, error) {
	q, err := r.monitor(ctx, id, dir, "fork")
	if err != nil {
		return 0, err
	}
	defer q.Close()
	st, err := q.QueryStatus(ctx)
	if err != nil {
		return 0, err
	}
	if !st.Running {
		return 0, fmt.Errorf("it is frozen in memory (%s): resume it first: %w", st.Status, errdefs.ErrFailedPrecondition)
	}
	return vmstate.Snapshot(ctx, q, filepath.Join(save, savedFile), func() error {
		var err error
		*saved, err = cloneVMFiles(cfg, save)
		return err
	})
}

// cloneVMFiles clones the RAM file and the writable disk of the VM of cfg
// into dir under a run dir's names and returns cfg with them (and Dir)
// set there. Read-only drives (the layers) are shared.
func cloneVMFiles(cfg qemu.Config, dir string) (qemu.Config, error) {
	out := cfg
	out.Dir = dir
	out.MemoryFile = filepath.Join(dir, memoryFile)
	if err := vmstate.Clone(cfg.MemoryFile, out.MemoryFile); err != nil {
		return out, err
	}
	out.Drives = append([]qemu.Drive(nil), cfg.Drives...)
	for i, d := range out.Drives {
		if d.ReadOnly {
			continue
		}
		if d.Serial != upperSerial {
			return out, fmt.Errorf("clone vm files: writable drive %q is not the upper disk", d.Serial)
		}
		out.Drives[i].Path = filepath.Join(dir, upperDisk)
		if err := vmstate.Clone(d.Path, out.Drives[i].Path); err != nil {
			return out, err
		}
	}
	return out, nil
}

// DropFork removes save name.
func (r *Runtime) DropFork(ctx context.Context, name string) error {
	if !backend.ValidID(name) {
		return fmt.Errorf("drop fork save %q: %w", name, errdefs.ErrInvalidArgument)
	}
	if err := os.RemoveAll(r.forkDir(name)); err != nil {
		return fmt.Errorf("drop fork save %s: %w", name, err)
	}
	return nil
}

// clearForks removes the saves an earlier instance left: a fork cut short
// by a restart.
func (r *Runtime) clearForks() error {
	return r.clearLeft(r.forksDir(), "removing a save left by an interrupted fork", os.RemoveAll)
}

// StartFork starts sandbox s.ID from save name: its own copies of the
// save's RAM file and writable disk, a new QEMU loading the save's state
// (vmstate.Resume) in s.ID's cgroup with s's limits, on a tap in s's
// namespace; then its agent's Reidentify gives the guest its host name
// (s.Hostname), a new machine-id, 64 bytes of the host's crypto/rand
// (reseeding its CRNG) and the namespace's MAC, address and gateway.
func (r *Runtime) StartFork(ctx context.Context, name string, s backend.Spec) (d backend.Dialer, err error) {
	if err := r.checkSpec(s); err != nil {
		return nil, err
	}
	if r.layout == nil {
		return nil, fmt.Errorf("start fork %s: the microvm runtime is not initialised: %w", s.ID, errdefs.ErrFailedPrecondition)
	}
	if !backend.ValidID(name) {
		return nil, fmt.Errorf("start fork %s: save name %q: %w", s.ID, name, errdefs.ErrInvalidArgument)
	}
	save := r.forkDir(name)
	saved, err := readConfig(save)
	if err != nil {
		return nil, fmt.Errorf("start fork %s from %s: %w", s.ID, name, err)
	}
	st, err := readState(save)
	if err != nil {
		return nil, fmt.Errorf("start fork %s from %s: %w", s.ID, name, err)
	}
	sz := sizeOf(s)
	if sz.memoryMiB != st.MemoryMiB || sz.vcpus != st.VCPUs {
		return nil, fmt.Errorf("start fork %s: the spec's %d MiB and %d vCPUs are not the saved VM's %d MiB and %d: %w",
			s.ID, sz.memoryMiB, sz.vcpus, st.MemoryMiB, st.VCPUs, errdefs.ErrInvalidArgument)
	}
	if (saved.NIC != nil) != (s.NetnsPath != "") {
		return nil, fmt.Errorf("start fork %s: the saved VM has a network card: %v, the spec a network: %v: %w",
			s.ID, saved.NIC != nil, s.NetnsPath != "", errdefs.ErrInvalidArgument)
	}
	dir := r.vmDir(s.ID)
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("start fork %s: %w", s.ID, errdefs.ErrAlreadyExists)
		}
		return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
	}
	defer func() {
		if err != nil {
			if derr := r.Delete(context.WithoutCancel(ctx), s.ID); derr != nil {
				r.log.Warn("remove half-made vm", "id", s.ID, "err", derr)
			}
		}
	}()
	start := time.Now()
	cfg, err := cloneVMFiles(saved, dir)
	if err != nil {
		return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
	}
	if err := useLayers(&cfg, s.Layers); err != nil {
		return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
	}
	tCopied := time.Now()
	var link *vmnet.Link
	if s.NetnsPath != "" {
		if link, err = r.attachNetwork(ctx, dir, s.NetnsPath); err != nil {
			return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
		}
		defer link.Tap.Close() // QEMU holds its own once started
		cfg.NIC = &qemu.NIC{Tap: link.Tap, MAC: link.Guest.MAC}
	}
	dialer := r.channels.get(filepath.Join(dir, qemu.ChannelSocket))
	release, err := dialer.Hold(ctx)
	if err != nil {
		return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
	}
	defer release()
	var v *vm
	p, rs, err := vmstate.Resume(ctx, cfg, filepath.Join(save, savedFile), vmstate.ResumeOptions{
		Started: func(p *qemu.Process) error {
			// Registered at once, so a failure from here on kills it.
			v = &vm{p: p, watched: make(chan struct{})}
			r.mu.Lock()
			r.vms[s.ID] = v
			r.mu.Unlock()
			go r.watch(s.ID, v)
			return r.layout.Place(r.cgroupRel(s.ID), p.Pid(), r.limits(s, sz))
		},
	}, r.log)
	if err != nil {
		return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
	}
	if err := writeConfig(dir, p.Config()); err != nil {
		return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
	}
	st.Pid = p.Pid()
	if st.StartTicks, err = startTicks(p.Pid()); err != nil {
		return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
	}
	if err := writeState(dir, st); err != nil {
		return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
	}
	if err := linkLog(s.LogPath, filepath.Join(dir, qemu.ConsoleLog)); err != nil {
		return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
	}
	release()
	tResumed := time.Now()
	req, err := reidentifyRequest(s.Hostname, saved.NIC, link)
	if err != nil {
		return nil, fmt.Errorf("start fork %s: %w", s.ID, err)
	}
	client := agentclient.New(dialer.Dial)
	defer client.Close()
	if _, err := client.Reidentify(ctx, connect.NewRequest(req)); err != nil {
		return nil, fmt.Errorf("start fork %s: reidentify the guest: %w", s.ID, err)
	}
	r.log.Info("vm sandbox forked", "id", s.ID, "save", name, "copy_took", tCopied.Sub(start),
		"resume_took", tResumed.Sub(tCopied), "load", rs.Load, "reidentify_took", time.Since(tResumed))
	return dialer.Dial, nil
}

// useLayers points cfg's read-only drives, bottom first, at layers (the
// child's mounts of the parent's layers).
func useLayers(cfg *qemu.Config, layers []backend.Layer) error {
	i := 0
	for j, d := range cfg.Drives {
		if !d.ReadOnly {
			continue
		}
		if i >= len(layers) {
			return fmt.Errorf("use layers: the saved VM has more layers than the spec's %d: %w", len(layers), errdefs.ErrInvalidArgument)
		}
		cfg.Drives[j].Path = layers[i].File
		i++
	}
	if i != len(layers) {
		return fmt.Errorf("use layers: the saved VM has %d layers, the spec %d: %w", i, len(layers), errdefs.ErrInvalidArgument)
	}
	return nil
}

// reidentifyRequest is the Reidentify of a child named hostname: fresh
// entropy and a machine-id from the host's crypto/rand and, with a
// network, the MAC of the saved card (old) replaced by the child's link's
// with its address and gateway.
func reidentifyRequest(hostname string, old *qemu.NIC, link *vmnet.Link) (*agentv1.ReidentifyRequest, error) {
	entropy := make([]byte, 64)
	id := make([]byte, 16)
	if _, err := rand.Read(entropy); err != nil {
		return nil, fmt.Errorf("read entropy: %w", err)
	}
	if _, err := rand.Read(id); err != nil {
		return nil, fmt.Errorf("read entropy: %w", err)
	}
	req := &agentv1.ReidentifyRequest{Hostname: hostname, MachineId: hex.EncodeToString(id), Entropy: entropy}
	if old != nil && link != nil {
		g := link.Guest
		req.Macs = map[string]string{old.MAC.String(): g.MAC.String()}
		req.Network = &agentv1.GuestNetwork{Mac: g.MAC.String(), Address: g.Addr.String(), Gateway: g.Gateway.String()}
	}
	return req, nil
}
