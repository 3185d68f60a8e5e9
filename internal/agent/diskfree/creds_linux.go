//go:build linux && (amd64 || arm64)

package diskfree

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// creds are a caller's file-system credentials, from /proc/PID/status.
type creds struct {
	fsuid, fsgid int
	groups       []int
	effective    uint64 // capabilities
}

func readCreds(dir int) (creds, error) {
	fd, err := unix.Openat(dir, "status", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return creds{}, err
	}
	defer unix.Close(fd)
	var b []byte
	buf := make([]byte, 4096)
	for {
		n, err := unix.Read(fd, buf)
		if err != nil {
			return creds{}, fmt.Errorf("read status: %w", err)
		}
		if n == 0 {
			break
		}
		b = append(b, buf[:n]...)
	}
	var c creds
	var seen int
	bad := func(line string) error { return fmt.Errorf("parse status: %q", line) }
	for line := range strings.Lines(string(b)) {
		key, val, _ := strings.Cut(line, ":")
		fields := strings.Fields(val)
		switch key {
		case "Uid", "Gid": // real, effective, saved, file system
			if len(fields) != 4 {
				return creds{}, bad(line)
			}
			v, err := strconv.Atoi(fields[3])
			if err != nil {
				return creds{}, bad(line)
			}
			if key == "Uid" {
				c.fsuid = v
			} else {
				c.fsgid = v
			}
			seen++
		case "Groups":
			for _, g := range fields {
				v, err := strconv.Atoi(g)
				if err != nil {
					return creds{}, bad(line)
				}
				c.groups = append(c.groups, v)
			}
		case "CapEff":
			if len(fields) != 1 {
				return creds{}, bad(line)
			}
			v, err := strconv.ParseUint(fields[0], 16, 64)
			if err != nil {
				return creds{}, bad(line)
			}
			c.effective = v
			seen++
		}
	}
	if seen != 3 {
		return creds{}, errors.New("parse status: Uid, Gid or CapEff missing")
	}
	return c, nil
}

// thread is the supervisor thread's own credentials, to return to after
// each call it looks into on a caller's behalf.
type thread struct {
	caps   [2]unix.CapUserData
	groups []int
	known  bool // caps and groups were read: the thread can take on a caller's
	broken bool // restoring failed: the thread must not serve again
}

// newThread raises CAP_SYS_PTRACE in the calling thread's effective set,
// when it is permitted, and records the thread's credentials.
func newThread() (*thread, error) {
	t := &thread{}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	if err := unix.Capget(&hdr, &t.caps[0]); err != nil {
		return t, fmt.Errorf("read capabilities: %w", err)
	}
	groups, err := unix.Getgroups()
	if err != nil {
		return t, fmt.Errorf("read groups: %w", err)
	}
	t.groups, t.known = groups, true
	if t.caps[0].Permitted&(1<<unix.CAP_SYS_PTRACE) == 0 {
		return t, errors.New("CAP_SYS_PTRACE is not permitted")
	}
	t.caps[0].Effective |= 1 << unix.CAP_SYS_PTRACE
	if err := unix.Capset(&hdr, &t.caps[0]); err != nil { // this thread only
		t.caps[0].Effective &^= 1 << unix.CAP_SYS_PTRACE
		return t, fmt.Errorf("raise CAP_SYS_PTRACE: %w", err)
	}
	return t, nil
}

// as runs fn with the thread's file-system credentials and capabilities
// those of c, so that the kernel checks a path lookup as it would for c
// (CAP_SYS_PTRACE included: a path through another process's /proc files
// must fail as it would for c); then it restores them.
func (t *thread) as(c creds, fn func() error) error {
	err := t.become(c)
	if err == nil {
		err = fn()
	}
	if rerr := t.restore(); rerr != nil {
		t.broken = true
		return errors.Join(err, rerr)
	}
	return err
}

// become sets the credentials; unix.Setgroups, Setfsgid, Setfsuid and
// Capset are plain syscalls, which change the calling thread only.
func (t *thread) become(c creds) error {
	if err := unix.Setgroups(c.groups); err != nil {
		return fmt.Errorf("set groups: %w", err)
	}
	unix.Setfsgid(c.fsgid)
	if g, _ := unix.SetfsgidRetGid(-1); g != c.fsgid {
		return fmt.Errorf("set fsgid %d", c.fsgid)
	}
	unix.Setfsuid(c.fsuid)
	if u, _ := unix.SetfsuidRetUid(-1); u != c.fsuid {
		return fmt.Errorf("set fsuid %d", c.fsuid)
	}
	caps := t.caps
	caps[0].Effective = t.caps[0].Permitted & uint32(c.effective)
	caps[1].Effective = t.caps[1].Permitted & uint32(c.effective>>32)
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	if err := unix.Capset(&hdr, &caps[0]); err != nil {
		return fmt.Errorf("set capabilities: %w", err)
	}
	return nil
}

// restore returns to the thread's own credentials: capabilities first,
// since the rest needs CAP_SETUID and CAP_SETGID.
func (t *thread) restore() error {
	caps := t.caps
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	if err := unix.Capset(&hdr, &caps[0]); err != nil {
		return fmt.Errorf("restore capabilities: %w", err)
	}
	unix.Setfsuid(0)
	unix.Setfsgid(0)
	if err := unix.Setgroups(t.groups); err != nil {
		return fmt.Errorf("restore groups: %w", err)
	}
	u, _ := unix.SetfsuidRetUid(-1)
	g, _ := unix.SetfsgidRetGid(-1)
	if u != 0 || g != 0 {
		return fmt.Errorf("restore fsuid and fsgid: %d:%d", u, g)
	}
	if got, err := unix.Getgroups(); err != nil || !slices.Equal(got, t.groups) {
		return fmt.Errorf("restore groups: %v %v", got, err)
	}
	return nil
}
