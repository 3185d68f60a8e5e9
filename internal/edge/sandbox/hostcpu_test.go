package sandbox

import (
	"testing"
	"time"
)

// TestHostCPU: no figure until two readings a window apart; then the busy
// seconds over the wall seconds between them, kept until the next window.
func TestHostCPU(t *testing.T) {
	used := 100.0
	h := &hostCPU{read: func() (float64, error) { return used, nil }, busy: -1}
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
