package cli

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// projectLabel names the project a sandbox belongs to (docs/iam.md).
const projectLabel = "dsec.dev/project"

// specFlags are the sandbox settings run and create share.
type specFlags struct {
	cpus     float64
	memoryMB int64
	diskMB   int64
	pids     int64
	ttl      time.Duration
	idle     time.Duration
	user     string
	workdir  string
	hostname string
	env      []string
	sudo     bool
	// isolation is container, gvisor or microvm; "" = container.
	isolation string
	qos       string // latency or best_effort; "" = latency
	labels    []string
	project   string // the label dsec.dev/project; "" = the token's
	netRules  string
	// onTimeout and noAutoResume are lifecycle settings, not shape.
	onTimeout    string
	noAutoResume bool
	// Phase budgets: setup, agent, verify (docs/lifecycle.md).
	setupBudget, agentBudget, verifyBudget time.Duration
	// prov are the provenance paths, not shape.
	prov provFlags
}

func (f *specFlags) add(cmd *cobra.Command) {
	f.addShape(cmd)
	fl := cmd.Flags()
	fl.DurationVar(&f.ttl, "ttl", 0, "hard lifetime, e.g. 30m (default: the node's)")
	fl.DurationVar(&f.idle, "idle-timeout", 0, "stop after this long with no calls and nothing running (default: the node's)")
	fl.StringArrayVar(&f.labels, "label", nil, "label K=V (repeatable)")
	fl.StringVarP(&f.project, "project", "p", "", "the project the sandbox belongs to, a path (ml/rl-run-42, / for the root); the token needs runner there (default: the token's project; the label "+projectLabel+")")
	fl.StringVar(&f.netRules, "network-rules", "", `network rules as JSON, e.g. {"pypi": true}`)
	fl.StringVar(&f.onTimeout, "on-timeout", "", "what the TTL or idle timeout does: stop (default) or pause")
	fl.BoolVar(&f.noAutoResume, "no-auto-resume", false, "refuse calls while paused instead of resuming first")
	fl.DurationVar(&f.setupBudget, "setup-budget", 0, "phase budgets: the setup phase's, e.g. 2m (the TTL becomes the budgets' sum plus 30s)")
	fl.DurationVar(&f.agentBudget, "agent-budget", 0, "phase budgets: the agent phase's; its end kills every process in the sandbox (see dsec end-phase)")
	fl.DurationVar(&f.verifyBudget, "verify-budget", 0, "phase budgets: the verify phase's, reserved however the agent overran")
	f.prov.add(cmd)
}

// addShape adds the flags that make a sandbox's shape: everything but
// labels, lifetimes and network rules. Warm pools are keyed by it.
func (f *specFlags) addShape(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.Float64Var(&f.cpus, "cpus", 0, "CPU cores (fractional; default: the node's)")
	fl.Int64Var(&f.memoryMB, "memory-mb", 0, "memory limit in MiB (default: the node's)")
	fl.Int64Var(&f.diskMB, "disk-mb", 0, "writable-layer limit in MiB (default: the node's)")
	fl.Int64Var(&f.pids, "pids", 0, "process limit (default: the node's)")
	fl.StringVar(&f.user, "user", "", "default user for commands (name or uid[:gid])")
	fl.StringVar(&f.workdir, "workdir", "", "default working directory for commands")
	fl.StringVar(&f.hostname, "hostname", "", "host name inside the sandbox")
	fl.StringArrayVar(&f.env, "env", nil, "environment variable K=V for every command (repeatable)")
	fl.BoolVar(&f.sudo, "allow-privilege-escalation", false, "let setuid programs (sudo) raise privileges inside the sandbox")
	fl.StringVar(&f.isolation, "isolation", "", "what isolates the sandbox: container (default; runc), gvisor (runsc) or microvm (QEMU); dsec nodes lists what each node offers")
	fl.StringVar(&f.qos, "qos", "", "CPU class: latency (default) or best_effort (SCHED_IDLE: only CPU time latency sandboxes leave)")
}

