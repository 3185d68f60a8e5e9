// Package mountinfo parses /proc/self/mountinfo for the container runtime:
// which mount holds a path, where each cgroup hierarchy is, what backs the
// upper file system.
package mountinfo

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Mount is one line of mountinfo.
type Mount struct {
	Major, Minor int
	Root         string // path inside the mounted file system
	Point        string // mount point
	Options      string // per-mount options
	FSType       string
	Source       string
	SuperOptions string // per-superblock options, e.g. "rw,prjquota"
}

// HasSuperOption reports whether opt is one of m's superblock options.
func (m Mount) HasSuperOption(opt string) bool {
	for _, o := range strings.Split(m.SuperOptions, ",") {
		if o == opt {
			return true
		}
	}
	return false
}

// Read returns the mounts of the calling process's mount namespace.
func Read() ([]Mount, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("open mountinfo: %w", err)
	}
	defer f.Close()
	return Parse(f)
}

// Parse reads mountinfo text.
func Parse(r io.Reader) ([]Mount, error) {
	var out []Mount
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			return nil, fmt.Errorf("parse mountinfo line %q: no separator", line)
		}
		a := strings.Fields(pre)
		b := strings.Fields(post)
		if len(a) < 6 || len(b) < 3 {
			return nil, fmt.Errorf("parse mountinfo line %q: too few fields", line)
		}
		maj, min, _ := strings.Cut(a[2], ":")
		m := Mount{
			Root:         unescape(a[3]),
			Point:        unescape(a[4]),
			Options:      a[5],
			FSType:       b[0],
			Source:       unescape(b[1]),
			SuperOptions: b[2],
		}
		m.Major, _ = strconv.Atoi(maj)
		m.Minor, _ = strconv.Atoi(min)
		out = append(out, m)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	return out, nil
}

// Containing returns the mount that holds path: the last-mounted one with the
// longest mount point that is path or one of its parents. path must be
// absolute and free of symlinks.
func Containing(mounts []Mount, path string) (Mount, bool) {
	path = filepath.Clean(path)
	best, found := Mount{}, false
	for _, m := range mounts {
		if !under(path, m.Point) {
			continue
		}
		if !found || len(m.Point) >= len(best.Point) {
			best, found = m, true
		}
	}
	return best, found
}

// At returns the last mount whose mount point is exactly path.
func At(mounts []Mount, path string) (Mount, bool) {
	path = filepath.Clean(path)
	best, found := Mount{}, false
	for _, m := range mounts {
		if m.Point == path {
			best, found = m, true
		}
	}
	return best, found
}

func under(path, dir string) bool {
	if dir == "/" || path == dir {
		return true
	}
	return strings.HasPrefix(path, dir+"/")
}

// unescape undoes the octal escapes (\040 for space…) of mountinfo fields.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
