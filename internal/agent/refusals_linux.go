package agent

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/refused"
)

// Layout of struct seccomp_data (linux/seccomp.h), little-endian.
const (
	seccompNr      = 0
	seccompArch    = 4
	seccompArg0Low = 16
	seccompArg1Low = 24
)

// logRefusals installs, on all the agent's threads (SECCOMP_FILTER_FLAG_TSYNC)
// and so on every command it starts, a filter that refuses with EPERM what
// the sandbox's profile refuses (package refused: whole syscalls, clone's
// namespace flags, the ioctl requests), loaded with SECCOMP_FILTER_FLAG_LOG:
// the kernel takes the newest filter's verdict among equals, so each such
// call, refused by the profile anyway, becomes an audit record (with the
// sandbox's audit session) for the edge to count. What the profile alone
// refuses (clone3's ENOSYS, personality's flags, other arches' calls) is
// not logged. The kernel caches a verdict that does not depend on the
// arguments per syscall number, so only ioctl and clone run this filter.
// It needs no_new_privs, which the sandbox has when the edge asks for it.
func logRefusals() error {
	prog, err := refusalFilter()
	if err != nil {
		return err
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	flags := unix.SECCOMP_FILTER_FLAG_TSYNC | unix.SECCOMP_FILTER_FLAG_LOG
	_, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, uintptr(flags), uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(prog)
	if e != 0 {
		return fmt.Errorf("install the filter that logs refused syscalls: %w", e)
	}
	return nil
}

// refusalFilter is the BPF program of logRefusals.
func refusalFilter() ([]unix.SockFilter, error) {
	if refused.Arch == 0 || len(refused.Numbers) == 0 {
		return nil, fmt.Errorf("log refused syscalls: no syscall numbers for this arch")
	}
	var p program
	p.ld(seccompArch)
	p.jeq(refused.Arch, "", "allow")
	p.ld(seccompNr)
	p.jeq(unix.SYS_IOCTL, "ioctl", "")
	p.jeq(unix.SYS_CLONE, "clone", "")
	for _, name := range refused.Syscalls {
		if nr, ok := refused.Numbers[name]; ok {
			p.jeq(uint32(nr), "deny", "")
		}
	}
	p.label("allow")
	p.ret(unix.SECCOMP_RET_ALLOW)
	p.label("ioctl")
	p.ld(seccompArg1Low) // the request is an unsigned int
	for _, req := range refused.Ioctls {
		p.jeq(uint32(req), "deny", "")
	}
	p.ret(unix.SECCOMP_RET_ALLOW)
	p.label("clone")
	p.ld(seccompArg0Low)
	p.add(unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K, K: refused.CloneNamespaces}, "deny", "")
	p.ret(unix.SECCOMP_RET_ALLOW)
	p.label("deny")
	p.ret(unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM))
	return p.resolve()
}

// program is a BPF program under construction whose forward jumps name
// labels.
type program struct {
	ins    []unix.SockFilter
	jumps  []labelJump
	labels map[string]int
}

type labelJump struct {
	at     int
	jt, jf string
}

func (p *program) add(f unix.SockFilter, jt, jf string) {
	if jt != "" || jf != "" {
		p.jumps = append(p.jumps, labelJump{len(p.ins), jt, jf})
	}
	p.ins = append(p.ins, f)
}

func (p *program) ld(off uint32) {
	p.add(unix.SockFilter{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: off}, "", "")
}

func (p *program) jeq(k uint32, jt, jf string) {
	p.add(unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, K: k}, jt, jf)
}

func (p *program) ret(k uint32) {
	p.add(unix.SockFilter{Code: unix.BPF_RET | unix.BPF_K, K: k}, "", "")
}

func (p *program) label(name string) {
	if p.labels == nil {
		p.labels = map[string]int{}
	}
	p.labels[name] = len(p.ins)
}

// resolve sets each jump's offsets from its labels (an empty label is the
// next instruction).
func (p *program) resolve() ([]unix.SockFilter, error) {
	off := func(at int, label string) (uint8, error) {
		if label == "" {
			return 0, nil
		}
		to, ok := p.labels[label]
		if !ok || to <= at || to-at-1 > 255 {
			return 0, fmt.Errorf("build seccomp filter: jump from %d to %q out of reach", at, label)
		}
		return uint8(to - at - 1), nil
	}
	for _, j := range p.jumps {
		var err error
		if p.ins[j.at].Jt, err = off(j.at, j.jt); err != nil {
			return nil, err
		}
		if p.ins[j.at].Jf, err = off(j.at, j.jf); err != nil {
			return nil, err
		}
	}
	return p.ins, nil
}
