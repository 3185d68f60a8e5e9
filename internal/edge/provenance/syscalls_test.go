package provenance

import (
	"fmt"
	"testing"

	"dsec.dev/dsec/internal/refused"
)

func TestParseSeccomp(t *testing.T) {
	line := `audit(1796549478.182:17): auid=0 uid=0 gid=0 ses=42 pid=8963 comm="python3" exe="/usr/bin/python3.11" sig=0 arch=c000003e syscall=250 compat=0 ip=0x4398c9 code=0x50000`
	r, err := parseSeccomp([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	want := "x86_64:250"
	if refused.Arch != 0 {
		want = "keyctl"
	}
	if r.serial != 17 || r.timeMs != 1796549478182 || r.session != 42 || r.pid != 8963 || r.comm != "python3" || r.name != want {
		t.Errorf("parsed %+v", r)
	}
	// A command named to look like fields is logged in hex and stays one
	// value; an i386 call is named by its arch.
	hex := fmt.Sprintf("%X", "x ses=1 pid=2")
	r, err = parseSeccomp([]byte(`audit(1.002:3): auid=0 ses=7 pid=5 comm=` + hex + ` exe="/a" arch=40000003 syscall=26 code=0x50000`))
	if err != nil {
		t.Fatal(err)
	}
	if r.session != 7 || r.pid != 5 || r.comm != "x ses=1 pid=2" || r.name != "i386:26" || r.timeMs != 1002 {
		t.Errorf("parsed %+v", r)
	}
	for _, bad := range []string{"", "type=1326", "audit(1.0:x): syscall=1", "audit(1.0:1): pid=1"} {
		if _, err := parseSeccomp([]byte(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// A sandbox refused in a loop keeps a count per syscall and 32 samples,
// and says how many calls it dropped; records of other sessions are not
// its; gaps in the serials are counted as missed for every sandbox
// tracked when they are found.
func TestSyscallBook(t *testing.T) {
	b := newSyscallBook()
	b.track("a", 10)
	serial := uint64(100)
	rec := func(session uint32, name string) {
		serial++
		r := seccompRecord{serial: serial, timeMs: int64(serial), session: session, pid: 1, comm: "c", name: name}
		b.seen(r.serial)
		b.add(r)
	}
	for range 1000 {
		rec(10, "keyctl")
	}
	rec(10, "mount")
	rec(11, "bpf") // no one's
	d, ok := b.denials("a")
	if !ok || len(d.Syscalls) != 2 || d.Syscalls[0].Count != 1000 || d.Syscalls[1].Name != "mount" || d.Syscalls[0].TimeUnixMs != 101 {
		t.Fatalf("denials %+v", d)
	}
	if len(d.Samples) != maxSyscallSamples || d.SamplesDropped != 1001-maxSyscallSamples || d.Lost != 0 {
		t.Errorf("samples %d, dropped %d, lost %d", len(d.Samples), d.SamplesDropped, d.Lost)
	}
	// A gap is found by the record after it, and counts for whoever was
	// tracked by then: the missed records may have been theirs.
	b.track("b", 12)
	serial += 50
	rec(12, "unshare")
	b.track("d", 14)
	rec(14, "bpf")
	da, _ := b.denials("a")
	db, _ := b.denials("b")
	dd, _ := b.denials("d")
	if da.Lost != 50 || db.Lost != 50 || dd.Lost != 0 || len(db.Syscalls) != 1 {
		t.Errorf("lost a %d, b %d, d %d (b's %v): want 50, 50, 0", da.Lost, db.Lost, dd.Lost, db.Syscalls)
	}
	// Names past the cap are counted in no entry but still sampled.
	b.track("c", 13)
	for i := range maxSyscallNames + 10 {
		rec(13, fmt.Sprint("x86_64:", i))
	}
	dc, _ := b.denials("c")
	if len(dc.Syscalls) != maxSyscallNames {
		t.Errorf("%d names kept, want %d", len(dc.Syscalls), maxSyscallNames)
	}
	b.forget("a")
	if _, ok := b.denials("a"); ok {
		t.Error("a still tracked")
	}
	rec(10, "keyctl") // no longer anyone's
}
