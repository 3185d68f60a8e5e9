package netpolicy

import (
	"bufio"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

func countLines(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		n++
	}
	return n
}

func event(id string, i int, base time.Time) Event {
	return Event{
		Time: base.Add(time.Duration(i) * time.Second), SandboxID: id, Kind: "connect", Verdict: "deny",
		Proto: "tcp", Dest: netip.MustParseAddr("10.0.0.1"), Port: uint16(i + 1), BytesOut: int64(i),
	}
}

func TestAuditRingFileRestart(t *testing.T) {
	dir := t.TempDir()
	base := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	const max = 5
	a := NewAuditLog(dir, max)
	for i := 0; i < 12; i++ {
		a.Record(event("sb-n1-a", i, base))
	}
	a.Record(event("sb-n1-b", 0, base))

	check := func(a *AuditLog, label string) {
		t.Helper()
		got, err := a.Read("sb-n1-a", time.Time{}, 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != max {
			t.Fatalf("%s: %d events, want %d", label, len(got), max)
		}
		for i, e := range got { // the newest five, oldest first
			if e.Port != uint16(7+i+1) || !e.Time.Equal(base.Add(time.Duration(7+i)*time.Second)) || e.Dest != netip.MustParseAddr("10.0.0.1") {
				t.Errorf("%s: event %d = %+v", label, i, e)
			}
		}
		since, err := a.Read("sb-n1-a", base.Add(9*time.Second), 0)
		if err != nil || len(since) != 2 || since[0].Port != 11 {
			t.Errorf("%s: since = %+v, %v", label, since, err)
		}
		limited, err := a.Read("sb-n1-a", time.Time{}, 2)
		if err != nil || len(limited) != 2 || limited[0].Port != 8 {
			t.Errorf("%s: limited = %+v, %v", label, limited, err)
		}
		other, err := a.Read("sb-n1-b", time.Time{}, 0)
		if err != nil || len(other) != 1 {
			t.Errorf("%s: other sandbox = %+v, %v", label, other, err)
		}
	}
	check(a, "live")

	path := filepath.Join(dir, "sb-n1-a.jsonl")
	if n := countLines(t, path); n > 2*max {
		t.Errorf("file has %d lines, bound is %d", n, 2*max)
	}

	// A new AuditLog over the same directory is a daemon restart.
	b := NewAuditLog(dir, max)
	check(b, "restarted")
	b.Record(event("sb-n1-a", 12, base))
	got, _ := b.Read("sb-n1-a", time.Time{}, 0)
	if len(got) != max || got[max-1].Port != 13 || got[0].Port != 9 {
		t.Errorf("after restart and record: %+v", got)
	}
	for i := 13; i < 40; i++ {
		b.Record(event("sb-n1-a", i, base))
		if n := countLines(t, path); n > 2*max {
			t.Fatalf("file has %d lines after event %d, bound is %d", n, i, 2*max)
		}
	}

	if err := b.Remove("sb-n1-a"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("file still there: %v", err)
	}
	if got, err := b.Read("sb-n1-a", time.Time{}, 0); err != nil || len(got) != 0 {
		t.Errorf("after Remove: %+v, %v", got, err)
	}
	if err := b.Remove("sb-never"); err != nil {
		t.Errorf("Remove of unknown sandbox: %v", err)
	}
}

func TestAuditTornLineAndBadIDs(t *testing.T) {
	dir := t.TempDir()
	a := NewAuditLog(dir, 10)
	a.Record(Event{SandboxID: "sb-1", Kind: "dns", Verdict: "allow", Name: "a.test"})
	f, err := os.OpenFile(filepath.Join(dir, "sb-1.jsonl"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"time":"2026-`) // a crash mid-write
	f.Close()

	b := NewAuditLog(dir, 10)
	got, err := b.Read("sb-1", time.Time{}, 0)
	if err != nil || len(got) != 1 || got[0].Name != "a.test" || got[0].Time.IsZero() {
		t.Fatalf("Read = %+v, %v", got, err)
	}

	// The next event is not glued to the torn line.
	b.Record(Event{SandboxID: "sb-1", Kind: "dns", Verdict: "deny", Name: "b.test"})
	c := NewAuditLog(dir, 10)
	got, err = c.Read("sb-1", time.Time{}, 0)
	if err != nil || len(got) != 2 || got[1].Name != "b.test" {
		t.Fatalf("after torn line and record: %+v, %v", got, err)
	}

	for _, id := range []string{"", "..", "a/b", "../x"} {
		if _, err := b.Read(id, time.Time{}, 0); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Read(%q) error = %v", id, err)
		}
		b.Record(Event{SandboxID: id}) // dropped, no file outside dir
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("dir holds %d entries, want 1", len(entries))
	}
}

func TestAuditMemoryOnly(t *testing.T) {
	a := NewAuditLog("", 3)
	for i := 0; i < 4; i++ {
		a.Record(event("sb-m", i, time.Now()))
	}
	got, err := a.Read("sb-m", time.Time{}, 0)
	if err != nil || len(got) != 3 || got[0].Port != 2 {
		t.Fatalf("Read = %+v, %v", got, err)
	}
}

func TestAuditConcurrent(t *testing.T) {
	dir := t.TempDir()
	a := NewAuditLog(dir, 50)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := []string{"sb-x", "sb-y"}[g%2]
			for i := 0; i < 100; i++ {
				a.Record(Event{SandboxID: id, Kind: "connect", Verdict: "allow"})
				if i%10 == 0 {
					if _, err := a.Read(id, time.Time{}, 5); err != nil {
						t.Error(err)
					}
				}
			}
		}()
	}
	wg.Wait()
	for _, id := range []string{"sb-x", "sb-y"} {
		got, err := NewAuditLog(dir, 50).Read(id, time.Time{}, 0)
		if err != nil || len(got) != 50 {
			t.Errorf("%s after restart: %d events, %v", id, len(got), err)
		}
		if n := countLines(t, filepath.Join(dir, id+".jsonl")); n > 100 {
			t.Errorf("%s: %d lines", id, n)
		}
	}
	if _, err := a.Read("sb-unknown", time.Time{}, 0); err != nil {
		t.Fatal(err)
	}
	if _, ok := a.rings["sb-unknown"]; ok {
		t.Error("Read of an unknown sandbox kept state")
	}
}
