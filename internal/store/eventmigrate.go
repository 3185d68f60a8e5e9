package store

import (
	"context"
	"database/sql"
	"fmt"
	"strings"

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

// eventsMigration is the dialect's migration that made the events table.
var eventsMigration = map[string]string{dialectSQLite: "00008_events.sql", dialectPostgres: "00007_events.sql"}

// unpackEvents undoes packLegacyEvents: the events table as its migration
// made it (that migration's Up, run again), every pack's events in it
// under their IDs (a key stored twice once: the table keeps each once),
// and its ID sequence after the counter's.
func (d *sqlDB) unpackEvents(ctx context.Context, tx *sql.Tx) error {
	ddl, err := upStatements(d.dialect, eventsMigration[d.dialect])
	if err != nil {
		return err
	}
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
	_, err = tx.ExecContext(ctx, `DELETE FROM event_packs`)
	return err
}

// upStatements are the statements of the Up part of the dialect's
// migration file name, one of plain statements (no goose statement
// blocks, no ";" inside one).
func upStatements(dialect, name string) ([]string, error) {
	data, err := migrations.ReadFile("migrations/" + dialect + "/" + name)
	if err != nil {
		return nil, fmt.Errorf("read migration %s: %w", name, err)
	}
	_, up, ok := strings.Cut(string(data), "-- +goose Up")
	up, _, ok2 := strings.Cut(up, "-- +goose Down")
	if !ok || !ok2 {
		return nil, fmt.Errorf("migration %s: no Up and Down parts", name)
	}
	var out []string
	for _, s := range strings.Split(up, ";") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out, nil
}
