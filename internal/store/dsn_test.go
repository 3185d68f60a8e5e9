package store

import "testing"

func TestParseDSN(t *testing.T) {
	for _, tc := range []struct {
		dsn, dialect, target string
	}{
		{"/var/lib/dsec/meta.db", dialectSQLite, "/var/lib/dsec/meta.db"},
		{"meta.db", dialectSQLite, "meta.db"},
		{"sqlite:/var/lib/dsec/meta.db", dialectSQLite, "/var/lib/dsec/meta.db"},
		{"sqlite:rel/meta.db", dialectSQLite, "rel/meta.db"},
		{"postgres://dsec@db.internal:5432/dsec?sslmode=verify-full", dialectPostgres, "postgres://dsec@db.internal:5432/dsec?sslmode=verify-full"},
		{"postgresql://db/dsec", dialectPostgres, "postgresql://db/dsec"},
		{"host=/run/postgresql dbname=dsec", dialectPostgres, "host=/run/postgresql dbname=dsec"},
		{"dbname=dsec host=db.internal user=dsec", dialectPostgres, "dbname=dsec host=db.internal user=dsec"},
		{"/srv/hostname=x/meta.db", dialectSQLite, "/srv/hostname=x/meta.db"},
	} {
		t.Run(tc.dsn, func(t *testing.T) {
			dialect, target, err := parseDSN(tc.dsn)
			if err != nil {
				t.Fatal(err)
			}
			if dialect != tc.dialect || target != tc.target {
				t.Fatalf("parseDSN(%q) = %s %q, want %s %q", tc.dsn, dialect, target, tc.dialect, tc.target)
			}
		})
	}
}
