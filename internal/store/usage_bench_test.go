package store_test

import (
	"fmt"
	"testing"
	"time"

	"dsec.dev/dsec/internal/sandboxid"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
)

// BenchmarkPutUsagePG is what storing the ledger costs PostgreSQL per
// ended sandbox, in the batches an apiserver's pull of a busy node brings
// (2,000 records: a node ending 2,000 sandboxes a second, pulled each
// second): the server's CPU a row, and the wall time a row. sole=true
// are sandboxes whose end is their only report (appended to ledger_ends
// by COPY), sole=false those checkpointed before (upserted into ledger);
// the first over the second is what appending saves.
func BenchmarkPutUsagePG(b *testing.B) {
	testutil.RequireRoot(b)
	pg := testutil.StartPostgresServer(b)
	for _, batch := range []int{2000, 50000} {
		for _, sole := range []bool{false, true} {
			b.Run(fmt.Sprintf("batch=%d/sole=%v", batch, sole), func(b *testing.B) { benchPutUsage(b, pg, batch, sole) })
		}
	}
}

func benchPutUsage(b *testing.B, pg *testutil.Postgres, batch int, sole bool) {
	st := openStore(b, pg.NewDatabase(b))
	ctx := b.Context()
	rows := make([]store.UsageRow, batch)
	n := 0
	cpu0 := pg.CPU()
	for b.Loop() {
		now := time.Now()
		for i := range rows {
			id := sandboxid.New("n1", 1, 1)
			rows[i] = store.UsageRow{Key: id, SandboxID: id, Project: "ml/team", Node: "n1", Started: now.Add(-20 * time.Second), Ended: now,
				Updated: now, Sole: sole, Usage: store.Usage{CPUUsec: 1_000_000, MemoryGiBSec: 2.5, DiskGiBHours: 0.01, DiskPeakBytes: 16 << 20, EgressBytes: 20 << 10}}
		}
		if err := st.PutUsage(ctx, rows...); err != nil {
			b.Fatal(err)
		}
		n += batch
	}
	b.ReportMetric(float64((pg.CPU()-cpu0).Microseconds())/float64(n), "pg-µs/row")
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(n), "µs/row")
}
