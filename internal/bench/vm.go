package bench

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend/microvm"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/vmfloor"
	dsec "dsec.dev/dsec/sdk/go"
)

// VMParts are the parts of `dsec bench vm`, in the order they run.
var VMParts = []string{"cold", "warm", "pause", "fork", "shared", "idle", "gvisor"}

// ParseVMParts reads --only: a comma-separated list of VMParts ("" or
// "all": every part), returned in VMParts' order without repeats.
func ParseVMParts(s string) ([]string, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "all" {
		return slices.Clone(VMParts), nil
	}
	want := map[string]bool{}
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if p == "restore" { // the same measurement: a resume restores the VM's memory snapshot
			p = "pause"
		}
		if !slices.Contains(VMParts, p) {
			return nil, fmt.Errorf("--only: no part %q (parts: %s)", p, strings.Join(VMParts, ","))
		}
		want[p] = true
	}
	var out []string
	for _, p := range VMParts {
		if want[p] {
			out = append(out, p)
		}
	}
	return out, nil
}

// VMOptions shape `dsec bench vm`.
type VMOptions struct {
	Env       string
	Parts     []string // of VMParts; empty: all
	Rounds    int      // cold creates → first exec of each isolation; warm pool creates
	Execs     int      // execs of `true` in one sandbox of each isolation
	WarmPool  int      // the microVM warm pool's size
	Pauses    int      // pause → resume → first exec rounds
	Forks     int      // children of each fork (the fork part)
	SharedVMs int      // microVMs reading the same file of a base layer
	SharedMiB int      // that file's size
	// SharedMemoryMiB is those microVMs' memory (0: MemoryMiB): enough for
	// a guest to keep the file in its page cache beside its kernel and
	// agent, as the target means; a guest that cannot evicts and re-reads,
	// and the side without shared pages is then bounded by the guest's
	// RAM instead of by the copies the target counts.
	SharedMemoryMiB int
	// Pmem is a second dsecd on this host, run with --vm-pmem-layers, for
	// the shared part's figure with shared pages; nil: that figure is
	// pending.
	Pmem       *dsec.Conn
	VMs        int           // idle microVMs held at once
	IdleWindow time.Duration // how long their CPU is measured
	MemoryMiB  int           // every microVM's memory
	Parallel   int           // microVM creates in flight (a TCG boot takes a core for seconds)
	// KernelDir is the node's guest kernel, for the floor VMs the cold
	// and idle parts boot beside the node's microVMs (package vmfloor);
	// "": no floors, and a note says so.
	KernelDir string
	FloorVMs  int // floor VMs the idle part holds beside its microVMs (0 = 2)
	Progress  io.Writer
}

func (o *VMOptions) logf(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// VMLatency is a distribution summary in milliseconds, with the p90 the
// VM targets name.
type VMLatency struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50_ms"`
	P90 float64 `json:"p90_ms"`
	Max float64 `json:"max_ms"`
}

