package metrics

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/testutil"
)

func TestAPI(t *testing.T) {
	r := New()
	a := r.API(func() (int, int) { return 3, 2 })
	a.Request("/dsec.v1.SandboxService/Create", "ok", time.Millisecond)
	a.Request("/dsec.v1.SandboxService/Create", "ok", time.Millisecond)
	a.Request("/dsec.v1.SandboxService/Get", "not_found", time.Millisecond)
	a.Placement("placed")
	a.Placement("all_full")
	var n int64 = 7
	r.Counters(Func{Name: "dsec_test_total", Help: "A test's counter.", Value: func() float64 { return float64(n) }})
	r.StoreErrors().Of("postgres")("ReserveCreate")
	r.StoreErrors().Of("postgres")("ReserveCreate") // registered once, counted twice
	r.BlobErrors().Of("s3")("get_range")
	r.Layers(func() (LayerTotals, bool) {
		return LayerTotals{BytesRead: 10, BytesFetched: 20, ChunksFetched: 2, MemoryHits: 3, DiskHits: 4, CacheMisses: 5, FetchErrors: 7, GetErrors: 3, ReadErrors: 2, VerifyErrors: 1, MemoryBytes: 100, DiskBytes: 200}, true
	})
	fams := scrape(t, r)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"dsec_api_request_seconds", map[string]string{"procedure": "/dsec.v1.SandboxService/Create", "code": "ok"}, 2},
		{"dsec_api_request_seconds", map[string]string{"procedure": "/dsec.v1.SandboxService/Get", "code": "not_found"}, 1},
		{"dsec_placement_decisions_total", map[string]string{"outcome": "placed"}, 1},
		{"dsec_placement_decisions_total", map[string]string{"outcome": "all_full"}, 1},
		{"dsec_placement_nodes", map[string]string{"state": "known"}, 3},
		{"dsec_placement_nodes", map[string]string{"state": "healthy"}, 2},
		{"dsec_test_total", map[string]string{}, 7},
		{"dsec_store_errors_total", map[string]string{"store": "postgres", "op": "ReserveCreate"}, 2},
		{"dsec_blob_errors_total", map[string]string{"store": "s3", "op": "get_range"}, 1},
		{"dsec_layer_read_bytes_total", map[string]string{}, 10},
		{"dsec_layer_fetched_bytes_total", map[string]string{}, 20},
		{"dsec_layer_fetched_chunks_total", map[string]string{}, 2},
		{"dsec_layer_chunk_reads_total", map[string]string{"from": "memory"}, 3},
		{"dsec_layer_chunk_reads_total", map[string]string{"from": "disk"}, 4},
		{"dsec_layer_chunk_reads_total", map[string]string{"from": "fetch"}, 5},
		{"dsec_layer_fetch_errors_total", map[string]string{"op": "get"}, 3},
		{"dsec_layer_fetch_errors_total", map[string]string{"op": "read"}, 2},
		{"dsec_layer_fetch_errors_total", map[string]string{"op": "verify"}, 1},
		{"dsec_layer_fetch_errors_total", map[string]string{"op": "unknown"}, 1}, // a loader's that did not count by op
		{"dsec_layer_cache_bytes", map[string]string{"tier": "memory"}, 100},
		{"dsec_layer_cache_bytes", map[string]string{"tier": "disk"}, 200},
	} {
		if got := testutil.MetricValue(fams, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}

	// A loader that does not answer leaves the layer metrics out.
	r2 := New()
	r2.Layers(func() (LayerTotals, bool) { return LayerTotals{}, false })
	if f := scrape(t, r2); f["dsec_layer_read_bytes_total"] != nil {
		t.Errorf("a loader that did not answer was scraped: %v", f["dsec_layer_read_bytes_total"])
	}
}

