package cli

import (
	"fmt"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (a *app) netCommand() *cobra.Command {
	cmd := &cobra.Command{Use: "net", Short: "change a sandbox's network rules and read its network audit log"}
	cmd.AddCommand(a.netSetCommand(), a.netLogCommand())
	return cmd
}

func (a *app) netSetCommand() *cobra.Command {
	var cut bool
	cmd := &cobra.Command{
		Use:   "set ID JSON",
		Short: `replace a running sandbox's network rules, e.g. dsec net set ID '{"pypi": true}'`,
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			rules, err := parseRules("rules", args[1])
			if err != nil {
				return err
			}
			if rules == nil {
				rules = map[string]bool{}
			}
			res, err := a.c.Sandboxes.SetNetworkRules(cmd.Context(), connect.NewRequest(&dsecv1.SetNetworkRulesRequest{
				SandboxId: args[0], Rules: rules, Cut: cut,
			}))
			if err != nil {
				return err
			}
			a.warn(res.Msg.GetWarnings())
			if a.json {
				return a.printProto(res.Msg)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&cut, "cut", false, "also break established connections the new rules no longer allow")
	return cmd
}

func (a *app) netLogCommand() *cobra.Command {
	var since time.Duration
	var limit int32
	cmd := &cobra.Command{
		Use:   "log ID",
		Short: "print a sandbox's network audit records: every connection attempt and DNS query, allowed or denied",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.NetworkLogRequest{SandboxId: args[0], Limit: limit}
			if since > 0 {
				req.SinceUnixMs = time.Now().Add(-since).UnixMilli()
			}
			res, err := a.c.Sandboxes.NetworkLog(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "TIME\tKIND\tVERDICT\tPROTO\tDESTINATION\tNAME\tBYTES OUT/IN\tRULE")
			for _, e := range res.Msg.GetEvents() {
				dest := e.GetDestination()
				if e.GetPort() != 0 {
					dest = fmt.Sprintf("%s:%d", dest, e.GetPort())
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d/%d\t%s\n", time.UnixMilli(e.GetTimeUnixMs()).UTC().Format("15:04:05.000"),
					e.GetKind(), e.GetVerdict(), e.GetProtocol(), dest, e.GetName(), e.GetBytesOut(), e.GetBytesIn(), e.GetRule())
			}
			return tw.Flush()
		},
	}
	cmd.Flags().DurationVar(&since, "since", 0, "only records newer than this, e.g. 5m")
	cmd.Flags().Int32Var(&limit, "limit", 0, "at most this many records (default 1000)")
	return cmd
}
