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

// WaitCounts polls count(i) for each i of want until every one is want[i]
// (a want below 0 is not asked: its count shows as -1), and fails t when
// limit passes first, naming what it waited for with the counts last seen
// and those wanted. It logs the counts it saw hold. As WaitFor, it polls
// every millisecond at first, backing off to every 100 ms. The event
// pulls' balance tests wait with it for each apiserver's share of nodes.
func WaitCounts(t testing.TB, limit time.Duration, what string, want []int64, count func(i int) int64) {
	t.Helper()
	got := make([]int64, len(want))
	deadline := time.Now().Add(limit)
	for pause := time.Millisecond; ; pause = min(2*pause, 100*time.Millisecond) {
		ok := true
		for i, w := range want {
			got[i] = -1
			if w >= 0 {
				got[i] = count(i)
				ok = ok && got[i] == w
			}
		}
		if ok {
			t.Logf("%s: %v", what, got)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s: %v, want %v", limit, what, got, want)
		}
		time.Sleep(pause)
	}
}
