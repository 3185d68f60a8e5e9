package root

import (
	"context"
	"encoding/csv"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// TestLedger runs two sandboxes of one run and two tasks that burn CPU
// (a shell loop whose own CPU time the shell reports from /proc), write a
// known number of bytes to their writable layer and send a known number
// of bytes to a test host of the test's own netns; snapshots the first;
// deletes them; and reads the cost ledger through the Go SDK and the CLI:
// each figure matches what the sandboxes did within the tolerance
// docs/usage.md states, the snapshot's bytes are its size as dsec snapshot
// ls reports it, the sums
// by label:task and label:run are right, and the rows survive the
// sandboxes' deletion.
func TestLedger(t *testing.T) {
	hostAddr, gw := netip.MustParseAddr("198.18.33.10"), netip.MustParseAddr("198.18.33.1")
	testutil.RequireUnrouted(t, hostAddr, gw)
	d := startDaemon(t)
	host := testutil.StartNetHost(t, "ldgh1", hostAddr, gw)
	// A sink on the test host: it counts what it receives.
	const sinkPort = 7033
	ln := host.Listen(t, sinkPort)
	var received atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				n, _ := io.Copy(io.Discard, c)
				received.Add(n)
			}()
		}
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()

	const (
		diskBytes   = 8 << 20
		egressBytes = 4 << 20
	)
	type ran struct {
		id      string
		task    string
		loopCPU time.Duration // the loop's own CPU time, as its shell read it
		sent    int64
	}
	var sbs []*ran
	c := sdkClient(t, d.Addr, d.Token())
	for _, task := range []string{"ta", "tb"} {
		sb := create(t, d, &dsecv1.SandboxSpec{Labels: map[string]string{"run": "lr1", "task": task},
			NetworkRules: map[string]bool{hostAddr.String() + "/32": true}})
		r := &ran{id: sb.GetId(), task: task}
		// CPU: a loop in a shell of its own, which then prints its utime
		// and stime (clock ticks of 1/100 s) from /proc.
		out := mustSh(t, d, r.id, `busybox sh -c 'i=0; while [ $i -lt 1000000 ]; do i=$((i+1)); done; cut -d" " -f14,15 /proc/$$/stat'`)
		var ut, st int64
		if _, err := fmt.Sscan(out, &ut, &st); err != nil {
			t.Fatalf("the loop's CPU time: %q: %v", out, err)
		}
		r.loopCPU = time.Duration(ut+st) * 10 * time.Millisecond
		mustSh(t, d, r.id, fmt.Sprintf("busybox head -c %d /dev/urandom > /ledger.bin && busybox sync", diskBytes))
		before := received.Load()
		mustSh(t, d, r.id, fmt.Sprintf("busybox head -c %d /dev/zero | busybox nc -w 10 %s %d", egressBytes, hostAddr, sinkPort))
		for deadline := time.Now().Add(10 * time.Second); received.Load()-before < egressBytes && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		}
		if got := received.Load() - before; got != egressBytes {
			t.Fatalf("the test host received %d bytes from %s, want %d", got, r.id, egressBytes)
		}
		r.sent = egressBytes
		sbs = append(sbs, r)
	}
	// A snapshot of the first sandbox: its writable layer holds the file.
	const snapName = "ledger-snap"
	snap, err := c.Snapshot(ctx, sbs[0].id, snapName)
	if err != nil {
		t.Fatalf("snapshot %s: %v", sbs[0].id, err)
	}
	t.Cleanup(func() { c.DeleteSnapshot(context.Background(), snapName) })
	// Packed: the file and the image's metadata, padded to a multiple of
	// 2 MiB (image.LayerAlign), so 10 MiB.
	if snap.GetSize() < diskBytes || snap.GetSize() > diskBytes+2<<20 {
		t.Errorf("snapshot of a layer holding %d random bytes: %d bytes packed, want within [+0, +2 MiB]", diskBytes, snap.GetSize())
	}
	// Its size as dsec snapshot ls reports it.
	lsOut, lsErr, code := d.CLI("", "--json", "snapshot", "ls")
	var ls dsecv1.ListSnapshotsResponse
	if code != 0 {
		t.Fatalf("dsec snapshot ls: %s %s", lsOut, lsErr)
	}
	if err := protojson.Unmarshal([]byte(lsOut), &ls); err != nil {
		t.Fatalf("dsec snapshot ls --json printed %q: %v", lsOut, err)
	}
	var snapSize int64 = -1
	for _, s := range ls.GetSnapshots() {
		if s.GetName() == snapName {
			snapSize = s.GetSize()
		}
	}
	if snapSize != snap.GetSize() {
		t.Errorf("dsec snapshot ls: %s is %d bytes, the Snapshot call said %d", snapName, snapSize, snap.GetSize())
	}
	for _, r := range sbs {
		if _, err := d.Clients.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: r.id})); err != nil {
			t.Fatal(err)
		}
	}

	// The ledger after the deletes: the last samples reach the store
	// within a pull or two. Until a sandbox's end is stored its figures
	// may still grow (its last sample comes with its end), and the reads
	// below must see the same rows: wait until neither is among the rows
	// of sandboxes still alive, those a window starting in the future
	// selects.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		live, err := c.Usage(ctx, dsec.UsageQuery{By: "sandbox", Since: time.Now().Add(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		var open []string
		for _, g := range live.Groups {
			if g.Key == sbs[0].id || g.Key == sbs[1].id {
				open = append(open, g.Key)
			}
		}
		if len(open) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the ledger has no end of deleted sandboxes %v after 30 s", open)
		}
	}
	var bySandbox *dsec.UsageReport
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		var err error
		if bySandbox, err = c.Usage(ctx, dsec.UsageQuery{By: "sandbox"}); err != nil {
			t.Fatal(err)
		}
		if bySandbox.Total.Sandboxes == 2 && bySandbox.Total.EgressBytes >= 2*egressBytes && bySandbox.Total.SnapshotBytes > 0 || time.Now().After(deadline) {
			break
		}
	}
	groups := map[string]dsec.Usage{}
	for _, g := range bySandbox.Groups {
		groups[g.Key] = g.Usage
	}
	for _, r := range sbs {
		u, ok := groups[r.id]
		if !ok {
			t.Fatalf("no ledger row for deleted sandbox %s: %+v", r.id, bySandbox)
		}
		t.Logf("%s: loop %.2f s of CPU; ledger %+v", r.id, r.loopCPU.Seconds(), u)
		// CPU: at least the loop's, and at most 0.5 s more (the agent,
		// the other commands; the loop's ticks round down by 20 ms).
		if cpu := time.Duration(u.CPUSeconds * float64(time.Second)); cpu < r.loopCPU-20*time.Millisecond || cpu > r.loopCPU+500*time.Millisecond {
			t.Errorf("%s: ledger CPU %v, the loop's %v: want within [-20 ms, +500 ms]", r.id, cpu, r.loopCPU)
		}
		if r.loopCPU < 50*time.Millisecond {
			t.Errorf("%s: the loop used %v of CPU: too little to check the ledger against", r.id, r.loopCPU)
		}
		// Egress: what the host received, plus the frames' headers (at
		// most 10 %) and the handshake.
		if u.EgressBytes < r.sent || u.EgressBytes > r.sent+r.sent/10+64<<10 {
			t.Errorf("%s: ledger egress %d bytes, sent %d: want within [+0, +10 %% + 64 KiB]", r.id, u.EgressBytes, r.sent)
		}
		// Disk: the writable layer at its largest holds the file (and a
		// little of the agent's and the shell's).
		if u.DiskPeakBytes < diskBytes || u.DiskPeakBytes > diskBytes+2<<20 {
			t.Errorf("%s: the writable layer's peak %d bytes, wrote %d: want within [+0, +2 MiB]", r.id, u.DiskPeakBytes, diskBytes)
		}
		// Snapshots: the first sandbox's is its one snapshot's size, the
		// second took none.
		if want := map[bool]int64{true: snapSize}[r == sbs[0]]; u.SnapshotBytes != want {
			t.Errorf("%s: ledger snapshot bytes %d, want %d (dsec snapshot ls)", r.id, u.SnapshotBytes, want)
		}
		if u.DiskGiBHours <= 0 || u.MemoryGiBSec <= 0 || u.Sandboxes != 1 {
			t.Errorf("%s: disk %v GiB-h, memory %v GiB-s, sandboxes %d: want the integrals above 0 and one sandbox", r.id, u.DiskGiBHours, u.MemoryGiBSec, u.Sandboxes)
		}
	}

	// By label: each task alone, the run both.
	byTask, err := c.Usage(ctx, dsec.UsageQuery{By: "label:task"})
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range byTask.Groups {
		if want, ok := groups[map[string]string{"ta": sbs[0].id, "tb": sbs[1].id}[g.Key]]; !ok || g.Usage != want {
			t.Errorf("by task, %q: %+v; want its sandbox's %+v", g.Key, g.Usage, want)
		}
	}
	if len(byTask.Groups) != 2 {
		t.Errorf("by task: %d groups, want 2: %+v", len(byTask.Groups), byTask.Groups)
	}
	// The CLI's CSV, by run: one row, both sandboxes.
	cmd := exec.CommandContext(ctx, filepath.Join(d.Bin, "dsec"), "--addr", d.Addr, "usage", "--by", "label:run", "--since", "1h", "--csv")
	cmd.Env = append(os.Environ(), "DSEC_TOKEN="+d.Token(), "DSEC_TOKEN_FILE=")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("dsec usage --by label:run --csv: %v", err)
	}
	rows, err := csv.NewReader(strings.NewReader(string(out))).ReadAll()
	if err != nil || len(rows) != 2 || rows[1][0] != "lr1" || rows[1][1] != "2" {
		t.Fatalf("dsec usage --by label:run --csv printed %q (%v): want a header and lr1 with 2 sandboxes", out, err)
	}
	egress, _ := strconv.ParseInt(rows[1][7], 10, 64)
	if want := groups[sbs[0].id].EgressBytes + groups[sbs[1].id].EgressBytes; egress != want {
		t.Errorf("run lr1's egress %d, want the sandboxes' sum %d", egress, want)
	}
	if snapBytes, _ := strconv.ParseInt(rows[1][6], 10, 64); snapBytes != snapSize {
		t.Errorf("run lr1's snapshot bytes %d (dsec usage --csv), want the snapshot's %d", snapBytes, snapSize)
	}
}
