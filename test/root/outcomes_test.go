package root

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// TestOutcomes causes each platform fault a single node can have against
// real sandboxes and checks what the Go SDK, the CLI and the Python SDK say:
// a sandbox deleted under a command, its TTL running out under one, a
// create refused on a full node, a create that times out, and an OOM kill
// by the node's memory (the cgroup of all sandboxes) against one at the
// sandbox's own limit. test/cluster's TestEdgeLostMidExec kills an edge.
func TestOutcomes(t *testing.T) {
	d := startDaemon(t, "--max-sandboxes", "3")
	c := sdkClient(t, d.Addr, d.Token())
	ctx := t.Context()
	newSandbox := func(o *dsec.CreateOptions) *dsec.Sandbox {
		t.Helper()
		sb, err := c.Create(ctx, env, o)
		// Through a cluster, the apiserver learns that deletes freed the
		// node's room with the edge's next report: a create just after
		// the full-node case may be refused until then.
		for deadline := time.Now().Add(20 * time.Second); dsec.InfraFault(err) == dsec.FaultAdmissionRefused && time.Now().Before(deadline); {
			time.Sleep(250 * time.Millisecond)
			sb, err = c.Create(ctx, env, o)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sb.Delete(context.WithoutCancel(ctx)) })
		return sb
	}
	// wantFault runs a long command in sb through the SDK while cut runs,
	// and checks the call ended with fault.
	wantFault := func(sb *dsec.Sandbox, want dsec.Fault, cut func()) {
		t.Helper()
		done := make(chan error, 1)
		go func() {
			r, err := sb.Exec(ctx, dsec.Sh("sleep 60"), &dsec.ExecOptions{Timeout: 50 * time.Second})
			if err == nil {
				err = fmt.Errorf("the command exited: %+v", r)
			}
			done <- err
		}()
		waitRunning(t, sb, "sleep 60")
		cut()
		err := <-done
		if got := dsec.InfraFault(err); got != want {
			t.Fatalf("exec: %v: fault %q, want %q", err, got, want)
		}
	}

	t.Run("sandbox deleted mid-exec", func(t *testing.T) {
		sb := newSandbox(nil)
		wantFault(sb, dsec.FaultSandboxDeleted, func() {
			if err := sb.Delete(ctx); err != nil {
				t.Fatal(err)
			}
		})
		// The CLI: a command in a sandbox deleted under it exits 208.
		sb = newSandbox(nil)
		cmd := exec.Command(filepath.Join(d.Bin, "dsec"), "--addr", d.Addr, "exec", sb.ID, "sleep", "60")
		cmd.Env = append(os.Environ(), "DSEC_TOKEN_FILE="+d.TokenFile())
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		waitRunning(t, sb, "sleep 60")
		if err := sb.Delete(ctx); err != nil {
			t.Fatal(err)
		}
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 208 || !strings.Contains(stderr.String(), "infrastructure fault (sandbox_deleted)") {
			t.Fatalf("dsec exec in a sandbox deleted under it: %v, stderr %q; want exit 208", err, stderr.String())
		}
	})

	t.Run("sandbox TTL mid-exec", func(t *testing.T) {
		sb := newSandbox(&dsec.CreateOptions{TTL: 3 * time.Second})
		wantFault(sb, dsec.FaultSandboxTTL, func() {})
		sb = newSandbox(&dsec.CreateOptions{TTL: 3 * time.Second})
		if _, errOut, code := d.CLI("", "exec", sb.ID, "sleep", "60"); code != 207 || !strings.Contains(errOut, "sandbox_ttl") {
			t.Fatalf("dsec exec past the TTL: exit %d, stderr %q; want 207", code, errOut)
		}
	})

	t.Run("admission refused on a full node", func(t *testing.T) {
		var held []*dsec.Sandbox
		t.Cleanup(func() {
			for _, sb := range held {
				sb.Delete(context.WithoutCancel(ctx))
			}
		})
		// The node full of this subtest's own sandboxes, whatever the
		// subtests before left being deleted: a create refused while one
		// still holds its place (or, through a cluster, while the
		// apiserver has not heard of its end) is tried again, and once
		// these 3 run the node is full for certain.
		for deadline := time.Now().Add(30 * time.Second); len(held) < 3; {
			sb, err := c.Create(ctx, env, nil)
			if err == nil {
				held = append(held, sb)
				continue
			}
			if dsec.InfraFault(err) != dsec.FaultAdmissionRefused || time.Now().After(deadline) {
				t.Fatalf("create %d of the node's 3: %v", len(held)+1, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
		_, err := c.Create(ctx, env, nil)
		if got := dsec.InfraFault(err); got != dsec.FaultAdmissionRefused {
			t.Fatalf("create on a full node: %v: fault %q, want admission_refused", err, got)
		}
		if _, errOut, code := d.CLI("", "create", env); code != 204 || !strings.Contains(errOut, "admission_refused") {
			t.Fatalf("dsec create on a full node: exit %d, stderr %q; want 204", code, errOut)
		}
	})

	t.Run("OOM of the task and of the node", func(t *testing.T) {
		sb := newSandbox(&dsec.CreateOptions{MemoryMB: 64})
		r, err := sb.Exec(ctx, dsec.Sh("head -c 300m /dev/zero | tail"), &dsec.ExecOptions{Timeout: 30 * time.Second})
		if err != nil || r.Status != dsec.StatusOOM || r.InfraFault != dsec.FaultNone {
			t.Fatalf("the task's OOM: %+v %v; want oom, no fault", r, err)
		}
		// The node's: every sandbox's cgroup limited below what one
		// sandbox may use. The OOM killer acts in the parent; the sandbox
		// never reaches its own limit.
		sb = newSandbox(&dsec.CreateOptions{MemoryMB: 1024})
		parent, usage, limit, none := filepath.Join("/sys/fs/cgroup", d.HostNames().CgroupParent), "memory.current", "memory.max", "max"
		if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err != nil { // v1
			parent, usage, limit, none = filepath.Join("/sys/fs/cgroup/memory", d.HostNames().CgroupParent), "memory.usage_in_bytes", "memory.limit_in_bytes", "-1"
		}
		cur, err := os.ReadFile(filepath.Join(parent, usage))
		if err != nil {
			t.Fatal(err)
		}
		var used int64
		fmt.Sscan(strings.TrimSpace(string(cur)), &used)
		if err := os.WriteFile(filepath.Join(parent, limit), []byte(fmt.Sprint(used+128<<20)), 0); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.WriteFile(filepath.Join(parent, limit), []byte(none), 0) })
		r, err = sb.Exec(ctx, dsec.Sh("head -c 400m /dev/zero | tail"), &dsec.ExecOptions{Timeout: 30 * time.Second})
		if err != nil || r.Status != dsec.StatusOOM || r.InfraFault != dsec.FaultNodeMemoryPressure {
			t.Fatalf("the node's OOM: %+v %v; want oom, fault node_memory_pressure", r, err)
		}
		if err := os.WriteFile(filepath.Join(parent, limit), []byte(none), 0); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("python", func(t *testing.T) {
		python := testutil.RequireCommand(t, "python3")
		cmd := exec.Command(python, "-c", pythonOutcomes, d.Addr, env)
		cmd.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join(testutil.RepoRoot(), "sdk", "python"), "DSEC_TOKEN_FILE="+d.TokenFile())
		out, err := cmd.CombinedOutput()
		if err != nil || strings.TrimSpace(string(out)) != "ok" {
			t.Fatalf("python: %v\n%s", err, out)
		}
	})
}

// pythonOutcomes: a TTL under a command is result.infra_fault
// "sandbox_ttl" on the error; the task's own OOM is a result without one.
const pythonOutcomes = `
import sys, libdsec
with libdsec.Client(sys.argv[1]) as c:
    with c.create(sys.argv[2], memory_mb=64, ttl_s=3) as sb:
        r = sb.exec("head -c 300m /dev/zero | tail", timeout=30)
        assert r.status == "oom" and r.infra_fault is None, r
        try:
            sb.exec("sleep 60", timeout=50)
            raise SystemExit("the command outlived its sandbox's TTL")
        except libdsec.DsecError as e:
            assert e.infra_fault == "sandbox_ttl", (e, e.infra_fault)
print("ok")
`

// waitRunning waits until a process running argv shows in sb.
func waitRunning(t *testing.T, sb *dsec.Sandbox, argv string) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		r, err := sb.Exec(t.Context(), dsec.Sh("ps -o args | grep -v grep | grep -q '^"+argv+"'"), nil)
		if err == nil && r.Status == dsec.StatusOK {
			return
		}
	}
	t.Fatalf("%q never ran in %s", argv, sb.ID)
}

