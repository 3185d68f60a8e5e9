package cli

import (
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (a *app) nodesCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "nodes",
		Short: "list the nodes, the isolations each offers (container, gvisor, microvm) and why it lacks the others, and whether latency sandboxes get core scheduling",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := a.c.Sandboxes.GetServerInfo(cmd.Context(), connect.NewRequest(&dsecv1.GetServerInfoRequest{}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(resp.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NODE\tHEALTHY\tLIVE\tOFFERS\tLACKS\tCORE SCHEDULING")
			for _, n := range resp.Msg.GetNodes() {
				fmt.Fprintf(tw, "%s\t%v\t%d/%d\t%s\t%s\t%s\n", n.GetName(), n.GetHealthy(), n.GetLive(), n.GetMaxSandboxes(),
					kindsText(n.GetKinds()), missingText(n.GetMissing()), coreSchedText(n.GetCoreScheduling()))
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			for _, n := range resp.Msg.GetNodes() {
				if !n.GetHealthy() {
					fmt.Fprintf(a.stderr, "dsec: node %s is unreachable: %s\n", n.GetName(), unreachableText(n, time.Now()))
				}
			}
			return nil
		},
	}
}

// unreachableText says of an unhealthy node when it last answered and why
// it does not now: "last answered 12s ago, its LIVE as of then (dial tcp
// …: connection refused)".
func unreachableText(n *dsecv1.NodeInfo, now time.Time) string {
	s := "it has not answered since the apiserver started"
	if ms := n.GetLastSeenUnixMs(); ms > 0 {
		s = fmt.Sprintf("last answered %s ago, its LIVE as of then", now.Sub(time.UnixMilli(ms)).Round(time.Second))
	}
	if r := n.GetUnreachableReason(); r != "" {
		s += " (" + r + ")"
	}
	return s
}

// kindsText is a node's kinds as "container, container/fncall,
// gvisor (systrap)".
func kindsText(ks []*dsecv1.SandboxKind) string {
	var out []string
	for _, k := range ks {
		s := lowerEnum(k.GetIsolation().String(), "ISOLATION_", "container")
		if p := k.GetProfile(); p == dsecv1.Backend_BACKEND_FNCALL {
			s += "/fncall"
		}
		if acc := k.GetAccelerator(); acc != "" {
			s += " (" + acc + ")"
		}
		out = append(out, s)
	}
	return strings.Join(out, ", ")
}

// coreSchedText is a node's core-scheduling report: "yes", "no: REASON",
// "-" when the node did not say.
func coreSchedText(cs *dsecv1.CoreScheduling) string {
	switch {
	case cs == nil:
		return "-"
	case cs.GetAvailable():
		return "yes"
	}
	return "no: " + cs.GetReason()
}

// missingText is why a node lacks each isolation it lacks, "-" for none.
func missingText(m map[string]string) string {
	if len(m) == 0 {
		return "-"
	}
	var out []string
	for name, why := range m {
		out = append(out, name+": "+why)
	}
	slices.Sort(out)
	return strings.Join(out, "; ")
}

// lowerEnum is an enum value's name without prefix, in lower case; def for
// its unspecified value.
func lowerEnum(name, prefix, def string) string {
	s := strings.ToLower(strings.TrimPrefix(name, prefix))
	if s == "unspecified" {
		return def
	}
	return s
}
