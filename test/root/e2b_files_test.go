package root

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	fspb "dsec.dev/dsec/api/gen/e2b/filesystem"
	"dsec.dev/dsec/api/gen/e2b/filesystem/filesystempbconnect"
	"dsec.dev/dsec/internal/e2b"
	"dsec.dev/dsec/internal/testutil"
)

// e2bSandbox is a sandbox seen through E2B's envd surface: its IDs, its
// access token and clients that send the headers the SDK sends.
type e2bSandbox struct {
	d     *testutil.Daemon
	id    string // dsec's
	e2bID string
	token string // envd access token
	base  string // http://E2BAddr
	fs    filesystempbconnect.FilesystemClient
	http  *http.Client // adds the sandbox headers
}

// headerTransport adds E2B's data-plane headers to every request.
type headerTransport struct {
	h    http.Header
	next http.RoundTripper
}

func (t headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	for k, v := range t.h {
		r.Header[k] = v
	}
	return t.next.RoundTrip(r)
}

// newE2BFilesSandbox makes a sandbox of environment (through dsec's own
// API) with E2B's user "user" (uid 1000, home /home/user): "" is the
// busybox base, where the user is added.
func newE2BFilesSandbox(t *testing.T, d *testutil.Daemon, environment string) *e2bSandbox {
	t.Helper()
	sb := create(t, d, &dsecv1.SandboxSpec{Environment: environment})
	if environment == "" {
		mustSh(t, d, sb.GetId(), "echo 'user:x:1000:1000::/home/user:/bin/sh' >>/etc/passwd && echo 'user:x:1000:' >>/etc/group && mkdir -p /home/user && chown 1000:1000 /home/user")
	}
	s := &e2bSandbox{d: d, id: sb.GetId(), e2bID: e2b.SandboxID(sb.GetId()), base: "http://" + d.E2BAddr}
	s.token = e2b.NewSigner(d.E2BSecret()).AccessToken(s.id)
	h := http.Header{}
	h.Set("E2b-Sandbox-Id", s.e2bID)
	h.Set("E2b-Sandbox-Port", e2b.EnvdPort)
	h.Set("X-Access-Token", s.token)
	h.Set("Authorization", "Basic dXNlcjo=") // "user:"
	s.http = &http.Client{Transport: headerTransport{h: h, next: http.DefaultTransport}, Timeout: 60 * time.Second}
	s.fs = filesystempbconnect.NewFilesystemClient(s.http, s.base, connect.WithProtoJSON())
	return s
}

