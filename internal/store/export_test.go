package store

// TokenHashForTest is what the store keeps of a token.
func TokenHashForTest(tok string) []byte { return hashToken(tok) }

// CombinedForTest says how many of a PostgreSQL store's ReserveCreate and
// CompleteCreate statements were sent in batches of two or more, and how
// many of those ran again alone because their batch failed.
func CombinedForTest(st Store) (batched, rerun int64) {
	pg := st.(*pgStore)
	return pg.reserve.batched.Load() + pg.complete.batched.Load(), pg.reserve.rerun.Load() + pg.complete.rerun.Load()
}
