// Package version says which build of dsec a binary is, for dsec --version
// and dsecd --version, from what the Go toolchain stamped into it
// (runtime/debug.ReadBuildInfo): the module's version and, when it was
// built in a git checkout, the commit.
package version

import (
	"runtime/debug"
	"strings"
)

// String is program's version line. Built from a git checkout it is
//
//	dsec v0.0.0-20261205173022-36c52f9614f7 (commit 36c52f9614f7, 2026-12-05T17:30:22Z, go1.26.8)
//
// with ", modified" after the time when the checkout had changes; built by
// `go install dsec.dev/dsec/cmd/dsec@v1.2.3`, "dsec v1.2.3 (go1.26.8)".
// A `go build` without a VCS stamp (outside a checkout, or with
// -buildvcs=false, as GOFLAGS may set) knows no version:
//
//	dsec (devel) (no VCS stamp: built outside a git checkout or with -buildvcs=false; go1.26.8)
func String(program string) string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return program + " (devel) (no build information)"
	}
	return describe(program, bi)
}

func describe(program string, bi *debug.BuildInfo) string {
	v := bi.Main.Version
	if v == "" {
		v = "(devel)"
	}
	settings := map[string]string{}
	for _, s := range bi.Settings {
		settings[s.Key] = s.Value
	}
	var about []string
	if rev := settings["vcs.revision"]; rev != "" {
		about = append(about, "commit "+rev[:min(12, len(rev))])
		if t := settings["vcs.time"]; t != "" {
			about = append(about, t)
		}
		if settings["vcs.modified"] == "true" {
			about = append(about, "modified")
		}
	} else if v == "(devel)" {
		about = append(about, "no VCS stamp: built outside a git checkout or with -buildvcs=false;")
	}
	about = append(about, bi.GoVersion)
	return program + " " + v + " (" + strings.ReplaceAll(strings.Join(about, ", "), ";,", ";") + ")"
}
