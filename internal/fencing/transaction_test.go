package fencing_test

import (
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
)

// testTransaction: a stale write aborts its transaction, so nothing the
// transaction wrote before it commits (on_stale: error). With on_stale:
// skip the stale statement writes nothing and the rest commits.
func testTransaction(t *testing.T, e *env) {
	db := e.newDB(t)
	d := direct(t, db)

	t.Run("error-aborts", func(t *testing.T) {
		resetTable(t, d, tError)
		setFences(t, d, tError, map[int64]int64{2: 50})
		before := snapshot(t, d, tError)
		c := e.connect(t, db)
		ctx := ctxT(t)
		setTokenN(t, c, 42)
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n, err := execRows(ctx, tx.Conn(), "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil || n != 1 {
			t.Fatalf("UPDATE row 1 (fence 0) with 42: %d rows, %v", n, err)
		}
		_, err = tx.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 2")
		wantCode(t, err, "FP001")
		_, err = tx.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 3")
		wantCode(t, err, "25P02")
		// COMMIT of an aborted transaction rolls it back.
		if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
			t.Fatalf("COMMIT: %v, want %v", err, pgx.ErrTxCommitRollback)
		}
		wantUnchanged(t, d, tError, before)
		selectOne(t, c)
	})

	t.Run("error-aborts-simple-protocol", func(t *testing.T) {
		resetTable(t, d, tError)
		setFences(t, d, tError, map[int64]int64{2: 50})
		before := snapshot(t, d, tError)
		c := e.connect(t, db)
		ctx := ctxT(t)
		setTokenN(t, c, 42)
		_, err := c.PgConn().Exec(ctx, "BEGIN; UPDATE acct SET n = n + 1 WHERE id = 1; UPDATE acct SET n = n + 1 WHERE id = 2; COMMIT").ReadAll()
		wantCode(t, err, "FP001")
		// The failed string left the transaction open and aborted.
		if _, err := c.PgConn().Exec(ctx, "COMMIT").ReadAll(); err != nil {
			t.Fatal(err)
		}
		wantUnchanged(t, d, tError, before)
	})

	t.Run("savepoint", func(t *testing.T) {
		// Rolling back to a savepoint undoes the stale statement only:
		// PostgreSQL's own semantics, the proxy keeps no state.
		resetTable(t, d, tError)
		setFences(t, d, tError, map[int64]int64{2: 50})
		c := e.connect(t, db)
		ctx := ctxT(t)
		setTokenN(t, c, 42)
		_, err := c.PgConn().Exec(ctx, "BEGIN; UPDATE acct SET n = n + 1 WHERE id = 1; SAVEPOINT s").ReadAll()
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.PgConn().Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 2").ReadAll()
		wantCode(t, err, "FP001")
		if _, err := c.PgConn().Exec(ctx, "ROLLBACK TO SAVEPOINT s; COMMIT").ReadAll(); err != nil {
			t.Fatal(err)
		}
		wantRow(t, d, tError, 1, 1, 42)
		wantRow(t, d, tError, 2, 0, 50)
	})

	t.Run("skip-commits-the-rest", func(t *testing.T) {
		resetTable(t, d, tSkip)
		setFences(t, d, tSkip, map[int64]int64{2: 50})
		c := e.connect(t, db)
		ctx := ctxT(t)
		setTokenN(t, c, 42)
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n, err := execRows(ctx, tx.Conn(), "UPDATE acct_skip SET n = n + 1 WHERE id = 1"); err != nil || n != 1 {
			t.Fatalf("UPDATE row 1: %d rows, %v", n, err)
		}
		if n, err := execRows(ctx, tx.Conn(), "UPDATE acct_skip SET n = n + 1 WHERE id = 2"); err != nil || n != 0 {
			t.Fatalf("UPDATE stale row 2: %d rows, %v; want 0 rows", n, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		wantRow(t, d, tSkip, 1, 1, 42)
		wantRow(t, d, tSkip, 2, 0, 50)
	})
}
