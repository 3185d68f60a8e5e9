package container

import (
	"maps"
	"math"
	"slices"
	"strconv"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/refused"
)

// Where things are inside a sandbox.
const (
	agentMount = "/.dsec/bin"
	// agentSockMount is where a gVisor sandbox's agent makes its socket:
	// a dir bind-mounted from the host (specInput.ListenDir).
	agentSockMount = "/.dsec/sock"
	// agentCgroupMount is where a gVisor sandbox's agent finds its own
	// cgroup, read-write (the sentry's cgroupfs; /sys/fs/cgroup stays
	// read-only as under runc).
	agentCgroupMount = "/.dsec/cgroup"
	agentPath        = agentMount + "/dsec-agent"
	cfsPeriod        = 100000 // µs

	// fncallStartShares is a fncall container's CPU weight (cgroup v1
	// cpu.shares; runc maps it onto v2's cpu.weight) until its agent is
	// ready: 8 times the default, so that on a node whose CPUs are busy
	// with calls (a burst of CPU-bound ones) the containers a pool starts
	// for the next calls get their agent and warm interpreter up before
	// the running calls' next slices, rather than an equal share beside
	// each of them. The agent brings it back to the default once warm
	// (call.Runner.Settle). A container start is about 60 ms of CPU in
	// the container; a call that waits for it has its clock running.
	fncallStartShares = 8 * 1024

	nofileLimit = 1 << 16 // open files per process in a sandbox
)

// capabilities is Docker's default set without NET_RAW: no SYS_ADMIN,
// SYS_PTRACE, SYS_MODULE, SYS_RAWIO, SYS_RESOURCE (which would override the
// disk quota), NET_ADMIN, …
var capabilities = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

var maskedPaths = []string{
	"/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore", "/proc/keys",
	"/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
	"/proc/sched_debug", "/proc/scsi", "/proc/kpagecgroup", "/proc/kpageflags",
	"/proc/kpagecount", "/proc/config.gz",
	"/sys/firmware", "/sys/kernel", "/sys/devices/virtual/powercap",
	"/sys/fs/bpf", "/sys/kernel/debug", "/sys/kernel/security",
}

var readonlyPaths = []string{
	"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
	// On cgroup v1 runc mounts a writable tmpfs here under the read-only
	// controller mounts.
	"/sys/fs/cgroup",
}

// specInput is what buildSpec needs beyond the caller's Spec.
type specInput struct {
	backend.Spec
	AgentDir    string
	CgroupsPath string
	MemorySwap  bool   // the host accounts swap (v1 memsw files exist, or v2)
	Nofile      uint64 // RLIMIT_NOFILE
	PidsFD      bool   // the agent gets fd 6, the commands' pids cgroup
	// FnCall makes a fncall sandbox: the agent gets the cpu cgroup dir as
	// the fd after the others and runs with --fncall; /tmp is a tmpfs.
	FnCall bool
	// ListenDir, when set, is a host dir bind-mounted at agentSockMount,
	// where the agent makes its own listening socket (--listen-path) in
	// place of fd 3, and no cgroup fds are passed (gVisor).
	ListenDir string
	// HostTasksPerTask is, under gVisor, how many host tasks (the
	// sentry's threads, the platform's stubs) each of the sandbox's own
	// tasks costs: the host's pids limit is the spec's that many times
	// over, plus gvisorPids.
	HostTasksPerTask int64
	// DiskQgroup is the sysfs dir of the btrfs qgroup that caps the
	// writable layer; the agent answers statfs of / from it (see
	// ptraceCapability).
	DiskQgroup string
	// LogRefusals asks the agent to log what the profile refuses, where it
	// can (refusalsLogged).
	LogRefusals bool
}

// ptraceCapability is granted to the agent of a sandbox whose disk limit
// it reports (DiskQgroup) so that its statfs supervisor can read the
// /proc/PID files of other users' processes, which hidepid=ptraceable
// hides from root without it. The agent drops it from its bounding and
// inheritable sets before it runs anything (so no command, which it starts
// with execve, can hold it) and from the effective set of every thread but
// the supervisor's.
const ptraceCapability = "CAP_SYS_PTRACE"

// agentPids is the room for the agent's own threads above a sandbox's pids
// limit, which its commands share.
const agentPids = 64

// gvisorPids is the room above a gVisor sandbox's pids limit for the
// host tasks of runsc itself: the host cgroup's pids limit counts the
// sentry's and the gofer's threads and the platform's stub processes, not
// the sandbox's processes (those the sentry's own pids cgroup caps, which
// the agent makes: --pids-max), and a sentry that cannot make a thread
// dies with every process inside. An idle sandbox holds 26 host tasks
// under systrap, 47 under ptrace.
const gvisorPids = 256

