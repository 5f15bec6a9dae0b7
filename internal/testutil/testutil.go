// Package testutil holds the small helpers the test suites of several
// packages share: the -short lane's skip of system tests, a per-step
// context, SQLSTATE checks, a query of texts, a bounded receive and a
// buffer safe for concurrent use.
package testutil

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A system test needs what the test run starts or runs itself: PostgreSQL,
// etcd, Redis, PgBouncer, psql or valgrind. Under -short (the fast lane,
// docs/lanes.md) each skips through SkipSystem, and the package's TestMain
// reports how many did (ReportSkips). Without -short nothing skips: a
// missing server fails the test, so a run without one cannot pass by
// accident.

var systemSkips atomic.Int64

// Short reports whether the tests run with -short. Unlike testing.Short it
// may be called from TestMain before m.Run: it parses the flags first.
func Short() bool {
	if !flag.Parsed() {
		flag.Parse()
	}
	return testing.Short()
}

// SkipSystem skips t under -short, counting it: t needs needs (say,
// "PostgreSQL"). Call it before starting or using the server.
func SkipSystem(t testing.TB, needs string) {
	t.Helper()
	if testing.Short() {
		systemSkips.Add(1)
		t.Skipf("system test (needs %s): skipped under -short", needs)
	}
}

// ReportSkips prints, under -short, how many system tests SkipSystem has
// skipped in this test binary. Call it from TestMain after m.Run.
func ReportSkips() {
	if Short() {
		fmt.Fprintf(os.Stdout, "skipped %d system tests (-short)\n", systemSkips.Load())
	}
}

// Run runs the tests with m.Run, then ReportSkips, and returns m.Run's
// code: TestMain's body in a package that needs nothing else,
// os.Exit(testutil.Run(m)).
func Run(m *testing.M) int {
	code := m.Run()
	ReportSkips()
	return code
}

// StepTimeout bounds one step of a test (a query, a connect).
const StepTimeout = 30 * time.Second

// Ctx returns a context for one step of a test, cancelled at its end or
// after StepTimeout.
func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), StepTimeout)
	t.Cleanup(cancel)
	return ctx
}

// SQLState returns the SQLSTATE of the PostgreSQL error in err's chain, or
// "".
func SQLState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// WantSQLState fails the test unless err carries SQLSTATE code.
func WantSQLState(t testing.TB, err error, code string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want SQLSTATE %s", code)
	}
	if got := SQLState(err); got != code {
		t.Fatalf("got error %v (SQLSTATE %q), want SQLSTATE %s", err, got, code)
	}
}

// QueryStrings runs sql on conn, each of whose rows is one text, and
// returns the texts.
func QueryStrings(t testing.TB, conn *pgx.Conn, sql string) []string {
	t.Helper()
	rows, err := conn.Query(Ctx(t), sql)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// SyncBuffer is a bytes.Buffer that a writer goroutine (a child process's
// output copier, a log writer) and the test can use at the same time.
type SyncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *SyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *SyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Recv returns the next value from ch. If none comes within timeout the
// test fails at once, saying that what did not happen.
func Recv[T any](t testing.TB, ch <-chan T, timeout time.Duration, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(timeout):
		t.Fatalf("%s within %v", what, timeout)
		panic("unreachable")
	}
}
