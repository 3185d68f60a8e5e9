package root

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// trajectoryOf reads a sandbox's trajectory through the CLI: its lines,
// and the state and hash the CLI reports on stderr.
func trajectoryOf(t *testing.T, d *testutil.Daemon, id string, extra ...string) (lines []dsec.TrajectoryLine, raw, state, sum string) {
	t.Helper()
	out, errOut, code := d.CLI("", append([]string{"trajectory", id}, extra...)...)
	if code != 0 {
		t.Fatalf("dsec trajectory %s: exit %d: %s", id, code, errOut)
	}
	m := regexp.MustCompile(`: (live|ended), \d+ bytes, sha256 ([0-9a-f]{64})`).FindStringSubmatch(errOut)
	if m == nil {
		t.Fatalf("dsec trajectory %s printed no state and hash: %q", id, errOut)
	}
	lines, err := dsec.ParseTrajectory(strings.NewReader(out))
	if err != nil {
		t.Fatalf("dsec trajectory %s: %v\n%s", id, err, out)
	}
	return lines, out, m[1], m[2]
}

func rm(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	if _, errOut, code := d.CLI("", "rm", id); code != 0 {
		t.Fatalf("dsec rm %s: %s", id, errOut)
	}
}

// TestTrajectory: a sandbox's trajectory holds its calls in order with
// their exits and outputs and its network events between them, through the
// CLI while it lives (and from an offset) and after its deletion, with one
// hash; a capped trajectory (a command writing megabytes, then hundreds of
// calls) degrades to hashes and counts and says what it dropped.
func TestTrajectory(t *testing.T) {
	const maxBytes, maxOutput = 32 << 10, 4096
	e := setupNetwork(t, "--trajectory-max-bytes", fmt.Sprint(maxBytes), "--trajectory-max-output", fmt.Sprint(maxOutput))
	d := e.d
	sb := e.sandbox(t, map[string]bool{"pypi": true})
	id := sb.GetId()
	if r := sh(t, d, id, "echo hello; echo oops >&2; exit 3"); r.exit.GetExitCode() != 3 {
		t.Fatalf("exit 3: %s", r)
	}
	e.probeFails(t, id, "connect "+e.npm.addr+":80")
	e.probeOK(t, id, "get http://pypi.test/")
	if _, errOut, code := d.CLI("", "exec", id, "touch", "/tmp/last"); code != 0 {
		t.Fatalf("dsec exec: %s", errOut)
	}

	lines, raw, state, _ := trajectoryOf(t, d, id)
	if state != "live" {
		t.Errorf("a live sandbox's trajectory is %s", state)
	}
	if len(lines) == 0 || lines[0].Type != "begin" || lines[0].Sandbox.ID != id || lines[0].Sandbox.Environment != env {
		t.Fatalf("the trajectory does not begin with its sandbox:\n%s", raw)
	}
	var calls []string
	var denied, allowed, pos = false, false, map[string]int{}
	for i, l := range lines {
		if i > 0 && l.Seq != lines[i-1].Seq+1 {
			t.Errorf("line %d has seq %d after %d", i, l.Seq, lines[i-1].Seq)
		}
		switch l.Type {
		case "call":
			name := l.Call
			if l.Call == "exec" {
				var a struct{ Command string }
				json.Unmarshal(l.Args, &a)
				name += ":" + a.Command
				if a.Command == "" {
					name += ":argv"
				}
			}
			calls = append(calls, name)
			pos[name] = i
		case "net":
			var n struct{ Verdict, Kind string }
			json.Unmarshal(l.Net, &n)
			if n.Verdict == "deny" && n.Kind == "connect" {
				denied = true
				if _, ok := pos["netprobe connect"]; !ok {
					pos["denied"] = i
				}
			}
			if n.Verdict == "allow" {
				allowed = true
			}
		}
	}
	want := []string{"write_file", "exec:echo hello; echo oops >&2; exit 3", "exec:netprobe connect " + e.npm.addr + ":80", "exec:netprobe get http://pypi.test/", "exec::argv"}
	if strings.Join(calls, "|") != strings.Join(want, "|") {
		t.Errorf("calls recorded %q, want %q", calls, want)
	}
	if !denied || !allowed {
		t.Errorf("the trajectory lacks the denied connect (%v) or the allowed fetch (%v):\n%s", denied, allowed, raw)
	}
	for _, l := range lines {
		if l.Call == "exec" && strings.Contains(string(l.Args), "echo hello") {
			if l.Exit == nil || *l.Exit != 3 || l.Stdout == nil || l.Stdout.Text != "hello\n" || l.Stderr == nil || l.Stderr.Text != "oops\n" || l.Stdout.Bytes != 6 {
				t.Errorf("the exec's line: exit %v, stdout %+v, stderr %+v", l.Exit, l.Stdout, l.Stderr)
			}
		}
		if l.Call == "write_file" && (l.Args != nil || l.ArgsSHA256 == "" || l.ArgsBytes < 1<<20) {
			t.Errorf("a write of a whole binary keeps its arguments (%d bytes) instead of their hash", len(l.Args))
		}
	}

	// A trainer re-attaching reads from where it stopped.
	off := len(raw)
	sh(t, d, id, "echo after")
	more, moreRaw, _, _ := trajectoryOf(t, d, id, "--since", fmt.Sprint(off))
	if len(more) == 0 || more[len(more)-1].Call != "exec" || !strings.Contains(string(more[len(more)-1].Args), "echo after") || more[0].Seq != lines[len(lines)-1].Seq+1 {
		t.Errorf("read from offset %d: %s", off, moreRaw)
	}

	rm(t, d, id)
	after, afterRaw, state, sum := trajectoryOf(t, d, id)
	if state != "ended" {
		t.Errorf("a deleted sandbox's trajectory is %s", state)
	}
	if !strings.HasPrefix(afterRaw, raw) || after[len(after)-1].Type != "end" || after[len(after)-2].Call != "delete" {
		t.Errorf("after the delete the trajectory does not carry on and end:\n%s", afterRaw)
	}
	if _, _, _, sum2 := trajectoryOf(t, d, id); sum2 != sum {
		t.Errorf("the ended trajectory's hash changed: %s then %s", sum, sum2)
	}

	// The caps: one command writing 3 MB, then calls past the bounds.
	capped := create(t, d, nil).GetId()
	mustSh(t, d, capped, "yes | head -c 3000000")
	for range 8 { // 8 lines of ~4.3 KiB: past 32 KiB of full lines
		mustSh(t, d, capped, "head -c 4096 /dev/zero | tr '\\0' a")
	}
	for range 300 { // degraded lines of ~250 bytes: past twice the bound
		mustSh(t, d, capped, "true")
	}
	rm(t, d, capped)
	cl, _, _, _ := trajectoryOf(t, d, capped)
	big := cl[1]
	if big.Stdout == nil || big.Stdout.Bytes != 3000000 || !big.Stdout.Truncated || len(big.Stdout.Text) != maxOutput || len(big.Stdout.SHA256) != 64 {
		t.Errorf("the 3 MB command's line: %+v", big.Stdout)
	}
	var degraded int
	for _, l := range cl {
		if l.Degraded {
			degraded++
			if l.Stdout != nil && l.Stdout.Text != "" {
				t.Errorf("a degraded line keeps output: %+v", l.Stdout)
			}
		}
	}
	last := cl[len(cl)-1]
	if last.Type != "end" {
		t.Fatalf("the capped trajectory has no end line")
	}
	var dropped struct {
		Calls       int64 `json:"calls"`
		Degraded    int64 `json:"degraded"`
		OutputBytes int64 `json:"output_bytes"`
	}
	var endLine struct {
		Dropped *struct {
			Calls       int64 `json:"calls"`
			Degraded    int64 `json:"degraded"`
			OutputBytes int64 `json:"output_bytes"`
		} `json:"dropped"`
	}
	json.Unmarshal(last.End, &endLine)
	if endLine.Dropped != nil {
		dropped = *endLine.Dropped
	}
	if degraded == 0 || dropped.Degraded != int64(degraded) || dropped.Calls == 0 || dropped.OutputBytes < 3000000-maxOutput {
		t.Errorf("degraded lines %d, end says %+v", degraded, dropped)
	}
	if size := fileSize(t, d, capped); size > 2*maxBytes+8<<10 {
		t.Errorf("the capped trajectory takes %d bytes, past twice its bound %d", size, maxBytes)
	}
	t.Logf("capped: %d lines, %d degraded, dropped %+v", len(cl), degraded, dropped)
}

