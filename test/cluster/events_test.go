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

// TestEventPullTakeover: two apiservers on PostgreSQL and four nodes; each
// node's events are pulled by one apiserver only (the holder of its
// lease), and the apiservers split the nodes two and two. While sandboxes
// are created and deleted through the second, the first is killed: the
// survivor takes its nodes over when the leases lapse and resumes at
// their cursors; the first starts again and the survivor gives two nodes
// back (after a pull, at their cursors). Every node's events are in the
// store once each, with no sequence number missing, and every sandbox
// created has its one created event.
func TestEventPullTakeover(t *testing.T) {
	pg := testutil.StartPostgres(t)
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 2, Edges: 4, DB: pg, Registry: true,
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
	// held waits until the apiservers hold want node pulls each (-1: not
	// asked, the apiserver is down).
	held := func(what string, want ...int64) {
		t.Helper()
		testutil.WaitCounts(t, 20*time.Second, what+": the node pulls each apiserver holds", want, func(i int) int64 {
			return metric(t, c.APIServers[i], "dsec_event_pull_nodes")
		})
	}

	// Creates through the second apiserver all along.
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		for !stop.Load() {
			if err := create(1); err != nil {
				t.Errorf("create through the second apiserver: %v", err)
				return
			}
		}
	})
	defer func() { stop.Store(true); wg.Wait() }()
	held("balanced", 2, 2)
	c.APIServers[0].Kill()
	held("the first killed", -1, 4)
	c.RestartAPIServer(0)
	held("the first started again", 2, 2)
	stop.Store(true)
	wg.Wait()
	if t.Failed() {
		return
	}
	for range 3 {
		if err := create(1); err != nil {
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
