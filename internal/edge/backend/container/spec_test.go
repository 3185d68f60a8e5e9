package container

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/refused"
)

func TestBuildSpec(t *testing.T) {
	s := buildSpec(specInput{
		Spec: backend.Spec{
			ID: "sb-1", Hostname: "h", CPUs: 1.5, MemoryBytes: 1 << 30,
		},
		AgentDir: "/agent", CgroupsPath: "/dsec/sb-1", MemorySwap: true, Nofile: 1024, LogRefusals: true,
	})
	wantArgs := []string{agentPath, "serve", "--log-refusals", "--listen-fd", "3", "--cgroup-fd", "4", "--memory-cgroup-fd", "5"}
	if !slices.Equal(s.Process.Args, wantArgs) {
		t.Errorf("args = %v", s.Process.Args)
	}
	if *s.Linux.Resources.CPU.Quota != 150000 || *s.Linux.Resources.CPU.Period != 100000 {
		t.Errorf("cpu = %d/%d", *s.Linux.Resources.CPU.Quota, *s.Linux.Resources.CPU.Period)
	}
	if *s.Linux.Resources.Memory.Swap != 1<<30 || s.Linux.Resources.Pids.Limit != defaultPids {
		t.Errorf("memory swap %d, pids %d", *s.Linux.Resources.Memory.Swap, s.Linux.Resources.Pids.Limit)
	}
	for _, c := range []string{"CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_RESOURCE", "CAP_NET_RAW", "CAP_NET_ADMIN"} {
		if slices.Contains(s.Process.Capabilities.Bounding, c) {
			t.Errorf("bounding set has %s", c)
		}
	}
	// With a qgroup to report, the agent gets the flag and CAP_SYS_PTRACE
	// for its statfs supervisor, never as inheritable or ambient.
	q := buildSpec(specInput{Spec: backend.Spec{ID: "sb-1"}, AgentDir: "/agent",
		DiskQgroup: "/sys/fs/btrfs/x/qgroups/0_256"})
	if !slices.Equal(q.Process.Args[len(q.Process.Args)-2:], []string{"--disk-qgroup", "/sys/fs/btrfs/x/qgroups/0_256"}) {
		t.Errorf("args with a qgroup = %v", q.Process.Args)
	}
	c := q.Process.Capabilities
	if !slices.Contains(c.Bounding, "CAP_SYS_PTRACE") || !slices.Contains(c.Permitted, "CAP_SYS_PTRACE") ||
		slices.Contains(c.Inheritable, "CAP_SYS_PTRACE") || slices.Contains(c.Ambient, "CAP_SYS_PTRACE") {
		t.Errorf("capabilities with a qgroup = %+v", c)
	}
	if slices.Contains(capabilities, "CAP_SYS_PTRACE") || len(c.Bounding) != len(capabilities)+1 {
		t.Errorf("the default set changed: %v", capabilities)
	}
	if !s.Process.NoNewPrivileges || s.Linux.RootfsPropagation != "rprivate" {
		t.Error("no_new_privileges or rprivate missing")
	}
	var nss []specs.LinuxNamespaceType
	for _, ns := range s.Linux.Namespaces {
		nss = append(nss, ns.Type)
	}
	for _, want := range []specs.LinuxNamespaceType{specs.PIDNamespace, specs.NetworkNamespace, specs.IPCNamespace, specs.UTSNamespace, specs.MountNamespace, specs.CgroupNamespace} {
		if !slices.Contains(nss, want) {
			t.Errorf("namespace %s missing", want)
		}
	}
	if slices.Contains(nss, specs.UserNamespace) {
		t.Error("user namespace: the agent runs as real root by design")
	}
}

func TestSeccompProfile(t *testing.T) {
	p := seccompProfile(false)
	if p.DefaultAction != specs.ActAllow {
		t.Fatalf("default action %s", p.DefaultAction)
	}
	denied := map[string]bool{}
	for _, r := range p.Syscalls {
		if r.Action == specs.ActErrno && len(r.Args) == 0 {
			for _, n := range r.Names {
				denied[n] = true
			}
		}
	}
	for _, n := range []string{"mount", "unshare", "setns", "ptrace", "bpf", "keyctl", "io_uring_setup", "open_by_handle_at", "userfaultfd", "kexec_load", "clone3"} {
		if !denied[n] {
			t.Errorf("%s not denied unconditionally", n)
		}
	}
	// Every conditional rule has one condition: the OCI runtime ORs
	// conditions on the same argument, so more would widen it.
	for _, r := range p.Syscalls {
		if len(r.Args) > 1 {
			t.Errorf("rule for %v has %d conditions", r.Names, len(r.Args))
		}
	}
}

