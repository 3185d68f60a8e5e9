package metrics

import (
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func TestChildren(t *testing.T) {
	vec := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c_total", Help: "h"}, []string{"a", "b"})
	c := newChildren(func(k execKey) prometheus.Counter { return vec.WithLabelValues(k.isolation, k.outcome) })
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { c.get(execKey{"container", "ok"}).Inc() })
	}
	wg.Wait()
	c.get(execKey{"gvisor", "ok"}).Inc()
	if got := testCounter(t, vec.WithLabelValues("container", "ok")); got != 8 {
		t.Errorf("container/ok = %v, want 8", got)
	}
	if got := testCounter(t, vec.WithLabelValues("gvisor", "ok")); got != 1 {
		t.Errorf("gvisor/ok = %v, want 1", got)
	}
	// Goroutines that race for a new series may each make it; the vector
	// holds one whatever the race.
	reg := prometheus.NewRegistry()
	reg.MustRegister(vec)
	if fams, err := reg.Gather(); err != nil || len(fams) != 1 || len(fams[0].Metric) != 2 {
		t.Errorf("gathered %v (%v), want one family of 2 series", fams, err)
	}
}

func testCounter(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// BenchmarkRequestLookup is a request's observation (metrics.API.Request)
// through the vector's WithLabelValues, as it was, and through the
// cached series (children), in one run: compare the two ns/op.
func BenchmarkRequestLookup(b *testing.B) {
	const proc, code = "/dsec.v1.SandboxService/Create", "ok"
	a := New().API(func() (int, int) { return 1, 1 })
	b.Run("WithLabelValues", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			a.requests.WithLabelValues(proc, code).Observe(0.01)
		}
	})
	b.Run("children", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			a.Request(proc, code, 10e6)
		}
	})
}

// BenchmarkCreateLookup is BenchmarkRequestLookup for an edge's create: a
// counter and a histogram of three labels.
func BenchmarkCreateLookup(b *testing.B) {
	e := New().Edge()
	b.Run("WithLabelValues", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			e.creates.WithLabelValues("container", "container", "ok").Inc()
			e.createSeconds.WithLabelValues("container", "container", "ok").Observe(0.01)
		}
	})
	b.Run("children", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			e.Create("container", "container", nil, 10e6)
		}
	})
}
