package cgroups

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/backend/container/mountinfo"
)

// Root is where cgroup file systems are mounted.
const Root = "/sys/fs/cgroup"

// v1Controllers are the controllers whose directories the runtime prepares
// on cgroup v1; runc makes the others it uses by itself.
var v1Controllers = []string{"cpu", "cpuacct", "cpuset", "memory", "pids", "freezer", "devices", "blkio"}

// v2Controllers are enabled for sandboxes on cgroup v2.
var v2Controllers = []string{"cpuset", "cpu", "io", "memory", "pids"}

// Layout is the host's cgroup layout. Paths named rel are relative to a
// hierarchy's root, like "dsec/sb-1".
type Layout struct {
	v2          bool
	controllers map[string]string // v1: controller -> mount point
	hierarchies []string          // every cgroup hierarchy's mount point, v1 named ones and cgroup2 included
}

// Detect reads the host's cgroup layout: pure cgroup v2 when Root itself is
// a cgroup2 file system, v1 (with or without a cgroup2 beside it) otherwise.
func Detect() (*Layout, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(Root, &st); err != nil {
		return nil, fmt.Errorf("statfs %s: %w", Root, err)
	}
	l := &Layout{controllers: map[string]string{}}
	if st.Type == unix.CGROUP2_SUPER_MAGIC {
		l.v2 = true
		l.hierarchies = []string{Root}
		return l, nil
	}
	ms, err := mountinfo.Read()
	if err != nil {
		return nil, err
	}
	seen := map[[2]int]bool{}
	for _, m := range ms {
		if (m.FSType != "cgroup" && m.FSType != "cgroup2") || m.Root != "/" {
			continue
		}
		if !strings.HasPrefix(m.Point, Root+"/") {
			continue
		}
		key := [2]int{m.Major, m.Minor}
		if seen[key] {
			continue
		}
		seen[key] = true
		l.hierarchies = append(l.hierarchies, m.Point)
		if m.FSType != "cgroup" {
			continue
		}
		for _, c := range v1Controllers {
			if m.HasSuperOption(c) {
				l.controllers[c] = m.Point
			}
		}
	}
	for _, c := range []string{"memory", "freezer", "pids", "cpu"} {
		if l.controllers[c] == "" {
			return nil, fmt.Errorf("detect cgroups: v1 controller %s is not mounted", c)
		}
	}
	return l, nil
}

// V2 reports whether the host runs pure cgroup v2.
func (l *Layout) V2() bool { return l.v2 }

// Dir is the directory of rel for controller ctrl (ignored on v2).
func (l *Layout) Dir(ctrl, rel string) string {
	if l.v2 {
		return filepath.Join(Root, rel)
	}
	return filepath.Join(l.controllers[ctrl], rel)
}

// EnsureParent makes the parent cgroup of all sandboxes. It is idempotent.
func (l *Layout) EnsureParent(parent string) error {
	if l.v2 {
		dir := filepath.Join(Root, parent)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("make cgroup %s: %w", dir, err)
		}
		// Controllers a kernel lacks are skipped; runc reports the ones a
		// limit needs.
		for _, d := range []string{Root, dir} {
			for _, c := range v2Controllers {
				_ = os.WriteFile(filepath.Join(d, "cgroup.subtree_control"), []byte("+"+c), 0)
			}
		}
		return nil
	}
	for _, c := range v1Controllers {
		mp := l.controllers[c]
		if mp == "" {
			continue
		}
		dir := filepath.Join(mp, parent)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("make cgroup %s: %w", dir, err)
		}
		if c == "cpuset" {
			// A new cpuset has no cpus or mems; its children could hold no task.
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				if err := inheritFile(mp, parent, f); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func inheritFile(root, rel, name string) error {
	dir := root
	for _, part := range strings.Split(filepath.Clean(rel), "/") {
		parent := dir
		dir = filepath.Join(dir, part)
		cur, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return fmt.Errorf("read %s: %w", name, err)
		}
		if strings.TrimSpace(string(cur)) != "" {
			continue
		}
		v, err := os.ReadFile(filepath.Join(parent, name))
		if err != nil {
			return fmt.Errorf("read %s: %w", name, err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), v, 0); err != nil {
			return fmt.Errorf("write %s in %s: %w", name, dir, err)
		}
	}
	return nil
}

