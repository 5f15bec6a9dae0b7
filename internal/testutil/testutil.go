// Package testutil holds the small helpers the test suites of several
// packages share: a per-step context, SQLSTATE checks, a query of texts, a
// bounded receive and a buffer safe for concurrent use.
package testutil

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

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
