package daemon

import (
	"testing"
	"time"

	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/config"
	"dsec.dev/dsec/internal/edge/fncall"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/edge/trajectory"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/placement"
)

// TestConfigDefaultsAgree: the defaults package config shows and passes
// are those the packages that take a zero for "the default" fall back
// on, so a Config built in Go and one from a file run alike.
func TestConfigDefaultsAgree(t *testing.T) {
	none := func(string) string { return "" }
	n := config.DefaultNode(none)
	a := config.DefaultAPIServer()
	for _, c := range []struct {
		name      string
		got, want any
	}{
		{"metrics_projects", n.MetricsProjects, metrics.DefaultProjects},
		{"trajectory.retention", n.Trajectory.Retention, trajectory.DefaultRetention},
		{"trajectory.max_bytes", n.Trajectory.MaxBytes, int64(trajectory.DefaultMaxBytes)},
		{"trajectory.max_output", n.Trajectory.MaxOutput, trajectory.DefaultMaxOutput},
		{"fncall.max_start_delay", n.FnCall.MaxStartDelay, fncall.DefaultMaxStartDelay},
		{"fncall.disk_mb", n.FnCall.DiskMB, int64(fncall.DefaultDiskMB)},
		{"audit_retention", a.AuditRetention, apiserver.DefaultAuditRetention},
		{"event_retention", a.EventRetention, apiserver.DefaultEventRetention},
		{"abandon_after", a.AbandonAfter, apiserver.DefaultAbandonAfter},
		{"placement_group", a.PlacementGroup, placement.DefaultGroup},
		{"max_batch", a.MaxBatch, apiserver.DefaultMaxBatch},
		{"create_concurrency", a.CreateConcurrency, apiserver.DefaultCreateConcurrency},
		{"reconcile_interval", a.ReconcileInterval, apiserver.DefaultReconcileInterval},
		{"webhook_timeout", a.WebhookTimeout, apiserver.DefaultWebhookTimeout},
		{"webhook_backoff", a.WebhookBackoff, apiserver.DefaultWebhookBackoff},
		{"webhook_max_active", a.WebhookMaxActive, apiserver.DefaultWebhookMaxActive},
		{"start_timeout", n.StartTimeout, sandbox.DefaultStartTimeout},
		{"paused_retention", n.PausedRetention, 7 * 24 * time.Hour}, // sandbox.Manager's
		{"max_warm", n.MaxWarm, 256},                                // sandbox.Manager's
		{"ledger_interval", n.LedgerInterval, ledger.DefaultInterval},
		{"ledger_checkpoint", n.LedgerCheckpoint, ledger.DefaultCheckpoint},
	} {
		if c.got != c.want {
			t.Errorf("%s: config's default %v, the package's %v", c.name, c.got, c.want)
		}
	}
	// The all-in-one's settings as they were as flags, converted.
	cfg, err := FromAllInOne(config.DefaultAllInOne(none))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listen != DefaultAddr || cfg.SandboxFusionListen != DefaultSandboxFusionAddr || cfg.Defaults.CPUs != 1 ||
		cfg.FnCall.Pools.QoS != "latency" || cfg.Storage.Mode != "ondemand" || cfg.Swap.Kind != "" {
		t.Errorf("converted defaults: %+v", cfg)
	}
	// "none" turns an optional listener off, as it does --listen: it is
	// not an address to listen on.
	aio := config.DefaultAllInOne(none)
	aio.API.E2BListen = "none"
	if cfg, err := FromAllInOne(aio); err != nil || cfg.E2BListen != "" {
		t.Errorf("--e2b-listen none: E2BListen %q, %v; want off", cfg.E2BListen, err)
	}
	api := config.DefaultAPIServer()
	api.API.E2BListen, api.API.SandboxFusionListen = "none", "none"
	if cfg, err := FromAPIServer(api); err != nil || cfg.E2BListen != "" || cfg.SandboxFusionListen != "" {
		t.Errorf("dsecd apiserver --e2b-listen none --sandboxfusion-listen none: %q %q, %v; want both off", cfg.E2BListen, cfg.SandboxFusionListen, err)
	}
	if _, err := FromEdge(config.DefaultEdge(none)); err == nil {
		t.Error("an edge without a node name converted")
	}
	e := config.DefaultEdge(none)
	e.Node.Node, e.TLS.Dir = "n1", "/etc/dsec"
	ec, err := FromEdge(e)
	if err != nil || ec.TLS.Cert != "/etc/dsec/edge-n1.crt" || ec.TLS.CABundle != "/etc/dsec/ca.crt" {
		t.Errorf("edge TLS from its directory: %+v, %v", ec.TLS, err)
	}
	a.Edges = []string{"bad"}
	if _, err := FromAPIServer(a); err == nil {
		t.Error("a malformed edge converted")
	}
}