// RemoveParent removes the parent cgroup in every hierarchy. It fails while
// a sandbox cgroup is left under it.
func (l *Layout) RemoveParent(parent string) error {
	var errs []error
	for _, h := range l.hierarchies {
		dir := filepath.Join(h, parent)
		// EBUSY: another node on this host (several dsecd roots, as in
		// tests) still has sandboxes under the shared parent.
		if err := unix.Rmdir(dir); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EBUSY) {
			errs = append(errs, fmt.Errorf("remove cgroup %s: %w", dir, err))
		}
	}
	return errors.Join(errs...)
}

// Create makes a sandbox's cgroup dirs that the runtime opens before the
// container starts: the freezer and memory dirs on v1 (the agent makes its
// per-command children under the freezer dir), the unified dir on v2. It
// returns them in that order; on v2 both are the same.
func (l *Layout) Create(rel string) (freezer, memory string, err error) {
	freezer, memory = l.Dir("freezer", rel), l.Dir("memory", rel)
	for _, d := range []string{freezer, memory} {
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return "", "", fmt.Errorf("make cgroup %s: %w", d, err)
		}
	}
	return freezer, memory, nil
}

// CreateCPU makes sandbox rel's cpu cgroup dir before the container starts
// (runc then uses it), so the runtime can hand the agent an fd of it: the
// cpu controller's dir on v1, the unified dir on v2.
func (l *Layout) CreateCPU(rel string) (string, error) {
	dir := l.Dir("cpu", rel)
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return "", fmt.Errorf("make cgroup %s: %w", dir, err)
	}
	return dir, nil
}

// CommandPids makes, on cgroup v1, the pids cgroup <pids>/<rel>/cmds with
// limit pids.max, and returns its dir: the agent moves every command into
// it, so commands share the sandbox's pids limit while the agent, left in
// the parent (whose limit is higher), keeps the room it needs to run. On
// v2 it returns "" (there the whole sandbox shares one limit).
func (l *Layout) CommandPids(rel string, max int64) (string, error) {
	if l.v2 || l.controllers["pids"] == "" {
		return "", nil
	}
	parent := l.Dir("pids", rel)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return "", fmt.Errorf("make cgroup %s: %w", parent, err)
	}
	dir := filepath.Join(parent, "cmds")
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return "", fmt.Errorf("make cgroup %s: %w", dir, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(strconv.FormatInt(max, 10)), 0); err != nil {
		return "", fmt.Errorf("limit cgroup %s to %d pids: %w", dir, max, err)
	}
	return dir, nil
}

// Exists reports whether any hierarchy holds rel.
func (l *Layout) Exists(rel string) bool {
	for _, h := range l.hierarchies {
		if _, err := os.Stat(filepath.Join(h, rel)); err == nil {
			return true
		}
	}
	return false
}

// tree lists rel and every cgroup below it in every hierarchy, children
// before their parents.
func (l *Layout) tree(rel string) []string {
	var out []string
	for _, h := range l.hierarchies {
		top := filepath.Join(h, rel)
		var dirs []string
		_ = filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return nil
			}
			if d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			out = append(out, dirs[i])
		}
	}
	return out
}

// Kill SIGKILLs every process in rel's cgroup tree in every hierarchy, thawing
// frozen ones first, and waits until the tree holds no process or ctx ends.
func (l *Layout) Kill(ctx context.Context, rel string) error {
	dirs := l.tree(rel)
	for _, d := range dirs {
		// v1: a frozen task does not die until thawed. v2: cgroup.kill
		// (Linux 5.14) kills the whole subtree, frozen tasks included.
		if _, err := os.Stat(filepath.Join(d, "freezer.state")); err == nil {
			_ = os.WriteFile(filepath.Join(d, "freezer.state"), []byte("THAWED"), 0)
		}
		if _, err := os.Stat(filepath.Join(d, "cgroup.kill")); err == nil {
			_ = os.WriteFile(filepath.Join(d, "cgroup.kill"), []byte("1"), 0)
		}
		if _, err := os.Stat(filepath.Join(d, "cgroup.freeze")); err == nil {
			_ = os.WriteFile(filepath.Join(d, "cgroup.freeze"), []byte("0"), 0)
		}
	}
	delay := time.Millisecond
	for {
		left := 0
		for _, d := range dirs {
			pids, err := readPids(filepath.Join(d, "cgroup.procs"))
			if err != nil {
				continue
			}
			for _, pid := range pids {
				left++
				_ = unix.Kill(pid, unix.SIGKILL)
			}
		}
		if left == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kill cgroup %s: %d processes left: %w", rel, left, ctx.Err())
		case <-time.After(delay):
		}
		delay = min(delay*2, 100*time.Millisecond)
	}
}

