package root

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/e2b"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// e2bClient calls a test daemon's E2B API as E2B's SDKs do: JSON over
// HTTP/1.1 with X-API-KEY.
type e2bClient struct {
	t    *testing.T
	base string
	key  string
	hc   *http.Client
}

func newE2BClient(t *testing.T, d *testutil.Daemon) *e2bClient {
	return &e2bClient{t: t, base: "http://" + d.E2BAddr, key: d.E2BKey(), hc: &http.Client{Timeout: 2 * time.Minute}}
}

// call sends body (marshalled unless a string or nil) and returns the
// status, the headers and the decoded-later body.
func (c *e2bClient) call(method, path string, body any) (int, http.Header, []byte) {
	c.t.Helper()
	req, err := http.NewRequest(method, c.base+path, requestBody(c.t, body))
	if err != nil {
		c.t.Fatal(err)
	}
	req.Header.Set("X-API-KEY", c.key)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatalf("%s %s: read the answer: %v", method, path, err)
	}
	return resp.StatusCode, resp.Header, b
}

// must calls and checks the status, decoding the answer into out (if not
// nil).
func (c *e2bClient) must(want int, method, path string, body, out any) http.Header {
	c.t.Helper()
	st, hdr, b := c.call(method, path, body)
	if st != want {
		c.t.Fatalf("%s %s: %d %s, want %d", method, path, st, b, want)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			c.t.Fatalf("%s %s: %v in %s", method, path, err, b)
		}
	}
	return hdr
}

// mustError calls and checks that the answer is E2B's error shape with
// status want.
func (c *e2bClient) mustError(want int, method, path string, body any) string {
	c.t.Helper()
	st, _, b := c.call(method, path, body)
	var e struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if err := json.Unmarshal(b, &e); st != want || err != nil || e.Code != want || e.Message == "" {
		c.t.Fatalf("%s %s: %d %s, want %d with {code, message}", method, path, st, b, want)
	}
	return e.Message
}

// The E2B answers the test reads.
type e2bCreated struct {
	SandboxID       string `json:"sandboxID"`
	TemplateID      string `json:"templateID"`
	ClientID        string `json:"clientID"`
	EnvdVersion     string `json:"envdVersion"`
	EnvdAccessToken string `json:"envdAccessToken"`
	Domain          string `json:"domain"`
}

type e2bListed struct {
	SandboxID  string            `json:"sandboxID"`
	TemplateID string            `json:"templateID"`
	State      string            `json:"state"`
	Metadata   map[string]string `json:"metadata"`
	StartedAt  time.Time         `json:"startedAt"`
	EndAt      time.Time         `json:"endAt"`
	CPUCount   int               `json:"cpuCount"`
	MemoryMB   int               `json:"memoryMB"`

	EnvdAccessToken string `json:"envdAccessToken"`
}

// e2bMetadataQuery encodes a metadata filter as E2B's JS SDK does (each
// key and value encoded, joined, and the whole encoded again).
func e2bMetadataQuery(md map[string]string) string {
	var pairs []string
	for k, v := range md {
		pairs = append(pairs, url.QueryEscape(encodeURIComponent(k))+"="+url.QueryEscape(encodeURIComponent(v)))
	}
	sort.Strings(pairs)
	return "metadata=" + encodeURIComponent(strings.Join(pairs, "&"))
}

// encodeURIComponent is JavaScript's, as far as this test needs.
func encodeURIComponent(s string) string {
	return strings.ReplaceAll(url.QueryEscape(s), "+", "%20")
}

