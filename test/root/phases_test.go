package root

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// TestPhaseBudgets: a sandbox made with phase budgets has their sum plus
// 30 s as its TTL; the agent phase overruns its budget, its processes (a
// foreground command and a background one) die with its end while the
// sandbox lives on, and the verify phase's commands run; each command says
// the phase it ran in. Then the phases ended by request: through the Go
// SDK (setup, after which provenance counts only what the agent wrote,
// a file of setup's it rewrote with its mtime set back included),
// the CLI (agent) and the Python SDK. The overrun runs in a
// container and under gVisor (the phases are the edge's, the kill goes
// through the agent, whatever the backend).
func TestPhaseBudgets(t *testing.T) {
	d := startDaemon(t, "--runsc", testutil.Runsc(t))
	c := sdkClient(t, d.Addr, d.Token())
	ctx := t.Context()

	for _, iso := range []string{dsec.IsolationContainer, dsec.IsolationGVisor} {
		t.Run(iso+": the agent overruns its budget", func(t *testing.T) { overrun(t, c, iso) })
	}

	t.Run("phases ended by request", func(t *testing.T) {
		sb, err := c.Create(ctx, env, &dsec.CreateOptions{Phases: &dsec.PhaseBudgets{Setup: time.Minute, Agent: time.Minute, Verify: time.Minute}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sb.Delete(t.Context()) })
		// What the trainer writes in setup is the task's: provenance leaves
		// it out of what the agent wrote once setup ends.
		if r, err := sb.Exec(ctx, dsec.Sh("mkdir -p /opt/task && echo data > /opt/task/input && echo 1234 > /opt/task/check && touch -t 202001010000.00 /opt/task/check"), nil); err != nil || r.Phase != dsec.PhaseSetup || r.ExitCode != 0 {
			t.Fatalf("setup: %+v %v", r, err)
		}
		if err := sb.EndPhase(ctx, dsec.PhaseSetup); err != nil || sb.Phase() != dsec.PhaseAgent {
			t.Fatalf("end setup: %q %v", sb.Phase(), err)
		}
		// The agent rewrites setup's check to its size and sets its time
		// back: mode, size and mtime as the baseline has them, its inode
		// change time not (before, it passed as unchanged).
		if r, err := sb.Exec(ctx, dsec.Sh("echo mine > /opt/agent-out && echo 4321 > /opt/task/check && touch -t 202001010000.00 /opt/task/check"), nil); err != nil || r.ExitCode != 0 {
			t.Fatalf("agent: %+v %v", r, err)
		}
		prov, err := sb.Provenance(ctx, false)
		if err != nil {
			t.Fatal(err)
		}
		written := map[string]bool{}
		for _, f := range prov.GetFilesWritten() {
			written[f.GetPath()] = true
		}
		if !written["/opt/agent-out"] || !written["/opt/task/check"] || written["/opt/task/input"] || written["/opt/task"] {
			t.Errorf("files written after setup ended: %v; want the agent's /opt/agent-out and /opt/task/check (rewritten, its mtime set back), not setup's /opt/task/input", written)
		}
		if _, err := sb.Spawn(ctx, dsec.Sh("sleep 1000"), nil); err != nil {
			t.Fatal(err)
		}
		out, errOut, code := d.CLI("", "end-phase", sb.ID, "agent")
		if code != 0 || !strings.Contains(out, "verify phase") {
			t.Fatalf("dsec end-phase agent: %q %q %d", out, errOut, code)
		}
		r, err := sb.Exec(ctx, dsec.Sh("ps -o args | grep -c '^sleep' || true"), nil)
		if err != nil || r.Phase != dsec.PhaseVerify || strings.TrimSpace(string(r.Stdout)) != "0" {
			t.Fatalf("verify: %+v %v; want no sleep left, in the verify phase", r, err)
		}
		// Ending a phase that is over does nothing.
		if err := sb.EndPhase(ctx, dsec.PhaseAgent); err != nil || sb.Phase() != dsec.PhaseVerify {
			t.Fatalf("end agent again: %q %v", sb.Phase(), err)
		}
	})

	t.Run("python", func(t *testing.T) {
		python := testutil.RequireCommand(t, "python3")
		cmd := exec.Command(python, "-c", pythonPhases, d.Addr, env)
		cmd.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join(testutil.RepoRoot(), "sdk", "python"), "DSEC_TOKEN_FILE="+d.TokenFile())
		out, err := cmd.CombinedOutput()
		if err != nil || strings.TrimSpace(string(out)) != "ok" {
			t.Fatalf("python: %v\n%s", err, out)
		}
	})
}

// overrun: an agent phase of 3 s overruns with a foreground and a
// background command; both die at its end, the sandbox lives on, and the
// verify phase's command finds neither.
func overrun(t *testing.T, c *dsec.Client, iso string) {
	ctx := t.Context()
	sb, err := c.Create(ctx, env, &dsec.CreateOptions{Isolation: iso, Phases: &dsec.PhaseBudgets{Agent: 3 * time.Second, Verify: 30 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Delete(t.Context()) })
	if ttl := sb.Info().GetSpec().GetTtlSeconds(); ttl != 63 {
		t.Errorf("TTL %ds, want 63 (3 + 30 + 30)", ttl)
	}
	if sb.Phase() != dsec.PhaseAgent {
		t.Fatalf("phase %q, want agent (setup has no budget)", sb.Phase())
	}
	if _, err := sb.Spawn(ctx, dsec.Sh("sleep 1000"), &dsec.SpawnOptions{Tag: "left-behind"}); err != nil {
		t.Fatal(err)
	}
	r, err := sb.Exec(ctx, dsec.Sh("sleep 60"), &dsec.ExecOptions{Timeout: 50 * time.Second})
	if err != nil || r.Status != dsec.StatusKilled || r.Phase != dsec.PhaseAgent {
		t.Fatalf("a command past the agent phase's budget: %+v %v; want killed, in the agent phase", r, err)
	}
	r, err = sb.Exec(ctx, dsec.Sh("ps -o args | grep -c '^sleep' || true"), nil)
	if err != nil || r.Phase != dsec.PhaseVerify || strings.TrimSpace(string(r.Stdout)) != "0" {
		t.Fatalf("verify: %+v %v; want no sleep left, in the verify phase", r, err)
	}
	if err := sb.Refresh(ctx); err != nil || sb.Phase() != dsec.PhaseVerify || sb.State() != "running" {
		t.Fatalf("after the agent phase: %s %s %v", sb.State(), sb.Phase(), err)
	}
}

const pythonPhases = `
import sys, libdsec
with libdsec.Client(sys.argv[1]) as c:
    with c.create(sys.argv[2], phases={"agent": 60, "verify": 30}) as sb:
        assert sb.phase == "agent", sb.phase
        assert sb.exec("true").phase == "agent"
        sb.end_phase("agent")
        assert sb.phase == "verify", sb.phase
        assert sb.exec("true").phase == "verify"
print("ok")
`
