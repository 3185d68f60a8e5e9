package cli

import (
	"encoding/json"
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
			if a.json {
				return a.printProto(res.Msg)
			}
			for _, w := range res.Msg.GetWarnings() {
				fmt.Fprintln(a.stderr, "warning:", w)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&cut, "cut", false, "also break established connections the new rules no longer allow")
	return cmd
}

// netEvent is one audit record as scripts see it.
type netEvent struct {
	Time        time.Time `json:"time"`
	Kind        string    `json:"kind"`
	Verdict     string    `json:"verdict"`
	Protocol    string    `json:"protocol,omitempty"`
	Destination string    `json:"destination,omitempty"`
	Port        int32     `json:"port,omitempty"`
	Name        string    `json:"name,omitempty"`
	BytesOut    int64     `json:"bytes_out,omitempty"`
	BytesIn     int64     `json:"bytes_in,omitempty"`
	Rule        string    `json:"rule,omitempty"`
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
			events := make([]netEvent, 0, len(res.Msg.GetEvents()))
			for _, e := range res.Msg.GetEvents() {
				events = append(events, netEvent{
					Time: time.UnixMilli(e.GetTimeUnixMs()).UTC(), Kind: e.GetKind(), Verdict: e.GetVerdict(),
					Protocol: e.GetProtocol(), Destination: e.GetDestination(), Port: e.GetPort(), Name: e.GetName(),
					BytesOut: e.GetBytesOut(), BytesIn: e.GetBytesIn(), Rule: e.GetRule(),
				})
			}
			if a.json {
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(map[string]any{"sandbox_id": args[0], "events": events})
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "TIME\tKIND\tVERDICT\tPROTO\tDESTINATION\tNAME\tBYTES OUT/IN\tRULE")
			for _, e := range events {
				dest := e.Destination
				if e.Port != 0 {
					dest = fmt.Sprintf("%s:%d", dest, e.Port)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d/%d\t%s\n", e.Time.Format("15:04:05.000"), e.Kind, e.Verdict,
					e.Protocol, dest, e.Name, e.BytesOut, e.BytesIn, e.Rule)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().DurationVar(&since, "since", 0, "only records newer than this, e.g. 5m")
	cmd.Flags().Int32Var(&limit, "limit", 0, "at most this many records (default 1000)")
	return cmd
}
