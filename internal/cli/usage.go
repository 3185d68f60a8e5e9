package cli

import (
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (a *app) timeoutCommand() *cobra.Command {
	var extendOnly bool
	cmd := &cobra.Command{
		Use:   "timeout ID DURATION",
		Short: "end a sandbox's TTL DURATION from now (e.g. 10m), later or sooner",
		Long: `Timeout moves a running sandbox's TTL end to DURATION from now, later or
sooner (0 ends it at once); with --extend-only an end further away stays. A
paused sandbox gets DURATION of running time once resumed. Prints the new end.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			d, err := time.ParseDuration(args[1])
			if err != nil || d < 0 {
				return fmt.Errorf("duration %q: want a Go duration such as 90s or 10m, not negative", args[1])
			}
			resp, err := a.c.Sandboxes.SetTimeout(cmd.Context(), connect.NewRequest(&dsecv1.SetTimeoutRequest{
				SandboxId: args[0], TimeoutSeconds: int64(d / time.Second), ExtendOnly: extendOnly}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(resp.Msg.GetSandbox())
			}
			end := time.UnixMilli(resp.Msg.GetSandbox().GetExpiresUnixMs())
			fmt.Fprintf(a.stdout, "%s ends at %s (in %s)\n", args[0], end.Format(time.RFC3339), time.Until(end).Round(time.Second))
			return nil
		},
	}
	cmd.Flags().BoolVar(&extendOnly, "extend-only", false, "never move the end sooner")
	return cmd
}

func (a *app) endPhaseCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "end-phase ID setup|agent",
		Short: "end a sandbox's setup or agent phase now (the agent phase's end kills every process in it)",
		Long: `End-phase ends the named phase of a sandbox made with phase budgets
(create --setup-budget, --agent-budget, --verify-budget) now, as its budget
running out would: setup gives way to agent, agent to verify. The end of the
agent phase kills every process running in the sandbox (what the agent left
behind), not the sandbox. A phase already over is left alone. Prints the
phase the sandbox is in and when it ends.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, ok := dsecv1.Phase_value["PHASE_"+strings.ToUpper(args[1])]
			if !ok || (args[1] != "setup" && args[1] != "agent") {
				return fmt.Errorf("phase %q: want setup or agent", args[1])
			}
			resp, err := a.c.Sandboxes.EndPhase(cmd.Context(), connect.NewRequest(&dsecv1.EndPhaseRequest{SandboxId: args[0], Phase: dsecv1.Phase(p)}))
			if err != nil {
				return err
			}
			sb := resp.Msg.GetSandbox()
			if a.json {
				return a.printProto(sb)
			}
			phase := strings.ToLower(strings.TrimPrefix(sb.GetPhase().String(), "PHASE_"))
			if ends := sb.GetPhaseEndsUnixMs(); ends > 0 {
				end := time.UnixMilli(ends)
				fmt.Fprintf(a.stdout, "%s is in its %s phase, which ends at %s (in %s)\n", args[0], phase, end.Format(time.RFC3339), time.Until(end).Round(time.Second))
				return nil
			}
			fmt.Fprintf(a.stdout, "%s is in its %s phase\n", args[0], phase)
			return nil
		},
	}
}

func (a *app) topCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "top ID...",
		Short: "a sandbox's CPU, memory and disk use now, with its limits",
		Long: `Top reads each sandbox's resource use now: CPU in percent of its cores (over
the time since the previous reading, or 100 ms), memory (page cache
included) from its cgroup, and its writable layer's disk use, each against
its limit (the node's when it has none of its own).`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			tw := tabwriter.NewWriter(a.stdout, 0, 2, 2, ' ', 0)
			if !a.json {
				fmt.Fprintln(tw, "ID\tCPU\tCORES\tMEMORY\tDISK")
			}
			for _, id := range args {
				resp, err := a.c.Sandboxes.Metrics(cmd.Context(), connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: id}))
				if err != nil {
					return err
				}
				m := resp.Msg
				if a.json {
					if err := a.printProto(m); err != nil {
						return err
					}
					continue
				}
				fmt.Fprintf(tw, "%s\t%.1f%%\t%g\t%s / %s\t%s / %s\n", id, m.GetCpuUsedPct(), m.GetCpuCount(),
					humanBytes(m.GetMemoryUsedBytes()), humanBytes(m.GetMemoryLimitBytes()),
					humanBytes(m.GetDiskUsedBytes()), humanBytes(m.GetDiskLimitBytes()))
			}
			return tw.Flush()
		},
	}
}

func (a *app) metricsCommand() *cobra.Command {
	var since string
	cmd := &cobra.Command{
		Use:   "metrics ID",
		Short: "a sandbox's CPU, memory, disk and network use over the last minutes, as its node sampled them",
		Long: `Metrics prints the samples of a sandbox's use its node kept: one a
--ledger-interval of its dsecd (10 s), the last 10 minutes of them at most,
while the sandbox lives. Each gives the CPU it used since the sample before
(in cores), its memory (page cache included) against its limit, its
writable layer, and the bytes it sent out since it started. --since
(a duration ago, e.g. 2m, or RFC 3339) prints only the later ones; --json
prints the reading now and the samples (docs/operations.md).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			from := time.Now().Add(-time.Hour)
			if since != "" {
				t, err := pointInTime(since, time.Now())
				if err != nil {
					return fmt.Errorf("--since: %w", err)
				}
				from = t
			}
			resp, err := a.c.Sandboxes.Metrics(cmd.Context(), connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: args[0], SinceUnixMs: max(from.UnixMilli(), 1)}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(resp.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 2, 2, ' ', 0)
			fmt.Fprintln(tw, "TIME\tCPU (CORES)\tMEMORY\tDISK\tSENT")
			for _, s := range resp.Msg.GetSamples() {
				fmt.Fprintf(tw, "%s\t%.2f\t%s / %s\t%s\t%s\n", time.UnixMilli(s.GetTimeUnixMs()).Format(time.TimeOnly), s.GetCpuUsedCores(),
					humanBytes(s.GetMemoryUsedBytes()), humanBytes(s.GetMemoryLimitBytes()), humanBytes(s.GetDiskUsedBytes()), humanBytes(s.GetNetEgressBytes()))
			}
			if len(resp.Msg.GetSamples()) == 0 {
				fmt.Fprintln(a.stderr, "no samples kept yet: the node samples every --ledger-interval (none with --no-ledger)")
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVar(&since, "since", "", "only samples after: a duration ago (2m) or RFC 3339")
	return cmd
}
