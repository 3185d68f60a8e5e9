package proc

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// spawn forks and executes path with every process of the command inside
// its cgroups from its first instruction, so nothing it forks can escape a
// kill of the tree.
//
// On cgroup v2 the child is cloned straight into the command's cgroup
// (CLONE_INTO_CGROUP). On v1, cgroup membership is per thread: the calling
// goroutine is locked to its thread, the thread alone joins the command's
// freezer cgroup and the commands' pids cgroup, forks (the child inherits
// the thread's cgroups), and goes back. Should going back fail, the thread
// is left locked and ends with the goroutine, so no agent thread stays in a
// cgroup that a kill may freeze. The thread moves itself by writing "0": the
// kernel then skips the global lock that moving another task takes, whose
// RCU grace period costs milliseconds when migrations are rare.
//
// The agent handles every signal (see the agent's Serve), and Go resets
// handled signals to their defaults in the child, so commands start with
// default dispositions and an empty signal mask.
func (m *Manager) spawn(cg *cgroup, join []Join, path string, argv []string, attr *syscall.ProcAttr) (int, error) {
	if cg != nil && cg.v2 {
		if len(join) > 0 {
			return 0, fmt.Errorf("join cgroups: more cgroups per command need cgroup v1")
		}
		attr.Sys.UseCgroupFD = true
		attr.Sys.CgroupFD = cg.fd
		pid, err := syscall.ForkExec(path, argv, attr)
		if err == nil {
			markOOMScore(pid)
		}
		return pid, err
	}
	type result struct {
		pid int
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		var back []int // tasks files of the cgroups the thread returns to
		moveBack := func() bool {
			ok := true
			for _, fd := range back {
				if err := enter(fd); err != nil {
					m.cfg.Log.Error("return agent thread to its cgroup", "err", err)
					ok = false
				}
			}
			return ok
		}
		var err error
		if cg != nil {
			if err = writeAt(cg.fd, "tasks", "0"); err == nil {
				back = append(back, m.tasks.freezerBack)
			}
		}
		if err == nil && m.tasks.pids >= 0 {
			if err = enter(m.tasks.pids); err == nil {
				back = append(back, m.tasks.pidsBack)
			}
		}
		for _, j := range join {
			if err != nil {
				break
			}
			if err = enter(j.Enter); err == nil {
				back = append(back, j.Back)
			}
		}
		var pid int
		if err == nil {
			pid, err = syscall.ForkExec(path, argv, attr)
			if err == nil {
				markOOMScore(pid)
			}
		} else {
			err = fmt.Errorf("join the command's cgroups: %w", err)
		}
		if moveBack() {
			runtime.UnlockOSThread()
		}
		done <- result{pid, err}
	}()
	r := <-done
	return r.pid, r.err
}

// commandOOMScoreAdj is every command's oom_score_adj: the sandbox's OOM
// killer takes a command before the agent, whatever their sizes (once a
// command's memory had been freed but not yet returned, the agent was the
// largest task left, and was killed). Raising it needs no privilege;
// lowering the agent's would need CAP_SYS_RESOURCE, which dsecd may lack.
const commandOOMScoreAdj = "500"

// markOOMScore sets a new command's oom_score_adj, which its children
// inherit from then on. It runs just after the fork and exec: what the
// command forks in its first microseconds keeps the agent's score.
func markOOMScore(pid int) {
	if fd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/oom_score_adj", unix.O_WRONLY|unix.O_CLOEXEC, 0); err == nil {
		unix.Write(fd, []byte(commandOOMScoreAdj))
		unix.Close(fd)
	}
}

// tasksFiles are the cgroup v1 tasks files the forking thread moves itself
// through for every command, opened once: the commands' pids cgroup, the
// agent's own pids cgroup (its parent), and the sandbox's freezer cgroup,
// parent of every command's. -1 where there is none.
type tasksFiles struct{ pids, pidsBack, freezerBack int }

func openTasksFiles(freezerFD, pidsFD int) (tasksFiles, error) {
	t := tasksFiles{-1, -1, -1}
	open := func(dirfd int, name string) (int, error) {
		if dirfd < 0 {
			return -1, nil
		}
		fd, err := unix.Openat(dirfd, name, unix.O_WRONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, fmt.Errorf("open cgroup tasks file %s: %w", name, err)
		}
		return fd, nil
	}
	var err error
	if t.pids, err = open(pidsFD, "tasks"); err != nil {
		return t, err
	}
	if t.pidsBack, err = open(pidsFD, "../tasks"); err != nil {
		return t, err
	}
	t.freezerBack, err = open(freezerFD, "tasks")
	return t, err
}

// enter moves the calling thread into the cgroup of the tasks file fd.
func enter(fd int) error {
	_, err := unix.Write(fd, []byte("0"))
	return err
}

// lookPath finds name on the PATH of env, like a shell would; relative
// PATH entries are taken from dir.
func lookPath(name string, env []string, dir string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, d := range filepath.SplitList(path) {
		if d == "" {
			d = "."
		}
		if !filepath.IsAbs(d) && dir != "" {
			d = filepath.Join(dir, d)
		}
		p := filepath.Join(d, name)
		st, err := os.Stat(p)
		if err != nil || st.IsDir() {
			continue
		}
		if unix.Access(p, unix.X_OK) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("find %q: executable file not found in PATH", name)
}
