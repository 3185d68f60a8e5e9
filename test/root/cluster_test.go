package root

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/testutil"
)

// TestClusterEndToEnd: the main flows through a cluster on this machine,
// two apiservers in front of two edges with real runc sandboxes sharing a
// blob store, through the CLI and the API as a user drives them: a tree
// streamed from the client through an apiserver is usable on every edge, a
// batch spreads, commands, files, sessions and background processes work on
// each edge's sandboxes through either apiserver, an OCI image is fetched
// once for both edges, hostile or oversized uploads are refused and leave
// nothing, a warm pool on every edge serves creates, and removal leaves
// nothing.
func TestClusterEndToEnd(t *testing.T) {
	onePassOnly(t)
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 2, Edges: 2, RealEdges: true,
		DB: testutil.StartPostgres(t), Registry: true, EdgeArgs: []string{"--max-upload-bytes", fmt.Sprint(maxUpload)}})
	cli := func(i int, args ...string) (string, string, int) {
		t.Helper()
		cmd := exec.Command(filepath.Join(c.Bin, "dsec"), append([]string{"--addr", c.APIServers[i].Addr}, args...)...)
		cmd.Env = append(os.Environ(), "DSEC_TOKEN="+c.APIServers[i].Token)
		var out, errb strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return out.String(), errb.String(), code
	}
	tree := t.TempDir()
	if out, err := exec.Command(filepath.Join(testutil.RepoRoot(), "scripts", "build-busybox-base.sh"), tree).CombinedOutput(); err != nil {
		t.Fatalf("build busybox base: %v\n%s", err, out)
	}
	big := make([]byte, 8<<20)
	rand.Read(big)
	if err := os.WriteFile(filepath.Join(tree, "big.bin"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	bigSum := sha256.Sum256(big)
	// Streamed from the client, as from another machine, to one edge; the
	// other adopts the layer from the blob store they share.
	if out, errOut, code := cli(0, "layer", "import", "--upload", "--kind", "base", env, tree); code != 0 {
		t.Fatalf("layer import --upload through an apiserver: %s %s", out, errOut)
	}
	if out, _, _ := cli(1, "layer", "ls"); !strings.Contains(out, env) {
		t.Fatalf("the other apiserver does not list the layer:\n%s", out)
	}

	out, errOut, code := cli(0, "create", "-n", "6", env)
	if code != 0 {
		t.Fatalf("create -n 6: %s", errOut)
	}
	ids := strings.Fields(out)
	nodes := map[string]int{}
	for _, id := range ids {
		for _, n := range []string{"e1", "e2"} {
			if strings.HasPrefix(id, "sb-"+n+"-") {
				nodes[n]++
			}
		}
	}
	if nodes["e1"] == 0 || nodes["e2"] == 0 {
		t.Errorf("a batch of 6 over 2 edges: %v", nodes)
	}
	for i, id := range ids {
		via := i % 2 // each sandbox through either apiserver
		if out, errOut, code := cli(via, "exec", "--env", "X="+id, id, "--", "sh", "-c", "echo $X; hostname"); code != 0 || out != id+"\n"+id+"\n" {
			t.Errorf("exec in %s through api%d: %q %q %d", id, via+1, out, errOut, code)
		}
	}
	// Every byte of the upload is there on both edges.
	for _, id := range onEachNode(ids) {
		if out, errOut, code := cli(0, "exec", id, "--", "sha256sum", "/big.bin"); code != 0 || !strings.HasPrefix(out, hex.EncodeToString(bigSum[:])) {
			t.Errorf("sha256sum /big.bin in %s: %q %q", id, out, errOut)
		}
	}
	imageFetchedOnce(t, c, cli)
	hostileUploadsRefused(t, c, cli)
	// Files, a session and a background process on one edge's sandbox,
	// through the API of the other apiserver.
	id := ids[0]
	cl := c.Client(1)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := cl.Sandboxes.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: id, Path: "/tmp/x", Data: []byte("hi")})); err != nil {
		t.Fatal(err)
	}
	rf, err := cl.Sandboxes.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: "/tmp/x"}))
	if err != nil || string(rf.Msg.GetData()) != "hi" {
		t.Fatalf("read back: %v %q", err, rf.Msg.GetData())
	}
	if out, _, code := cli(1, "exec", "-d", "--tag", "bg", id, "--", "sh", "-c", "echo bg; sleep 30"); code != 0 || !strings.HasPrefix(out, "p-") {
		t.Fatalf("exec -d: %q", out)
	}
	testutil.WaitFor(t, 10*time.Second, "the background process to print", func() bool {
		out, _, _ := cli(0, "attach", "--no-follow", id, "bg")
		return out == "bg\n"
	})
	if _, errOut, code := cli(0, "kill", id, "bg"); code != 0 {
		t.Fatalf("kill: %s", errOut)
	}

	// A warm pool on every edge serves creates of its shape.
	if out, errOut, code := cli(0, "pool", "set", "--size", "1", env); code != 0 {
		t.Fatalf("pool set: %s %s", out, errOut)
	}
	testutil.WaitFor(t, 60*time.Second, "both edges' pools to fill", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := cl.Sandboxes.ListWarmPools(ctx, connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
		if err != nil {
			return false
		}
		ready := map[string]bool{}
		for _, p := range resp.Msg.GetPools() {
			ready[p.GetNode()] = p.GetReady() >= 1
		}
		return ready["e1"] && ready["e2"]
	})
	out, _, code = cli(1, "create", "--json", env)
	if code != 0 || !strings.Contains(out, `"fromWarmPool": true`) {
		t.Errorf("create of the pool's shape: %s", out)
	}
	cli(0, "pool", "rm", env)

	if _, errOut, code := cli(0, append([]string{"rm", firstID(out)}, ids...)...); code != 0 {
		t.Fatalf("rm: %s", errOut)
	}
	if out, _, _ := cli(1, "ls"); strings.Count(out, "sb-") != 0 {
		t.Errorf("sandboxes left after rm:\n%s", out)
	}
}

