package container_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/backendtest"
	"dsec.dev/dsec/internal/edge/backend/container"
	"dsec.dev/dsec/internal/testutil"
)

// TestGVisorAgainstRunc starts sandboxes under runc and under runsc
// (DSEC_RUNSC) on the same node and logs, side by side, the time from Start
// to the first exec's exit and the time of an exec of `true`; it checks
// that commands run and what `ls FILE` and `stat FILE` print (Debian's
// runsc of 2022 failed both). It asserts no times.
func TestGVisorAgainstRunc(t *testing.T) {
	runsc := testutil.Runsc(t)
	lower, cfg := conformanceSetup(t)
	const runs, execs = 5, 20
	type result struct{ first, exec []time.Duration }
	results := map[string]*result{}
	for _, name := range []string{"runc", "runsc"} {
		c := cfg(t, filepath.Join(t.TempDir(), name))
		if name == "runsc" {
			c.Runtime, c.RuntimePath, c.RunscPlatform = "runsc", runsc, os.Getenv("DSEC_RUNSC_PLATFORM")
		}
		rt, err := container.New(c)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		if err := rt.Init(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ids, _ := rt.List(ctx)
			for _, id := range ids {
				if err := rt.Delete(ctx, id); err != nil {
					t.Errorf("delete %s: %v", id, err)
				}
			}
			if err := rt.Teardown(ctx); err != nil {
				t.Errorf("teardown: %v", err)
			}
		})
		res := &result{}
		results[name] = res
		for i := range runs {
			id := fmt.Sprintf("%s-%d", name, i)
			spec := backend.Spec{ID: id, Layers: backendtest.DirLayers(lower), DiskBytes: 64 << 20, MemoryBytes: 256 << 20,
				LogPath: filepath.Join(t.TempDir(), id+".log")}
			t0 := time.Now()
			dial, err := rt.Start(ctx, spec)
			if err != nil {
				t.Fatalf("start %s: %v", id, err)
			}
			client := agentclient.New(dial)
			defer client.Close()
			for {
				if _, code, err := execIn(ctx, client, "true"); err == nil && code == 0 {
					break
				} else if time.Since(t0) > 30*time.Second {
					t.Fatalf("%s: no exec answered within 30 s: %v (exit %d)", id, err, code)
				}
				time.Sleep(2 * time.Millisecond)
			}
			res.first = append(res.first, time.Since(t0))
			for range execs {
				t1 := time.Now()
				if _, code, err := execIn(ctx, client, "true"); err != nil || code != 0 {
					t.Fatalf("%s: exec true: exit %d, %v", id, code, err)
				}
				res.exec = append(res.exec, time.Since(t1))
			}
			if i == 0 {
				checkCommands(t, ctx, client, id)
				checkCapture(t, ctx, rt, client, id)
				// The memory limit is on the sandbox's cgroup (runsc's
				// sentry and gofer under gVisor).
				if u, err := rt.Usage(ctx, id); err != nil || u.MemoryLimit != spec.MemoryBytes {
					t.Errorf("%s: usage %+v, %v; want a memory limit of %d", id, u, err, spec.MemoryBytes)
				}
			}
			if err := rt.Delete(ctx, id); err != nil {
				t.Errorf("delete %s: %v", id, err)
			}
		}
	}
	med := func(d []time.Duration) time.Duration {
		d = slices.Clone(d)
		slices.Sort(d)
		return d[len(d)/2]
	}
	rc, rs := results["runc"], results["runsc"]
	t.Logf("create -> first exec, median of %d: runc %v, runsc %v (%.1fx); all runsc %v", runs,
		med(rc.first), med(rs.first), float64(med(rs.first))/float64(med(rc.first)), rs.first)
	t.Logf("exec true, median of %d: runc %v, runsc %v (%.1fx)", runs*execs,
		med(rc.exec), med(rs.exec), float64(med(rs.exec))/float64(med(rc.exec)))
}

// checkCommands runs what Debian's runsc failed and a pipeline.
func checkCommands(t *testing.T, ctx context.Context, c agentclient.Client, id string) {
	t.Helper()
	for _, tc := range []struct{ line, want string }{
		{"ls /etc/passwd", "/etc/passwd"},
		{"stat -c %n:%s /etc/passwd", "/etc/passwd:"},
		{"cat /etc/passwd | grep -c root", "1"},
		{"echo hi > /root/f && cat /root/f", "hi"},
		// The seccomp profile holds (runsc --oci-seccomp): no namespaces.
		{"grep -c '^Seccomp:.*2' /proc/self/status", "1"},
		// The agent's socket is reachable from the host only.
		{"ls -A /.dsec/sock 2>/dev/null | wc -l", "0"},
	} {
		out, code, err := execIn(ctx, c, tc.line)
		if err != nil || code != 0 || !strings.HasPrefix(strings.TrimSpace(out), tc.want) {
			t.Errorf("%s: %q: %q, exit %d, %v; want %q", id, tc.line, out, code, err, tc.want)
		}
	}
}

