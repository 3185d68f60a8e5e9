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