// fileSize is the size of a trajectory's file on the node (the cluster
// pass: on its edge).
func fileSize(t *testing.T, d *testutil.Daemon, id string) int64 {
	t.Helper()
	matches, _ := filepath.Glob(filepath.Join(d.Root, "*", "trajectories", id+".jsonl"))
	matches2, _ := filepath.Glob(filepath.Join(d.Root, "trajectories", id+".jsonl"))
	for _, p := range append(matches, matches2...) {
		if st, err := os.Stat(p); err == nil {
			return st.Size()
		}
	}
	t.Logf("no trajectory file of %s under %s", id, d.Root)
	return 0
}

// TestReplay: a replay of a trajectory with a command printing $RANDOM
// finds it diverges (and only it), one of deterministic commands matches
// step by step; through the CLI from a deleted sandbox's ID and a file, and
// through the Go SDK.
func TestReplay(t *testing.T) {
	d := startDaemon(t)
	record := func(commands ...string) string {
		id := create(t, d, nil).GetId()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := d.Clients.Sandboxes.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{
			SandboxId: id, Path: "/w/seed", Data: []byte("42\n"), MakeParents: true})); err != nil {
			t.Fatal(err)
		}
		for _, c := range commands {
			sh(t, d, id, c)
		}
		rm(t, d, id)
		return id
	}
	planted := record("cat /w/seed", "echo $RANDOM$RANDOM$RANDOM", "expr 2 + 3")
	steady := record("cat /w/seed", "expr 2 + 3", "ls /w; exit 4")

	out, errOut, code := d.CLI("", "replay", "--json", planted)
	if code != 3 {
		t.Fatalf("replay of the planted non-determinism: exit %d, want 3:\n%s%s", code, out, errOut)
	}
	var rep dsec.ReplayReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("replay --json: %v\n%s", err, out)
	}
	var verdicts []string
	for _, s := range rep.Steps {
		verdicts = append(verdicts, s.Call+":"+s.Verdict)
	}
	if want := "write_file:match exec:match exec:diverged exec:match delete:skipped"; strings.Join(verdicts, " ") != want {
		t.Errorf("replay of the planted non-determinism: %s, want %s:\n%s", strings.Join(verdicts, " "), want, out)
	} else if s := rep.Steps[2]; s.Detail != "[stdout differs]" || *s.WantExit != 0 || *s.GotExit != 0 {
		t.Errorf("the $RANDOM step: %+v", s)
	}
	if out, _, code := d.CLI("", "replay", planted); code != 3 || !strings.Contains(out, "3 matched, 1 diverged, 1 skipped") {
		t.Errorf("replay's table: exit %d:\n%s", code, out)
	}

	_, raw, _, _ := trajectoryOf(t, d, steady)
	file := filepath.Join(t.TempDir(), "steady.jsonl")
	if err := os.WriteFile(file, []byte(raw), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, errOut, code := d.CLI("", "replay", file); code != 0 || !strings.Contains(out, "4 matched, 0 diverged") {
		t.Errorf("replay of a deterministic trajectory: exit %d:\n%s%s", code, out, errOut)
	}

	c, err := dsec.NewClient(d.Addr, dsec.WithToken(d.Token()))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	lines, err := dsec.ParseTrajectory(strings.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	sdkRep, err := c.Replay(context.Background(), lines, nil)
	if err != nil || !sdkRep.Deterministic() || sdkRep.Matched != 4 {
		t.Errorf("SDK replay: %+v, %v", sdkRep, err)
	}
}
