package sandbox

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/fake"
	"dsec.dev/dsec/internal/iam"
)

// BenchmarkMetricsView is what a scrape of a node's /metrics costs in
// reading its sandboxes (MetricsView walks them all, holding the
// manager's lock), at 1,000 and 10,000 sandboxes of 50 projects: the time
// of one scrape's walk. Nothing walks them between scrapes.
//
//	go test -run XXX -bench MetricsView ./internal/edge/sandbox
func BenchmarkMetricsView(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			m, err := New(Config{Node: "n1", StateDir: b.TempDir(), Defaults: Defaults{TTL: time.Hour}},
				map[Kind]backend.Runtime{ContainerKind: fake.New(b.TempDir())}, &fakeImages{}, nil, slog.New(slog.DiscardHandler))
			if err != nil {
				b.Fatal(err)
			}
			defer m.Shutdown()
			// Records only, put in place: no runtime, agent or watch
			// holds them, and MetricsView reads nothing else.
			m.mu.Lock()
			for i := range n {
				id := fmt.Sprintf("sb-n1-%d", i)
				m.sandboxes[id] = &sandbox{rec: &dsecv1.Sandbox{Id: id, State: dsecv1.State_STATE_RUNNING,
					Spec: &dsecv1.SandboxSpec{Cpus: 1, MemoryMb: 512, Labels: map[string]string{iam.ProjectLabel: fmt.Sprintf("/p%d", i%50)}}}}
			}
			m.mu.Unlock()
			for b.Loop() {
				if v := m.MetricsView(); len(v.Sandboxes) != 50 {
					b.Fatalf("%d sandbox groups, want 50 (one a project)", len(v.Sandboxes))
				}
			}
		})
	}
}
