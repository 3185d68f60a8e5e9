package root

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

// TestOverwritePastQuota: through the CLI on a real node and store (both
// passes). A layer pushed again under its name while its project is at
// its layer_bytes quota is admitted when the result fits once the old
// version's bytes are given back (the new one is charged in the
// transaction that releases the old); one that does not fit is refused by
// name with the numbers, and nothing is lost: the old version is still
// what the name makes sandboxes of. An image pushed again at the quota is
// admitted the same way, and removing it takes it off the node and gives
// its bytes back (before, the node kept it). A snapshot taken again under
// its name at its snapshot_bytes quota is refused, and the snapshot stays
// whole and usable.
func TestOverwritePastQuota(t *testing.T) {
	d := startDaemon(t)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	st, err := store.Open(ctx, d.DB())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	cli := func(args ...string) string {
		t.Helper()
		out, errOut, code := d.CLI("", args...)
		if code != 0 {
			t.Fatalf("dsec %s: exit %d: %s %s", strings.Join(args, " "), code, out, errOut)
		}
		return out
	}
	layerUse := func() int64 {
		t.Helper()
		qs, err := st.Quota(ctx, "ovw")
		if err != nil {
			t.Fatal(err)
		}
		return qs[0].Used[store.LayerBytes]
	}
	object := func(name string) store.Object {
		t.Helper()
		o, err := st.Object(ctx, name)
		if err != nil {
			t.Fatalf("the record of %s: %v", name, err)
		}
		return o
	}
	// tree is a task layer saying version, padded with n bytes that do
	// not compress.
	tree := func(version string, n int) string {
		t.Helper()
		dir := t.TempDir()
		pad := make([]byte, n)
		r := rand.NewChaCha8([32]byte{byte(n), version[0]})
		r.Read(pad)
		if err := os.WriteFile(filepath.Join(dir, "task.txt"), []byte(version+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "pad.bin"), pad, 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	push := func(dir string) (stdout, stderr string, code int) {
		return d.CLI("", "layer", "import", "--kind", "workspace", "--upload", "--project", "ovw", "ovw-env:1", dir)
	}
	task := func() string {
		t.Helper()
		return strings.TrimSpace(cli("run", env+"+ovw-env:1", "--", "cat", "/task.txt"))
	}

	cli("project", "create", "ovw")
	t.Cleanup(func() {
		d.CLI("", "layer", "rm", "ovw-env:1")
		d.CLI("", "layer", "rm", "ovw-img:1")
		d.CLI("", "project", "rm", "ovw")
	})
	if out, errOut, code := push(tree("v1", 64<<10)); code != 0 {
		t.Fatalf("push v1: exit %d: %s %s", code, out, errOut)
	}
	v1 := object("ovw-env:1")
	if n := layerUse(); n != v1.Bytes || n <= 0 {
		t.Fatalf("ovw uses %d bytes of layers for a %d-byte layer", n, v1.Bytes)
	}
	// At the quota: v2 (no bigger) fits once v1's bytes are given back.
	cli("project", "quota", "ovw", "layer_bytes="+strconv.FormatInt(v1.Bytes, 10))
	if out, errOut, code := push(tree("v2", 60<<10)); code != 0 {
		t.Fatalf("push v2 at the quota, which fits once v1 is given back: exit %d: %s %s", code, out, errOut)
	}
	v2 := object("ovw-env:1")
	if v2.Blobs[0].Digest == v1.Blobs[0].Digest || layerUse() != v2.Bytes {
		t.Fatalf("after v2: the record holds %v (v1 held %v), ovw uses %d; want v2's blob, charged alone", v2.Blobs, v1.Blobs, layerUse())
	}
	if got := task(); got != "v2" {
		t.Fatalf("a sandbox of ovw-env:1 after v2 reads %q", got)
	}
	// v1 stays on the node, nameless, listed to the root's admin, who
	// removes it by digest.
	if ls := cli("layer", "ls", "--json"); !strings.Contains(ls, v1.Blobs[0].Digest) {
		t.Fatalf("dsec layer ls does not list the overwritten v1 (%s): %s", v1.Blobs[0].Digest, ls)
	}
	cli("layer", "rm", v1.Blobs[0].Digest)
	if ls := cli("layer", "ls", "--json"); strings.Contains(ls, v1.Blobs[0].Digest) {
		t.Fatalf("dsec layer ls lists v1 after its removal: %s", ls)
	}
	// v3 does not fit even with v2 given back: refused by name with the
	// numbers, and v2 stays.
	out, errOut, code := push(tree("v3", 4<<20))
	want := "quota of project ovw: " + strconv.FormatInt(v2.Bytes, 10) + " of " + strconv.FormatInt(v1.Bytes, 10) + " bytes of layers in use"
	if code == 0 || !strings.Contains(errOut, "layer ovw-env:1 (") || !strings.Contains(errOut, want) || !strings.Contains(errOut, "the layer before is kept") {
		t.Fatalf("push v3 past the quota: exit %d: %s %s; want refused naming ovw-env:1 and %q", code, out, errOut, want)
	}
	if o := object("ovw-env:1"); o.Blobs[0] != v2.Blobs[0] || layerUse() != v2.Bytes {
		t.Fatalf("after the refusal: the record holds %v, ovw uses %d; want v2's %v, %d", o.Blobs, layerUse(), v2.Blobs, v2.Bytes)
	}
	if got := task(); got != "v2" {
		t.Fatalf("a sandbox of ovw-env:1 after the refused v3 reads %q, want v2", got)
	}
	if ls := cli("layer", "ls", "--json"); strings.Contains(ls, "dsec-staging/") {
		t.Fatalf("a staging ref is left: %s", ls)
	}

	// An image, pushed again at the quota, then removed.
	image := func(body string) string {
		t.Helper()
		img, err := mutate.AppendLayers(empty.Image, layerOf(t, tarOf(t, []tarEntry{{name: "img.txt", body: body}})))
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
		return "oci:" + dir
	}
	cli("project", "quota", "ovw", "layer_bytes="+strconv.FormatInt(4*v1.Bytes, 10))
	cli("image", "import", "--project", "ovw", "ovw-img:1", image("image one\n"))
	one := object("ovw-img:1")
	withImage := layerUse()
	cli("project", "quota", "ovw", "layer_bytes="+strconv.FormatInt(withImage, 10))
	cli("image", "import", "--project", "ovw", "ovw-img:1", image("image two\n"))
	two := object("ovw-img:1")
	if two.Blobs[0].Digest == one.Blobs[0].Digest || layerUse() != v2.Bytes+two.Bytes {
		t.Fatalf("after pushing ovw-img:1 again: the record holds %v (it held %v), ovw uses %d; want the new layer, charged alone", two.Blobs, one.Blobs, layerUse())
	}
	if ls := cli("image", "ls"); !strings.Contains(ls, "ovw-img:1") {
		t.Fatalf("dsec image ls after the push: %s", ls)
	}
	cli("layer", "rm", "ovw-img:1")
	if ls := cli("image", "ls"); strings.Contains(ls, "ovw-img:1") {
		t.Fatalf("dsec image ls lists ovw-img:1 after its removal: %s", ls)
	}
	if _, err := st.Object(ctx, "ovw-img:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("the record of the removed image: %v", err)
	}
	if n := layerUse(); n != v2.Bytes {
		t.Fatalf("ovw uses %d bytes of layers once the image is removed, want %d", n, v2.Bytes)
	}
	// A snapshot taken again under its name at the snapshot_bytes quota
	// is refused before any node is asked, and the snapshot stays whole:
	// its record, its charge, and what it makes sandboxes of.
	id := strings.TrimSpace(cli("create", env+"+ovw-env:1"))
	t.Cleanup(func() { d.CLI("", "rm", id) })
	cli("exec", id, "--", "sh", "-c", "echo snap1 > /snap.txt")
	snapEnv := strings.TrimSpace(cli("snapshot", "--project", "ovw", id, "ovw-snap"))
	t.Cleanup(func() { d.CLI("", "snapshot", "rm", "ovw-snap") })
	snap := object("snap:ovw-snap")
	snapUse := func() int64 {
		t.Helper()
		qs, err := st.Quota(ctx, "ovw")
		if err != nil {
			t.Fatal(err)
		}
		return qs[0].Used[store.SnapshotBytes]
	}
	cli("project", "quota", "ovw", "snapshot_bytes="+strconv.FormatInt(snapUse(), 10))
	cli("exec", id, "--", "sh", "-c", "echo snap2 > /snap.txt")
	out, errOut, code = d.CLI("", "snapshot", "--project", "ovw", id, "ovw-snap")
	if code == 0 || !strings.Contains(errOut, "snapshot ovw-snap exists") {
		t.Fatalf("snapshot ovw-snap again at the quota: exit %d: %s %s; want refused, it exists", code, out, errOut)
	}
	if o := object("snap:ovw-snap"); len(o.Blobs) != 1 || o.Blobs[0] != snap.Blobs[0] || snapUse() != snap.Bytes {
		t.Fatalf("after the refusal: the record holds %v, ovw uses %d snapshot bytes; want %v, %d", o.Blobs, snapUse(), snap.Blobs, snap.Bytes)
	}
	if got := strings.TrimSpace(cli("run", snapEnv, "--", "cat", "/snap.txt")); got != "snap1" {
		t.Fatalf("a sandbox of ovw-snap after the refusal reads %q, want snap1", got)
	}
	cli("rm", id)
	cli("snapshot", "rm", "ovw-snap")
	if n := snapUse(); n != 0 {
		t.Fatalf("ovw uses %d snapshot bytes with none left", n)
	}

	cli("layer", "rm", "ovw-env:1")
	if n := layerUse(); n != 0 {
		t.Fatalf("ovw uses %d bytes of layers with none left", n)
	}
}
