package qemu

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// TestMain lets the test binary stand in for QEMU (fakeQEMUMode), so the
// process handling and the boot watchdog are tested without a guest.
func TestMain(m *testing.M) {
	if mode := os.Getenv(fakeQEMUEnv); mode != "" {
		os.Exit(fakeQEMU(mode))
	}
	os.Exit(m.Run())
}

func TestArgs(t *testing.T) {
	for _, tc := range []struct {
		accel   Accel
		cpu     string
		cmdline string
	}{
		{TCG, "max,-erms,-fsrm", "console=ttyS0 quiet reboot=t panic=-1 cryptomgr.notests tsc_early_khz=2596142 -- --log-level debug"},
		{KVM, "host", "console=ttyS0 quiet reboot=t panic=-1 cryptomgr.notests -- --log-level debug"},
	} {
		t.Run(string(tc.accel), func(t *testing.T) {
			c := Config{Dir: "/run/vm/sb-1", Kernel: "/k/vmlinux", Initrd: "/k/initrd", Accel: tc.accel,
				TSCkHz: 2596142, Cmdline: "-- --log-level debug",
				Drives: []Drive{{Path: "/l/base.erofs", Serial: "dsec-layer0", ReadOnly: true}, {Path: "/u/upper.ext4", Serial: "dsec-upper"}},
				NIC:    &NIC{Tap: os.Stdin, MAC: net.HardwareAddr{0x02, 0, 0, 0, 0, 0x2a}}}
			if err := c.fill(); err != nil {
				t.Fatal(err)
			}
			args := c.Args()
			after := func(flag string) []string {
				var vs []string
				for i := 0; i+1 < len(args); i++ {
					if args[i] == flag {
						vs = append(vs, args[i+1])
					}
				}
				return vs
			}
			want := map[string][]string{
				"-M": {"microvm"}, "-accel": {string(tc.accel)}, "-cpu": {tc.cpu}, "-m": {"256"}, "-smp": {"1"},
				"-kernel": {"/k/vmlinux"}, "-initrd": {"/k/initrd"}, "-append": {tc.cmdline},
				"-serial": {"chardev:console"}, "-mon": {"chardev=qmp,mode=control"},
				"-chardev": {"socket,id=console,fd=5,server=on,wait=on", "socket,id=qmp,fd=3,server=on,wait=off",
					"socket,id=agent,fd=4,server=on,wait=off"},
				"-device": {"virtio-serial-device", "virtserialport,chardev=agent,name=dsec.0,id=agent-port",
					"virtio-blk-device,drive=disk0,serial=dsec-layer0", "virtio-blk-device,drive=disk1,serial=dsec-upper",
					"virtio-net-device,netdev=net0,mac=02:00:00:00:00:2a"},
				"-netdev": {"tap,id=net0,fd=6"},
				"-drive":  {"file=/l/base.erofs,format=raw,if=none,id=disk0,readonly=on", "file=/u/upper.ext4,format=raw,if=none,id=disk1"},
			}
			for flag, vs := range want {
				if got := after(flag); !slices.Equal(got, vs) {
					t.Errorf("%s: got %q, want %q", flag, got, vs)
				}
			}
			for _, flag := range []string{"-nodefaults", "-no-user-config", "-no-reboot"} {
				if !slices.Contains(args, flag) {
					t.Errorf("no %s in %q", flag, args)
				}
			}
		})
	}
}

// A VM whose RAM is a file, started to receive a saved state.
func TestArgsMemoryFileIncoming(t *testing.T) {
	c := Config{Dir: "/run/vm/sb-1", Kernel: "/k/vmlinux", Initrd: "/k/initrd", Accel: KVM, MemoryMiB: 512,
		MemoryFile: "/state/sb-1/memory", Incoming: true}
	if err := c.fill(); err != nil {
		t.Fatal(err)
	}
	args := strings.Join(c.Args(), " ")
	for _, want := range []string{
		"-object memory-backend-file,id=mem,share=on,mem-path=/state/sb-1/memory,size=512M -machine memory-backend=mem",
		"-incoming defer",
		"-m 512",
	} {
		if !strings.Contains(args, want) {
			t.Errorf("no %q in %q", want, args)
		}
	}
	c.Incoming, c.MemoryFile = false, ""
	if args := strings.Join(c.Args(), " "); strings.Contains(args, "-incoming") || strings.Contains(args, "memory-backend") {
		t.Errorf("a plain VM's args name a memory backend or an incoming state: %q", args)
	}
}

