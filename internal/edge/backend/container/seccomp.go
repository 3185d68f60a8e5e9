package container

import (
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"dsec.dev/dsec/internal/refused"
)

// Personality values a sandbox may set: PER_LINUX, PER_LINUX32, UNAME26
// with either, and 0xffffffff, which only queries. Other flags turn off
// address randomisation or map page zero.
const (
	perLinux32 = 0x8
	unameNN    = 0x20000
	perQuery   = 0xffffffff
)

// seccompProfile is every sandbox's profile. clone3 is refused with
// ENOSYS, except under gVisor (gvisor): there its agent needs clone3's
// CLONE_INTO_CGROUP to start each command in its own cgroup of the
// sentry's cgroupfs, where the commands' pids limit is (see
// internal/agent's commandsCgroup), and the sentry, not the host's
// kernel, serves the call: a namespace a clone3 asks for is one of the
// sentry's, whose code the sandbox reaches through any syscall anyway.
func seccompProfile(gvisor bool) *specs.LinuxSeccomp {
	eperm := uint(1)   // EPERM
	enosys := uint(38) // ENOSYS
	deny := func(names []string, args ...specs.LinuxSeccompArg) specs.LinuxSyscall {
		return specs.LinuxSyscall{Names: names, Action: specs.ActErrno, ErrnoRet: &eperm, Args: args}
	}
	sys := []specs.LinuxSyscall{deny(refused.Syscalls)}
	// The OCI runtime ORs rules (and conditions on one argument), so each
	// forbidden flag is a rule of its own: (flags & bit) == bit.
	for _, bit := range []uint64{refused.CloneNewNS, refused.CloneNewCgroup, refused.CloneNewUTS, refused.CloneNewIPC, refused.CloneNewUser, refused.CloneNewPID, refused.CloneNewNet} {
		sys = append(sys, deny([]string{"clone"}, specs.LinuxSeccompArg{Index: 0, Value: bit, ValueTwo: bit, Op: specs.OpMaskedEqual}))
	}
	// clone3 passes its flags in memory, out of seccomp's sight: ENOSYS makes
	// libc fall back to clone, which the rules above check.
	if !gvisor {
		sys = append(sys, specs.LinuxSyscall{Names: []string{"clone3"}, Action: specs.ActErrno, ErrnoRet: &enosys})
	}
	// ioctl's request is an unsigned int: compare the low 32 bits only.
	for _, req := range refused.Ioctls {
		sys = append(sys, deny([]string{"ioctl"}, specs.LinuxSeccompArg{Index: 1, Value: 0xffffffff, ValueTwo: req, Op: specs.OpMaskedEqual}))
	}
	sys = append(sys, personalityRules(deny)...)
	return &specs.LinuxSeccomp{
		DefaultAction: specs.ActAllow,
		Architectures: []specs.Arch{specs.ArchX86_64, specs.ArchX86, specs.ArchX32},
		Syscalls:      sys,
	}
}

// personalityRules deny every personality(2) argument but the safe values.
// Conditions can only be ORed here, so the allowed set {0, 8, 0x20000,
// 0x20008, 0xffffffff} is written as the complement of a union of deny rules:
//   - anything above 32 bits;
//   - bit 31 clear and any bit but 3 and 17 set;
//   - bit 31 set and any other bit clear (all ones is the query).
func personalityRules(deny func([]string, ...specs.LinuxSeccompArg) specs.LinuxSyscall) []specs.LinuxSyscall {
	names := []string{"personality"}
	out := []specs.LinuxSyscall{deny(names, specs.LinuxSeccompArg{Index: 0, Value: perQuery, Op: specs.OpGreaterThan})}
	const top = uint64(1) << 31
	for b := 0; b < 31; b++ {
		bit := uint64(1) << b
		if bit != perLinux32 && bit != unameNN {
			out = append(out, deny(names, specs.LinuxSeccompArg{Index: 0, Value: bit | top, ValueTwo: bit, Op: specs.OpMaskedEqual}))
		}
		out = append(out, deny(names, specs.LinuxSeccompArg{Index: 0, Value: bit | top, ValueTwo: top, Op: specs.OpMaskedEqual}))
	}
	return out
}
