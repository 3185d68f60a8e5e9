package cli

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"text/tabwriter"

	"github.com/spf13/cobra"

	dsec "dsec.dev/dsec/sdk/go"
)

func (a *app) trajectoryCommand() *cobra.Command {
	var since int64
	cmd := &cobra.Command{
		Use:   "trajectory ID",
		Short: "print what was done to a sandbox, in order, as JSON lines: calls with their arguments, exits and output hashes, and network events (docs/trajectories.md)",
		Long: `Print a sandbox's trajectory as JSON lines: every call that acted on it, in
order, with its time, arguments, exit and the SHA-256 of its output (the
output itself up to the node's cap), and its network events between them.
It is kept after the sandbox is deleted, for the node's retention
(dsecd --trajectory-retention). --since OFFSET prints only what came after
the first OFFSET bytes (a trainer re-attaching reads what it missed). The
trajectory's SHA-256 and the offset to read from next go to stderr.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c := a.c.Client()
			var next, size int64
			var sum string
			var ended bool
			for off := since; ; {
				r, err := c.ReadTrajectory(cmd.Context(), args[0], off)
				if err != nil {
					return err
				}
				if _, err := a.stdout.Write(r.Lines); err != nil {
					return err
				}
				next, size, sum, ended = r.NextOffset, r.Size, r.SHA256, r.Ended
				off = r.NextOffset
				if off >= r.Size || len(r.Lines) == 0 {
					break
				}
			}
			state := "live"
			if ended {
				state = "ended"
			}
			fmt.Fprintf(a.stderr, "trajectory of %s: %s, %d bytes, sha256 %s, next offset %d\n", args[0], state, size, sum, next)
			return nil
		},
	}
	cmd.Flags().Int64Var(&since, "since", 0, "start at this byte offset (the next offset an earlier read printed)")
	return cmd
}

func (a *app) replayCommand() *cobra.Command {
	var env string
	cmd := &cobra.Command{
		Use:   "replay TRAJECTORY",
		Short: "run a trajectory's calls again in a fresh sandbox and report, step by step, where exits and outputs diverge (is this task deterministic?)",
		Long: `Replay a trajectory (a file of its JSON lines, as dsec trajectory prints it,
or the ID of a sandbox whose trajectory the cluster keeps) in a fresh sandbox
of the same environment (or --env) and network rules: each command's exit
code and the SHA-256 of its stdout and stderr are compared with the record,
each other call's success. Calls that act on a sandbox as a whole (pause,
resume, snapshot, fork, shell, delete) are skipped. Exits 0 when every step
matched, 3 when one diverged.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c := a.c.Client()
			data, err := os.ReadFile(args[0])
			if errors.Is(err, fs.ErrNotExist) {
				var buf bytes.Buffer
				if _, _, err := c.Trajectory(cmd.Context(), args[0], &buf); err != nil {
					return fmt.Errorf("%s is neither a file nor a sandbox with a trajectory: %w", args[0], err)
				}
				data = buf.Bytes()
			} else if err != nil {
				return err
			}
			lines, err := dsec.ParseTrajectory(bytes.NewReader(data))
			if err != nil {
				return err
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			if !a.json {
				fmt.Fprintln(tw, "SEQ\tCALL\tVERDICT\tDETAIL")
			}
			rep, err := c.Replay(cmd.Context(), lines, &dsec.ReplayOptions{Environment: env, OnStep: func(s dsec.ReplayStep) {
				if !a.json {
					fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", s.Seq, s.Call, s.Verdict, s.Detail)
				}
			}})
			if err != nil {
				return err
			}
			if a.json {
				if err := a.printJSON(rep); err != nil {
					return err
				}
			} else {
				tw.Flush()
				fmt.Fprintf(a.stdout, "%d matched, %d diverged, %d skipped\n", rep.Matched, rep.Diverged, rep.Skipped)
			}
			if !rep.Deterministic() {
				return &exitCode{code: 3}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&env, "env", "", "replay in this environment instead of the trajectory's")
	return cmd
}
