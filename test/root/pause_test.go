package root

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/swap"
	"dsec.dev/dsec/internal/testutil"
)

// startMemhog starts dsec-agent hold-memory in the sandbox, holding mib
// MiB in the background, and returns the checksum of its memory.
func startMemhog(t *testing.T, d *testutil.Daemon, id string, mib int) string {
	t.Helper()
	background(t, d, id, "exec /.dsec/bin/dsec-agent hold-memory "+strconv.Itoa(mib))
	var sum string
	testutil.WaitFor(t, 30*time.Second, "memhog to fill its memory", func() bool {
		sum = strings.TrimSpace(sh(t, d, id, "cat /tmp/memhog.sum 2>/dev/null").stdout)
		return sum != ""
	})
	return sum
}

// background starts command in the sandbox in the background and returns
// its process ID.
func background(t *testing.T, d *testutil.Daemon, id, command string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := d.Clients.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: command, Background: true}))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for st.Receive() {
		if s := st.Msg().GetStarted(); s != nil {
			return s.GetProcessId()
		}
	}
	t.Fatalf("background %q did not start: %v", command, st.Err())
	return ""
}

// memhogSum asks memhog to checksum its memory again and returns the sum.
func memhogSum(t *testing.T, d *testutil.Daemon, id string) string {
	t.Helper()
	mustSh(t, d, id, "rm -f /tmp/memhog.check; kill -USR1 $(cat /tmp/memhog.pid)")
	var sum string
	testutil.WaitFor(t, 30*time.Second, "memhog to check its memory", func() bool {
		sum, _, _ = strings.Cut(strings.TrimSpace(sh(t, d, id, "cat /tmp/memhog.check 2>/dev/null").stdout), " ")
		return sum != ""
	})
	return sum
}

// mib is n bytes in MiB.
func mib(n int64) float64 { return float64(n) / (1 << 20) }

func pause(t *testing.T, d *testutil.Daemon, id string, keepMemory bool) *dsecv1.PauseResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := d.Clients.Sandboxes.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: id, KeepMemory: keepMemory}))
	if err != nil {
		t.Fatalf("pause %s: %v", id, err)
	}
	return resp.Msg
}

func resume(t *testing.T, d *testutil.Daemon, id string) *dsecv1.ResumeResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := d.Clients.Sandboxes.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: id}))
	if err != nil {
		t.Fatalf("resume %s: %v", id, err)
	}
	return resp.Msg
}

func state(t *testing.T, d *testutil.Daemon, id string) *dsecv1.Sandbox {
	t.Helper()
	sb, err := d.Clients.Sandboxes.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	if err != nil {
		t.Fatal(err)
	}
	return sb.Msg
}