// A sandbox without privilege escalation under runc has its agent log the
// profile's refusals (--log-refusals) when the node asks for it; gVisor and
// a sandbox that may escalate do not. The profile itself is the same either way.
func TestLogRefusals(t *testing.T) {
	if refused.Arch == 0 {
		t.Skip("refusals are logged on x86_64 only")
	}
	for _, c := range []struct {
		name string
		in   specInput
		log  bool
	}{
		{"runc", specInput{Spec: backend.Spec{ID: "sb-1"}, AgentDir: "/agent", LogRefusals: true}, true},
		{"node off", specInput{Spec: backend.Spec{ID: "sb-1"}, AgentDir: "/agent"}, false},
		{"escalation", specInput{Spec: backend.Spec{ID: "sb-1", AllowPrivilegeEscalation: true}, AgentDir: "/agent", LogRefusals: true}, false},
		{"gvisor", specInput{Spec: backend.Spec{ID: "sb-1"}, AgentDir: "/agent", ListenDir: "/l", LogRefusals: true}, false},
	} {
		s := buildSpec(c.in)
		if got := slices.Contains(s.Process.Args, "--log-refusals"); got != c.log {
			t.Errorf("%s: agent logs refusals %v, want %v", c.name, got, c.log)
		}
		if !reflect.DeepEqual(s.Linux.Seccomp, seccompProfile(c.in.ListenDir != "")) {
			t.Errorf("%s: the profile differs", c.name)
		}
	}
}

func TestBuildSpecNetwork(t *testing.T) {
	plain := buildSpec(specInput{Spec: backend.Spec{ID: "sb-1"}, AgentDir: "/agent"})
	for _, ns := range plain.Linux.Namespaces {
		if ns.Path != "" {
			t.Errorf("loopback-only sandbox joins namespace %s at %s", ns.Type, ns.Path)
		}
	}
	for _, m := range plain.Mounts {
		if m.Destination == "/etc/resolv.conf" {
			t.Error("loopback-only sandbox got a resolv.conf mount")
		}
	}
	s := buildSpec(specInput{Spec: backend.Spec{ID: "sb-1", NetnsPath: "/run/netns/x", ResolvConf: "/r/resolv.conf"}, AgentDir: "/agent"})
	var joined bool
	for _, ns := range s.Linux.Namespaces {
		if ns.Type == specs.NetworkNamespace && ns.Path == "/run/netns/x" {
			joined = true
		}
	}
	if !joined {
		t.Errorf("network namespace not joined: %+v", s.Linux.Namespaces)
	}
	var mounted bool
	for _, m := range s.Mounts {
		if m.Destination == "/etc/resolv.conf" && m.Source == "/r/resolv.conf" && slices.Contains(m.Options, "ro") {
			mounted = true
		}
	}
	if !mounted {
		t.Error("resolv.conf not bind-mounted read-only")
	}
}

