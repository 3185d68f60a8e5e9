package store_test

import (
	"fmt"
	"os"
	"strconv"
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
// are sandboxes whose end is their only report (appended in packs,
// ledger_end_packs), sole=false those checkpointed before (upserted into
// ledger);
// the first over the second is what appending saves. client-µs/row is the
// CPU this process (the apiserver's part: encoding the rows) spent a row.
// Each row has the labels a training loop's sandbox has: its project and
// a run.
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
	self := os.Getpid()
	cpu0, self0 := pg.CPU(), testutil.ProcCPU(self, false)
	// The sandboxes' IDs are made once: each round's keys are them and
	// the round's number, so that making them costs the client next to
	// nothing.
	ids := make([]string, batch)
	for i := range ids {
		ids[i] = sandboxid.New("n1", 1, 1)
	}
	labels := map[string]string{"dsec.dev/project": "ml/team", "run": "grpo-7"}
	round := 0
	for b.Loop() {
		now := time.Now()
		round++
		suffix := "-" + strconv.Itoa(round)
		for i := range rows {
			id := ids[i] + suffix
			rows[i] = store.UsageRow{Key: id, SandboxID: id, Project: "ml/team", Node: "n1",
				Labels: labels, Started: now.Add(-20 * time.Second), Ended: now,
				Updated: now, Sole: sole, Usage: store.Usage{CPUUsec: 1_000_000, MemoryGiBSec: 2.5, DiskGiBHours: 0.01, DiskPeakBytes: 16 << 20, EgressBytes: 20 << 10}}
		}
		if err := st.PutUsage(ctx, rows...); err != nil {
			b.Fatal(err)
		}
		n += batch
	}
	b.ReportMetric(float64((pg.CPU()-cpu0).Microseconds())/float64(n), "pg-µs/row")
	b.ReportMetric(float64((testutil.ProcCPU(self, false)-self0).Microseconds())/float64(n), "client-µs/row")
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(n), "µs/row")
}
