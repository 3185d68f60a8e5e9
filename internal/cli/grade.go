package cli

import (
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// maxGradeTests bounds the tests files one grade sends from the local
// disk: a grade request is one message.
const maxGradeTests = 32 << 20

func (a *app) gradeCommand() *cobra.Command {
	var (
		paths, testsPaths, tests, env []string
		layer, command, user, cwd     string
		iso, receiptFile              string
		timeout                       time.Duration
		keep                          bool
		cpus                          float64
		memoryMB                      int64
	)
	cmd := &cobra.Command{
		Use:   "grade ID --path PATH... [--tests LOCAL:PATH]... [--tests-layer REF] (-c COMMAND | -- ARGV...)",
		Short: "grade a sandbox in a clean room: only --path captured, the trusted tests on top, no network, the grader as nobody; prints the reward",
		Long: "grade captures only the sandbox's --path paths, starts a fresh sandbox from its layers, that capture\n" +
			"and the trusted tests on top (--tests copies a local file or directory to PATH, --tests-layer stacks a\n" +
			"layer; each --tests PATH, and each --tests-path, is left out of the capture whole), with no network and\n" +
			"none of the sandbox's processes, runs the grader there as nobody (--user) and prints the reward on\n" +
			"stdout: the number the grader wrote to $DSEC_REWARD_FILE, else 1 on exit 0 and 0 otherwise. The\n" +
			"grader's output goes to stderr. Exit 0 whatever the reward; non-zero only when no grade happened\n" +
			"(200 + the fault's number when the platform's fault ended it: docs/outcomes.md).\n" +
			"See docs/grading.md.",
		Args:        cobra.MinimumNArgs(1),
		Annotations: faultExits,
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.GradeRequest{SandboxId: args[0], Paths: paths, Command: command, User: user, Cwd: cwd,
				TimeoutSeconds: timeout.Seconds(), Keep: keep, Cpus: cpus, MemoryMb: memoryMB,
				Tests: &dsecv1.GradeTests{Layer: layer, Paths: testsPaths, Files: map[string][]byte{}}}
			if len(args) > 1 {
				req.Argv = args[1:]
			}
			var err error
			if req.Env, err = parseKV("--env", env); err != nil {
				return err
			}
			if req.Isolation, err = parseIsolation(iso); err != nil {
				return err
			}
			var total int64
			for _, t := range tests {
				local, remote, ok := strings.Cut(t, ":")
				if !ok || local == "" || !strings.HasPrefix(remote, "/") {
					return &exitCode{code: 2, msg: fmt.Sprintf("dsec: --tests %q: want LOCAL:PATH, PATH absolute in the sandbox", t)}
				}
				n, err := readTests(local, remote, req.Tests.Files)
				if err != nil {
					return err
				}
				if total += n; total > maxGradeTests {
					return &exitCode{code: 2, msg: fmt.Sprintf("dsec: --tests: over %d MiB of files; put them in a layer (--tests-layer)", maxGradeTests>>20)}
				}
				req.Tests.Paths = append(req.Tests.Paths, path.Clean(remote))
			}
			resp, err := a.c.Sandboxes.Grade(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			r := resp.Msg
			// The receipt is written whatever the outcome; one that
			// cannot be is an error once the grade is reported.
			receiptErr := writeReceipt(receiptFile, args[0], r.GetReceipt())
			if a.json {
				if err := a.printProto(r); err != nil {
					return err
				}
				return receiptErr
			}
			a.stderr.Write(r.GetStdout())
			a.stderr.Write(r.GetStderr())
			fmt.Fprintln(a.stderr, gradeSummary(args[0], r))
			if keep {
				fmt.Fprintf(a.stderr, "dsec: the clean room %s is kept: delete it with dsec rm %s\n", r.GetGraderSandboxId(), r.GetGraderSandboxId())
			}
			if f := r.GetFault(); f != dsecv1.Fault_FAULT_UNSPECIFIED {
				return faultErr(f, "the platform ended the grader: no reward")
			}
			fmt.Fprintln(a.stdout, r.GetReward())
			return receiptErr
		},
	}
	f := cmd.Flags()
	f.StringArrayVar(&paths, "path", nil, "a workspace path the grade captures, with everything under it (repeatable; at least one)")
	f.StringArrayVar(&tests, "tests", nil, "LOCAL:PATH: copy the local file or directory LOCAL to PATH in the clean room, pristine (repeatable)")
	f.StringVar(&layer, "tests-layer", "", "a layer (name:tag or digest) stacked above the capture; name its paths with --tests-path")
	f.StringArrayVar(&testsPaths, "tests-path", nil, "a path the trusted tests own: the sandbox's version is left out whole (repeatable)")
	f.StringVarP(&command, "command", "c", "", "the grader as a shell line (else the arguments after ID, run directly)")
	f.StringVarP(&user, "user", "u", "", "who the grader runs as (default 65534:65534, nobody)")
	f.StringVarP(&cwd, "cwd", "w", "", "the grader's working directory")
	f.StringArrayVarP(&env, "env", "e", nil, "K=V in the grader's environment (repeatable)")
	f.DurationVar(&timeout, "timeout", 0, "the grader's timeout (default 10m)")
	f.StringVar(&iso, "isolation", "", "the clean room's isolation: container, gvisor or microvm (default the sandbox's own)")
	f.StringVar(&receiptFile, "receipt", "", "write the grade's signed receipt to FILE, for dsec receipt verify (docs/receipts.md)")
	f.BoolVar(&keep, "keep", false, "keep the clean room afterwards (its ID goes to stderr)")
	f.Float64Var(&cpus, "cpus", 0, "the clean room's CPUs (default the sandbox's)")
	f.Int64Var(&memoryMB, "memory", 0, "the clean room's memory in MiB (default the sandbox's)")
	return cmd
}

// writeReceipt writes a grade's signed receipt to file ("": not asked
// for).
func writeReceipt(file, id string, signed []byte) error {
	switch {
	case file == "":
		return nil
	case len(signed) == 0:
		return fmt.Errorf("grade of %s: its node signed no receipt (the dsecd log says why), so %s is not written", id, file)
	}
	if err := os.WriteFile(file, signed, 0o644); err != nil {
		return fmt.Errorf("write the grade's receipt: %w", err)
	}
	return nil
}

// readTests reads the local file or directory local into files, at remote
// and below, and returns the bytes read. Symlinks are refused: the tests
// are what the caller holds, not what a link points at.
func readTests(local, remote string, files map[string][]byte) (int64, error) {
	var total int64
	err := filepath.WalkDir(local, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			return nil
		case !d.Type().IsRegular():
			return fmt.Errorf("--tests %s: %s is not a regular file", local, p)
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(local, p)
		if err != nil {
			return err
		}
		files[path.Join(remote, filepath.ToSlash(rel))] = data
		total += int64(len(data))
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("read tests: %w", err)
	}
	return total, nil
}

// exitWords says how a command ended.
// gradeSummary is the line dsec grade ends its stderr with: how the
// grader ended, where the reward came from, and the times of the parts.
func gradeSummary(id string, r *dsecv1.GradeResult) string {
	status := strings.ToLower(strings.TrimPrefix(r.GetExit().GetStatus().String(), "EXIT_STATUS_"))
	t := r.GetTimes()
	return fmt.Sprintf("dsec: grade of %s: %s (%s), reward from %s; capture %d ms, start %d ms, tests %d ms, grader %d ms, kill+reward %d ms, receipt %d ms, total %d ms",
		id, status, exitWords(r.GetExit()), r.GetRewardSource(), t.GetCaptureMs(), t.GetStartMs(), t.GetTestsMs(),
		t.GetGraderMs(), t.GetRewardMs(), t.GetReceiptMs(), t.GetTotalMs())
}

func exitWords(e *dsecv1.ExecExited) string {
	if e.GetSignal() != 0 {
		return fmt.Sprintf("signal %d", e.GetSignal())
	}
	return fmt.Sprintf("exit %d", e.GetExitCode())
}