func summarize90(ds []time.Duration) VMLatency {
	if len(ds) == 0 {
		return VMLatency{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	pick := func(q float64) float64 {
		i := int(q*float64(len(s))+0.5) - 1
		i = max(0, min(i, len(s)-1))
		return float64(s[i].Microseconds()) / 1000
	}
	return VMLatency{N: len(s), P50: pick(0.5), P90: pick(0.9), Max: float64(s[len(s)-1].Microseconds()) / 1000}
}

// VMPause is the pause part's figures: a microVM paused to disk (its
// memory snapshot) and resumed from it, Pauses times.
type VMPause struct {
	PauseCall     VMLatency `json:"pause_call"`
	ResumeExec    VMLatency `json:"resume_to_first_exec"`
	ResidentMiB   float64   `json:"resident_mib_p50"`    // QEMU's resident memory before a pause
	ReleasedPct   float64   `json:"released_pct_p50"`    // of it, released by the pause
	ReleasedMin   float64   `json:"released_pct_min"`    // the least any pause released
	ColdP50       float64   `json:"cold_p50_ms"`         // the cold boot the restore is against
	ColdFrom      string    `json:"cold_from"`           // where ColdP50 came from
	RestoreFaster float64   `json:"restore_speedup_p50"` // ColdP50 over ResumeExec's p50
}

// VMSharedSide is one node's figures in the shared part: host memory of
// SharedVMs microVMs that each read the same SharedMiB of a base layer.
type VMSharedSide struct {
	Node      string  `json:"node"`
	Device    string  `json:"layer_device"`          // how the layer reached the guests: virtio-blk or pmem (seen in the guest)
	BeforeMiB float64 `json:"host_mib_before_reads"` // their cgroups' memory, booted
	AfterMiB  float64 `json:"host_mib_after_reads"`  // and once every guest read the file
	ReadS     float64 `json:"read_s_p50"`            // one guest's read of the file
}

// VMShared is the shared part's figures: the node at --addr and, where
// given, a node whose layers are shared pages (dsecd --vm-pmem-layers).
type VMShared struct {
	VMs       int           `json:"vms"`
	FileMiB   int           `json:"file_mib"`
	MemoryMiB int           `json:"vm_memory_mib"`
	Blk       VMSharedSide  `json:"without_shared_pages"`
	Pmem      *VMSharedSide `json:"with_shared_pages,omitempty"`
	// HostCopyMiB is the layer file's one copy in the host's page cache,
	// counted once on each side: every guest read the whole file through
	// it, but its pages are charged to whoever read them first (the import
	// that wrote the layer, here), not to the VMs' cgroups.
	HostCopyMiB float64 `json:"host_copy_mib"`
	// Ratio is (Pmem.AfterMiB + HostCopyMiB) / (Blk.AfterMiB + HostCopyMiB).
	Ratio   float64 `json:"with_over_without,omitempty"`
	Pending string  `json:"shared_pending,omitempty"`
}

// VMIdle is the idle part's figures: VMs microVMs held at once.
type VMIdle struct {
	VMs        int     `json:"vms"`
	Started    int     `json:"started"`
	Answering  int     `json:"answering_exec"`
	BootWallS  float64 `json:"boot_wall_s"` // making them all, Parallel at a time
	MemMeanMiB float64 `json:"host_mib_per_vm_mean"`
	MemMaxMiB  float64 `json:"host_mib_per_vm_max"`
	WindowS    float64 `json:"cpu_window_s"`
	CPUMeanPct float64 `json:"cpu_pct_of_a_core_per_vm_mean"`
	CPUMaxPct  float64 `json:"cpu_pct_of_a_core_per_vm_max"`
	CPUOver    int     `json:"vms_over_cpu_target"`
	// FloorVMs floor VMs (package vmfloor) idled beside them, measured
	// at the same moment the same way: the host memory of the kernel
	// and QEMU alone.
	FloorVMs    int     `json:"floor_vms,omitempty"`
	FloorMemMiB float64 `json:"floor_host_mib_per_vm_mean,omitempty"`
	FloorCPUPct float64 `json:"floor_cpu_pct_of_a_core_per_vm_mean,omitempty"`
}

// VMCheck is one target's line: the figure, its floor measured in the
// same run (what the unchanged kernel and QEMU, or the steady exec path,
// cost by themselves; "" where none applies or it was not measured), the
// target and the verdict: PASS, MISS, FLOOR (missed, and the floor alone
// is past the target) or PENDING (not measurable yet).
type VMCheck struct {
	Name    string `json:"name"`
	Value   string `json:"value"`
	Floor   string `json:"floor,omitempty"`
	Target  string `json:"target"`
	Verdict string `json:"verdict"`
}

// VMReport is what `dsec bench vm` prints: every microVM and gVisor figure
// of issue 30 measured through one dsecd in one run, each beside its
// baseline (a runc container, a cold boot) from the same run.
type VMReport struct {
	Node           string   `json:"node"`
	Accelerator    string   `json:"accelerator"`     // the microVMs': kvm or tcg
	GVisorPlatform string   `json:"gvisor_platform"` // "" when the node offers no gvisor
	Cores          int      `json:"host_cores"`
	HostMemGiB     float64  `json:"host_memory_gib"`
	MemoryMiB      int      `json:"vm_memory_mib"`
	Parts          []string `json:"parts"`

	MicroVMCold VMLatency `json:"microvm_create_to_first_exec"`
	RuncCold    VMLatency `json:"runc_create_to_first_exec"`
	GVisorCold  VMLatency `json:"gvisor_create_to_first_exec"`
	MicroVMExec VMLatency `json:"microvm_exec_true"`
	RuncExec    VMLatency `json:"runc_exec_true"`
	GVisorExec  VMLatency `json:"gvisor_exec_true"`
	Warm        VMLatency `json:"microvm_warm_pool_create_to_first_exec"`
	WarmHits    int       `json:"warm_pool_hits"`
	// The warm figure's parts: the create call, the first exec after it,
	// and a second exec right after that.
	WarmCreateCall VMLatency `json:"microvm_warm_pool_create_call"`
	WarmFirstExec  VMLatency `json:"microvm_warm_pool_first_exec"`
	WarmSecondExec VMLatency `json:"microvm_warm_pool_second_exec"`

	// Floor is QEMU with the node's accelerator, machine, memory and
	// kernel to a trivial init's first line (package vmfloor), one boot
	// per cold round, FloorUptime the guest's own clock at that line.
	Floor       VMLatency `json:"floor_qemu_to_trivial_init"`
	FloorUptime VMLatency `json:"floor_guest_uptime_at_trivial_init"`

	Pause  *VMPause  `json:"pause,omitempty"`
	Fork   *VMFork   `json:"fork,omitempty"`
	Shared *VMShared `json:"shared,omitempty"`
	Idle   *VMIdle   `json:"idle,omitempty"`

	Checks []VMCheck `json:"checks"`
	Notes  []string  `json:"notes,omitempty"`
}

// The targets of issue 30.
const (
	coldTargetTCGMs   = 3000
	coldTargetKVMMs   = 300
	warmTargetMs      = 50
	restoreTargetX    = 10
	releasedTargetPct = 90
	resumeTargetMs    = 500
	sharedTargetRatio = 0.6
	idleMemTargetMiB  = 64
	idleCPUTargetPct  = 2
)

// vmRun is one run's state: its samples, gathered across parts.
type vmRun struct {
	c   *dsec.Conn
	o   VMOptions
	rep *VMReport

	microCold, runcCold, gvisorCold []time.Duration
	microExec, runcExec, gvisorExec []time.Duration
	floor, floorUptime              []time.Duration

	vmfloor *vmfloor.Floor // nil: no floors
}

func (r *vmRun) spec(iso dsecv1.Isolation) *dsecv1.SandboxSpec {
	s := &dsecv1.SandboxSpec{Environment: r.o.Env, Isolation: iso, Cpus: 1, IdleTimeoutSeconds: -1,
		Labels: map[string]string{"dsec-bench": "vm"}}
	if iso == dsecv1.Isolation_ISOLATION_MICROVM {
		s.MemoryMb = int64(r.o.MemoryMiB)
		s.DiskMb = 256
	} else {
		s.MemoryMb = benchMemoryMB
	}
	return s
}

// RunVM measures the parts of o through c, a dsecd on this host.
func RunVM(ctx context.Context, c *dsec.Conn, o VMOptions) (*VMReport, error) {
	if len(o.Parts) == 0 {
		o.Parts = slices.Clone(VMParts)
	}
	o.Parallel = max(o.Parallel, 1)
	rep := &VMReport{Parts: o.Parts, MemoryMiB: o.MemoryMiB, Cores: runtime.NumCPU(), HostMemGiB: hostMemGiB()}
	info, err := c.Sandboxes.GetServerInfo(ctx, connect.NewRequest(&dsecv1.GetServerInfoRequest{}))
	if err != nil {
		return nil, fmt.Errorf("ask the server what its node offers: %w", err)
	}
	nodes := info.Msg.GetNodes()
	if len(nodes) == 0 {
		return nil, fmt.Errorf("the server lists no node")
	}
	n := nodes[0]
	rep.Node = n.GetName()
	hasVM := false
	for _, k := range n.GetKinds() {
		switch k.GetIsolation() {
		case dsecv1.Isolation_ISOLATION_MICROVM:
			hasVM, rep.Accelerator = true, k.GetAccelerator()
		case dsecv1.Isolation_ISOLATION_GVISOR:
			rep.GVisorPlatform = k.GetAccelerator()
			if rep.GVisorPlatform == "" {
				rep.GVisorPlatform = "gvisor"
			}
		}
	}
	r := &vmRun{c: c, o: o, rep: rep}
	if hasVM && (slices.Contains(o.Parts, "cold") || slices.Contains(o.Parts, "idle")) {
		f, err := r.newFloor()
		if err != nil {
			rep.Notes = append(rep.Notes, "floors not measured: "+err.Error())
		} else {
			r.vmfloor = f
			defer f.Close()
		}
	}
	for _, part := range o.Parts {
		if part == "gvisor" {
			if rep.GVisorPlatform == "" {
				rep.Notes = append(rep.Notes, "gvisor: node "+n.GetName()+" offers none: "+n.GetMissing()["gvisor"])
				continue
			}
		} else if !hasVM {
			return nil, fmt.Errorf("node %s offers no microvm: %s", n.GetName(), n.GetMissing()["microvm"])
		}
		o.logf("part %s", part)
		var err error
		switch part {
		case "cold":
			err = r.cold(ctx)
		case "warm":
			err = r.warm(ctx)
		case "pause":
			err = r.pause(ctx)
		case "fork":
			err = r.fork(ctx)
		case "shared":
			err = r.shared(ctx)
		case "idle":
			err = r.idle(ctx)
		case "gvisor":
			err = r.gvisor(ctx)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", part, err)
		}
	}
	rep.MicroVMCold, rep.RuncCold, rep.GVisorCold = summarize90(r.microCold), summarize90(r.runcCold), summarize90(r.gvisorCold)
	rep.MicroVMExec, rep.RuncExec, rep.GVisorExec = summarize90(r.microExec), summarize90(r.runcExec), summarize90(r.gvisorExec)
	rep.Floor, rep.FloorUptime = summarize90(r.floor), summarize90(r.floorUptime)
	if p := rep.Pause; p != nil && rep.MicroVMCold.N > 0 {
		p.ColdP50, p.ColdFrom = rep.MicroVMCold.P50, fmt.Sprintf("the cold part's p50 (%d boots)", rep.MicroVMCold.N)
	}
	if p := rep.Pause; p != nil && p.ResumeExec.P50 > 0 {
		p.RestoreFaster = p.ColdP50 / p.ResumeExec.P50
	}
	rep.Checks = rep.checks()
	return rep, nil
}

// newFloor sets up the run's floor VMs: the node's accelerator, its
// microVMs' memory and TCG code buffer, the kernel at o.KernelDir.
func (r *vmRun) newFloor() (*vmfloor.Floor, error) {
	if r.o.KernelDir == "" {
		return nil, fmt.Errorf("no guest kernel given (--vm-kernel-dir)")
	}
	dir, err := os.MkdirTemp("", "dsec-bench-floor-")
	if err != nil {
		return nil, err
	}
	f, err := vmfloor.New(vmfloor.Config{KernelDir: r.o.KernelDir, Accel: qemu.Accel(r.rep.Accelerator), MemoryMiB: r.o.MemoryMiB,
		TCGBufferMiB: microvm.TCGBufferMiB, Dir: dir, CgroupParent: "dsec-bench-floor"})
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return f, nil
}

// cold times create → first exec of a microVM and of a runc container in
// turns, and a floor VM's boot after each pair, then execs of `true` in one
// of each in turns.
func (r *vmRun) cold(ctx context.Context) error {
	return r.turns(ctx, r.spec(dsecv1.Isolation_ISOLATION_MICROVM), &r.microCold, &r.microExec, r.bootFloor)
}

// bootFloor times one floor VM's boot to its init's line, if the run has
// floors, and ends it.
func (r *vmRun) bootFloor(ctx context.Context) (string, error) {
	if r.vmfloor == nil {
		return "", nil
	}
	vm, err := r.vmfloor.Boot(ctx)
	if err != nil {
		return "", err
	}
	r.floor, r.floorUptime = append(r.floor, vm.Ready), append(r.floorUptime, vm.Uptime)
	return fmt.Sprintf(", floor %s (guest uptime %s)", vm.Ready.Round(time.Millisecond), vm.Uptime.Round(time.Millisecond)), vm.Close()
}

// turns times create → first exec of a runc container and of spec's
// isolation in turns, Rounds times, into runcCold and *cold (then calls
// after, whose words end the round's progress line), and then execs of
// `true` in the last round's two sandboxes in turns, into runcExec and
// *execs.
func (r *vmRun) turns(ctx context.Context, spec *dsecv1.SandboxSpec, cold, execs *[]time.Duration,
	after func(context.Context) (string, error)) error {
	ctr := r.spec(dsecv1.Isolation_ISOLATION_CONTAINER)
	iso := strings.ToLower(strings.TrimPrefix(spec.GetIsolation().String(), "ISOLATION_"))
	var keep []string
	defer func() { deleteAll(r.c, keep) }()
	for i := range r.o.Rounds {
		id, d, err := createExec(ctx, r.c, ctr)
		if err != nil {
			deleteAll(r.c, []string{id})
			return fmt.Errorf("runc container: %w", err)
		}
		r.runcCold = append(r.runcCold, d)
		r.keepLast(&keep, id, i)
		oid, od, err := createExec(ctx, r.c, spec)
		if err != nil {
			deleteAll(r.c, []string{oid})
			return fmt.Errorf("%s: %w", iso, err)
		}
		*cold = append(*cold, od)
		r.keepLast(&keep, oid, i)
		more := ""
		if after != nil {
			if more, err = after(ctx); err != nil {
				return err
			}
		}
		r.o.logf("round %d: %s %s, runc %s%s", i+1, iso, od.Round(time.Millisecond), d.Round(time.Millisecond), more)
	}
	if len(keep) == 2 {
		return execTurns(ctx, r.c, r.o.Execs, []string{keep[1], keep[0]}, []*[]time.Duration{execs, &r.runcExec})
	}
	return nil
}

// keepLast deletes id unless it is of the last round, which the exec
// figures use.
func (r *vmRun) keepLast(keep *[]string, id string, round int) {
	if round == r.o.Rounds-1 {
		*keep = append(*keep, id)
		return
	}
	deleteAll(r.c, []string{id})
}

// execTurns times n execs of `true` in each sandbox of ids, in turns of
// ten, so a slow spell of the machine hits every column alike.
func execTurns(ctx context.Context, c *dsec.Conn, n int, ids []string, out []*[]time.Duration) error {
	for done := 0; done < n; done += 10 {
		for i, id := range ids {
			for range min(10, n-done) {
				t := time.Now()
				if err := execTrue(ctx, c, id); err != nil {
					return err
				}
				*out[i] = append(*out[i], time.Since(t))
			}
		}
	}
	return nil
}

// warm times create → first exec of a microVM from a warm pool of
// WarmPool; each round waits until the pool is full again, as a trainer
// whose creates come slower than the refills would see. The take starts
// the refill's boot at once, which under TCG takes a core: the figure
// includes that, as a trainer's would.
func (r *vmRun) warm(ctx context.Context) error {
	spec := r.spec(dsecv1.Isolation_ISOLATION_MICROVM)
	setPool := func(size int) error {
		_, err := r.c.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: spec, Size: int32(size)}))
		return err
	}
	if err := setPool(r.o.WarmPool); err != nil {
		return fmt.Errorf("set a warm pool of %d microVMs: %w", r.o.WarmPool, err)
	}
	defer func() {
		_, _ = r.c.Sandboxes.SetWarmPool(context.WithoutCancel(ctx), connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: spec, Size: 0}))
	}()
	if err := r.waitPool(ctx, int32(r.o.WarmPool)); err != nil {
		return err
	}
	var lat, calls, firsts, seconds []time.Duration
	for i := range r.o.Rounds {
		// A full pool: the last take's refill has booted, so no boot but
		// the one this take starts shares the machine with the round.
		if err := r.waitPool(ctx, int32(r.o.WarmPool)); err != nil {
			return err
		}
		t0 := time.Now()
		resp, err := r.c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
		if err != nil {
			return fmt.Errorf("create from the warm pool: %w", err)
		}
		created := time.Since(t0)
		sb := resp.Msg.GetSandboxes()[0]
		err = execTrue(ctx, r.c, sb.GetId())
		d := time.Since(t0)
		var second time.Duration
		if err == nil {
			t1 := time.Now()
			err = execTrue(ctx, r.c, sb.GetId())
			second = time.Since(t1)
		}
		deleteAll(r.c, []string{sb.GetId()})
		if err != nil {
			return err
		}
		if sb.GetFromWarmPool() {
			r.rep.WarmHits++
		}
		lat, calls, firsts, seconds = append(lat, d), append(calls, created), append(firsts, d-created), append(seconds, second)
		r.o.logf("round %d: %s: the create call %s, the first exec %s, a second %s (from the pool: %v)", i+1, d.Round(time.Millisecond),
			created.Round(time.Millisecond), (d - created).Round(time.Millisecond), second.Round(time.Millisecond), sb.GetFromWarmPool())
	}
	r.rep.Warm = summarize90(lat)
	r.rep.WarmCreateCall, r.rep.WarmFirstExec, r.rep.WarmSecondExec = summarize90(calls), summarize90(firsts), summarize90(seconds)
	return nil
}

