package store

import "context"

// TokenHashForTest is what the store keeps of a token.
func TokenHashForTest(tok string) []byte { return hashToken(tok) }

// CombinedForTest says how many of a PostgreSQL store's ReserveCreate and
// CompleteCreate statements were sent in batches of two or more, and how
// many of those ran again alone because their batch failed.
func CombinedForTest(st Store) (batched, rerun int64) {
	pg := st.(*pgStore)
	return pg.reserve.batched.Load() + pg.complete.batched.Load(), pg.reserve.rerun.Load() + pg.complete.rerun.Load()
}

// PullEventsByInsertForTest is PullEvents as it was on PostgreSQL before
// COPY: the events by INSERTs of 100 rows (what it still does when a key
// is stored already). On SQLite it is PullEvents.
func PullEventsByInsertForTest(st Store) func(ctx context.Context, owner string, to []EventPull, evs ...Event) (int, error) {
	if pg, ok := st.(*pgStore); ok {
		return pg.sqlDB.PullEvents
	}
	return st.PullEvents
}
