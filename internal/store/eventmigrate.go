package store

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/pressly/goose/v3"
)

// The events table's rows become packs in a Go migration, the version
// after the SQL one that makes event_packs (the encoding is Go's), one
// version number per dialect.
var eventPackMigration = map[string]int64{dialectSQLite: 19, dialectPostgres: 18}

// goMigrations are the dialect's migrations written in Go.
func goMigrations(dialect string) []*goose.Migration {
	d := &sqlDB{dialect: dialect}
	return []*goose.Migration{goose.NewGoMigration(eventPackMigration[dialect],
		&goose.GoFunc{RunTx: d.packLegacyEvents}, &goose.GoFunc{RunTx: d.unpackEvents})}
}

// migrateRead is how many rows or packs the event migrations read at a time.
const migrateRead = 10000

// packLegacyEvents moves the events table's rows into packs, keeping
// their IDs (a pack is a run of consecutive IDs of one project), and
// drops the table.
func (d *sqlDB) packLegacyEvents(ctx context.Context, tx *sql.Tx) error {
	var after int64
	for {
		rows, err := tx.QueryContext(ctx, d.q(`SELECT id, key, at{ms}, project, sandbox_id, kind, node, reason, message
			FROM events WHERE id > ? ORDER BY id LIMIT ?`), after, migrateRead)
		if err != nil {
			return fmt.Errorf("read the events to pack: %w", err)
		}
		var evs []Event
		for rows.Next() {
			var e Event
			if err := rows.Scan(&e.ID, &e.Key, timeCol{&e.At}, &e.Project, &e.SandboxID, &e.Kind, &e.Node, &e.Reason, &e.Message); err != nil {
				rows.Close()
				return err
			}
			evs = append(evs, e)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		if len(evs) == 0 {
			break
		}
		after = evs[len(evs)-1].ID
		for len(evs) > 0 {
			n := 1
			for n < len(evs) && n < packMax && evs[n].ID == evs[n-1].ID+1 && evs[n].Project == evs[0].Project {
				n++
			}
			p := packEvents(evs[:n])[0]
			if _, err := tx.ExecContext(ctx, d.q(insertPack), evs[n-1].ID, evs[0].ID, p.project, d.ts(p.firstAt), d.ts(p.last), encodePack(p.events)); err != nil {
				return fmt.Errorf("pack events %d–%d: %w", evs[0].ID, evs[n-1].ID, err)
			}
			evs = evs[n:]
		}
	}
	_, err := tx.ExecContext(ctx, `DROP TABLE events`)
	return err
}

// unpackEvents undoes packLegacyEvents: the events table as its first
// migration made it, every pack's events in it under their IDs (a key
// stored twice once: the table keeps each once), and its ID sequence
// after the counter's.
func (d *sqlDB) unpackEvents(ctx context.Context, tx *sql.Tx) error {
	ddl := []string{`CREATE TABLE events (
		id         INTEGER PRIMARY KEY AUTOINCREMENT,
		key        TEXT NOT NULL UNIQUE,
		at_ms      INTEGER NOT NULL,
		project    TEXT NOT NULL,
		sandbox_id TEXT NOT NULL,
		kind       TEXT NOT NULL,
		node       TEXT NOT NULL,
		reason     TEXT NOT NULL,
		message    TEXT NOT NULL)`}
	if d.dialect == dialectPostgres {
		ddl = []string{`CREATE TABLE events (
		id         bigserial PRIMARY KEY,
		key        text NOT NULL UNIQUE,
		at         timestamptz NOT NULL,
		project    text NOT NULL,
		sandbox_id text NOT NULL,
		kind       text NOT NULL,
		node       text NOT NULL,
		reason     text NOT NULL,
		message    text NOT NULL)`}
	}
	ddl = append(ddl, `CREATE INDEX events_project_id ON events (project, id)`, d.q(`CREATE INDEX events_at ON events (at{ms})`))
	for _, s := range ddl {
		if _, err := tx.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("make the events table again: %w", err)
		}
	}
	var after int64
	for {
		rows, err := tx.QueryContext(ctx, d.q(`SELECT `+packColumns+` FROM event_packs WHERE last_id > ? ORDER BY last_id LIMIT ?`), after, migrateRead/packMax)
		if err != nil {
			return fmt.Errorf("read the packs to unpack: %w", err)
		}
		var evs []Event
		for rows.Next() {
			p, err := scanPack(rows)
			if err != nil {
				rows.Close()
				return err
			}
			after = p.last
			if err := p.decode(func(e Event) bool { evs = append(evs, e); return true }); err != nil {
				rows.Close()
				return err
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		if len(evs) == 0 {
			break
		}
		for _, e := range evs {
			if _, err := tx.ExecContext(ctx, d.q(`INSERT INTO events (id, key, at{ms}, project, sandbox_id, kind, node, reason, message)
				VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING`),
				e.ID, e.Key, d.ts(e.At), e.Project, e.SandboxID, e.Kind, e.Node, e.Reason, e.Message); err != nil {
				return fmt.Errorf("unpack event %d: %w", e.ID, err)
			}
		}
	}
	seq := []string{`DELETE FROM sqlite_sequence WHERE name = 'events'`,
		`INSERT INTO sqlite_sequence (name, seq) SELECT 'events', last_id FROM event_ids`}
	if d.dialect == dialectPostgres {
		seq = []string{`SELECT setval('events_id_seq', GREATEST(last_id, 1), last_id > 0) FROM event_ids`}
	}
	for _, s := range seq {
		if _, err := tx.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("set the events' ID sequence: %w", err)
		}
	}
	_, err := tx.ExecContext(ctx, `DELETE FROM event_packs`)
	return err
}
