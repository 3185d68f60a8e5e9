package apiserver_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/apiserver/iamtest"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/watcher"
	dsec "dsec.dev/dsec/sdk/go"
)

// eventsEnv is an apiserver over a real store and one hollow edge with its
// event log, and a runner's token in each of projects a and b.
type eventsEnv struct {
	st           store.Store
	fleet        *watcher.Fixed
	log          *eventlog.Log
	admin, a, b  string // tokens
	aAdmin       string // an admin of project a
	api          *apiserver.Server
	url          string
	stopPulling  context.CancelFunc
	pullingEnded chan struct{}
}

func startEventsEnv(t *testing.T, dsn string) *eventsEnv {
	t.Helper()
	ctx := t.Context()
	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	e := &eventsEnv{st: st}
	for _, p := range []string{"a", "b"} {
		if _, err := st.CreateProject(ctx, iam.NodeAdmin(), p); err != nil {
			t.Fatal(err)
		}
	}
	for _, u := range []struct {
		name, project string
		role          iam.Role
		tok           *string
	}{{"admin", "", iam.Admin, &e.admin}, {"alice", "a", iam.Runner, &e.a}, {"bob", "b", iam.Runner, &e.b}, {"carol", "a", iam.Admin, &e.aAdmin}} {
		if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: u.name}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, iam.NodeAdmin(), u.name, u.project, u.role); err != nil {
			t.Fatal(err)
		}
		if *u.tok, _, err = st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: u.name, Project: u.project, Role: u.role}); err != nil {
			t.Fatal(err)
		}
	}
	e.log = eventlog.New("n1", 0)
	svc := edgesvc.New(hollow.New(hollow.Config{Node: "n1", Events: e.log}), nil, slog.New(slog.DiscardHandler))
	svc.SetEvents(e.log)
	e.fleet = watcher.NewFixed(watcher.Node{Member: watcher.Member{Name: "n1"}, Edge: svc})
	e.start(t)
	return e
}

// start serves a new apiserver (as a restarted one) and has it pull
// events until stop.
func (e *eventsEnv) start(t *testing.T) {
	t.Helper()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	e.api = apiserver.New(apiserver.Config{Name: "events", Auth: e.st, IAM: e.st, Events: e.st, Webhooks: e.st, Metrics: metrics.New(),
		WebhookAllowPrivate: true, WebhookTimeout: 2 * time.Second, WebhookBackoff: 50 * time.Millisecond}, e.st, e.fleet, log)
	hs := httptest.NewUnstartedServer(e.api.Handler())
	hs.Config.Protocols = new(http.Protocols)
	hs.Config.Protocols.SetHTTP1(true)
	hs.Config.Protocols.SetUnencryptedHTTP2(true)
	hs.Start()
	t.Cleanup(hs.Close)
	e.url = hs.URL
	ctx, cancel := context.WithCancel(context.Background())
	ended := make(chan struct{})
	e.stopPulling, e.pullingEnded = cancel, ended
	api := e.api
	go func() {
		defer close(ended)
		var wg sync.WaitGroup
		wg.Go(func() { api.RunEvents(ctx) })
		wg.Go(func() { api.RunWebhooks(ctx) })
		wg.Wait()
	}()
	t.Cleanup(e.stop)
}

// startAnother serves a second apiserver on the same store and edge,
// delivering and pulling beside the first until the test ends, and
// returns its URL.
func (e *eventsEnv) startAnother(t *testing.T) string {
	t.Helper()
	first := *e
	e.start(t)
	second := *e
	*e = first
	t.Cleanup(second.stop)
	return second.url
}

func (e *eventsEnv) stop() {
	e.stopPulling()
	<-e.pullingEnded
}

// kindsOf lists the kinds of sandbox id's events in evs.
func kindsOf(evs []dsec.SandboxEvent, id string) []string {
	var out []string
	for _, ev := range evs {
		if ev.SandboxID == id {
			out = append(out, ev.Kind)
		}
	}
	return out
}

