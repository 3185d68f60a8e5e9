package qemu

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// kvmGetAPIVersion is KVM_GET_API_VERSION, _IO(KVMIO, 0x00); every KVM
// answers kvmAPIVersion.
const (
	kvmGetAPIVersion = 0xAE00
	kvmAPIVersion    = 12
)

// DetectAccel returns KVM when /dev/kvm can run a stock guest kernel, else
// TCG, with the reason KVM was not taken.
//
// /dev/kvm answering KVM_GET_API_VERSION is not enough: some hosts have a
// /dev/kvm from kvm_pvm, which runs only PVM guest kernels, on CPUs without
// VMX or SVM. A stock kernel needs hardware virtualisation, which the CPU
// flags show.
func DetectAccel() (Accel, string) {
	if err := kvmUsable(); err != nil {
		return TCG, err.Error()
	}
	return KVM, ""
}

func kvmUsable() error {
	fd, err := unix.Open("/dev/kvm", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open /dev/kvm: %w", err)
	}
	defer unix.Close(fd)
	v, err := unix.IoctlRetInt(fd, kvmGetAPIVersion)
	if err != nil {
		return fmt.Errorf("/dev/kvm: KVM_GET_API_VERSION: %w", err)
	}
	if v != kvmAPIVersion {
		return fmt.Errorf("/dev/kvm: KVM API version %d, want %d", v, kvmAPIVersion)
	}
	flags, err := cpuFlags()
	if err != nil {
		return err
	}
	if !flags["vmx"] && !flags["svm"] {
		return fmt.Errorf("/dev/kvm answers but the CPU has no vmx or svm flag (kvm_pvm runs only PVM guest kernels)")
	}
	return nil
}

// cpuFlags is the first CPU's flags in /proc/cpuinfo.
func cpuFlags() (map[string]bool, error) {
	v, err := cpuinfoField("flags")
	if err != nil {
		return nil, err
	}
	flags := map[string]bool{}
	for _, f := range strings.Fields(v) {
		flags[f] = true
	}
	return flags, nil
}

// cpuinfoField is the value of the first CPU's field name in /proc/cpuinfo.
func cpuinfoField(name string) (string, error) {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return "", fmt.Errorf("read cpu info: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == name {
			return strings.TrimSpace(v), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read cpu info: %w", err)
	}
	return "", fmt.Errorf("read cpu info: no %q field", name)
}

// HostTSCkHz is the host's TSC frequency in kHz, which a TCG guest's TSC
// runs at (QEMU's TCG reads the host's TSC). It is sysfs's tsc_freq_khz
// where the kernel has one, else /proc/cpuinfo's "cpu MHz", which is the
// TSC's frequency on CPUs with a constant TSC and no frequency scaling
// (virtual machines, where these hosts run).
func HostTSCkHz() (int64, error) {
	if b, err := os.ReadFile("/sys/devices/system/cpu/cpu0/tsc_freq_khz"); err == nil {
		if khz, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && khz > 0 {
			return khz, nil
		}
	}
	v, err := cpuinfoField("cpu MHz")
	if err != nil {
		return 0, fmt.Errorf("find the host's TSC frequency: %w", err)
	}
	mhz, err := strconv.ParseFloat(v, 64)
	if err != nil || mhz <= 0 {
		return 0, fmt.Errorf("find the host's TSC frequency: cpu MHz %q", v)
	}
	return int64(mhz*1000 + 0.5), nil
}
