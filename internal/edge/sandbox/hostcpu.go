package sandbox

import (
	"runtime"
	"sync"
	"time"

	"dsec.dev/dsec/internal/metrics"
)

// hostCPU turns the host's busy CPU time (/proc/stat) into how many CPUs
// were busy, on average, between two of the node's status reports at
// least minCPUWindow apart: the apiservers read Status every poll, and a
// rate over a shorter window would be noise. It also keeps the host's
// online CPU count from the same reading: the CPUs the busy figure is
// spread over, which the node reports as its CPUs (runtime.NumCPU follows
// dsecd's CPU affinity, and a pinned dsecd would report fewer CPUs than
// the host keeps busy).
type hostCPU struct {
	read func() (used float64, cpus int, err error) // busy seconds since boot, online CPUs

	mu   sync.Mutex
	at   time.Time
	used float64
	busy float64 // -1: not known yet
	cpus int     // 0: not read yet
}

const minCPUWindow = time.Second

func newHostCPU() *hostCPU { return &hostCPU{read: metrics.HostCPU, busy: -1} }

// Busy returns the CPUs busy on average over the last window, -1 until
// two readings a window apart have been taken (or on a host without
// /proc/stat).
func (h *hostCPU) Busy(now time.Time) float64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.at.IsZero() && now.Sub(h.at) < minCPUWindow {
		return h.busy
	}
	used, cpus, err := h.read()
	if err != nil {
		return -1
	}
	if !h.at.IsZero() && used >= h.used {
		h.busy = (used - h.used) / now.Sub(h.at).Seconds()
	}
	h.at, h.used, h.cpus = now, used, cpus
	return h.busy
}

// CPUs returns the host's online CPUs as last read (reading them if
// Busy has not), or runtime.NumCPU on a host without /proc/stat.
func (h *hostCPU) CPUs() int {
	if h == nil {
		return runtime.NumCPU()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cpus == 0 {
		if _, cpus, err := h.read(); err == nil {
			h.cpus = cpus
		}
	}
	if h.cpus == 0 {
		return runtime.NumCPU()
	}
	return h.cpus
}
