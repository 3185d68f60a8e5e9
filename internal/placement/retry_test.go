package placement

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
)

func TestClassify(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want Outcome
	}{
		{nil, Stop},
		{fmt.Errorf("node n1 holds its maximum of 200 sandboxes: %w", errdefs.ErrResourceExhausted), Refused},
		{errdefs.FromConnect(errdefs.ToConnect(fmt.Errorf("full: %w", errdefs.ErrResourceExhausted))), Refused},
		{fmt.Errorf("dial n1: %w", errdefs.ErrUnavailable), Failed},
		{errdefs.FromConnect(errdefs.ToConnect(fmt.Errorf("dial: %w", errdefs.ErrUnavailable))), Failed},
		{errdefs.ErrInternal, Failed},
		{errdefs.ErrDeadlineExceeded, Failed},
		{fmt.Errorf("backend microvm is not available on node n1: %w", errdefs.ErrNotSupported), Failed},
		{errors.New("connection reset"), Failed},
		{fmt.Errorf("bad spec: %w", errdefs.ErrInvalidArgument), Stop},
		{errdefs.FromConnect(errdefs.ToConnect(fmt.Errorf("bad spec: %w", errdefs.ErrInvalidArgument))), Stop},
		{fmt.Errorf("layer sha256:ab: %w", errdefs.ErrNotFound), Stop},
		{errdefs.ErrAlreadyExists, Stop},
		{errdefs.ErrFailedPrecondition, Stop},
		{fmt.Errorf("create: %w", context.Canceled), Stop},
		{context.DeadlineExceeded, Stop},
	} {
		if got := Classify(tc.err); got != tc.want {
			t.Errorf("Classify(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

func TestRetry(t *testing.T) {
	full := fmt.Errorf("full: %w", errdefs.ErrResourceExhausted)
	down := fmt.Errorf("dial: %w", errdefs.ErrUnavailable)
	bad := fmt.Errorf("spec: %w", errdefs.ErrInvalidArgument)
	type step struct {
		node  string
		err   error
		again bool
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"success", []step{{"a", nil, false}}},
		{"caller's fault", []step{{"a", bad, false}}},
		{"refusals do not count", []step{{"a", full, true}, {"b", full, true}, {"c", full, true}, {"d", full, true}, {"e", nil, false}}},
		{"three failures", []step{{"a", down, true}, {"b", full, true}, {"c", down, true}, {"d", down, false}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var r Retry
			tried := map[string]bool{}
			for i, s := range tc.steps {
				if r.Exclude[s.node] {
					t.Fatalf("step %d: %s placed again though excluded", i, s.node)
				}
				if got := r.Again(s.node, s.err); got != s.again {
					t.Fatalf("step %d: Again(%s, %v) = %v, want %v", i, s.node, s.err, got, s.again)
				}
				if Classify(s.err) != Stop {
					tried[s.node] = true
				}
			}
			if len(r.Exclude) != len(tried) {
				t.Errorf("excluded %v, want %v", r.Exclude, tried)
			}
		})
	}
}

// TestRetryEnds runs the loop in Retry's comment against a cluster whose
// every edge refuses: it stops with the typed error once all were tried.
func TestRetryEnds(t *testing.T) {
	p := newPlacer(1, newClock())
	view := equal(5, 0, 10)
	var r Retry
	for i := 0; ; i++ {
		if i > len(view) {
			t.Fatal("the loop did not end")
		}
		names, err := p.Place(view, Request{Count: 1}, r.Exclude)
		if err != nil {
			var ex *ExhaustedError
			if !errors.As(err, &ex) || ex.Shortage != AllTried || r.Refusals != len(view) {
				t.Fatalf("ended with %v after %d refusals, want every node tried", err, r.Refusals)
			}
			return
		}
		p.Done(names[0], 1, false)
		if !r.Again(names[0], fmt.Errorf("node %s full: %w", names[0], errdefs.ErrResourceExhausted)) {
			t.Fatal("a refusal stopped the loop")
		}
	}
}
