package pgtest

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
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Shared is one cluster for a whole test package, each test working in a
// database of its own (NewDatabase). Under -short there is none, and its
// methods skip the test.
type Shared struct {
	Cluster *pgcluster.Cluster
	seq     atomic.Int64
}

// RunMain starts the package's cluster, runs its tests, stops the cluster,
// reports the skipped system tests and, when the tests passed, fails if
// goroutines are left running. A package's TestMain is
// os.Exit(sh.RunMain(m)).
func (sh *Shared) RunMain(m *testing.M) int {
	c, stop := StartMain(pgcluster.Options{})
	sh.Cluster = c
	code := m.Run()
	stop()
	testutil.ReportSkips()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goroutines left running:", err)
			code = 1
		}
	}
	return code
}

var nonName = regexp.MustCompile(`[^A-Za-z0-9]+`)

// NewDatabase creates an empty database named after the test.
func (sh *Shared) NewDatabase(t *testing.T) string {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL")
	name := strings.ToLower(nonName.ReplaceAllString(t.Name(), "_"))
	if len(name) > 50 {
		name = name[:50]
	}
	name = fmt.Sprintf("%s_%d", name, sh.seq.Add(1))
	if err := sh.Cluster.CreateDatabase(t.Context(), name); err != nil {
		t.Fatal(err)
	}
	return name
}

// Connect connects to db as the superuser, or as user when given; the
// connection is closed when the test ends.
func (sh *Shared) Connect(t *testing.T, db string, user ...string) *pgx.Conn {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL")
	dsn := sh.Cluster.SuperuserDSN(db)
	if len(user) > 0 {
		dsn = sh.Cluster.DSN(user[0], "", db)
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

// Exec runs sql (one or more statements) on conn, failing the test on an
// error.
func Exec(t *testing.T, conn *pgx.Conn, sql string) {
	t.Helper()
	if _, err := conn.Exec(t.Context(), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}