// waitEvents lists q's events through c until want of sandbox id are
// there (or fails after a while: the apiserver pulls every 250 ms).
func waitEvents(t *testing.T, c *dsec.Client, q dsec.EventQuery, id string, want []string) []dsec.SandboxEvent {
	t.Helper()
	var got []dsec.SandboxEvent
	for range 200 {
		evs, _, err := c.Events(t.Context(), q)
		if err != nil {
			t.Fatalf("Events: %v", err)
		}
		got = evs
		if len(kindsOf(got, id)) >= len(want) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if k := kindsOf(got, id); !slices.Equal(k, want) {
		t.Fatalf("events of %s: %q, want %q", id, k, want)
	}
	return got
}

// TestEvents: a sandbox's life comes through ListEvents and FollowEvents
// in order, to its project and the root and not to another project; an
// apiserver started again (the first stopped) pulls the node's log from
// its start and stores nothing twice, and what happened while none
// pulled is stored. SQLite and PostgreSQL.
func TestEvents(t *testing.T) {
	for name, dsn := range iamtest.Databases() {
		t.Run(name, func(t *testing.T) { testEvents(t, dsn(t)) })
	}
}

func testEvents(t *testing.T, dsn string) {
	ctx := t.Context()
	e := startEventsEnv(t, dsn)
	admin, a, b := client(t, e.url, e.admin), client(t, e.url, e.a), client(t, e.url, e.b)

	// A follower in a, from the start.
	fctx, stopFollow := context.WithCancel(ctx)
	defer stopFollow()
	var mu sync.Mutex
	var followed []dsec.SandboxEvent
	var followErr error
	followDone := make(chan struct{})
	go func() {
		defer close(followDone)
		for ev, err := range a.FollowEvents(fctx, dsec.EventQuery{}) {
			mu.Lock()
			if err != nil {
				followErr = err
			} else {
				followed = append(followed, ev)
			}
			mu.Unlock()
		}
	}()

	sbA := check(a.Create(ctx, "busybox", nil))(t)
	check(sbA.Pause(ctx, false))(t)
	check(sbA.Resume(ctx))(t)
	if err := sbA.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	sbB := check(b.Create(ctx, "busybox", nil))(t)
	life := []string{"created", "paused", "resumed", "deleted"}
	evs := waitEvents(t, a, dsec.EventQuery{}, sbA.ID, life)
	for _, ev := range evs {
		if ev.Project != "a" || ev.Node != "n1" || ev.ID == 0 || ev.Key == "" || ev.At.IsZero() {
			t.Fatalf("a's token sees %+v: want project a's events with their fields", ev)
		}
	}
	waitEvents(t, b, dsec.EventQuery{}, sbB.ID, []string{"created"})
	all := waitEvents(t, admin, dsec.EventQuery{}, sbA.ID, life)
	if k := kindsOf(all, sbB.ID); !slices.Equal(k, []string{"created"}) {
		t.Fatalf("the root's admin sees b's sandbox's events %q, want [created]", k)
	}
	// Filters and the cursor.
	got := waitEvents(t, admin, dsec.EventQuery{Project: "a", Kinds: []string{"paused", "deleted"}}, sbA.ID, []string{"paused", "deleted"})
	if len(got) != 2 {
		t.Fatalf("a's paused and deleted events: %d, want 2", len(got))
	}
	page, next := check2(a.Events(ctx, dsec.EventQuery{Limit: 2}))(t)
	rest, _ := check2(a.Events(ctx, dsec.EventQuery{After: next}))(t)
	if k := kindsOf(append(page, rest...), sbA.ID); len(page) != 2 || !slices.Equal(k, life) {
		t.Fatalf("two pages from the cursor: %q (first %d), want %q", k, len(page), life)
	}
	// Another project's events are not seen, nor asked for.
	_, _, err := b.Events(ctx, dsec.EventQuery{Project: "a"})
	wantErr(t, "b's token reading a's events", err, dsec.ErrNotFound, "")
	// A kind no edge records is refused, not an empty page forever.
	_, _, err = a.Events(ctx, dsec.EventQuery{Kinds: []string{"fail"}})
	wantErr(t, "events of an unknown kind", err, dsec.ErrInvalidArgument, `"fail"`)

	// The follower saw the life in order, and nothing of b's.
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		k, kb, ferr := kindsOf(followed, sbA.ID), kindsOf(followed, sbB.ID), followErr
		mu.Unlock()
		if ferr != nil {
			t.Fatalf("FollowEvents: %v", ferr)
		}
		if len(kb) > 0 {
			t.Fatalf("a's follower saw b's sandbox's events %q", kb)
		}
		if slices.Equal(k, life) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a's follower saw %q of %s, want %q", k, sbA.ID, life)
		}
		time.Sleep(50 * time.Millisecond)
	}
	stopFollow()
	<-followDone

	// A restart: the apiserver stops; a sandbox lives and dies meanwhile;
	// a new one pulls the node's whole log again. Its counter of events
	// stored counts only the new ones: the first apiserver counted each
	// event it stored once, and the new one none of those again.
	before, _ := check2(admin.Events(ctx, dsec.EventQuery{}))(t)
	if got := eventsStored(t, e.url); got != float64(len(before)) {
		t.Errorf("dsec_events_stored_total = %v with %d events stored", got, len(before))
	}
	e.stop()
	if err := sbB.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	e.start(t)
	admin = client(t, e.url, e.admin)
	waitEvents(t, admin, dsec.EventQuery{}, sbB.ID, []string{"created", "deleted"})
	stored, _ := check2(admin.Events(ctx, dsec.EventQuery{}))(t)
	logged, _, _ := e.log.Read("", 0, 1000)
	var keys, want []string
	for _, ev := range stored {
		keys = append(keys, ev.Key)
	}
	for _, ev := range logged {
		want = append(want, ev.GetKey())
	}
	if !slices.Equal(keys, want) {
		t.Fatalf("stored after a restart: %q, want the node's log once each, in order: %q", keys, want)
	}
	if got := eventsStored(t, e.url); got != float64(len(stored)-len(before)) {
		t.Errorf("after a restart, dsec_events_stored_total = %v, want %d (the events stored while it was down), not the %d pulled again",
			got, len(stored)-len(before), len(stored))
	}
}