func (f *specFlags) spec(env string) (*dsecv1.SandboxSpec, error) {
	envVars, err := parseKV("--env", f.env)
	if err != nil {
		return nil, err
	}
	labels, err := parseKV("--label", f.labels)
	if err != nil {
		return nil, err
	}
	if f.project != "" {
		if named, ok := labels[projectLabel]; ok && named != f.project {
			return nil, fmt.Errorf("--project %s and --label %s=%s: name the project once", f.project, projectLabel, named)
		}
		if labels == nil {
			labels = map[string]string{}
		}
		labels[projectLabel] = f.project
	}
	rules, err := parseRules("--network-rules", f.netRules)
	if err != nil {
		return nil, err
	}
	spec := &dsecv1.SandboxSpec{
		Environment: env, Cpus: f.cpus, MemoryMb: f.memoryMB, DiskMb: f.diskMB, Pids: f.pids,
		TtlSeconds: int64(f.ttl / time.Second), IdleTimeoutSeconds: int64(f.idle / time.Second),
		User: f.user, Workdir: f.workdir, Hostname: f.hostname, Env: envVars, Labels: labels,
		NetworkRules: rules, AllowPrivilegeEscalation: f.sudo, Qos: f.qos,
	}
	if spec.Isolation, err = parseIsolation(f.isolation); err != nil {
		return nil, err
	}
	switch f.onTimeout {
	case "", "stop":
	case "pause":
		spec.OnTimeout = dsecv1.OnTimeout_ON_TIMEOUT_PAUSE
	default:
		return nil, fmt.Errorf("--on-timeout %q: want stop or pause", f.onTimeout)
	}
	if f.noAutoResume {
		no := false
		spec.AutoResume = &no
	}
	if f.setupBudget != 0 || f.agentBudget != 0 || f.verifyBudget != 0 {
		spec.Phases = &dsecv1.PhaseBudgets{SetupSeconds: f.setupBudget.Seconds(), AgentSeconds: f.agentBudget.Seconds(), VerifySeconds: f.verifyBudget.Seconds()}
	}
	spec.Provenance = f.prov.paths()
	return spec, nil
}

// parseIsolation reads --isolation: container, gvisor or microvm, "" for
// the default (container).
func parseIsolation(s string) (dsecv1.Isolation, error) {
	if s == "" {
		return dsecv1.Isolation_ISOLATION_UNSPECIFIED, nil
	}
	v, ok := dsecv1.Isolation_value["ISOLATION_"+strings.ToUpper(s)]
	if !ok || v == 0 {
		return 0, fmt.Errorf("--isolation %q: want container, gvisor or microvm", s)
	}
	return dsecv1.Isolation(v), nil
}

// execFlags are the per-command settings of run and exec.
type execFlags struct {
	timeout time.Duration
	env     []string
	workdir string
	user    string
	stdin   bool
	shell   bool
}

func (f *execFlags) add(cmd *cobra.Command, withUserDir bool) {
	fl := cmd.Flags()
	fl.DurationVar(&f.timeout, "timeout", 0, "kill the command (and all it started) after this long; exit code 124")
	fl.BoolVarP(&f.stdin, "interactive", "i", false, "send this program's stdin to the command")
	fl.BoolVar(&f.shell, "sh", false, "run the arguments as one shell command line under the platform's static shell")
	if withUserDir {
		fl.StringArrayVarP(&f.env, "env", "e", nil, "environment variable K=V for this command only (repeatable)")
		// The name it had before exec took run's --env; kept for scripts.
		fl.StringArrayVar(&f.env, "exec-env", nil, "old name of --env")
		fl.MarkHidden("exec-env")
		fl.StringVarP(&f.workdir, "workdir", "w", "", "working directory")
		fl.StringVarP(&f.user, "user", "u", "", "user (name or uid[:gid])")
	}
}

// commandArgs checks the positional arguments of run and exec (WHAT then
// the command), saying what is missing rather than how many are.
func commandArgs(use, what string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		switch len(args) {
		case 0:
			return fmt.Errorf("name the %s and the command to run: dsec %s", what, use)
		case 1:
			return fmt.Errorf("no command to run in %s: dsec %s", args[0], strings.Replace(use, what, args[0], 1))
		}
		return nil
	}
}