// TestBuildSpecFnCall: a fncall sandbox's agent gets the cpu cgroup as the
// fd after the others, and /tmp is a tmpfs capped at half the memory
// limit; a container sandbox has neither.
func TestBuildSpecFnCall(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      specInput
		wantFds []string // the args after the memory cgroup's
		wantTmp string   // the /tmp mount's size option, "" = no /tmp mount
	}{
		{"container", specInput{Spec: backend.Spec{MemoryBytes: 256 << 20}, PidsFD: true},
			[]string{"--pids-cgroup-fd", "6"}, ""},
		{"fncall v1", specInput{Spec: backend.Spec{MemoryBytes: 256 << 20}, PidsFD: true, FnCall: true},
			[]string{"--pids-cgroup-fd", "6", "--cpu-cgroup-fd", "7", "--fncall"}, "size=134217728"},
		{"fncall v2", specInput{Spec: backend.Spec{MemoryBytes: 256 << 20}, FnCall: true},
			[]string{"--cpu-cgroup-fd", "6", "--fncall"}, "size=134217728"},
		{"fncall tmp given", specInput{Spec: backend.Spec{MemoryBytes: 256 << 20, TmpBytes: 8 << 20}, FnCall: true},
			[]string{"--cpu-cgroup-fd", "6", "--fncall"}, "size=8388608"},
		{"fncall no memory limit", specInput{FnCall: true},
			[]string{"--cpu-cgroup-fd", "6", "--fncall"}, "size=268435456"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.in.AgentDir = "/agent"
			s := buildSpec(tc.in)
			i := slices.Index(s.Process.Args, "--memory-cgroup-fd")
			if got := s.Process.Args[i+2:]; !slices.Equal(got, tc.wantFds) {
				t.Errorf("fd args %v, want %v", got, tc.wantFds)
			}
			var tmp string
			for _, m := range s.Mounts {
				if m.Destination == "/tmp" {
					if m.Type != "tmpfs" || slices.Contains(m.Options, "noexec") || !slices.Contains(m.Options, "nosuid") {
						t.Errorf("/tmp mount %+v", m)
					}
					for _, o := range m.Options {
						if strings.HasPrefix(o, "size=") {
							tmp = o
						}
					}
				}
			}
			if tmp != tc.wantTmp {
				t.Errorf("/tmp size %q, want %q", tmp, tc.wantTmp)
			}
			// A fncall container starts at a raised CPU weight (its agent
			// lowers it once warm); a container sandbox keeps the default.
			var shares uint64
			if c := s.Linux.Resources.CPU; c != nil && c.Shares != nil {
				shares = *c.Shares
			}
			if want := map[bool]uint64{true: fncallStartShares}[tc.in.FnCall]; shares != want {
				t.Errorf("cpu shares %d, want %d", shares, want)
			}
		})
	}
}

// TestAgentFlags: the agent's configuration as the flags its serve command
// takes, the environment sorted, nothing for what is unset.
func TestAgentFlags(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   backend.Agent
		want []string
	}{
		{"none", backend.Agent{}, nil},
		{"all", backend.Agent{
			User: "1000:1000", Workdir: "/work", Hostname: "h", Address: "198.18.0.2",
			Env: map[string]string{"B": "2", "A": "1=x", "E": ""}, OutputLimit: 1 << 20,
		}, []string{
			"--user", "1000:1000", "--workdir", "/work", "--hostname", "h", "--address", "198.18.0.2",
			"--env", "A=1=x", "--env", "B=2", "--env", "E=", "--output-limit", "1048576",
		}},
		{"env only", backend.Agent{Env: map[string]string{"PIP_INDEX_URL": "http://m/simple"}}, []string{"--env", "PIP_INDEX_URL=http://m/simple"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := agentFlags(tc.in); !slices.Equal(got, tc.want) {
				t.Errorf("agentFlags = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestBuildSpecGVisor: under gVisor the agent makes its socket itself and
// its commands' cgroup in the sentry's cgroupfs, mounted read-write for it
// at agentCgroupMount, capped at the spec's pids; the host's limit has
// room for runsc's own tasks; clone3 reaches the sentry.
func TestBuildSpecGVisor(t *testing.T) {
	s := buildSpec(specInput{Spec: backend.Spec{ID: "sb-1", Pids: 48}, AgentDir: "/agent", ListenDir: "/sock/sb-1",
		HostTasksPerTask: gvisorHostTasks("systrap")})
	want := []string{agentPath, "serve", "--listen-path", agentSockMount + "/agent.sock", "--cgroup-path", agentCgroupMount, "--pids-max", "48"}
	if !slices.Equal(s.Process.Args, want) {
		t.Errorf("args = %v, want %v", s.Process.Args, want)
	}
	if s.Linux.Resources.Pids.Limit != 3*48+gvisorPids {
		t.Errorf("host pids limit = %d, want %d", s.Linux.Resources.Pids.Limit, 3*48+gvisorPids)
	}
	var cgroupMounts []string
	for _, m := range s.Mounts {
		if m.Type == "cgroup" {
			cgroupMounts = append(cgroupMounts, m.Destination+":"+strings.Join(m.Options, ","))
		}
	}
	if want := []string{"/sys/fs/cgroup:nosuid,noexec,nodev,relatime,ro", agentCgroupMount + ":nosuid,noexec,nodev"}; !slices.Equal(cgroupMounts, want) {
		t.Errorf("cgroup mounts = %v, want %v", cgroupMounts, want)
	}
	for _, r := range s.Linux.Seccomp.Syscalls {
		if slices.Contains(r.Names, "clone3") {
			t.Errorf("clone3 refused under gVisor: %+v", r)
		}
	}
}
