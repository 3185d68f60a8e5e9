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
	"slices"
	"strings"
	"sync/atomic"
	"syscall"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"google.golang.org/protobuf/proto"

	"dsec.dev/dsec/internal/editdist"
	"dsec.dev/dsec/internal/pbjson"
	"dsec.dev/dsec/internal/version"
	dsec "dsec.dev/dsec/sdk/go"
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
	c      *dsec.Conn
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
	return a.main(args)
}

// main runs the CLI with args and returns the exit code: 0, the code an
// error asks for, 1 for any other error, or 128+N after signal N (130 for
// Ctrl-C, as a shell reports a program it interrupted).
func (a *app) main(args []string) int {
	root := a.rootCommand()
	root.SetArgs(args)
	root.SetOut(a.stdout)
	root.SetErr(a.stderr)
	ctx, interrupted := interruptible()
	cmd, err := root.ExecuteContextC(ctx)
	if n := interrupted(); n != 0 {
		return 128 + n
	}
	return a.exit(err, cmd != nil && cmd.Annotations[faultExitsKey] != "")
}

// exit prints err, if any, and returns the exit code it asks for: an
// exitCode's, 200+F for the platform's fault F when faults exit so (the
// commands that run a command or make sandboxes: faultExits), else 1.
func (a *app) exit(err error, faults bool) int {
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
	if f := dsec.InfraFault(err); faults && f != dsec.FaultNone {
		fmt.Fprintf(a.stderr, "dsec: infrastructure fault (%s): %s\n", f, describe(err))
		return faultExit(f.Proto())
	}
	fmt.Fprintln(a.stderr, "dsec:", describe(err))
	return 1
}

// interruptible is a context that SIGINT or SIGTERM cancels, and a
// function that stops watching for them and returns the one that came (0
// for none). After the first, a second one ends the program at once, as
// if dsec did not handle them: a cleanup that hangs does not trap the user.
func interruptible() (context.Context, func() int) {
	ctx, cancel := context.WithCancel(context.Background())
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	var caught atomic.Int32
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case s := <-sigs:
			signal.Stop(sigs)
			caught.Store(int32(s.(syscall.Signal)))
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, func() int {
		signal.Stop(sigs)
		cancel()
		<-done
		return int(caught.Load())
	}
}

// describe turns an RPC error into plain words.
func describe(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		msg := ce.Message()
		// Only the client's own failure to reach the address is "cannot
		// reach dsecd": an apiserver that answers Unavailable naming a node
		// it cannot reach ("node e2 is unreachable (…: connect: connection
		// refused)") was reached, and its words say what is down.
		if ce.Code() == connect.CodeUnavailable && (dsec.Unreachable(err) || !connect.IsWireError(err) && strings.Contains(msg, "connect:")) {
			return "cannot reach dsecd (" + msg + "); is it running? (" + addrWhence(dsec.AddrFrom(err)) + ")"
		}
		// The server's message ends with its error kind in words ("…: not
		// found"); the code in brackets says it already.
		msg = strings.TrimSuffix(msg, ": "+strings.ReplaceAll(ce.Code().String(), "_", " "))
		return fmt.Sprintf("%s (%s)", msg, ce.Code())
	}
	return err.Error()
}

