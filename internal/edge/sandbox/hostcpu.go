package sandbox

import (
	"sync"
	"time"

	"dsec.dev/dsec/internal/metrics"
)

// hostCPU turns the host's busy CPU time (/proc/stat) into how many CPUs
// were busy, on average, between two of the node's status reports at
// least minCPUWindow apart: the apiservers read Status every poll, and a
// rate over a shorter window would be noise.
type hostCPU struct {
	read func() (float64, error) // busy seconds since boot

	mu   sync.Mutex
	at   time.Time
	used float64
	busy float64 // -1: not known yet
}

const minCPUWindow = time.Second

func newHostCPU() *hostCPU { return &hostCPU{read: metrics.CPUUsed, busy: -1} }

// Busy returns the CPUs busy on average over the last window, -1 until
// two readings a window apart have been taken (or on a host without
// /proc/stat).
func (h *hostCPU) Busy(now time.Time) float64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.at.IsZero() && now.Sub(h.at) < minCPUWindow {
		return h.busy
	}
	used, err := h.read()
	if err != nil {
		return -1
	}
	if !h.at.IsZero() && used >= h.used {
		h.busy = (used - h.used) / now.Sub(h.at).Seconds()
	}
	h.at, h.used = now, used
	return h.busy
}