// eventsStored is dsec_events_stored_total on the apiserver at url.
func eventsStored(t *testing.T, url string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for line := range strings.Lines(string(body)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "dsec_events_stored_total "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("/metrics has no dsec_events_stored_total:\n%s", body)
	return 0
}

// check2 is check for calls that return two values and an error.
func check2[T, U any](v T, u U, err error) func(*testing.T) (T, U) {
	return func(t *testing.T) (T, U) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v, u
	}
}

// TestEventsPython runs the Python SDK's event tests
// (sdk/python/tests/test_events.py) and docs/python.md's events example
// against an apiserver on SQLite with a hollow edge.
func TestEventsPython(t *testing.T) {
	py := testutil.RequireCommand(t, "python3")
	e := startEventsEnv(t, filepath.Join(t.TempDir(), "meta.db"))
	tests := filepath.Join(testutil.RepoRoot(), "sdk", "python", "tests")
	cmd := exec.CommandContext(t.Context(), py, "-m", "unittest", "-v", "test_events")
	cmd.Dir = tests
	cmd.Env = append(os.Environ(), "DSEC_TEST_EVENTS_ADDR="+e.url, "DSEC_TEST_EVENTS_TOKEN="+e.a, "DSEC_TEST_EVENTS_ADMIN_TOKEN="+e.aAdmin)
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("OK")) || bytes.Contains(out, []byte("skipped")) {
		t.Fatalf("python3 -m unittest test_events: %v\n%s", err, out)
	}
	t.Logf("%s", out)

	example := pythonDocBlock(t, "follow_events(after=cursor")
	cmd = exec.CommandContext(t.Context(), py, "-c", example)
	cmd.Env = append(os.Environ(), "DSEC_ADDR="+e.url, "DSEC_TOKEN="+e.a, "DSEC_TOKEN_FILE=", "PYTHONPATH="+filepath.Dir(tests))
	if out, err := cmd.CombinedOutput(); err != nil || !bytes.Contains(out, []byte(" deleted ")) {
		t.Fatalf("docs/python.md's events example: %v\n%s", err, out)
	}
}

// TestFollowersEndWhenStopping: EndFollowers (the daemon calls it as it
// begins to stop) ends a follower waiting for events with Unavailable, the
// clients' word for "follow again elsewhere", rather than leave it to hold
// the server's shutdown.
func TestFollowersEndWhenStopping(t *testing.T) {
	e := startEventsEnv(t, filepath.Join(t.TempDir(), "meta.db"))
	a := client(t, e.url, e.a)
	sb := check(a.Create(t.Context(), "busybox", nil))(t)
	got := make(chan error, 1)
	go func() {
		for ev, err := range a.FollowEvents(t.Context(), dsec.EventQuery{}) {
			if err != nil {
				got <- err
				return
			}
			if ev.SandboxID == sb.ID && ev.Kind == "created" {
				// Caught up: now waiting for more.
				e.api.EndFollowers()
			}
		}
		got <- nil
	}()
	select {
	case err := <-got:
		if !errors.Is(err, dsec.ErrUnavailable) || !strings.Contains(err.Error(), "stopping") {
			t.Fatalf("a follower of a stopping apiserver ended with %v, want Unavailable saying it is stopping", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a follower of a stopping apiserver did not end")
	}
}
