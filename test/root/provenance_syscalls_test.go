package root

import (
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// refusedCalls calls unshare, mount, keyctl and bpf (x86_64's numbers) from
// Python, each refused by the profile with EPERM, and exits at once: the
// edge reads the records after the process is gone.
const refusedCalls = `python3 -c '
import ctypes
l = ctypes.CDLL(None, use_errno=True)
for n in (272, 165, 250, 321):
    r = l.syscall(n, 0, 0, 0, 0, 0)
    assert r == -1 and ctypes.get_errno() == 1, (n, r, ctypes.get_errno())
print("refused")
'`

// honestWork starts threads (glibc tries clone3 for each, which the agent
// refuses, unlogged, with ENOSYS) and processes, and checks clone3's
// answer.
const honestWork = `python3 -c '
import ctypes, subprocess, threading
ts = [threading.Thread(target=lambda: None) for _ in range(8)]
[t.start() for t in ts]
[t.join() for t in ts]
subprocess.run(["true"], check=True)
l = ctypes.CDLL(None, use_errno=True)
assert l.syscall(435, 0, 0) == -1 and ctypes.get_errno() == 38, ctypes.get_errno()
print("honest")
' && mkdir -p /work && echo done > /work/out`

// tightLoop calls keyctl, refused, as fast as Python can, and getppid as
// often for comparison, and prints what a call of each took.
const tightLoop = `python3 -c '
import ctypes, time
l = ctypes.CDLL(None, use_errno=True)
t0 = time.perf_counter()
for _ in range(200000):
    l.syscall(250, 0, 0, 0, 0, 0)
t1 = time.perf_counter()
for _ in range(200000):
    l.syscall(110)
t2 = time.perf_counter()
print("keyctl %.2f us, getppid %.2f us" % ((t1 - t0) / 0.2, (t2 - t1) / 0.2))
'`

// testProvenanceSyscalls (TestE2BBase/ProvenanceSyscalls): syscalls the sandbox's profile refuses show in
// `dsec provenance` (each by name with its count, syscalls_denied raised)
// and in a grade's provenance, though the process that called them ended
// at once; honest work (threads, processes: clone3 refused unlogged) raises
// nothing; a tight loop of refusals keeps a count, 32 samples and says
// what it dropped and what the node's reader missed (its rate limit),
// count and misses together covering every call.
func testProvenanceSyscalls(t *testing.T, d *testutil.Daemon) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the calls are made by x86_64's numbers")
	}
	// Python on E2B's base (Debian's python3, 0.3 GB), not the fncall
	// environment's 1.8 GB of toolchains.
	base := testutil.E2BBaseEnv + ":latest"
	run := func(t *testing.T, command string) (string, *dsecv1.SandboxProvenance) {
		t.Helper()
		out, errOut, code := d.CLI("", "create", "--workspace", "/work", base)
		if code != 0 {
			t.Fatalf("dsec create: %s %s", out, errOut)
		}
		id := strings.TrimSpace(out)
		t.Cleanup(func() { d.CLI("", "rm", id) })
		out, errOut, code = d.CLI("", "exec", id, "--", "sh", "-c", command)
		if code != 0 {
			t.Fatalf("exec: exit %d: %s %s", code, out, errOut)
		}
		return id, provenanceOf(t, d, id)
	}
	names := func(p *dsecv1.SandboxProvenance) []string {
		var out []string
		for _, s := range p.GetSyscallsDenied() {
			out = append(out, s.GetName())
		}
		return out
	}

	t.Run("honest", func(t *testing.T) {
		id, p := run(t, honestWork)
		if f := p.GetFlags(); f.GetSyscallsDenied() || len(p.GetSyscallsDenied()) > 0 || len(p.GetSyscallSamples()) > 0 {
			human, _, _ := d.CLI("", "provenance", id)
			t.Errorf("honest work: syscalls_denied %v, %v\n%s", f.GetSyscallsDenied(), names(p), human)
		}
		for _, u := range p.GetUnseen() {
			if strings.HasPrefix(u, "syscalls_denied") {
				t.Errorf("unseen: %s", u)
			}
		}
	})

	t.Run("refused", func(t *testing.T) {
		id, p := run(t, refusedCalls+" && mkdir -p /work && echo done > /work/out")
		want := []string{"bpf", "keyctl", "mount", "unshare"}
		if got := names(p); !slices.Equal(got, want) || !p.GetFlags().GetSyscallsDenied() {
			human, _, _ := d.CLI("", "provenance", id)
			t.Fatalf("syscalls denied %v (flag %v), want %v\n%s\n%s", got, p.GetFlags().GetSyscallsDenied(), want, human, d.Log())
		}
		for _, s := range p.GetSyscallsDenied() {
			if s.GetCount() != 1 || s.GetCommand() != "python3" || s.GetPid() <= 0 {
				t.Errorf("%s: count %d by %d %q, want once by python3", s.GetName(), s.GetCount(), s.GetPid(), s.GetCommand())
			}
		}
		if len(p.GetSyscallSamples()) != 4 || p.GetSyscallSamplesDropped() != 0 {
			t.Errorf("samples %d, dropped %d; want 4, 0", len(p.GetSyscallSamples()), p.GetSyscallSamplesDropped())
		}
		human, errOut, code := d.CLI("", "provenance", id)
		if code != 0 || !strings.Contains(human, "SYSCALLS DENIED (4 calls)") || !strings.Contains(human, "keyctl") {
			t.Errorf("dsec provenance: exit %d\n%s%s", code, human, errOut)
		}
		out, errOut, code := d.CLI("", "grade", id, "--json", "--path", "/work", "-c", "test -f /work/out")
		if code != 0 {
			t.Fatalf("dsec grade: exit %d: %s %s", code, out, errOut)
		}
		var g dsecv1.GradeResult
		if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal([]byte(out), &g); err != nil {
			t.Fatalf("dsec grade --json: %v\n%s", err, out)
		}
		if got := names(g.GetProvenance()); !slices.Equal(got, want) || !g.GetProvenance().GetFlags().GetSyscallsDenied() || g.GetReward() != 1 {
			t.Errorf("the grade's provenance: syscalls denied %v (flag %v), reward %v; want %v, the flag, 1", got,
				g.GetProvenance().GetFlags().GetSyscallsDenied(), g.GetReward(), want)
		}
	})

	t.Run("tight_loop", func(t *testing.T) {
		out, errOut, code := d.CLI("", "create", base)
		if code != 0 {
			t.Fatalf("dsec create: %s %s", out, errOut)
		}
		id := strings.TrimSpace(out)
		t.Cleanup(func() { d.CLI("", "rm", id) })
		timing, errOut, code := d.CLI("", "exec", id, "--", "sh", "-c", tightLoop)
		if code != 0 {
			t.Fatalf("exec: exit %d: %s %s", code, timing, errOut)
		}
		// Records the reader missed show as a gap in the serials of the
		// records after them: refuse one more call until every call is
		// counted or missed (bounded: the reader rests at most a second).
		calls := int64(200000)
		var p *dsecv1.SandboxProvenance
		var count int64
		for range 30 {
			if out, errOut, code := d.CLI("", "exec", id, "--", "python3", "-c", "import ctypes; ctypes.CDLL(None).syscall(250, 0, 0, 0, 0, 0)"); code != 0 {
				t.Fatalf("exec: exit %d: %s %s", code, out, errOut)
			}
			calls++
			p = provenanceOf(t, d, id)
			count = 0
			for _, s := range p.GetSyscallsDenied() {
				count += s.GetCount()
			}
			if count+p.GetSyscallRecordsLost() >= calls {
				break
			}
			time.Sleep(time.Second)
		}
		lost := p.GetSyscallRecordsLost()
		human, _, _ := d.CLI("", "provenance", id)
		if got := names(p); !slices.Equal(got, []string{"keyctl"}) {
			t.Fatalf("syscalls denied %v, want keyctl\n%s", got, human)
		}
		// Other records on the node may add to the misses, never take
		// from them.
		if count+lost < calls || count > calls {
			t.Errorf("counted %d, missed %d: want every one of %d calls counted or missed\n%s", count, lost, calls, human)
		}
		if len(p.GetSyscallSamples()) != 32 || p.GetSyscallSamplesDropped() != count-32 {
			t.Errorf("samples %d, dropped %d; want 32, %d", len(p.GetSyscallSamples()), p.GetSyscallSamplesDropped(), count-32)
		}
		t.Logf("%d refused calls: %d counted, %d audit records missed; a call of %s", calls, count, lost, strings.TrimSpace(timing))
	})
}

// provenanceOf reads sandbox id's provenance through `dsec provenance
// --json`.
func provenanceOf(t *testing.T, d *testutil.Daemon, id string) *dsecv1.SandboxProvenance {
	t.Helper()
	out, errOut, code := d.CLI("", "provenance", id, "--json")
	if code != 0 {
		t.Fatalf("dsec provenance: %s", errOut)
	}
	var p dsecv1.SandboxProvenance
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal([]byte(out), &p); err != nil {
		t.Fatalf("dsec provenance --json: %v\n%s", err, out)
	}
	return &p
}
