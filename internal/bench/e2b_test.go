package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	processpb "dsec.dev/dsec/api/gen/e2b/process"
	"dsec.dev/dsec/api/gen/e2b/process/processpbconnect"
)

func TestE2BZeroCost(t *testing.T) {
	p := E2BPair{
		E2B: Latency{P50: 4.5}, Dsec: Latency{P50: 1.6}, DsecBash: Latency{P50: 2.4},
		E2BFloor: Latency{N: 10, P50: 1.5}, DsecFloor: Latency{N: 10, P50: 0.4},
	}
	// The SDK alone (1.5) plus dsec's work for bash -l (2.4 - 0.4).
	if got := p.ZeroCost(); got != 3.5 {
		t.Errorf("ZeroCost = %v, want 3.5", got)
	}
	if got := (E2BPair{E2B: Latency{P50: 4.5}, Dsec: Latency{P50: 1.6}}).ZeroCost(); got != 0 {
		t.Errorf("ZeroCost without floors = %v, want 0", got)
	}
	r := &E2BReport{Template: "base", Environment: "e2b-base", Cold: p, Run: p}
	var out bytes.Buffer
	r.Print(&out)
	// 3.5 / 1.6 = 2.19: over both targets, so out of reach for both.
	for _, want := range []string{"each client against an instant server", "E2B with a zero-cost adapter", "2.19×", "out of reach"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
	p.E2BFloor.P50 = 0.5 // 2.5 / 1.6 = 1.56: within the run target of 2×
	r = &E2BReport{Template: "base", Environment: "e2b-base", Run: p}
	out.Reset()
	r.Print(&out)
	if !strings.Contains(out.String(), "reachable") || strings.Contains(out.String(), "out of reach") {
		t.Errorf("a zero-cost figure of 1.56× against ≤ 2× is reachable:\n%s", out.String())
	}
}

// TestInstantServers: both instant servers answer their clients' calls as
// the real servers would, so the floors time the clients doing real work.
func TestInstantServers(t *testing.T) {
	for _, addr := range []string{"127.0.0.1:1", "unix:///nonexistent.sock"} {
		fl, err := startFloors(addr)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		resp, err := fl.dsec.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "e"}}))
		if err != nil {
			t.Fatalf("%s: create: %v", addr, err)
		}
		if err := execArgvOK(ctx, fl.dsec, resp.Msg.GetSandboxes()[0].GetId(), []string{"true"}); err != nil {
			t.Errorf("%s: exec: %v", addr, err)
		}

		// E2B's control plane, as the SDK sends it.
		res, err := http.Post(fl.e2bURL+"/v2/sandboxes", "application/json", strings.NewReader(`{"templateID":"base"}`))
		if err != nil {
			t.Fatal(err)
		}
		var sb map[string]string
		json.NewDecoder(res.Body).Decode(&sb)
		res.Body.Close()
		if res.StatusCode != http.StatusCreated || sb["sandboxID"] == "" || sb["envdVersion"] == "" {
			t.Errorf("create: %d %v", res.StatusCode, sb)
		}
		// envd's Start, in Connect's JSON as the SDK sends it.
		pc := processpbconnect.NewProcessClient(http.DefaultClient, fl.e2bURL, connect.WithProtoJSON())
		st, err := pc.Start(ctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", "true"}}}))
		if err != nil {
			t.Fatal(err)
		}
		var started, ended bool
		for st.Receive() {
			started = started || st.Msg().GetEvent().GetStart() != nil
			if e := st.Msg().GetEvent().GetEnd(); e != nil {
				ended = e.GetExited() && e.GetExitCode() == 0
			}
		}
		if err := st.Err(); err != nil || !started || !ended {
			t.Errorf("start: started %v, ended with 0 %v, err %v", started, ended, err)
		}
		fl.close()
	}
}