func TestParseCPUUsed(t *testing.T) {
	got, cpus, err := parseCPUUsed(strings.NewReader("cpu  100 20 30 4000 50 6 7 8 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n" +
		"cpu2 1 2 3 4 5 6 7 8 0 0\ncpu3 1 2 3 4 5 6 7 8 0 0\nintr 1 2 3\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := (100 + 20 + 30 + 6 + 7 + 8) / 100.0; got != want {
		t.Errorf("used = %v, want %v", got, want)
	}
	if cpus != 3 {
		t.Errorf("cpus = %d, want 3 (the cpuN lines: cpu1 is offline)", cpus)
	}
	for _, bad := range []string{"", "intr 1 2 3\n", "cpu 1 2 x 4 5 6 7 8\n", "cpu  1 2 3 4 5 6 7 8\nintr 1\n"} {
		if _, _, err := parseCPUUsed(strings.NewReader(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
	if _, err := os.Stat("/proc/stat"); err == nil {
		r := New()
		r.Node(func() NodeView { return NodeView{} }, 1)
		if testutil.MetricValue(scrape(t, r), "dsec_node_cpu_used_seconds_total", map[string]string{}) <= 0 {
			t.Error("the node's CPU time used is missing")
		}
	}
}

// TestGuard: loopback and Unix-socket scrapes need no token; one from off
// loopback needs the scrape token and is refused (401) without it or with
// another.
func TestGuard(t *testing.T) {
	path := filepath.Join(t.TempDir(), "scrape.token")
	if err := os.WriteFile(path, []byte("0123456789abcdef0123\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tok, err := ReadScrapeToken(path)
	if err != nil {
		t.Fatal(err)
	}
	h := Guard(New().Handler(), tok.Allow)
	for _, c := range []struct {
		remote, token string
		want          int
	}{
		{"127.0.0.1:5000", "", 200},
		{"[::1]:5000", "", 200},
		{"@", "", 200}, // a Unix socket's peer
		{"10.0.0.7:5000", "", 401},
		{"10.0.0.7:5000", "not-the-token", 401},
		{"10.0.0.7:5000", "0123456789abcdef0123", 200},
		{"[2001:db8::1]:5000", "0123456789abcdef0123", 200},
	} {
		req := httptest.NewRequest("GET", "/metrics", nil)
		req.RemoteAddr = c.remote
		if c.token != "" {
			req.Header.Set("Authorization", "Bearer "+c.token)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != c.want {
			t.Errorf("from %s with token %q: %d, want %d (%s)", c.remote, c.token, rec.Code, c.want, strings.TrimSpace(rec.Body.String()))
		}
		if rec.Code == http.StatusUnauthorized && strings.Contains(rec.Body.String(), c.token) && c.token != "" {
			t.Errorf("the refusal echoes the token: %s", rec.Body)
		}
	}
	// Without a token file, off loopback is refused; files others can
	// read, and short tokens, are refused.
	h = Guard(New().Handler(), ScrapeToken{}.Allow)
	req := httptest.NewRequest("GET", "/metrics", nil)
	req.RemoteAddr = "10.0.0.7:5000"
	req.Header.Set("Authorization", "Bearer ")
	rec := httptest.NewRecorder()
	if h.ServeHTTP(rec, req); rec.Code != 401 {
		t.Errorf("no scrape token configured, an empty bearer token: %d, want 401", rec.Code)
	}
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadScrapeToken(path); err == nil {
		t.Error("a token file others can read was accepted")
	}
	short := filepath.Join(t.TempDir(), "short")
	os.WriteFile(short, []byte("abc"), 0o600)
	if _, err := ReadScrapeToken(short); err == nil {
		t.Error("a 3-character token was accepted")
	}
}

// BenchmarkRequestRecord is what recording one API request costs the
// apiserver (a histogram observation by procedure and code), beside
// BenchmarkExecRecord's edge side: docs/operations.md has the sum against
// an exec's p50.
func BenchmarkRequestRecord(b *testing.B) {
	a := New().API(func() (int, int) { return 1, 1 })
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			start := time.Now()
			a.Request("/dsec.v1.SandboxService/Exec", "ok", time.Since(start))
		}
	})
}
