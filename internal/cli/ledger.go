package cli

import (
	"encoding/csv"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (a *app) usageCommand() *cobra.Command {
	var project, by, since, until string
	var csvOut bool
	cmd := &cobra.Command{
		Use:   "usage",
		Short: "show what the sandboxes of a project (default: the token's) and under it used, by project, sandbox, node or label:KEY (the cost ledger)",
		Long: `Usage adds up the cost ledger (docs/usage.md): CPU-seconds, memory
GiB-seconds, disk GiB-hours (the writable layer), the writable layer's
largest size, snapshot bytes, egress bytes and FnCall calls of the sandboxes
of a project and the projects under it, deleted ones included, grouped by
--by: project (the default), sandbox, node, or label:KEY (label:run,
label:task…: what one run or task cost; sandboxes without the label sum
under "-"; by project, the root's own sandboxes show as "/"). --since and --until select the sandboxes alive in that window
(each counts whole). A table, --csv one line per group with a header, or
--json one UsageResponse.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.UsageRequest{Project: optional(project), By: by}
			now := time.Now()
			if since != "" {
				t, err := pointInTime(since, now)
				if err != nil {
					return fmt.Errorf("--since: %w", err)
				}
				req.SinceUnixMs = t.UnixMilli()
			}
			if until != "" {
				t, err := pointInTime(until, now)
				if err != nil {
					return fmt.Errorf("--until: %w", err)
				}
				req.UntilUnixMs = t.UnixMilli()
			}
			res, err := a.c.Sandboxes.Usage(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			out := res.Msg
			if a.json {
				return a.printProto(out)
			}
			header := []string{usageKeyHeader(out.GetBy()), "SANDBOXES", "CPU_S", "MEM_GIB_S", "DISK_GIB_H", "DISK_PEAK_BYTES", "SNAPSHOT_BYTES", "EGRESS_BYTES", "FNCALL_CALLS"}
			rows := make([][]string, 0, len(out.GetGroups())+1)
			for _, g := range out.GetGroups() {
				rows = append(rows, usageCells(usageKey(out.GetBy(), g.GetKey()), g.GetUsage()))
			}
			if csvOut {
				w := csv.NewWriter(a.stdout)
				w.Write(header)
				w.WriteAll(rows)
				return w.Error()
			}
			rows = append(rows, usageCells("TOTAL", out.GetTotal()))
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			for i, h := range header {
				if i > 0 {
					fmt.Fprint(tw, "\t")
				}
				fmt.Fprint(tw, h)
			}
			fmt.Fprintln(tw)
			for _, r := range rows {
				for i, c := range r {
					if i > 0 {
						fmt.Fprint(tw, "\t")
					}
					fmt.Fprint(tw, c)
				}
				fmt.Fprintln(tw)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVarP(&project, "project", "p", "", "the project, with everything under it (default: the token's project)")
	cmd.Flags().StringVar(&by, "by", "project", "group by project, sandbox, node or label:KEY")
	cmd.Flags().StringVar(&since, "since", "", "sandboxes alive since: a duration ago (1h, 7d) or RFC 3339")
	cmd.Flags().StringVar(&until, "until", "", "sandboxes started before: a duration ago or RFC 3339")
	cmd.Flags().BoolVar(&csvOut, "csv", false, "print CSV: a header, then a line per group")
	return cmd
}

// usageKeyHeader heads the groups' column: PROJECT, LABEL:RUN…
func usageKeyHeader(by string) string {
	if by == "" {
		by = "project"
	}
	return strings.ToUpper(by)
}

// usageKey is a group's key as the table and CSV show it: the root
// project as "/", as every other command shows it; a group without the
// label (or node) as "-".
func usageKey(by, key string) string {
	if by == "" || by == "project" {
		return displayPath(key)
	}
	if key == "" {
		return "-"
	}
	return key
}

// usageCells is one group's figures as text: CPU in seconds, the rest as
// the ledger keeps them.
func usageCells(key string, u *dsecv1.UsageFigures) []string {
	return []string{key, strconv.FormatInt(u.GetSandboxes(), 10),
		strconv.FormatFloat(float64(u.GetCpuUsec())/1e6, 'f', 3, 64),
		strconv.FormatFloat(u.GetMemoryGibSeconds(), 'f', 3, 64),
		strconv.FormatFloat(u.GetDiskGibHours(), 'f', 6, 64),
		strconv.FormatInt(u.GetDiskPeakBytes(), 10),
		strconv.FormatInt(u.GetSnapshotBytes(), 10),
		strconv.FormatInt(u.GetEgressBytes(), 10),
		strconv.FormatInt(u.GetFncallCalls(), 10)}
}
