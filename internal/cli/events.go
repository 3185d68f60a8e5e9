package cli

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	pb "google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/pbjson"
	dsec "dsec.dev/dsec/sdk/go"
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
one Event object a line. --after CURSOR starts after an event's ID: with
--limit N, when more events follow, the next page's --after goes to stderr
(with --json, "next").`,
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
			// more: --limit cut the listing short with events left, which
			// a page one longer than wanted tells.
			more := false
			for {
				page := copyEventsRequest(req)
				want := int32(eventsPage)
				if limit > 0 {
					want = min(limit-int32(len(out.Events))+1, eventsPage)
					page.Limit = want
				}
				res, err := a.c.Sandboxes.ListEvents(cmd.Context(), connect.NewRequest(page))
				if err != nil {
					return err
				}
				evs := res.Msg.GetEvents()
				full := len(evs) >= int(want)
				if limit > 0 && len(out.Events)+len(evs) > int(limit) {
					evs = evs[:int(limit)-len(out.Events)]
				}
				out.Events = append(out.Events, evs...)
				if len(evs) > 0 {
					out.Next = evs[len(evs)-1].GetId()
				}
				if limit > 0 && len(out.Events) >= int(limit) {
					more = full
					break
				}
				if !full {
					break
				}
				req.After = out.Next
			}
			if a.json {
				return a.printProto(out)
			}
			if more {
				defer fmt.Fprintf(a.stderr, "%d shown; the next page: --after %d\n", len(out.Events), out.Next)
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
	cmd.Flags().Int32Var(&limit, "limit", 0, "at most this many events (default: all); when more follow, the next page's --after goes to stderr")
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
// the stream ends or the command is interrupted. A stream that breaks (its
// apiserver restarted or went away) is followed again after the last event
// printed, through whichever address answers, so nothing is missed or
// printed twice; an answer refusing the request ends it.
func (a *app) followEvents(cmd *cobra.Command, req *dsecv1.ListEventsRequest) error {
	ctx := cmd.Context()
	if !a.json {
		fmt.Fprintln(a.stdout, "ID\tTIME\tPROJECT\tSANDBOX\tEVENT\tREASON\tMESSAGE")
	}
	left := req.GetLimit() // events still wanted (0: no limit)
	for first := true; ; first = false {
		got, err := a.followOnce(cmd, req, &left)
		if err == nil || ctx.Err() != nil {
			return err
		}
		// No address answering the first follow is a wrong address or a
		// dsecd not running, said at once; later, a restart under way.
		if !streamBroke(err) || first && dsec.Unreachable(err) {
			return err
		}
		if got == 0 {
			// Nothing came since the last break: wait before asking again,
			// so an address that keeps failing is not hammered.
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(followRetry):
			}
		}
		fmt.Fprintf(a.stderr, "dsec: the event stream broke (%s); following again after event %d\n", describe(err), req.GetAfter())
	}
}

// followRetry is how long a follower whose stream broke with nothing
// received waits before following again.
const followRetry = time.Second

// streamBroke reports whether a follow ended by a failure of the
// connection or of the apiserver serving it rather than by an answer to
// the request: a transport error, or Unavailable.
func streamBroke(err error) bool {
	return connect.CodeOf(err) == connect.CodeUnavailable || !connect.IsWireError(err)
}

// followOnce follows once, printing each event and moving req's cursor
// past it, and returns how many came. *left counts down the events a
// --limit still wants (0: no limit), and the stream is asked for those.
func (a *app) followOnce(cmd *cobra.Command, req *dsecv1.ListEventsRequest, left *int32) (int, error) {
	req.Limit = *left
	stream, err := a.c.Sandboxes.FollowEvents(cmd.Context(), connect.NewRequest(req))
	if err != nil {
		return 0, err
	}
	defer stream.Close()
	got := 0
	for stream.Receive() {
		e := stream.Msg()
		got++
		req.After = e.GetId()
		if a.json {
			b, err := pbjson.Marshal(e, pbjson.Options{EmitDefaults: true})
			if err != nil {
				return got, err
			}
			fmt.Fprintf(a.stdout, "%s\n", b)
		} else {
			eventRow(a.stdout, e)
		}
		if *left > 0 {
			if *left--; *left == 0 {
				return got, nil
			}
		}
	}
	if err := stream.Err(); err != nil && cmd.Context().Err() == nil {
		return got, err
	}
	return got, nil
}

func (a *app) webhookCommand() *cobra.Command {
	cmd := &cobra.Command{Use: "webhook", Short: "register endpoints for a project's events, list them with their deliveries, remove them (a project admin's)"}
	var project, secret string
	var kinds []string
	var batch int32
	var single bool
	add := &cobra.Command{
		Use:   "add URL",
		Short: "register URL for the events of a project (default: the token's) and under it, from now on; prints its ID and signing secret",
		Long: `Register an endpoint: its events (of --kind only, when given) are POSTed
