package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// sdkMetadataQuery encodes a metadata filter as E2B's JS SDK does: each
// key and value with encodeURIComponent, those joined by URLSearchParams
// (form encoding), and the whole with encodeURIComponent again as the
// query parameter's value.
func sdkMetadataQuery(md map[string]string) string {
	var pairs []string
	for _, k := range slices.Sorted(maps.Keys(md)) {
		pairs = append(pairs, url.QueryEscape(encodeURIComponent(k))+"="+url.QueryEscape(encodeURIComponent(md[k])))
	}
	return "metadata=" + encodeURIComponent(strings.Join(pairs, "&"))
}

// encodeURIComponent is JavaScript's, as far as these tests need.
func encodeURIComponent(s string) string {
	return strings.ReplaceAll(url.QueryEscape(s), "+", "%20")
}

func TestParseMetadataQuery(t *testing.T) {
	for _, md := range []map[string]string{
		{"user": "abc"},
		{"user": "abc", "app": "prod"},
		{"a b": "c&d=e", "ünï": "100%", "k/with/slash": "v+plus"},
	} {
		q, err := url.ParseQuery(sdkMetadataQuery(md))
		if err != nil {
			t.Fatal(err)
		}
		got, err := parseMetadataQuery(q.Get("metadata"))
		if err != nil {
			t.Fatalf("parse %v: %v", md, err)
		}
		if diff := cmp.Diff(md, got); diff != "" {
			t.Errorf("metadata %v (-want +got):\n%s", md, diff)
		}
	}
	for _, bad := range []string{"novalue", "a=b=c", "=v", "%zz=1"} {
		if _, err := parseMetadataQuery(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("parse %q: %v, want invalid argument", bad, err)
		}
	}
}

func TestPaginate(t *testing.T) {
	var items []pageItem
	for i := range 7 {
		// Pairs with one start time, to test the tie break.
		items = append(items, pageItem{At: int64(100 + i/2), ID: fmt.Sprintf("id%d", i)})
	}
	for _, asc := range []bool{false, true} {
		var got []pageItem
		token := ""
		pages := 0
		for {
			page, next, err := paginate(items, 3, token, asc)
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, page...)
			pages++
			if next == "" {
				break
			}
			token = next
			if pages > 10 {
				t.Fatal("paging does not end")
			}
		}
		if pages != 3 {
			t.Errorf("asc=%v: %d pages of 3 for 7 items", asc, pages)
		}
		want := slices.Clone(items)
		slices.SortFunc(want, compareItems)
		if asc {
			slices.Reverse(want)
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("asc=%v: pages (-want +got):\n%s", asc, diff)
		}
		if !asc && (got[0].At != 103 || got[1].ID != "id4" || got[2].ID != "id5") {
			t.Errorf("newest first, ties by ID: got %v", got[:3])
		}
	}
	// A cursor survives the item it names going away.
	page, _, _ := paginate(items, 2, "", false)
	rest := slices.DeleteFunc(slices.Clone(items), func(it pageItem) bool { return it == page[1] })
	next, _, err := paginate(rest, 10, cursorOf(page[1]), false)
	if err != nil || len(next) != 5 {
		t.Errorf("after a removed cursor item: %d items, %v; want 5", len(next), err)
	}
	if _, _, err := paginate(items, 2, "not a token!", false); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad token: %v", err)
	}
}

func TestSpecOf(t *testing.T) {
	ten := int64(10)
	yes, no := true, false
	spec, err := specOf(newSandbox{TemplateID: "base", Timeout: &ten, AutoPause: &yes, AutoResume: &autoResume{Enabled: false},
		Metadata: map[string]string{"k": "v"}, EnvVars: map[string]string{"A": "1"}}, "e2b-base")
	if err != nil {
		t.Fatal(err)
	}
	want := &dsecv1.SandboxSpec{Environment: "e2b-base", TtlSeconds: 10, IdleTimeoutSeconds: -1, Env: map[string]string{"A": "1"},
		Labels:    map[string]string{templateLabel: "base", metadataPrefix + "k": "v"},
		OnTimeout: dsecv1.OnTimeout_ON_TIMEOUT_PAUSE, AutoResume: &no, AllowPrivilegeEscalation: true}
	if !proto.Equal(spec, want) {
		t.Errorf("spec = %v, want %v", spec, want)
	}
	if spec, _ := specOf(newSandbox{TemplateID: "x"}, "x"); spec.GetTtlSeconds() != defaultTimeout || spec.GetNetworkRules() != nil || spec.AutoResume != nil {
		t.Errorf("default spec = %v", spec)
	}
	if spec, _ := specOf(newSandbox{AllowInternetAccess: &yes, Network: &networkConfig{DenyOut: []string{"10.0.0.0/8"}}}, "x"); !cmp.Equal(spec.GetNetworkRules(), map[string]bool{"0.0.0.0/0": true, "10.0.0.0/8": false}) {
		t.Errorf("network rules = %v", spec.GetNetworkRules())
	}
	neg := int64(-1)
	for _, b := range []newSandbox{{Timeout: &neg}, {VolumeMounts: []json.RawMessage{[]byte(`{}`)}}, {Mcp: []byte(`{"x":1}`)}} {
		if _, err := specOf(b, "x"); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("specOf(%+v): %v, want invalid argument", b, err)
		}
	}
	var ar newSandbox
	if err := json.Unmarshal([]byte(`{"autoResume": true, "unknownField": {"a": 1}}`), &ar); err != nil || ar.AutoResume == nil || !ar.AutoResume.Enabled {
		t.Errorf("autoResume as a bool: %+v, %v", ar.AutoResume, err)
	}
}

