package fncall

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"time"
)

// memAvailable tells the node's available memory (MemAvailable of
// /proc/meminfo), read at most once per minPeriod: the pools start a
// container only while it holds the call (pools.growLocked). Its callers
// hold pools.mu.
type memAvailable struct {
	at        time.Time
	mb        int64
	ok        bool
	minPeriod time.Duration
	read      func() (mb int64, ok bool)
}

func newMemAvailable() *memAvailable {
	return &memAvailable{minPeriod: 20 * time.Millisecond, read: procMemAvailable}
}

// availableMB is the node's available memory in MiB, as last read; false
// when /proc/meminfo cannot be read.
func (m *memAvailable) availableMB(now time.Time) (int64, bool) {
	if m.at.IsZero() || now.Sub(m.at) >= m.minPeriod {
		m.mb, m.ok = m.read()
		m.at = now
	}
	return m.mb, m.ok
}

// procMemAvailable reads MemAvailable from /proc/meminfo, in MiB.
func procMemAvailable() (int64, bool) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "MemAvailable:")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		if err != nil {
			return 0, false
		}
		return kb >> 10, true
	}
	return 0, false
}
