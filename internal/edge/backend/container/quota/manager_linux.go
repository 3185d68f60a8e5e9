package quota

import (
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"dsec.dev/dsec/internal/edge/btrfs"
	"dsec.dev/dsec/internal/errdefs"
)

// Manager makes limited directories under one root. It is safe for
// concurrent use; different Managers must not share a root.
type Manager struct {
	root string
	kind string
	mu   sync.Mutex // serialises project ID allocation
}

// projectFile records a directory's project ID beside its contents, so
// Remove works for directories an earlier process made.
const projectFile = ".project"

// Open returns a Manager for root, or an error wrapping
// errdefs.ErrNotSupported when root's file system can enforce neither
// project quotas nor btrfs qgroups.
func Open(root string) (*Manager, error) {
	perr := projectSupported(root)
	if perr == nil {
		return &Manager{root: root, kind: KindProject}, nil
	}
	berr := btrfsSupported(root)
	if berr == nil {
		return &Manager{root: root, kind: KindBtrfs}, nil
	}
	return nil, fmt.Errorf("open quotas on %s: %w; %w", root, perr, berr)
}

// Kind says which mechanism m uses: KindProject or KindBtrfs.
func (m *Manager) Kind() string { return m.kind }

// Create makes <root>/<name> with limit l and returns its path. Everything
// made inside it later counts against l.
func (m *Manager) Create(name string, l Limit) (string, error) {
	dir := filepath.Join(m.root, name)
	if m.kind == KindBtrfs {
		if err := btrfs.CreateSubvolume(m.root, name); err != nil {
			return "", err
		}
		if err := btrfs.LimitSubvolume(dir, l.Bytes); err != nil {
			return "", errors.Join(err, m.Remove(name))
		}
		return dir, nil
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return "", fmt.Errorf("make %s: %w", dir, errdefs.ErrAlreadyExists)
		}
		return "", fmt.Errorf("make %s: %w", dir, err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	proj, err := m.freeProject(name)
	if err != nil {
		return "", err
	}
	// Written before the dir is tagged, so it is not charged to the project.
	if err := os.WriteFile(filepath.Join(dir, projectFile), []byte(strconv.FormatUint(uint64(proj), 10)+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("record project of %s: %w", dir, err)
	}
	if err := setProject(dir, proj); err != nil {
		return "", err
	}
	// A project with limits counts as taken, so set an inode limit even
	// when the caller asked for none.
	if l.Inodes <= 0 {
		l.Inodes = 1 << 62
	}
	if err := setProjectLimit(dir, proj, l); err != nil {
		return "", err
	}
	return dir, nil
}

// freeProject picks the project ID of name: a hash of it, or the next one
// after it that holds nothing and has no limits. The caller holds m.mu.
func (m *Manager) freeProject(name string) (uint32, error) {
	h := fnv.New32a()
	h.Write([]byte(name))
	// Stay clear of 0 (no project) and of small IDs an admin may use.
	const base, span = 1 << 20, 1<<31 - 1<<20
	start := h.Sum32() % span
	for i := uint32(0); i < 1000; i++ {
		p := base + (start+i)%span
		l, u, err := getProject(m.root, p)
		if err != nil {
			return 0, err
		}
		if l == (Limit{}) && u == (Usage{}) {
			return p, nil
		}
	}
	return 0, fmt.Errorf("pick quota project for %s: %w", name, errdefs.ErrResourceExhausted)
}

// Qgroup returns the sysfs directory of the btrfs qgroup that limits
// <root>/<name>, /sys/fs/btrfs/<fsid>/qgroups/0_<subvolume id>, whose files
// hold its limit (max_referenced) and usage (referenced, and the rsv_*
// reservations of writes not yet committed). Under project quotas it
// returns "": the kernel's statfs of a directory in a project with limits
// already reports the project's limit and usage.
func (m *Manager) Qgroup(name string) (string, error) {
	if m.kind != KindBtrfs {
		return "", nil
	}
	dir := filepath.Join(m.root, name)
	fsid, err := btrfs.FSID(dir)
	if err != nil {
		return "", err
	}
	id, err := btrfs.SubvolumeID(dir)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("/sys/fs/btrfs/%s/qgroups/0_%d", fsid, id), nil
}

// Usage returns the limit and the use of <root>/<name>: its project's
// quota, or its btrfs qgroup's referenced bytes and the reservations of
// writes not yet committed (what the agent's statfs reports; no inode
// counts there).
func (m *Manager) Usage(name string) (Limit, Usage, error) {
	dir := filepath.Join(m.root, name)
	if m.kind == KindBtrfs {
		qg, err := m.Qgroup(name)
		if err != nil {
			return Limit{}, Usage{}, err
		}
		used, err := readSysInt(filepath.Join(qg, "referenced"))
		if err != nil {
			return Limit{}, Usage{}, fmt.Errorf("read disk use of %s: %w", dir, err)
		}
		for _, rsv := range []string{"rsv_data", "rsv_meta_pertrans", "rsv_meta_prealloc"} {
			if n, err := readSysInt(filepath.Join(qg, rsv)); err == nil {
				used += n
			}
		}
		// "none" when the subvolume has no limit.
		limit, _ := readSysInt(filepath.Join(qg, "max_referenced"))
		return Limit{Bytes: limit}, Usage{Bytes: used}, nil
	}
	b, err := os.ReadFile(filepath.Join(dir, projectFile))
	if err != nil {
		return Limit{}, Usage{}, fmt.Errorf("read project of %s: %w", dir, err)
	}
	p, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32)
	if err != nil {
		return Limit{}, Usage{}, fmt.Errorf("parse project of %s: %w", dir, err)
	}
	return getProject(m.root, uint32(p))
}

func readSysInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// Remove removes <root>/<name> with its contents and frees its quota. A
// missing directory is fine.
func (m *Manager) Remove(name string) error {
	dir := filepath.Join(m.root, name)
	b, perr := os.ReadFile(filepath.Join(dir, projectFile))
	// On btrfs RemoveAll ends with rmdir of the empty subvolume, which the
	// kernel allows to root.
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	if perr != nil {
		return nil
	}
	p, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32)
	if err != nil {
		return fmt.Errorf("parse project of %s: %w", dir, err)
	}
	return setProjectLimit(m.root, uint32(p), Limit{})
}

func btrfsSupported(path string) error {
	ok, err := btrfs.Is(path)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("check btrfs qgroups on %s: not btrfs: %w", path, errdefs.ErrNotSupported)
	}
	uuid, err := btrfs.FSID(path)
	if err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join("/sys/fs/btrfs", uuid, "qgroups")); err != nil {
		return fmt.Errorf("check btrfs qgroups on %s: quotas not enabled: %w", path, errdefs.ErrNotSupported)
	}
	return nil
}

// EnableBtrfs turns on qgroups on the btrfs mounted at root. It is a no-op
// when they are on already.
func EnableBtrfs(root string) error { return btrfs.EnableQuota(root) }
