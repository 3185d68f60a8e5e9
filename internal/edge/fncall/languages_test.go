package fncall

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestBuiltinLanguagesAreValid(t *testing.T) {
	langs := Builtin()
	for _, name := range []string{"python", "pytest", "cpp", "c", "go", "go_test", "java", "nodejs", "bash", "rust"} {
		if _, ok := langs[name]; !ok {
			t.Errorf("Builtin has no %s", name)
		}
	}
	for name, l := range langs {
		if l.Name != name {
			t.Errorf("Builtin()[%q].Name = %q", name, l.Name)
		}
		if err := l.Validate(); err != nil {
			t.Errorf("Builtin()[%q]: %v", name, err)
		}
		if l.Zygote != (name == "python") {
			t.Errorf("Builtin()[%q].Zygote = %v", name, l.Zygote)
		}
	}
	// A fresh map on every call: a caller's change is its own.
	langs["python"] = Language{}
	if Builtin()["python"].Name != "python" {
		t.Error("Builtin returned a shared map")
	}
}

func TestLoadLanguages(t *testing.T) {
	in := `[
	  {"name": "lua", "file": "main.lua", "run": ["lua5.4", "main.lua"], "environment": "lua:5.4"},
	  {"name": "cpp_O2", "file": "a.cpp", "compile": ["g++", "-O2", "a.cpp", "-o", "a"], "run": ["./a"],
	   "env": {"LC_ALL": "C"}},
	  {"name": "python_fast", "file": "m.py", "run": ["python3", "m.py"], "zygote": true}
	]`
	got, err := LoadLanguages(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]Language{
		"lua":         {Name: "lua", File: "main.lua", Run: []string{"lua5.4", "main.lua"}, Environment: "lua:5.4"},
		"cpp_O2":      {Name: "cpp_O2", File: "a.cpp", Compile: []string{"g++", "-O2", "a.cpp", "-o", "a"}, Run: []string{"./a"}, Env: map[string]string{"LC_ALL": "C"}},
		"python_fast": {Name: "python_fast", File: "m.py", Run: []string{"python3", "m.py"}, Zygote: true},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("LoadLanguages (-want +got):\n%s", diff)
	}
}

func TestLoadLanguagesErrors(t *testing.T) {
	for _, tc := range []struct {
		name, in, want string
	}{
		{"not json", `{`, "parse languages"},
		{"not an array", `{"name": "x"}`, "parse languages"},
		{"unknown field", `[{"name": "x", "file": "x", "run": ["x"], "compile_cmd": ["y"]}]`, `unknown field "compile_cmd"`},
		{"two values", `[] []`, "more than one JSON value"},
		{"bad name", `[{"name": "9x", "file": "x", "run": ["x"]}]`, `language 0 ("9x"): name "9x"`},
		{"name with slash", `[{"name": "a/b", "file": "x", "run": ["x"]}]`, `name "a/b"`},
		{"no file", `[{"name": "x", "run": ["x"]}]`, `file "": must be set`},
		{"file with slash", `[{"name": "x", "file": "src/x.c", "run": ["x"]}]`, `file "src/x.c": must be a plain file name`},
		{"file dotdot", `[{"name": "x", "file": "..", "run": ["x"]}]`, `file "..": must name a file`},
		{"file with dotdot", `[{"name": "x", "file": "a..b", "run": ["x"]}]`, `file "a..b": must not contain`},
		{"file flag", `[{"name": "x", "file": "-x", "run": ["x"]}]`, `file "-x": must not start with '-'`},
		{"no run", `[{"name": "x", "file": "x"}]`, "run: must be a non-empty argv"},
		{"empty run", `[{"name": "x", "file": "x", "run": []}]`, "run: must be a non-empty argv"},
		{"empty argv0", `[{"name": "x", "file": "x", "run": [""]}]`, "run: argv[0] is empty"},
		{"empty compile", `[{"name": "x", "file": "x", "compile": [], "run": ["x"]}]`, "compile: must be a non-empty argv"},
		{"env HOME", `[{"name": "x", "file": "x", "run": ["x"], "env": {"HOME": "/"}}]`, "env: HOME is set by the runner"},
		{"env bad key", `[{"name": "x", "file": "x", "run": ["x"], "env": {"A=B": "c"}}]`, `env: "A=B" is not a variable name`},
		{"zygote not python", `[{"name": "x", "file": "x.js", "run": ["node", "x.js"], "zygote": true}]`, "zygote: only for a run of the form"},
		{"environment spaces", `[{"name": "x", "file": "x", "run": ["x"], "environment": "a b"}]`, `environment "a b"`},
		{"duplicate", `[{"name": "x", "file": "x", "run": ["x"]}, {"name": "x", "file": "y", "run": ["y"]}]`, `language 1 ("x"): name: registered twice`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LoadLanguages(strings.NewReader(tc.in))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("LoadLanguages(%s) = %v, want an error containing %q", tc.in, err, tc.want)
			}
		})
	}
}
