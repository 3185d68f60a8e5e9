package root

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// qemuPids are the pids of the QEMU processes running microVM id.
func qemuPids(id string) []string {
	out, _ := exec.Command("pgrep", "-f", "qemu.*dsec-"+id).Output()
	return strings.Fields(string(out))
}

// vmLeft lists what of microVM id is still on the host: its QEMU, its run
// directory, its cgroups.
func vmLeft(d *testutil.Daemon, id string) []string {
	var left []string
	for _, pid := range qemuPids(id) {
		left = append(left, "qemu pid "+pid)
	}
	if _, err := os.Stat(filepath.Join(d.Root, "microvm", "vms", id)); !os.IsNotExist(err) {
		left = append(left, "run dir "+filepath.Join(d.Root, "microvm", "vms", id))
	}
	for _, ctrl := range []string{"memory", "pids", "cpu", "freezer", "unified"} {
		dir := filepath.Join("/sys/fs/cgroup", ctrl, d.HostNames().CgroupParent+"-microvm", id)
		if _, err := os.Stat(dir); err == nil {
			left = append(left, "cgroup "+dir)
		}
	}
	return left
}

// waitFailed waits for sandbox id to fail and returns its record.
func waitFailed(t *testing.T, d *testutil.Daemon, id string) *dsecv1.Sandbox {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		sb := state(t, d, id)
		if sb.GetState() == dsecv1.State_STATE_FAILED {
			return sb
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not fail: %v", id, sb)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// waitGone waits for nothing of microVM id to be left on the host.
func waitGone(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		left := vmLeft(d, id)
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("microVM %s left %v", id, left)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestMicroVMFaults: microVMs on one dsecd, beside gVisor sandboxes and a
// container, at most two VMs at once, four boots in all:
//   - VM a floods its console (the log stays capped), fills its disk
//     (ENOSPC inside, then it writes again once it removed the file), runs
//     what a container refuses (a tmpfs mount, a network namespace, a
//     module loaded), and keeps its agent from root in the guest as a
//     container does; the agent's socket of a VM is seen by no sandbox;
//   - a dsecd killed -9 and started again re-adopts a running microVM, a
//     microVM paused to disk, a running and a paused gVisor sandbox: all
//     answer, the paused ones resume with their state;
//   - VM c's QEMU killed -9, VM b's guest kernel made to panic: each
//     sandbox fails with the reason and the console's last lines in its
//     record (dsec inspect), leaves no QEMU, run directory or cgroup, while
//     VM a still answers.
func TestMicroVMFaults(t *testing.T) {
	allInOneOnly(t)
	runsc := testutil.Runsc(t)
	kernelDir := testutil.VMKernelDir(t)
	d := startDaemon(t, "--runsc", runsc, "--vm-kernel-dir", kernelDir)
	ctx := context.Background()
	vmSpec := func() *dsecv1.SandboxSpec {
		return &dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_MICROVM, MemoryMb: 192, DiskMb: 64}
	}
	ctr := create(t, d, nil)
	a := create(t, d, vmSpec()).GetId()
	g1 := create(t, d, &dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_GVISOR}).GetId()
	g2 := create(t, d, &dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_GVISOR}).GetId()
	alive := func(t *testing.T) {
		t.Helper()
		for _, id := range []string{a, ctr.GetId()} {
			if out := mustSh(t, d, id, "echo alive"); out != "alive\n" {
				t.Errorf("%s: %q", id, out)
			}
		}
	}

	t.Run("console flood stays capped", func(t *testing.T) {
		// Root writes to the serial console as fast as the guest can.
		sh(t, d, a, "timeout 8 sh -c 'while :; do echo floodfloodfloodfloodfloodfloodfloodfloodfloodflood; done > /dev/ttyS0'")
		var total int64
		for _, name := range []string{"console.log", "console.log.1"} {
			if fi, err := os.Stat(filepath.Join(d.Root, "microvm", "vms", a, name)); err == nil {
				total += fi.Size()
			}
		}
		logged, _ := os.ReadFile(filepath.Join(d.Root, "microvm", "vms", a, "console.log"))
		t.Logf("console logs: %d bytes", total)
		if !strings.Contains(string(logged), "floodflood") {
			t.Errorf("the flood is not in the console log")
		}
		if total > 1<<20 {
			t.Errorf("console logs hold %d bytes, want at most the 1 MiB cap", total)
		}
		alive(t)
	})
	t.Run("disk full", func(t *testing.T) {
		r := sh(t, d, a, "dd if=/dev/zero of=/big bs=1M count=100")
		if r.exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK || !strings.Contains(r.stderr, "No space left") {
			t.Fatalf("100 MiB into a 64 MiB disk: %s, want ENOSPC", r)
		}
		mustSh(t, d, a, "rm /big && echo again > /after && sync")
		alive(t)
	})
	t.Run("what a container refuses", func(t *testing.T) {
		// virtio_balloon, among the kernel directory's modules: unloaded
		// and loaded again from a file the sandbox was given.
		ko, err := os.ReadFile(filepath.Join(kernelDir, "modules", "virtio_balloon.ko"))
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range []string{a, ctr.GetId()} {
			if _, err := d.Clients.Sandboxes.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: id, Path: "/tmp/virtio_balloon.ko", Data: ko})); err != nil {
				t.Fatal(err)
			}
		}
		for _, c := range []struct{ name, cmd, want string }{
			{"tmpfs", "mkdir -p /mnt/t && mount -t tmpfs none /mnt/t && grep -c ' /mnt/t tmpfs' /proc/mounts", "1\n"},
			{"network namespace", "unshare -n sh -c 'ip link set lo up && ip -o link | wc -l'", "1\n"},
			{"module", "rmmod virtio_balloon; insmod /tmp/virtio_balloon.ko && grep -c '^virtio_balloon ' /proc/modules", "1\n"},
		} {
			if got := sh(t, d, a, c.cmd); got.stdout != c.want || got.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
				t.Errorf("%s in the microVM: %s, want %q", c.name, got, c.want)
			}
			if got := sh(t, d, ctr.GetId(), c.cmd); got.exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK {
				t.Errorf("%s in a container: %s, want it refused", c.name, got)
			}
		}
	})
	t.Run("agent protected", func(t *testing.T) {
		// The VM's agent socket is a host file no sandbox mounts: no
		// sandbox of any isolation sees it.
		sock := filepath.Join(d.Root, "microvm", "vms", a, "agent.sock")
		if _, err := os.Stat(sock); err != nil {
			t.Fatalf("the VM's agent socket: %v", err)
		}
		for _, id := range []string{ctr.GetId(), g1, a} {
			if r := sh(t, d, id, "ls "+sock+" || ls "+filepath.Dir(sock)); r.exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK {
				t.Errorf("%s sees the VM's agent socket: %s", id, r)
			}
		}
		checkAgentProtected(t, d, a)
	})

	c := create(t, d, vmSpec()).GetId()
	t.Run("restart re-adopts", func(t *testing.T) {
		for _, id := range []string{a, g2} {
			mustSh(t, d, id, "echo kept > /dev/shm/state")
			background(t, d, id, "while :; do date +%s >> /tmp/ticks; sleep 0.2; done")
		}
		pause(t, d, a, false)
		pause(t, d, g2, false)
		if pids := qemuPids(a); len(pids) != 0 {
			t.Errorf("QEMU of %s paused to disk still runs: %v", a, pids)
		}
		d.Kill()
		d.Start()
		for _, id := range []string{c, g1} {
			if out := mustSh(t, d, id, "echo back"); out != "back\n" {
				t.Errorf("%s after the restart: %q", id, out)
			}
		}
		for _, id := range []string{a, g2} {
			if st := state(t, d, id).GetState(); st != dsecv1.State_STATE_PAUSED {
				t.Errorf("%s after the restart: %s, want paused", id, st)
			}
			resume(t, d, id)
			if out := mustSh(t, d, id, "cat /dev/shm/state"); out != "kept\n" {
				t.Errorf("%s resumed: /dev/shm/state %q", id, out)
			}
			n1 := mustSh(t, d, id, "wc -l < /tmp/ticks")
			time.Sleep(time.Second)
			if n2 := mustSh(t, d, id, "wc -l < /tmp/ticks"); n1 == n2 {
				t.Errorf("%s resumed: its background process stopped (%s ticks)", id, n1)
			}
		}
	})
	t.Run("qemu killed", func(t *testing.T) {
		pids := qemuPids(c)
		if len(pids) != 1 {
			t.Fatalf("QEMU of %s: pids %v", c, pids)
		}
		pid, _ := strconv.Atoi(pids[0])
		if err := exec.Command("kill", "-9", strconv.Itoa(pid)).Run(); err != nil {
			t.Fatal(err)
		}
		sb := waitFailed(t, d, c)
		t.Logf("%s: %s: %s", c, sb.GetReason(), sb.GetMessage())
		// A re-adopted VM's QEMU (not this dsecd's child) is known gone,
		// not how; the console's last lines come with it.
		if msg := sb.GetMessage(); !strings.Contains(msg, "qemu") || !strings.Contains(msg, "gone") && !strings.Contains(msg, "SIGKILL") || !strings.Contains(msg, "console") {
			t.Errorf("%s failed saying %q, want QEMU gone and the console's last lines", c, msg)
		}
		waitGone(t, d, c)
		alive(t)
	})
	t.Run("guest kernel panic", func(t *testing.T) {
		b := create(t, d, vmSpec()).GetId()
		// The exec's stream ends with the guest: its error is expected.
		if st, err := d.Clients.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: b, Command: "echo c > /proc/sysrq-trigger"})); err == nil {
			for st.Receive() {
			}
			st.Close()
		}
		sb := waitFailed(t, d, b)
		t.Logf("%s: %s: %s", b, sb.GetReason(), sb.GetMessage())
		out, _, _ := d.CLI("", "inspect", b)
		for _, want := range []string{"panic", "sysrq"} {
			if !strings.Contains(out, want) {
				t.Errorf("dsec inspect %s does not say %q:\n%s", b, want, out)
			}
		}
		waitGone(t, d, b)
		alive(t)
	})
}
