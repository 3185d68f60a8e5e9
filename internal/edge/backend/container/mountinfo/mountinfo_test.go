package mountinfo

import (
	"strings"
	"testing"
)

const sample = `22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
31 22 0:27 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
40 22 7:0 / /var/lib/my\040upper rw,relatime - ext4 /dev/loop0 rw,prjquota
`

func TestParse(t *testing.T) {
	ms, err := Parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 4 {
		t.Fatalf("got %d mounts, want 4", len(ms))
	}
	tests := []struct {
		path, point string
	}{
		{"/", "/"},
		{"/etc/passwd", "/"},
		{"/sys/fs/cgroup/memory/dsec", "/sys/fs/cgroup/memory"},
		{"/sys/fs/cgroup/memoryx", "/"},
		{"/var/lib/my upper/sb-1/upper", "/var/lib/my upper"},
	}
	for _, tt := range tests {
		t.Run(tt.path, func(t *testing.T) {
			m, ok := Containing(ms, tt.path)
			if !ok || m.Point != tt.point {
				t.Fatalf("Containing(%q) = %q, %v; want %q", tt.path, m.Point, ok, tt.point)
			}
		})
	}
	m, ok := At(ms, "/var/lib/my upper")
	if !ok || m.Source != "/dev/loop0" || !m.HasSuperOption("prjquota") || m.Major != 7 {
		t.Fatalf("At = %+v, %v", m, ok)
	}
	if m.HasSuperOption("quota") {
		t.Fatal("HasSuperOption matched a substring")
	}
}