// TestEdgeLostMidExec: an edge killed (SIGKILL) under a command in one of
// its sandboxes ends the command's stream as the platform's fault
// edge_unreachable, through the Go SDK and the CLI (exit 202), never as an
// exit of the command.
func TestEdgeLostMidExec(t *testing.T) {
	onePassOnly(t)
	c := startRealCluster(t, 1)
	api := c.APIServers[0]
	cl := sdkClient(t, api.Addr, api.Token)
	ctx := t.Context()
	sb, err := cl.Create(ctx, env, nil)
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
	cmd := exec.Command(filepath.Join(c.Bin, "dsec"), "--addr", api.Addr, "exec", sb.ID, "sleep", "61")
	cmd.Env = append(os.Environ(), "DSEC_TOKEN="+api.Token)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitRunning(t, sb, "sleep 60")
	waitRunning(t, sb, "sleep 61")
	c.Edges[0].Kill()
	if err := <-sdkDone; dsec.InfraFault(err) != dsec.FaultEdgeUnreachable {
		t.Errorf("SDK exec on a killed edge: %v: fault %q, want edge_unreachable", err, dsec.InfraFault(err))
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 202 || !strings.Contains(stderr.String(), "infrastructure fault (edge_unreachable)") {
		t.Errorf("dsec exec on a killed edge: %v, stderr %q; want exit 202", err, stderr.String())
	}
}
