package root

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dsec "dsec.dev/dsec/sdk/go"
)

// The platform's faults caused for real (docs/outcomes.md), beside
// TestOutcomes and TestEdgeLostMidExec: an edge killed under a grade, a
// create whose start times out, a sandbox preempted under a command.

// TestEdgeLostMidGrade: an edge killed (SIGKILL) while a grader runs in a
// clean room on it ends the grade as the platform's fault, through the Go
// SDK (an error typed edge_unreachable or node_lost) and the CLI (exit 202
// or 201), never as a reward.
func TestEdgeLostMidGrade(t *testing.T) {
	onePassOnly(t)
	c := startRealCluster(t, 1)
	api := c.APIServers[0]
	cl := sdkClient(t, api.Addr, api.Token)
	ctx := t.Context()
	sb, err := cl.Create(ctx, env, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := sb.Exec(ctx, dsec.Sh("mkdir -p /work && echo 42 > /work/answer"), nil); err != nil || r.ExitCode != 0 {
		t.Fatalf("setup: %v %+v", err, r)
	}
	sdkDone := make(chan error, 1)
	go func() {
		res, err := sb.Grade(ctx, dsec.GradeOptions{Paths: []string{"/work"}, Command: "touch /tmp/grader-60 && sleep 60", Timeout: 50 * time.Second})
		if err == nil {
			err = fmt.Errorf("the grade returned reward %v, exit %v, fault %v", res.GetReward(), res.GetExit().GetStatus(), res.GetFault())
		}
		sdkDone <- err
	}()
	cmd := exec.Command(filepath.Join(c.Bin, "dsec"), "--addr", api.Addr, "grade", sb.ID, "--path", "/work", "-c", "touch /tmp/grader-61 && sleep 61")
	cmd.Env = append(os.Environ(), "DSEC_TOKEN="+api.Token)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	// Both graders run, each in its clean room.
	for _, marker := range []string{"/tmp/grader-60", "/tmp/grader-61"} {
		waitGrader(t, cl, sb.ID, marker)
	}
	c.Edges[0].Kill()
	if err := <-sdkDone; !lostEdge(dsec.InfraFault(err)) {
		t.Errorf("SDK grade on a killed edge: %v: fault %q, want edge_unreachable or node_lost", err, dsec.InfraFault(err))
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || (ee.ExitCode() != 202 && ee.ExitCode() != 201) || !strings.Contains(stderr.String(), "infrastructure fault (") || stdout.Len() != 0 {
		t.Errorf("dsec grade on a killed edge: %v, stdout %q, stderr %q; want exit 202 (or 201) and no reward", err, stdout.String(), stderr.String())
	}
}

func lostEdge(f dsec.Fault) bool { return f == dsec.FaultEdgeUnreachable || f == dsec.FaultNodeLost }

// waitGrader waits until a clean room grading sandbox id holds the file
// marker its grader makes as it starts.
func waitGrader(t *testing.T, cl *dsec.Client, id, marker string) {
	t.Helper()
	var last string
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		rooms, err := cl.List(t.Context(), map[string]string{"dsec.dev/grade-of": id})
		if err != nil {
			last = fmt.Sprintf("list the clean rooms: %v", err)
			continue
		}
		last = fmt.Sprintf("%d clean rooms", len(rooms))
		for _, room := range rooms {
			r, err := room.Exec(t.Context(), dsec.Sh("test -e "+marker), nil)
			if err == nil && r.Status == dsec.StatusOK {
				return
			}
			last += fmt.Sprintf("; %s: %v %+v", room.ID, err, r)
		}
	}
	t.Fatalf("no clean room grading %s ever made %s: %s", id, marker, last)
}

// TestEdgeStoppedMidExec: an edge stopped (SIGSTOP) under a command keeps
// its connections open; once the apiserver's watcher finds it unroutable,
// the command's stream ends as the platform's fault edge_unreachable,
// through the Go SDK and the CLI (exit 202), rather than waiting for the
// caller's own deadline and passing for the caller's timeout.
func TestEdgeStoppedMidExec(t *testing.T) {
	onePassOnly(t)
	c := startRealCluster(t, 1)
	api := c.APIServers[0]
	cl := sdkClient(t, api.Addr, api.Token)
	sb, err := cl.Create(t.Context(), env, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The caller's deadline is far beyond the watcher's few missed polls.
	ctx, cancel := context.WithTimeout(t.Context(), 45*time.Second)
	defer cancel()
	sdkDone := make(chan error, 1)
	go func() {
		r, err := sb.Exec(ctx, dsec.Sh("sleep 60"), nil)
		if err == nil {
			err = fmt.Errorf("the command exited: %+v", r)
		}
		sdkDone <- err
	}()
	cmd := exec.CommandContext(ctx, filepath.Join(c.Bin, "dsec"), "--addr", api.Addr, "exec", sb.ID, "sleep", "61")
	cmd.Env = append(os.Environ(), "DSEC_TOKEN="+api.Token)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitRunning(t, sb, "sleep 60")
	waitRunning(t, sb, "sleep 61")
	c.Edges[0].Stop()
	t.Cleanup(c.Edges[0].Cont) // before the cluster's own cleanup
	if err := <-sdkDone; dsec.InfraFault(err) != dsec.FaultEdgeUnreachable {
		t.Errorf("SDK exec on a stopped edge: %v: fault %q, want edge_unreachable", err, dsec.InfraFault(err))
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 202 || !strings.Contains(stderr.String(), "infrastructure fault (edge_unreachable)") {
		t.Errorf("dsec exec on a stopped edge: %v, stderr %q; want exit 202", err, stderr.String())
	}
}

// TestStartTimeout: a create whose sandbox does not run within its timeout
// (its edge stopped, SIGSTOP, while it is asked) fails typed start_timeout
// through the Go SDK; once the edge runs again, the cluster serves on.
func TestStartTimeout(t *testing.T) {
	onePassOnly(t)
	c := startRealCluster(t, 1)
	api := c.APIServers[0]
	cl := sdkClient(t, api.Addr, api.Token)
	c.Edges[0].Stop()
	t.Cleanup(c.Edges[0].Cont) // before the cluster's own cleanup
	_, err := cl.Create(t.Context(), env, &dsec.CreateOptions{Timeout: 2 * time.Second})
	if f := dsec.InfraFault(err); f != dsec.FaultStartTimeout || !errors.Is(err, dsec.ErrStartupTimeout) {
		t.Errorf("create on a stopped edge: %v: fault %q, want start_timeout", err, f)
	}
	c.Edges[0].Cont()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	sb, err := cl.Create(ctx, env, nil)
	if err != nil {
		t.Fatalf("create once the edge runs again: %v", err)
	}
	sb.Delete(ctx)
}

// TestPreemptedMidExec: a sandbox paused under a running command (a
// preemption) and stopped before it ran again (dsecd --paused-retention)
// ends the command as the platform's fault preempted, through the Go SDK
// and the CLI (exit 203), never as an exit of the command.
func TestPreemptedMidExec(t *testing.T) {
	d := startDaemon(t, "--paused-retention", "3s")
	cl := sdkClient(t, d.Addr, d.Token())
	ctx := t.Context()
	sb, err := cl.Create(ctx, env, &dsec.CreateOptions{NoAutoResume: true})
	if err != nil {
		t.Fatal(err)
	}
	sdkDone := make(chan error, 1)
	go func() {
		r, err := sb.Exec(ctx, dsec.Sh("sleep 60"), &dsec.ExecOptions{Timeout: 50 * time.Second})
		if err == nil {
			err = fmt.Errorf("the command exited: %+v", r)
		}
		sdkDone <- err
	}()
	cmd := exec.Command(filepath.Join(d.Bin, "dsec"), "--addr", d.Addr, "exec", sb.ID, "sleep", "61")
	cmd.Env = append(os.Environ(), "DSEC_TOKEN_FILE="+d.TokenFile())
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	waitRunning(t, sb, "sleep 60")
	waitRunning(t, sb, "sleep 61")
	if _, err := sb.Pause(ctx, false); err != nil {
		t.Fatal(err)
	}
	if err := <-sdkDone; dsec.InfraFault(err) != dsec.FaultPreempted {
		t.Errorf("SDK exec in a sandbox paused past the retention: %v: fault %q, want preempted", err, dsec.InfraFault(err))
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 203 || !strings.Contains(stderr.String(), "infrastructure fault (preempted)") {
		t.Errorf("dsec exec in a sandbox paused past the retention: %v, stderr %q; want exit 203", err, stderr.String())
	}
}

// TestNodeLost (both passes): a sandbox its node lost, for real. The node
// is killed (SIGKILL) while the sandbox's record says it was being made,
// as a node killed in the middle of a create leaves it, so the restarted
// node cannot re-adopt it: it tears the sandbox down and ends it
// node_lost. A command on it then fails typed node_lost (Go SDK; dsec exec
// exits 201), and a grade of it is the platform's fault, never a reward
// (Go SDK; dsec grade exits 201 with no reward on stdout).
func TestNodeLost(t *testing.T) {
	d := startDaemon(t)
	cl := sdkClient(t, d.Addr, d.Token())
	ctx := t.Context()
	sb, err := cl.Create(ctx, env, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := sb.Exec(ctx, dsec.Sh("mkdir -p /work && echo 42 > /work/answer"), nil); err != nil || r.ExitCode != 0 {
		t.Fatalf("setup: %v %+v", err, r)
	}
	d.Kill()
	markCreating(t, filepath.Join(d.Root, "sandboxes", sb.ID, "state.json"))
	d.Start()

	_, err = sb.Exec(ctx, dsec.Sh("true"), nil)
	if f := dsec.InfraFault(err); f != dsec.FaultNodeLost {
		t.Errorf("SDK exec in a sandbox its node lost: %v: fault %q, want node_lost", err, f)
	}
	out, errOut, code := d.CLI("", "exec", sb.ID, "true")
	if code != 201 || !strings.Contains(errOut, "infrastructure fault (node_lost)") {
		t.Errorf("dsec exec in a sandbox its node lost: exit %d, %s %s; want exit 201", code, out, errOut)
	}
	res, err := sb.Grade(ctx, dsec.GradeOptions{Paths: []string{"/work"}, Command: `test "$(cat /work/answer)" = 42`})
	if f := dsec.InfraFault(err); f != dsec.FaultNodeLost {
		t.Errorf("SDK grade of a sandbox its node lost: reward %v, %v: fault %q, want node_lost", res.GetReward(), err, f)
	}
	out, errOut, code = d.CLI("", "grade", sb.ID, "--path", "/work", "-c", `test "$(cat /work/answer)" = 42`)
	if code != 201 || out != "" || !strings.Contains(errOut, "infrastructure fault (node_lost)") {
		t.Errorf("dsec grade of a sandbox its node lost: exit %d, stdout %q, stderr %q; want exit 201 and no reward", code, out, errOut)
	}
}

// markCreating rewrites a sandbox's record (its node's state.json, the
// node stopped) to say the sandbox was still being made.
func markCreating(t *testing.T, file string) {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var rec map[string]any
	if err := dec.Decode(&rec); err != nil {
		t.Fatalf("read %s: %v", file, err)
	}
	if rec["state"] != "STATE_RUNNING" {
		t.Fatalf("%s says state %v, want STATE_RUNNING", file, rec["state"])
	}
	rec["state"] = "STATE_CREATING"
	if data, err = json.Marshal(rec); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, data, 0o600); err != nil {
		t.Fatal(err)
	}
}