// checkCapture writes a file in the sandbox, freezes it and checks the
// file is in a capture of its writable layer: under runsc the write goes
// through the sentry and its gofer to the host's upper dir.
func checkCapture(t *testing.T, ctx context.Context, rt backend.Runtime, c agentclient.Client, id string) {
	t.Helper()
	if out, code, err := execIn(ctx, c, "echo captured > /root/c"); err != nil || code != 0 {
		t.Fatalf("%s: write /root/c: %q, exit %d, %v", id, out, code, err)
	}
	p, sn := rt.(backend.Pauser), rt.(backend.Snapshotter)
	if err := p.Freeze(ctx, id); err != nil {
		t.Fatalf("%s: freeze: %v", id, err)
	}
	tree, err := sn.Capture(ctx, id, "check")
	if err != nil {
		t.Fatalf("%s: capture: %v", id, err)
	}
	defer func() {
		if err := tree.Remove(); err != nil {
			t.Errorf("%s: remove the capture: %v", id, err)
		}
	}()
	if err := p.Thaw(ctx, id); err != nil {
		t.Fatalf("%s: thaw: %v", id, err)
	}
	b, err := os.ReadFile(filepath.Join(tree.Dir, "root", "c"))
	if err != nil || string(b) != "captured\n" {
		t.Errorf("%s: /root/c in the capture: %q, %v; want %q", id, b, err, "captured\n")
	}
}

// execIn runs line: a lone word as the command itself (exec of `true`),
// anything else through the sandbox's shell.
func execIn(ctx context.Context, c agentclient.Client, line string) (string, int32, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	argv := []string{"/bin/sh", "-c", line}
	if !strings.ContainsAny(line, " |>") {
		argv = []string{line}
	}
	s, err := c.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: argv})
	if err != nil {
		return "", -1, err
	}
	defer s.Close()
	var out strings.Builder
	code := int32(-1)
	for s.Receive() {
		out.Write(s.Msg().GetStdout())
		out.Write(s.Msg().GetStderr())
		if e := s.Msg().GetExited(); e != nil {
			code = e.ExitCode
		}
	}
	return out.String(), code, s.Err()
}

// TestRunscMissing: a node told to run runsc without one refuses to start
// and names the script that builds it.
func TestRunscMissing(t *testing.T) {
	dir := t.TempDir()
	for _, path := range []string{filepath.Join(dir, "no-runsc"), dir} {
		_, err := container.New(container.Config{Root: dir, UpperRoot: dir, AgentDir: dir,
			Runtime: "runsc", RuntimePath: path})
		if err == nil || !strings.Contains(err.Error(), "scripts/build-runsc.sh") {
			t.Errorf("New with runsc at %s: %v, want an error naming scripts/build-runsc.sh", path, err)
		}
	}
}

// TestGVisorForkBomb runs a fork bomb in one of two gVisor sandboxes: the
// sentry's pids cgroup of its commands (made by the agent, --pids-max)
// refuses forks past the sandbox's pids limit, so the bombed sandbox's
// agent answers, the other sandbox answers, and once the bomb is killed
// the bombed one runs commands again.
func TestGVisorForkBomb(t *testing.T) {
	rt, lower := newGVisor(t)
	ctx := context.Background()
	const pids = 48
	clients := map[string]agentclient.Client{}
	for _, id := range []string{"bomb", "bystander"} {
		spec := backend.Spec{ID: id, Layers: backendtest.DirLayers(lower), DiskBytes: 64 << 20, MemoryBytes: 256 << 20,
			Pids: pids, LogPath: filepath.Join(t.TempDir(), id+".log")}
		dial, err := rt.Start(ctx, spec)
		if err != nil {
			t.Fatalf("start %s: %v", id, err)
		}
		client := agentclient.New(dial)
		t.Cleanup(func() { client.Close() })
		t0 := time.Now()
		for {
			if _, code, err := execIn(ctx, client, "true"); err == nil && code == 0 {
				break
			} else if time.Since(t0) > 30*time.Second {
				t.Fatalf("%s: no exec answered within 30 s: %v (exit %d)", id, err, code)
			}
			time.Sleep(10 * time.Millisecond)
		}
		clients[id] = client
	}
	bomb := clients["bomb"]
	// The bomb runs as a background command, which the agent kills with
	// its cgroup: no new command could start in a full pids cgroup.
	bctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := bomb.ExecEvents(bctx, &dsecv1.ExecRequest{Argv: []string{"/bin/sh", "-c", "f() { f | f & }; f; read x"},
		Background: true, KeepStdinOpen: true})
	if err != nil {
		t.Fatalf("start the fork bomb: %v", err)
	}
	defer stream.Close()
	if !stream.Receive() || stream.Msg().GetStarted() == nil {
		t.Fatalf("the fork bomb did not start: %v", stream.Err())
	}
	bombID := stream.Msg().GetStarted().ProcessId
	// The bomb has reached the limit once the sentry has refused a fork.
	// A command here may not start while the bomb holds every pid: retry.
	var events string
	for t0 := time.Now(); !strings.HasPrefix(events, "max ") || strings.HasPrefix(events, "max 0"); time.Sleep(100 * time.Millisecond) {
		if time.Since(t0) > time.Minute {
			t.Fatalf("no fork refused in a minute: %q", events)
		}
		events, _, _ = execIn(ctx, bomb, "cat /.dsec/cgroup/commands/pids.events /.dsec/cgroup/commands/pids.peak")
	}
	t.Logf("fork bomb under a pids limit of %d: pids.events and pids.peak %q", pids, events)
	if f := strings.Fields(events); len(f) < 3 || f[2] != strconv.Itoa(pids) {
		t.Errorf("pids.events and pids.peak of the commands: %q; want a peak at the limit, %d", events, pids)
	}
	pctx, pcancel := context.WithTimeout(ctx, 30*time.Second)
	defer pcancel()
	if _, err := bomb.Ping(pctx, connect.NewRequest(&agentv1.PingRequest{})); err != nil {
		t.Errorf("the bombed sandbox's agent does not answer: %v", err)
	}
	if out, code, err := execIn(ctx, clients["bystander"], "echo alive"); err != nil || code != 0 || strings.TrimSpace(out) != "alive" {
		t.Errorf("the other sandbox with the bomb going: echo alive: %q, exit %d, %v", out, code, err)
	}
	for _, id := range []string{"bomb", "bystander"} {
		if st, err := rt.Status(ctx, id); err != nil || !st.Running {
			t.Errorf("%s: status with the bomb going: %+v, %v", id, st, err)
		}
	}
	if _, err := bomb.Signal(pctx, connect.NewRequest(&dsecv1.SignalRequest{ProcessId: bombID})); err != nil {
		t.Fatalf("kill the fork bomb: %v", err)
	}
	for t0 := time.Now(); ; time.Sleep(100 * time.Millisecond) {
		out, code, err := execIn(ctx, bomb, "echo alive")
		if err == nil && code == 0 && strings.TrimSpace(out) == "alive" {
			break
		}
		if time.Since(t0) > 30*time.Second {
			t.Fatalf("no command runs 30 s after the bomb was killed: %q, exit %d, %v", out, code, err)
		}
	}
}

