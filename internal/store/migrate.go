package store

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

// migrations holds one directory of goose SQL migrations per dialect. A
// migration, once released, is never edited: a change is a new file.
//
//go:embed migrations/sqlite/*.sql migrations/postgres/*.sql
var migrations embed.FS

// migrationLockID is the PostgreSQL advisory lock that serialises replicas
// migrating one database at once ("dsecmeta" in ASCII).
const migrationLockID = 0x647365636d657461

// migrator returns the goose provider for db's dialect.
func migrator(db *sql.DB, dialect string) (*goose.Provider, error) {
	dir, err := fs.Sub(migrations, "migrations/"+dialect)
	if err != nil {
		return nil, err
	}
	opts := []goose.ProviderOption{goose.WithDisableGlobalRegistry(true), goose.WithGoMigrations(goMigrations(dialect)...)}
	gd := goose.DialectSQLite3
	if dialect == dialectPostgres {
		gd = goose.DialectPostgres
		locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(migrationLockID), lock.WithLockTimeout(1, 300))
		if err != nil {
			return nil, err
		}
		opts = append(opts, goose.WithSessionLocker(locker))
	}
	return goose.NewProvider(gd, db, dir, opts...)
}

// migrate brings db's schema to the newest version this binary holds.
func migrate(ctx context.Context, db *sql.DB, dialect string) error {
	p, err := migrator(db, dialect)
	if err != nil {
		return fmt.Errorf("load %s migrations: %w", dialect, err)
	}
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("migrate %s metadata schema: %w", dialect, err)
	}
	return nil
}
