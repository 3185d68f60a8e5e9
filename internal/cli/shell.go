package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// parseRules reads the network-rules JSON mapping (name -> allow). Rules
// are security policy: each value must be the JSON boolean true or false,
// and anything else (the string "false" included) is refused by name.
func parseRules(what, s string) (map[string]bool, error) {
	if s == "" {
		return nil, nil
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal([]byte(s), &raw); err != nil {
		return nil, fmt.Errorf(`%s: want a JSON object of name to true/false, e.g. {"pypi": true}: %w`, what, err)
	}
	rules := make(map[string]bool, len(raw))
	for _, k := range slices.Sorted(maps.Keys(raw)) {
		switch v := strings.TrimSpace(string(raw[k])); v {
		case "true", "false":
			rules[k] = v == "true"
		default:
			return nil, fmt.Errorf(`%s: network rule %q: want true or false (a JSON boolean), not %s`, what, k, v)
		}
	}
	return rules, nil
}

func (a *app) shellCommand() *cobra.Command {
	var user, workdir string
	var tty bool
	cmd := &cobra.Command{
		Use:         "shell ID [-- CMD ARGS...]",
		Short:       "open an interactive terminal in a sandbox (with stdin not a terminal, run the shell on it as ssh does)",
		Annotations: faultExits,
		Args:        cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			fd := int(os.Stdin.Fd())
			if !tty && !term.IsTerminal(fd) {
				return a.pipedShell(cmd.Context(), args[0], args[1:], user, workdir)
			}
			start := &dsecv1.ShellStart{SandboxId: args[0], Argv: args[1:], User: user, Cwd: workdir,
				Env: map[string]string{"TERM": envOr("TERM", "xterm")}}
			return a.terminalShell(cmd.Context(), fd, start)
		},
	}
	cmd.Flags().StringVarP(&user, "user", "u", "", "user (name or uid[:gid])")
	cmd.Flags().StringVarP(&workdir, "workdir", "w", "", "working directory")
	cmd.Flags().BoolVarP(&tty, "tty", "t", false, "use a terminal (PTY) even when stdin is not one, as ssh -t")
	return cmd
}

// pipedShell is `dsec shell` with stdin not a terminal (a pipe, a file), as
// ssh does then: no PTY, and no prompt or echo in the output. The command,
// or the sandbox's shell reading commands from its stdin, gets this
// program's stdin, closed at its end, so the shell ends when the input
// does; stdout and stderr stay apart, and the exit code is the command's
// (with the codes of exec).
func (a *app) pipedShell(ctx context.Context, id string, argv []string, user, workdir string) error {
	req := &dsecv1.ExecRequest{SandboxId: id, Argv: argv, User: user, Cwd: workdir, KeepStdinOpen: true}
	if len(argv) == 0 {
		// Under `shell -c`, $0 is that shell, the one `dsec shell` opens:
		// exec'd with no arguments and stdin not a terminal, it reads its
		// commands from stdin.
		req.Command = `exec "$0"`
	}
	return a.streamExec(ctx, req)
}

// terminalShell runs start in a PTY until it exits, and exits with its
// code. When stdin is a terminal, it is put in raw mode meanwhile and its
// size follows this one's.
func (a *app) terminalShell(ctx context.Context, fd int, start *dsecv1.ShellStart) error {
	interactive := term.IsTerminal(fd)
	if interactive {
		if cols, rows, err := term.GetSize(fd); err == nil {
			start.Size = &dsecv1.TerminalSize{Rows: uint32(rows), Cols: uint32(cols)}
		}
		old, err := term.MakeRaw(fd)
		if err != nil {
			return fmt.Errorf("put the terminal in raw mode: %w", err)
		}
		defer term.Restore(fd, old)
	}
	stream := a.c.Sandboxes.Shell(ctx)
	if err := stream.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Start{Start: start}}); err != nil {
		return err
	}
	go func() {
		buf := make([]byte, 32<<10)
		for {
			n, err := os.Stdin.Read(buf)
			if n > 0 {
				data := append([]byte(nil), buf[:n]...)
				if stream.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Data{Data: data}}) != nil {
					return
				}
			}
			if err != nil {
				stream.CloseRequest()
				return
			}
		}
	}()
	if interactive {
		winch := make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
		go func() {
			for range winch {
				if cols, rows, err := term.GetSize(fd); err == nil {
					stream.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Resize{Resize: &dsecv1.TerminalSize{Rows: uint32(rows), Cols: uint32(cols)}}})
				}
			}
		}()
	}
	var exited *dsecv1.ExecExited
	var recvErr error
	for {
		out, err := stream.Receive()
		if err != nil {
			recvErr = err
			break
		}
		switch o := out.Output.(type) {
		case *dsecv1.ShellOutput_Data:
			a.stdout.Write(o.Data)
		case *dsecv1.ShellOutput_Exited:
			exited = o.Exited
		}
	}
	stream.CloseResponse()
	if exited == nil {
		if recvErr != nil && !errors.Is(recvErr, io.EOF) {
			return recvErr
		}
		return fmt.Errorf("the shell ended without an exit status")
	}
	if exited.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK {
		return nil
	}
	return &exitCode{code: int(max(exited.GetExitCode(), 1))}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
