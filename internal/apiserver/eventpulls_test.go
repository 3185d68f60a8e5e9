package apiserver_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/watcher"
)

// TestEventPullBalance: two apiservers over one store and four hollow
// edges split the nodes' pulls two and two; the one stopped hands its
// nodes to the other; one started after takes its share back from the
// survivor. Events added to every node's log all along are stored once
// each, in each node's order, none missing. On SQLite: test/cluster's
// TestEventPullTakeover does it on PostgreSQL with apiserver processes,
// and storetest's EventPullBalance runs the store's part on both.
func TestEventPullBalance(t *testing.T) {
	ctx := t.Context()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	discard := slog.New(slog.DiscardHandler)
	var nodes []watcher.Node
	var logs []*eventlog.Log
	for i := range 4 {
		name := fmt.Sprintf("n%d", i+1)
		l := eventlog.New(name, 0)
		svc := edgesvc.New(hollow.New(hollow.Config{Node: name, Events: l}), nil, discard)
		svc.SetEvents(l)
		nodes = append(nodes, watcher.Node{Member: watcher.Member{Name: name}, Edge: svc})
		logs = append(logs, l)
	}
	fleet := watcher.NewFixed(nodes...)

	type puller struct {
		api  *apiserver.Server
		stop func()
	}
	start := func(name string) *puller {
		api := apiserver.New(apiserver.Config{Name: name, Auth: st, IAM: st, Events: st, Metrics: metrics.New()}, st, fleet, discard)
		pctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			api.RunEvents(pctx)
		}()
		p := &puller{api: api, stop: sync.OnceFunc(func() { cancel(); <-done })}
		t.Cleanup(p.stop)
		return p
	}
	held := func(p *puller) int {
		req := httptest.NewRequest("GET", "/metrics", nil)
		req.RemoteAddr = "127.0.0.1:1"
		rec := httptest.NewRecorder()
		p.api.Handler().ServeHTTP(rec, req)
		if rec.Code != 200 {
			t.Fatalf("/metrics: %d", rec.Code)
		}
		return int(testutil.MetricValue(testutil.ParseMetrics(t, rec.Body), "dsec_event_pull_nodes", nil))
	}
	// wait waits until the apiservers hold want node pulls each.
	wait := func(what string, ps []*puller, want ...int64) {
		t.Helper()
		testutil.WaitCounts(t, 20*time.Second, what+": the node pulls each apiserver holds", want, func(i int) int64 { return int64(held(ps[i])) })
	}

	// Every node logs events all along.
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; !stop.Load(); i++ {
			for _, l := range logs {
				l.Add("created", fmt.Sprintf("sb-%d", i), "p", "", "")
			}
			time.Sleep(5 * time.Millisecond)
		}
	})
	defer func() { stop.Store(true); wg.Wait() }()

	a, b := start("a"), start("b")
	wait("two apiservers", []*puller{a, b}, 2, 2)
	b.stop()
	wait("the second stopped", []*puller{a}, 4)
	c := start("c")
	wait("a third started", []*puller{a, c}, 2, 2)
	stop.Store(true)
	wg.Wait()

	// Each node's log is in the store once, in its order.
	want := 0
	for _, l := range logs {
		_, n := l.Head()
		want += int(n)
	}
	var evs []store.Event
	for deadline := time.Now().Add(20 * time.Second); len(evs) < want; {
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
		if len(evs) < want && time.Now().After(deadline) {
			t.Fatalf("%d events stored, want %d", len(evs), want)
		}
		time.Sleep(50 * time.Millisecond)
	}
	next := map[string]uint64{}
	for _, e := range evs {
		i := strings.LastIndexByte(e.Key, '/')
		n, err := strconv.ParseUint(e.Key[i+1:], 10, 64)
		if err != nil {
			t.Fatalf("event key %q", e.Key)
		}
		if next[e.Node]+1 != n {
			t.Fatalf("node %s: event %d stored after %d (a gap or a repeat)", e.Node, n, next[e.Node])
		}
		next[e.Node] = n
	}
	if len(evs) != want || len(next) != 4 {
		t.Fatalf("%d events of %d nodes stored, want %d of 4", len(evs), len(next), want)
	}
	t.Logf("%d events of 4 nodes, each once and in order, over two hand-overs", len(evs))
}
