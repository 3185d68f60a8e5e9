package cli

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"dsec.dev/dsec/internal/testutil"
)

// passage is a piece of docs/cli.md that describes something on its own: a
// table row, or a paragraph or list item, with the heading it is under.
type passage struct {
	heading, text string
}

// docPassages splits docs/cli.md into passages, leaving out fenced blocks
// (example sessions, which show commands without describing them).
func docPassages(doc string) []passage {
	var out []passage
	heading, para := "", ""
	flush := func() {
		if para != "" {
			out = append(out, passage{heading, para})
		}
		para = ""
	}
	fenced := false
	for _, line := range strings.Split(doc, "\n") {
		switch {
		case strings.HasPrefix(line, "```"):
			flush()
			fenced = !fenced
		case fenced:
		case strings.HasPrefix(line, "#"):
			flush()
			heading = line
		case strings.TrimSpace(line) == "":
			flush()
		case strings.HasPrefix(line, "|"), strings.HasPrefix(line, "- "):
			flush()
			para = line
		default:
			para += "\n" + line
		}
	}
	flush()
	return out
}

// mentions says whether text names the command at path ("snapshot ls"):
// `dsec snapshot ls ...`, or `snapshot ls` alone in backticks, as prose
// refers to a command the text around it introduced.
func mentions(text, path string) bool {
	re := regexp.MustCompile("`(dsec )?" + regexp.QuoteMeta(path) + "[` ]")
	for _, m := range re.FindAllStringIndex(text, -1) {
		rest := text[m[1]-1:]
		if !strings.HasPrefix(rest, " ") || !startsWithWord(rest[1:]) {
			return true
		}
	}
	return false
}

// startsWithWord says whether s begins with a lower-case word (a
// subcommand's name, as in `dsec snapshot ls` for `dsec snapshot`).
func startsWithWord(s string) bool {
	w, _, _ := strings.Cut(s, " ")
	w = strings.TrimRight(w, "`,")
	return regexp.MustCompile(`^[a-z][a-z0-9-]*$`).MatchString(w)
}

// hasFlag says whether text names the flag, --name or its shorthand -s.
func hasFlag(text string, f *pflag.Flag) bool {
	if regexp.MustCompile(`--` + regexp.QuoteMeta(f.Name) + `([^a-z0-9-]|$)`).MatchString(text) {
		return true
	}
	return f.Shorthand != "" && regexp.MustCompile(`(^|[^A-Za-z0-9-])-`+regexp.QuoteMeta(f.Shorthand)+`([^A-Za-z0-9-]|$)`).MatchString(text)
}

// cliTree is every command of dsec, cobra's help and completion included,
// by path below the root ("snapshot ls").
func cliTree() (*cobra.Command, map[string]*cobra.Command) {
	root := (&app{}).rootCommand()
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	cmds := map[string]*cobra.Command{}
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		for _, s := range c.Commands() {
			if s.Hidden {
				continue
			}
			cmds[strings.TrimPrefix(s.CommandPath(), "dsec ")] = s
			walk(s)
		}
	}
	walk(root)
	return root, cmds
}

// TestDocListsEveryCommandAndFlag: docs/cli.md says it lists every command
// and flag. Every command dsec has is named in it, and every flag of a
// command (by its name or shorthand) in a passage that names the command
// (its table row, or prose about it); every `dsec ...` the page names is a command dsec has.
func TestDocListsEveryCommandAndFlag(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(testutil.RepoRoot(), "docs", "cli.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	passages := docPassages(doc)
	root, cmds := cliTree()

	var paths []string
	for p := range cmds {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for _, p := range paths {
		c := cmds[p]
		if !regexp.MustCompile("`dsec " + regexp.QuoteMeta(p) + "[` \\]|]").MatchString(doc) {
			t.Errorf("docs/cli.md does not name `dsec %s` (%s)", p, c.Short)
			continue
		}
		if p == "help" || strings.HasPrefix(p, "completion") {
			continue // cobra's own; its flags are cobra's
		}
		c.LocalFlags().VisitAll(func(f *pflag.Flag) {
			if f.Hidden {
				return
			}
			for _, ps := range passages {
				if hasFlag(ps.text, f) && (mentions(ps.text, p) || mentions(ps.heading+" ", p)) {
					return
				}
			}
			t.Errorf("docs/cli.md does not give `dsec %s` its flag --%s (%s)", p, f.Name, f.Usage)
		})
	}
	root.PersistentFlags().VisitAll(func(f *pflag.Flag) {
		if !hasFlag(doc, f) {
			t.Errorf("docs/cli.md does not name the global flag --%s (%s)", f.Name, f.Usage)
		}
	})

	// The other way: what the page calls a command is one.
	for _, m := range regexp.MustCompile("`dsec ([^`]*)`").FindAllStringSubmatch(doc, -1) {
		words := strings.Fields(m[1])
		if len(words) == 0 {
			continue
		}
		if _, ok := cmds[words[0]]; !ok {
			if regexp.MustCompile(`^[a-z][a-z0-9-]*$`).MatchString(words[0]) {
				t.Errorf("docs/cli.md names `dsec %s`: dsec has no command %q", m[1], words[0])
			}
			continue
		}
		path := words[0]
		for _, w := range words[1:] {
			next := path + " " + w
			if _, ok := cmds[next]; !ok {
				if isGroup(cmds[path]) {
					t.Errorf("docs/cli.md names `dsec %s`: `dsec %s` has no subcommand %q", m[1], path, w)
				}
				break
			}
			path = next
		}
	}
}
