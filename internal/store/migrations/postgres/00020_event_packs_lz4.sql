-- Event packs compressed with LZ4 rather than PostgreSQL's own pglz: a
-- pack of a busy node's pull (hundreds of events, tens of KiB) is
-- compressed as it is stored (TOAST), and pglz was a third of what
-- storing a pack cost the server: BenchmarkPullPacks (internal/store,
-- batches of 256 events) read 2.2–2.4 µs of PostgreSQL's CPU an event
-- with pglz, 1.6–1.9 with LZ4. Only packs stored from now on; a server
-- built without LZ4 keeps pglz (the ALTER is refused, and skipped).

-- +goose Up
-- +goose StatementBegin
DO $$
BEGIN
	ALTER TABLE event_packs ALTER COLUMN events SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
	RAISE NOTICE 'this PostgreSQL has no LZ4: event packs stay compressed with pglz';
END
$$;
-- +goose StatementEnd

-- +goose Down
ALTER TABLE event_packs ALTER COLUMN events SET COMPRESSION default;
