package fencing_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestHoldDropped: fenceproxy.hold dropped while the proxy runs. The
// lock-fenced write that calls it fails with nothing of it written, the
// database is checked again, and registrations go back to
// fenceproxy.register, which still refuses a stale holder. In both
// protocols: a simple Query's registration is spliced in front of it, a
// prepared statement's is sent before its Bind.
func TestHoldDropped(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, _ := startChecker(t, lockRules)
	e := startLockEnvWith(t, policy.Options{Checks: checker})
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			db := newLockDB(t, true)
			d := direct(t, db)
			c := e.holder(t, db, "L", 7, mode)
			var pid int
			if err := c.QueryRow(ctxT(t), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				t.Fatal(err)
			}
			const write = "UPDATE jobs SET state = state || 'x' WHERE id = 1"
			mustExec(t, c, write)
			if q := pid2query(t, d, pid); mode == pgx.QueryExecModeSimpleProtocol && !strings.Contains(q, "CALL fenceproxy.hold(") {
				t.Fatalf("sent %s; want the registration calling fenceproxy.hold", q)
			}
			mustExec(t, d, "DROP PROCEDURE fenceproxy.hold(text, text, boolean, boolean, text, text)")

			written, refused := 1, 0
			deadline := time.Now().Add(20 * time.Second)
			for {
				_, err := c.Exec(ctxT(t), write)
				if err == nil {
					written++
					break
				}
				var pe *pgconn.PgError
				if !errors.As(err, &pe) || pe.Code != "42883" || !strings.Contains(pe.Message, "fenceproxy.hold was removed") {
					t.Fatalf("after the drop: %v, want 42883 saying fenceproxy.hold was removed", err)
				}
				refused++
				if time.Now().After(deadline) {
					t.Fatalf("writes still fail after the recheck: %v", err)
				}
				time.Sleep(100 * time.Millisecond)
			}
			// The proxy learns of the drop from the failed call (this
			// database has no catalog watch to tell it sooner): the first
			// write after it is refused.
			if refused == 0 {
				t.Errorf("no write was refused after the drop")
			}
			if q := pid2query(t, d, pid); mode == pgx.QueryExecModeSimpleProtocol && !strings.Contains(q, "CALL fenceproxy.register(") {
				t.Errorf("after the recheck, sent %s; want the registration calling fenceproxy.register", q)
			}

			// A newer holder registers; the older one is refused, through
			// register now, and writes nothing.
			mustExec(t, e.holder(t, db, "L", 8, mode), "SELECT state FROM jobs WHERE id = 1")
			var pe *pgconn.PgError
			if _, err := c.Exec(ctxT(t), write); !errors.As(err, &pe) || pe.Code != "FP001" {
				t.Errorf("stale holder after the drop: %v, want FP001", err)
			}
			var state string
			if err := d.QueryRow(ctxT(t), "SELECT state FROM jobs WHERE id = 1").Scan(&state); err != nil || state != "queued"+strings.Repeat("x", written) {
				t.Errorf("jobs row: %q, %v; want %d writes", state, err, written)
			}
		})
	}
}