// TestLedgerCheckpointBounded: --ledger-checkpoint is refused shorter
// than the sampling interval (a checkpoint comes with a sample) and past
// a quarter of the hour a node keeps an ended sandbox's record, as the
// pulls are; in between, an edge and the all-in-one take it.
func TestLedgerCheckpointBounded(t *testing.T) {
	for _, c := range []struct {
		every, interval time.Duration
		ok              bool
	}{
		{ledger.DefaultCheckpoint, 0, true}, {ledger.DefaultInterval, 0, true}, {time.Second, time.Second, true},
		{ledger.Keep / 4, ledger.DefaultInterval, true},
		{0, ledger.DefaultInterval, false}, {-time.Second, ledger.DefaultInterval, false},
		{time.Second, ledger.DefaultInterval, false}, {ledger.Keep/4 + time.Second, ledger.DefaultInterval, false},
		{ledger.Keep, ledger.DefaultInterval, false},
	} {
		e := config.DefaultEdge(func(string) string { return "" })
		e.Node.Node = "n1"
		e.Node.LedgerCheckpoint, e.Node.LedgerInterval = c.every, c.interval
		cfg, err := FromEdge(e)
		if (err == nil) != c.ok {
			t.Errorf("edge ledger_checkpoint %s, ledger_interval %s: %v, want ok %v", c.every, c.interval, err, c.ok)
		}
		if err == nil && cfg.Node.LedgerCheckpoint != c.every {
			t.Errorf("edge ledger_checkpoint %s: passed on as %s", c.every, cfg.Node.LedgerCheckpoint)
		}
		a := config.DefaultAllInOne(func(string) string { return "" })
		a.Node.LedgerCheckpoint, a.Node.LedgerInterval = c.every, c.interval
		if acfg, err := FromAllInOne(a); (err == nil) != c.ok || err == nil && acfg.LedgerCheckpoint != c.every {
			t.Errorf("all-in-one ledger_checkpoint %s, ledger_interval %s: %v (%s), want ok %v", c.every, c.interval, err, acfg.LedgerCheckpoint, c.ok)
		}
	}
}

// TestUsagePullBounded: --usage-pull-interval is refused negative, and at
// or past the time a node keeps an ended sandbox's ledger record (a pull
// that far apart loses the records the node dropped in between), with a
// margin for an apiserver's failover; up to a quarter of it is taken.
func TestUsagePullBounded(t *testing.T) {
	for _, c := range []struct {
		every time.Duration
		ok    bool
	}{
		{0, true}, {30 * time.Second, true}, {ledger.Keep / 4, true},
		{-time.Second, false}, {ledger.Keep/4 + time.Second, false}, {ledger.Keep, false},
	} {
		a := config.DefaultAPIServer()
		a.UsagePull = c.every
		cfg, err := FromAPIServer(a)
		if (err == nil) != c.ok {
			t.Errorf("usage_pull_interval %s: %v, want ok %v", c.every, err, c.ok)
		}
		if err == nil && cfg.UsagePullEvery != c.every {
			t.Errorf("usage_pull_interval %s: passed on as %s", c.every, cfg.UsagePullEvery)
		}
	}
}