// addrWhence says where the address of an unreachable call came from.
func addrWhence(from string) string {
	switch from {
	case "":
		return "address from --addr, else $DSEC_ADDR, else " + dsec.DefaultAddr
	case dsec.DefaultAddr:
		return "the default address; --addr or $DSEC_ADDR name another"
	}
	return "address from " + from
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "dsec",
		Version:       version.String("dsec"),
		Short:         "dsec: elastic sandboxes for agentic RL and evaluation",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			c, err := dsec.Dial(a.addr, dsec.DialOptions{Token: a.token, TokenName: "--token", CAFile: a.caFile, AddrName: "--addr"})
			if err != nil {
				return err
			}
			a.c = c
			return nil
		},
	}
	root.SetVersionTemplate("{{.Version}}\n")
	root.PersistentFlags().StringVar(&a.addr, "addr", "", "dsecd or apiserver address, or a comma-separated list to fail over between: unix:///path, host:port, http://host:port or https://host:port (default $DSEC_ADDR, else "+dsec.DefaultAddr+")")
	root.PersistentFlags().StringVar(&a.token, "token", "", "bearer token (default $DSEC_TOKEN, else the file $DSEC_TOKEN_FILE, else "+dsec.DefaultTokenFile+" if readable)")
	root.PersistentFlags().StringVar(&a.caFile, "ca-file", "", "PEM bundle to verify https:// addresses with (default $DSEC_CA_FILE, else the system roots)")
	root.PersistentFlags().BoolVar(&a.json, "json", false, "print JSON for scripts")
	root.AddCommand(
		a.runCommand(), a.createCommand(), a.execCommand(), a.shellCommand(),
		a.lsCommand(), a.inspectCommand(), a.nodesCommand(), a.rmCommand(), a.pauseCommand(), a.resumeCommand(), a.timeoutCommand(), a.endPhaseCommand(), a.topCommand(), a.metricsCommand(), a.snapshotCommand(), a.forkCommand(), a.gradeCommand(), a.cpCommand(),
		a.psCommand(), a.attachCommand(), a.killCommand(),
		a.layerCommand(), a.envCommand(), a.benchCommand(), a.netCommand(), a.provenanceCommand(), a.imageCommand(), a.poolCommand(), a.fnCommand(), a.e2bCommand(),
		a.trajectoryCommand(), a.replayCommand(),
		a.projectCommand(), a.quotaCommand(), a.principalCommand(), a.grantCommand(), a.revokeCommand(), a.tokenCommand(), a.auditCommand(), a.eventsCommand(), a.usageCommand(), a.webhookCommand(),
		a.receiptCommand(),
	)
	root.SetFlagErrorFunc(flagError)
	// cobra adds these as it executes; added now, refuseUnknown sees them.
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	refuseUnknown(root)
	return root
}

// flagError adds to an unknown flag's error the command's flags nearest
// to it: --memory gets "did you mean --memory-mb?".
func flagError(cmd *cobra.Command, err error) error {
	name, ok := strings.CutPrefix(err.Error(), "unknown flag: --")
	if !ok {
		return err
	}
	var near []string
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if !f.Hidden && (strings.HasPrefix(f.Name, name) || strings.HasPrefix(name, f.Name) || editdist.Levenshtein(name, f.Name) <= 2) {
			near = append(near, "--"+f.Name)
		}
	})
	if len(near) == 0 {
		return err
	}
	return fmt.Errorf("%w (did you mean %s?)", err, strings.Join(near, " or "))
}

// refuseUnknown makes every command below c that holds subcommands refuse
// a word that is none of them: cobra prints a group's help and exits 0
// ("dsec image lst"), and hands a runnable parent the word as an argument.
// A group named alone prints its help.
func refuseUnknown(c *cobra.Command) {
	for _, sub := range c.Commands() {
		refuseUnknown(sub)
	}
	// The words other tools use for rm and ls are too far from them for
	// the edit distance ("remove" came out as "did you mean revoke?").
	switch c.Name() {
	case "rm":
		c.SuggestFor = append(c.SuggestFor, "delete", "remove", "del")
	case "ls":
		c.SuggestFor = append(c.SuggestFor, "list")
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
	if s := suggestionsFor(cmd, args[0]); len(s) > 0 {
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

// suggestionsFor is cobra's suggestions for a mistyped subcommand of cmd,
// those that name the word in their SuggestFor first: "remove" is nearer
// "revoke" by edit distance, but means rm.
func suggestionsFor(cmd *cobra.Command, typed string) []string {
	var named, near []string
	for _, s := range cmd.SuggestionsFor(typed) {
		if sub, _, err := cmd.Find([]string{s}); err == nil && slices.Contains(sub.SuggestFor, typed) {
			named = append(named, s)
		} else {
			near = append(near, s)
		}
	}
	return append(named, near...)
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