// waitPool waits, up to 5 minutes, until the microVM pool of the run's
// environment holds n ready sandboxes.
func (r *vmRun) waitPool(ctx context.Context, n int32) error {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		resp, err := r.c.Sandboxes.ListWarmPools(ctx, connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
		if err != nil {
			return err
		}
		for _, p := range resp.Msg.GetPools() {
			s := p.GetSpec()
			if s.GetEnvironment() == r.o.Env && s.GetIsolation() == dsecv1.Isolation_ISOLATION_MICROVM && p.GetReady() >= n {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the microVM warm pool did not reach %d ready in 5 minutes: %v", n, resp.Msg.GetPools())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// pause pauses one microVM to disk (its RAM written to its file and
// dropped, its devices' state saved, QEMU ended) and resumes it from that
// memory snapshot, Pauses times, timing the resume to its first exec.
func (r *vmRun) pause(ctx context.Context) error {
	id, cold, err := createExec(ctx, r.c, r.spec(dsecv1.Isolation_ISOLATION_MICROVM))
	defer deleteAll(r.c, []string{id})
	if err != nil {
		return err
	}
	p := &VMPause{ColdP50: float64(cold.Microseconds()) / 1000, ColdFrom: "this part's one boot"}
	var calls, resumes []time.Duration
	var resident, released []float64
	for i := range r.o.Pauses {
		t0 := time.Now()
		resp, err := r.c.Sandboxes.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: id}))
		if err != nil {
			return fmt.Errorf("pause %d: %w", i+1, err)
		}
		calls = append(calls, time.Since(t0))
		st := resp.Msg.GetSandbox().GetLastPause()
		if st.GetResidentBytes() > 0 {
			resident = append(resident, float64(st.GetResidentBytes())/(1<<20))
			released = append(released, 100*float64(st.GetReleasedBytes())/float64(st.GetResidentBytes()))
		}
		t1 := time.Now()
		if _, err := r.c.Sandboxes.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: id})); err != nil {
			return fmt.Errorf("resume %d: %w", i+1, err)
		}
		if err := execTrue(ctx, r.c, id); err != nil {
			return fmt.Errorf("the first exec after resume %d: %w", i+1, err)
		}
		resumes = append(resumes, time.Since(t1))
		r.o.logf("round %d: paused in %s (released %.0f of %.0f MiB), resume → first exec %s", i+1,
			calls[i].Round(time.Millisecond), float64(st.GetReleasedBytes())/(1<<20), float64(st.GetResidentBytes())/(1<<20),
			resumes[i].Round(time.Millisecond))
	}
	p.PauseCall, p.ResumeExec = summarize90(calls), summarize90(resumes)
	p.ResidentMiB, p.ReleasedPct = median(resident), median(released)
	if len(released) > 0 {
		p.ReleasedMin = slices.Min(released)
	}
	r.rep.Pause = p
	return nil
}