func TestStatusOf(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want int
	}{
		{errdefs.ErrInvalidArgument, 400},
		{fmt.Errorf("x: %w", errdefs.ErrNotFound), 404},
		{errdefs.ErrAlreadyExists, 409},
		{errdefs.ErrFailedPrecondition, 409},
		{errdefs.ErrUnauthenticated, 401},
		{errdefs.ErrResourceExhausted, 429},
		{errdefs.ErrUnavailable, 503},
		{connect.NewError(connect.CodeNotFound, errors.New("sandbox sb-x")), 404},
		{errors.New("boom"), 500},
	} {
		if got := statusOf(tc.err); got != tc.want {
			t.Errorf("statusOf(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

// fakeAPI is the part of dsec's SandboxService the control plane calls,
// over a map of sandboxes.
type fakeAPI struct {
	dsecv1connect.SandboxServiceClient // nil: any other call panics
	mu                                 sync.Mutex
	sbs                                map[string]*dsecv1.Sandbox
	n                                  int
}

func (f *fakeAPI) Create(ctx context.Context, req *connect.Request[dsecv1.CreateRequest]) (*connect.Response[dsecv1.CreateResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
	now := time.Now().UnixMilli() + int64(f.n) // distinct start times
	sb := &dsecv1.Sandbox{Id: fmt.Sprintf("sb-n1-%04d", f.n), Node: "n1", Spec: req.Msg.GetSpec(), State: dsecv1.State_STATE_RUNNING,
		StartedUnixMs: now, ExpiresUnixMs: now + req.Msg.GetSpec().GetTtlSeconds()*1000}
	f.sbs[sb.Id] = sb
	return connect.NewResponse(&dsecv1.CreateResponse{Sandboxes: []*dsecv1.Sandbox{proto.Clone(sb).(*dsecv1.Sandbox)}}), nil
}

func (f *fakeAPI) Get(ctx context.Context, req *connect.Request[dsecv1.GetRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sbs[req.Msg.GetId()]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("sandbox %s", req.Msg.GetId()))
	}
	return connect.NewResponse(proto.Clone(sb).(*dsecv1.Sandbox)), nil
}

func (f *fakeAPI) List(ctx context.Context, req *connect.Request[dsecv1.ListRequest]) (*connect.Response[dsecv1.ListResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := &dsecv1.ListResponse{}
	for _, sb := range f.sbs {
		match := true
		for k, v := range req.Msg.GetLabels() {
			match = match && sb.GetSpec().GetLabels()[k] == v
		}
		if match {
			out.Sandboxes = append(out.Sandboxes, proto.Clone(sb).(*dsecv1.Sandbox))
		}
	}
	return connect.NewResponse(out), nil
}

func (f *fakeAPI) Delete(ctx context.Context, req *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if sb, ok := f.sbs[req.Msg.GetId()]; ok {
		sb.State = dsecv1.State_STATE_STOPPED
	}
	return connect.NewResponse(&dsecv1.DeleteResponse{}), nil
}

type fakeAuth struct{ token string }

func (a fakeAuth) Authenticate(ctx context.Context, token string) (iam.Authority, error) {
	if token != a.token {
		return iam.Authority{}, errdefs.ErrUnauthenticated
	}
	return iam.Authority{TokenID: "p"}, nil
}

// TestControlPlane drives the REST API over the fake: the translation of
// requests, answers, paging and errors.
func TestControlPlane(t *testing.T) {
	const token = "dsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
	key, err := APIKey(token)
	if err != nil {
		t.Fatal(err)
	}
	api := &fakeAPI{sbs: map[string]*dsecv1.Sandbox{}}
	h, err := NewHandler(Config{API: api, Auth: fakeAuth{token}, Signer: NewSigner([]byte(strings.Repeat("s", 32)))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	call := func(method, path, body, apiKey string) (int, http.Header, []byte) {
		t.Helper()
		req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-API-KEY", apiKey)
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, resp.Header, b
	}

	// Creates: v1 and v2, with metadata.
	var ids []string
	for i := range 5 {
		path := "/v2/sandboxes"
		if i == 0 {
			path = "/sandboxes"
		}
		team := "a"
		if i%2 == 1 {
			team = "b"
		}
		st, _, b := call("POST", path, fmt.Sprintf(`{"templateID":"base","metadata":{"team":%q,"n":"%d"},"timeout":60,"someNewField":1}`, team, i), key)
		if st != http.StatusCreated {
			t.Fatalf("create: %d %s", st, b)
		}
		var sb sandboxBody
		if err := json.Unmarshal(b, &sb); err != nil {
			t.Fatal(err)
		}
		if sb.EnvdVersion != EnvdVersion || sb.EnvdAccessToken == "" || sb.TemplateID != "base" {
			t.Errorf("create answered %+v", sb)
		}
		if got := api.sbs[mustDsecID(t, sb.SandboxID)].GetSpec().GetEnvironment(); got != "e2b-base" {
			t.Errorf("template base made environment %q", got)
		}
		ids = append(ids, sb.SandboxID)
	}

	// Info gives the metadata back.
	st, _, b := call("GET", "/sandboxes/"+ids[1], "", key)
	var d sandboxDetail
	if err := json.Unmarshal(b, &d); st != 200 || err != nil {
		t.Fatalf("info: %d %s %v", st, b, err)
	}
	if !cmp.Equal(d.Metadata, map[string]string{"team": "b", "n": "1"}) || d.State != "running" || d.EnvdAccessToken == "" {
		t.Errorf("info = %+v", d)
	}

	// List with a metadata filter, in pages of 1.
	var seen []string
	next := ""
	for {
		q := sdkMetadataQuery(map[string]string{"team": "a"}) + "&limit=1&state=running,paused"
		if next != "" {
			q += "&nextToken=" + url.QueryEscape(next)
		}
		st, hdr, b := call("GET", "/v2/sandboxes?"+q, "", key)
		var page []listedSandbox
		if err := json.Unmarshal(b, &page); st != 200 || err != nil || len(page) != 1 {
			t.Fatalf("list: %d %s %v", st, b, err)
		}
		seen = append(seen, page[0].SandboxID)
		if next = hdr.Get("X-Next-Token"); next == "" {
			break
		}
	}
	if want := []string{ids[4], ids[2], ids[0]}; !cmp.Equal(seen, want) {
		t.Errorf("listed team a newest first: %v, want %v", seen, want)
	}

	// Kill twice: 204, then 404 in E2B's shape.
	if st, _, b := call("DELETE", "/sandboxes/"+ids[0], "", key); st != http.StatusNoContent {
		t.Errorf("kill: %d %s", st, b)
	}
	st, _, b = call("DELETE", "/sandboxes/"+ids[0], "", key)
	var e errorBody
	if err := json.Unmarshal(b, &e); st != 404 || err != nil || e.Code != 404 || e.Message == "" {
		t.Errorf("kill again: %d %s", st, b)
	}

	for _, tc := range []struct {
		name, method, path, body, key string
		want                          int
	}{
		{"wrong key", "GET", "/v2/sandboxes", "", "e2b_00ff", 401},
		{"no key", "GET", "/v2/sandboxes", "", "", 401},
		{"bad JSON", "POST", "/v2/sandboxes", `{"templateID":`, key, 400},
		{"wrong type", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":"x"}`, key, 400},
		{"no template", "POST", "/v2/sandboxes", `{}`, key, 400},
		{"oversized", "POST", "/v2/sandboxes", `{"templateID":"` + strings.Repeat("x", maxBody) + `"}`, key, 400},
		{"unknown ID", "GET", "/sandboxes/notours", "", key, 404},
		{"bad metadata", "GET", "/v2/sandboxes?metadata=nopair", "", key, 400},
		{"bad state", "GET", "/v2/sandboxes?state=dead", "", key, 400},
		{"bad limit", "GET", "/v2/sandboxes?limit=0", "", key, 400},
		{"bad token", "GET", "/v2/sandboxes?nextToken=zz!", "", key, 400},
		{"timeout missing", "POST", "/sandboxes/" + ids[1] + "/timeout", `{}`, key, 400},
		{"fork too many", "POST", "/sandboxes/" + ids[1] + "/fork", `{"count":17}`, key, 400},
		{"unknown call", "GET", "/nothing/here", "", key, 404},
	} {
		st, _, b := call(tc.method, tc.path, tc.body, tc.key)
		var e errorBody
		if err := json.Unmarshal(b, &e); st != tc.want || err != nil || e.Code != tc.want || e.Message == "" {
			t.Errorf("%s: %d %s, want %d with {code,message}", tc.name, st, b, tc.want)
		}
	}
}

func mustDsecID(t *testing.T, e2bID string) string {
	t.Helper()
	id, err := DsecID(e2bID)
	if err != nil {
		t.Fatal(err)
	}
	return id
}