// execRequest builds an exec request. With -i it keeps the command's stdin
// open, for this program's stdin to be streamed into it once it has started
// (see streamExec and exec -d).
func (a *app) execRequest(id string, f *execFlags, argv []string) (*dsecv1.ExecRequest, error) {
	env, err := parseKV("--env", f.env)
	if err != nil {
		return nil, err
	}
	req := &dsecv1.ExecRequest{SandboxId: id, Env: env, Cwd: f.workdir, User: f.user,
		TimeoutSeconds: f.timeout.Seconds()}
	if f.shell {
		req.Command = strings.Join(argv, " ")
	} else {
		req.Argv = argv
	}
	req.KeepStdinOpen = f.stdin
	return req, nil
}

// streamExec copies an exec stream to stdout and stderr and turns its end
// into the exit code convention of `dsec run` and `dsec exec`. A request
// that keeps stdin open gets this program's stdin, streamed in chunks once
// the command has started, so its size is not bounded by one request.
func (a *app) streamExec(ctx context.Context, req *dsecv1.ExecRequest) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := a.c.Sandboxes.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	defer stream.Close()
	end, err := a.copyEvents(stream, func(st *dsecv1.ExecStarted) {
		if req.GetKeepStdinOpen() {
			go a.pumpStdin(ctx, req.GetSandboxId(), st.GetProcessId())
		}
	})
	if err != nil {
		return err
	}
	if end.exited == nil {
		return fmt.Errorf("the command's stream ended without an exit status")
	}
	return end.err()
}

// streamEnd is what a stream of exec events came to: the exit (nil when
// the stream ended without one) and the output the stream did not carry.
type streamEnd struct {
	exited                 *dsecv1.ExecExited
	droppedOut, droppedErr int64
}

// copyEvents copies a stream of exec events to stdout and stderr until it
// ends, calling started (if set) at the start event, and returns how it
// ended.
func (a *app) copyEvents(stream *connect.ServerStreamForClient[dsecv1.ExecEvent], started func(*dsecv1.ExecStarted)) (streamEnd, error) {
	var end streamEnd
	var gotOut, gotErr int64
	for stream.Receive() {
		switch e := stream.Msg().Event.(type) {
		case *dsecv1.ExecEvent_Started:
			if started != nil {
				started(e.Started)
			}
		case *dsecv1.ExecEvent_Stdout:
			a.stdout.Write(e.Stdout)
			gotOut += int64(len(e.Stdout))
		case *dsecv1.ExecEvent_Stderr:
			a.stderr.Write(e.Stderr)
			gotErr += int64(len(e.Stderr))
		case *dsecv1.ExecEvent_Dropped:
			if e.Dropped.GetStderr() {
				end.droppedErr += e.Dropped.GetBytes()
			} else {
				end.droppedOut += e.Dropped.GetBytes()
			}
		case *dsecv1.ExecEvent_Exited:
			end.exited = e.Exited
		}
	}
	if x := end.exited; x != nil {
		if x.GetStdoutTruncated() {
			end.droppedOut = max(end.droppedOut, x.GetStdoutBytes()-gotOut)
		}
		if x.GetStderrTruncated() {
			end.droppedErr = max(end.droppedErr, x.GetStderrBytes()-gotErr)
		}
	}
	return end, stream.Err()
}

// err is the exit the stream's end asks for: the command's (exitFor), and
// never a success when output was dropped: a script must not take what it
// got for all the command wrote. Then the exit code is the command's if it
// failed, else 1, and the message says what is missing.
func (e streamEnd) err() error {
	var err error
	if e.exited != nil {
		err = exitFor(e.exited)
	}
	var missing []string
	if e.droppedOut > 0 {
		missing = append(missing, fmt.Sprintf("%d bytes of stdout", e.droppedOut))
	}
	if e.droppedErr > 0 {
		missing = append(missing, fmt.Sprintf("%d bytes of stderr", e.droppedErr))
	}
	if len(missing) == 0 {
		return err
	}
	note := "output dropped: this lacks " + strings.Join(missing, " and ") + " the command wrote: " +
		"they came while nothing read its output, past what the node keeps of it (dsecd --output-limit, 16 MiB a stream by default); " +
		"a stream that follows the command from its start (exec without -d) gets all of it"
	var ec *exitCode
	if errors.As(err, &ec) {
		if ec.msg != "" {
			note = ec.msg + "; " + note
		}
		return &exitCode{code: ec.code, msg: note}
	}
	return &exitCode{code: 1, msg: note}
}