// sharedEnv is the environment of the shared part: busybox and one file
// of mib MiB of random bytes at /bench/shared.bin, in one base layer.
func sharedEnv(mib int) string { return fmt.Sprintf("busybox:bench-shared-%d", mib) }

// ensureSharedLayer imports the shared part's base layer unless the node
// has it.
func (r *vmRun) ensureSharedLayer(ctx context.Context, c *dsec.Conn) error {
	ref := sharedEnv(r.o.SharedMiB)
	resp, err := c.Layers.ListLayers(ctx, connect.NewRequest(&dsecv1.ListLayersRequest{}))
	if err != nil {
		return err
	}
	for _, l := range resp.Msg.GetLayers() {
		if slices.Contains(l.GetRefs(), ref) {
			return nil
		}
	}
	r.o.logf("importing %s: busybox and %d MiB of random bytes", ref, r.o.SharedMiB)
	dir, err := os.MkdirTemp("", "dsec-bench-shared-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := image.BuildBusyboxRootfs(dir); err != nil {
		return fmt.Errorf("build busybox base: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "bench"), 0o755); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(dir, "bench", "shared.bin"))
	if err != nil {
		return err
	}
	_, err = io.CopyN(f, rand.Reader, int64(r.o.SharedMiB)<<20)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write the shared file: %w", err)
	}
	_, err = c.Layers.ImportLayer(ctx, connect.NewRequest(&dsecv1.ImportLayerRequest{Ref: ref, Kind: dsecv1.LayerKind_LAYER_KIND_BASE, Path: dir}))
	if err != nil {
		return fmt.Errorf("import %s: %w", ref, err)
	}
	return nil
}

// shared measures the node at --addr and, with o.Pmem, the node whose
// layers are shared pages, one after the other.
func (r *vmRun) shared(ctx context.Context) error {
	s := &VMShared{VMs: r.o.SharedVMs, FileMiB: r.o.SharedMiB, MemoryMiB: r.sharedMemoryMiB(), HostCopyMiB: float64(r.o.SharedMiB)}
	var err error
	if s.Blk, err = r.sharedOn(ctx, r.c); err != nil {
		return err
	}
	switch {
	case r.o.Pmem == nil:
		s.Pending = "no node with shared pages given (a second dsecd with --vm-pmem-layers, --shared-pmem-addr): the shared-pages figure is pending"
	default:
		side, err := r.sharedOn(ctx, r.o.Pmem)
		if err != nil {
			return fmt.Errorf("the node with shared pages: %w", err)
		}
		s.Pmem = &side
		if side.Device != "pmem" || s.Blk.Device == "pmem" {
			s.Pending = fmt.Sprintf("the layer reached the guests over %s on %s and over %s on %s: not a comparison of shared pages against none",
				s.Blk.Device, s.Blk.Node, side.Device, side.Node)
		} else if s.Blk.AfterMiB > 0 {
			s.Ratio = (side.AfterMiB + s.HostCopyMiB) / (s.Blk.AfterMiB + s.HostCopyMiB)
		}
	}
	r.rep.Shared = s
	return nil
}

// sharedMemoryMiB is the shared part's microVMs' memory.
func (r *vmRun) sharedMemoryMiB() int {
	if r.o.SharedMemoryMiB > 0 {
		return r.o.SharedMemoryMiB
	}
	return r.o.MemoryMiB
}

// sharedOn boots SharedVMs microVMs on the shared layer through c, has
// each read the whole file, and sums their cgroups' memory (guest RAM as
// QEMU holds it, QEMU's own, and the host page cache each first touched)
// before and after. The guests say how the layer reached them.
func (r *vmRun) sharedOn(ctx context.Context, c *dsec.Conn) (VMSharedSide, error) {
	var side VMSharedSide
	if err := r.ensureSharedLayer(ctx, c); err != nil {
		return side, err
	}
	spec := r.spec(dsecv1.Isolation_ISOLATION_MICROVM)
	spec.Environment = sharedEnv(r.o.SharedMiB)
	spec.MemoryMb = int64(r.sharedMemoryMiB())
	rc := *r
	rc.c = c
	ids, _, err := rc.createMany(ctx, spec, r.o.SharedVMs)
	defer deleteAll(c, ids)
	if err != nil {
		return side, err
	}
	if sb, err := c.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: ids[0]})); err == nil {
		side.Node = sb.Msg.GetNode()
	}
	side.Device = "virtio-blk"
	if out, err := execOut(ctx, c, ids[0], "ls /sys/block"); err != nil {
		return side, fmt.Errorf("list the guest's block devices: %w", err)
	} else if strings.Contains(out, "pmem") {
		side.Device = "pmem"
	}
	settle()
	if side.BeforeMiB, err = rc.memSum(ctx, ids); err != nil {
		return side, err
	}
	reads := make([]time.Duration, len(ids))
	err = rc.each(ctx, ids, func(i int, id string) error {
		t := time.Now()
		err := execOK(ctx, c, &dsecv1.ExecRequest{SandboxId: id, Command: "cat /bench/shared.bin > /dev/null"})
		reads[i] = time.Since(t)
		return err
	})
	if err != nil {
		return side, fmt.Errorf("read the shared file: %w", err)
	}
	settle()
	if side.AfterMiB, err = rc.memSum(ctx, ids); err != nil {
		return side, err
	}
	side.ReadS = summarize90(reads).P50 / 1000
	r.o.logf("%s: %d microVMs over %s: %.0f MiB before the reads, %.0f MiB after", side.Node, len(ids), side.Device, side.BeforeMiB, side.AfterMiB)
	return side, nil
}

