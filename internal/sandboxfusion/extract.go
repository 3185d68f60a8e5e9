package sandboxfusion

import (
	"regexp"
	"strings"
)

// Code extraction from a completion, as SandboxFusion's
// default_extract_helper does it (sandbox/utils/extraction.py): every
// complete fenced block (priority 30), incomplete fenced block (20) and,
// for python and bash, heuristic block (10) is a candidate; of those with
// the highest priority, the first tagged with the language wins, else the
// first. Where SandboxFusion finds nothing and runs the empty string,
// dsec runs the whole completion (a bare program, sent without fences).

// Extracted types, EvalResult.extracted_type.
const (
	extractedFenced     = "fenced"
	extractedIncomplete = "incomplete_fenced"
	extractedHeuristic  = "heuristic"
	extractedEmpty      = "empty"
)

var (
	fencedRE     = regexp.MustCompile("(?s)```([^\n]*)\n(.*?)\n\\s*```")
	incompleteRE = regexp.MustCompile("(?s)```([^\n]*)\n(.*)")
	pythonDefRE  = regexp.MustCompile(`(?m)(?:^(?:import|from|#)[^\n]+\n)*^(?:def|class) [^\n]+\n(?:\s+[^\n]+\n)+`)
)

// fenceTags maps a fence's info string to the language it names, as
// SandboxFusion's aliases table (where "javascript" names "javascript",
// not "nodejs": a later entry of the table overrides an earlier one).
var fenceTags = func() map[string]string {
	m := map[string]string{}
	for lang, tags := range map[string][]string{
		"python":     {"python", "Python", "py", "Python3", "python3", "PY"},
		"cpp":        {"cpp", "c++", "C++", "Cpp", "CPP"},
		"nodejs":     {"JS", "js"},
		"javascript": {"javascript", "Javascript", "JavaScript"},
		"go":         {"go", "Go"},
		"java":       {"java", "Java"},
		"php":        {"php", "PHP"},
		"csharp":     {"csharp", "c#", "C#"},
		"bash":       {"bash", "Bash", "BASH", "sh", "shell"},
		"typescript": {"typescript"},
		"rust":       {"rust", "Rust", "rs"},
		"sql":        {"sql", "SQL", "Sql"},
		"D":          {"D", "d"},
		"julia":      {"julia", "Julia", "jl"},
		"lua":        {"lua", "Lua"},
		"perl":       {"perl", "Perl", "PERL"},
		"R":          {"R", "r"},
		"ruby":       {"ruby", "Ruby"},
		"scala":      {"scala", "Scala"},
		"kotlin":     {"kotlin", "Kotlin"},
		"c":          {"c", "C"},
		"html":       {"html", "Html", "HTML"},
		"verilog":    {"verilog", "Verilog", "VERILOG"},
		"racket":     {"racket"},
		"swift":      {"swift"},
	} {
		for _, t := range tags {
			m[t] = lang
		}
	}
	return m
}()

type codeBlock struct {
	priority int
	language string
	code     string
}

// extractCode returns the code to run and how it was found.
func extractCode(completion, language string) (code, extractedType string) {
	var blocks []codeBlock
	for _, m := range fencedRE.FindAllStringSubmatch(completion, -1) {
		blocks = append(blocks, codeBlock{30, fenceTags[strings.TrimSpace(m[1])], m[2]})
	}
	blocks = append(blocks, heuristicBlocks(completion, language)...)
	for _, m := range incompleteRE.FindAllStringSubmatch(completion, -1) {
		blocks = append(blocks, codeBlock{20, fenceTags[strings.TrimSpace(m[1])], m[2]})
	}
	if len(blocks) == 0 {
		return completion, extractedEmpty
	}
	top := 0
	for _, b := range blocks {
		top = max(top, b.priority)
	}
	var first *codeBlock
	for i := range blocks {
		b := &blocks[i]
		if b.priority != top {
			continue
		}
		if b.language == language {
			first = b
			break
		}
		if first == nil {
			first = b
		}
	}
	kind := map[int]string{30: extractedFenced, 20: extractedIncomplete, 10: extractedHeuristic}[top]
	return first.code, kind
}

func heuristicBlocks(completion, language string) []codeBlock {
	nonBlank := func() string {
		var lines []string
		for _, l := range strings.Split(completion, "\n") {
			if strings.TrimSpace(l) != "" {
				lines = append(lines, l)
			}
		}
		return strings.Join(lines, "\n") + "\n"
	}
	switch language {
	case "python":
		var out []codeBlock
		for _, m := range pythonDefRE.FindAllString(nonBlank(), -1) {
			out = append(out, codeBlock{10, "python", m})
		}
		return out
	case "bash":
		return []codeBlock{{10, "bash", nonBlank()}}
	}
	return nil
}
