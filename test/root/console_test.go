package root

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/chromedp/chromedp"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
)

// chromium is the headless browser the console test drives: $DSEC_CHROMIUM,
// else Debian's chromium on PATH.
func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("DSEC_CHROMIUM"); p != "" {
		return p
	}
	p, err := exec.LookPath("chromium")
	testutil.Require(t, err == nil, "chromium is not installed (apt-get install chromium)")
	return p
}

// browserCtx starts one headless Chromium for a test (as root it needs
// --no-sandbox) and returns a tab's context; everything goes with t.
func browserCtx(t *testing.T) context.Context {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium(t)),
		chromedp.Flag("headless", "new"),
		chromedp.NoSandbox,
		chromedp.Flag("disable-gpu", true),
		chromedp.WindowSize(1280, 800),
		chromedp.UserDataDir(t.TempDir()),
	)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	actx, acancel := chromedp.NewExecAllocator(ctx, opts...)
	bctx, bcancel := chromedp.NewContext(actx)
	t.Cleanup(func() { bcancel(); acancel(); cancel() })
	if err := chromedp.Do(bctx); err != nil { // starts the browser
		t.Fatalf("start chromium: %v", err)
	}
	return bctx
}

// TestConsole drives the web console in a real headless Chromium, as a
// person would: sign in with a runner token of a project, list its
// sandboxes (and not another project's), filter by label, inspect one,
// run a command and read its output, pause, resume and delete it; then
// as a viewer of the project, see a pause refused (403, nothing paused);
// another project's sandbox is a 404. With DSEC_CONSOLE_SCREENSHOTS=DIR
// it saves PNGs of the main pages there (docs/console/ holds them).
func TestConsole(t *testing.T) {
	d := startDaemon(t)
	ctx := t.Context()
	st, err := store.Open(ctx, d.DB())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for _, p := range []string{"web", "webx"} {
		if _, err := st.CreateProject(ctx, iam.NodeAdmin(), p); err != nil {
			t.Fatal(err)
		}
	}
	mint := func(name string, role iam.Role) string {
		t.Helper()
		if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: name, Project: "web"}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, iam.NodeAdmin(), name, "web", role); err != nil {
			t.Fatal(err)
		}
		tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: name, Project: "web", Role: role, TTL: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	runner, viewer := mint("web-runner", iam.Runner), mint("web-viewer", iam.Viewer)
	for res, limit := range map[store.Resource]int64{store.Sandboxes: 10, store.MemoryMB: 1024} {
		if err := st.SetLimit(ctx, iam.NodeAdmin(), "web", res, limit); err != nil {
			t.Fatal(err)
		}
	}
	small := func(labels map[string]string) *dsecv1.SandboxSpec {
		return &dsecv1.SandboxSpec{Environment: env, Cpus: 0.25, MemoryMb: 64, DiskMb: 32, Labels: labels}
	}
	sb1 := create(t, d, small(map[string]string{iam.ProjectLabel: "web", "run": "r1"}))
	sb2 := create(t, d, small(map[string]string{iam.ProjectLabel: "web", "run": "r2"}))
	other := create(t, d, small(map[string]string{iam.ProjectLabel: "webx"}))

	shots := os.Getenv("DSEC_CONSOLE_SCREENSHOTS")
	shot := func(bctx context.Context, name string) {
		t.Helper()
		if shots == "" {
			return
		}
		png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatalf("screenshot %s: %v", name, err)
		}
		if err := os.WriteFile(filepath.Join(shots, name+".png"), png, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	base := "http://" + d.Addr + "/console"
	b := browserCtx(t)
	// load runs actions that load a page and returns its HTTP status.
	load := func(what string, actions ...chromedp.Action[chromedp.Void]) int64 {
		t.Helper()
		resp, err := chromedp.RunResponse(b, actions...)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return resp.Status
	}
	text := func(sel string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(b, 15*time.Second)
		defer cancel()
		s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
		if err != nil {
			t.Fatalf("read %s: %v", sel, err)
		}
		return s
	}
	location := func() string {
		u, err := chromedp.Run(b, chromedp.Location())
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	body := func() string { return text("main") }
	signIn := func(tok string) {
		t.Helper()
		if code := load("open the console", chromedp.Navigate(base+"/sandboxes")); code != 200 || !strings.Contains(location(), "/console/signin") {
			t.Fatalf("without a session the console answered %d at %s, want the sign-in page", code, location())
		}
		shot(b, "signin")
		if code := load("sign in", chromedp.SendKeys(chromedp.CSS("#token"), tok), chromedp.Click(chromedp.CSS("#signin"))); code != 200 {
			t.Fatalf("sign-in: %d at %s", code, location())
		}
		if !strings.HasSuffix(location(), "/console/sandboxes") {
			t.Fatalf("signed in at %s, want the sandbox list", location())
		}
	}

	start := time.Now()
	signIn(runner)
	if who := text("#who"); who != "web-runner" {
		t.Errorf("signed in as %q", who)
	}
	list := body()
	if !strings.Contains(list, sb1.GetId()) || !strings.Contains(list, sb2.GetId()) || strings.Contains(list, other.GetId()) {
		t.Errorf("the runner of web's list: want %s and %s, not %s:\n%s", sb1.GetId(), sb2.GetId(), other.GetId(), list)
	}
	shot(b, "sandboxes")

	load("filter", chromedp.SetValue(chromedp.CSS("#f-label"), "run=r1"), chromedp.Click(chromedp.CSS("#f-apply")))
	if list := text("#sandboxes"); !strings.Contains(list, sb1.GetId()) || strings.Contains(list, sb2.GetId()) {
		t.Errorf("filtered on run=r1: %s", list)
	}
	if c := text("#count"); c != "1–1 of 1" {
		t.Errorf("filtered count %q", c)
	}

	load("inspect", chromedp.Click(chromedp.CSS(`a[href="/console/sandboxes/`+sb1.GetId()+`"]`)))
	if id, state := text("#sandbox-id"), text("#state"); id != sb1.GetId() || state != "running" {
		t.Errorf("inspect: %q %q", id, state)
	}
	if p := text("#project"); p != "web" {
		t.Errorf("inspect: project %q", p)
	}
	shot(b, "sandbox")

	if code := load("run a command", chromedp.SendKeys(chromedp.CSS("#command"), "echo hello-console; echo oops >&2; exit 3"), chromedp.Click(chromedp.CSS("#run"))); code != 200 {
		t.Fatalf("exec: %d: %s", code, body())
	}
	if out, exit := text("#output"), text("#exit"); !strings.Contains(out, "hello-console") || !strings.Contains(out, "oops") || !strings.HasPrefix(exit, "exit 3 ") {
		t.Errorf("the command's page: output %q, %q", out, exit)
	}
	shot(b, "exec")

	load("back", chromedp.Navigate(base+"/sandboxes/"+sb1.GetId()))
	load("pause", chromedp.Click(chromedp.CSS("#act-pause")))
	if s := text("#state"); s != "paused" {
		t.Errorf("after pause: %q", s)
	}
	load("resume", chromedp.Click(chromedp.CSS("#act-resume")))
	if s := text("#state"); s != "running" {
		t.Errorf("after resume: %q", s)
	}
	load("delete", chromedp.Click(chromedp.CSS("#act-delete")))
	if !strings.HasSuffix(location(), "/console/sandboxes") || strings.Contains(text("#sandboxes"), sb1.GetId()) {
		t.Errorf("after delete: at %s, the list still shows %s", location(), sb1.GetId())
	}
	got, err := d.Clients.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: sb1.GetId()}))
	if err == nil && got.Msg.GetState() != dsecv1.State_STATE_STOPPED {
		t.Errorf("the console deleted %s, the API says it is %s", sb1.GetId(), got.Msg.GetState())
	}

	if code := load("another project's sandbox", chromedp.Navigate(base+"/sandboxes/"+other.GetId())); code != 404 {
		t.Errorf("another project's sandbox: %d, want 404: %s", code, body())
	}
	// The events page: sb1's life newest first (its node's events reach
	// the store within a pull), not another project's; a sandbox's page
	// links to its own; followed live, the page reloads itself.
	var evText string
	for deadline := time.Now().Add(15 * time.Second); ; {
		load("events", chromedp.Navigate(base+"/events?sandbox="+sb1.GetId()))
		if evText = text("#events"); strings.Contains(evText, "deleted") || time.Now().After(deadline) {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	kinds := []string{}
	for _, line := range strings.Split(evText, "\n") {
		for _, k := range []string{"created", "paused", "resumed", "deleted"} {
			if strings.Contains(line, sb1.GetId()) && strings.Contains(line, "\t"+k+"\t") {
				kinds = append(kinds, k)
			}
		}
	}
	if strings.Join(kinds, ",") != "deleted,resumed,paused,created" {
		t.Errorf("sb1's events on the events page: %q, want deleted, resumed, paused, created (newest first):\n%s", kinds, evText)
	}
	load("all events", chromedp.Navigate(base+"/events"))
	if all := text("#events"); strings.Contains(all, other.GetId()) || !strings.Contains(all, sb2.GetId()) {
		t.Errorf("the events page shows another project's sandbox, or not sb2:\n%s", all)
	}
	load("sb2's page", chromedp.Navigate(base+"/sandboxes/"+sb2.GetId()))
	load("sb2's events", chromedp.Click(chromedp.CSS("#sandbox-events")))
	if evs := text("#events"); !strings.Contains(evs, sb2.GetId()) || strings.Contains(evs, sb1.GetId()) {
		t.Errorf("sb2's events link shows:\n%s", evs)
	}
	load("follow live", chromedp.Click(chromedp.CSS("#live-on")))
	if !strings.Contains(location(), "live=1") || !strings.Contains(text("#events-live"), "reloads every") {
		t.Errorf("following live: at %s, %q", location(), text("#events-live"))
	}
	for _, p := range []string{"nodes", "pools", "layers", "projects", "events"} {
		if code := load(p, chromedp.Navigate(base+"/"+p)); code != 200 {
			t.Errorf("page %s: %d: %s", p, code, body())
		}
		if p == "nodes" && !strings.Contains(text("#nodes"), "healthy") {
			t.Errorf("the nodes page: %s", text("#nodes"))
		}
		// The node's use: its host's busy CPUs (a rate over two of its
		// reports, seconds apart by now) and its memory in use.
		if p == "nodes" && (!strings.Contains(text("#nodes td.cpu"), " CPUs (") || !strings.Contains(text("#nodes td.memory"), "iB of ")) {
			t.Errorf("the nodes page shows no CPU or memory use: %q, %q", text("#nodes td.cpu"), text("#nodes td.memory"))
		}
		shot(b, p)
	}

	load("sign out", chromedp.Click(chromedp.CSS(".who button")))
	if !strings.Contains(location(), "/console/signin") {
		t.Errorf("after sign-out at %s", location())
	}
	signIn(viewer)
	load("inspect as a viewer", chromedp.Navigate(base+"/sandboxes/"+sb2.GetId()))
	if code := load("pause as a viewer", chromedp.Click(chromedp.CSS("#act-pause"))); code != 403 || !strings.Contains(body(), "needs runner") {
		t.Errorf("a viewer's pause: %d, want 403 saying it needs runner: %s", code, body())
	}
	got, err = d.Clients.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: sb2.GetId()}))
	if err != nil || got.Msg.GetState() != dsecv1.State_STATE_RUNNING {
		t.Errorf("after a viewer's refused pause %s is %s (%v), want running", sb2.GetId(), got.Msg.GetState(), err)
	}
	t.Logf("the browser's walk took %v", time.Since(start).Round(time.Millisecond))
}