// execOut runs command in sandbox id and returns its stdout.
func execOut(ctx context.Context, c *dsec.Conn, id, command string) (string, error) {
	stream, err := c.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: command}))
	if err != nil {
		return "", err
	}
	defer stream.Close()
	var out []byte
	for stream.Receive() {
		out = append(out, stream.Msg().GetStdout()...)
	}
	return string(out), stream.Err()
}

// settle gives the guests a moment to finish what a boot or a read left
// in flight (the page cache's writes, the agent's first timers).
func settle() { time.Sleep(3 * time.Second) }

// createMany makes n sandboxes of spec, Parallel at a time, and returns
// those made (every one, on an error too, for the caller to delete).
func (r *vmRun) createMany(ctx context.Context, spec *dsecv1.SandboxSpec, n int) ([]string, time.Duration, error) {
	ids := make([]string, n)
	errs := make([]error, n)
	sem := make(chan struct{}, r.o.Parallel)
	var wg sync.WaitGroup
	t0 := time.Now()
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			resp, err := r.c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec, WaitSeconds: 300}))
			if err != nil {
				errs[i] = err
				return
			}
			ids[i] = resp.Msg.GetSandboxes()[0].GetId()
			if (i+1)%8 == 0 {
				r.o.logf("%d of %d microVMs started", i+1, n)
			}
		}()
	}
	wg.Wait()
	made := slices.DeleteFunc(ids, func(id string) bool { return id == "" })
	for _, err := range errs {
		if err != nil {
			return made, time.Since(t0), fmt.Errorf("create %d microVMs (%d made): %w", n, len(made), err)
		}
	}
	return made, time.Since(t0), nil
}

