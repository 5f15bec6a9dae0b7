package fencing_test

import (
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestCatalogCheckInBand: a write in a database with the catalog watch is
// decided with the paths at hand and checks the stamp in its own
// transaction (fenceproxy.catalog_is). The stamp is moved on a direct
// connection, with no change of the paths and no notification: the
// session's next write is refused (FP003) and writes nothing, in the
// simple and the extended protocol (an unnamed statement, checked at its
// Bind), and in a REPEATABLE READ transaction whose snapshot is older
// than the move; its retry, decided once the database was checked again,
// writes. A fenced write, which has a lock registration, waits for a
// stamp read instead. A transaction's own DDL moves the stamp without
// refusing its own writes.
func TestCatalogCheckInBand(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, testRules)
	e := startPolicyEnv(t, policy.Options{Checks: checker}, specs)
	db := e.newDB(t)
	d := direct(t, db)
	c := e.connect(t, db)
	ctx := ctxT(t)
	setToken(t, c, "5")

	readV := func() int {
		t.Helper()
		var v int
		if err := d.QueryRow(ctx, "SELECT v FROM src WHERE id = 1").Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	readN := func() int {
		t.Helper()
		var n int
		if err := d.QueryRow(ctx, "SELECT n FROM acct WHERE id = 1").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	bump := func() { execDirect(t, d, "UPDATE fenceproxy.catalog SET stamp = stamp + 1") }
	// settle waits for the checks the refusal asked for: one that ran
	// after the next move would let the proxy decide with its stamp.
	settle := func(t *testing.T) {
		t.Helper()
		if err := checker.WaitFresh(ctx, db); err != nil {
			t.Fatal(err)
		}
	}

	for _, k := range []struct {
		name  string
		write func() error
		read  func() int
	}{
		{"simple", func() error {
			_, err := c.PgConn().Exec(ctx, "UPDATE src SET v = v + 1 WHERE id = 1").ReadAll()
			return err
		}, readV},
		{"extended", func() error {
			_, err := c.Exec(ctx, "UPDATE src SET v = v + 1 WHERE id = $1", pgx.QueryExecModeDescribeExec, 1)
			return err
		}, readV},
	} {
		t.Run(k.name, func(t *testing.T) {
			// Decided once with the stamp in force: it writes.
			before := k.read()
			if err := k.write(); err != nil {
				t.Fatalf("before the move: %v", err)
			}
			if got := k.read(); got != before+1 {
				t.Fatalf("before the move: %d, want %d", got, before+1)
			}
			bump()
			err := k.write()
			if !isCatalogCheck(err) {
				t.Fatalf("after the move: %v, want the catalog check's FP003", err)
			}
			if got := k.read(); got != before+1 {
				t.Fatalf("refused, yet written: %d, want %d", got, before+1)
			}
			if err := k.write(); err != nil {
				t.Fatalf("retry: %v", err)
			}
			if got := k.read(); got != before+2 {
				t.Fatalf("retry: %d, want %d", got, before+2)
			}
			settle(t)
		})
	}

	t.Run("fenced, with a lock registration", func(t *testing.T) {
		// The check runs just before the lock registration, in the
		// write's transaction: refused once, nothing written, and the
		// retry goes once the database was checked again.
		before := readN()
		bump()
		_, err := c.PgConn().Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1").ReadAll()
		if !isCatalogCheck(err) {
			t.Fatalf("after the move: %v, want the catalog check's FP003", err)
		}
		if got := readN(); got != before {
			t.Fatalf("refused, yet written: %d, want %d", got, before)
		}
		if _, err := c.PgConn().Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1").ReadAll(); err != nil {
			t.Fatalf("retry: %v", err)
		}
		if got := readN(); got != before+1 {
			t.Fatalf("retry: %d, want %d", got, before+1)
		}
		settle(t)
	})

	t.Run("repeatable read", func(t *testing.T) {
		// The transaction's snapshot is older than the move: the stamp
		// it reads is the old one, the catalog it plans with the new.
		write := func(move bool) error {
			tx, err := c.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, "SELECT 1 FROM src"); err != nil {
				return err
			}
			if move {
				bump()
			}
			if _, err := tx.Exec(ctx, "UPDATE src SET v = v + 1 WHERE id = 1"); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
		before := readV()
		if err := write(true); !isCatalogCheck(err) {
			t.Fatalf("after the move: %v, want the catalog check's FP003", err)
		}
		if got := readV(); got != before {
			t.Fatalf("refused, yet written: %d, want %d", got, before)
		}
		if err := write(false); err != nil {
			t.Fatalf("retry: %v", err)
		}
		if got := readV(); got != before+1 {
			t.Fatalf("retry: %d, want %d", got, before+1)
		}
		settle(t)
	})

	t.Run("own DDL", func(t *testing.T) {
		if _, err := c.PgConn().Exec(ctx, "BEGIN; CREATE TABLE made_here (id int)").ReadAll(); err != nil {
			t.Fatal(err)
		}
		for _, sql := range []string{"INSERT INTO made_here VALUES (1)", "UPDATE src SET v = v WHERE id = 1", "COMMIT"} {
			if _, err := c.Exec(ctx, sql); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
		var n int
		if err := d.QueryRow(ctx, "SELECT count(*) FROM made_here").Scan(&n); err != nil || n != 1 {
			t.Fatalf("made_here: %d rows, %v", n, err)
		}
	})
}
