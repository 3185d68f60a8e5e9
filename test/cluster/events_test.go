package cluster

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
)

// TestEventPullTakeover: two apiservers on PostgreSQL and two nodes; each
// node's events are pulled by one apiserver only (the holder of its lease:
// the other calls no node for events). The holder is killed while
// sandboxes are created through the other: the survivor takes the nodes
// over when the leases lapse and resumes at their cursors, so every node's
// events are in the store once each, with no sequence number missing, and
// every sandbox created has its one created event.
func TestEventPullTakeover(t *testing.T) {
	pg := testutil.StartPostgres(t)
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 2, Edges: 2, DB: pg, Registry: true,
		EdgeArgs: []string{"--runtime", "fake", "--hollow-max-sandboxes", "2000"}})
	ctx := context.Background()
	st, err := store.Open(ctx, pg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })

	var mu sync.Mutex
	var created []string
	create := func(i int) error {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		resp, err := c.Client(i).Sandboxes.Create(cctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 4}))
		if err != nil {
			return err
		}
		mu.Lock()
		for _, sb := range resp.Msg.GetSandboxes() {
			created = append(created, sb.GetId())
		}
		mu.Unlock()
		// Deleted again, so the nodes never fill (and deletes are events too).
		for _, sb := range resp.Msg.GetSandboxes() {
			if _, err := c.Client(i).Sandboxes.Delete(cctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sb.GetId()})); err != nil {
				return err
			}
		}
		return nil
	}
	for range 5 {
		if err := create(0); err != nil {
			t.Fatal(err)
		}
	}

	// One apiserver holds each node (the counts settle within a claim).
	var held [2]int64
	for deadline := time.Now().Add(20 * time.Second); ; {
		held = [2]int64{metric(t, c.APIServers[0], "dsec_event_pull_nodes"), metric(t, c.APIServers[1], "dsec_event_pull_nodes")}
		if held[0]+held[1] == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the apiservers hold %v node pulls, want 2 in all", held)
		}
		time.Sleep(100 * time.Millisecond)
	}
	victim, survivor := 0, 1
	if held[1] > held[0] {
		victim, survivor = 1, 0
	}
	if held[survivor] == 0 {
		if n := metric(t, c.APIServers[survivor], "dsec_event_pulls_total"); n != 0 {
			t.Errorf("apiserver %s holds no node but called nodes for events %d times", c.APIServers[survivor].Name, n)
		}
	}
	t.Logf("apiserver %s holds %d nodes' pulls, %s %d", c.APIServers[victim].Name, held[victim], c.APIServers[survivor].Name, held[survivor])

	// Create through the survivor while the holder dies.
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		for !stop.Load() {
			if err := create(survivor); err != nil {
				t.Errorf("create through the survivor: %v", err)
				return
			}
		}
	})
	time.Sleep(300 * time.Millisecond) // some creates while the holder still pulls
	c.APIServers[victim].Kill()
	for deadline := time.Now().Add(20 * time.Second); metric(t, c.APIServers[survivor], "dsec_event_pull_nodes") != 2; {
		if time.Now().After(deadline) {
			t.Fatal("the survivor did not take the killed apiserver's nodes over")
		}
		time.Sleep(100 * time.Millisecond)
	}
	stop.Store(true)
	wg.Wait()
	for range 3 {
		if err := create(survivor); err != nil {
			t.Fatal(err)
		}
	}

	// Every created sandbox's event arrives, once; no node's sequence has a gap.
	mu.Lock()
	want := append([]string(nil), created...)
	mu.Unlock()
	var evs []store.Event
	for deadline := time.Now().Add(20 * time.Second); ; {
		evs = evs[:0]
		for after := int64(0); ; {
			page, err := st.ListEvents(ctx, store.EventQuery{After: after, Limit: 1000})
			if err != nil {
				t.Fatal(err)
			}
			evs = append(evs, page...)
			if len(page) < 1000 {
				break
			}
			after = page[len(page)-1].ID
		}
		n := 0
		for _, e := range evs {
			if e.Kind == "created" {
				n++
			}
		}
		if n >= len(want) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d created events stored, want %d", n, len(want))
		}
		time.Sleep(200 * time.Millisecond)
	}
	createdOf := map[string]int{}
	seqs := map[string][]uint64{} // NODE/EPOCH: the sequence numbers stored, in ID order
	for _, e := range evs {
		if e.Kind == "created" {
			createdOf[e.SandboxID]++
		}
		i := strings.LastIndexByte(e.Key, '/')
		n, err := strconv.ParseUint(e.Key[i+1:], 10, 64)
		if err != nil {
			t.Fatalf("event key %q", e.Key)
		}
		seqs[e.Key[:i]] = append(seqs[e.Key[:i]], n)
	}
	for _, id := range want {
		if createdOf[id] != 1 {
			t.Errorf("sandbox %s: %d created events, want 1", id, createdOf[id])
		}
	}
	for log, ns := range seqs {
		for i, n := range ns {
			if n != uint64(i+1) {
				t.Fatalf("node log %s: event %d of the store is sequence number %d (a gap or a repeat): %v", log, i+1, n, ns)
			}
		}
	}
	t.Logf("%d sandboxes, %d events over %d node logs, each once and in order", len(want), len(evs), len(seqs))
}
