// Package cli is the dsec command-line client. Every command talks to a
// dsecd through the public API; errors go to stderr with a non-zero exit,
// and --json gives output for scripts.
package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	"dsec.dev/dsec/internal/apiclient"
	"dsec.dev/dsec/internal/pbjson"
)

// app holds what every command shares.
type app struct {
	addr   string
	token  string // --token; never printed
	caFile string
	json   bool
	stdin  io.Reader
	stdout io.Writer
	stderr io.Writer
	c      *apiclient.Clients
}

// exitCode asks Main to exit with code after printing msg (if any).
type exitCode struct {
	code int
	msg  string
}

func (e *exitCode) Error() string { return e.msg }

// Main runs the CLI with args and returns the process exit code.
func Main(args []string) int {
	a := &app{stdin: os.Stdin, stdout: os.Stdout, stderr: os.Stderr}
	root := a.rootCommand()
	root.SetArgs(args)
	root.SetOut(a.stdout)
	root.SetErr(a.stderr)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := root.ExecuteContext(ctx)
	if err == nil {
		return 0
	}
	var ec *exitCode
	if errors.As(err, &ec) {
		if ec.msg != "" {
			fmt.Fprintln(a.stderr, "dsec:", ec.msg)
		}
		return ec.code
	}
	fmt.Fprintln(a.stderr, "dsec:", describe(err))
	return 1
}

// describe turns an RPC error into plain words.
func describe(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		msg := ce.Message()
		if ce.Code() == connect.CodeUnavailable && (apiclient.Unreachable(err) || strings.Contains(msg, "connect:")) {
			return "cannot reach dsecd (" + msg + "); is it running? (address from --addr or $DSEC_ADDR)"
		}
		// The server's message ends with its error kind in words ("…: not
		// found"); the code in brackets says it already.
		msg = strings.TrimSuffix(msg, ": "+strings.ReplaceAll(ce.Code().String(), "_", " "))
		return fmt.Sprintf("%s (%s)", msg, ce.Code())
	}
	return err.Error()
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "dsec",
		Short:         "dsec: elastic sandboxes for agentic RL and evaluation",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			c, err := apiclient.DialWith(a.addr, apiclient.Options{Token: a.token, TokenName: "--token", CAFile: a.caFile})
			if err != nil {
				return err
			}
			a.c = c
			return nil
		},
	}
	root.PersistentFlags().StringVar(&a.addr, "addr", "", "dsecd or apiserver address, or a comma-separated list to fail over between: unix:///path, host:port, http://host:port or https://host:port (default $DSEC_ADDR, else "+apiclient.DefaultAddr+")")
	root.PersistentFlags().StringVar(&a.token, "token", "", "bearer token (default $DSEC_TOKEN, else the file $DSEC_TOKEN_FILE, else "+apiclient.DefaultTokenFile+" if readable)")
	root.PersistentFlags().StringVar(&a.caFile, "ca-file", "", "PEM bundle to verify https:// addresses with (default $DSEC_CA_FILE, else the system roots)")
	root.PersistentFlags().BoolVar(&a.json, "json", false, "print JSON for scripts")
	root.AddCommand(
		a.runCommand(), a.createCommand(), a.execCommand(), a.shellCommand(),
		a.lsCommand(), a.inspectCommand(), a.rmCommand(), a.pauseCommand(), a.resumeCommand(), a.timeoutCommand(), a.topCommand(), a.snapshotCommand(), a.forkCommand(), a.cpCommand(),
		a.psCommand(), a.attachCommand(), a.killCommand(),
		a.layerCommand(), a.envCommand(), a.benchCommand(), a.netCommand(), a.imageCommand(), a.poolCommand(), a.fnCommand(), a.e2bCommand(),
	)
	// cobra adds these as it executes; added now, refuseUnknown sees them.
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	refuseUnknown(root)
	return root
}

// refuseUnknown makes every command below c that holds subcommands refuse
// a word that is none of them: cobra prints a group's help and exits 0
// ("dsec image lst"), and hands a runnable parent the word as an argument.
// A group named alone prints its help.
func refuseUnknown(c *cobra.Command) {
	for _, sub := range c.Commands() {
		refuseUnknown(sub)
	}
	if !c.HasSubCommands() || !c.HasParent() {
		return // the root refuses unknown commands itself
	}
	if !c.Runnable() {
		c.RunE = func(cmd *cobra.Command, args []string) error { return cmd.Help() }
		if c.Annotations == nil {
			c.Annotations = map[string]string{}
		}
		c.Annotations[groupAnnotation] = "true"
	}
	if c.Args == nil {
		c.Args = noSubcommand
	}
}

// groupAnnotation marks a command that only holds subcommands (dsec
// image): a word after it names one of them.
const groupAnnotation = "dsec.group"

// isGroup reports whether c only holds subcommands.
func isGroup(c *cobra.Command) bool { return c.Annotations[groupAnnotation] != "" }

// noSubcommand refuses any argument to a command with subcommands, naming
// them.
func noSubcommand(cmd *cobra.Command, args []string) error {
	if len(args) == 0 {
		return nil
	}
	msg := fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath())
	if cmd.SuggestionsMinimumDistance <= 0 {
		cmd.SuggestionsMinimumDistance = 2 // cobra's own default
	}
	if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
		msg += fmt.Sprintf("; did you mean %q?", cmd.CommandPath()+" "+s[0])
	}
	var names []string
	for _, sub := range cmd.Commands() {
		if sub.IsAvailableCommand() {
			names = append(names, sub.Name())
		}
	}
	return fmt.Errorf("%s (its commands: %s)", msg, strings.Join(names, ", "))
}

// printProto writes one API record as indented JSON, the shape
// docs/cli.md gives every --json: protobuf's JSON names (camelCase), every
// field present (zero values, [] and {} included), 64-bit integers as
// numbers.
func (a *app) printProto(m proto.Message) error {
	b, err := pbjson.Marshal(m, pbjson.Options{EmitDefaults: true})
	if err != nil {
		return err
	}
	var out bytes.Buffer
	if err := json.Indent(&out, b, "", "  "); err != nil {
		return err
	}
	fmt.Fprintln(a.stdout, out.String())
	return nil
}

// printJSON writes a value the CLI makes itself (not an API record) as
// indented JSON, in the API records' style: camelCase keys, every key
// always present.
func (a *app) printJSON(v any) error {
	enc := json.NewEncoder(a.stdout)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// parseKV turns K=V flags into a map.
func parseKV(what string, kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("%s %q: want KEY=VALUE", what, kv)
		}
		out[k] = v
	}
	return out, nil
}
