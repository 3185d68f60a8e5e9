// Package fncall runs reward code the way SandboxFusion's /run_code does:
// one call compiles (where the language has a compile step) and runs a
// program in a fresh scratch directory of a pooled warm container whose
// root file system is the fncall environment (scripts/build-fncall-env.sh).
//
// This file holds the language table: how each language SandboxFusion
// names is compiled and run, and the loader for languages users register
// in a JSON file. Every argv here runs with the scratch directory as its
// working directory, so file names in it are relative to that directory.
package fncall

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strings"
)

// Language says how a call in one language is compiled and run in its
// scratch directory.
type Language struct {
	Name    string            // SandboxFusion's name: "python", "cpp", ...
	File    string            // the code is written to this file in the scratch dir
	Compile []string          // argv of the compile step, run in the scratch dir; nil = none
	Run     []string          // argv of the run step
	Env     map[string]string // added to the call's environment (HOME, TMPDIR, PATH are set by the runner)
	Zygote  bool              // the run step may be served by a warm Python interpreter (python only)

	// Environment is the dsec environment the language runs in; "" means
	// the fncall environment (DefaultEnvironment). Only user-registered
	// languages set it: the builtin ones all run in the fncall environment.
	Environment string
}

// DefaultEnvironment is the environment the builtin languages run in, as
// imported by `scripts/build-fncall-env.sh --import`.
const DefaultEnvironment = "fncall:latest"

// The JVM's flags, for javac (through -J) and java alike. A call's
// container has a memory cgroup, and the JVM sizes itself from it, but
// with its defaults (G1, a GC thread per CPU, a quarter of the limit as
// heap) a small limit either starves the heap or, where the limit is not
// visible, lets the heap outgrow the cgroup until the OOM killer ends the
// call with SIGKILL instead of an OutOfMemoryError. Serial GC has no GC
// threads and the smallest footprint; the heap gets half of the limit
// (the rest is metaspace, code cache, thread stacks and the JVM itself);
// the main thread a deep stack for recursive solutions; and class data
// sharing (the JDK's default archive, built into the environment) keeps
// start-up at a few hundred milliseconds.
var jvmFlags = []string{
	"-XX:+UseSerialGC",
	"-XX:MaxRAMPercentage=50",
	"-Xss64m",
}

// javaClassPath is SandboxFusion's: the scratch dir and javatuples, which
// its Java image puts beside every call (Debian's libjavatuples-java).
const javaClassPath = ".:/usr/share/java/javatuples.jar"

// goTestSeeded runs `go test "$1"` with the call's build cache (the
// default, under HOME) started from the environment's seed when the call
// has none yet. The seed is read-only and the copy the call's own, so no
// call can write what another one reads. Without a seed (another
// environment) go test runs with an empty cache, only slower.
const goTestSeeded = `c=${GOCACHE:-$HOME/.cache/go-build}
if [ ! -e "$c" ] && [ -d ` + goCacheSeed + ` ]; then
	mkdir -p "$(dirname "$c")" && cp -R ` + goCacheSeed + ` "$c" 2>/dev/null || rm -rf "$c"
fi
exec go test "$1"`

// goCacheSeed is where scripts/build-fncall-env.sh puts the seed.
const goCacheSeed = "/usr/lib/dsec-fncall/go-build"

// Builtin returns the languages dsec knows, by name. Each is run as
// SandboxFusion's runners (sandbox/runners/major.py) run it, except that
// the code goes to a fixed file name instead of a random temporary one, and
// c, which SandboxFusion has no runner for, is compiled like cpp.
// The map is new on every call; callers may change it.
func Builtin() map[string]Language {
	javac := append([]string{"javac"}, prefixed("-J", jvmFlags)...)
	javac = append(javac, "-cp", javaClassPath, "Main.java")
	java := append([]string{"java"}, jvmFlags...)
	java = append(java, "-cp", javaClassPath, "-ea", "Main")

	langs := []Language{
		{Name: "python", File: "tmp_code.py", Run: []string{"python", "tmp_code.py"}, Zygote: true},
		// pytest collects a file named on its command line whatever its
		// name, so the file need not be test_*.py.
		{Name: "pytest", File: "tmp_code.py", Run: []string{"pytest", "tmp_code.py"}},
		{
			Name:    "cpp",
			File:    "tmp_code.cpp",
			Compile: []string{"g++", "-std=c++17", "tmp_code.cpp", "-o", "test", "-lpthread"},
			Run:     []string{"./test"},
		},
		{
			Name:    "c",
			File:    "tmp_code.c",
			Compile: []string{"gcc", "tmp_code.c", "-o", "test", "-lm", "-lpthread"},
			Run:     []string{"./test"},
		},
		// Go builds the file alone, outside any module (command-line
		// arguments), so a call needs no go.mod; its build cache is the
		// default one under HOME, the scratch dir, and starts empty: the
		// standard library comes precompiled from GOROOT/pkg.
		{
			Name:    "go",
			File:    "tmp_code.go",
			Compile: []string{"go", "build", "-o", "out", "tmp_code.go"},
			Run:     []string{"./out"},
		},
		// go test compiles, vets and runs in one step, as SandboxFusion's
		// does: the test's build errors are the run's. Vet needs facts
		// about every imported package, which a fresh cache computes again
		// (1.2 s for the standard library under testing); the environment
		// ships a seed of them, copied into the call's own cache first.
		{Name: "go_test", File: "tmp_code_test.go", Run: []string{"/bin/sh", "-c", goTestSeeded, "go_test", "tmp_code_test.go"}},
		{Name: "java", File: "Main.java", Compile: javac, Run: java},
		{Name: "nodejs", File: "tmp_code.js", Run: []string{"node", "tmp_code.js"}},
		{Name: "bash", File: "tmp_code.sh", Run: []string{"/bin/bash", "tmp_code.sh"}},
		{
			Name:    "rust",
			File:    "tmp_code.rs",
			Compile: []string{"rustc", "tmp_code.rs", "-o", "test"},
			Run:     []string{"./test"},
		},
	}
	m := make(map[string]Language, len(langs)+1)
	for _, l := range langs {
		m[l.Name] = l
	}
	// SandboxFusion's alias of nodejs.
	js := m["nodejs"]
	js.Name = "js"
	m["js"] = js
	return m
}

