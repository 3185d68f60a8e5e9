package testutil

import (
	"testing"
	"time"
)

// WaitFor polls cond until it holds, and fails t when limit passes first,
// naming what it waited for. It polls every millisecond at first, backing
// off to every 100 ms, so that a condition that holds soon is seen soon
// and a slow one is not polled hard.
func WaitFor(t testing.TB, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	pause := time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", limit, what)
		}
		time.Sleep(pause)
		pause = min(2*pause, 100*time.Millisecond)
	}
}
