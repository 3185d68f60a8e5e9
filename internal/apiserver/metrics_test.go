package apiserver

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"
	dto "github.com/prometheus/client_model/go"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/watcher"
)

// scrapeHandler reads h's /metrics as a scrape from remote with token
// ("" for none), returning the status and, on 200, the parsed families.
func scrapeHandler(t *testing.T, h http.Handler, remote, token string) (int, map[string]*dto.MetricFamily) {
	t.Helper()
	req := httptest.NewRequest("GET", "/metrics", nil)
	req.RemoteAddr = remote
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != 200 {
		return rec.Code, nil
	}
	fams := testutil.ParseMetrics(t, rec.Body)
	return rec.Code, fams
}

// TestMetrics: /metrics serves the apiserver's requests by procedure,
// its placement decisions, the nodes it knows and its parts' counters.
func TestMetrics(t *testing.T) {
	s, _, c := newRig(t, false, Config{Metrics: metrics.New()}, newFakeEdge("n1"))
	s.rec.reaped.Add(3)
	ctx := context.Background()
	if _, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: "sb-nope-1"})); err == nil {
		t.Fatal("Get of a sandbox that does not exist succeeded")
	}
	code, fams := scrapeHandler(t, s.Handler(), "127.0.0.1:4000", "")
	if code != 200 {
		t.Fatalf("scrape: %d", code)
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"dsec_api_request_seconds", map[string]string{"procedure": "/dsec.v1.SandboxService/Create", "code": "ok"}, 1},
		{"dsec_api_request_seconds", map[string]string{"procedure": "/dsec.v1.SandboxService/Get", "code": "not_found"}, 1},
		{"dsec_placement_decisions_total", map[string]string{"outcome": "placed"}, 1},
		{"dsec_placement_nodes", map[string]string{"state": "known"}, 1},
		{"dsec_placement_nodes", map[string]string{"state": "healthy"}, 1},
		{"dsec_reconcile_sandboxes_reaped_total", map[string]string{}, 3},
	} {
		if got := testutil.MetricValue(fams, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if fams["dsec_events_stored_total"] == nil || fams["dsec_webhook_deliveries_total"] == nil {
		t.Error("the events' and webhooks' counters are missing")
	}

	// Without a registry there is no /metrics.
	s2, _, _ := newRig(t, false, Config{}, newFakeEdge("n1"))
	if code, _ := scrapeHandler(t, s2.Handler(), "127.0.0.1:4000", ""); code != 404 {
		t.Errorf("scrape of an apiserver without metrics: %d, want 404", code)
	}
}

// TestMetricsAuth: with tokens required, a scrape from loopback needs
// none; one from off loopback needs a viewer's token on the root project
// or the scrape token, and is refused (401) without a token or with a bad
// one, and (403) with a viewer's of a project under the root only.
func TestMetricsAuth(t *testing.T) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	admin := iam.NodeAdmin()
	if _, err := st.CreateProject(ctx, admin, "ml"); err != nil {
		t.Fatal(err)
	}
	mint := func(principal, project string, role iam.Role) string {
		t.Helper()
		if _, err := st.CreatePrincipal(ctx, admin, store.PrincipalSpec{Name: principal}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, admin, principal, project, role); err != nil {
			t.Fatal(err)
		}
		tok, _, err := st.MintToken(ctx, admin, store.TokenSpec{Principal: principal, Project: project, Role: role})
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	rootViewer := mint("prometheus", "", iam.Viewer)
	mlViewer := mint("ml-viewer", "ml", iam.Viewer)
	path := filepath.Join(t.TempDir(), "scrape.token")
	if err := os.WriteFile(path, []byte("scrape-token-0123456789"), 0o600); err != nil {
		t.Fatal(err)
	}
	scrape, err := metrics.ReadScrapeToken(path)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	s := New(Config{Name: "a1", Auth: st, IAM: st, Metrics: metrics.New(), ScrapeToken: scrape}, st, watcher.NewFixed(), log)
	for _, c := range []struct {
		what, remote, token string
		want                int
	}{
		{"loopback, no token", "127.0.0.1:4000", "", 200},
		{"off loopback, no token", "192.0.2.10:4000", "", 401},
		{"off loopback, a forged token", "192.0.2.10:4000", "dsec_forged", 401},
		{"off loopback, a viewer of ml only", "192.0.2.10:4000", mlViewer, 403},
		{"off loopback, a viewer of the root", "192.0.2.10:4000", rootViewer, 200},
		{"off loopback, the scrape token", "192.0.2.10:4000", "scrape-token-0123456789", 200},
	} {
		for name, h := range map[string]http.Handler{"API port": s.Handler(), "--metrics-listen": s.MetricsHandler()} {
			if code, _ := scrapeHandler(t, h, c.remote, c.token); code != c.want {
				t.Errorf("%s, on the %s: %d, want %d", c.what, name, code, c.want)
			}
		}
	}
}
