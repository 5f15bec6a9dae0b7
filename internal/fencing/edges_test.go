package fencing_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// testEdges probes the corners of docs/rewrite.md through the proxy: spellings
// of the fence column and of the table name, refusals the doc promises,
// conditional branches that do not write, a token set inside a
// multi-statement string, and plans the server may cache.
func testEdges(t *testing.T, e *env) {
	db := e.newDB(t)
	d := direct(t, db)

	t.Run("fence-column-spellings", func(t *testing.T) {
		resetTable(t, d, tError)
		c := e.connect(t, db)
		ctx := ctxT(t)
		setTokenN(t, c, 42)
		for _, sql := range []string{
			"UPDATE acct SET LAST_FENCE = 99, n = n + 1 WHERE id = 1",
			`UPDATE acct SET "last_fence" = 99, n = n + 1 WHERE id = 1`,
			"UPDATE acct SET (Last_Fence, n) = (99, n + 1) WHERE id = 1",
		} {
			if _, err := c.Exec(ctx, sql); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
		wantRow(t, d, tError, 1, 3, 42)
		for _, sql := range []string{
			"INSERT INTO acct (id, LAST_FENCE) VALUES (50, 99)",
			`INSERT INTO acct (id, "last_fence") VALUES (51, 99)`,
			"INSERT INTO acct (id, last_fence) SELECT id + 200, 99 FROM src",
			"INSERT INTO acct (last_fence, id) SELECT 99, 52",
		} {
			if _, err := c.Exec(ctx, sql); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
		for id, r := range snapshot(t, d, tError) {
			if r.Fence != 42 && id != 2 && id != 3 {
				t.Errorf("row %d = %+v, want fence 42", id, r)
			}
		}
		// Forms the doc refuses rather than guess.
		before := snapshot(t, d, tError)
		for _, sql := range []string{
			"UPDATE acct SET (n, last_fence) = (SELECT 1, 99) WHERE id = 1",
			"INSERT INTO acct (id, last_fence) SELECT 60, 99 UNION ALL SELECT 61, 99",
		} {
			_, err := c.Exec(ctx, sql)
			wantCode(t, err, "FP003")
		}
		wantUnchanged(t, d, tError, before)
	})

	t.Run("table-name-spellings", func(t *testing.T) {
		resetTable(t, d, tError)
		before := snapshot(t, d, tError)
		c := e.connect(t, db) // no token: a fenced write is refused with FP002
		for _, sql := range []string{
			`UPDATE U&"acc\0074" SET n = n + 1 WHERE id = 1`,
			`UPDATE U&"\0061cct" SET n = n + 1 WHERE id = 1`,
			`UPDATE U&"!0061cct" UESCAPE '!' SET n = n + 1 WHERE id = 1`,
			"UPDATE " + db + ".public.acct SET n = n + 1 WHERE id = 1",
			"UPDATE/**/acct/**/SET n = n + 1 WHERE id = 1",
			"UPDATE\n\tacct\nSET n = n + 1 WHERE id = 1",
		} {
			_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
			if code := sqlState(err); code != "FP002" {
				t.Errorf("%s: %v (SQLSTATE %q), want FP002", sql, err, code)
			}
		}
		wantUnchanged(t, d, tError, before)
	})

	t.Run("self-join", func(t *testing.T) {
		// The fence check applies to the target row (alias a), not to the
		// row the statement only reads (alias b) from the same table.
		c := e.connect(t, db)
		ctx := ctxT(t)
		setTokenN(t, c, 41)
		for _, sql := range []string{
			"UPDATE acct a SET n = b.n + 1 FROM acct b WHERE b.id = 2 AND a.id = 1",
			"DELETE FROM acct a USING acct b WHERE b.id = 2 AND a.id = 1",
			"MERGE INTO acct a USING acct b ON b.id = 2 AND a.id = 1 WHEN MATCHED THEN UPDATE SET n = b.n + 1",
		} {
			// Target stale, source newer: refused.
			resetTable(t, d, tError)
			setFences(t, d, tError, map[int64]int64{1: 42})
			before := snapshot(t, d, tError)
			_, err := c.Exec(ctx, sql)
			wantCode(t, err, "FP001")
			wantUnchanged(t, d, tError, before)
			// Target fresh, source newer than the token: accepted.
			resetTable(t, d, tError)
			setFences(t, d, tError, map[int64]int64{2: 42})
			if n, err := execRows(ctx, c, sql); err != nil || n != 1 {
				t.Fatalf("%s: %d rows, %v", sql, n, err)
			}
			if r, ok := snapshot(t, d, tError)[1]; ok && r.Fence != 41 {
				t.Errorf("%s: row 1 = %+v, want fence 41", sql, r)
			}
		}
	})

	t.Run("merge-insert-default-values", func(t *testing.T) {
		resetTable(t, d, tError)
		c := e.connect(t, db)
		setTokenN(t, c, 42)
		if n, err := execRows(ctxT(t), c, "MERGE INTO acct t USING (SELECT 600 AS id) s ON t.id = s.id WHEN NOT MATCHED THEN INSERT DEFAULT VALUES"); err != nil || n != 1 {
			t.Fatalf("%d rows, %v", n, err)
		}
		for id, r := range snapshot(t, d, tError) {
			if id > 3 && r.Fence != 42 {
				t.Errorf("new row %+v, want fence 42", r)
			}
		}
	})

	t.Run("code-that-writes-later", func(t *testing.T) {
		// Bodies the proxy cannot fence are refused when they mention a
		// protected table (doc: Refusals).
		c := e.connect(t, db)
		setTokenN(t, c, 42)
		for _, sql := range []string{
			"DO $$ BEGIN UPDATE acct SET n = 99; END $$",
			"CREATE FUNCTION bump() RETURNS void LANGUAGE sql AS $$ UPDATE acct SET n = 99 $$",
			"CREATE RULE r AS ON INSERT TO src DO ALSO UPDATE acct SET n = 99",
		} {
			_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
			wantCode(t, err, "FP003")
		}
		var n int
		if err := d.QueryRow(ctxT(t), "SELECT count(*) FROM acct WHERE n = 99").Scan(&n); err != nil || n != 0 {
			t.Errorf("%d rows written by refused code (%v)", n, err)
		}
	})

	t.Run("copy-from-server-side", func(t *testing.T) {
		c := e.connect(t, db)
		setTokenN(t, c, 42)
		for _, sql := range []string{
			"COPY acct FROM '/nonexistent/fenceproxy-test'",
			"COPY acct (id) FROM PROGRAM 'echo 99'",
		} {
			_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
			wantCode(t, err, "FP003")
		}
	})

	t.Run("branches-that-do-not-write", func(t *testing.T) {
		// Row 1 at fence 42, token 41: statements whose conditions keep
		// them from writing row 1 must not fail.
		resetTable(t, d, tError)
		setFences(t, d, tError, map[int64]int64{1: 42})
		before := snapshot(t, d, tError)
		c := e.connect(t, db)
		ctx := ctxT(t)
		setTokenN(t, c, 41)
		for _, sql := range []string{
			"INSERT INTO acct (id) VALUES (1) ON CONFLICT (id) DO UPDATE SET n = 5 WHERE acct.n > 100",
			"MERGE INTO acct t USING (SELECT 1 AS id) s ON t.id = s.id WHEN MATCHED AND t.n > 100 THEN UPDATE SET n = 5",
			"MERGE INTO acct t USING (SELECT 1 AS id) s ON t.id = s.id WHEN MATCHED AND t.n > 100 THEN DELETE",
			"MERGE INTO acct t USING (SELECT 1 AS id) s ON t.id = s.id WHEN MATCHED THEN DO NOTHING",
			"UPDATE acct SET n = 5 WHERE id = 1 AND false",
			"DELETE FROM acct WHERE id = 1 AND n > 100",
		} {
			if n, err := execRows(ctx, c, sql); err != nil || n != 0 {
				t.Errorf("%s: %d rows, %v; want 0 rows, no error", sql, n, err)
			}
		}
		wantUnchanged(t, d, tError, before)
	})

	t.Run("token-set-in-the-same-string", func(t *testing.T) {
		// The token is read when each statement runs, so a SET earlier
		// in the same simple-query string applies.
		resetTable(t, d, tError)
		setFences(t, d, tError, map[int64]int64{1: 42})
		before := snapshot(t, d, tError)
		c := e.connect(t, db)
		ctx := ctxT(t)
		_, err := c.PgConn().Exec(ctx, "SET fence.token = '41'; UPDATE acct SET n = n + 1 WHERE id = 1").ReadAll()
		wantCode(t, err, "FP001")
		wantUnchanged(t, d, tError, before)
		if _, err := c.PgConn().Exec(ctx, "SET fence.token = '42'; UPDATE acct SET n = n + 1 WHERE id = 1; SET fence.token = '41'").ReadAll(); err != nil {
			t.Fatal(err)
		}
		wantRow(t, d, tError, 1, 1, 42)
		_, err = c.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1")
		wantCode(t, err, "FP001")
	})

	t.Run("where-current-of-without-token", func(t *testing.T) {
		resetTable(t, d, tError)
		before := snapshot(t, d, tError)
		c := e.connect(t, db)
		_, err := c.PgConn().Exec(ctxT(t), "BEGIN; DECLARE cur CURSOR FOR SELECT id FROM acct WHERE id = 1 FOR UPDATE; FETCH cur; UPDATE acct SET n = n + 1 WHERE CURRENT OF cur; COMMIT").ReadAll()
		wantCode(t, err, "FP002")
		if _, err := c.PgConn().Exec(ctxT(t), "ROLLBACK").ReadAll(); err != nil {
			t.Fatal(err)
		}
		wantUnchanged(t, d, tError, before)
		// DELETE ... WHERE CURRENT OF is refused (doc: Refusals).
		_, err = c.PgConn().Exec(ctxT(t), "BEGIN; DECLARE cur CURSOR FOR SELECT id FROM acct WHERE id = 1 FOR UPDATE; FETCH cur; DELETE FROM acct WHERE CURRENT OF cur; COMMIT").ReadAll()
		wantCode(t, err, "FP003")
		if _, err := c.PgConn().Exec(ctxT(t), "ROLLBACK").ReadAll(); err != nil {
			t.Fatal(err)
		}
		wantUnchanged(t, d, tError, before)
	})

	t.Run("cached-plans", func(t *testing.T) {
		// A server-side prepared statement run many times, with generic
		// and custom plans: each execution reads the token anew.
		for _, mode := range []string{"force_generic_plan", "force_custom_plan", "auto"} {
			t.Run(mode, func(t *testing.T) {
				for _, table := range []string{tError, tSkip} {
					resetTable(t, d, table)
					c := e.connect(t, db)
					ctx := ctxT(t)
					if _, err := c.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
						t.Fatal(err)
					}
					upd, del := "upd_"+table, "del_"+table
					if _, err := c.Prepare(ctx, upd, "UPDATE "+table+" SET n = n + 1 WHERE id = $1"); err != nil {
						t.Fatal(err)
					}
					if _, err := c.Prepare(ctx, del, "DELETE FROM "+table+" WHERE id = $1"); err != nil {
						t.Fatal(err)
					}
					for i := range 8 {
						setTokenN(t, c, int64(42+i))
						if n, err := execRows(ctx, c, upd, int64(1)); err != nil || n != 1 {
							t.Fatalf("%s with %d: %d rows, %v", upd, 42+i, n, err)
						}
						before := snapshot(t, d, table)
						setTokenN(t, c, 41)
						n, err := execRows(ctx, c, upd, int64(1))
						if table == tSkip {
							if err != nil || n != 0 {
								t.Fatalf("stale %s: %d rows, %v", upd, n, err)
							}
						} else {
							wantCode(t, err, "FP001")
						}
						n, err = execRows(ctx, c, del, int64(1))
						if table == tSkip {
							if err != nil || n != 0 {
								t.Fatalf("stale %s: %d rows, %v", del, n, err)
							}
						} else {
							wantCode(t, err, "FP001")
						}
						setToken(t, c, "abc")
						_, err = execRows(ctx, c, upd, int64(1))
						wantCode(t, err, "FP002")
						_, err = execRows(ctx, c, del, int64(1))
						wantCode(t, err, "FP002")
						wantUnchanged(t, d, table, before)
					}
					wantRow(t, d, table, 1, 8, 49)
				}
			})
		}
	})

	t.Run("long-token", func(t *testing.T) {
		resetTable(t, d, tError)
		c := e.connect(t, db)
		setToken(t, c, strings.Repeat("1", 10000))
		_, err := c.Exec(ctxT(t), "UPDATE acct SET n = n + 1 WHERE id = 1")
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "FP002" || len(pgErr.Detail) > 200 {
			t.Errorf("a 10000-digit token: %v (detail %d bytes)", err, len(pgErr.Detail))
		}
	})

	t.Run("explain-without-analyze", func(t *testing.T) {
		// Plain EXPLAIN plans the rewritten statement without running it:
		// no write, and no raw 22P02 from the planner, whatever the token.
		resetTable(t, d, tSkip)
		resetTable(t, d, tError)
		c := e.connect(t, db, func(cfg *pgx.ConnConfig) { cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol })
		for _, tok := range []string{"", "abc", "41"} {
			setToken(t, c, tok)
			for _, sql := range []string{
				"EXPLAIN UPDATE acct SET n = n + 1 WHERE id = 1",
				"EXPLAIN DELETE FROM acct WHERE last_fence < 50",
				"EXPLAIN UPDATE acct_skip SET n = n + 1 WHERE last_fence < 50",
				"EXPLAIN DELETE FROM acct_skip WHERE id = 1",
			} {
				if _, err := c.Exec(ctxT(t), sql); err != nil && !strings.HasPrefix(sqlState(err), "FP") {
					t.Errorf("token %q: %s: %v", tok, sql, err)
				}
			}
		}
	})
}
