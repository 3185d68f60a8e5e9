package apiserver

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"connectrpc.com/connect"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/placement"
)

// registerMetrics registers the apiserver's metrics in Config.Metrics:
// requests and placements (recorded as they happen), the nodes it knows,
// and the counters kept in its parts (reconciliation, events, webhooks),
// read at each scrape.
func (s *Server) registerMetrics() {
	r := s.cfg.Metrics
	if r == nil {
		return
	}
	s.metrics = r.API(func() (known, healthy int) {
		nodes := s.fleet.Nodes()
		for _, n := range nodes {
			if n.Healthy {
				healthy++
			}
		}
		return len(nodes), healthy
	})
	of := func(v interface{ Load() int64 }) func() float64 { return func() float64 { return float64(v.Load()) } }
	r.Counters(
		metrics.Func{Name: "dsec_reconcile_doubts_recorded_total", Help: "Creates sent to a node whose outcome this apiserver never learned.", Value: of(&s.rec.doubtsRecorded)},
		metrics.Func{Name: "dsec_reconcile_doubts_settled_total", Help: "Doubts this apiserver settled with their nodes.", Value: of(&s.rec.doubtsSettled)},
		metrics.Func{Name: "dsec_reconcile_sandboxes_reaped_total", Help: "Sandboxes of given-up creates that nodes removed when this apiserver asked.", Value: of(&s.rec.reaped)},
		metrics.Func{Name: "dsec_reconcile_reservations_abandoned_total", Help: "Pending reservations whose lease lapsed, abandoned by this apiserver.", Value: of(&s.rec.abandoned)},
		metrics.Func{Name: "dsec_reconcile_rows_removed_total", Help: "Sandbox rows of sandboxes gone from their nodes, removed by this apiserver.", Value: of(&s.rec.rowsRemoved)},
		metrics.Func{Name: "dsec_reconcile_row_checks_skipped_total", Help: "Checks of a node's sandbox rows skipped because none of its sandboxes ended since the last.", Value: of(&s.rec.rowChecksSkipped)},
		metrics.Func{Name: "dsec_events_stored_total", Help: "Lifecycle events this apiserver pulled from nodes and stored: new ones only, so an event pulled again (by another apiserver, or after a restart) is not counted twice.", Value: of(&s.events.stored)},
		metrics.Func{Name: "dsec_events_lost_total", Help: "Lifecycle events nodes no longer kept when this apiserver asked for them.", Value: of(&s.events.lost)},
		metrics.Func{Name: "dsec_event_pulls_total", Help: "Calls this apiserver made to nodes for their events (only to the nodes whose pull it holds).", Value: of(&s.events.pulls)},
		metrics.Func{Name: "dsec_webhook_deliveries_total", Help: "Webhook deliveries (POSTs, each of up to its webhook's batch of events) this apiserver made that their endpoints acknowledged (2xx).", Value: of(&s.webhooks.delivered)},
		metrics.Func{Name: "dsec_webhook_delivery_failures_total", Help: "Webhook delivery attempts that failed (an error, a timeout or an answer other than 2xx), each retried.", Value: of(&s.webhooks.failed)},
	)
	r.Gauges(metrics.Func{Name: "dsec_event_pull_nodes", Help: "Nodes whose event pull this apiserver holds the lease of.", Value: of(&s.events.held)})
}

// MetricsHandler serves Config.Metrics (nil without it) to scrapes from
// loopback or the Unix socket, and to others bearing the scrape token or
// a token with the viewer role on the root project; the rest get 401.
// Without Config.Auth every caller is trusted, as by the API.
func (s *Server) MetricsHandler() http.Handler {
	if s.cfg.Metrics == nil {
		return nil
	}
	return metrics.Guard(s.cfg.Metrics.Handler(), s.allowScrape)
}

func (s *Server) allowScrape(r *http.Request) error {
	if s.authn == nil {
		return nil
	}
	tok := metrics.BearerToken(r)
	switch {
	case tok == "":
		return metrics.ErrNoToken
	case s.cfg.ScrapeToken.Matches(tok):
		return nil
	}
	au, err := s.authn.Authenticate(r.Context(), tok)
	if err != nil {
		if errors.Is(err, errdefs.ErrUnauthenticated) {
			s.log.Warn("scrape token refused", "peer", r.RemoteAddr, "err", err)
			return errors.New("the bearer token was refused (unknown, expired or revoked)")
		}
		return fmt.Errorf("check the bearer token: %w", err)
	}
	if au.On("") < iam.Viewer {
		s.log.Warn("scrape refused", "peer", r.RemoteAddr, "principal", au.Principal)
		return fmt.Errorf("principal %s is not a viewer of the root project, which reading /metrics needs: %w", au.Principal, errdefs.ErrPermissionDenied)
	}
	return nil
}

// requestMetrics times every call of the public services by procedure and
// code (metrics.API.Request).
type requestMetrics struct{ m *metrics.API }

func code(err error) string {
	if err == nil {
		return "ok"
	}
	return connect.CodeOf(err).String()
}

func (i requestMetrics) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		start := time.Now()
		resp, err := next(ctx, req)
		i.m.Request(req.Spec().Procedure, code(err), time.Since(start))
		return resp, err
	}
}

func (i requestMetrics) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i requestMetrics) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		start := time.Now()
		err := next(ctx, conn)
		i.m.Request(conn.Spec().Procedure, code(err), time.Since(start))
		return err
	}
}

// placementOutcome is a placement decision's metric label: placed, or
// the shortage that refused it.
func placementOutcome(err error) string {
	var ex *placement.ExhaustedError
	switch {
	case err == nil:
		return "placed"
	case errors.As(err, &ex):
		return ex.Shortage.Label()
	}
	return "error"
}