// stdinChunk is how much of stdin one WriteStdin call carries.
const stdinChunk = 256 << 10

// pumpStdin copies this program's stdin into a command's, then closes the
// command's stdin. It stops quietly once the command no longer takes input
// (it exited, or closed its stdin): the exit status tells the rest.
func (a *app) pumpStdin(ctx context.Context, sandboxID, processID string) {
	buf := make([]byte, stdinChunk)
	for {
		n, rerr := a.stdin.Read(buf)
		if n > 0 {
			if _, err := a.c.Sandboxes.WriteStdin(ctx, connect.NewRequest(&dsecv1.WriteStdinRequest{
				SandboxId: sandboxID, ProcessId: processID, Data: buf[:n]})); err != nil {
				return
			}
		}
		if rerr != nil {
			a.c.Sandboxes.WriteStdin(ctx, connect.NewRequest(&dsecv1.WriteStdinRequest{
				SandboxId: sandboxID, ProcessId: processID, Close: true}))
			return
		}
	}
}

// exitFor maps a command's end onto this program's exit: its own code, 124
// on timeout, 137 when OOM-killed, 128+N when killed by signal N, 200+F
// when the platform's fault F ended it (faultExit). What the
// stream missed of its output is streamEnd.err's to say.
func exitFor(x *dsecv1.ExecExited) error {
	if f := x.GetFault(); f != dsecv1.Fault_FAULT_UNSPECIFIED {
		return faultErr(f, "command "+x.GetMessage())
	}
	switch x.GetStatus() {
	case dsecv1.ExitStatus_EXIT_STATUS_OK:
		return nil
	case dsecv1.ExitStatus_EXIT_STATUS_NONZERO:
		return &exitCode{code: int(x.GetExitCode())}
	case dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT:
		return &exitCode{code: 124, msg: fmt.Sprintf("command timed out after %.1fs and was killed with everything it started", x.GetDurationSeconds())}
	case dsecv1.ExitStatus_EXIT_STATUS_OOM:
		msg := x.GetMessage()
		if msg == "" {
			msg = "killed by the OOM killer"
		}
		return &exitCode{code: 137, msg: "command was OOM-killed: " + msg}
	case dsecv1.ExitStatus_EXIT_STATUS_KILLED:
		return &exitCode{code: 128 + int(x.GetSignal()), msg: fmt.Sprintf("command was killed by signal %d", x.GetSignal())}
	case dsecv1.ExitStatus_EXIT_STATUS_START_ERROR:
		// The agent's message says "could not start: <why>" already.
		msg := x.GetMessage()
		if !strings.HasPrefix(msg, "could not start") {
			msg = "could not start: " + msg
		}
		return &exitCode{code: 127, msg: "command " + msg}
	}
	return &exitCode{code: 1, msg: "command ended with an unknown status: " + x.GetMessage()}
}

func (a *app) create(ctx context.Context, spec *dsecv1.SandboxSpec, count int) ([]*dsecv1.Sandbox, error) {
	resp, err := a.c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{
		Spec: spec, Count: int32(count), IdempotencyKey: uuid.NewString(),
	}))
	if err != nil {
		return nil, err
	}
	sbs := resp.Msg.GetSandboxes()
	// A batch has one spec, so its sandboxes share their warnings.
	var warnings []string
	for _, sb := range sbs {
		warnings = append(warnings, sb.GetWarnings()...)
	}
	a.warn(warnings)
	return sbs, nil
}

