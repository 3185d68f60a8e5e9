// Command agent is a stand-in for dsec-agent in the runtime's tests. It
// serves the listening socket on fd 3: each line received is a shell command
// run with /.dsec/bin/sh -c, or a built-in starting with "!"; it writes back
// the output and a final line "@@EXIT <code>". Run as "agent probe NAME" it
// tries one syscall and prints "ok" or "errno=N".
package main

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

func main() {
	if len(os.Args) > 2 && os.Args[1] == "probe" {
		fmt.Println(result(probe(os.Args[2], os.Args[3:])))
		return
	}
	ln, err := net.FileListener(os.NewFile(3, "listener"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		os.Exit(1)
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, "accept:", err)
			os.Exit(1)
		}
		go serve(c)
	}
}

func serve(c net.Conn) {
	defer c.Close()
	sc := bufio.NewScanner(c)
	for sc.Scan() {
		out, code := run(sc.Text())
		fmt.Fprintf(c, "%s\n@@EXIT %d\n", out, code)
	}
}

func run(line string) (string, int) {
	if name, ok := strings.CutPrefix(line, "!cgchild "); ok {
		return cgChild(name)
	}
	cmd := exec.Command("/.dsec/bin/sh", "-c", line)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return string(out), 0
	case errors.As(err, &ee):
		return string(out), ee.ExitCode()
	default:
		return string(out) + err.Error(), -1
	}
}

// cgChild does what the real agent does per command: makes a child of the
// sandbox cgroup through fd 4 and starts a process in it.
func cgChild(name string) (string, int) {
	if err := unix.Mkdirat(4, name, 0o755); err != nil {
		return "mkdir: " + err.Error(), 1
	}
	cmd := exec.Command("/.dsec/bin/sh", "-c", "sleep 1000")
	if err := cmd.Start(); err != nil {
		return "start: " + err.Error(), 1
	}
	go cmd.Wait()
	fd, err := unix.Openat(4, name+"/cgroup.procs", unix.O_WRONLY, 0)
	if err != nil {
		return "open: " + err.Error(), 1
	}
	defer unix.Close(fd)
	if _, err := unix.Write(fd, []byte(strconv.Itoa(cmd.Process.Pid))); err != nil {
		return "write: " + err.Error(), 1
	}
	return strconv.Itoa(cmd.Process.Pid), 0
}

func result(err error) string {
	var en syscall.Errno
	switch {
	case err == nil:
		return "ok"
	case errors.As(err, &en):
		return "errno=" + strconv.Itoa(int(en))
	default:
		return "error: " + err.Error()
	}
}

func errno(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

func probe(name string, args []string) error {
	switch name {
	case "mount":
		return unix.Mount("none", "/tmp", "tmpfs", 0, "")
	case "unshare-user":
		return unix.Unshare(unix.CLONE_NEWUSER)
	case "clone-newuser", "clone-newns":
		flags := uintptr(unix.CLONE_NEWUSER)
		if name == "clone-newns" {
			flags = unix.CLONE_NEWNS
		}
		cmd := exec.Command("/.dsec/bin/sh", "-c", "true")
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: flags}
		return cmd.Run()
	case "fork":
		return exec.Command("/.dsec/bin/sh", "-c", "true").Run()
	case "ptrace":
		_, _, e := unix.RawSyscall(unix.SYS_PTRACE, unix.PTRACE_TRACEME, 0, 0)
		return errno(e)
	case "clone3":
		_, _, e := unix.RawSyscall(unix.SYS_CLONE3, 0, 0, 0)
		return errno(e)
	case "io_uring":
		var params [120]byte
		_, _, e := unix.RawSyscall(unix.SYS_IO_URING_SETUP, 1, uintptr(unsafe.Pointer(&params)), 0)
		return errno(e)
	case "personality":
		v, err := strconv.ParseUint(args[0], 0, 64)
		if err != nil {
			return err
		}
		_, _, e := unix.RawSyscall(unix.SYS_PERSONALITY, uintptr(v), 0, 0)
		return errno(e)
	case "ioctl":
		req, err := strconv.ParseUint(args[1], 0, 32)
		if err != nil {
			return err
		}
		f, err := os.OpenFile(args[0], os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			return err
		}
		defer f.Close()
		var buf [512]byte
		_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(req), uintptr(unsafe.Pointer(&buf)))
		return errno(e)
	}
	return fmt.Errorf("unknown probe %q", name)
}
