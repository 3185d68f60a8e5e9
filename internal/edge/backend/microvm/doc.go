// Package microvm is the microvm backend of the runtime seam (package
// backend): each sandbox a QEMU `microvm` guest with its own Linux kernel,
// dsec-agent as the guest's init (package agent/guest), reached over a
// virtio-serial port (package vm/channel).
//
// A Runtime turns a backend.Spec into one QEMU process (package vm/qemu):
//   - the layers' EROFS image files (backend.Layer.File) attached as
//     read-only virtio-blk disks, found in the guest by their serials
//     (layer0, layer1, … bottom first) and stacked with overlayfs;
//   - a writable ext4 disk (upper), a sparse file of the sandbox's disk
//     limit made with mkfs.ext4, holding at its root the agent's
//     configuration (package vm/guestcfg: user, workdir, host name,
//     address, environment, output limit) beside the overlay's upper/ and
//     work/;
//   - ceil(CPUs) vCPUs and MemoryBytes of guest memory;
//   - QEMU itself in a cgroup of its own (parent CgroupParent) holding the
//     guest's memory plus QEMU's overhead, a pids limit and the CPU quota
//     of Spec.CPUs.
//
// Start returns once the guest's agent answers: the boot watchdog
// (qemu.Process.WaitBoot) kills a guest that does not, and Start fails
// with the console's last lines. QEMU runs in a session of its own and
// outlives the edge; everything needed to find a VM again is in its run
// directory, so a new Runtime over the same StateDir lists, inspects,
// reaches and deletes the VMs an earlier one started.
//
// Host layout:
//
//	<StateDir>/initramfs/initrd-<digest>.cpio   the guest's initramfs, built by the first Start, once per agent and kernel
//	<StateDir>/vms/<id>/vm.json                 QEMU's pid and start time, the accelerator, the VM's size
//	<StateDir>/vms/<id>/upper.ext4              the writable disk
//	<StateDir>/vms/<id>/memory                  the guest's RAM, a sparse file (package vm/vmstate)
//	<StateDir>/vms/<id>/qemu.json               QEMU's config, which a resume runs again
//	<StateDir>/vms/<id>/vmstate{,.json}         a VM paused to disk: its device state and what vmstate knew
//	<StateDir>/vms/<id>/{qmp,agent,console}.sock, console.log, qemu.log
//	<StateDir>/vms/<id>/exit                    why QEMU ended, written by the instance that saw it
//	<StateDir>/vms/<id>/netns                   the edge's network namespace of a networked VM (its tap's)
//	<StateDir>/captures/<id>.<name>/            a capture: upper.ext4, the disk's clone, mounted at mnt/ by fuse2fs
//	<cgroup>/<CgroupParent>/<id>                QEMU's cgroup (memory, pids, cpu, cpuacct, freezer on v1)
//
// A sandbox with a network namespace (Spec.NetnsPath) gets a virtio-net
// card on a tap in that namespace (package vmnet), wired to the edge's
// veth, so the edge's policy, resolver and audit apply as to a container;
// <StateDir>/vms/<id>/netns names the namespace for Delete, which removes
// the tap. Spec.ResolvConf is not used: the guest writes its own
// resolv.conf naming vmnet.DNSAddr, which the namespace hands to the
// edge's resolver.
//
// Pause (pause_linux.go) freezes a VM with QMP, or saves it to disk and
// ends its QEMU (package vm/vmstate), its RAM dropped from the host's
// memory; Resume runs it again in a new QEMU.
//
// Capture (capture_linux.go) clones a frozen VM's writable disk and mounts
// the clone on the host through fuse2fs (package vm/fuse2fs: no host kernel
// file system parses what the guest wrote), whose upper/ package snapshot
// packs into a layer; Freeze has the guest sync first.
//
// Not yet: the sandbox's pids limit inside the guest.
package microvm