// newGVisor is a container runtime under runsc (DSEC_RUNSC, on
// DSEC_RUNSC_PLATFORM) over a test root, deleted with its sandboxes at
// the test's end, and the busybox lower dir sandboxes start on.
func newGVisor(t *testing.T) (*container.Container, string) {
	runsc := testutil.Runsc(t)
	lower, cfg := conformanceSetup(t)
	c := cfg(t, t.TempDir())
	c.Runtime, c.RuntimePath, c.RunscPlatform = "runsc", runsc, os.Getenv("DSEC_RUNSC_PLATFORM")
	rt, err := container.New(c)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := rt.Init(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ids, _ := rt.List(ctx)
		for _, id := range ids {
			if err := rt.Delete(ctx, id); err != nil {
				t.Errorf("delete %s: %v", id, err)
			}
		}
		if err := rt.Teardown(ctx); err != nil {
			t.Errorf("teardown: %v", err)
		}
	})
	return rt, lower
}

// TestGVisorManyPids: a loop of twice a pids limit of 300 stops at the
// limit inside and the sandbox lives: the host's pids limit leaves room
// for the host tasks each sandbox task costs (about 2 under systrap, 12
// under ptrace), which the spec's plus 256 did not (the sentry died).
func TestGVisorManyPids(t *testing.T) {
	rt, lower := newGVisor(t)
	ctx := context.Background()
	const pids = 300
	spec := backend.Spec{ID: "many", Layers: backendtest.DirLayers(lower), DiskBytes: 64 << 20, MemoryBytes: 512 << 20,
		Pids: pids, LogPath: filepath.Join(t.TempDir(), "many.log")}
	dial, err := rt.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	client := agentclient.New(dial)
	defer client.Close()
	for t0 := time.Now(); ; time.Sleep(10 * time.Millisecond) {
		if _, code, err := execIn(ctx, client, "true"); err == nil && code == 0 {
			break
		} else if time.Since(t0) > 30*time.Second {
			t.Fatalf("no exec answered within 30 s: %v (exit %d)", err, code)
		}
	}
	out, code, err := execIn(ctx, client, "i=0; ( while [ $i -lt "+strconv.Itoa(2*pids)+" ]; do sleep 600 & i=$((i+1)); echo $i >/tmp/forks; done ) 2>/dev/null; cat /tmp/forks")
	peak, _ := strconv.Atoi(strings.TrimSpace(out))
	t.Logf("pids limit %d: %d sleeps started", pids, peak)
	if err != nil || code != 0 || peak >= pids || peak < pids/2 {
		t.Errorf("a loop of %d sleeps under a pids limit of %d: %q, exit %d, %v; want fewer than %d started and at least %d", 2*pids, pids, out, code, err, pids, pids/2)
	}
	if st, err := rt.Status(ctx, "many"); err != nil || !st.Running {
		t.Fatalf("status after the loop: %+v, %v", st, err)
	}
	if out, code, err := execIn(ctx, client, "kill -9 -1; echo alive"); err != nil || code != 0 || !strings.Contains(out, "alive") {
		t.Errorf("after the loop: %q, exit %d, %v", out, code, err)
	}
}
