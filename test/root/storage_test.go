package root

import (
	"archive/tar"
	"bytes"
	"crypto/md5"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/tarfile"
	"dsec.dev/dsec/internal/testutil"
)

// tarOfDir is dir as an uncompressed tar stream (an OCI layer).
func tarOfDir(t *testing.T, dir string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		return tarfile.WriteEntry(tw, p, rel, info, func(h *tar.Header) {
			h.Mode &^= 0o6000 // no setuid in the test image
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	tw.Close()
	return buf.Bytes()
}

// tarOf builds a layer from name -> body ("" with a trailing / is a dir).
func tarOf(t *testing.T, files []tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range files {
		h := &tar.Header{Name: e.name, Mode: 0o644, Size: int64(len(e.body)), Typeflag: tar.TypeReg}
		if strings.HasSuffix(e.name, "/") {
			h = &tar.Header{Name: e.name, Mode: 0o755, Typeflag: tar.TypeDir}
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(e.body))
	}
	tw.Close()
	return buf.Bytes()
}

func layerOf(t *testing.T, b []byte) v1.Layer {
	t.Helper()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// testImage is a busybox base plus two layers: the second deletes a file
// of the first and makes a directory opaque.
func testImage(t *testing.T) v1.Image {
	t.Helper()
	bb := t.TempDir()
	if out, err := exec.Command(filepath.Join(testutil.RepoRoot(), "scripts", "build-busybox-base.sh"), bb).CombinedOutput(); err != nil {
		t.Fatalf("build busybox base: %v\n%s", err, out)
	}
	img, err := mutate.AppendLayers(empty.Image,
		layerOf(t, tarOfDir(t, bb)),
		layerOf(t, tarOf(t, []tarEntry{
			{name: "app/"}, {name: "app/keep.txt", body: "kept\n"}, {name: "app/gone.txt", body: "deleted later\n"},
			{name: "data/"}, {name: "data/old.txt", body: "hidden by an opaque dir\n"},
		})),
		layerOf(t, tarOf(t, []tarEntry{
			{name: "app/.wh.gone.txt"}, {name: "data/"}, {name: "data/.wh..wh..opq"}, {name: "data/new.txt", body: "new\n"},
		})),
	)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// TestImageDeletionNotListed imports an OCI image (from a layout) whose
// upper layer deletes /etc/gone and /app/gone.txt, collapsed into one EROFS
// layer and as separate ones, and lists the directories in a sandbox: the
// deleted names are neither listed nor reported. (/etc is copied up when the
// agent writes /etc/hosts, which merges it; /app stays in one layer, where
// overlayfs lists whatever whiteout the layer holds.)
func TestImageDeletionNotListed(t *testing.T) {
	testutil.RequireRoot(t)
	bb := t.TempDir()
	if out, err := exec.Command(filepath.Join(testutil.RepoRoot(), "scripts", "build-busybox-base.sh"), bb).CombinedOutput(); err != nil {
		t.Fatalf("build busybox base: %v\n%s", err, out)
	}
	img, err := mutate.AppendLayers(empty.Image,
		layerOf(t, tarOfDir(t, bb)),
		layerOf(t, tarOf(t, []tarEntry{{name: "etc/gone", body: "deleted later\n"}, {name: "app/"}, {name: "app/gone.txt", body: "deleted later\n"}, {name: "app/keep.txt", body: "kept\n"}})),
		layerOf(t, tarOf(t, []tarEntry{{name: "etc/.wh.gone"}, {name: "app/.wh.gone.txt"}})),
	)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "layout")
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := lp.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	d := testutil.StartDaemon(t, "--no-network")
	for _, collapse := range []string{"0", "-1"} {
		ref := "deleted:" + map[string]string{"0": "collapsed", "-1": "separate"}[collapse]
		if out, errOut, code := d.CLI("", "image", "import", "--collapse-below", collapse, ref, "oci:"+dir); code != 0 {
			t.Fatalf("dsec image import %s: %s %s", ref, out, errOut)
		}
		out, errOut, code := d.CLI("", "run", ref, "--", "ls", "/etc", "/app")
		if code != 0 || errOut != "" || strings.Contains(out, "gone") || !strings.Contains(out, "passwd") || !strings.Contains(out, "keep.txt") {
			t.Errorf("%s: dsec run ls /etc /app: exit %d, stdout %q, stderr %q; want passwd and keep.txt listed, nothing gone", ref, code, out, errOut)
		}
	}
}

// layerStats runs `dsec layer stats --json`.
type layerStats struct {
	Mode      string `json:"mode"`
	BlobStore string `json:"blobStore"`
	Layers    []struct {
		Digest        string `json:"digest"`
		Size          int64  `json:"size"`
		BytesRead     int64  `json:"bytesRead"`
		BytesFetched  int64  `json:"bytesFetched"`
		ChunksTotal   int64  `json:"chunksTotal"`
		ChunksFetched int64  `json:"chunksFetched"`
		CacheMisses   int64  `json:"cacheMisses"`
		MemoryHits    int64  `json:"memoryHits"`
		DiskHits      int64  `json:"diskHits"`
		WrittenDisk   int64  `json:"bytesWrittenDisk"`
	} `json:"layers"`
	Environments []struct {
		Name      string   `json:"name"`
		Digests   []string `json:"layerDigests"`
		Size      int64    `json:"size"`
		BytesRead int64    `json:"bytesRead"`
		Sandboxes int64    `json:"sandboxes"`
	} `json:"environments"`
}

func stats(t *testing.T, d *testutil.Daemon) layerStats {
	t.Helper()
	out, errOut, code := d.CLI("", "layer", "stats", "--json")
	if code != 0 {
		t.Fatalf("dsec layer stats: %s", errOut)
	}
	var s layerStats
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatalf("layer stats JSON: %v\n%s", err, out)
	}
	return s
}

// TestImageFromRegistry imports a real image from a registry on loopback
// and runs it on demand: whiteouts hold, and the accounting sees the reads.
func TestImageFromRegistry(t *testing.T) {
	testutil.RequireRoot(t)
	d := testutil.StartDaemon(t)
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	ref, err := name.ParseReference(host+"/e2e/tools:1", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, testImage(t)); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := d.CLI("", "image", "import", "--insecure", "--json", "tools:1", "docker://"+host+"/e2e/tools:1")
	if code != 0 {
		t.Fatalf("dsec image import: %s %s", out, errOut)
	}
	var res struct {
		LayerDigests []string `json:"layerDigests"`
		OciLayers    int      `json:"ociLayers"`
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("import JSON: %v\n%s", err, out)
	}
	if res.OciLayers != 3 || len(res.LayerDigests) == 0 {
		t.Fatalf("import result %+v", res)
	}
	// Importing again reuses every layer and gives the same digests.
	out2, errOut, code := d.CLI("", "image", "import", "--insecure", "--json", "tools:1", "docker://"+host+"/e2e/tools:1")
	if code != 0 || !strings.Contains(out2, res.LayerDigests[0]) {
		t.Fatalf("second import: %s %s", out2, errOut)
	}
	// image ls lists it, with its layers.
	if out, errOut, code := d.CLI("", "image", "ls"); code != 0 ||
		!regexp.MustCompile(`(?m)^tools:1 +`+strconv.Itoa(len(res.LayerDigests))+` `).MatchString(out) {
		t.Errorf("dsec image ls: exit %d, %q %q; want tools:1 with %d layers", code, out, errOut, len(res.LayerDigests))
	}

	got, errOut, code := d.CLI("", "run", "tools:1", "--", "sh", "-c",
		"cat /app/keep.txt; ls /app /data | tr '\\n' ' '; test ! -e /app/gone.txt && test ! -e /data/old.txt && echo whiteouts-hold")
	if code != 0 {
		t.Fatalf("run on the imported image: %s %s", got, errOut)
	}
	for _, want := range []string{"kept", "new.txt", "whiteouts-hold"} {
		if !strings.Contains(got, want) {
			t.Errorf("sandbox output %q lacks %q", got, want)
		}
	}
	if strings.Contains(got, "gone.txt") || strings.Contains(got, "old.txt") {
		t.Errorf("deleted files visible: %q", got)
	}

	// The sandbox's reads were saved as an access trace for later prefetching.
	var traced int
	for _, dg := range res.LayerDigests {
		b, err := os.ReadFile(filepath.Join(d.Root, "lazy", "cache", "traces", strings.TrimPrefix(dg, "sha256:")+".json"))
		var tr struct{ Chunks []int }
		if err == nil && json.Unmarshal(b, &tr) == nil && len(tr.Chunks) > 0 {
			traced++
		}
	}
	if traced == 0 {
		t.Errorf("no access trace saved for any of %v", res.LayerDigests)
	}
	// And published to the blob store (in the background), for other nodes.
	published := func() int {
		n := 0
		for _, dg := range res.LayerDigests {
			if _, err := os.Stat(filepath.Join(d.Root, "blobstore", "traces", "sha256", strings.TrimPrefix(dg, "sha256:")+".json")); err == nil {
				n++
			}
		}
		return n
	}
	for deadline := time.Now().Add(30 * time.Second); published() < traced && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	if n := published(); n < traced {
		t.Errorf("%d access traces published to the blob store, want the %d saved", n, traced)
	}

	s := stats(t, d)
	if s.Mode != "ondemand" {
		t.Errorf("mode %q, want ondemand by default", s.Mode)
	}
	var env bool
	for _, e := range s.Environments {
		if e.Name == "tools:1" {
			env = true
			if e.Sandboxes < 1 || e.BytesRead <= 0 || e.BytesRead > e.Size {
				t.Errorf("environment accounting %+v", e)
			}
		}
	}
	if !env {
		t.Errorf("layer stats has no environment tools:1: %+v", s)
	}

	// A hostile source is refused with a clear error.
	if _, errOut, code := d.CLI("", "image", "import", "bad:1", "oci:/nonexistent/layout"); code == 0 || !strings.Contains(errOut, "nonexistent") {
		t.Errorf("import of a missing layout: code %d, %q", code, errOut)
	}
}

// TestTracesWarmAnotherNode: what a sandbox read on one node is published
// to the blob store the nodes share; another node that imports the same
// image prefetches those chunks into memory before anything runs there, and
// its first sandbox finds them, writing nothing to the chunk cache's disk.
func TestTracesWarmAnotherNode(t *testing.T) {
	testutil.RequireRoot(t)
	store := filepath.Join(t.TempDir(), "blobs")
	const cmd = "cat /bin/busybox >/dev/null; ls -l /bin /etc >/dev/null; echo ran"
	first := testutil.StartDaemon(t, "--blob-store", store, "--no-network")
	first.ImportBusybox(env)
	if out, errOut, code := first.CLI("", "run", env, "--", "sh", "-c", cmd); code != 0 || !strings.Contains(out, "ran") {
		t.Fatalf("run on the first node: %s %s", out, errOut)
	}
	traces := func() []string {
		m, _ := filepath.Glob(filepath.Join(store, "traces", "sha256", "*.json"))
		return m
	}
	for deadline := time.Now().Add(30 * time.Second); len(traces()) == 0 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	if len(traces()) == 0 {
		t.Fatal("the first node published no access trace")
	}

	second := testutil.StartDaemon(t, "--blob-store", store, "--no-network")
	second.ImportBusybox(env)
	fetched := func() (n int64) {
		for _, l := range stats(t, second).Layers {
			n += l.ChunksFetched
		}
		return n
	}
	for deadline := time.Now().Add(30 * time.Second); fetched() == 0 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	for _, l := range stats(t, second).Layers {
		if l.BytesRead != 0 {
			t.Errorf("layer %s read %d bytes before any sandbox ran", l.Digest, l.BytesRead)
		}
	}
	if fetched() == 0 {
		t.Fatal("the second node prefetched nothing on import")
	}
	// Let the prefetch finish, then run the same command.
	for prev, deadline := int64(-1), time.Now().Add(30*time.Second); fetched() != prev && time.Now().Before(deadline); {
		prev = fetched()
		time.Sleep(300 * time.Millisecond)
	}
	if out, errOut, code := second.CLI("", "run", env, "--", "sh", "-c", cmd); code != 0 || !strings.Contains(out, "ran") {
		t.Fatalf("run on the second node: %s %s", out, errOut)
	}
	var hits, misses, written int64
	for _, l := range stats(t, second).Layers {
		hits, misses, written = hits+l.MemoryHits, misses+l.CacheMisses, written+l.WrittenDisk
	}
	if hits == 0 || misses > hits || written != 0 {
		t.Errorf("second node's first sandbox: %d memory hits, %d misses, %d bytes written to disk; want mostly hits, nothing written", hits, misses, written)
	}
}

// TestLayerModes runs a sandbox in each loading mode, the eager and tar
// modes pulling from the blob store, and (with a real S3 server in CI) the
// on-demand mode against S3.
func TestLayerModes(t *testing.T) {
	testutil.RequireRoot(t)
	s3 := os.Getenv("DSEC_TEST_S3")
	testutil.Require(t, s3 != "", "DSEC_TEST_S3 names no S3 server (scripts/seaweedfs.sh start DIR PORT)")
	bucket := fmt.Sprintf("dsec-e2e-%d", os.Getpid())
	for _, mode := range []string{"ondemand", "eager", "tar", "local"} {
		t.Run(mode, func(t *testing.T) {
			spec := "s3://" + bucket + "/" + mode + "?endpoint=" + s3 + "&insecure=1"
			d := testutil.StartDaemon(t, "--blob-store", spec, "--layer-mode", mode, "--layer-tars", "--no-network")
			d.ImportBusybox(env)
			out, errOut, code := d.CLI("", "run", env, "--", "sh", "-c", "echo hi from "+mode+"; ls /bin | wc -l")
			if code != 0 || !strings.Contains(out, "hi from "+mode) {
				t.Fatalf("run in %s mode: %s %s", mode, out, errOut)
			}
			s := stats(t, d)
			if s.Mode != mode || !strings.HasPrefix(s.BlobStore, "s3://") {
				t.Errorf("stats say mode %q store %q", s.Mode, s.BlobStore)
			}
			if mode == "ondemand" {
				var fetched int64
				for _, l := range s.Layers {
					fetched += l.BytesFetched
				}
				if fetched == 0 {
					t.Errorf("on demand fetched nothing from S3: %+v", s.Layers)
				}
			}
		})
	}
}

// TestBlobStoreOutage takes the blob store away under a running sandbox:
// reads of chunks not yet cached fail with an I/O error after a bounded
// retry, while the sandbox, the node and other sandboxes live on; when the
// store is back, the same reads succeed.
func TestBlobStoreOutage(t *testing.T) {
	testutil.RequireRoot(t)
	store := filepath.Join(t.TempDir(), "blobs")
	d := testutil.StartDaemon(t, "--blob-store", store, "--no-network")
	d.ImportBusybox(env)
	ws := t.TempDir()
	big := make([]byte, 6<<20)
	for i := range big {
		big[i] = byte(i*7 + i>>13)
	}
	if err := os.WriteFile(filepath.Join(ws, "big.bin"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, errOut, code := d.CLI("", "layer", "import", "--kind", "workspace", "big:1", ws); code != 0 {
		t.Fatalf("import workspace: %s %s", out, errOut)
	}
	sb := create(t, d, &dsecv1.SandboxSpec{Environment: env + "+big:1"})
	other := create(t, d, nil)

	away := store + ".away"
	if err := os.Rename(store, away); err != nil {
		t.Fatal(err)
	}
	restored := false
	restore := func() {
		if !restored {
			restored = true
			if err := os.Rename(away, store); err != nil {
				t.Fatal(err)
			}
		}
	}
	defer restore()
	r := sh(t, d, sb.GetId(), "cat /big.bin > /dev/null")
	if r.exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK || !strings.Contains(strings.ToLower(r.stderr), "input/output error") {
		t.Errorf("reading uncached chunks with the store gone: %s, want an I/O error", r)
	}
	// The sandbox, the node and the other sandbox live on.
	if out := mustSh(t, d, sb.GetId(), "echo alive"); out != "alive\n" {
		t.Errorf("sandbox after the failed read: %q", out)
	}
	if out := mustSh(t, d, other.GetId(), "echo alive"); out != "alive\n" {
		t.Errorf("other sandbox: %q", out)
	}
	restore()
	out := mustSh(t, d, sb.GetId(), "md5sum /big.bin")
	if !strings.HasPrefix(out, fmt.Sprintf("%x", md5sum(big))) {
		t.Errorf("after the store came back: %q", out)
	}
}

func md5sum(b []byte) [16]byte { return md5.Sum(b) }