// each calls fn for every sandbox, Parallel at a time, and returns the
// first error.
func (r *vmRun) each(ctx context.Context, ids []string, fn func(int, string) error) error {
	errs := make([]error, len(ids))
	sem := make(chan struct{}, r.o.Parallel)
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			errs[i] = fn(i, id)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// metrics reads every sandbox's metrics.
func (r *vmRun) metrics(ctx context.Context, ids []string) ([]*dsecv1.SandboxMetrics, error) {
	out := make([]*dsecv1.SandboxMetrics, len(ids))
	err := r.each(ctx, ids, func(i int, id string) error {
		m, err := r.c.Sandboxes.Metrics(ctx, connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: id}))
		if err != nil {
			return fmt.Errorf("metrics of %s: %w", id, err)
		}
		out[i] = m.Msg
		return nil
	})
	return out, err
}

// memSum is the memory of the sandboxes' cgroups together, in MiB.
func (r *vmRun) memSum(ctx context.Context, ids []string) (float64, error) {
	ms, err := r.metrics(ctx, ids)
	if err != nil {
		return 0, err
	}
	var sum float64
	for _, m := range ms {
		sum += float64(m.GetMemoryUsedBytes()) / (1 << 20)
	}
	return sum, nil
}

// idle holds VMs microVMs at once: host memory of each (its QEMU's
// cgroup), CPU of each over IdleWindow, and whether all answer an exec.
func (r *vmRun) idle(ctx context.Context) error {
	ids, wall, err := r.createMany(ctx, r.spec(dsecv1.Isolation_ISOLATION_MICROVM), r.o.VMs)
	defer deleteAll(r.c, ids)
	if err != nil {
		return err
	}
	s := &VMIdle{VMs: r.o.VMs, Started: len(ids), BootWallS: wall.Seconds(), WindowS: r.o.IdleWindow.Seconds()}
	r.o.logf("%d microVMs in %s", len(ids), wall.Round(time.Second))
	floors, err := r.idleFloors(ctx)
	defer func() {
		for _, vm := range floors {
			vm.Close()
		}
	}()
	if err != nil {
		return err
	}
	r.o.logf("%d floor VMs beside them; letting them all settle", len(floors))
	time.Sleep(10 * time.Second)
	before, err := r.metrics(ctx, ids)
	if err != nil {
		return err
	}
	floorsBefore, err := floorUsage(floors)
	if err != nil {
		return err
	}
	t0 := time.Now()
	r.o.logf("measuring their CPU over %s", r.o.IdleWindow)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(r.o.IdleWindow):
	}
	after, err := r.metrics(ctx, ids)
	if err != nil {
		return err
	}
	floorsAfter, err := floorUsage(floors)
	if err != nil {
		return err
	}
	window := time.Since(t0)
	s.WindowS = window.Seconds()
	var memSum, cpuSum float64
	for i := range ids {
		mem := float64(after[i].GetMemoryUsedBytes()) / (1 << 20)
		cpu := 100 * float64(after[i].GetCpuUsedUsec()-before[i].GetCpuUsedUsec()) / float64(window.Microseconds())
		memSum, cpuSum = memSum+mem, cpuSum+cpu
		s.MemMaxMiB, s.CPUMaxPct = max(s.MemMaxMiB, mem), max(s.CPUMaxPct, cpu)
		if cpu > idleCPUTargetPct {
			s.CPUOver++
		}
	}
	if len(ids) > 0 {
		s.MemMeanMiB, s.CPUMeanPct = memSum/float64(len(ids)), cpuSum/float64(len(ids))
	}
	if n := len(floors); n > 0 {
		var mem, cpu float64
		for i := range floors {
			mem += float64(floorsAfter[i].MemoryBytes) / (1 << 20)
			cpu += 100 * float64(floorsAfter[i].CPUUsec-floorsBefore[i].CPUUsec) / float64(window.Microseconds())
		}
		s.FloorVMs, s.FloorMemMiB, s.FloorCPUPct = n, mem/float64(n), cpu/float64(n)
	}
	var mu sync.Mutex
	r.each(ctx, ids, func(_ int, id string) error {
		if execTrue(ctx, r.c, id) == nil {
			mu.Lock()
			s.Answering++
			mu.Unlock()
		}
		return nil
	})
	r.rep.Idle = s
	return nil
}

// floorUsage reads every floor VM's cgroup.
func floorUsage(vms []*vmfloor.VM) ([]vmfloor.Usage, error) {
	out := make([]vmfloor.Usage, len(vms))
	for i, vm := range vms {
		u, err := vm.Usage()
		if err != nil {
			return nil, err
		}
		out[i] = u
	}
	return out, nil
}