// TestArgsPmem: pmem drives make a q35 machine with PCI devices, each
// pmem drive a shared, read-only mapping of its file in its own slot,
// and room for them beside the RAM.
func TestArgsPmem(t *testing.T) {
	dir := t.TempDir()
	layer := filepath.Join(dir, "base.erofs")
	if err := os.WriteFile(layer, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(layer, 4<<20); err != nil {
		t.Fatal(err)
	}
	c := Config{Dir: "/run/vm/sb-1", Kernel: "/k/vmlinux", Initrd: "/k/initrd", Accel: TCG, TSCkHz: 2596142,
		FreePageReporting: true,
		Drives: []Drive{
			{Path: layer, Serial: "layer0", ReadOnly: true, Pmem: true},
			{Path: "/l/top.erofs", Serial: "layer1", ReadOnly: true},
			{Path: layer, Serial: "layer2", ReadOnly: true, Pmem: true},
			{Path: "/u/upper.ext4", Serial: "upper"},
		}}
	if err := c.fill(); err != nil {
		t.Fatal(err)
	}
	if c.Machine != Q35 {
		t.Errorf("machine %q, want q35 for pmem drives", c.Machine)
	}
	args := c.Args()
	after := func(flag string) []string {
		var vs []string
		for i := 0; i+1 < len(args); i++ {
			if args[i] == flag {
				vs = append(vs, args[i+1])
			}
		}
		return vs
	}
	want := map[string][]string{
		"-M": {"q35,sata=off,smbus=off,usb=off,vmport=off,i8042=off,hpet=off"},
		"-m": {"256,maxmem=264M"},
		"-object": {
			"memory-backend-file,id=pmem0,mem-path=" + layer + ",size=4194304,share=on,readonly=on,align=2097152",
			"memory-backend-file,id=pmem2,mem-path=" + layer + ",size=4194304,share=on,readonly=on,align=2097152",
		},
		"-device": {"virtio-serial-pci", "virtserialport,chardev=agent,name=dsec.0,id=agent-port",
			"virtio-pmem-pci,memdev=pmem0,id=disk0,addr=0x10.0",
			"virtio-blk-pci,drive=disk1,serial=layer1",
			"virtio-pmem-pci,memdev=pmem2,id=disk2,addr=0x11.0",
			"virtio-blk-pci,drive=disk3,serial=upper",
			"virtio-balloon-pci,free-page-reporting=on"},
		"-drive": {"file=/l/top.erofs,format=raw,if=none,id=disk1,readonly=on", "file=/u/upper.ext4,format=raw,if=none,id=disk3"},
	}
	for flag, vs := range want {
		if got := after(flag); !slices.Equal(got, vs) {
			t.Errorf("%s: got %q, want %q", flag, got, vs)
		}
	}
	if !strings.Contains(c.KernelCmdline(), " swiotlb=noforce") {
		t.Errorf("kernel command line %q: no swiotlb=noforce", c.KernelCmdline())
	}
	var refs []string
	for i := range c.Drives {
		refs = append(refs, c.GuestRef(i))
	}
	if want := []string{"pmem@0000:00:10.0", "layer1", "pmem@0000:00:11.0", "upper"}; !slices.Equal(refs, want) {
		t.Errorf("guest refs %q, want %q", refs, want)
	}

	// Free page reporting on microvm: the balloon on virtio-mmio.
	m := Config{Dir: "d", Kernel: "k", Initrd: "i", Accel: TCG, TSCkHz: 1000, FreePageReporting: true}
	if err := m.fill(); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(m.Args(), "virtio-balloon-device,free-page-reporting=on") || m.Machine != Microvm {
		t.Errorf("microvm with free page reporting: %q", m.Args())
	}
}

func TestConfigRefuses(t *testing.T) {
	good := Config{Dir: "d", Kernel: "k", Initrd: "i", Accel: TCG, TSCkHz: 1000}
	for name, change := range map[string]func(*Config){
		"no dir":          func(c *Config) { c.Dir = "" },
		"no kernel":       func(c *Config) { c.Kernel = "" },
		"tiny memory":     func(c *Config) { c.MemoryMiB = 16 },
		"unknown accel":   func(c *Config) { c.Accel = "hvf" },
		"newline":         func(c *Config) { c.Cmdline = "a\nb" },
		"tcg without tsc": func(c *Config) { c.TSCkHz = -1 },
		"drive no serial": func(c *Config) { c.Drives = []Drive{{Path: "a"}} },
		"drive comma":     func(c *Config) { c.Drives = []Drive{{Path: "a,b", Serial: "x"}} },
		"long serial":     func(c *Config) { c.Drives = []Drive{{Path: "a", Serial: "abcdefghijklmnopqrstu"}} },
		"nic no tap":      func(c *Config) { c.NIC = &NIC{MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}} },
		"nic no mac":      func(c *Config) { c.NIC = &NIC{Tap: os.Stdin} },
		"memory comma":    func(c *Config) { c.MemoryFile = "a,b" },
		"incoming no ram": func(c *Config) { c.Incoming = true },
	} {
		t.Run(name, func(t *testing.T) {
			c := good
			change(&c)
			if err := c.fill(); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("fill of %+v: %v, want InvalidArgument", c, err)
			}
		})
	}
	c := good
	if err := c.fill(); err != nil {
		t.Errorf("fill refused a good config: %v", err)
	}
}

