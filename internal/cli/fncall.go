package cli

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (a *app) fnCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "fn",
		Short: "run short programs (reward code, test cases) in the fncall backend's warm containers",
	}
	cmd.AddCommand(a.fnRunCommand(), a.fnLanguagesCommand())
	return cmd
}

// fnRunFlags are the flags of dsec fn run.
type fnRunFlags struct {
	language       string
	stdinFile      string
	files          []string
	fetch          []string
	runTimeout     float64
	compileTimeout float64
	memoryMB       int64
	cpus           float64
	netRules       string
	environment    string
}

func (a *app) fnRunCommand() *cobra.Command {
	var f fnRunFlags
	cmd := &cobra.Command{
		Use:         "run --language LANG [flags] FILE|-",
		Short:       "compile and run one program, as SandboxFusion's /run_code does",
		Annotations: faultExits,
		Long: `Run compiles (for compiled languages) and runs the program in FILE, or read
from stdin when FILE is -. The program's stdin is this command's stdin when
FILE is given (unless it is a terminal), else the --stdin-file, else empty:

  dsec fn run --language python solution.py < input.txt

The run's stdout and stderr are printed to stdout and stderr, and the exit
code is the program's. A failed compile prints the compiler's output to
stderr and exits 1; a step that timed out exits 124, one killed at the memory
limit 137, one killed by signal N 128+N; a call that could not be run (a
sandbox error) exits 125. --json prints the whole RunCodeResponse instead,
with the same exit code.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return fmt.Errorf("name the program's FILE, or - to read it from stdin: dsec fn run --language LANG FILE")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			req, fetchTo, err := a.fnRequest(&f, args[0])
			if err != nil {
				return err
			}
			resp, err := a.c.FnCall.RunCode(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			if a.json {
				if err := a.printProto(resp.Msg); err != nil {
					return err
				}
				if ec := fnExit(resp.Msg); ec != nil {
					ec.msg = ""
					return ec
				}
				return nil
			}
			return a.fnOutput(resp.Msg, req.GetFetchFiles(), fetchTo)
		},
	}
	fl := cmd.Flags()
	fl.StringVarP(&f.language, "language", "l", "", "the program's language (dsec fn languages lists them)")
	fl.StringVar(&f.stdinFile, "stdin-file", "", "file given to the program as its stdin (default: this command's stdin when FILE is given)")
	fl.StringArrayVar(&f.files, "file", nil, "PATH=LOCAL: the local file LOCAL written at PATH in the call's scratch directory first (repeatable)")
	fl.StringArrayVar(&f.fetch, "fetch", nil, "PATH[=LOCAL]: the file PATH read back after the run and written to LOCAL (default: PATH's base name here) (repeatable)")
	fl.Float64Var(&f.runTimeout, "run-timeout", 0, "seconds the run step may take (default 10)")
	fl.Float64Var(&f.compileTimeout, "compile-timeout", 0, "seconds the compile step may take (default 10)")
	fl.Int64Var(&f.memoryMB, "memory-mb", 0, "the call's memory limit in MiB (default 1024)")
	fl.Float64Var(&f.cpus, "cpus", 0, "the call's CPU limit in cores (default 1)")
	fl.StringVar(&f.netRules, "network-rules", "", `network rules as JSON, e.g. {"pypi": true} (default: no network)`)
	fl.StringVar(&f.environment, "environment", "", "the environment to run in (default: the language's, fncall:latest)")
	return cmd
}

// fnRequest builds the call from the flags and FILE, and says where each
// fetched file goes.
func (a *app) fnRequest(f *fnRunFlags, file string) (*dsecv1.RunCodeRequest, map[string]string, error) {
	if f.language == "" {
		return nil, nil, fmt.Errorf("--language is required (dsec fn languages lists them)")
	}
	if f.runTimeout < 0 || f.compileTimeout < 0 {
		return nil, nil, fmt.Errorf("--run-timeout and --compile-timeout are seconds, 0 (the default) or more")
	}
	rules, err := parseRules("--network-rules", f.netRules)
	if err != nil {
		return nil, nil, err
	}
	req := &dsecv1.RunCodeRequest{
		Language: f.language, RunTimeoutSeconds: f.runTimeout, CompileTimeoutSeconds: f.compileTimeout,
		MemoryMb: f.memoryMB, Cpus: f.cpus, NetworkRules: rules, Environment: f.environment,
	}
	var code []byte
	if file == "-" {
		if code, err = io.ReadAll(a.stdin); err != nil {
			return nil, nil, fmt.Errorf("read the program from stdin: %w", err)
		}
	} else if code, err = os.ReadFile(file); err != nil {
		return nil, nil, fmt.Errorf("read the program: %w", err)
	}
	req.Code = string(code)
	switch {
	case f.stdinFile != "":
		if req.Stdin, err = os.ReadFile(f.stdinFile); err != nil {
			return nil, nil, fmt.Errorf("read --stdin-file: %w", err)
		}
	case file != "-" && !isTerminal(a.stdin):
		if req.Stdin, err = io.ReadAll(a.stdin); err != nil {
			return nil, nil, fmt.Errorf("read the program's stdin: %w", err)
		}
	}
	for _, kv := range f.files {
		path, local, ok := strings.Cut(kv, "=")
		if !ok || path == "" || local == "" {
			return nil, nil, fmt.Errorf("--file %q: want PATH=LOCAL", kv)
		}
		data, err := os.ReadFile(local)
		if err != nil {
			return nil, nil, fmt.Errorf("--file %s: %w", path, err)
		}
		if req.Files == nil {
			req.Files = map[string][]byte{}
		}
		req.Files[path] = data
	}
	fetchTo := map[string]string{}
	for _, kv := range f.fetch {
		path, local, ok := strings.Cut(kv, "=")
		if !ok {
			local = filepath.Base(path)
		}
		if path == "" || local == "" || local == "." || local == "/" {
			return nil, nil, fmt.Errorf("--fetch %q: want PATH or PATH=LOCAL", kv)
		}
		if _, dup := fetchTo[path]; !dup {
			req.FetchFiles = append(req.FetchFiles, path)
		}
		fetchTo[path] = local
	}
	return req, fetchTo, nil
}

func isTerminal(r io.Reader) bool {
	f, ok := r.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// fnOutput prints a call's output, writes its fetched files and turns its
// result into the exit code.
func (a *app) fnOutput(resp *dsecv1.RunCodeResponse, fetch []string, fetchTo map[string]string) error {
	if c := resp.GetCompileResult(); c != nil && resp.GetRunResult() == nil {
		a.stderr.Write(c.GetStdout())
		a.stderr.Write(c.GetStderr())
	}
	if r := resp.GetRunResult(); r != nil {
		a.stdout.Write(r.GetStdout())
		a.stderr.Write(r.GetStderr())
	}
	for _, path := range fetch {
		data, ok := resp.GetFiles()[path]
		if !ok {
			fmt.Fprintf(a.stderr, "dsec: warning: %s was not fetched: the call left no such file\n", path)
			continue
		}
		if err := os.WriteFile(fetchTo[path], data, 0o644); err != nil {
			return fmt.Errorf("write fetched %s: %w", path, err)
		}
	}
	if ec := fnExit(resp); ec != nil {
		return ec
	}
	return nil
}

// fnExit maps a call's result onto this program's exit: the run's own code,
// 1 for a failed compile, 124 for a step that timed out (as timeout(1)),
// 137 for one killed at the memory limit, 128+N for one killed by signal N,
// 125 for a call that could not be run, 200+F for one the platform's fault
// F kept from running (faultExit). nil when it succeeded.
func fnExit(resp *dsecv1.RunCodeResponse) *exitCode {
	if f := resp.GetFault(); f != dsecv1.Fault_FAULT_UNSPECIFIED {
		return faultErr(f, resp.GetMessage())
	}
	if resp.GetStatus() == dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR {
		msg := resp.GetMessage()
		if msg == "" {
			msg = "the call could not be run"
		}
		return &exitCode{code: 125, msg: "sandbox error: " + msg}
	}
	trunc := ""
	if r := resp.GetRunResult(); r.GetStdoutTruncated() || r.GetStderrTruncated() {
		trunc = " (output cut at 1 MiB per stream)"
	}
	if c := resp.GetCompileResult(); c != nil && resp.GetRunResult() == nil {
		if ec := stepExit("compile step", c, ""); ec != nil {
			if ec.code != 124 && ec.code != 137 {
				ec.code = 1
			}
			return ec
		}
		return &exitCode{code: 1, msg: "the compile step failed: " + resp.GetMessage()}
	}
	if r := resp.GetRunResult(); r != nil {
		if ec := stepExit("program", r, trunc); ec != nil {
			return ec
		}
	}
	if resp.GetStatus() != dsecv1.RunStatus_RUN_STATUS_SUCCESS {
		return &exitCode{code: 1, msg: "the call failed: " + resp.GetMessage()}
	}
	if trunc != "" {
		return &exitCode{code: 0, msg: "note:" + trunc}
	}
	return nil
}

func stepExit(what string, r *dsecv1.CommandResult, trunc string) *exitCode {
	switch {
	case r.GetStatus() == dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED:
		return &exitCode{code: 124, msg: fmt.Sprintf("the %s timed out after %.1fs and was killed%s", what, r.GetExecutionTimeSeconds(), trunc)}
	case r.GetMemoryLimitExceeded():
		return &exitCode{code: 137, msg: fmt.Sprintf("the %s was killed at the call's memory limit (--memory-mb)%s", what, trunc)}
	case r.ReturnCode == nil:
		return &exitCode{code: 1, msg: fmt.Sprintf("the %s ended without an exit code%s", what, trunc)}
	case r.GetReturnCode() < 0:
		return &exitCode{code: 128 - int(r.GetReturnCode()), msg: fmt.Sprintf("the %s was killed by signal %d%s", what, -r.GetReturnCode(), trunc)}
	case r.GetReturnCode() > 0:
		msg := strings.TrimPrefix(trunc, " ")
		if what != "program" {
			msg = fmt.Sprintf("the %s exited with %d%s", what, r.GetReturnCode(), trunc)
		}
		return &exitCode{code: int(r.GetReturnCode()), msg: msg}
	}
	return nil
}

func (a *app) fnLanguagesCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "languages",
		Short: "list the languages fn run takes, with how each is compiled and run",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.FnCall.ListLanguages(cmd.Context(), connect.NewRequest(&dsecv1.ListLanguagesRequest{}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			langs := slices.Clone(res.Msg.GetLanguages())
			slices.SortFunc(langs, func(x, y *dsecv1.Language) int { return strings.Compare(x.GetName(), y.GetName()) })
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tENVIRONMENT\tFILE\tCOMPILE\tRUN")
			for _, l := range langs {
				compile := showArgv(l.GetCompileArgv())
				if compile == "" {
					compile = "-"
				}
				run := showArgv(l.GetRunArgv())
				if l.GetZygote() {
					run += " (warm interpreter)"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", l.GetName(), l.GetEnvironment(), l.GetSourceFile(), compile, run)
			}
			return tw.Flush()
		},
	}
}

// showArgv writes an argv on one line of a table: each argument quoted as
// a shell would need it, one of several lines (go_test's script) cut to
// its first and "…".
func showArgv(argv []string) string {
	out := make([]string, len(argv))
	for i, arg := range argv {
		if first, _, cut := strings.Cut(arg, "\n"); cut {
			arg = first + " …"
		}
		arg = strings.ReplaceAll(arg, "\t", " ")
		if arg == "" || strings.ContainsAny(arg, " '\"$`\\|&;<>()*?[]{}~#!") {
			arg = "'" + strings.ReplaceAll(arg, "'", `'\''`) + "'"
		}
		out[i] = arg
	}
	return strings.Join(out, " ")
}