// maxUpload is the edges' --max-upload-bytes in TestClusterEndToEnd.
const maxUpload = 64 << 20

type clusterCLI func(i int, args ...string) (string, string, int)

// onEachNode picks one sandbox of each node among ids.
func onEachNode(ids []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, id := range ids {
		node := strings.SplitN(id, "-", 3)[1]
		if !seen[node] {
			seen[node] = true
			out = append(out, id)
		}
	}
	return out
}

// imageFetchedOnce: an OCI image imported through one apiserver is fetched
// from the registry once, by one edge, and runs on both.
func imageFetchedOnce(t *testing.T, c *testutil.Cluster, cli clusterCLI) {
	t.Helper()
	var mu sync.Mutex
	gets := map[string]int{} // blob digest -> GETs
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/") {
			mu.Lock()
			gets[path.Base(r.URL.Path)]++
			mu.Unlock()
		}
		reg.ServeHTTP(w, r)
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	ref, err := name.ParseReference(host+"/e2e/tools:1", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img := testImage(t)
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	clear(gets) // what pushing read back
	mu.Unlock()
	if out, errOut, code := cli(0, "image", "import", "--insecure", "tools:1", "docker://"+host+"/e2e/tools:1"); code != 0 {
		t.Fatalf("image import through an apiserver: %s %s", out, errOut)
	}
	mu.Lock()
	for _, l := range layers {
		d, err := l.Digest()
		if err != nil {
			t.Fatal(err)
		}
		if gets[d.String()] != 1 {
			t.Errorf("layer blob %s was fetched %d times, want once for the cluster", d, gets[d.String()])
		}
	}
	for d, n := range gets {
		if n != 1 {
			t.Errorf("blob %s fetched %d times", d, n)
		}
	}
	mu.Unlock()
	out, errOut, code := cli(1, "create", "-n", "4", "tools:1")
	if code != 0 {
		t.Fatalf("create -n 4 tools:1: %s", errOut)
	}
	ids := strings.Fields(out)
	on := onEachNode(ids)
	if len(on) != 2 {
		t.Errorf("4 sandboxes of the image over 2 edges: %v", ids)
	}
	for _, id := range on {
		if out, errOut, code := cli(0, "exec", id, "--", "cat", "/app/keep.txt"); code != 0 || out != "kept\n" {
			t.Errorf("the image in %s: %q %q", id, out, errOut)
		}
	}
	if _, errOut, code := cli(0, append([]string{"rm"}, ids...)...); code != 0 {
		t.Fatalf("rm: %s", errOut)
	}
}