// idleFloors boots the idle part's floor VMs, one at a time (none
// without floors), and returns those booted.
func (r *vmRun) idleFloors(ctx context.Context) ([]*vmfloor.VM, error) {
	if r.vmfloor == nil {
		return nil, nil
	}
	n := r.o.FloorVMs
	if n <= 0 {
		n = 2
	}
	var vms []*vmfloor.VM
	for range n {
		vm, err := r.vmfloor.Boot(ctx)
		if err != nil {
			return vms, err
		}
		vms = append(vms, vm)
	}
	return vms, nil
}

// gvisor times create → first exec of a gVisor sandbox and of a runc
// container in turns, then execs of `true` in one of each in turns.
func (r *vmRun) gvisor(ctx context.Context) error {
	return r.turns(ctx, r.spec(dsecv1.Isolation_ISOLATION_GVISOR), &r.gvisorCold, &r.gvisorExec, nil)
}

// hostMemGiB is this host's memory (MemTotal).
func hostMemGiB() float64 {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		var kb float64
		if n, _ := fmt.Sscanf(line, "MemTotal: %f kB", &kb); n == 1 {
			return kb / (1 << 20)
		}
	}
	return 0
}

func passOrMiss(ok bool) string {
	if ok {
		return "PASS"
	}
	return "MISS"
}

// checks are the report's target lines, for the parts that ran.
func (r *VMReport) checks() []VMCheck {
	var out []VMCheck
	add := func(name, value, target string, ok bool) {
		out = append(out, VMCheck{Name: name, Value: value, Target: target, Verdict: passOrMiss(ok)})
	}
	// addFloored is add with the floor beside the figure: a miss whose
	// floor alone is past the target is FLOOR.
	addFloored := func(name, value, target string, ok bool, floor string, floorPast bool) {
		c := VMCheck{Name: name, Value: value, Floor: floor, Target: target, Verdict: passOrMiss(ok)}
		if !ok && floorPast {
			c.Verdict = "FLOOR"
		}
		out = append(out, c)
	}
	ms := func(v float64) string { return fmt.Sprintf("%.0f ms", v) }
	if r.MicroVMCold.N > 0 {
		target := float64(coldTargetTCGMs)
		if r.Accelerator == "kvm" {
			target = coldTargetKVMMs
		}
		floor := ""
		if r.Floor.N > 0 {
			floor = fmt.Sprintf("%.0f ms: QEMU + the kernel to a trivial init (%+.0f ms ours)", r.Floor.P50, r.MicroVMCold.P50-r.Floor.P50)
		}
		addFloored("microvm create → first exec p50, cold", ms(r.MicroVMCold.P50),
			fmt.Sprintf("≤ %.0f ms under %s", target, r.Accelerator), r.MicroVMCold.P50 <= target, floor, r.Floor.N > 0 && r.Floor.P50 > target)
	}
	if r.Warm.N > 0 {
		// The claim and an exec in a guest that has run one: what a
		// pooled VM's first exec would cost had it run one before.
		f := r.WarmCreateCall.P50 + r.WarmSecondExec.P50
		floor := fmt.Sprintf("%.0f ms: the claim + a warm guest's exec (%+.0f ms ours)", f, r.Warm.P50-f)
		addFloored("microvm create → first exec p50, warm pool", ms(r.Warm.P50), fmt.Sprintf("≤ %d ms", warmTargetMs),
			r.Warm.P50 <= warmTargetMs, floor, f > warmTargetMs)
	}
	if p := r.Pause; p != nil && p.ResumeExec.N > 0 {
		add("restore from the memory snapshot → first exec vs a cold boot", fmt.Sprintf("%.1f× (%.0f vs %.0f ms)", p.RestoreFaster, p.ResumeExec.P50, p.ColdP50),
			fmt.Sprintf("≥ %d×", restoreTargetX), p.RestoreFaster >= restoreTargetX)
		add("pause: QEMU's host memory released (the least of any pause)", fmt.Sprintf("%.0f %% of %.0f MiB", p.ReleasedMin, p.ResidentMiB),
			fmt.Sprintf("≥ %d %%", releasedTargetPct), p.ReleasedMin >= releasedTargetPct)
		add("resume → first exec p50", ms(p.ResumeExec.P50), fmt.Sprintf("≤ %d ms", resumeTargetMs), p.ResumeExec.P50 <= resumeTargetMs)
	}
	if f := r.Fork; f != nil {
		out = append(out, f.check())
	}
	if s := r.Shared; s != nil {
		name := fmt.Sprintf("%d microVMs of %d MiB reading %d MiB of a base layer: host memory shared / not", s.VMs, s.MemoryMiB, s.FileMiB)
		if s.Ratio > 0 {
			add(name, fmt.Sprintf("%.2f× (%.0f vs %.0f MiB, the layer's host copy in both)", s.Ratio, s.Pmem.AfterMiB+s.HostCopyMiB, s.Blk.AfterMiB+s.HostCopyMiB),
				fmt.Sprintf("≤ %.1f×", sharedTargetRatio), s.Ratio <= sharedTargetRatio)
		} else {
			out = append(out, VMCheck{Name: name, Value: fmt.Sprintf("%.0f MiB over %s, shared: not measured", s.Blk.AfterMiB, s.Blk.Device),
				Target: fmt.Sprintf("≤ %.1f×", sharedTargetRatio), Verdict: "PENDING"})
		}
	}
	if s := r.Idle; s != nil {
		add(fmt.Sprintf("%d idle microVMs of %d MiB answer exec", s.VMs, r.MemoryMiB), fmt.Sprintf("%d of %d", s.Answering, s.VMs), "all", s.Answering == s.VMs)
		floor := ""
		if s.FloorVMs > 0 {
			floor = fmt.Sprintf("%.0f MiB: QEMU + the kernel idle at a trivial init (%+.0f MiB ours)", s.FloorMemMiB, s.MemMeanMiB-s.FloorMemMiB)
		}
		addFloored("host memory per idle microVM (mean)", fmt.Sprintf("%.0f MiB (max %.0f)", s.MemMeanMiB, s.MemMaxMiB), fmt.Sprintf("≤ %d MiB", idleMemTargetMiB),
			s.MemMeanMiB <= idleMemTargetMiB, floor, s.FloorVMs > 0 && s.FloorMemMiB > idleMemTargetMiB)
		floor = ""
		if s.FloorVMs > 0 {
			floor = fmt.Sprintf("%.2f %%: QEMU + the kernel idle at a trivial init (%+.2f ours)", s.FloorCPUPct, s.CPUMeanPct-s.FloorCPUPct)
		}
		addFloored("CPU per idle microVM (mean)", fmt.Sprintf("%.2f %% of a core (max %.2f, %d over)", s.CPUMeanPct, s.CPUMaxPct, s.CPUOver),
			fmt.Sprintf("≤ %d %%", idleCPUTargetPct), s.CPUMeanPct <= idleCPUTargetPct, floor, s.FloorVMs > 0 && s.FloorCPUPct > idleCPUTargetPct)
	}
	return out
}

