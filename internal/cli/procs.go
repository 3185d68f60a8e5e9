package cli

import (
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// The commands here work on the processes of a sandbox, above all the
// background ones `dsec exec -d` starts: list them, follow or read their
// output, signal them.

func (a *app) psCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "ps ID",
		Short: "list a sandbox's processes started through dsec (running ones and those kept after they exited)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := a.c.Sandboxes.ListProcesses(cmd.Context(), connect.NewRequest(&dsecv1.ListProcessesRequest{SandboxId: args[0]}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(resp.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "PROCESS\tPID\tTAG\tSTATUS\tAGE\tCOMMAND")
			for _, p := range resp.Msg.GetProcesses() {
				age := ""
				if ms := p.GetStartedUnixMs(); ms > 0 {
					age = time.Since(time.UnixMilli(ms)).Round(time.Second).String()
				}
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\n", p.GetProcessId(), p.GetPid(), p.GetTag(), processStatus(p), age,
					strings.Join(p.GetArgv(), " "))
			}
			return tw.Flush()
		},
	}
}

// processStatus is a process's state in a word or two: running, or how it
// ended.
func processStatus(p *dsecv1.ProcessInfo) string {
	if p.GetRunning() {
		return "running"
	}
	x := p.GetExited()
	switch x.GetStatus() {
	case dsecv1.ExitStatus_EXIT_STATUS_OK, dsecv1.ExitStatus_EXIT_STATUS_NONZERO:
		return fmt.Sprintf("exited %d", x.GetExitCode())
	case dsecv1.ExitStatus_EXIT_STATUS_KILLED:
		return fmt.Sprintf("killed (signal %d)", x.GetSignal())
	case dsecv1.ExitStatus_EXIT_STATUS_UNSPECIFIED:
		return "exited"
	}
	return strings.ToLower(strings.TrimPrefix(x.GetStatus().String(), "EXIT_STATUS_"))
}

// processRef fills a process reference: a process ID (p-…) or a tag.
func processRef(ref string) (processID, tag string) {
	if strings.HasPrefix(ref, "p-") {
		return ref, ""
	}
	return "", ref
}

func (a *app) attachCommand() *cobra.Command {
	var noFollow bool
	cmd := &cobra.Command{
		Use:   "attach ID PROCESS|TAG",
		Short: "print a background process's output from its start, follow it, and exit with its exit code",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			pid, tag := processRef(args[1])
			stream, err := a.c.Sandboxes.Attach(cmd.Context(), connect.NewRequest(&dsecv1.AttachRequest{
				SandboxId: args[0], ProcessId: pid, Tag: tag, NoFollow: noFollow}))
			if err != nil {
				return err
			}
			defer stream.Close()
			end, err := a.copyEvents(stream, nil)
			if err != nil {
				return err
			}
			if end.exited == nil && !noFollow {
				return fmt.Errorf("the process's stream ended without an exit status")
			}
			// Without an exit (--no-follow of a running process) what it
			// printed so far is out: a success, unless some was dropped.
			return end.err()
		},
	}
	cmd.Flags().BoolVar(&noFollow, "no-follow", false, "print what the process has printed so far and return at once")
	return cmd
}

func (a *app) killCommand() *cobra.Command {
	var sig string
	cmd := &cobra.Command{
		Use:   "kill ID PROCESS|TAG",
		Short: "kill a process with everything it started (or send it one signal with --signal)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			n, err := parseSignal(sig)
			if err != nil {
				return err
			}
			// The agent finds a process by ID or tag (the newest with it).
			_, err = a.c.Sandboxes.Signal(cmd.Context(), connect.NewRequest(&dsecv1.SignalRequest{
				SandboxId: args[0], ProcessId: args[1], Signal: int32(n)}))
			return err
		},
	}
	cmd.Flags().StringVarP(&sig, "signal", "s", "", "signal to send the process alone, by name or number (TERM, INT, 9…); default: SIGKILL to its whole tree")
	return cmd
}

// parseSignal reads a signal name (TERM, SIGTERM) or number; "" is 0, which
// the API takes as "kill the whole tree".
func parseSignal(s string) (int, error) {
	if s == "" {
		return 0, nil
	}
	if n, err := strconv.Atoi(s); err == nil {
		if n < 1 || n > 64 {
			return 0, fmt.Errorf("--signal %d: want 1..64", n)
		}
		return n, nil
	}
	name := strings.ToUpper(s)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	if n := unix.SignalNum(name); n != 0 {
		return int(n), nil
	}
	return 0, fmt.Errorf("--signal %q: not a signal name or number", s)
}