// gvisorHostTasks is how many host tasks each of a gVisor sandbox's tasks
// may cost on platform: measured here, a sleeping process cost 2 under
// systrap (36 of them: 26 host tasks became 99) and 11 to 12 under ptrace
// (a stub thread per sentry thread that ran it: 15 of them, 47 became
// 219). Under ptrace processes that come and go cost more: the stubs of
// an address space outlive its processes for a while, so a fork bomb
// under a sandbox limit of 48 took the host's count to 1,972 (41 a
// sandbox task), past the 1,024 of 16 a task, and the sentry died; 64 a
// task leaves room above that. kvm is taken as systrap (not measured).
func gvisorHostTasks(platform string) int64 {
	if platform == "ptrace" {
		return 64
	}
	return 3
}

func pidsLimit(s backend.Spec) int64 {
	if s.Pids > 0 {
		return s.Pids
	}
	return defaultPids
}

// agentFlags is a's flags of the agent's serve command, the environment's
// sorted by name.
func agentFlags(a backend.Agent) []string {
	var args []string
	for _, f := range []struct{ flag, value string }{
		{"--user", a.User}, {"--workdir", a.Workdir}, {"--hostname", a.Hostname}, {"--address", a.Address},
	} {
		if f.value != "" {
			args = append(args, f.flag, f.value)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(a.Env)) {
		args = append(args, "--env", k+"="+a.Env[k])
	}
	if a.OutputLimit > 0 {
		args = append(args, "--output-limit", strconv.FormatInt(a.OutputLimit, 10))
	}
	return args
}

// refusalsLogged says whether a sandbox's agent logs what its profile
// refuses (--log-refusals): a filter of the agent's own, on top of the
// profile, refusing the same calls with SECCOMP_FILTER_FLAG_LOG, so each
// refusal becomes an audit record the edge counts into the sandbox's
// provenance (provenance.SyscallLog). The OCI runtime could load the
// profile with that flag itself, but Debian's runc 1.1 refuses seccomp
// flags, and the flag would log clone3's ENOSYS too, which glibc meets on
// every thread it starts. The agent needs no_new_privs to load a filter (a
// sandbox that may escalate privileges has none); under gVisor the sentry
// applies the profile and the host's kernel sees no refusal; the refused
// numbers are x86_64's (package refused).
func refusalsLogged(in specInput) bool {
	return in.LogRefusals && in.ListenDir == "" && !in.AllowPrivilegeEscalation && refused.Arch != 0
}

func buildSpec(in specInput) *specs.Spec {
	args := append([]string{agentPath, "serve"}, agentFlags(in.Agent)...)
	if refusalsLogged(in) {
		args = append(args, "--log-refusals")
	}
	fd := 6
	pids := pidsLimit(in.Spec)
	if in.ListenDir != "" {
		// The commands' limit is the sentry's: the agent makes their pids
		// cgroup in the sentry's cgroupfs. The host's counts runsc's own
		// tasks, with room above.
		args = append(args, "--listen-path", agentSockMount+"/agent.sock",
			"--cgroup-path", agentCgroupMount, "--pids-max", strconv.FormatInt(pids, 10))
		pids = pids*max(in.HostTasksPerTask, 1) + gvisorPids
	} else {
		// The fds Start passes, in its order from 3 on.
		args = append(args, "--listen-fd", "3", "--cgroup-fd", "4", "--memory-cgroup-fd", "5")
	}
	if in.PidsFD {
		// Commands are capped at pids in their own cgroup; the sandbox as a
		// whole gets room on top for the agent's threads.
		args = append(args, "--pids-cgroup-fd", strconv.Itoa(fd))
		fd++
		pids += agentPids
	}
	if in.FnCall && in.ListenDir != "" {
		args = append(args, "--fncall")
	} else if in.FnCall {
		args = append(args, "--cpu-cgroup-fd", strconv.Itoa(fd), "--fncall")
	}
	res := &specs.LinuxResources{
		Devices: devices(),
		Pids:    &specs.LinuxPids{Limit: pids},
	}
	if in.CPUs > 0 {
		period := uint64(cfsPeriod)
		quota := int64(math.Ceil(in.CPUs * cfsPeriod))
		quota = max(quota, 1000) // the kernel's minimum is 1 ms
		res.CPU = &specs.LinuxCPU{Period: &period, Quota: &quota}
	}
	if in.FnCall {
		if res.CPU == nil {
			res.CPU = &specs.LinuxCPU{}
		}
		shares := uint64(fncallStartShares)
		res.CPU.Shares = &shares
	}
	if in.MemoryBytes > 0 {
		limit := in.MemoryBytes
		res.Memory = &specs.LinuxMemory{Limit: &limit}
		if in.MemorySwap {
			swap := limit // memory+swap = memory: no swap
			res.Memory.Swap = &swap
		}
	}
	agentCaps := capabilities
	if in.DiskQgroup != "" {
		args = append(args, "--disk-qgroup", in.DiskQgroup)
		agentCaps = append(slices.Clip(capabilities), ptraceCapability)
	}
	caps := &specs.LinuxCapabilities{
		Bounding:  agentCaps,
		Effective: agentCaps,
		Permitted: agentCaps,
	}
	spec := &specs.Spec{
		Version:  specs.Version,
		Hostname: in.Hostname,
		Root:     &specs.Root{Path: "rootfs"},
		Process: &specs.Process{
			Args:            args,
			Env:             []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			Cwd:             "/",
			User:            specs.User{UID: 0, GID: 0},
			NoNewPrivileges: !in.AllowPrivilegeEscalation,
			Capabilities:    caps,
			Rlimits: []specs.POSIXRlimit{
				{Type: "RLIMIT_NOFILE", Hard: in.Nofile, Soft: in.Nofile},
				{Type: "RLIMIT_CORE", Hard: 0, Soft: 0},
			},
		},
		Mounts: []specs.Mount{
			// hidepid=ptraceable hides every process the caller may not ptrace
			// (unlike "invisible", group 0 gets no exemption):
			// the agent (pid 1, non-dumpable) is not even listed, so its fds
			// and memory stay out of reach for root inside the sandbox.
			{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev", "hidepid=ptraceable"}},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=67108864"}},
			{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			{Destination: "/sys/fs/cgroup", Type: "cgroup", Source: "cgroup", Options: []string{"nosuid", "noexec", "nodev", "relatime", "ro"}},
			{Destination: agentMount, Type: "bind", Source: in.AgentDir, Options: []string{"rbind", "ro", "nosuid", "nodev"}},
		},
		Linux: &specs.Linux{
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.NetworkNamespace}, {Type: specs.IPCNamespace},
				{Type: specs.UTSNamespace}, {Type: specs.MountNamespace}, {Type: specs.CgroupNamespace},
			},
			CgroupsPath: in.CgroupsPath,
			Resources:   res,
			// The host detaches its copy of the rootfs mount right after the
			// start; rprivate keeps that unmount out of the container.
			RootfsPropagation: "rprivate",
			MaskedPaths:       maskedPaths,
			ReadonlyPaths:     readonlyPaths,
			Seccomp:           seccompProfile(in.ListenDir != ""),
		},
	}
	if in.NetnsPath != "" {
		for i := range spec.Linux.Namespaces {
			if spec.Linux.Namespaces[i].Type == specs.NetworkNamespace {
				spec.Linux.Namespaces[i].Path = in.NetnsPath
			}
		}
	}
	if in.FnCall {
		// exec is allowed: reward code compiles into /tmp and runs what it
		// built. tmpfs pages are charged to the writer's memory cgroup.
		spec.Mounts = append(spec.Mounts, specs.Mount{Destination: "/tmp", Type: "tmpfs", Source: "tmpfs",
			Options: []string{"nosuid", "nodev", "mode=1777", "size=" + strconv.FormatInt(tmpBytes(in.Spec), 10)}})
	}
	if in.ListenDir != "" {
		spec.Mounts = append(spec.Mounts, specs.Mount{Destination: agentSockMount, Type: "bind", Source: in.ListenDir,
			Options: []string{"bind", "rw", "nosuid", "nodev", "noexec"}},
			specs.Mount{Destination: agentCgroupMount, Type: "cgroup", Source: "cgroup", Options: []string{"nosuid", "noexec", "nodev"}})
	}
	if in.ResolvConf != "" {
		spec.Mounts = append(spec.Mounts, specs.Mount{Destination: "/etc/resolv.conf", Type: "bind", Source: in.ResolvConf,
			Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}})
	}
	return spec
}

func devices() []specs.LinuxDeviceCgroup {
	c := func(major, minor int64) specs.LinuxDeviceCgroup {
		return specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &major, Minor: &minor, Access: "rwm"}
	}
	any := int64(-1)
	return []specs.LinuxDeviceCgroup{
		{Allow: false, Access: "rwm"},
		c(1, 3), c(1, 5), c(1, 7), c(1, 8), c(1, 9), // null zero full random urandom
		c(5, 0), c(5, 2), // tty ptmx
		{Allow: true, Type: "c", Major: ptr(int64(136)), Minor: &any, Access: "rwm"}, // pts
	}
}

func ptr[T any](v T) *T { return &v }
