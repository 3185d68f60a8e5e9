package root

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// treeListing lists a sandbox's whole file system, one line per object:
// name, type, mode, owner, then for what is not a directory its size and
// links and the content's md5 or a link's target (a directory's size and
// link count are the file system's business); what each sandbox gets of its own (/proc, /sys, /dev, the agent,
// /etc/hosts and /etc/hostname) is left out.
const treeListing = `find / -xdev \( -path /proc -o -path /sys -o -path /dev -o -path /.dsec -o -path /etc/hosts -o -path /etc/hostname -o -path /tmp/memhog.pid \) -prune -o -print | sort | while read -r f; do
  if [ -d "$f" ] && [ ! -L "$f" ]; then stat -c '%n %F %a %u:%g' "$f"; continue; fi
  stat -c '%n %F %a %u:%g %s %h' "$f"
  if [ -L "$f" ]; then readlink "$f"; elif [ -f "$f" ]; then md5sum < "$f"; fi
done`

// TestSnapshotRestoreAndFork: a snapshot of a sandbox that changed its file
// system every way a task does restores, in a new sandbox, to the same tree
// compared object by object (but for the excluded residue); the source stood
// still only for the capture and runs on; a taken name and a path outside
// the sandbox are refused; a fork of 16 gives 16 independent children; a deleted
// snapshot is gone from the listing.
func TestSnapshotRestoreAndFork(t *testing.T) {
	d := startDaemon(t)
	src := create(t, d, nil)
	id := src.GetId()
	mustSh(t, d, id, `set -e
mkdir -p /work/src /answers /cache
echo 'print("hello")' > /work/src/main.py
echo secret > /answers/expected.txt
echo blob > /cache/pip.tgz
ln /work/src/main.py /work/src/hardlink.py
ln -s ../src/main.py /work/link.py
chmod 4755 /work/src/main.py
chown 65534:65534 /work/src
rm /bin/vi
rm -r /root
mkdir /root && echo fresh > /root/note
head -c 300000 /dev/urandom > /work/big.bin
printf 'odd\n' > "/work/we ird $(printf '\t')name"`)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sc := d.Clients.Sandboxes
	if _, err := sc.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: "bad", Exclude: []string{"../etc"}})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("snapshot with an exclude outside the sandbox: %v, want InvalidArgument", err)
	}
	resp, err := sc.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: "s1", Exclude: []string{"/answers", "/cache"}}))
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	info := resp.Msg
	t.Logf("snapshot s1: %s, frozen %d µs (%s), packed in %d ms, %d bytes", info.GetEnvironment(), info.GetFrozenUs(), info.GetCaptureMethod(), info.GetPackMs(), info.GetSize())
	if info.GetEnvironment() != env+"+snap:s1" || info.GetSourceSandbox() != id || !strings.HasPrefix(info.GetDigest(), "sha256:") {
		t.Fatalf("snapshot info: %v", info)
	}
	if _, err := sc.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: "s1"})); connect.CodeOf(err) != connect.CodeAlreadyExists {
		t.Errorf("a second snapshot named s1: %v, want AlreadyExists", err)
	}
	// The source runs on.
	if out := strings.TrimSpace(mustSh(t, d, id, "cat /work/src/main.py")); out != `print("hello")` {
		t.Fatalf("the source after its snapshot: %q", out)
	}
	want := mustSh(t, d, id, "rm -r /answers /cache; "+treeListing)

	restored := create(t, d, &dsecv1.SandboxSpec{Environment: info.GetEnvironment()})
	got := mustSh(t, d, restored.GetId(), treeListing)
	if got != want {
		t.Fatalf("the restored tree differs from the source's:\n%s", firstDiff(want, got))
	}
	if out := sh(t, d, restored.GetId(), "ls /bin | grep -cx vi; ls /answers /cache 2>&1; ls /root"); !strings.Contains(out.stdout, "0\n") || !strings.Contains(out.stdout, "note") ||
		!strings.Contains(out.stdout, "No such file") {
		t.Errorf("deleted, excluded and replaced paths in the restored sandbox: %q", out.stdout)
	}

	// A paused source is resumed for a snapshot.
	pause(t, d, id, false)
	if _, err := sc.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: "s2"})); err != nil {
		t.Fatalf("snapshot of a paused sandbox: %v", err)
	}
	if s := state(t, d, id).GetState(); s != dsecv1.State_STATE_RUNNING {
		t.Errorf("after a snapshot of a paused sandbox: %s, want running", s)
	}

	fork, err := sc.Fork(ctx, connect.NewRequest(&dsecv1.ForkRequest{SandboxId: id, Count: 16, Exclude: []string{"/work/big.bin"}}))
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	if _, err := sc.Fork(ctx, connect.NewRequest(&dsecv1.ForkRequest{SandboxId: id, Count: 17})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("a fork of 17: %v, want InvalidArgument", err)
	}
	var kids []string
	for i, c := range fork.Msg.GetChildren() {
		if c.GetError() != "" {
			t.Fatalf("fork child %d: %s", i, c.GetError())
		}
		kid := c.GetSandbox().GetId()
		kids = append(kids, kid)
		t.Cleanup(func() { sc.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: kid})) })
	}
	if len(kids) != 16 {
		t.Fatalf("fork of 16 made %d children", len(kids))
	}
	mustSh(t, d, kids[0], "echo mine > /work/child0")
	for i, kid := range kids {
		out := sh(t, d, kid, "cat /work/src/main.py; ls /work/big.bin 2>&1; cat /work/child0 2>&1")
		if !strings.Contains(out.stdout, `print("hello")`) || !strings.Contains(out.stdout, "No such file") {
			t.Errorf("fork child %d: %q", i, out.stdout)
		}
		if (i == 0) != strings.Contains(out.stdout, "mine") {
			t.Errorf("fork child %d sees another child's file: %q", i, out.stdout)
		}
	}

	list, err := sc.ListSnapshots(ctx, connect.NewRequest(&dsecv1.ListSnapshotsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, s := range list.Msg.GetSnapshots() {
		names[s.GetName()] = true
	}
	if !names["s1"] || !names["s2"] || !names[fork.Msg.GetSnapshot().GetName()] {
		t.Errorf("snapshots listed: %v", names)
	}
	if _, err := sc.DeleteSnapshot(ctx, connect.NewRequest(&dsecv1.DeleteSnapshotRequest{Name: "s2"})); err != nil {
		t.Fatalf("delete snapshot s2: %v", err)
	}
	list, _ = sc.ListSnapshots(ctx, connect.NewRequest(&dsecv1.ListSnapshotsRequest{}))
	for _, s := range list.Msg.GetSnapshots() {
		if s.GetName() == "s2" {
			t.Errorf("deleted snapshot s2 still listed")
		}
	}
}

// firstDiff shows where two listings part.
func firstDiff(a, b string) string {
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	for i := 0; i < len(al) || i < len(bl); i++ {
		var x, y string
		if i < len(al) {
			x = al[i]
		}
		if i < len(bl) {
			y = bl[i]
		}
		if x != y {
			return "line " + strconv.Itoa(i) + ":\n want " + x + "\n  got " + y
		}
	}
	return "(same)"
}
