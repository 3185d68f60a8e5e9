package apiserver_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/apiserver/iamtest"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/sandboxfusion"
	"dsec.dev/dsec/internal/watcher"
	dsec "dsec.dev/dsec/sdk/go"
)

// TestUsage: a node's ledger reaches the store on the apiserver's event
// pull, a sandbox's later figures replace its earlier ones (nothing counts
// twice, its end included), and Usage sums them by label for a token of
// the project, refusing another project's token as if the project did not
// exist; and FnCall calls run for a project through the API (RunCode,
// RunCodeBatch, SandboxFusion's /run_code) are its fncall_calls, one
// each. SQLite and PostgreSQL.
func TestUsage(t *testing.T) {
	for name, dsn := range iamtest.Databases() {
		t.Run(name, func(t *testing.T) { testUsage(t, dsn(t)) })
	}
}

func testUsage(t *testing.T, dsn string) {
	e := startEventsEnv(t, dsn) // its store, projects a and b, and tokens
	e.stopPulling()
	<-e.pullingEnded
	l, err := ledger.Open("n2", "", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	svc := edgesvc.New(hollow.New(hollow.Config{Node: "n2"}), nil, slog.New(slog.DiscardHandler))
	svc.SetLedger(l)
	svc.SetFnCall(fnCalls{})
	fleet := watcher.NewFixed(watcher.Node{Member: watcher.Member{Name: "n2"}, Edge: svc})
	api := apiserver.New(apiserver.Config{Name: "usage", Auth: e.st, IAM: e.st, Events: e.st, Ledger: e.st},
		e.st, fleet, slog.New(slog.NewTextHandler(io.Discard, nil)))
	hs := httptest.NewUnstartedServer(api.Handler())
	hs.Config.Protocols = new(http.Protocols)
	hs.Config.Protocols.SetHTTP1(true)
	hs.Config.Protocols.SetUnencryptedHTTP2(true)
	hs.Start()
	t.Cleanup(hs.Close)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); api.RunEvents(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	t0 := time.Now().Add(-time.Minute)
	l.Start("sb-a1", "a", map[string]string{"run": "r1"}, t0, true)
	l.Observe("sb-a1", "a", map[string]string{"run": "r1"}, ledger.Sample{At: t0.Add(time.Second), CPUUsec: 1_000_000, EgressBytes: 10})
	l.Start("sb-a2", "a", map[string]string{"run": "r2"}, t0, true)
	l.Observe("sb-a2", "a", map[string]string{"run": "r2"}, ledger.Sample{At: t0.Add(time.Second), CPUUsec: 500_000})
	l.Start("sb-b1", "b", map[string]string{"run": "r1"}, t0, true)
	l.Observe("sb-b1", "b", map[string]string{"run": "r1"}, ledger.Sample{At: t0.Add(time.Second), CPUUsec: 7_000_000})

	a := client(t, hs.URL, e.a)
	wait := func(want float64) map[string]dsec.Usage {
		t.Helper()
		var got map[string]dsec.Usage
		for range 200 {
			r, err := a.Usage(t.Context(), dsec.UsageQuery{By: "label:run"})
			if err != nil {
				t.Fatalf("Usage: %v", err)
			}
			got = map[string]dsec.Usage{}
			for _, g := range r.Groups {
				got[g.Key] = g.Usage
			}
			if got["r1"].CPUSeconds == want {
				return got
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatalf("project a by run: %+v, want r1 at %v CPU-s", got, want)
		return nil
	}
	got := wait(1)
	if len(got) != 2 || got["r2"].CPUSeconds != 0.5 || got["r1"].EgressBytes != 10 || got["r1"].Sandboxes != 1 {
		t.Fatalf("project a by run: %+v (project b's sb-b1 must not count)", got)
	}
	// Later figures and the end: replaced, not added.
	l.Observe("sb-a1", "a", nil, ledger.Sample{At: t0.Add(2 * time.Second), CPUUsec: 3_000_000, EgressBytes: 30})
	l.End("sb-a1", t0.Add(2*time.Second))
	got = wait(3)
	if got["r1"].EgressBytes != 30 || got["r1"].Sandboxes != 1 {
		t.Fatalf("after sb-a1's end: %+v", got)
	}
	// Another project's token: as if project a did not exist.
	b := client(t, hs.URL, e.b)
	if _, err := b.Usage(t.Context(), dsec.UsageQuery{Project: "a"}); !errors.Is(err, dsec.ErrNotFound) {
		t.Fatalf("b's token asking for a's usage: %v, want NotFound", err)
	}
	if _, err := a.Usage(t.Context(), dsec.UsageQuery{By: "colour"}); !errors.Is(err, dsec.ErrInvalidArgument) {
		t.Fatalf("by colour: %v, want InvalidArgument", err)
	}
	r, err := client(t, hs.URL, e.admin).Usage(t.Context(), dsec.UsageQuery{Project: ""})
	if err != nil || r.Total.CPUSeconds != 10.5 || r.Total.Sandboxes != 3 {
		t.Fatalf("the root's usage: %+v, %v; want 10.5 CPU-s of 3 sandboxes", r, err)
	}

	// FnCall calls: 2 RunCode and a batch of 2 through the Go SDK, and
	// one SandboxFusion /run_code, for project a; one RunCode for b.
	py := dsec.RunCodeRequest{Language: "python", Code: "print(1)"}
	for range 2 {
		if _, err := a.RunCode(t.Context(), py); err != nil {
			t.Fatalf("RunCode: %v", err)
		}
	}
	if _, err := a.RunCodeBatch(t.Context(), []dsec.RunCodeRequest{py, py}); err != nil {
		t.Fatalf("RunCodeBatch: %v", err)
	}
	sf := httptest.NewServer(sandboxfusion.NewHandler(api, sandboxfusion.Config{Authorize: api.AuthorizeFnCall}))
	t.Cleanup(sf.Close)
	sfReq, _ := http.NewRequest(http.MethodPost, sf.URL+"/run_code", strings.NewReader(`{"code": "print(1)", "language": "python"}`))
	sfReq.Header.Set("Authorization", "Bearer "+e.a)
	sfReq.Header.Set("Content-Type", "application/json")
	sfResp, err := sf.Client().Do(sfReq)
	if err != nil {
		t.Fatal(err)
	}
	sfBody, _ := io.ReadAll(sfResp.Body)
	sfResp.Body.Close()
	if sfResp.StatusCode != http.StatusOK || !strings.Contains(string(sfBody), `"Success"`) {
		t.Fatalf("SandboxFusion /run_code: %s %s", sfResp.Status, sfBody)
	}
	if _, err := b.RunCode(t.Context(), py); err != nil {
		t.Fatalf("RunCode as b: %v", err)
	}
	// The counters ride on the next pull: a node's ledger that moved
	// makes one.
	l.Observe("sb-a2", "a", nil, ledger.Sample{At: t0.Add(3 * time.Second), CPUUsec: 600_000})
	calls := func(c *dsec.Client, project string) int64 {
		t.Helper()
		r, err := c.Usage(t.Context(), dsec.UsageQuery{Project: project})
		if err != nil {
			t.Fatalf("Usage of %q: %v", project, err)
		}
		return r.Total.FnCallCalls
	}
	for i := 0; calls(a, "a") != 5 && i < 200; i++ {
		time.Sleep(50 * time.Millisecond)
	}
	if n := calls(a, "a"); n != 5 {
		t.Fatalf("project a's fncall_calls: %d, want 5 (2 RunCode, a batch of 2, 1 SandboxFusion run_code)", n)
	}
	if n := calls(b, "b"); n != 1 {
		t.Errorf("project b's fncall_calls: %d, want 1", n)
	}
	if n := calls(client(t, hs.URL, e.admin), ""); n != 6 {
		t.Errorf("the root's fncall_calls: %d, want 6", n)
	}
}

// fnCalls is a node's fncall backend whose every call succeeds.
type fnCalls struct{}

func (fnCalls) RunCode(context.Context, *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
	return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SUCCESS,
		RunResult: &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, Stdout: []byte("1\n")}}, nil
}

func (fnCalls) Languages() []*dsecv1.Language { return nil }

func (fnCalls) Load() (busy, queue, idle int) { return 0, 0, 0 }