// TestPauseReleasesMemoryAndSurvivesRestart: on a node with swap of its own,
// a paused sandbox releases at least 90 % of its resident memory (measured
// in its memory cgroup), whether it is its processes' memory or a file in
// /dev/shm written and read back just before the pause; the sandboxes stay
// paused across a restart of dsecd, and the next exec resumes each with
// every byte of its memory intact.
func TestPauseReleasesMemoryAndSurvivesRestart(t *testing.T) {
	d := startDaemon(t, "--swap", "file:768M")
	sb := create(t, d, &dsecv1.SandboxSpec{MemoryMb: 256})
	id := sb.GetId()
	sum := startMemhog(t, d, id, 128)

	p := pause(t, d, id, false)
	st := p.GetSandbox().GetLastPause()
	t.Logf("pause: frozen in %d µs, reclaim %d ms, resident %d MiB, released %d MiB, %d MiB to swap",
		st.GetFrozenUs(), st.GetReclaimMs(), st.GetResidentBytes()>>20, st.GetReleasedBytes()>>20, st.GetSwappedBytes()>>20)
	if p.GetSandbox().GetState() != dsecv1.State_STATE_PAUSED || p.GetAlreadyPaused() {
		t.Fatalf("pause answered %v", p)
	}
	if st.GetResidentBytes() < 128<<20 || st.GetReleasedBytes()*10 < st.GetResidentBytes()*9 {
		t.Errorf("released %d of %d resident bytes, want at least 90 %%", st.GetReleasedBytes(), st.GetResidentBytes())
	}

	// Shared memory read just before the pause (what multiprocessing,
	// browsers and test runners keep in /dev/shm), paused with the CLI: the
	// kernel holds pages touched twice on its active list, which reclaim
	// ages only once its statistics, up to two seconds old, say so.
	shm := create(t, d, &dsecv1.SandboxSpec{MemoryMb: 128}).GetId()
	shmSum := mustSh(t, d, shm, "dd if=/dev/urandom of=/dev/shm/f bs=1M count=64 2>/dev/null && md5sum /dev/shm/f")
	out, errOut, code := d.CLI("", "--json", "pause", shm)
	if code != 0 {
		t.Fatalf("dsec --json pause %s: exit %d: %s%s", shm, code, out, errOut)
	}
	var sp dsecv1.PauseResponse
	if err := protojson.Unmarshal([]byte(out), &sp); err != nil {
		t.Fatalf("dsec --json pause printed %q: %v", out, err)
	}
	st = sp.GetSandbox().GetLastPause()
	t.Logf("pause with /dev/shm read back: reclaim %d ms, resident %.1f MiB, released %.1f MiB, %.1f MiB to swap, kept %.1f MiB (%.1f shared) %q",
		st.GetReclaimMs(), mib(st.GetResidentBytes()), mib(st.GetReleasedBytes()), mib(st.GetSwappedBytes()),
		mib(st.GetKeptBytes()), mib(st.GetKeptShmemBytes()), st.GetKeptReason())
	if st.GetResidentBytes() < 64<<20 || st.GetReleasedBytes()*10 < st.GetResidentBytes()*9 {
		t.Errorf("a sandbox with 64 MiB in /dev/shm, read back before its pause, released %.1f of %.1f MiB, want at least 90 %%",
			mib(st.GetReleasedBytes()), mib(st.GetResidentBytes()))
	}
	if kept := st.GetResidentBytes() - st.GetReleasedBytes(); st.GetKeptBytes() < kept-1<<20 || st.GetKeptBytes() > kept+1<<20 {
		t.Errorf("kept_bytes %d, want resident - released = %d", st.GetKeptBytes(), kept)
	}
	if again := pause(t, d, id, false); !again.GetAlreadyPaused() {
		t.Errorf("a second pause did not say it was paused already: %v", again)
	}
	if r := state(t, d, id).GetPauseReleases(); !strings.Contains(r, "swap free") {
		t.Errorf("pause_releases = %q, want it to name the node's swap", r)
	}

	d.Kill()
	d.Start()
	for _, id := range []string{id, shm} {
		if got := state(t, d, id); got.GetState() != dsecv1.State_STATE_PAUSED {
			t.Fatalf("after a restart of dsecd: %s, want paused", got.GetState())
		}
	}
	// Any call resumes it.
	if got := memhogSum(t, d, id); got != sum {
		t.Fatalf("memory changed across pause and restart: %s, was %s", got, sum)
	}
	if got := mustSh(t, d, shm, "md5sum /dev/shm/f"); got != shmSum {
		t.Fatalf("/dev/shm changed across pause and restart: %q, was %q", got, shmSum)
	}
	if got := state(t, d, id); got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("after an exec: %s, want running", got.GetState())
	}
	if r := resume(t, d, id); !r.GetAlreadyRunning() {
		t.Errorf("resume of a running sandbox did not say so: %v", r)
	}
}

