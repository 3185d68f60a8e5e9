package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/container"
	"dsec.dev/dsec/internal/edge/backend/microvm"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/vm/kernel"
	"dsec.dev/dsec/internal/vm/qemu"
)

// NoRunsc turns gVisor off: Config.Runsc "none" offers no gvisor isolation
// even where a runsc is found.
const NoRunsc = "none"

// DefaultVMKernelDir is where scripts/build-vm-kernel.sh puts the microVM
// guest kernel by default.
const DefaultVMKernelDir = kernel.DefaultDir

// offers collects the node's runtimes, one per kind it offers, and why it
// lacks the isolations it lacks.
type offers struct {
	log      *slog.Logger
	runtimes map[sandbox.Kind]backend.Runtime
	missing  map[dsecv1.Isolation]string
}

// add makes kind k's runtime with open and Inits it. A runtime that cannot
// be made or made ready is not offered: with required the node refuses to
// start, else the isolation is missing for why.
func (o *offers) add(ctx context.Context, k sandbox.Kind, required bool, open func() (backend.Runtime, error)) error {
	rt, err := open()
	if err == nil {
		err = rt.Init(ctx)
	}
	if err != nil {
		if required {
			return fmt.Errorf("offer %s sandboxes: %w", k, err)
		}
		o.log.Warn("the node does not offer an isolation", "isolation", sandbox.IsolationName(k.Isolation), "err", err)
		o.missing[k.Isolation] = err.Error()
		return nil
	}
	o.runtimes[k] = rt
	return nil
}

// openRuntimes makes the node's runtimes, each Init'ed, from the container
// backends' shared base config: every isolation the node can offer is
// registered here, in one place.
//
//   - container (runc or crun, Config.Runtime): always, with the sandbox
//     and fncall profiles;
//   - gvisor (runsc, Config.Runsc): where a runsc that runs is found, beside
//     runc on the same node, with its own state, writable layers and
//     cgroups (container.Config.Runtime runsc keeps them apart);
//   - microvm (QEMU guests with their own kernel, package backend/microvm):
//     where QEMU and the guest kernel (Config.VMKernelDir) are found.
func openRuntimes(ctx context.Context, cfg Config, base container.Config, log *slog.Logger) (map[sandbox.Kind]backend.Runtime, map[dsecv1.Isolation]string, error) {
	o := &offers{log: log, runtimes: map[sandbox.Kind]backend.Runtime{}, missing: map[dsecv1.Isolation]string{}}
	if err := o.add(ctx, sandbox.ContainerKind, true, func() (backend.Runtime, error) { return container.New(base) }); err != nil {
		return nil, nil, err
	}
	if err := o.add(ctx, sandbox.FnCallKind, true, func() (backend.Runtime, error) { return container.NewFnCall(base) }); err != nil {
		return nil, nil, err
	}

	gv := base
	platform, why := runscPlatform(cfg.RunscPlatform, qemu.DetectAccel)
	gv.Runtime, gv.RuntimePath, gv.RunscPlatform = "runsc", cfg.Runsc, platform
	if cfg.Runsc != NoRunsc && cfg.Runsc != "" {
		log.Info("gVisor's platform", "platform", platform, "why", why)
	}
	switch {
	case cfg.Runsc == NoRunsc:
		o.missing[dsecv1.Isolation_ISOLATION_GVISOR] = "gVisor is turned off on this node (dsecd --runsc none)"
	case cfg.Runsc == "":
		o.missing[dsecv1.Isolation_ISOLATION_GVISOR] = "no runsc: build it with scripts/build-runsc.sh (into " +
			filepath.Dir(DefaultRunsc) + ") or give dsecd --runsc PATH"
	default:
		// A runsc named by flag or environment must work; one found on
		// the host is offered when it does.
		if err := o.add(ctx, sandbox.GVisorKind, cfg.runscRequired, func() (backend.Runtime, error) { return container.New(gv) }); err != nil {
			return nil, nil, err
		}
	}

	// microvm: where QEMU and the guest kernel are found (Init refuses,
	// naming what to install, where they are not).
	kernelDir := cfg.VMKernelDir
	if kernelDir == "" {
		kernelDir = DefaultVMKernelDir
	}
	if err := o.add(ctx, sandbox.MicroVMKind, false, func() (backend.Runtime, error) {
		return microvm.New(microvm.Config{
			StateDir:     filepath.Join(cfg.Root, "microvm"),
			KernelDir:    kernelDir,
			QEMU:         cfg.QEMU,
			AgentDir:     base.AgentDir,
			CgroupParent: base.CgroupParent + "-microvm",
			PmemLayers:   cfg.VMPmemLayers,
			Log:          log.With("component", "microvm"),
		})
	}); err != nil {
		return nil, nil, err
	}
	return o.runtimes, o.missing, nil
}

// runscPlatform is the platform the gvisor isolation runs on, and why:
// the one named (dsecd --runsc-platform), else kvm where /dev/kvm runs
// stock guests (detect, qemu.DetectAccel: the same test as the microvm
// isolation's, since a /dev/kvm of kvm_pvm on a CPU without vmx or svm
// runs neither), else systrap, which needs no KVM.
func runscPlatform(named string, detect func() (qemu.Accel, string)) (platform, why string) {
	if named != "" {
		return named, "named by --runsc-platform"
	}
	if accel, noKVM := detect(); accel != qemu.KVM {
		return "systrap", "no usable KVM: " + noKVM
	}
	return "kvm", "/dev/kvm runs stock guests"
}
