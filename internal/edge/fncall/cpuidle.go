package fncall

import (
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// cpuIdle tells how much of the node's CPU time went unused lately, from
// /proc/stat: a pool past its soft ceiling grows only when it did, since
// waiters behind busy CPUs gain nothing from more containers.
type cpuIdle struct {
	mu         sync.Mutex
	at         time.Time
	idle, all  uint64
	frac       float64
	minPeriod  time.Duration
	readCounts func() (idle, all uint64, ok bool)
}

func newCPUIdle() *cpuIdle {
	return &cpuIdle{minPeriod: 50 * time.Millisecond, readCounts: procStat}
}

// fraction is the idle share of CPU time since the previous sample at
// least minPeriod ago: 0 until there are two samples (no growth on a
// guess), 1 when /proc/stat cannot be read (no growth held back on one).
func (c *cpuIdle) fraction(now time.Time) float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if now.Sub(c.at) < c.minPeriod {
		return c.frac
	}
	idle, all, ok := c.readCounts()
	if !ok {
		return 1
	}
	if !c.at.IsZero() && all > c.all {
		c.frac = float64(idle-c.idle) / float64(all-c.all)
	}
	c.at, c.idle, c.all = now, idle, all
	return c.frac
}

// procStat reads the node's idle (idle + iowait) and total CPU time.
func procStat() (idle, all uint64, ok bool) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, false
	}
	line, _, _ := strings.Cut(string(data), "\n")
	f := strings.Fields(line)
	if len(f) < 6 || f[0] != "cpu" {
		return 0, 0, false
	}
	for i, v := range f[1:] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return 0, 0, false
		}
		if i == 7 { // steal and what follows (guest) are counted elsewhere
			break
		}
		all += n
		if i == 3 || i == 4 {
			idle += n
		}
	}
	return idle, all, true
}
