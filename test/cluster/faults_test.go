package cluster

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// burst runs workers that each make keyed creates of n sandboxes, a new key
// per request, retrying a request with its key (as the SDKs do) until it is
// acknowledged or 60 s pass, while fault runs once the burst is going. It
// returns the IDs acknowledged per key.
func burst(t *testing.T, cl *dsec.Conn, workers, requests, n int, fault func()) map[string][]string {
	t.Helper()
	var mu sync.Mutex
	acked := map[string][]string{}
	var started atomic.Int32
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range requests {
				key := fmt.Sprintf("w%d-r%d", w, r)
				req := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: int32(n), IdempotencyKey: key}
				deadline := time.Now().Add(60 * time.Second)
				for {
					started.Add(1)
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					resp, err := cl.Sandboxes.Create(ctx, connect.NewRequest(req))
					cancel()
					if err == nil {
						var ids []string
						for _, sb := range resp.Msg.GetSandboxes() {
							ids = append(ids, sb.GetId())
						}
						mu.Lock()
						acked[key] = ids
						mu.Unlock()
						break
					}
					if time.Now().After(deadline) {
						t.Errorf("request %s never acknowledged: %v", key, err)
						return
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
		}()
	}
	for started.Load() < int32(workers*2) {
		time.Sleep(5 * time.Millisecond)
	}
	fault()
	wg.Wait()
	return acked
}

// checkExactlyOnce: every request was acknowledged with n distinct
// sandboxes, each still there, and the edges hold no sandbox nobody was
// told of.
func checkExactlyOnce(t *testing.T, cl *dsec.Conn, acked map[string][]string, want, n int) {
	t.Helper()
	if len(acked) != want {
		t.Fatalf("%d of %d requests acknowledged", len(acked), want)
	}
	ids := map[string]bool{}
	for key, got := range acked {
		if len(got) != n {
			t.Errorf("request %s: %d sandboxes", key, len(got))
		}
		for _, id := range got {
			if ids[id] {
				t.Errorf("sandbox %s acknowledged twice", id)
			}
			ids[id] = true
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := cl.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{States: []dsecv1.State{dsecv1.State_STATE_RUNNING}}))
	if err != nil {
		t.Fatal(err)
	}
	running := map[string]bool{}
	for _, sb := range resp.Msg.GetSandboxes() {
		running[sb.GetId()] = true
		if !ids[sb.GetId()] {
			t.Errorf("sandbox %s runs, but no request was acknowledged with it (a duplicate)", sb.GetId())
		}
	}
	for id := range ids {
		if !running[id] {
			t.Errorf("acknowledged sandbox %s does not run (lost)", id)
		}
	}
	t.Logf("%d requests, %d sandboxes, each once", len(acked), len(ids))
}

// TestApiserverKilledMidBurst: SIGKILL one of two apiservers while clients
// create through both; retrying through the other replica loses no create
// and duplicates none.
func TestApiserverKilledMidBurst(t *testing.T) {
	pg := testutil.StartPostgres(t)
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 2, Edges: 3, DB: pg, Registry: true,
		EdgeArgs: []string{"--runtime", "fake", "--hollow-max-sandboxes", "2000", "--hollow-start-delay", "20ms"}})
	cl := c.ClientAll()
	acked := burst(t, cl, 8, 12, 5, func() { c.APIServers[0].Kill() })
	checkExactlyOnce(t, cl, acked, 8*12, 5)
}

// TestPostgresRestartedMidBurst: PostgreSQL restarts while clients create;
// every create acknowledged exists, none twice, and the apiservers carry on
// without a restart of their own.
func TestPostgresRestartedMidBurst(t *testing.T) {
	pg := testutil.StartPostgresServer(t)
	dsn := pg.NewDatabase(t)
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 2, Edges: 2, DB: dsn, Registry: true,
		EdgeArgs: []string{"--runtime", "fake", "--hollow-max-sandboxes", "2000", "--hollow-start-delay", "10ms"}})
	cl := c.ClientAll()
	acked := burst(t, cl, 6, 10, 3, func() { pg.Restart(t) })
	checkExactlyOnce(t, cl, acked, 6*10, 3)
	// Both replicas still serve.
	for i := range c.APIServers {
		if _, err := c.Create(i, &dsecv1.SandboxSpec{Environment: "base:1"}, 1); err != nil {
			t.Errorf("apiserver %s after the restart: %v", c.APIServers[i].Name, err)
		}
	}
}