// warn prints what the node warned about to stderr, each warning once, so
// that stdout keeps only the command's result.
func (a *app) warn(warnings []string) {
	seen := map[string]bool{}
	for _, w := range warnings {
		if !seen[w] {
			seen[w] = true
			fmt.Fprintln(a.stderr, "dsec: warning:", w)
		}
	}
}

func (a *app) runCommand() *cobra.Command {
	var sf specFlags
	var ef execFlags
	cmd := &cobra.Command{
		Use:         "run [flags] ENV [--] CMD [ARGS...]",
		Short:       "create a sandbox, run one command in it, delete it; exits with the command's code",
		Annotations: faultExits,
		Args: func(cmd *cobra.Command, args []string) error {
			return commandArgs("run ENV -- CMD [ARGS...]", "ENV")(cmd, execArgs(args))
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			args = execArgs(args)
			ctx := cmd.Context()
			spec, err := sf.spec(args[0])
			if err != nil {
				return err
			}
			sbs, err := a.create(ctx, spec, 1)
			if err != nil {
				return err
			}
			id := sbs[0].GetId()
			defer func() {
				dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
				defer cancel()
				if _, err := a.c.Sandboxes.Delete(dctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id})); err != nil {
					fmt.Fprintf(a.stderr, "dsec: delete %s: %s\n", id, describe(err))
				}
			}()
			req, err := a.execRequest(id, &ef, args[1:])
			if err != nil {
				return err
			}
			return a.streamExec(ctx, req)
		},
	}
	sf.add(cmd)
	ef.add(cmd, false)
	// Flags end at the environment, as docker run's do at the image:
	// dsec run ENV ls -la.
	cmd.Flags().SetInterspersed(false)
	return cmd
}

func (a *app) createCommand() *cobra.Command {
	var sf specFlags
	var count int
	cmd := &cobra.Command{
		Use:         "create [flags] ENV",
		Short:       "create sandboxes and print their IDs",
		Annotations: faultExits,
		Args:        cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			spec, err := sf.spec(args[0])
			if err != nil {
				return err
			}
			sbs, err := a.create(cmd.Context(), spec, count)
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(&dsecv1.CreateResponse{Sandboxes: sbs})
			}
			for _, sb := range sbs {
				fmt.Fprintln(a.stdout, sb.GetId())
			}
			return nil
		},
	}
	sf.add(cmd)
	cmd.Flags().IntVarP(&count, "count", "n", 1, "how many sandboxes (one batch, all or none)")
	return cmd
}

