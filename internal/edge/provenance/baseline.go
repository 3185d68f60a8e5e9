package provenance

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// Baseline is what a sandbox's writable layer holds once it has started
// and before any caller's command ran: the entries the platform itself
// made (the agent's mount point, the host name and hosts files, the
// resolver's mount point), each by its kind, size, modification time and,
// where the kernel gives them, its inode and inode change time.
type Baseline map[string]Stamp

// Stamp identifies one state of an entry. The modification time alone
// does not: a process sets it back at will (touch -d, utimensat) after
// rewriting a file to its size. The inode change time (ctime) it cannot
// set: every write, chmod, chown, rename or utimensat moves it to now, and
// a file replaced (renamed over) has another inode. Ino and ChangeTime are
// 0 where the system gives none (not Linux), and in a baseline saved
// before they were recorded, which is then compared without them.
type Stamp struct {
	Mode       fs.FileMode `json:"mode"`
	Size       int64       `json:"size"`
	ModTime    int64       `json:"mtime_ns"`
	Ino        uint64      `json:"ino,omitempty"`
	ChangeTime int64       `json:"ctime_ns,omitempty"`
}

func stampOf(info fs.FileInfo) Stamp {
	ino, ctime := inodeOf(info)
	return Stamp{Mode: info.Mode(), Size: info.Size(), ModTime: info.ModTime().UnixNano(), Ino: ino, ChangeTime: ctime}
}

func (b Baseline) unchanged(rel string, info fs.FileInfo) bool {
	st, ok := b[rel]
	if !ok {
		return false
	}
	now := stampOf(info)
	if st.Ino == 0 && st.ChangeTime == 0 {
		now.Ino, now.ChangeTime = 0, 0 // a baseline saved before they were recorded
	}
	return st == now
}

// TakeBaseline records upper as it is now.
func TakeBaseline(upper string) (Baseline, error) {
	b := Baseline{}
	err := filepath.WalkDir(upper, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == upper {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		b["/"+filepath.ToSlash(strings.TrimPrefix(p, upper+string(filepath.Separator)))] = stampOf(info)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("take baseline of writable layer %s: %w", upper, err)
	}
	return b, nil
}

// Save writes b to file p.
func (b Baseline) Save(p string) error {
	data, err := json.Marshal(b)
	if err != nil {
		return fmt.Errorf("encode provenance baseline: %w", err)
	}
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("save provenance baseline: %w", err)
	}
	if err := os.Rename(tmp, p); err != nil {
		return fmt.Errorf("save provenance baseline: %w", err)
	}
	return nil
}

// LoadBaseline reads a baseline Save wrote; a missing file is nil, no
// error.
func LoadBaseline(p string) (Baseline, error) {
	data, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("load provenance baseline: %w", err)
	}
	var b Baseline
	if err := json.Unmarshal(data, &b); err != nil {
		return nil, fmt.Errorf("decode provenance baseline %s: %w", p, err)
	}
	return b, nil
}

// PlatformPaths are what the platform writes into a sandbox's root as it
// starts (the agent's mount point, the host name, hosts and resolver
// files): a scan without a baseline leaves them out.
var PlatformPaths = []string{"/.dsec", "/etc/hostname", "/etc/hosts", "/etc/resolv.conf"}

func platformPath(rel string) bool { return under(rel, PlatformPaths) }
