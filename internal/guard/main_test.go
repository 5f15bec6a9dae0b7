package guard_test

import (
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// shared is the server every test uses; each test works in a database of
// its own (newDatabase). Under -short there is none, and newDatabase and
// connect skip the test.
var shared pgtest.Shared

func TestMain(m *testing.M) { os.Exit(shared.RunMain(m)) }

// newDatabase creates an empty database named after the test.
func newDatabase(t *testing.T) string { return shared.NewDatabase(t) }

// connect connects to db as the superuser, or as user when given.
func connect(t *testing.T, db string, user ...string) *pgx.Conn {
	return shared.Connect(t, db, user...)
}

// execSQL runs sql (one or more statements) on conn.
func execSQL(t *testing.T, conn *pgx.Conn, sql string) { pgtest.Exec(t, conn, sql) }

// specs validates tables as a configuration and returns its entries.
func specs(t *testing.T, tables ...rules.Table) []rules.TableSpec {
	t.Helper()
	s, err := rules.Specs(rules.Config{Tables: tables})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// session connects as role with fence.lock and fence.token set ("" leaves
// a setting unset).
func session(t *testing.T, db, role, lock, token string) *pgx.Conn {
	t.Helper()
	conn := connect(t, db, role)
	for name, v := range map[string]string{"fence.lock": lock, "fence.token": token} {
		if v == "" {
			continue
		}
		if _, err := conn.Exec(t.Context(), "SELECT set_config($1, $2, false)", name, v); err != nil {
			t.Fatal(err)
		}
	}
	return conn
}

// sqlState returns err's SQLSTATE, "" for nil or a non-server error.
var sqlState = testutil.SQLState

// watermark reads lock's stored token, 0 when it has none.
func watermark(t *testing.T, db, lock string) int64 {
	t.Helper()
	var w int64
	err := connect(t, db).QueryRow(t.Context(), "SELECT coalesce((SELECT token FROM fenceproxy.locks WHERE name = $1), 0)", lock).Scan(&w)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// createRole creates the login role name unless it exists.
func createRole(t *testing.T, conn *pgx.Conn, name string) {
	t.Helper()
	execSQL(t, conn, "DO $$ BEGIN CREATE ROLE "+name+" LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
}

// superRole creates the superuser name (a login role), if missing, and
// returns its name.
func superRole(t *testing.T, conn *pgx.Conn, name string) string {
	t.Helper()
	execSQL(t, conn, "DO $$ BEGIN CREATE ROLE "+name+" LOGIN SUPERUSER; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
	return name
}
