package catalog_test

import (
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
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