// pmemFile is a file of size bytes in a test's temporary directory.
func pmemFile(t *testing.T, size int64) string {
	f := filepath.Join(t.TempDir(), "layer.erofs")
	if err := os.WriteFile(f, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(f, size); err != nil {
		t.Fatal(err)
	}
	return f
}

func TestHostTSCkHz(t *testing.T) {
	khz, err := HostTSCkHz()
	if err != nil {
		t.Skipf("no TSC frequency here: %v", err)
	}
	// A TSC runs between 100 MHz and 10 GHz on anything QEMU emulates.
	if khz < 100_000 || khz > 10_000_000 {
		t.Errorf("HostTSCkHz = %d", khz)
	}
}

func TestConsoleLogCapped(t *testing.T) {
	path := filepath.Join(t.TempDir(), "console.log")
	const limit = 16 << 10
	l, err := openConsoleLog(path, limit)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2000 {
		fmt.Fprintf(l, "line %04d of a guest that floods its console\r\n", i)
	}
	l.Close()
	var total int64
	for _, p := range []string{path, path + ".1"} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		total += fi.Size()
	}
	if total > limit {
		t.Errorf("the console log holds %d bytes, over its limit of %d", total, limit)
	}
	want := "line 1997 of a guest that floods its console\nline 1998 of a guest that floods its console\nline 1999 of a guest that floods its console"
	if got := l.Tail(3); got != want {
		t.Errorf("Tail(3) = %q, want %q", got, want)
	}
}

// fakeQEMUEnv makes the test binary a fake QEMU: it takes the listening
// sockets as QEMU does, prints boot lines on the console, then, by mode,
// hangs ("hang"), exits with status 3 ("exit"), or also answers "ready" to
// each connection on the agent's socket ("ready").
const fakeQEMUEnv = "DSEC_TEST_FAKE_QEMU"

func fakeQEMU(mode string) int {
	listener := func(fd int) net.Listener {
		ln, err := net.FileListener(os.NewFile(uintptr(fd), "socket"))
		if err != nil {
			fmt.Fprintln(os.Stderr, "fake qemu:", err)
			os.Exit(2)
		}
		return ln
	}
	console, err := listener(consoleFD).Accept()
	if err != nil {
		return 2
	}
	for i := range 30 {
		fmt.Fprintf(console, "[    0.%03d] fake boot line %d\r\n", i, i)
	}
	switch mode {
	case "exit":
		fmt.Fprintf(console, "Kernel panic - not syncing: fake\r\n")
		return 3
	case "ready":
		ln := listener(channelFD)
		for {
			c, err := ln.Accept()
			if err != nil {
				return 2
			}
			c.Write([]byte("ready"))
			c.Close()
		}
	default:
		select {}
	}
}

