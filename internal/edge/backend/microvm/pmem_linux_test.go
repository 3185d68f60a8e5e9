package microvm_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/microvm"
	"dsec.dev/dsec/internal/vm/qemu"
)

// TestPmemLayers: a runtime with PmemLayers attaches the store-built layer
// as virtio-pmem on a q35 machine, with free page reporting; the guest
// mounts it with DAX and runs from it, and the VM pauses to disk and
// resumes with the layer attached again.
func TestPmemLayers(t *testing.T) {
	f := setup(t)
	root := t.TempDir()
	cfg := config(t, f, root)
	cfg.Channels = microvm.NewChannels(nil)
	cfg.PmemLayers = true
	rt := newRuntime(t, cfg)
	ctx := context.Background()
	s := spec(root, "sb-pmem", f)
	dial, err := rt.Start(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	client := agentclient.New(dial)
	defer client.Close()
	if out := execOut(t, client, "cat", "/etc/group"); !strings.HasPrefix(out, "root:x:0:") {
		t.Errorf("cat /etc/group from the pmem layer: %q", out)
	}
	var saved struct {
		QEMU qemu.Config `json:"qemu"`
	}
	b, err := os.ReadFile(filepath.Join(cfg.StateDir, "vms", s.ID, "qemu.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &saved); err != nil {
		t.Fatal(err)
	}
	if qc := saved.QEMU; qc.Machine != qemu.Q35 || len(qc.Drives) == 0 || !qc.Drives[0].Pmem || !qc.FreePageReporting {
		t.Errorf("QEMU config: machine %s, drives %+v, free page reporting %v; want q35, the layer pmem, reporting", qc.Machine, qc.Drives, qc.FreePageReporting)
	}
	console, err := os.ReadFile(s.LogPath)
	if err != nil || !strings.Contains(string(console), "dax=true") {
		t.Errorf("the console says no pmem layer was mounted with DAX (%v):\n%s", err, console)
	}

	p := rt.(backend.Pauser)
	if _, err := p.Pause(ctx, s.ID, true); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Resume(ctx, s.ID, false); err != nil {
		t.Fatal(err)
	}
	if out := execOut(t, client, "cat", "/etc/passwd"); !strings.HasPrefix(out, "root:x:0:0:") {
		t.Errorf("cat /etc/passwd after a resume: %q", out)
	}
	if err := rt.Delete(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, rt, cfg, s.ID)
}