// Print writes the report: the header, the figures side by side, the
// target lines.
func (r *VMReport) Print(w io.Writer) {
	gv := r.GVisorPlatform
	if gv == "" {
		gv = "not offered"
	}
	fmt.Fprintf(w, "dsec bench vm: node %s, microvm accelerator %s, gvisor %s; machine %d cores, %.1f GiB RAM; microVMs of %d MiB, 1 vCPU\n",
		r.Node, r.Accelerator, gv, r.Cores, r.HostMemGiB, r.MemoryMiB)
	fmt.Fprintf(w, "parts: %s\n\n", strings.Join(r.Parts, ","))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if r.RuncCold.N+r.MicroVMCold.N+r.Warm.N+r.GVisorCold.N > 0 || r.Pause != nil {
		fmt.Fprintln(tw, "figure\tp50 ms\tp90 ms\tn\tvs runc p50")
	}
	row := func(name string, l, base VMLatency) {
		if l.N == 0 {
			return
		}
		vs := "-"
		if base.P50 > 0 && l.P50 > 0 && l != base {
			vs = fmt.Sprintf("%.1f×", l.P50/base.P50)
		}
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%d\t%s\n", name, l.P50, l.P90, l.N, vs)
	}
	row("runc create → first exec", r.RuncCold, r.RuncCold)
	row("microvm create → first exec, cold", r.MicroVMCold, r.RuncCold)
	row("  floor: QEMU + the kernel to a trivial init", r.Floor, r.RuncCold)
	row("  floor: the guest's uptime at that init", r.FloorUptime, VMLatency{})
	row("microvm create → first exec, warm pool", r.Warm, r.RuncCold)
	row("  of which the create call", r.WarmCreateCall, VMLatency{})
	row("  of which the first exec", r.WarmFirstExec, VMLatency{})
	row("  a second exec right after", r.WarmSecondExec, VMLatency{})
	row("gvisor create → first exec", r.GVisorCold, r.RuncCold)
	row("runc exec true", r.RuncExec, r.RuncExec)
	row("microvm exec true", r.MicroVMExec, r.RuncExec)
	row("gvisor exec true", r.GVisorExec, r.RuncExec)
	if p := r.Pause; p != nil {
		row("microvm pause to disk (the call)", p.PauseCall, VMLatency{})
		row("microvm resume → first exec", p.ResumeExec, VMLatency{})
	}
	tw.Flush()
	if r.Warm.N > 0 {
		fmt.Fprintf(w, "warm pool: %d of %d creates were served by the pool (each round waits for a full pool)\n", r.WarmHits, r.Warm.N)
	}
	if p := r.Pause; p != nil {
		fmt.Fprintf(w, "pause: QEMU held %.0f MiB before a pause (p50); a pause released %.0f %% (p50), %.0f %% at least; the cold boot: %s\n",
			p.ResidentMiB, p.ReleasedPct, p.ReleasedMin, p.ColdFrom)
	}
	if f := r.Fork; f != nil {
		f.print(w)
	}
	if s := r.Shared; s != nil {
		for _, side := range []*VMSharedSide{&s.Blk, s.Pmem} {
			if side == nil {
				continue
			}
			fmt.Fprintf(w, "shared: %d microVMs on node %s, the layer over %s: %.0f MiB of host memory booted, %.0f MiB once each read its %d MiB (one read %.1f s)\n",
				s.VMs, side.Node, side.Device, side.BeforeMiB, side.AfterMiB, s.FileMiB, side.ReadS)
		}
		fmt.Fprintf(w, "shared: the layer file's one copy in the host's page cache (%.0f MiB, charged to its import) is counted once on each side\n", s.HostCopyMiB)
		if s.Pending != "" {
			fmt.Fprintln(w, "shared:", s.Pending)
		}
	}
	if s := r.Idle; s != nil {
		fmt.Fprintf(w, "idle: %d of %d microVMs started in %.0f s; memory and CPU from each QEMU's cgroup, CPU over %.0f s\n",
			s.Started, s.VMs, s.BootWallS, s.WindowS)
		if s.FloorVMs > 0 {
			fmt.Fprintf(w, "idle: %d floor VMs (the same QEMU, machine, memory and kernel, a busybox init asleep) beside them: %.0f MiB and %.2f %% of a core each, read at the same moments\n",
				s.FloorVMs, s.FloorMemMiB, s.FloorCPUPct)
		}
	}
	if len(r.Checks) > 0 {
		fmt.Fprintln(w, "\ntargets (issue 30)")
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "target\tmeasured\tfloor (same run)\ttarget\tverdict")
		for _, c := range r.Checks {
			floor := c.Floor
			if floor == "" {
				floor = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", c.Name, c.Value, floor, c.Target, c.Verdict)
		}
		tw.Flush()
	}
	fmt.Fprintln(w, "\nfloor: what the unchanged outside parts cost by themselves in this run; FLOOR: missed, and the floor alone is past the target.")
	fmt.Fprintln(w, "memory: a sandbox's cgroup (for a microVM, QEMU's: the guest RAM it touched, QEMU's own, the page cache it charged).")
	for _, n := range r.Notes {
		fmt.Fprintln(w, "note:", n)
	}
}

// JSON writes the report as one JSON object.
func (r *VMReport) JSON(w io.Writer) error { return writeJSON(w, r) }