// Remove removes rel's cgroup tree in every hierarchy, children first. The
// tree must hold no process (see Kill); a cgroup whose last task is still
// exiting is retried until ctx ends.
func (l *Layout) Remove(ctx context.Context, rel string) error {
	delay := time.Millisecond
	for {
		var busy error
		for _, d := range l.tree(rel) {
			err := unix.Rmdir(d)
			switch {
			case err == nil, errors.Is(err, unix.ENOENT):
			case errors.Is(err, unix.EBUSY):
				busy = fmt.Errorf("remove cgroup %s: %w", d, err)
			default:
				return fmt.Errorf("remove cgroup %s: %w", d, err)
			}
		}
		if busy == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return busy
		case <-time.After(delay):
		}
		delay = min(delay*2, 100*time.Millisecond)
	}
}

// Stats reads rel's memory statistics.
func (l *Layout) Stats(rel string) (Stats, error) {
	var s Stats
	dir := l.Dir("memory", rel)
	if l.v2 {
		cur, err := readInt(filepath.Join(dir, "memory.current"))
		if err != nil {
			return s, err
		}
		s.MemoryBytes = cur
		// memory.events counts the whole subtree.
		s.OOMKills, _ = readKey(filepath.Join(dir, "memory.events"), "oom_kill")
		return s, nil
	}
	cur, err := readInt(filepath.Join(dir, "memory.usage_in_bytes"))
	if err != nil {
		return s, err
	}
	s.MemoryBytes = cur
	// v1 counts a kill in the cgroup whose limit was hit only: add the
	// children, which may have limits of their own.
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		n, _ := readKey(filepath.Join(p, "memory.oom_control"), "oom_kill")
		s.OOMKills += n
		return nil
	})
	return s, nil
}

// Usage reads rel's CPU time, memory use and memory limit.
func (l *Layout) Usage(rel string) (Usage, error) {
	var u Usage
	if l.v2 {
		dir := l.Dir("", rel)
		usec, err := readKey(filepath.Join(dir, "cpu.stat"), "usage_usec")
		if err != nil {
			return u, err
		}
		u.CPUUsec = usec
		if u.MemoryBytes, err = readInt(filepath.Join(dir, "memory.current")); err != nil {
			return u, err
		}
		u.MemoryLimit, _ = readInt(filepath.Join(dir, "memory.max")) // "max": none
		u.CacheBytes, _ = readKey(filepath.Join(dir, "memory.stat"), "file")
		return u, nil
	}
	ns, err := readInt(filepath.Join(l.Dir("cpuacct", rel), "cpuacct.usage"))
	if err != nil {
		return u, err
	}
	u.CPUUsec = ns / 1000
	mem := l.Dir("memory", rel)
	if u.MemoryBytes, err = readInt(filepath.Join(mem, "memory.usage_in_bytes")); err != nil {
		return u, err
	}
	// v1 says "no limit" with a huge number (page-aligned LONG_MAX).
	if lim, err := readInt(filepath.Join(mem, "memory.limit_in_bytes")); err == nil && lim < 1<<60 {
		u.MemoryLimit = lim
	}
	u.CacheBytes, _ = readKey(filepath.Join(mem, "memory.stat"), "total_cache")
	return u, nil
}

func readPids(path string) ([]int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 0 {
			out = append(out, pid)
		}
	}
	return out, nil
}

func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", path, err)
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parse %s: %w", path, err)
	}
	return v, nil
}

// readKey reads the value of "key N" in a flat-keyed cgroup file.
func readKey(path, key string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if ok && k == key {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("read %s: no key %s: %w", path, key, syscall.ENOENT)
}