// TestE2BControl drives E2B's REST API on a real dsecd with net/http:
// create (v1 and v2), info, list with a metadata filter and paging,
// timeout, connect, pause and connect-resumes, metrics, kill twice, and
// the errors of a wrong key and bad JSON.
func TestE2BControl(t *testing.T) {
	d := startDaemon(t)
	c := newE2BClient(t, d)

	// Bad input first: nothing made.
	c.key = "e2b_00ff00ff"
	c.mustError(401, "GET", "/v2/sandboxes", nil)
	c.mustError(401, "POST", "/v2/sandboxes", map[string]any{"templateID": env})
	c.key = d.E2BKey()
	c.mustError(400, "POST", "/v2/sandboxes", `{"templateID": `)
	c.mustError(400, "POST", "/v2/sandboxes", `{"templateID": "`+env+`", "timeout": "soon"}`)
	if msg := c.mustError(404, "POST", "/v2/sandboxes", map[string]any{"templateID": "no-such-env:1"}); !strings.Contains(msg, "no-such-env") {
		t.Errorf("unknown template: %q does not name it", msg)
	}

	// Creates: v1 and v2, each answering once the sandbox serves, with
	// metadata, env vars and a timeout; an unknown field is ignored.
	created := map[string]e2bCreated{}
	var ids []string
	for i, path := range []string{"/sandboxes", "/v2/sandboxes", "/v2/sandboxes", "/v2/sandboxes"} {
		team := "ctl"
		if i == 3 {
			team = "other"
		}
		var sb e2bCreated
		c.must(201, "POST", path, map[string]any{
			"templateID": env, "timeout": 120, "metadata": map[string]string{"team": team, "n": fmt.Sprint(i), "odd key&=": "v a/l%"},
			"envVars": map[string]string{"E2B_TEST": fmt.Sprintf("v%d", i)}, "someFutureField": map[string]int{"x": 1},
		}, &sb)
		if sb.EnvdVersion != e2b.EnvdVersion || sb.EnvdAccessToken == "" || sb.TemplateID != env || sb.ClientID == "" || sb.Domain == "" {
			t.Fatalf("create answered %+v", sb)
		}
		dsecID, err := e2b.DsecID(sb.SandboxID)
		if err != nil {
			t.Fatal(err)
		}
		// It serves at once, with the env vars.
		if got := strings.TrimSpace(mustSh(t, d, dsecID, "echo $E2B_TEST")); got != fmt.Sprintf("v%d", i) {
			t.Errorf("envVars E2B_TEST in %s = %q", sb.SandboxID, got)
		}
		created[sb.SandboxID] = sb
		ids = append(ids, sb.SandboxID)
		time.Sleep(5 * time.Millisecond) // distinct start times, for the order
	}
	defer func() {
		for _, id := range ids {
			c.call("DELETE", "/sandboxes/"+id, nil)
		}
	}()
	first := ids[0]

	// Info: the list fields, the metadata exactly as given, the token.
	var info e2bListed
	c.must(200, "GET", "/sandboxes/"+first, nil, &info)
	wantMD := map[string]string{"team": "ctl", "n": "0", "odd key&=": "v a/l%"}
	if fmt.Sprint(info.Metadata) != fmt.Sprint(wantMD) || info.State != "running" || info.TemplateID != env ||
		info.EnvdAccessToken != created[first].EnvdAccessToken || info.CPUCount < 1 {
		t.Errorf("info = %+v", info)
	}
	if left := time.Until(info.EndAt); left < 100*time.Second || left > 121*time.Second {
		t.Errorf("endAt is %s away, want about 120 s", left)
	}

	// List v2 by metadata, one per page: newest first, the other team's
	// left out, x-next-token until the last page.
	var paged []string
	next := ""
	for pages := 0; ; pages++ {
		q := e2bMetadataQuery(map[string]string{"team": "ctl", "odd key&=": "v a/l%"}) + "&state=running,paused&limit=1"
		if next != "" {
			q += "&nextToken=" + url.QueryEscape(next)
		}
		var page []e2bListed
		hdr := c.must(200, "GET", "/v2/sandboxes?"+q, nil, &page)
		if len(page) != 1 || pages > 3 {
			t.Fatalf("page %d: %v", pages, page)
		}
		paged = append(paged, page[0].SandboxID)
		if next = hdr.Get("X-Next-Token"); next == "" {
			break
		}
	}
	if want := []string{ids[2], ids[1], ids[0]}; fmt.Sprint(paged) != fmt.Sprint(want) {
		t.Errorf("listed team ctl: %v, want %v", paged, want)
	}
	var v1 []e2bListed
	c.must(200, "GET", "/sandboxes?"+e2bMetadataQuery(map[string]string{"team": "other"}), nil, &v1)
	if len(v1) != 1 || v1[0].SandboxID != ids[3] || v1[0].Metadata["team"] != "other" {
		t.Errorf("v1 list of team other: %+v", v1)
	}

	// Timeout: set, and connect only ever extends it.
	c.must(204, "POST", "/sandboxes/"+first+"/timeout", map[string]int{"timeout": 600}, nil)
	c.must(200, "GET", "/sandboxes/"+first, nil, &info)
	if left := time.Until(info.EndAt); left < 590*time.Second || left > 601*time.Second {
		t.Errorf("after timeout 600: endAt is %s away", left)
	}
	var conn e2bCreated
	c.must(200, "POST", "/v2/sandboxes/"+first+"/connect", map[string]int{"timeout": 30}, &conn)
	if conn.SandboxID != first || conn.EnvdAccessToken != created[first].EnvdAccessToken {
		t.Errorf("connect answered %+v", conn)
	}
	c.must(200, "GET", "/sandboxes/"+first, nil, &info)
	if left := time.Until(info.EndAt); left < 580*time.Second {
		t.Errorf("connect with timeout 30 shortened the timeout: endAt is %s away", left)
	}
	c.must(200, "POST", "/sandboxes/"+first+"/connect", map[string]int{"timeout": 900}, &conn)
	c.must(200, "GET", "/sandboxes/"+first, nil, &info)
	if left := time.Until(info.EndAt); left < 890*time.Second {
		t.Errorf("connect (v1) with timeout 900: endAt is %s away", left)
	}
	c.mustError(409, "POST", "/sandboxes/"+first+"/resume", map[string]int{"timeout": 60})

	// Metrics: one sample, with limits, that sees a busy CPU and a file
	// written.
	firstID, _ := e2b.DsecID(first)
	mustSh(t, d, firstID, "dd if=/dev/urandom of=/tmp/blob bs=1M count=4 2>/dev/null && sync")
	background(t, d, firstID, "while :; do :; done")
	var ms []struct {
		CPUCount   int     `json:"cpuCount"`
		CPUUsedPct float64 `json:"cpuUsedPct"`
		MemUsed    int64   `json:"memUsed"`
		MemTotal   int64   `json:"memTotal"`
		DiskUsed   int64   `json:"diskUsed"`
		DiskTotal  int64   `json:"diskTotal"`
		Timestamp  string  `json:"timestamp"`
	}
	// The loop's share of a CPU shows once it has run a while; on a
	// loaded machine that takes longer than on an idle one.
	for deadline := time.Now().Add(20 * time.Second); ; {
		c.must(200, "GET", "/sandboxes/"+first+"/metrics", nil, &ms)
		if len(ms) != 1 || ms[0].CPUUsedPct >= 10 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if len(ms) != 1 || ms[0].CPUCount < 1 || ms[0].MemUsed <= 0 || ms[0].MemTotal < ms[0].MemUsed || ms[0].DiskTotal < ms[0].DiskUsed ||
		ms[0].DiskUsed < 4<<20 || ms[0].CPUUsedPct < 10 || ms[0].CPUUsedPct > 100 || ms[0].Timestamp == "" {
		t.Errorf("metrics with a 4 MiB file and a busy loop = %+v", ms)
	}
	t.Logf("metrics: %+v", ms) // the busy loop ends with the sandbox, killed below
	if out, errOut, code := d.CLI("", "top", firstID); code != 0 || !strings.Contains(out, firstID) || !strings.Contains(out, "%") {
		t.Errorf("dsec top: %d %s%s", code, out, errOut)
	}

	// The CLI's timeout is the same call.
	if out, errOut, code := d.CLI("", "timeout", firstID, "700s"); code != 0 || !strings.Contains(out, "ends at") {
		t.Errorf("dsec timeout: %d %s%s", code, out, errOut)
	}
	c.must(200, "GET", "/sandboxes/"+first, nil, &info)
	if left := time.Until(info.EndAt); left < 690*time.Second || left > 701*time.Second {
		t.Errorf("after dsec timeout 700s: endAt is %s away", left)
	}

	// dsec e2b env prints what this client uses: the address the server
	// says it serves E2B's API on.
	out, errOut, code := d.CLI("", "e2b", "env")
	want := fmt.Sprintf("export E2B_API_URL=http://%s E2B_SANDBOX_URL=http://%s E2B_API_KEY=%s\n", d.E2BAddr, d.E2BAddr, d.E2BKey())
	if code != 0 || out != want {
		t.Errorf("dsec e2b env: %d %q%s, want %q", code, out, errOut, want)
	}

	// Pause: 204, again 409; listed paused; connect resumes it (201) and
	// it serves again, with the same access token.
	second := ids[1]
	c.must(204, "POST", "/sandboxes/"+second+"/pause", nil, nil)
	c.mustError(409, "POST", "/sandboxes/"+second+"/pause", `{}`)
	c.must(200, "GET", "/sandboxes/"+second, nil, &info)
	if info.State != "paused" {
		t.Errorf("after pause: state %q", info.State)
	}
	var paused []e2bListed
	c.must(200, "GET", "/v2/sandboxes?state=paused", nil, &paused)
	if len(paused) != 1 || paused[0].SandboxID != second {
		t.Errorf("listed paused: %+v", paused)
	}
	c.must(201, "POST", "/v2/sandboxes/"+second+"/connect", map[string]int{"timeout": 60}, &conn)
	if conn.EnvdAccessToken != created[second].EnvdAccessToken {
		t.Errorf("connect after pause gave another access token")
	}
	c.must(200, "GET", "/sandboxes/"+second, nil, &info)
	dsecSecond, _ := e2b.DsecID(second)
	if got := strings.TrimSpace(mustSh(t, d, dsecSecond, "echo $E2B_TEST")); info.State != "running" || got != "v1" {
		t.Errorf("after connect: state %q, E2B_TEST %q", info.State, got)
	}

	// Kill: 204, then 404 in E2B's shape (the SDK's kill returns false),
	// and the sandbox is gone for info, timeout and connect.
	c.must(204, "DELETE", "/sandboxes/"+first, nil, nil)
	c.mustError(404, "DELETE", "/sandboxes/"+first, nil)
	c.mustError(404, "GET", "/sandboxes/"+first, nil)
	c.mustError(404, "POST", "/sandboxes/"+first+"/timeout", map[string]int{"timeout": 60})
	c.mustError(404, "POST", "/v2/sandboxes/"+first+"/connect", map[string]int{"timeout": 60})
	c.mustError(404, "DELETE", "/sandboxes/notasandbox", nil)
	c.mustError(400, "POST", "/sandboxes/"+second+"/fork", map[string]int{"count": 17})
}

// TestE2BControlSnapshotAndFork: a snapshot's ID creates sandboxes as a
// template does, and fork makes children that carry on the source's files.
func TestE2BControlSnapshotAndFork(t *testing.T) {
	d := startDaemon(t)
	c := newE2BClient(t, d)
	var src e2bCreated
	c.must(201, "POST", "/v2/sandboxes", map[string]any{"templateID": env, "metadata": map[string]string{"role": "source"}}, &src)
	var made []string
	defer func() {
		for _, id := range append(made, src.SandboxID) {
			c.call("DELETE", "/sandboxes/"+id, nil)
		}
	}()
	srcID, _ := e2b.DsecID(src.SandboxID)
	mustSh(t, d, srcID, "echo carried > /tmp/mark")

	var snap struct {
		SnapshotID string   `json:"snapshotID"`
		Names      []string `json:"names"`
	}
	c.must(201, "POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]string{"name": "e2b-ctl-snap"}, &snap)
	if snap.SnapshotID == "" || len(snap.Names) == 0 {
		t.Fatalf("snapshot answered %+v", snap)
	}
	// A second snapshot of the same files shares the first's layer, and
	// both are listed.
	var snap2 struct {
		SnapshotID string `json:"snapshotID"`
	}
	c.must(201, "POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]string{"name": "e2b-ctl-snap2"}, &snap2)
	var listed []struct {
		SnapshotID string `json:"snapshotID"`
	}
	c.must(200, "GET", "/snapshots?sandboxID="+src.SandboxID, nil, &listed)
	got := []string{}
	for _, l := range listed {
		got = append(got, l.SnapshotID)
	}
	sort.Strings(got)
	if want := []string{snap.SnapshotID, snap2.SnapshotID}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("snapshots of the source: %v, want %v", got, want)
	}
	c.must(200, "GET", "/snapshots?limit=1", nil, &listed)
	if len(listed) != 1 {
		t.Errorf("snapshots, limit 1: %+v", listed)
	}
	c.must(204, "DELETE", "/templates/"+snap2.SnapshotID, nil, nil)
	var fromSnap e2bCreated
	c.must(201, "POST", "/v2/sandboxes", map[string]any{"templateID": snap.SnapshotID}, &fromSnap)
	made = append(made, fromSnap.SandboxID)
	id, _ := e2b.DsecID(fromSnap.SandboxID)
	if got := strings.TrimSpace(mustSh(t, d, id, "cat /tmp/mark")); got != "carried" {
		t.Errorf("a sandbox from the snapshot reads %q", got)
	}

	var forks []struct {
		Sandbox *e2bCreated `json:"sandbox"`
		Error   *struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	c.must(201, "POST", "/sandboxes/"+src.SandboxID+"/fork", map[string]int{"count": 2, "timeout": 60}, &forks)
	if len(forks) != 2 {
		t.Fatalf("fork of 2 answered %d results", len(forks))
	}
	for _, f := range forks {
		if f.Sandbox == nil {
			t.Fatalf("fork failed: %+v", f.Error)
		}
		made = append(made, f.Sandbox.SandboxID)
		var info e2bListed
		c.must(200, "GET", "/sandboxes/"+f.Sandbox.SandboxID, nil, &info)
		if info.Metadata["role"] != "source" || time.Until(info.EndAt) > 61*time.Second {
			t.Errorf("fork child %+v: want the source's metadata and a 60 s timeout", info)
		}
		id, _ := e2b.DsecID(f.Sandbox.SandboxID)
		if got := strings.TrimSpace(mustSh(t, d, id, "cat /tmp/mark")); got != "carried" {
			t.Errorf("fork child reads %q", got)
		}
	}
	c.must(204, "DELETE", "/templates/"+snap.SnapshotID, nil, nil)
	c.mustError(404, "DELETE", "/templates/"+snap.SnapshotID, nil)
}

// TestE2BProjects: an E2B API key is a dsec token, and its project bounds
// what it sees through E2B's API as through dsec's: a runner key of one
// project finds no sandbox of another (404 by ID, for a kill too) and
// does not list it, while its own sandbox lands in its project.
func TestE2BProjects(t *testing.T) {
	d := startDaemon(t)
	ctx := t.Context()
	st, err := store.Open(ctx, d.DB())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.CreateProject(ctx, iam.NodeAdmin(), "e2bp"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "e2bp-runner", Kind: store.KindService, Project: "e2bp"}); err != nil {
		t.Fatal(err)
	}
	if err := st.Grant(ctx, iam.NodeAdmin(), "e2bp-runner", "e2bp", iam.Runner); err != nil {
		t.Fatal(err)
	}
	tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "e2bp-runner", Project: "e2bp", Role: iam.Runner})
	if err != nil {
		t.Fatal(err)
	}
	admin := newE2BClient(t, d)
	runner := newE2BClient(t, d)
	if runner.key, err = e2b.APIKey(tok); err != nil {
		t.Fatal(err)
	}
	var theirs, mine e2bCreated
	admin.must(201, "POST", "/v2/sandboxes", map[string]any{"templateID": env, "timeout": 120}, &theirs)
	defer admin.call("DELETE", "/sandboxes/"+theirs.SandboxID, nil)
	runner.must(201, "POST", "/v2/sandboxes", map[string]any{"templateID": env, "timeout": 120}, &mine)
	defer admin.call("DELETE", "/sandboxes/"+mine.SandboxID, nil)

	runner.mustError(404, "GET", "/sandboxes/"+theirs.SandboxID, nil)
	runner.mustError(404, "DELETE", "/sandboxes/"+theirs.SandboxID, nil)
	listed := func(c *e2bClient) map[string]bool {
		var l []e2bListed
		c.must(200, "GET", "/v2/sandboxes", nil, &l)
		out := map[string]bool{}
		for _, sb := range l {
			out[sb.SandboxID] = true
		}
		return out
	}
	if l := listed(runner); l[theirs.SandboxID] || !l[mine.SandboxID] {
		t.Errorf("the runner lists %v: want its own sandbox and not the admin's", l)
	}
	if l := listed(admin); !l[theirs.SandboxID] || !l[mine.SandboxID] {
		t.Errorf("the admin lists %v: want both", l)
	}
	cl, err := dsec.Dial(d.Addr, dsec.DialOptions{Token: d.Token()})
	if err != nil {
		t.Fatal(err)
	}
	id, err := e2b.DsecID(mine.SandboxID)
	if err != nil {
		t.Fatal(err)
	}
	sb, err := cl.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	if err != nil || sb.Msg.GetSpec().GetLabels()[iam.ProjectLabel] != "e2bp" {
		t.Errorf("the runner's sandbox %s: %v, labels %v, want project e2bp", id, err, sb.Msg.GetSpec().GetLabels())
	}
	runner.must(204, "DELETE", "/sandboxes/"+mine.SandboxID, nil, nil)
}