func prefixed(prefix string, args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = prefix + a
	}
	return out
}

var (
	nameRE   = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_-]{0,63}$`)
	envKeyRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

// runnerEnv are the variables the runner sets for every call; a language
// cannot override them.
var runnerEnv = map[string]bool{"HOME": true, "TMPDIR": true, "PATH": true}

// Validate reports the first thing wrong with l, naming the field.
func (l Language) Validate() error {
	if !nameRE.MatchString(l.Name) {
		return fmt.Errorf("name %q: must be a letter followed by up to 63 letters, digits, '_' or '-'", l.Name)
	}
	if err := validFile(l.File); err != nil {
		return fmt.Errorf("file %q: %w", l.File, err)
	}
	if len(l.Run) == 0 {
		return errors.New("run: must be a non-empty argv")
	}
	if err := validArgv(l.Run); err != nil {
		return fmt.Errorf("run: %w", err)
	}
	if l.Compile != nil {
		if len(l.Compile) == 0 {
			return errors.New("compile: must be a non-empty argv, or left out for none")
		}
		if err := validArgv(l.Compile); err != nil {
			return fmt.Errorf("compile: %w", err)
		}
	}
	for k, v := range l.Env {
		if !envKeyRE.MatchString(k) {
			return fmt.Errorf("env: %q is not a variable name", k)
		}
		if runnerEnv[k] {
			return fmt.Errorf("env: %s is set by the runner for every call", k)
		}
		if strings.IndexByte(v, 0) >= 0 {
			return fmt.Errorf("env: %s: value holds a NUL byte", k)
		}
	}
	if l.Zygote {
		// The zygote runs the file as `python FILE` would, and nothing else.
		if len(l.Run) != 2 || !strings.HasPrefix(l.Run[0], "python") || l.Run[1] != l.File {
			return fmt.Errorf("zygote: only for a run of the form [\"python\", %q]", l.File)
		}
	}
	if l.Environment != "" && strings.ContainsAny(l.Environment, " \t\n\x00") {
		return fmt.Errorf("environment %q: must not hold white space", l.Environment)
	}
	return nil
}

func validFile(f string) error {
	switch {
	case f == "":
		return errors.New("must be set")
	case f == "." || f == "..":
		return errors.New("must name a file")
	case strings.ContainsAny(f, "/\\"):
		return errors.New("must be a plain file name in the scratch dir, with no '/'")
	case strings.Contains(f, ".."):
		return errors.New("must not contain \"..\"")
	case strings.IndexByte(f, 0) >= 0:
		return errors.New("must not hold a NUL byte")
	case strings.HasPrefix(f, "-"):
		return errors.New("must not start with '-' (it would read as a flag)")
	}
	return nil
}

func validArgv(argv []string) error {
	if argv[0] == "" {
		return errors.New("argv[0] is empty")
	}
	for i, a := range argv {
		if strings.IndexByte(a, 0) >= 0 {
			return fmt.Errorf("argv[%d] holds a NUL byte", i)
		}
	}
	return nil
}

// languageJSON is a language as a user registers it.
type languageJSON struct {
	Name        string            `json:"name"`
	File        string            `json:"file"`
	Compile     []string          `json:"compile"`
	Run         []string          `json:"run"`
	Env         map[string]string `json:"env"`
	Zygote      bool              `json:"zygote"`
	Environment string            `json:"environment"`
}

// LoadLanguages reads user-registered languages: a JSON array of objects
// with the fields of Language in lower_snake case (name, file, compile,
// run, env, zygote, environment), e.g.
//
//	[{"name": "lua", "file": "main.lua", "run": ["lua5.4", "main.lua"],
//	  "environment": "lua:5.4"}]
//
// Unknown fields, duplicate names and invalid languages are errors that
// name the entry and the field. Whether a user's language may replace a
// builtin one of the same name is the caller's choice.
func LoadLanguages(r io.Reader) (map[string]Language, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("read languages: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var entries []languageJSON
	if err := dec.Decode(&entries); err != nil {
		return nil, fmt.Errorf("parse languages: %w", err)
	}
	if dec.More() {
		return nil, errors.New("parse languages: more than one JSON value")
	}
	m := make(map[string]Language, len(entries))
	for i, e := range entries {
		l := Language{
			Name:        e.Name,
			File:        e.File,
			Compile:     e.Compile,
			Run:         e.Run,
			Env:         e.Env,
			Zygote:      e.Zygote,
			Environment: e.Environment,
		}
		if err := l.Validate(); err != nil {
			return nil, fmt.Errorf("language %d (%q): %w", i, e.Name, err)
		}
		if _, dup := m[l.Name]; dup {
			return nil, fmt.Errorf("language %d (%q): name: registered twice", i, e.Name)
		}
		m[l.Name] = l
	}
	return m, nil
}
