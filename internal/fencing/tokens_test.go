package fencing_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// testTokens covers the ways a client sets fence.token (docs/design.md, "The proxy") and
// what happens without a valid one: the token is read on the server at
// execution time, so PostgreSQL's own SET / SET LOCAL / RESET / rollback
// semantics apply.
func testTokens(t *testing.T, e *env) {
	db := e.newDB(t)
	d := direct(t, db)

	// update writes row 1 of acct through c.
	update := func(t *testing.T, c *pgx.Conn) error {
		t.Helper()
		_, err := c.Exec(ctxT(t), "UPDATE acct SET n = n + 1 WHERE id = 1")
		return err
	}
	// fresh resets acct with row 1 at fence 10 (so that an accepted write
	// shows the token the server read: the row then carries it).
	fresh := func(t *testing.T) rowSet {
		t.Helper()
		resetTable(t, d, tError)
		setFences(t, d, tError, map[int64]int64{1: 10})
		return snapshot(t, d, tError)
	}
	// accepted writes row 1 and checks that it now has n and fence 42.
	accepted := func(t *testing.T, c *pgx.Conn, n int32) {
		t.Helper()
		if err := update(t, c); err != nil {
			t.Fatalf("write: %v", err)
		}
		wantRow(t, d, tError, 1, n, 42)
	}
	refused := func(t *testing.T, c *pgx.Conn, code string, before rowSet) {
		t.Helper()
		wantCode(t, update(t, c), code)
		wantUnchanged(t, d, tError, before)
	}
	exec := func(t *testing.T, c *pgx.Conn, sql string) {
		t.Helper()
		if _, err := c.PgConn().Exec(ctxT(t), sql).ReadAll(); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}

	t.Run("never-set", func(t *testing.T) {
		before := fresh(t)
		c := e.connect(t, db)
		refused(t, c, "FP002", before)
		err := update(t, c)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || !strings.Contains(pgErr.Detail, "not set") {
			t.Errorf("error for an unset token: %+v", pgErr)
		}
	})

	t.Run("SET", func(t *testing.T) {
		for _, sql := range []string{
			"SET fence.token = '42'",
			"SET fence.token = 42",
			"SET fence.token TO '42'",
			"SET SESSION fence.token = '42'",
			`SET "fence"."token" = '42'`,
			"SET FENCE.TOKEN = '42'",
			"SET fence.token = '0042'",
		} {
			fresh(t)
			c := e.connect(t, db)
			exec(t, c, sql)
			accepted(t, c, 1)
		}
	})

	t.Run("SET-LOCAL", func(t *testing.T) {
		fresh(t)
		c := e.connect(t, db)
		exec(t, c, "BEGIN")
		exec(t, c, "SET LOCAL fence.token = '42'")
		if err := update(t, c); err != nil {
			t.Fatal(err)
		}
		exec(t, c, "COMMIT")
		wantRow(t, d, tError, 1, 1, 42)
		// After COMMIT the setting is gone (it reads as '').
		before := snapshot(t, d, tError)
		refused(t, c, "FP002", before)

		// SET LOCAL overrides the session's token for one transaction.
		setTokenN(t, c, 41)
		refused(t, c, "FP001", before)
		exec(t, c, "BEGIN; SET LOCAL fence.token = '42'")
		if err := update(t, c); err != nil {
			t.Fatal(err)
		}
		exec(t, c, "COMMIT")
		wantRow(t, d, tError, 1, 2, 42)
		before = snapshot(t, d, tError)
		refused(t, c, "FP001", before)
	})

	t.Run("set_config", func(t *testing.T) {
		fresh(t)
		c := e.connect(t, db)
		ctx := ctxT(t)
		if _, err := c.Exec(ctx, "SELECT set_config('fence.token', '42', false)"); err != nil {
			t.Fatal(err)
		}
		accepted(t, c, 1)
		accepted(t, c, 2) // the session keeps it

		// is_local: only for the transaction.
		fresh(t)
		c = e.connect(t, db)
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT set_config('fence.token', $1, true)", "42"); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		wantRow(t, d, tError, 1, 1, 42)
		before := snapshot(t, d, tError)
		refused(t, c, "FP002", before)

		// is_local outside a transaction block lasts for its own implicit
		// transaction only.
		if _, err := c.Exec(ctx, "SELECT set_config('fence.token', '42', true)"); err != nil {
			t.Fatal(err)
		}
		refused(t, c, "FP002", before)
		// ...unless in the same simple-query string (one implicit
		// transaction).
		exec(t, c, "SELECT set_config('fence.token', '42', true); UPDATE acct SET n = n + 1 WHERE id = 1")
		wantRow(t, d, tError, 1, 2, 42)
	})

	t.Run("startup-options", func(t *testing.T) {
		// RuntimeParams, sent in the StartupMessage.
		fresh(t)
		c := e.connect(t, db, func(cfg *pgx.ConnConfig) {
			cfg.RuntimeParams["options"] = "-c fence.token=42"
		})
		accepted(t, c, 1)
		// The options parameter of a URL.
		fresh(t)
		u := e.proxy.URL("postgres", "", db)
		u.RawQuery = "sslmode=disable&options=-c%20fence.token%3D42"
		c = connectDSN(t, u.String())
		accepted(t, c, 1)
		// A stale one.
		fresh(t)
		setFences(t, d, tError, map[int64]int64{1: 42})
		before := snapshot(t, d, tError)
		c = e.connect(t, db, func(cfg *pgx.ConnConfig) {
			cfg.RuntimeParams["options"] = "-c fence.token=41"
		})
		refused(t, c, "FP001", before)
		// lib/pq, keyword/value DSN.
		fresh(t)
		pq := pinnedPQ(t, "host="+e.proxy.Host()+" port="+itoa(e.proxy.Port())+" user=postgres dbname="+db+" sslmode=disable options='-c fence.token=42'")
		if _, err := pq.ExecContext(ctxT(t), "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		wantRow(t, d, tError, 1, 1, 42)
	})

	t.Run("ALTER-ROLE-SET", func(t *testing.T) {
		fresh(t)
		ctx := ctxT(t)
		role := "fence_role_" + db
		if _, err := d.Exec(ctx, "CREATE ROLE "+role+" LOGIN; "); err != nil {
			t.Fatal(err)
		}
		for _, sql := range []string{
			"GRANT SELECT, UPDATE ON acct TO " + role,
			"ALTER ROLE " + role + " SET fence.token = '42'",
		} {
			if _, err := d.Exec(ctx, sql); err != nil {
				t.Fatal(err)
			}
		}
		c := connectDSN(t, e.proxy.DSN(role, "", db))
		accepted(t, c, 1)
	})

	t.Run("RESET", func(t *testing.T) {
		before := fresh(t)
		// The simple protocol: DISCARD ALL drops pgx's cached statements.
		c := e.connect(t, db, func(cfg *pgx.ConnConfig) { cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol })
		setTokenN(t, c, 42)
		exec(t, c, "RESET fence.token")
		refused(t, c, "FP002", before)
		setTokenN(t, c, 42)
		exec(t, c, "RESET ALL")
		refused(t, c, "FP002", before)
		setTokenN(t, c, 42)
		exec(t, c, "DISCARD ALL")
		refused(t, c, "FP002", before)
		setTokenN(t, c, 42)
		exec(t, c, "SET fence.token TO DEFAULT")
		refused(t, c, "FP002", before)
	})

	t.Run("rollback-restores", func(t *testing.T) {
		fresh(t)
		c := e.connect(t, db)
		setTokenN(t, c, 42)
		exec(t, c, "BEGIN; SET fence.token = '41'; ROLLBACK")
		accepted(t, c, 1)
	})

	t.Run("changed-mid-transaction", func(t *testing.T) {
		resetTable(t, d, tError)
		before := snapshot(t, d, tError)
		c := e.connect(t, db)
		ctx := ctxT(t)
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SET fence.token = '42'"); err != nil {
			t.Fatal(err)
		}
		if n, err := execRows(ctx, tx.Conn(), "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil || n != 1 {
			t.Fatalf("write with 42: %d rows, %v", n, err)
		}
		if _, err := tx.Exec(ctx, "SET fence.token = '41'"); err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1")
		wantCode(t, err, "FP001")
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		wantUnchanged(t, d, tError, before)
	})

	t.Run("invalid", func(t *testing.T) {
		c := e.connect(t, db)
		ctx := ctxT(t)
		for _, tok := range []string{
			"", "0", "00", "-1", "-42", "+42", "abc", "1.5", "42.0", " 42", "42 ", "42\n", "4_2", "0x2a", "1e3",
			"٤٢", // Arabic-Indic digits
			"9223372036854775808", "99999999999999999999", "18446744073709551616",
		} {
			before := fresh(t)
			setToken(t, c, tok)
			for _, sql := range []string{
				"UPDATE acct SET n = n + 1 WHERE id = 1",
				"UPDATE acct SET n = n + 1", // rows at fence 0 and 42
				"DELETE FROM acct WHERE id = 2",
				"INSERT INTO acct (id, payload) VALUES (9, 'x')",
				"INSERT INTO acct (id, payload) VALUES (1, 'x') ON CONFLICT (id) DO UPDATE SET n = 7",
				"MERGE INTO acct t USING src s ON t.id = s.id WHEN MATCHED THEN UPDATE SET n = 7",
			} {
				_, err := c.Exec(ctx, sql)
				if sqlState(err) != "FP002" {
					t.Errorf("token %q: %s: %v, want SQLSTATE FP002", tok, sql, err)
				}
			}
			wantUnchanged(t, d, tError, before)
		}
		// The bounds of the valid range.
		for tok, want := range map[string]int64{
			"1":                      1,
			"9223372036854775807":    9223372036854775807,
			"0009223372036854775807": 9223372036854775807,
		} {
			resetTable(t, d, tError)
			setToken(t, c, tok)
			if _, err := c.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
				t.Errorf("token %q: %v", tok, err)
			}
			if r := snapshot(t, d, tError)[1]; r.N != 1 || r.Fence != want {
				t.Errorf("token %q: row 1 = %+v, want n 1 fence %d", tok, r, want)
			}
		}
	})

	t.Run("missing-token-allow", func(t *testing.T) {
		resetTable(t, d, tAllow)
		setFences(t, d, tAllow, map[int64]int64{2: 42})
		c := e.connect(t, db)
		ctx := ctxT(t)
		// No token: the write goes through unfenced; the fence column is
		// left alone (new rows get 0).
		for _, sql := range []string{
			"UPDATE acct_allow SET n = n + 1 WHERE id IN (1, 2)",
			"INSERT INTO acct_allow (id, payload, last_fence) VALUES (9, 'x', 77)",
			"DELETE FROM acct_allow WHERE id = 3",
		} {
			if _, err := c.Exec(ctx, sql); err != nil {
				t.Fatalf("%s without a token: %v", sql, err)
			}
		}
		got := snapshot(t, d, tAllow)
		want := rowSet{
			1: {1, "a", 1, 0},
			2: {2, "b", 1, 42},
			9: {9, "x", 0, 0},
		}
		if !got.equal(want) {
			t.Errorf("after unfenced writes: %v, want %v", got, want)
		}
		// An invalid token is treated as none.
		setToken(t, c, "abc")
		if _, err := c.Exec(ctx, "UPDATE acct_allow SET n = n + 1 WHERE id = 2"); err != nil {
			t.Fatal(err)
		}
		// A valid token is still enforced.
		setTokenN(t, c, 41)
		before := snapshot(t, d, tAllow)
		_, err := c.Exec(ctx, "UPDATE acct_allow SET n = n + 1 WHERE id = 2")
		wantCode(t, err, "FP001")
		wantUnchanged(t, d, tAllow, before)
		setTokenN(t, c, 43)
		if _, err := c.Exec(ctx, "UPDATE acct_allow SET n = n + 1 WHERE id = 2"); err != nil {
			t.Fatal(err)
		}
		if r := snapshot(t, d, tAllow)[2]; r.N != 3 || r.Fence != 43 {
			t.Errorf("row 2 = %+v, want n 3 fence 43", r)
		}
	})

	t.Run("injection", func(t *testing.T) {
		before := fresh(t)
		c := e.connect(t, db)
		ctx := ctxT(t)
		for _, tok := range []string{
			"42'; DROP TABLE acct; --",
			"42')::bigint; DROP TABLE acct; --",
			`42\'; DROP TABLE acct; --`,
			"42$$; DROP TABLE acct; --",
			"42\x00",
		} {
			_, err := c.Exec(ctx, "SELECT set_config('fence.token', $1, false)", tok)
			if strings.ContainsRune(tok, 0) {
				if err == nil {
					t.Errorf("set_config with a NUL byte succeeded")
				}
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			for _, sql := range []string{
				"UPDATE acct SET n = n + 1 WHERE id = 1",
				"INSERT INTO acct (id) VALUES (9)",
				"DELETE FROM acct WHERE id = 1",
			} {
				_, err := c.Exec(ctx, sql)
				wantCode(t, err, "FP002")
				var pgErr *pgconn.PgError
				if errors.As(err, &pgErr) && !strings.Contains(pgErr.Detail, "DROP TABLE") {
					t.Errorf("token %q: detail %q does not show the value", tok, pgErr.Detail)
				}
			}
		}
		// The same through SET with a dollar-quoted value, simple protocol.
		exec(t, c, "SET fence.token = $$42'; DROP TABLE acct; --$$")
		_, err := c.PgConn().Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1").ReadAll()
		wantCode(t, err, "FP002")
		if !tableExists(t, d, tError) {
			t.Fatal("acct was dropped")
		}
		wantUnchanged(t, d, tError, before)
	})
}