// TestPauseCyclesLoseNothing: a sandbox writing files and holding memory
// while it is paused and resumed a thousand times (every twentieth pause
// releases its memory to swap) loses and changes no byte of either (E2B's
// #884 and #1104). The cluster pass cycles a hundred times: what it adds,
// the apiserver's routing of each pause and resume, shows in the first
// hundred, and the thousand's freezes and swaps are the edge's, which the
// all-in-one pass cycles.
func TestPauseCyclesLoseNothing(t *testing.T) {
	d := startDaemon(t, "--swap", "file:512M")
	sb := create(t, d, &dsecv1.SandboxSpec{MemoryMb: 256})
	id := sb.GetId()
	sum := startMemhog(t, d, id, 32)
	// A writer that checksums every file it writes, all through the cycles.
	writer := background(t, d, id, `mkdir -p /tmp/w; i=0
while :; do head -c 8192 /dev/urandom > /tmp/w/f$i; (cd /tmp/w && md5sum f$i >> ../sums); i=$((i+1)); done`)

	cycles := 1000
	if testutil.ClusterMode() {
		cycles = 100
	}
	start := time.Now()
	for i := range cycles {
		p := pause(t, d, id, i%20 != 0)
		if p.GetSandbox().GetState() != dsecv1.State_STATE_PAUSED {
			t.Fatalf("cycle %d: pause left it %s", i, p.GetSandbox().GetState())
		}
		r := resume(t, d, id)
		if r.GetSandbox().GetState() != dsecv1.State_STATE_RUNNING {
			t.Fatalf("cycle %d: resume left it %s", i, r.GetSandbox().GetState())
		}
	}
	t.Logf("%d pause/resume cycles in %s", cycles, time.Since(start).Round(time.Millisecond))
	if _, err := d.Clients.Sandboxes.Signal(context.Background(), connect.NewRequest(&dsecv1.SignalRequest{SandboxId: id, ProcessId: writer})); err != nil {
		t.Fatalf("stop the writer: %v", err)
	}
	time.Sleep(100 * time.Millisecond)
	written := strings.TrimSpace(mustSh(t, d, id, "wc -l < /tmp/sums"))
	if res := sh(t, d, id, "cd /tmp/w && md5sum -c ../sums 2>&1 | grep -v ': OK$' | head -5"); strings.TrimSpace(res.stdout) != "" {
		t.Fatalf("files changed across pauses:\n%s", res.stdout)
	}
	if n, _ := strconv.Atoi(written); n < cycles/10 {
		t.Fatalf("the writer wrote only %s files", written)
	}
	if got := memhogSum(t, d, id); got != sum {
		t.Fatalf("memory changed across %d pauses: %s, was %s", cycles, got, sum)
	}
	t.Logf("the writer wrote and checked %s files", written)
}

// TestPauseConcurrentCalls: pauses, resumes and execs on one sandbox at
// once never deadlock, and leave it running or paused, never half frozen;
// an exec caught by a pause carries on once the sandbox is resumed; a
// paused sandbox can be deleted.
func TestPauseConcurrentCalls(t *testing.T) {
	d := startDaemon(t)
	sb := create(t, d, nil)
	id := sb.GetId()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var lifecycle, execs sync.WaitGroup
	errs := make(chan error, 60)
	for i := range 40 {
		if i%2 == 0 {
			execs.Add(1)
			go func() {
				defer execs.Done()
				st, err := d.Clients.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: "echo hi"}))
				if err == nil {
					out := ""
					for st.Receive() {
						out += string(st.Msg().GetStdout())
					}
					err = st.Err()
					st.Close()
					if err == nil && out != "hi\n" {
						err = fmt.Errorf("exec printed %q", out)
					}
				}
				errs <- err
			}()
			continue
		}
		lifecycle.Add(1)
		go func() {
			defer lifecycle.Done()
			var err error
			if i%4 == 1 {
				_, err = d.Clients.Sandboxes.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: id, KeepMemory: i%8 == 1}))
			} else {
				_, err = d.Clients.Sandboxes.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: id}))
			}
			errs <- err
		}()
	}
	lifecycle.Wait()
	// An exec the last pause caught goes on when the sandbox runs again.
	// (An exec may be resuming it by itself meanwhile: a resume waits.)
	resume(t, d, id)
	execs.Wait()
	if s := state(t, d, id).GetState(); s != dsecv1.State_STATE_RUNNING {
		t.Fatalf("after concurrent pauses, resumes and execs, and a resume: %s", s)
	}
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("concurrent call: %v", err)
		}
	}
	if out := strings.TrimSpace(mustSh(t, d, id, "echo alive")); out != "alive" {
		t.Fatalf("exec after concurrent calls: %q", out)
	}
	// Without swap, shared memory stays in RAM, and the pause says so.
	mustSh(t, d, id, "dd if=/dev/zero of=/dev/shm/f bs=1M count=8 2>/dev/null")
	out, errOut, code := d.CLI("", "pause", id)
	if code != 0 {
		t.Fatalf("dsec pause %s: exit %d: %s%s", id, code, out, errOut)
	}
	if host, err := swap.Describe(""); err != nil || host.Total > 0 {
		t.Logf("the host has swap: not checking what a pause without swap says: %s", out)
	} else if !strings.Contains(out, " of shared memory (tmpfs files such as /dev/shm") || !strings.Contains(out, "the node has no swap") {
		t.Errorf("dsec pause of a sandbox with 8 MiB in /dev/shm on a node without swap printed %q: want what it kept and why", out)
	}
	if _, err := d.Clients.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id})); err != nil {
		t.Fatalf("delete a paused sandbox: %v", err)
	}
	if s := state(t, d, id).GetState(); s != dsecv1.State_STATE_STOPPED {
		t.Fatalf("a deleted paused sandbox is %s", s)
	}
}
