package daemon

import (
	"testing"
)

// TestFillRunsc: a named runsc is required, none turns gVisor off, and the
// deprecated --runtime runsc reads as --runsc beside runc.
func TestFillRunsc(t *testing.T) {
	for _, tc := range []struct {
		name     string
		in       Config
		runsc    string
		required bool
	}{
		{"named", Config{Runsc: "/opt/runsc"}, "/opt/runsc", true},
		{"off", Config{Runsc: NoRunsc}, NoRunsc, false},
		{"deprecated runtime", Config{Runtime: "runsc", RuntimePath: "/opt/runsc"}, "/opt/runsc", true},
		{"deprecated runtime beside runsc", Config{Runtime: "runsc", RuntimePath: "/opt/a", Runsc: "/opt/b"}, "/opt/b", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.in
			c.Root = t.TempDir()
			if err := c.fill(); err != nil {
				t.Fatal(err)
			}
			if c.Runtime != "runc" || c.RuntimePath != "" || c.Runsc != tc.runsc || c.runscRequired != tc.required {
				t.Errorf("filled runtime %q at %q, runsc %q (required %v); want runc, runsc %q (required %v)",
					c.Runtime, c.RuntimePath, c.Runsc, c.runscRequired, tc.runsc, tc.required)
			}
		})
	}
	// Unnamed: whatever the host has, offered only if it works.
	c := Config{Root: t.TempDir()}
	if err := c.fill(); err != nil {
		t.Fatal(err)
	}
	if c.runscRequired || c.Runsc != findRunsc() {
		t.Errorf("unnamed runsc filled as %q (required %v), want %q, not required", c.Runsc, c.runscRequired, findRunsc())
	}
}
