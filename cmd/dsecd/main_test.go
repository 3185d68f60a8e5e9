package main

import (
	"io"
	"strings"
	"testing"
)

// TestConfigPrint: dsecd config print shows a role's effective
// configuration, its flags over its DSECD_* variables over its defaults,
// with the metadata store's password hidden.
func TestConfigPrint(t *testing.T) {
	t.Setenv("DSECD_MAX_SANDBOXES", "7")
	t.Setenv("DSECD_REGISTRY", "postgres://dsec:hunter2@db/dsec")
	t.Setenv("DSECD_LISTEN", "0.0.0.0:1")
	var out strings.Builder
	if code := dispatch([]string{"config", "print", "--role", "edge", "--listen", "127.0.0.1:2"}, &out); code != 0 {
		t.Fatalf("exit %d", code)
	}
	for _, want := range []string{"max_sandboxes = 7\n", `listen = "127.0.0.1:2"`, `registry = "postgres://dsec:REDACTED@db/dsec"`, `runtime = "runc"`, "# on this machine: "} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("no %q in\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "hunter2") {
		t.Error("the password was printed")
	}
	t.Setenv("DSECD_MAX_SANDBOXES", "many")
	if code := dispatch([]string{"config", "print", "--role", "edge"}, io.Discard); code != 2 {
		t.Errorf("a malformed variable: exit %d, want 2", code)
	}
	if code := dispatch([]string{"config", "print", "--role", "chef"}, io.Discard); code != 2 {
		t.Errorf("an unknown role: exit %d, want 2", code)
	}
}

// TestVersion: dsecd --version prints which build this is and exits 0.
func TestVersion(t *testing.T) {
	for _, arg := range []string{"--version", "version"} {
		var out strings.Builder
		if code := dispatch([]string{arg}, &out); code != 0 || !strings.HasPrefix(out.String(), "dsecd ") || !strings.Contains(out.String(), "go1.") {
			t.Errorf("dsecd %s: exit %d, %q", arg, code, out.String())
		}
	}
}

// TestStrayEnv: a DSECD_* variable no command reads is named, with the
// setting it is a slip of; a role's, --config's and a tool's are not.
func TestStrayEnv(t *testing.T) {
	got := strayEnv([]string{"PATH=/bin", "DSECD_ROOT=/srv/dsec", "DSECD_CONFIG=/etc/dsec/dsecd.toml", "DSECD_REGISTRY=postgres://db",
		"DSECD_PRINCIPAL=alice", "DSECD_COUNT=3", "DSECD_MAX_SANDBOX=5", "DSECD_FOO=1"})
	want := []string{
		"DSECD_MAX_SANDBOX names no setting of dsecd and is ignored (did you mean DSECD_MAX_SANDBOXES?)",
		"DSECD_FOO names no setting of dsecd and is ignored",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("strayEnv:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
