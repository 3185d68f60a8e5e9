package cli

import (
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestVersion: dsec --version prints which build this is, with no daemon.
func TestVersion(t *testing.T) {
	out, _, err := runCLIErr(t, "unix:///nonexistent", "--version")
	if err != nil || !strings.HasPrefix(out, "dsec ") || !strings.Contains(out, "go1.") || strings.Count(out, "\n") != 1 {
		t.Errorf("dsec --version: %q, %v", out, err)
	}
}

// TestUnknownFlagHint: a flag dsec lacks is refused with the nearest it
// has.
func TestUnknownFlagHint(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"create", "--memory", "512", "b:1"}, "unknown flag: --memory (did you mean --memory-mb?)"},
		{[]string{"run", "--cpu=2", "b:1", "--", "true"}, "unknown flag: --cpu (did you mean --cpus?)"},
		{[]string{"ls", "--lable", "a=b"}, "unknown flag: --lable (did you mean --label?)"},
		{[]string{"ls", "--xyzzy"}, "unknown flag: --xyzzy"},
	} {
		_, _, err := runCLIErr(t, "unix:///nonexistent", tc.args...)
		if err == nil || err.Error() != tc.want {
			t.Errorf("dsec %s: %v, want %q", strings.Join(tc.args, " "), err, tc.want)
		}
	}
}

// TestInterruptExits130: Ctrl-C during a command ends dsec with 130, as a
// shell reports a program it interrupted, not 1 and an error.
func TestInterruptExits130(t *testing.T) {
	f, addr := startFake(t)
	f.execHangs = make(chan struct{}, 1)
	var out, errOut strings.Builder
	a := &app{stdin: strings.NewReader(""), stdout: &out, stderr: &errOut}
	done := make(chan int, 1)
	go func() { done <- a.main([]string{"--addr", addr, "exec", "sb-n1-a", "--", "sleep", "60"}) }()
	<-f.execHangs // dsec is in its call: it watches for signals
	if err := syscall.Kill(os.Getpid(), syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case code := <-done:
		if code != 130 || errOut.String() != "" {
			t.Errorf("exit %d, stderr %q; want 130 and nothing said", code, errOut.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("dsec did not end after SIGINT")
	}
}

// TestUnreachableSaysWhereTheAddressCameFrom: a daemon that cannot be
// reached is named with where its address came from: --addr, $DSEC_ADDR
// or the default, not "--addr or $DSEC_ADDR" whichever it was.
func TestUnreachableSaysWhereTheAddressCameFrom(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	run := func(args ...string) string {
		t.Helper()
		var out, errOut strings.Builder
		a := &app{stdin: strings.NewReader(""), stdout: &out, stderr: &errOut}
		if code := a.main(args); code != 1 {
			t.Errorf("dsec %s: exit %d", strings.Join(args, " "), code)
		}
		return errOut.String()
	}
	t.Setenv("DSEC_TOKEN", "")
	t.Setenv("DSEC_TOKEN_FILE", "")
	t.Setenv("DSEC_ADDR", closed)
	if got := run("ls"); !strings.Contains(got, "is it running? (address from $DSEC_ADDR)\n") {
		t.Errorf("with $DSEC_ADDR: %q", got)
	}
	if got := run("--addr", closed, "ls"); !strings.Contains(got, "is it running? (address from --addr)\n") {
		t.Errorf("with --addr: %q", got)
	}
	t.Setenv("DSEC_ADDR", "")
	if _, err := os.Stat("/var/lib/dsec/dsecd.sock"); err == nil {
		t.Skip("a dsecd answers at the default address here")
	}
	if got := run("ls"); !strings.Contains(got, "unix:///var/lib/dsec/dsecd.sock") ||
		!strings.Contains(got, "is it running? (the default address; --addr or $DSEC_ADDR name another)\n") {
		t.Errorf("by default: %q", got)
	}
}

// TestNetSetWarnsAsCreateDoes: net set's warnings read "dsec: warning:",
// as create's do.
func TestNetSetWarnsAsCreateDoes(t *testing.T) {
	f, addr := startFake(t)
	f.warnings = []string{`service "pypi" has no domains or CIDRs on this node; allowing it allows nothing`}
	_, errOut, err := runCLIErr(t, addr, "net", "set", "sb-n1-a", `{"pypi": true}`)
	if want := "dsec: warning: " + f.warnings[0] + "\n"; err != nil || errOut != want {
		t.Errorf("net set: stderr %q (%v), want %q", errOut, err, want)
	}
}
