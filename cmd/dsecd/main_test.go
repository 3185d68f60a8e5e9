package main

import (
	"flag"
	"io"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/daemon"
)

// TestFlagsFromEnvironment: every role's flags can come from DSECD_*
// variables, and the command line wins over them.
func TestFlagsFromEnvironment(t *testing.T) {
	var cfg daemon.EdgeConfig
	var nf nodeFlags
	fs := flag.NewFlagSet("dsecd edge", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	addNodeFlags(fs, &cfg.Node, &nf)
	fs.StringVar(&cfg.Listen, "listen", daemon.DefaultEdgeAddr, "")
	fs.StringVar(&cfg.Registry, "registry", "", "")
	env := map[string]string{"DSECD_MAX_SANDBOXES": "7", "DSECD_REGISTRY": "postgres://db/dsec", "DSECD_LISTEN": "0.0.0.0:1"}
	if err := fromEnv(fs, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	if err := fs.Parse([]string{"--listen", "127.0.0.1:2"}); err != nil {
		t.Fatal(err)
	}
	if cfg.Node.Limits.MaxSandboxes != 7 || cfg.Registry != "postgres://db/dsec" || cfg.Listen != "127.0.0.1:2" {
		t.Errorf("max-sandboxes %d, registry %q, listen %q", cfg.Node.Limits.MaxSandboxes, cfg.Registry, cfg.Listen)
	}
	bad := map[string]string{"DSECD_MAX_SANDBOXES": "many"}
	if err := fromEnv(fs, func(k string) string { return bad[k] }); err == nil {
		t.Error("a malformed variable was taken")
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
