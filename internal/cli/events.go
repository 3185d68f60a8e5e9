package cli

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	pb "google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/pbjson"
)

// eventsPage is the server's page of ListEvents.
const eventsPage = 1000

func (a *app) eventsCommand() *cobra.Command {
	var project, since, sandbox string
	var kinds []string
	var after int64
	var limit int32
	var follow bool
	cmd := &cobra.Command{
		Use:   "events",
		Short: "show the lifecycle events of the sandboxes of a project (default: the token's) and under it; --follow waits for new ones",
		Long: `Print sandboxes' lifecycle events (created, paused, resumed, phase_ended,
forked, snapshot, deleted, expired, failed with its reason), oldest first,
as a table, or with --json one ListEventsResponse ({"events": [...], "next":
CURSOR}); with --follow, after those, each new event as it comes (about a
second after its node saw it), until interrupted: a line each, with --json
one Event object a line. --after CURSOR starts after an event's ID.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.ListEventsRequest{Project: optional(project), After: after, SandboxId: sandbox, Kinds: kinds, Limit: limit}
			if since != "" {
				t, err := pointInTime(since, time.Now())
				if err != nil {
					return fmt.Errorf("--since: %w", err)
				}
				req.SinceUnixMs = t.UnixMilli()
			}
			if follow {
				return a.followEvents(cmd, req)
			}
			out := &dsecv1.ListEventsResponse{Next: after}
			for {
				page := copyEventsRequest(req)
				if limit > 0 {
					page.Limit = min(limit-int32(len(out.Events)), eventsPage)
				}
				res, err := a.c.Sandboxes.ListEvents(cmd.Context(), connect.NewRequest(page))
				if err != nil {
					return err
				}
				out.Events = append(out.Events, res.Msg.GetEvents()...)
				if len(res.Msg.GetEvents()) > 0 {
					out.Next = res.Msg.GetNext()
				}
				if len(res.Msg.GetEvents()) < eventsPage || (limit > 0 && len(out.Events) >= int(limit)) {
					break
				}
				req.After = out.Next
			}
			if a.json {
				return a.printProto(out)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tTIME\tPROJECT\tSANDBOX\tEVENT\tREASON\tMESSAGE")
			for _, e := range out.Events {
				eventRow(tw, e)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVarP(&project, "project", "p", "", "the project, with everything under it (default: the token's project)")
	cmd.Flags().StringVar(&since, "since", "", "from this time: a duration ago (1h, 7d) or RFC 3339")
	cmd.Flags().StringVar(&sandbox, "sandbox", "", "only this sandbox's events")
	cmd.Flags().StringSliceVar(&kinds, "kind", nil, "only events of these kinds (created, paused, resumed, phase_ended, forked, snapshot, deleted, expired, failed)")
	cmd.Flags().Int64Var(&after, "after", 0, "only events after this cursor (an event's ID)")
	cmd.Flags().Int32Var(&limit, "limit", 0, "at most this many events (default: all)")
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "then wait for new events and print each as it comes")
	return cmd
}

// copyEventsRequest copies a request, so a page's limit leaves the next page's alone.
func copyEventsRequest(r *dsecv1.ListEventsRequest) *dsecv1.ListEventsRequest {
	return pb.Clone(r).(*dsecv1.ListEventsRequest)
}

func eventRow(w io.Writer, e *dsecv1.Event) {
	fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", e.GetId(), msTime(e.GetAtUnixMs()), displayPath(e.GetProject()),
		e.GetSandboxId(), e.GetKind(), e.GetReason(), e.GetMessage())
}

// followEvents prints what FollowEvents streams, a line per event, until
// the stream ends or the command is interrupted.
func (a *app) followEvents(cmd *cobra.Command, req *dsecv1.ListEventsRequest) error {
	stream, err := a.c.Sandboxes.FollowEvents(cmd.Context(), connect.NewRequest(req))
	if err != nil {
		return err
	}
	defer stream.Close()
	if !a.json {
		fmt.Fprintln(a.stdout, "ID\tTIME\tPROJECT\tSANDBOX\tEVENT\tREASON\tMESSAGE")
	}
	for stream.Receive() {
		e := stream.Msg()
		if a.json {
			b, err := pbjson.Marshal(e, pbjson.Options{EmitDefaults: true})
			if err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "%s\n", b)
			continue
		}
		eventRow(a.stdout, e)
	}
	if err := stream.Err(); err != nil && cmd.Context().Err() == nil {
		return err
	}
	return nil
}