to it as JSON, {"webhook": ID, "events": [...]} with up to --batch of the
events waiting in each delivery (--single: one event a delivery, the event
object itself), signed in the Dsec-Signature header with the webhook's
secret (--secret, or one the server makes and prints once), at least once
and in order, retried with backoff until it answers 2xx (docs/events.md
says how to verify and read a delivery). The server refuses http:// and loopback or private
addresses unless its operator allowed them (dsecd --webhook-allow-private).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.Sandboxes.AddWebhook(cmd.Context(), connect.NewRequest(&dsecv1.AddWebhookRequest{
				Project: optional(project), Url: args[0], Kinds: kinds, Secret: secret, Batch: batch, Single: single}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			fmt.Fprintf(a.stdout, "%s\nsecret: %s\n", res.Msg.GetId(), res.Msg.GetSecret())
			return nil
		},
	}
	add.Flags().StringVarP(&project, "project", "p", "", "the project (default: the token's)")
	add.Flags().StringSliceVar(&kinds, "kind", nil, "only events of these kinds (default: all)")
	add.Flags().StringVar(&secret, "secret", "", "the signing secret (default: the server makes one)")
	add.Flags().Int32Var(&batch, "batch", 0, "the most events one delivery carries, 1 to 1000 (default 100)")
	add.Flags().BoolVar(&single, "single", false, "one event a delivery, the event object itself as the body (the format before batches)")
	var lsProject string
	ls := &cobra.Command{
		Use:   "ls",
		Short: "list the webhooks of a project (default: the token's) and under it, with their last delivered event, last success and last failure",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.Sandboxes.ListWebhooks(cmd.Context(), connect.NewRequest(&dsecv1.ListWebhooksRequest{Project: optional(lsProject)}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tPROJECT\tURL\tKINDS\tBATCH\tDELIVERED\tLAST OK\tLAST FAILURE\tFAILURES\tLAST ERROR")
			for _, w := range res.Msg.GetWebhooks() {
				k, b := webhookShape(w)
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%d\t%s\n", w.GetId(), displayPath(w.GetProject()), w.GetUrl(), k, b, w.GetDelivered(),
					msTime(w.GetLastOkUnixMs()), msTime(w.GetLastFailureUnixMs()), w.GetFailures(), w.GetLastError())
			}
			return tw.Flush()
		},
	}
	ls.Flags().StringVarP(&lsProject, "project", "p", "", "the project, with everything under it (default: the token's)")
	var rmProject string
	rm := &cobra.Command{
		Use:   "rm ID...",
		Short: "remove webhooks",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			for _, id := range args {
				res, err := a.c.Sandboxes.RemoveWebhook(cmd.Context(), connect.NewRequest(&dsecv1.RemoveWebhookRequest{Project: optional(rmProject), Id: id}))
				if err != nil {
					return err
				}
				if a.json {
					if err := a.printProto(res.Msg); err != nil {
						return err
					}
				}
			}
			return nil
		},
	}
	rm.Flags().StringVarP(&rmProject, "project", "p", "", "the project the webhooks belong to, or one above it (default: the token's)")
	var rotProject, rotSecret string
	var overlap time.Duration
	rotate := &cobra.Command{
		Use:   "rotate ID",
		Short: "give a webhook a new signing secret; the old one signs beside it for --overlap (default 24h); prints the new secret",
		Long: `Rotate a webhook's signing secret: the new secret (--secret, or one the
server makes and prints once) signs every delivery from now on, and for
--overlap the old one signs it too (the Dsec-Signature header carries two
v1= entries), so receivers can move to the new secret one at a time without
refusing a delivery. --overlap 0s retires the old secret at once.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			secs := int64(overlap / time.Second)
			if overlap <= 0 {
				secs = -1
			} else if secs == 0 {
				secs = 1
			}
			res, err := a.c.Sandboxes.RotateWebhookSecret(cmd.Context(), connect.NewRequest(&dsecv1.RotateWebhookSecretRequest{
				Project: optional(rotProject), Id: args[0], Secret: rotSecret, OverlapSeconds: secs}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			fmt.Fprintf(a.stdout, "%s\nsecret: %s\n", res.Msg.GetId(), res.Msg.GetSecret())
			if u := res.Msg.GetPreviousSecretUntilUnixMs(); u > 0 {
				fmt.Fprintf(a.stdout, "the previous secret signs too until %s\n", msTime(u))
			}
			return nil
		},
	}
	rotate.Flags().StringVarP(&rotProject, "project", "p", "", "the project the webhook belongs to, or one above it (default: the token's)")
	rotate.Flags().StringVar(&rotSecret, "secret", "", "the new signing secret (default: the server makes one)")
	rotate.Flags().DurationVar(&overlap, "overlap", 24*time.Hour, "how long the old secret signs beside the new one (0s: retired at once)")
	cmd.AddCommand(add, ls, rm, rotate, a.webhookSetCommand())
	return cmd
}

// webhookSetCommand is `dsec webhook set`: a webhook changed in place.
func (a *app) webhookSetCommand() *cobra.Command {
	var project, url string
	var kinds []string
	var batch int32
	var single, allKinds bool
	set := &cobra.Command{
		Use:   "set ID",
		Short: "change a webhook in place (--batch or --single, --url, --kind or --all-kinds), keeping its cursor and secret",
		Long: `Change what a webhook is: its batch (--batch N, or --single: one event a
delivery, bare), its endpoint (--url), the kinds it gets (--kind, or
--all-kinds). What is not named stays. It keeps its cursor, so no event
is skipped or sent again for the change (a webhook removed and added
again starts from the events after its adding, losing those not yet
delivered), its secret and its history; its deliveries take the change
within seconds. A webhook added before batches (BATCH single in dsec
webhook ls) moves to them with --batch 100.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.UpdateWebhookRequest{Project: optional(project), Id: args[0], Single: single}
			f := cmd.Flags()
			if f.Changed("batch") {
				req.Batch = &batch
			}
			if f.Changed("url") {
				req.Url = &url
			}
			switch {
			case allKinds && len(kinds) > 0:
				return fmt.Errorf("--kind and --all-kinds: name one")
			case allKinds:
				req.SetKinds = true
			case f.Changed("kind"):
				req.SetKinds, req.Kinds = true, kinds
			}
			if req.Batch == nil && !single && req.Url == nil && !req.SetKinds {
				return fmt.Errorf("nothing to change: name --batch, --single, --url, --kind or --all-kinds")
			}
			res, err := a.c.Sandboxes.UpdateWebhook(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			w := res.Msg
			k, b := webhookShape(w)
			fmt.Fprintf(a.stdout, "%s\nurl: %s\nkinds: %s\nbatch: %s\ndelivered: %d\n", w.GetId(), w.GetUrl(), k, b, w.GetDelivered())
			return nil
		},
	}
	set.Flags().StringVarP(&project, "project", "p", "", "the project the webhook belongs to, or one above it (default: the token's)")
	set.Flags().StringVar(&url, "url", "", "its new endpoint")
	set.Flags().StringSliceVar(&kinds, "kind", nil, "only events of these kinds from now on")
	set.Flags().BoolVar(&allKinds, "all-kinds", false, "events of every kind from now on")
	set.Flags().Int32Var(&batch, "batch", 0, "the most events one delivery carries, 1 to 1000 (0: 100)")
	set.Flags().BoolVar(&single, "single", false, "one event a delivery, the event object itself as the body")
	return set
}

// webhookShape says which events w delivers ("all", or its kinds) and in
// what ("single" events, or batches of up to N), as listings print them.
func webhookShape(w *dsecv1.Webhook) (kinds, batch string) {
	kinds = strings.Join(w.GetKinds(), ",")
	if kinds == "" {
		kinds = "all"
	}
	batch = fmt.Sprint(w.GetBatch())
	if w.GetBatch() == 0 {
		batch = "single"
	}
	return kinds, batch
}
