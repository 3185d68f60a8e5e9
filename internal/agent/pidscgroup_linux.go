package agent

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// commandsCgroup makes the commands' cgroup under root, the agent's own
// cgroup v2 dir, capped at max tasks (when max > 0), and returns an fd of it for
// Config.CgroupFD: each command then gets its own cgroup under it, as in a
// container on a cgroup v2 host, and the agent's threads stay outside the
// limit. Under gVisor no host cgroup dir reaches the agent, so it makes
// the dir itself (--cgroup-path, --pids-max) in the sentry's own cgroupfs
// (runsc --in-sandbox-cgroup=v2, a cgroup mount in the spec, a cgroup
// namespace rooted at the container's cgroup), whose pids controller
// refuses a fork past pids.max as the host's does. The agent first moves to a leaf of its
// own: a cgroup with processes in it cannot give its children controllers.
func commandsCgroup(root string, max int64) (int, error) {
	mkdir := func(dir string) error {
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		return nil
	}
	agentDir := filepath.Join(root, "agent")
	if err := mkdir(agentDir); err != nil {
		return -1, fmt.Errorf("make the agent's cgroup: %w", err)
	}
	if err := os.WriteFile(filepath.Join(agentDir, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
		return -1, fmt.Errorf("move the agent into its cgroup: %w", err)
	}
	if err := os.WriteFile(filepath.Join(root, "cgroup.subtree_control"), []byte("+pids"), 0); err != nil {
		return -1, fmt.Errorf("enable the pids controller: %w", err)
	}
	dir := filepath.Join(root, "commands")
	if err := mkdir(dir); err != nil {
		return -1, fmt.Errorf("make the commands' cgroup: %w", err)
	}
	if max > 0 {
		if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(strconv.FormatInt(max, 10)), 0); err != nil {
			return -1, fmt.Errorf("cap the commands' cgroup at %d pids: %w", max, err)
		}
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open the commands' cgroup: %w", err)
	}
	return fd, nil
}