// upload posts body to /files with the sandbox's headers.
func (s *e2bSandbox) upload(t *testing.T, query, contentType string, body io.Reader) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, s.base+"/files?"+query, body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", contentType)
	resp, err := s.http.Do(req)
	if err != nil {
		t.Fatalf("POST /files?%s: %v", query, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// multipartBody is a form of "file" parts, file name → content.
func multipartBody(t *testing.T, files ...[2]string) (string, *bytes.Buffer) {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	for _, f := range files {
		w, err := mw.CreateFormFile("file", f[0])
		if err != nil {
			t.Fatal(err)
		}
		w.Write([]byte(f[1]))
	}
	mw.Close()
	return mw.FormDataContentType(), &buf
}

// get fetches /files with c (nil: no headers at all) and returns the status,
// the headers and the body.
func (s *e2bSandbox) get(t *testing.T, c *http.Client, query string) (int, http.Header, []byte) {
	t.Helper()
	if c == nil {
		c = &http.Client{Timeout: 60 * time.Second}
	}
	resp, err := c.Get(s.base + "/files?" + query)
	if err != nil {
		t.Fatalf("GET /files?%s: %v", query, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b
}

func (s *e2bSandbox) stat(ctx context.Context, p string) (*fspb.EntryInfo, error) {
	resp, err := s.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: p}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetEntry(), nil
}

type uploadedEntry struct {
	Name, Type, Path string
}

func decodeUploaded(t *testing.T, b []byte) []uploadedEntry {
	t.Helper()
	var out []uploadedEntry
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("upload answer %q: %v", b, err)
	}
	return out
}

// TestE2BFiles drives envd's filesystem service and /files on the busybox
// base with E2B's user added.
func TestE2BFiles(t *testing.T) {
	d := startDaemon(t)
	e2bFilesSuite(t, d, "")
}

// testE2BFilesOnE2BBase (TestE2BBase/Files) runs the same on the e2b-base
// environment (Debian, as E2B's base template).
func testE2BFilesOnE2BBase(t *testing.T, d *testutil.Daemon) {
	e2bFilesSuite(t, d, testutil.E2BBaseEnv+":latest")
}

func e2bFilesSuite(t *testing.T, d *testutil.Daemon, environment string) {
	s := newE2BFilesSandbox(t, d, environment)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	t.Run("write and read, multipart", func(t *testing.T) {
		ct, body := multipartBody(t, [2]string{"ignored.txt", "hello, e2b\n"})
		code, b := s.upload(t, "path=mp/sub/a.txt", ct, body)
		if code != http.StatusOK {
			t.Fatalf("upload: %d %s", code, b)
		}
		got := decodeUploaded(t, b)
		if len(got) != 1 || got[0] != (uploadedEntry{"a.txt", "file", "/home/user/mp/sub/a.txt"}) {
			t.Fatalf("upload answered %+v", got)
		}
		code, h, data := s.get(t, s.http, "path=mp/sub/a.txt")
		if code != http.StatusOK || string(data) != "hello, e2b\n" {
			t.Fatalf("read: %d %q", code, data)
		}
		if h.Get("Content-Type") != "application/octet-stream" || !strings.Contains(h.Get("Content-Disposition"), `filename=a.txt`) {
			t.Errorf("read headers: %v", h)
		}
		// writeFiles: several parts, each to its own file name.
		ct, body = multipartBody(t, [2]string{"multi/x.txt", "x"}, [2]string{"/home/user/multi/deep/y.txt", "yy"})
		code, b = s.upload(t, "", ct, body)
		if code != http.StatusOK {
			t.Fatalf("upload of two: %d %s", code, b)
		}
		got = decodeUploaded(t, b)
		want := []uploadedEntry{{"x.txt", "file", "/home/user/multi/x.txt"}, {"y.txt", "file", "/home/user/multi/deep/y.txt"}}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("upload of two answered %+v, want %+v", got, want)
		}
		if _, _, data := s.get(t, s.http, "path=/home/user/multi/deep/y.txt"); string(data) != "yy" {
			t.Fatalf("read y.txt: %q", data)
		}
		e, err := s.stat(ctx, "multi/x.txt")
		if err != nil || e.GetOwner() != "user" || e.GetGroup() != "user" {
			t.Fatalf("a written file is not the user's: %v %v", e, err)
		}
	})

	t.Run("write and read, octet-stream, larger than a chunk", func(t *testing.T) {
		big := make([]byte, 9<<20+123)
		rand.Read(big)
		code, b := s.upload(t, "path=big/blob.bin", "application/octet-stream", bytes.NewReader(big))
		if code != http.StatusOK {
			t.Fatalf("upload: %d %s", code, b)
		}
		if got := decodeUploaded(t, b); len(got) != 1 || got[0].Path != "/home/user/big/blob.bin" {
			t.Fatalf("upload answered %+v", got)
		}
		code, _, data := s.get(t, s.http, "path=big/blob.bin")
		if code != http.StatusOK || !bytes.Equal(data, big) {
			t.Fatalf("read back: %d, %d bytes, equal %v", code, len(data), bytes.Equal(data, big))
		}
		// An empty file, overwriting.
		if code, b := s.upload(t, "path=big/blob.bin", "application/octet-stream", strings.NewReader("")); code != http.StatusOK {
			t.Fatalf("empty upload: %d %s", code, b)
		}
		if code, _, data := s.get(t, s.http, "path=big/blob.bin"); code != http.StatusOK || len(data) != 0 {
			t.Fatalf("read empty: %d %d bytes", code, len(data))
		}
	})

	t.Run("read errors", func(t *testing.T) {
		code, _, b := s.get(t, s.http, "path=nope.txt")
		var eb struct {
			Code    int
			Message string
		}
		if code != http.StatusNotFound || json.Unmarshal(b, &eb) != nil || eb.Code != 404 || eb.Message == "" {
			t.Fatalf("missing file: %d %s", code, b)
		}
		if code, _, b := s.get(t, s.http, "path=/home/user"); code != http.StatusBadRequest {
			t.Fatalf("a directory: %d %s", code, b)
		}
		if code, b := s.upload(t, "path=x", "text/plain", strings.NewReader("x")); code != http.StatusBadRequest {
			t.Fatalf("a text/plain upload: %d %s", code, b)
		}
	})

	t.Run("list, stat, exists", func(t *testing.T) {
		for _, f := range []string{"tree/a.txt", "tree/sub/b.txt", "tree/sub/deeper/c.txt"} {
			if code, b := s.upload(t, "path="+f, "application/octet-stream", strings.NewReader(f)); code != http.StatusOK {
				t.Fatalf("upload %s: %d %s", f, code, b)
			}
		}
		paths := func(depth uint32) []string {
			resp, err := s.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: "tree", Depth: depth}))
			if err != nil {
				t.Fatalf("list depth %d: %v", depth, err)
			}
			var out []string
			for _, e := range resp.Msg.GetEntries() {
				out = append(out, e.GetPath()+":"+e.GetType().String())
			}
			return out
		}
		if got, want := paths(1), []string{"/home/user/tree/a.txt:FILE_TYPE_FILE", "/home/user/tree/sub:FILE_TYPE_DIRECTORY"}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("depth 1: %v, want %v", got, want)
		}
		if got, want := paths(2), []string{"/home/user/tree/a.txt:FILE_TYPE_FILE", "/home/user/tree/sub:FILE_TYPE_DIRECTORY",
			"/home/user/tree/sub/b.txt:FILE_TYPE_FILE", "/home/user/tree/sub/deeper:FILE_TYPE_DIRECTORY"}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("depth 2: %v, want %v", got, want)
		}
		e, err := s.stat(ctx, "tree/a.txt")
		if err != nil {
			t.Fatal(err)
		}
		if e.GetName() != "a.txt" || e.GetType() != fspb.FileType_FILE_TYPE_FILE || e.GetPath() != "/home/user/tree/a.txt" || e.GetSize() != 10 ||
			e.GetMode() != 0o644 || e.GetPermissions() != "-rw-r--r--" || e.GetOwner() != "user" || e.GetGroup() != "user" ||
			time.Since(e.GetModifiedTime().AsTime()) > 5*time.Minute {
			t.Errorf("stat: %v", e)
		}
		if e, err := s.stat(ctx, "/"); err != nil || e.GetType() != fspb.FileType_FILE_TYPE_DIRECTORY || e.GetOwner() != "root" || !strings.HasPrefix(e.GetPermissions(), "d") {
			t.Errorf("stat /: %v %v", e, err)
		}
		if _, err := s.stat(ctx, "tree/none"); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("stat of a missing path: %v, want not_found", err)
		}
		if _, err := s.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: "tree/none"})); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("list of a missing path: %v, want not_found", err)
		}
		if _, err := s.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: "tree/a.txt"})); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("list of a file: %v, want invalid_argument", err)
		}
	})

	t.Run("makeDir, rename, remove", func(t *testing.T) {
		resp, err := s.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: "made/a/b"}))
		if err != nil || resp.Msg.GetEntry().GetType() != fspb.FileType_FILE_TYPE_DIRECTORY || resp.Msg.GetEntry().GetPath() != "/home/user/made/a/b" {
			t.Fatalf("makeDir: %v %v", resp, err)
		}
		if _, err := s.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: "made/a/b"})); connect.CodeOf(err) != connect.CodeAlreadyExists {
			t.Fatalf("makeDir again: %v, want already_exists", err)
		}
		if code, b := s.upload(t, "path=made/a/b/f.txt", "application/octet-stream", strings.NewReader("moved")); code != http.StatusOK {
			t.Fatalf("upload: %d %s", code, b)
		}
		mv, err := s.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: "made/a/b/f.txt", Destination: "made/elsewhere/g.txt"}))
		if err != nil || mv.Msg.GetEntry().GetPath() != "/home/user/made/elsewhere/g.txt" || mv.Msg.GetEntry().GetName() != "g.txt" {
			t.Fatalf("rename: %v %v", mv, err)
		}
		if _, err := s.stat(ctx, "made/a/b/f.txt"); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("the old name after a rename: %v", err)
		}
		if _, _, data := s.get(t, s.http, "path=made/elsewhere/g.txt"); string(data) != "moved" {
			t.Errorf("read the renamed file: %q", data)
		}
		if _, err := s.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: "made/none", Destination: "made/x"})); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("rename of a missing path: %v, want not_found", err)
		}
		if _, err := s.fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: "made"})); err != nil {
			t.Fatalf("remove a tree: %v", err)
		}
		if _, err := s.stat(ctx, "made"); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("a removed tree: %v", err)
		}
		if _, err := s.fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: "made"})); err != nil {
			t.Errorf("remove of a missing path (envd answers ok): %v", err)
		}
	})

	t.Run("watch", func(t *testing.T) {
		if _, err := s.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: "watched/sub"})); err != nil {
			t.Fatal(err)
		}
		wctx, wcancel := context.WithTimeout(ctx, 60*time.Second)
		defer wcancel()
		req := connect.NewRequest(&fspb.WatchDirRequest{Path: "watched", Recursive: true})
		req.Header().Set("Keepalive-Ping-Interval", "1")
		stream, err := s.fs.WatchDir(wctx, req)
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		if !stream.Receive() || stream.Msg().GetStart() == nil {
			t.Fatalf("the first event is not start: %v %v", stream.Msg(), stream.Err())
		}
		events := make(chan *fspb.FilesystemEvent, 100)
		keepalives := make(chan struct{}, 100)
		go func() {
			defer close(events)
			for stream.Receive() {
				if e := stream.Msg().GetFilesystem(); e != nil {
					events <- e
				} else if stream.Msg().GetKeepalive() != nil {
					select {
					case keepalives <- struct{}{}:
					default:
					}
				}
			}
		}()
		waitFor := func(name string, typ fspb.EventType) {
			t.Helper()
			for {
				select {
				case e, ok := <-events:
					if !ok {
						t.Fatalf("the watch ended before %s %s: %v", typ, name, stream.Err())
					}
					if e.GetName() == name && e.GetType() == typ {
						return
					}
				case <-time.After(15 * time.Second):
					t.Fatalf("no %s event for %s", typ, name)
				}
			}
		}
		if code, b := s.upload(t, "path=watched/new.txt", "application/octet-stream", strings.NewReader("one")); code != http.StatusOK {
			t.Fatalf("upload: %d %s", code, b)
		}
		waitFor("new.txt", fspb.EventType_EVENT_TYPE_CREATE)
		if code, b := s.upload(t, "path=watched/new.txt", "application/octet-stream", strings.NewReader("two, longer")); code != http.StatusOK {
			t.Fatalf("upload: %d %s", code, b)
		}
		waitFor("new.txt", fspb.EventType_EVENT_TYPE_WRITE)
		if code, b := s.upload(t, "path=watched/sub/deep.txt", "application/octet-stream", strings.NewReader("deep")); code != http.StatusOK {
			t.Fatalf("upload: %d %s", code, b)
		}
		waitFor("sub/deep.txt", fspb.EventType_EVENT_TYPE_WRITE)
		if _, err := s.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: "watched/new.txt", Destination: "watched/renamed.txt"})); err != nil {
			t.Fatal(err)
		}
		waitFor("new.txt", fspb.EventType_EVENT_TYPE_RENAME)
		if _, err := s.fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: "watched/renamed.txt"})); err != nil {
			t.Fatal(err)
		}
		waitFor("renamed.txt", fspb.EventType_EVENT_TYPE_REMOVE)
		select {
		case <-keepalives:
		case <-time.After(5 * time.Second):
			t.Errorf("no keepalive within 5 s at a 1 s interval")
		}

		// The polled watcher calls.
		cw, err := s.fs.CreateWatcher(ctx, connect.NewRequest(&fspb.CreateWatcherRequest{Path: "watched", IncludeEntry: true}))
		if err != nil {
			t.Fatal(err)
		}
		id := cw.Msg.GetWatcherId()
		if code, b := s.upload(t, "path=watched/polled.txt", "application/octet-stream", strings.NewReader("p")); code != http.StatusOK {
			t.Fatalf("upload: %d %s", code, b)
		}
		deadline := time.Now().Add(15 * time.Second)
		for found := false; !found; {
			if time.Now().After(deadline) {
				t.Fatal("GetWatcherEvents never gave the create of polled.txt")
			}
			evs, err := s.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: id}))
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range evs.Msg.GetEvents() {
				if e.GetName() == "polled.txt" && e.GetType() == fspb.EventType_EVENT_TYPE_CREATE {
					found = true
					if e.GetEntry().GetPath() != "/home/user/watched/polled.txt" || e.GetEntry().GetType() != fspb.FileType_FILE_TYPE_FILE {
						t.Errorf("the create's entry: %v", e.GetEntry())
					}
				}
			}
			time.Sleep(100 * time.Millisecond)
		}
		if _, err := s.fs.RemoveWatcher(ctx, connect.NewRequest(&fspb.RemoveWatcherRequest{WatcherId: id})); err != nil {
			t.Fatal(err)
		}
		if _, err := s.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: id})); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("a removed watcher: %v, want not_found", err)
		}
		if _, err := s.fs.WatchDir(wctx, connect.NewRequest(&fspb.WatchDirRequest{Path: "watched/none"})); err == nil {
			// A server stream's error may come with the first Receive.
			st, _ := s.fs.WatchDir(wctx, connect.NewRequest(&fspb.WatchDirRequest{Path: "watched/none"}))
			if st.Receive() || connect.CodeOf(st.Err()) != connect.CodeNotFound {
				t.Errorf("watch of a missing directory: %v, want not_found", st.Err())
			}
			st.Close()
		} else if connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("watch of a missing directory: %v, want not_found", err)
		}
	})

	t.Run("signed URLs", func(t *testing.T) {
		if code, b := s.upload(t, "path=signed.txt", "application/octet-stream", strings.NewReader("signed content")); code != http.StatusOK {
			t.Fatalf("upload: %d %s", code, b)
		}
		// downloadUrl: no headers at all, as a browser or curl sends it.
		sig := e2b.FileSignature("signed.txt", "read", "", s.token, 0)
		code, _, data := s.get(t, nil, "path=signed.txt&signature="+url.QueryEscape(sig))
		if code != http.StatusOK || string(data) != "signed content" {
			t.Fatalf("signed download without headers: %d %q", code, data)
		}
		exp := time.Now().Add(time.Minute).Unix()
		sig = e2b.FileSignature("signed.txt", "read", "user", s.token, exp)
		q := "path=signed.txt&username=user&signature=" + url.QueryEscape(sig) + "&signature_expiration=" + strconv.FormatInt(exp, 10)
		if code, _, data := s.get(t, nil, q); code != http.StatusOK || string(data) != "signed content" {
			t.Fatalf("signed download with an expiry: %d %q", code, data)
		}
		// With the sandbox header but no access token, as the SDK's own
		// requests to a signed URL.
		plain := &http.Client{Transport: headerTransport{h: http.Header{"E2b-Sandbox-Id": {s.e2bID}, "E2b-Sandbox-Port": {e2b.EnvdPort}}, next: http.DefaultTransport}}
		if code, _, data := s.get(t, plain, q); code != http.StatusOK || string(data) != "signed content" {
			t.Fatalf("signed download with the sandbox header: %d %q", code, data)
		}
		old := time.Now().Add(-time.Minute).Unix()
		sig = e2b.FileSignature("signed.txt", "read", "", s.token, old)
		q = "path=signed.txt&signature=" + url.QueryEscape(sig) + "&signature_expiration=" + strconv.FormatInt(old, 10)
		if code, _, b := s.get(t, nil, q); code != http.StatusUnauthorized {
			t.Errorf("expired signature without headers: %d %s", code, b)
		}
		if code, _, b := s.get(t, plain, q); code != http.StatusUnauthorized {
			t.Errorf("expired signature with the sandbox header: %d %s", code, b)
		}
		wrong := e2b.FileSignature("other.txt", "read", "", s.token, 0)
		if code, _, b := s.get(t, nil, "path=signed.txt&signature="+url.QueryEscape(wrong)); code != http.StatusUnauthorized {
			t.Errorf("a signature of another path: %d %s", code, b)
		}
		// A read signature does not write.
		sig = e2b.FileSignature("up.txt", "read", "", s.token, 0)
		ct, body := multipartBody(t, [2]string{"up.txt", "nope"})
		if code := postNoHeaders(t, s.base+"/files?path=up.txt&signature="+url.QueryEscape(sig), ct, body); code != http.StatusUnauthorized {
			t.Errorf("upload with a read signature: %d", code)
		}
		// uploadUrl: a write signature, multipart, no headers.
		sig = e2b.FileSignature("up.txt", "write", "", s.token, 0)
		ct, body = multipartBody(t, [2]string{"up.txt", "uploaded by URL"})
		if code := postNoHeaders(t, s.base+"/files?path=up.txt&signature="+url.QueryEscape(sig), ct, body); code != http.StatusOK {
			t.Fatalf("signed upload: %d", code)
		}
		if _, _, data := s.get(t, s.http, "path=up.txt"); string(data) != "uploaded by URL" {
			t.Errorf("read the signed upload: %q", data)
		}
	})

	t.Run("missing or wrong access token", func(t *testing.T) {
		h := http.Header{"E2b-Sandbox-Id": {s.e2bID}, "E2b-Sandbox-Port": {e2b.EnvdPort}}
		noToken := &http.Client{Transport: headerTransport{h: h, next: http.DefaultTransport}}
		fs := filesystempbconnect.NewFilesystemClient(noToken, s.base, connect.WithProtoJSON())
		if _, err := fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: "/"})); connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Errorf("stat without a token: %v, want unauthenticated", err)
		}
		if code, _, b := s.get(t, noToken, "path=signed.txt"); code != http.StatusUnauthorized {
			t.Errorf("read without a token: %d %s", code, b)
		}
		h = h.Clone()
		h.Set("X-Access-Token", strings.Repeat("0", len(s.token)))
		wrongToken := &http.Client{Transport: headerTransport{h: h, next: http.DefaultTransport}}
		if code, _, b := s.get(t, wrongToken, "path=signed.txt"); code != http.StatusUnauthorized {
			t.Errorf("read with a wrong token: %d %s", code, b)
		}
		sig := e2b.FileSignature("signed.txt", "read", "", s.token, 0)
		if code, _, b := s.get(t, wrongToken, "path=signed.txt&signature="+url.QueryEscape(sig)); code != http.StatusUnauthorized {
			t.Errorf("a good signature with a wrong token: %d %s", code, b)
		}
	})

	t.Run("paths stay inside the sandbox", func(t *testing.T) {
		b := make([]byte, 6)
		rand.Read(b)
		name := fmt.Sprintf("dsec-e2b-escape-%x", b)
		host := filepath.Join("/tmp", name)
		t.Cleanup(func() { os.Remove(host); os.Remove(host + "-link") })
		if code, b := s.upload(t, "path=../../../../../../../tmp/"+name, "application/octet-stream", strings.NewReader("dotdot")); code != http.StatusOK {
			t.Fatalf("upload with ..: %d %s", code, b)
		}
		mustSh(t, d, s.id, "ln -s / /home/user/rootlink && ln -s /tmp /home/user/tmplink")
		if code, b := s.upload(t, "path=tmplink/"+name+"-link", "application/octet-stream", strings.NewReader("link")); code != http.StatusOK {
			t.Fatalf("upload through a symlink: %d %s", code, b)
		}
		ct, body := multipartBody(t, [2]string{"rootlink/tmp/" + name + "-multi", "multi"})
		if code, b := s.upload(t, "", ct, body); code != http.StatusOK {
			t.Fatalf("multipart upload through a symlink: %d %s", code, b)
		}
		for _, p := range []string{host, host + "-link", host + "-multi"} {
			if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s was written on the host: %v", p, err)
			}
		}
		// They are in the sandbox's /tmp instead.
		if out := mustSh(t, d, s.id, "cat /tmp/"+name+" /tmp/"+name+"-link /tmp/"+name+"-multi"); out != "dotdotlinkmulti" {
			t.Errorf("inside the sandbox: %q", out)
		}
		if _, _, data := s.get(t, s.http, "path=rootlink/tmp/"+name); string(data) != "dotdot" {
			t.Errorf("read through a symlink: %q", data)
		}
		// The symlink as envd describes it: the target's type, the link's permissions.
		e, err := s.stat(ctx, "tmplink")
		if err != nil || e.GetType() != fspb.FileType_FILE_TYPE_DIRECTORY || e.GetSymlinkTarget() != "/tmp" || !strings.HasPrefix(e.GetPermissions(), "L") {
			t.Errorf("stat of a symlink: %v %v", e, err)
		}
		// What the user may not write stays unwritten.
		if code, b := s.upload(t, "path=/etc/passwd", "application/octet-stream", strings.NewReader("x")); code == http.StatusOK {
			t.Errorf("user overwrote /etc/passwd: %s", b)
		}
	})

	t.Run("a killed sandbox ends its watch", func(t *testing.T) {
		other := newE2BFilesSandbox(t, d, environment)
		wctx, wcancel := context.WithTimeout(ctx, 60*time.Second)
		defer wcancel()
		stream, err := other.fs.WatchDir(wctx, connect.NewRequest(&fspb.WatchDirRequest{Path: "/home/user"}))
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		if !stream.Receive() || stream.Msg().GetStart() == nil {
			t.Fatalf("no start: %v", stream.Err())
		}
		if _, err := d.Clients.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: other.id})); err != nil {
			t.Fatal(err)
		}
		for stream.Receive() {
		}
		if stream.Err() == nil || wctx.Err() != nil {
			t.Errorf("the watch of a deleted sandbox ended with %v (deadline: %v)", stream.Err(), wctx.Err())
		}
	})
}

func postNoHeaders(t *testing.T, u, contentType string, body io.Reader) int {
	t.Helper()
	resp, err := http.Post(u, contentType, body)
	if err != nil {
		t.Fatalf("POST %s: %v", u, err)
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}
