package cli

import (
	"go/scanner"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/testutil"
)

// TestUnknownSubcommandFails: a word after a command with subcommands that
// is none of them is an error (cobra printed the group's help and exited
// 0), naming the nearest; the group alone prints its help.
func TestUnknownSubcommandFails(t *testing.T) {
	_, cmds := cliTree()
	for path, c := range cmds {
		if !c.HasSubCommands() || path == "snapshot" || path == "provenance" { // snapshot ID NAME and provenance ID take arguments
			continue
		}
		args := append(strings.Fields(path), "lsx")
		_, _, err := runCLIErr(t, "unix:///nonexistent", args...)
		if err == nil || !strings.Contains(err.Error(), `unknown command "lsx" for "dsec `+path+`"`) {
			t.Errorf("dsec %s: %v, want an unknown command error", strings.Join(args, " "), err)
		}
	}
	_, _, err := runCLIErr(t, "unix:///nonexistent", "image", "lst")
	if err == nil || !strings.Contains(err.Error(), `did you mean "dsec image ls"?`) {
		t.Errorf("dsec image lst: %v", err)
	}
	out, _, err := runCLIErr(t, "unix:///nonexistent", "image")
	if err != nil || !strings.Contains(out, "Available Commands:") {
		t.Errorf("dsec image: %v, %q", err, out)
	}
}

// TestOtherToolsWordsForRmAndLs: delete, remove and list, which other
// tools call rm and ls, suggest them (remove suggested only revoke, which
// removes a role binding, and delete nothing).
func TestOtherToolsWordsForRmAndLs(t *testing.T) {
	for _, tc := range []struct{ args, want string }{
		{"delete sb-e1-a", "\trm\n"},
		{"remove sb-e1-a", "\trm\n"},
		{"list", "\tls\n"},
		{"webhook delete wh-1", `did you mean "dsec webhook rm"?`},
		{"layer remove x:1", `did you mean "dsec layer rm"?`},
		{"principal list", `did you mean "dsec principal ls"?`},
	} {
		_, _, err := runCLIErr(t, "unix:///nonexistent", strings.Fields(tc.args)...)
		if err == nil || !strings.Contains(err.Error()+"\n", tc.want) {
			t.Errorf("dsec %s: %v, want %q in it", tc.args, err, tc.want)
		}
	}
}

// TestNamedCommandsExist: every `dsec ...` command the code (its errors,
// hints and help), the Python SDK and the docs name is one dsec has: an
// error once sent users to `dsec image ls`, which did not exist.
func TestNamedCommandsExist(t *testing.T) {
	_, cmds := cliTree()
	repo := testutil.RepoRoot()
	var files []string
	for _, glob := range []string{"cmd/*/*.go", "internal/*/*.go", "internal/*/*/*.go", "sdk/go/*.go",
		"sdk/python/libdsec/*.py", "docs/*.md", "README.md", "sdk/python/README.md"} {
		m, err := filepath.Glob(filepath.Join(repo, glob))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	dsec := regexp.MustCompile(`\bdsec `)
	words := regexp.MustCompile(`^[a-z][a-z0-9-]*(?: [a-z][a-z0-9-]*)*`)
	checked := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		if strings.HasSuffix(f, ".go") {
			text = stringLiterals(b) // what users see; comments may say "its dsec layer ref"
		}
		rel, _ := filepath.Rel(repo, f)
		for _, at := range dsec.FindAllStringIndex(text, -1) {
			m := words.FindString(text[at[1]:])
			if m == "" {
				continue
			}
			words := strings.Fields(m)
			path := words[0]
			if cmds[path] == nil {
				continue // prose: "dsec itself", "dsec enforces"
			}
			checked++
			for _, w := range words[1:] {
				if !isGroup(cmds[path]) {
					break // a command's arguments, or prose
				}
				if cmds[path+" "+w] == nil {
					t.Errorf("%s names `dsec %s`: `dsec %s` has no command %q", rel, m, path, w)
					break
				}
				path += " " + w
			}
		}
	}
	if checked < 100 {
		t.Fatalf("only %d commands named in %d files: is the search broken?", checked, len(files))
	}
}

// stringLiterals is the string literals of Go source src, one a line.
func stringLiterals(src []byte) string {
	var s scanner.Scanner
	fset := token.NewFileSet()
	s.Init(fset.AddFile("", fset.Base(), len(src)), src, nil, 0)
	var out strings.Builder
	for {
		_, tok, lit := s.Scan()
		if tok == token.EOF {
			return out.String()
		}
		if tok == token.STRING {
			if v, err := strconv.Unquote(lit); err == nil {
				out.WriteString(v + "\n")
			}
		}
	}
}
