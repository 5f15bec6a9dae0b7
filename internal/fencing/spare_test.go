package fencing_test

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestRegistrationOncePerTransaction: in an explicit transaction, the lock
// registration runs once for the session's lock and token, not before
// every statement: it holds its advisory lock until the transaction ends.
// A ROLLBACK TO SAVEPOINT (which may undo it) or a change of the token
// makes the next statement register again. Counted with track_functions.
func TestRegistrationOncePerTransaction(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	calls := func(t *testing.T, c *pgx.Conn) int64 {
		t.Helper()
		if _, err := c.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
			t.Fatal(err)
		}
		var n int64
		if err := c.QueryRow(ctx, "SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions WHERE schemaname = 'fenceproxy' AND funcname = 'register'").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for i, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
		c := e.holder(t, db, "spare"+mode.String(), 50, mode)
		upd := fmt.Sprintf("UPDATE acct SET n = n + 1 WHERE id = %d", i+1)
		mustExec(t, c, "SET track_functions = 'pl'")
		before := calls(t, c)
		mustExec(t, c, "BEGIN")
		for range 3 {
			if _, err := c.Exec(ctx, upd); err != nil {
				t.Fatal(err)
			}
		}
		mustExec(t, c, "SAVEPOINT s")
		if _, err := c.Exec(ctx, upd); err != nil {
			t.Fatal(err)
		}
		mustExec(t, c, "ROLLBACK TO SAVEPOINT s")
		if _, err := c.Exec(ctx, upd); err != nil { // registers again
			t.Fatal(err)
		}
		mustExec(t, c, "SET LOCAL fence.token = '51'")
		if _, err := c.Exec(ctx, upd); err != nil { // and again
			t.Fatal(err)
		}
		mustExec(t, c, "COMMIT")
		if got := calls(t, c) - before; got != 3 {
			t.Errorf("%v: %d registrations for 6 statements in one transaction, want 3 (first, after the rollback to the savepoint, after the token changed)", mode, got)
		}
		var n int32
		var fence int64
		if err := d.QueryRow(ctx, "SELECT n, last_fence FROM acct WHERE id = $1", i+1).Scan(&n, &fence); err != nil || fence != 51 || n != 5 {
			t.Errorf("%v: row n=%d fence=%d (%v)", mode, n, fence, err)
		}
		c.Close(ctx)
	}
}