// hostileUploadsRefused: an archive that escapes its root, one that unpacks
// past the limit and one over it are refused through the stream with words
// that say why, and leave no layer, staging file or blob store record.
func hostileUploadsRefused(t *testing.T, c *testutil.Cluster, cli clusterCLI) {
	t.Helper()
	dir := t.TempDir()
	write := func(name string, gz bool, hdr *tar.Header, body io.Reader) string {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var w io.Writer = f
		var zw *gzip.Writer
		if gz {
			zw = gzip.NewWriter(f)
			w = zw
		}
		tw := tar.NewWriter(w)
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(tw, body); err != nil {
			t.Fatal(err)
		}
		tw.Close()
		if zw != nil {
			zw.Close()
		}
		return f.Name()
	}
	escape := write("escape.tar", false, &tar.Header{Name: "../escape", Mode: 0o644, Size: 1, Typeflag: tar.TypeReg}, strings.NewReader("x"))
	bomb := write("bomb.tar.gz", true, &tar.Header{Name: "zeros", Mode: 0o644, Size: maxUpload + 1, Typeflag: tar.TypeReg},
		io.LimitReader(zeros{}, maxUpload+1))
	huge := filepath.Join(dir, "huge.tar")
	if err := os.WriteFile(huge, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(huge, maxUpload+1); err != nil { // sparse: costs nothing to make
		t.Fatal(err)
	}
	for _, tc := range []struct{ ref, src, want string }{
		{"evil:escape", escape, `"../escape": path contains a .. component`},
		{"evil:bomb", bomb, fmt.Sprintf("content exceeds %d bytes (limit dsecd --max-upload-bytes)", maxUpload)},
		{"evil:huge", huge, "is over the 64 MiB an upload may have (dsecd --max-upload-bytes)"},
	} {
		if out, errOut, code := cli(0, "layer", "import", "--upload", "--kind", "base", tc.ref, tc.src); code == 0 || !strings.Contains(errOut, tc.want) {
			t.Errorf("upload of %s: code %d, %q %q; want an error with %q", filepath.Base(tc.src), code, out, errOut, tc.want)
		}
	}
	if out, _, _ := cli(1, "layer", "ls"); strings.Contains(out, "evil") {
		t.Errorf("a refused upload is listed:\n%s", out)
	}
	for _, e := range c.Edges {
		if left, _ := os.ReadDir(filepath.Join(e.Root, "layers", "tmp")); len(left) != 0 {
			t.Errorf("edge %s kept staging files: %v", e.Name, left)
		}
	}
	blobs, err := blob.NewDir(c.BlobStore)
	if err != nil {
		t.Fatal(err)
	}
	err = blobs.List(t.Context(), "refs/", func(key string, size int64) error {
		rc, err := blobs.Get(t.Context(), key)
		if err != nil {
			return err
		}
		defer rc.Close()
		var rec struct{ Ref string }
		if err := json.NewDecoder(rc).Decode(&rec); err != nil {
			return err
		}
		if strings.HasPrefix(rec.Ref, "evil") {
			t.Errorf("the blob store has a record of refused %s", rec.Ref)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// zeros reads as zero bytes without end.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// firstID is the first sandbox ID in a create's JSON.
func firstID(js string) string {
	i := strings.Index(js, `"id": "`)
	if i < 0 {
		return ""
	}
	rest := js[i+len(`"id": "`):]
	return rest[:strings.IndexByte(rest, '"')]
}
