package catalog_test

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// cluster is the server every test uses; each test works in a database of
// its own (newDatabase). Under -short there is none, and newDatabase and
// connect skip the test.
var cluster *pgcluster.Cluster

func TestMain(m *testing.M) {
	c, stop := pgtest.StartMain(pgcluster.Options{})
	cluster = c
	code := m.Run()
	stop()
	testutil.ReportSkips()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goroutines left running:", err)
			code = 1
		}
	}
	os.Exit(code)
}

var dbSeq atomic.Int64

// newDatabase creates an empty database named after the test.
func newDatabase(t *testing.T) string {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL")
	name := strings.ToLower(regexp.MustCompile(`[^A-Za-z0-9]+`).ReplaceAllString(t.Name(), "_"))
	if len(name) > 50 {
		name = name[:50]
	}
	name = fmt.Sprintf("%s_%d", name, dbSeq.Add(1))
	if err := cluster.CreateDatabase(t.Context(), name); err != nil {
		t.Fatal(err)
	}
	return name
}

// connect connects to db as the superuser, or as user when given.
func connect(t *testing.T, db string, user ...string) *pgx.Conn {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL")
	dsn := cluster.SuperuserDSN(db)
	if len(user) > 0 {
		dsn = cluster.DSN(user[0], "", db)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// execSQL runs sql (one or more statements) on conn.
func execSQL(t *testing.T, conn *pgx.Conn, sql string) {
	t.Helper()
	if _, err := conn.Exec(t.Context(), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}