// startFake starts the fake QEMU in mode.
func startFake(t *testing.T, mode string) *Process {
	t.Helper()
	t.Setenv(fakeQEMUEnv, mode)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	p, err := Start(context.Background(), Config{Binary: exe, Dir: dir, Kernel: "k", Initrd: "i", Accel: TCG, TSCkHz: 1000, ConsoleLimit: 1 << 20}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Kill()
		<-p.Done()
	})
	return p
}

// probe is a readiness check that reads "ready" from the agent's socket.
func probe(p *Process) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", p.ChannelPath())
		if err != nil {
			return err
		}
		defer c.Close()
		if dl, ok := ctx.Deadline(); ok {
			c.SetDeadline(dl)
		}
		b := make([]byte, 5)
		if _, err := c.Read(b); err != nil {
			return err
		}
		if string(b) != "ready" {
			return fmt.Errorf("read %q", b)
		}
		return nil
	}
}

func TestWaitBoot(t *testing.T) {
	t.Run("ready", func(t *testing.T) {
		p := startFake(t, "ready")
		if err := p.WaitBoot(context.Background(), time.Minute, probe(p)); err != nil {
			t.Fatal(err)
		}
		select {
		case <-p.Done():
			t.Fatal("WaitBoot ended a guest that booted")
		default:
		}
	})
	t.Run("hung", func(t *testing.T) {
		p := startFake(t, "hang")
		err := p.WaitBoot(context.Background(), 300*time.Millisecond, probe(p))
		if !errors.Is(err, errdefs.ErrDeadlineExceeded) {
			t.Fatalf("WaitBoot of a hung guest: %v, want DeadlineExceeded", err)
		}
		if !strings.Contains(err.Error(), "fake boot line 29") || strings.Contains(err.Error(), "fake boot line 9\n") {
			t.Errorf("the error does not end with the console's last lines: %v", err)
		}
		select {
		case <-p.Done():
		default:
			t.Error("QEMU still runs after its boot failed")
		}
	})
	t.Run("exited", func(t *testing.T) {
		p := startFake(t, "exit")
		err := p.WaitBoot(context.Background(), time.Minute, probe(p))
		if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "exit status 3") ||
			!strings.Contains(err.Error(), "the guest kernel panicked: Kernel panic - not syncing: fake") {
			t.Fatalf("WaitBoot of a guest that panicked: %v", err)
		}
		if got := p.ConsoleTail(1); got != "Kernel panic - not syncing: fake" {
			t.Errorf("ConsoleTail(1) = %q", got)
		}
	})
}

// TestStartCleansUpOnFailure: a QEMU that is not installed is named, and
// Start leaves no socket behind.
func TestStartCleansUpOnFailure(t *testing.T) {
	dir := t.TempDir()
	_, err := Start(context.Background(), Config{Binary: "no-such-qemu-system", Dir: dir, Kernel: "k", Initrd: "i", Accel: TCG, TSCkHz: 1000}, nil)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "qemu-system-x86") {
		t.Fatalf("Start without QEMU: %v", err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 0 {
		t.Errorf("Start left %v", entries)
	}
}

// TestExplain: a panic's message is found, and the lines quoted are those
// leading up to it rather than its trace.
func TestExplain(t *testing.T) {
	for _, tc := range []struct {
		name, console, panic, lines string
	}{
		{"no panic", "a\nb\nc", "", "b\nc"},
		{"panic", "init: bad flag\n[ 1.5] Kernel panic - not syncing: Attempted to kill init!\n trace 1\n trace 2", "Kernel panic - not syncing: Attempted to kill init!",
			"init: bad flag\n[ 1.5] Kernel panic - not syncing: Attempted to kill init!"},
		{"empty", "", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			panic, lines := Explain(tc.console, 2)
			if panic != tc.panic || lines != tc.lines {
				t.Errorf("Explain = %q, %q; want %q, %q", panic, lines, tc.panic, tc.lines)
			}
		})
	}
}