func (a *app) execCommand() *cobra.Command {
	var ef execFlags
	var background bool
	var tag string
	cmd := &cobra.Command{
		Use:         "exec [flags] ID [--] CMD [ARGS...]",
		Short:       "run a command in a sandbox, streaming its output; exits with its code",
		Annotations: faultExits,
		Args: func(cmd *cobra.Command, args []string) error {
			return commandArgs("exec ID -- CMD [ARGS...]", "ID")(cmd, execArgs(args))
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			args = execArgs(args)
			req, err := a.execRequest(args[0], &ef, args[1:])
			if err != nil {
				return err
			}
			if !background {
				return a.streamExec(cmd.Context(), req)
			}
			req.Background, req.Tag = true, tag
			stream, err := a.c.Sandboxes.Exec(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			defer stream.Close()
			for stream.Receive() {
				// A command that could not start ends its stream with its
				// exit and no start: say why, as the foreground exec does.
				if x := stream.Msg().GetExited(); x != nil {
					return exitFor(x)
				}
				if st := stream.Msg().GetStarted(); st != nil {
					if req.GetKeepStdinOpen() {
						// -i: all of stdin goes in before the process ID is
						// printed, so a script can rely on it being there.
						a.pumpStdin(cmd.Context(), req.GetSandboxId(), st.GetProcessId())
					}
					if a.json {
						return a.printProto(st)
					}
					fmt.Fprintln(a.stdout, st.GetProcessId())
					return nil
				}
			}
			if err := stream.Err(); err != nil {
				return err
			}
			return fmt.Errorf("the background command did not start")
		},
	}
	ef.add(cmd, true)
	cmd.Flags().BoolVarP(&background, "detach", "d", false, "run in the background and print its process ID (see dsec ps, attach, kill)")
	cmd.Flags().StringVar(&tag, "tag", "", "name for a background command")
	// Flags end at the ID, as docker exec's do: dsec exec ID ls -la.
	cmd.Flags().SetInterspersed(false)
	return cmd
}

// execArgs is exec's ID (run's environment) and command, without the "--"
// that may stand between them (flags end at the ID, so the parser keeps
// it).
func execArgs(args []string) []string {
	if len(args) > 1 && args[1] == "--" {
		return append(args[:1:1], args[2:]...)
	}
	return args
}

func (a *app) lsCommand() *cobra.Command {
	var labels []string
	var states []string
	var project string
	var all bool
	var pageSize int32
	var pageToken string
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "list live sandboxes (--all: stopped and failed ones too, while the node keeps them)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			lm, err := parseKV("--label", labels)
			if err != nil {
				return err
			}
			req := &dsecv1.ListRequest{Labels: lm}
			rootOnly := false
			if project != "" {
				if named, ok := lm[projectLabel]; ok {
					return fmt.Errorf("--project %s and --label %s=%s: name the project once", project, projectLabel, named)
				}
				// The root's own sandboxes carry no label, which List
				// cannot ask for: they are kept here.
				if p := strings.Trim(project, "/"); p == "" {
					rootOnly = true
				} else {
					if req.Labels == nil {
						req.Labels = map[string]string{}
					}
					req.Labels[projectLabel] = p
				}
			}
			for _, s := range states {
				v, ok := dsecv1.State_value["STATE_"+strings.ToUpper(s)]
				if !ok || v == 0 {
					return fmt.Errorf("--state %q: want creating, running, stopping, stopped or failed", s)
				}
				req.States = append(req.States, dsecv1.State(v))
			}
			if len(req.States) > 0 && all {
				return fmt.Errorf("--all and --state: name one")
			}
			req.All = all
			if rootOnly && (pageSize != 0 || pageToken != "") {
				return fmt.Errorf("--project / and --page-size: the root's own sandboxes are listed whole (List cannot select them, so its pages would hold others)")
			}
			req.PageSize, req.PageToken = pageSize, pageToken
			resp, err := a.c.Sandboxes.List(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			if rootOnly {
				var own []*dsecv1.Sandbox
				for _, sb := range resp.Msg.GetSandboxes() {
					if sb.GetSpec().GetLabels()[projectLabel] == "" {
						own = append(own, sb)
					}
				}
				resp.Msg.Sandboxes = own
			}
			if a.json {
				return a.printProto(resp.Msg)
			}
			if down := resp.Msg.GetUnreachableNodes(); len(down) > 0 {
				defer fmt.Fprintf(a.stderr, "dsec: %s unreachable: %s sandboxes are not listed (dsec nodes)\n", nodesAre(down), pronoun(len(down)))
			}
			if next := resp.Msg.GetNextPageToken(); next != "" {
				defer fmt.Fprintf(a.stderr, "%d of %d shown; the next page: --page-token %s\n", len(resp.Msg.GetSandboxes()), resp.Msg.GetTotal(), next)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tSTATE\tPROJECT\tISOLATION\tQOS\tENVIRONMENT\tAGE\tREASON")
			for _, sb := range resp.Msg.GetSandboxes() {
				age := time.Since(time.UnixMilli(sb.GetCreatedUnixMs())).Round(time.Second)
				reason := ""
				if sb.GetReason() != dsecv1.Reason_REASON_UNSPECIFIED {
					reason = strings.ToLower(strings.TrimPrefix(sb.GetReason().String(), "REASON_"))
				}
				qos := sb.GetSpec().GetQos()
				if qos == "" {
					qos = "latency" // the default (docs/qos.md)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", sb.GetId(), strings.ToLower(strings.TrimPrefix(sb.GetState().String(), "STATE_")),
					displayPath(sb.GetSpec().GetLabels()[projectLabel]), lowerEnum(sb.GetSpec().GetIsolation().String(), "ISOLATION_", "container"), qos,
					sb.GetSpec().GetEnvironment(), age, reason)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringArrayVar(&labels, "label", nil, "only sandboxes with label K=V (repeatable)")
	cmd.Flags().StringVarP(&project, "project", "p", "", "only the sandboxes of this project itself (/ for the root's own), not of those under it")
	cmd.Flags().StringArrayVar(&states, "state", nil, "only sandboxes in this state (repeatable): creating, running, stopping, stopped, failed")
	cmd.Flags().BoolVarP(&all, "all", "a", false, "also list stopped and failed sandboxes (kept for the node's retention period)")
	cmd.Flags().Int32Var(&pageSize, "page-size", 0, "at most this many sandboxes, newest first (at most 1000); the next page's token goes to stderr")
	cmd.Flags().StringVar(&pageToken, "page-token", "", "the page after an earlier --page-size listing's")
	return cmd
}

// nodesAre names nodes as the subject of a sentence: "node e1 is",
// "nodes e1, e2 are".
func nodesAre(names []string) string {
	if len(names) == 1 {
		return "node " + names[0] + " is"
	}
	return "nodes " + strings.Join(names, ", ") + " are"
}

// pronoun is "its" for one, "their" for more.
func pronoun(n int) string {
	if n == 1 {
		return "its"
	}
	return "their"
}

func (a *app) inspectCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "inspect ID",
		Short: "print a sandbox's record as JSON",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := a.c.Sandboxes.Get(cmd.Context(), connect.NewRequest(&dsecv1.GetRequest{Id: args[0]}))
			if err != nil {
				return err
			}
			return a.printProto(resp.Msg)
		},
	}
}

// liveStates are the states of a sandbox that holds resources.
var liveStates = []dsecv1.State{dsecv1.State_STATE_CREATING, dsecv1.State_STATE_RUNNING,
	dsecv1.State_STATE_PAUSING, dsecv1.State_STATE_PAUSED, dsecv1.State_STATE_RESUMING}

// selectIDs is the sandboxes a command names: its arguments, or with
// --label every sandbox in one of states whose labels match.
func (a *app) selectIDs(ctx context.Context, args, labels []string, states []dsecv1.State) ([]string, error) {
	if len(labels) == 0 {
		if len(args) == 0 {
			return nil, fmt.Errorf("name sandbox IDs or --label")
		}
		return args, nil
	}
	if len(args) > 0 {
		return nil, fmt.Errorf("name sandbox IDs or --label, not both")
	}
	lm, err := parseKV("--label", labels)
	if err != nil {
		return nil, err
	}
	resp, err := a.c.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{Labels: lm, States: states}))
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, sb := range resp.Msg.GetSandboxes() {
		ids = append(ids, sb.GetId())
	}
	return ids, nil
}

func (a *app) rmCommand() *cobra.Command {
	var labels []string
	cmd := &cobra.Command{
		Use:   "rm ID... | rm --label K=V",
		Short: "delete sandboxes",
		RunE: func(cmd *cobra.Command, args []string) error {
			ids, err := a.selectIDs(cmd.Context(), args, labels, liveStates)
			if err != nil {
				return err
			}
			failed := 0
			deleted := []string{}
			for _, id := range ids {
				if _, err := a.c.Sandboxes.Delete(cmd.Context(), connect.NewRequest(&dsecv1.DeleteRequest{Id: id})); err != nil {
					fmt.Fprintf(a.stderr, "dsec: delete %s: %s\n", id, describe(err))
					failed++
					continue
				}
				deleted = append(deleted, id)
				if !a.json {
					fmt.Fprintln(a.stdout, id)
				}
			}
			if a.json {
				if err := a.printJSON(map[string][]string{"deleted": deleted}); err != nil {
					return err
				}
			}
			if failed > 0 {
				return &exitCode{code: 1}
			}
			return nil
		},
	}
	cmd.Flags().StringArrayVar(&labels, "label", nil, "delete every live sandbox with label K=V (repeatable)")
	return cmd
}
