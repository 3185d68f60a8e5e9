package testutil

import (
	"sync/atomic"
	"testing"
	"time"
)

func TestWaitForSeesCondition(t *testing.T) {
	var calls atomic.Int32
	WaitFor(t, 5*time.Second, "the third poll", func() bool { return calls.Add(1) >= 3 })
	if n := calls.Load(); n != 3 {
		t.Fatalf("cond called %d times, want 3", n)
	}
}

// fatalRecorder records a Fatalf instead of ending the test.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}

func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = format
	panic(r)
}

func TestWaitForTimesOut(t *testing.T) {
	r := &fatalRecorder{TB: t}
	start := time.Now()
	func() {
		defer func() {
			if p := recover(); p != nil && p != r {
				panic(p)
			}
		}()
		WaitFor(r, 50*time.Millisecond, "never", func() bool { return false })
	}()
	if r.msg == "" {
		t.Fatal("WaitFor returned without failing for a condition that never holds")
	}
	if waited := time.Since(start); waited < 50*time.Millisecond {
		t.Fatalf("WaitFor gave up after %s, before its 50ms limit", waited)
	}
}

// TestWaitCounts: it returns once every count asked is its want, never
// asking a count whose want is below 0, and fails naming the counts when
// one never comes.
func TestWaitCounts(t *testing.T) {
	// Each count grows by one a poll up to its want.
	var calls [3]atomic.Int64
	want := []int64{2, -1, 3}
	WaitCounts(t, 5*time.Second, "counts", want, func(i int) int64 { return min(calls[i].Add(1), want[i]) })
	if a, b, c := calls[0].Load(), calls[1].Load(), calls[2].Load(); a != 3 || b != 0 || c != 3 {
		t.Fatalf("counts asked %d, %d, %d times; want 3, never, 3", a, b, c)
	}
	r := &fatalRecorder{TB: t}
	func() {
		defer func() {
			if p := recover(); p != nil && p != r {
				panic(p)
			}
		}()
		WaitCounts(r, 20*time.Millisecond, "never", []int64{1}, func(int) int64 { return 0 })
	}()
	if r.msg == "" {
		t.Fatal("WaitCounts returned for a count that never comes")
	}
}
