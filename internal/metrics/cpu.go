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
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0, fmt.Errorf("read cpu time: %w", err)
	}
	defer f.Close()
	return parseCPUUsed(f)
}

func parseCPUUsed(r io.Reader) (float64, error) {
	sc := bufio.NewScanner(r)
	if !sc.Scan() {
		return 0, fmt.Errorf("read cpu time: /proc/stat is empty")
	}
	f := strings.Fields(sc.Text())
	if len(f) < 9 || f[0] != "cpu" {
		return 0, fmt.Errorf("read cpu time: /proc/stat's first line is %q, want the cpu totals", sc.Text())
	}
	var used uint64
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system (idle iowait) irq softirq steal
		n, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("read cpu time: field %d of /proc/stat's cpu line: %w", i, err)
		}
		used += n
	}
	return float64(used) / userHZ, nil
}
