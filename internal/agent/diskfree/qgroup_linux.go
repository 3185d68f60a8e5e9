//go:build linux && (amd64 || arm64)

package diskfree

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// qgroup holds the sysfs files of a btrfs qgroup, read again at every call.
type qgroup struct {
	limit int   // max_referenced
	usage []int // referenced and the reservations that exist (rsv_*)
}

func openQgroup(dir string) (*qgroup, error) {
	open := func(name string) (int, error) {
		fd, err := unix.Open(filepath.Join(dir, name), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, fmt.Errorf("open qgroup file %s: %w", filepath.Join(dir, name), err)
		}
		return fd, nil
	}
	q := &qgroup{limit: -1}
	var err error
	if q.limit, err = open("max_referenced"); err != nil {
		return nil, err
	}
	fd, err := open("referenced")
	if err != nil {
		q.close()
		return nil, err
	}
	q.usage = append(q.usage, fd)
	// Reservations (Linux 5.9+) count writes not yet committed, which the
	// kernel's limit check counts too; without them usage lags a commit.
	for _, name := range []string{"rsv_data", "rsv_meta_pertrans", "rsv_meta_prealloc"} {
		if fd, err := open(name); err == nil {
			q.usage = append(q.usage, fd)
		}
	}
	return q, nil
}

func (q *qgroup) close() {
	unix.Close(q.limit)
	for _, fd := range q.usage {
		unix.Close(fd)
	}
}

// read returns the limit and the usage in bytes.
func (q *qgroup) read() (limit, used int64, err error) {
	if limit, err = readInt(q.limit); err != nil {
		return 0, 0, err
	}
	for _, fd := range q.usage {
		v, err := readInt(fd)
		if err != nil {
			return 0, 0, err
		}
		used += v
	}
	return limit, used, nil
}

// readInt reads a sysfs attribute holding a number; a pread at offset 0
// makes sysfs produce it anew.
func readInt(fd int) (int64, error) {
	var b [32]byte
	n, err := unix.Pread(fd, b[:], 0)
	if err != nil {
		return 0, fmt.Errorf("read qgroup: %w", err)
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(b[:n])), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("read qgroup: %w", err)
	}
	return v, nil
}
