package store_test

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"dsec.dev/dsec/internal/store"
)

// BenchmarkAppendEvents is what storing events costs per event on SQLite,
// in the batches an apiserver's pull makes (one event a call when nodes
// are quiet, more under load).
func BenchmarkAppendEvents(b *testing.B) {
	for _, batch := range []int{1, 16, 100} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			st := openStore(b, filepath.Join(b.TempDir(), "meta.db"))
			n := 0
			for b.Loop() {
				evs := make([]store.Event, batch)
				for i := range evs {
					n++
					evs[i] = store.Event{Key: fmt.Sprintf("n1/e/%d", n), At: time.Now(), Project: "ml", SandboxID: "sb-n1-0a1b2c3d", Kind: "created", Node: "n1"}
				}
				if _, err := st.AppendEvents(b.Context(), evs...); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(n)/1000, "µs/event")
		})
	}
}
