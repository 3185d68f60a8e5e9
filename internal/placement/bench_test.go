package placement

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// BenchmarkPlace measures one Place and the Done of its sandboxes over 160
// nodes, the cycle one create costs an apiserver. It reports the time per
// sandbox and its share of the 200 µs one sandbox has at 5,000 creates/s.
func BenchmarkPlace(b *testing.B) {
	const budget = float64(time.Second / 5000)
	for _, batch := range []int{1, 50} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			p := New(Config{Rand: rand.New(rand.NewPCG(1, 1))})
			view := make([]Node, 160)
			for i := range view {
				view[i] = Node{Name: fmt.Sprintf("node-%03d", i), Backends: []string{"container", "microvm"},
					Capacity: 3200, Live: 1600 + i%50, Healthy: true, ReportedAt: time.Now()}
			}
			for b.Loop() {
				names, err := p.Place(view, Request{Count: batch}, nil)
				if err != nil {
					b.Fatal(err)
				}
				for _, n := range names {
					p.Done(n, 1, false)
				}
			}
			ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N*batch)
			b.ReportMetric(ns, "ns/sandbox")
			b.ReportMetric(ns/budget, "budget-share")
		})
	}
}
