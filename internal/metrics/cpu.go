package metrics

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// userHZ is the unit of /proc/stat's CPU times: USER_HZ, 100 on every
// Linux architecture dsec builds for.
const userHZ = 100

// CPUUsed reads the CPU time the host has spent busy since it booted, in
// seconds, from /proc/stat: user, nice, system, irq, softirq and steal
// over every CPU (idle and iowait are not busy). An error on a system
// without /proc/stat; the node's gauge is then left out.
func CPUUsed() (float64, error) {
	used, _, err := HostCPU()
	return used, err
}

// HostCPU reads, from one look at /proc/stat, the CPU time the host has
// spent busy since it booted (as CPUUsed) and how many CPUs it has online
// (its cpuN lines): the CPUs that busy time is spent on. This is the
// host's count, whatever CPU affinity the caller runs with, where
// runtime.NumCPU follows the process's affinity.
func HostCPU() (used float64, cpus int, err error) {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0, 0, fmt.Errorf("read cpu time: %w", err)
	}
	defer f.Close()
	return parseCPUUsed(f)
}

func parseCPUUsed(r io.Reader) (float64, int, error) {
	sc := bufio.NewScanner(r)
	if !sc.Scan() {
		return 0, 0, fmt.Errorf("read cpu time: /proc/stat is empty")
	}
	f := strings.Fields(sc.Text())
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0, fmt.Errorf("read cpu time: /proc/stat's first line is %q, want the cpu totals", sc.Text())
	}
	var used uint64
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system (idle iowait) irq softirq steal
		n, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("read cpu time: field %d of /proc/stat's cpu line: %w", i, err)
		}
		used += n
	}
	// The per-CPU lines follow the totals, one per online CPU.
	cpus := 0
	for sc.Scan() {
		name, _, _ := strings.Cut(sc.Text(), " ")
		if !strings.HasPrefix(name, "cpu") {
			break
		}
		if _, err := strconv.ParseUint(name[len("cpu"):], 10, 32); err == nil {
			cpus++
		}
	}
	if err := sc.Err(); err != nil {
		return 0, 0, fmt.Errorf("read cpu time: %w", err)
	}
	if cpus == 0 {
		return 0, 0, fmt.Errorf("read cpu time: /proc/stat lists no CPU after the totals")
	}
	return float64(used) / userHZ, cpus, nil
}
