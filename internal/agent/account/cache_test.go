package account

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestCacheSeesChanges(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		t.Helper()
		// A new file each time, as editors and useradd do.
		tmp := filepath.Join(dir, name+".new")
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	write("passwd", "root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n")
	write("group", "root:x:0:\nalice:x:1000:\n")
	c := NewCache(dir)

	for i := 0; i < 2; i++ {
		a, err := c.Lookup("alice")
		if err != nil || a.UID != 1000 || a.Home != "/home/alice" {
			t.Fatalf("lookup %d: %+v %v", i, a, err)
		}
	}
	if _, err := c.Lookup("bob"); err == nil {
		t.Fatal("bob found before he was added")
	}

	write("passwd", "root:x:0:0:root:/root:/bin/sh\nalice:x:1001:1000::/srv/alice:/bin/sh\nbob:x:1002:1000::/home/bob:/bin/sh\n")
	a, err := c.Lookup("alice")
	if err != nil || a.UID != 1001 || a.Home != "/srv/alice" {
		t.Fatalf("after passwd changed: %+v %v", a, err)
	}
	if b, err := c.Lookup("bob"); err != nil || b.UID != 1002 {
		t.Fatalf("bob after he was added: %+v %v", b, err)
	}

	// An edit in place that keeps the size ("root:x:0:\n" and the first
	// byte of the next line become "staff:x:0:\n") shows in the mtime.
	past := time.Now().Add(-time.Hour)
	os.Chtimes(filepath.Join(dir, "group"), past, past)
	if _, err := c.Lookup("alice"); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "group"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("staff:x:0:\n")
	f.Close()
	g, err := c.Lookup("0:staff")
	if err != nil || g.GID != 0 {
		t.Fatalf("group renamed in place: %+v %v", g, err)
	}

	os.Remove(filepath.Join(dir, "passwd"))
	if _, err := c.Lookup("alice"); err == nil {
		t.Fatal("alice found after passwd was removed")
	}
}
