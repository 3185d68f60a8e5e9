package bench

import (
	"strings"
	"testing"
)

func TestPerSandboxMiB(t *testing.T) {
	if got, method := perSandboxMiB(300, 100); got != 3 || method != idleMemoryMethod {
		t.Errorf("grown by 300 MiB over 100: %v %q", got, method)
	}
	got, method := perSandboxMiB(-10, 200)
	if got != 0 || !strings.Contains(method, "not measured") {
		t.Errorf("shrunk: %v %q, want 0 and a method saying it was not measured", got, method)
	}
	if got, _ := perSandboxMiB(300, 0); got != 0 {
		t.Errorf("no sandboxes: %v", got)
	}
}

func TestSandboxOfCgroup(t *testing.T) {
	for _, tc := range []struct{ cgroup, want string }{
		{"12:freezer:/dsec/sb-t1-aaaa\n11:memory:/dsec/sb-t1-aaaa\n0::/\n", "sb-t1-aaaa"},
		{"0::/dsec/sb-t1-bbbb\n", "sb-t1-bbbb"},
		{"3:cpu,cpuacct:/user.slice\n0::/user.slice/session-1.scope\n", ""},
		{"", ""},
	} {
		if got := sandboxOfCgroup(tc.cgroup); got != tc.want {
			t.Errorf("sandboxOfCgroup(%q) = %q, want %q", tc.cgroup, got, tc.want)
		}
	}
}

// Only processes there at both readings count, each for what it used
// between them.
func TestCPUUseMinus(t *testing.T) {
	var before, after cpuUse
	before.add("10", 1000, 5)
	before.add("11", 500, 1) // gone since
	after.add("10", 4000, 8)
	after.add("12", 9000, 9) // new since
	d := after.minus(before)
	if d.procs != 1 || d.ns != 3000 || d.runs != 3 {
		t.Errorf("after minus before = %d processes, %d ns, %d runs; want 1, 3000, 3", d.procs, d.ns, d.runs)
	}
}

func TestDaemonTicks(t *testing.T) {
	const rest = " S 1 2 3 4 5 6 7 8 9 10 100 20 300 4 20 0 12 0 1000 0 0"
	for _, tc := range []struct {
		stat string
		want int64
	}{
		{"4242 (dsecd)" + rest, 424},
		{"4242 (dsec-agent)" + rest, 0},
		{"4242 (dsecd) oops)" + rest, 0},
		{"4242 (dsecd", 0},
	} {
		if got := daemonTicks(tc.stat); got != tc.want {
			t.Errorf("daemonTicks(%q) = %d, want %d", tc.stat, got, tc.want)
		}
	}
}
