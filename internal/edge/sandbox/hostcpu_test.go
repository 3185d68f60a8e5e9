package sandbox

import (
	"runtime"
	"testing"
	"time"

	"dsec.dev/dsec/internal/edge/backend/fake"
)

// TestHostCPU: no figure until two readings a window apart; then the busy
// seconds over the wall seconds between them, kept until the next window.
func TestHostCPU(t *testing.T) {
	used := 100.0
	h := &hostCPU{read: func() (float64, int, error) { return used, 64, nil }, busy: -1}
	t0 := time.Unix(1000, 0)
	if b := h.Busy(t0); b != -1 {
		t.Fatalf("first reading: %v, want -1 (not known)", b)
	}
	used = 103
	if b := h.Busy(t0.Add(2 * time.Second)); b != 1.5 {
		t.Fatalf("3 busy seconds over 2: %v, want 1.5", b)
	}
	used = 200
	if b := h.Busy(t0.Add(2500 * time.Millisecond)); b != 1.5 {
		t.Fatalf("within the window: %v, want the last figure 1.5", b)
	}
	if b := h.Busy(t0.Add(4 * time.Second)); b != 48.5 {
		t.Fatalf("97 busy seconds over 2: %v, want 48.5", b)
	}
}

// TestStatusHostCPUs: the node reports the host's online CPUs, which its
// busy figure is over, in Status and its metrics alike, not
// runtime.NumCPU, which follows dsecd's CPU affinity: a dsecd pinned to 2
// of 64 CPUs reported 2 CPUs with up to 64 of them busy.
func TestStatusHostCPUs(t *testing.T) {
	m := newTestManager(t, t.TempDir(), fake.New(t.TempDir()))
	host := runtime.NumCPU() + 62 // never what affinity gives this process
	used := 100.0
	m.hostCPU = &hostCPU{read: func() (float64, int, error) { return used, host, nil }, busy: -1}
	if got := m.MetricsView().CPUs; got != float64(host) {
		t.Errorf("MetricsView().CPUs = %v before any Status, want the host's %d", got, host)
	}
	t0 := time.Now()
	st := m.Status()
	if st.CPUs != float64(host) {
		t.Errorf("Status().CPUs = %v, want the host's %d (runtime.NumCPU is %d)", st.CPUs, host, runtime.NumCPU())
	}
	used += float64(host) * 2 // every host CPU busy
	m.hostCPU.mu.Lock()
	m.hostCPU.at = t0.Add(-2 * time.Second)
	m.hostCPU.used = 100
	m.hostCPU.mu.Unlock()
	st = m.Status()
	if st.CPUBusy <= 0 || st.CPUBusy > st.CPUs {
		t.Errorf("Status() says %v of %v CPUs busy, want a figure within the CPUs it reports", st.CPUBusy, st.CPUs)
	}
	if got := m.MetricsView().CPUs; got != float64(host) {
		t.Errorf("MetricsView().CPUs = %v, want the host's %d", got, host)
	}
}
