package runtime

import (
	"slices"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func TestBuildSpec(t *testing.T) {
	s := buildSpec(specInput{
		Spec: Spec{
			ID: "sb-1", Hostname: "h", CPUs: 1.5, MemoryBytes: 1 << 30, AgentArgs: []string{"serve"},
		},
		AgentDir: "/agent", CgroupsPath: "/dsec/sb-1", MemorySwap: true, Nofile: 1024,
	})
	wantArgs := []string{agentPath, "serve", "--listen-fd", "3", "--cgroup-fd", "4", "--memory-cgroup-fd", "5"}
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
	p := seccompProfile()
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
