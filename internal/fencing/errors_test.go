package fencing_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// testErrors checks what the client is told (docs/operating.md, "Errors"): FP001 names the
// table, the token and the stored watermark, with a Detail and a Hint; and
// only rows that the client's own WHERE selects can cause an error.
func testErrors(t *testing.T, e *env) {
	db := e.newDB(t)
	d := direct(t, db)

	t.Run("FP001-message", func(t *testing.T) {
		resetTable(t, d, tError)
		setFences(t, d, tError, map[int64]int64{1: 42})
		c := e.connect(t, db)
		setTokenN(t, c, 41)
		for _, sql := range []string{
			"UPDATE acct SET n = n + 1 WHERE id = 1",
			"DELETE FROM acct WHERE id = 1",
			"INSERT INTO acct (id) VALUES (1) ON CONFLICT (id) DO UPDATE SET n = 5",
			"MERGE INTO acct t USING (SELECT 1 AS id) s ON t.id = s.id WHEN MATCHED THEN UPDATE SET n = 5",
			"MERGE INTO acct t USING (SELECT 1 AS id) s ON t.id = s.id WHEN MATCHED THEN DELETE",
		} {
			_, err := c.Exec(ctxT(t), sql)
			pgErr := wantPgError(t, err, "FP001")
			const want = "fenceproxy: stale fencing token 41 for table public.acct (stored watermark 42)"
			if pgErr.Message != want {
				t.Errorf("%s: message %q, want %q", sql, pgErr.Message, want)
			}
			if pgErr.Detail == "" || pgErr.Hint == "" || pgErr.Severity != "ERROR" {
				t.Errorf("%s: severity %q, detail %q, hint %q; want ERROR with a detail and a hint", sql, pgErr.Severity, pgErr.Detail, pgErr.Hint)
			}
			if strings.Contains(pgErr.Message+pgErr.Detail+pgErr.Hint, "22P02") || strings.Contains(pgErr.Message, "invalid input syntax") {
				t.Errorf("%s: the raw server error leaked: %+v", sql, pgErr)
			}
		}
	})

	t.Run("FP002-message", func(t *testing.T) {
		c := e.connect(t, db)
		_, err := c.Exec(ctxT(t), `UPDATE "Config" SET n = 1`)
		pgErr := wantPgError(t, err, "FP002")
		if !strings.Contains(pgErr.Message, `public."Config"`) || !strings.Contains(pgErr.Message, "fence.token") || pgErr.Hint == "" || pgErr.Detail == "" {
			t.Errorf("FP002 arrived as %+v", pgErr)
		}
		setToken(t, c, "forty-two")
		_, err = c.Exec(ctxT(t), `UPDATE "Config" SET n = 1`)
		pgErr = wantPgError(t, err, "FP002")
		if !strings.Contains(pgErr.Detail, `"forty-two"`) {
			t.Errorf("FP002 for an invalid token arrived as %+v", pgErr)
		}
	})

	t.Run("FP003-message", func(t *testing.T) {
		c := e.connect(t, db)
		_, err := c.Exec(ctxT(t), "TRUNCATE acct_skip")
		pgErr := wantPgError(t, err, "FP003")
		if !strings.Contains(pgErr.Message, "public.acct_skip") {
			t.Errorf("FP003 arrived as %+v", pgErr)
		}
	})

	// Rows at fence 100 (id 1) and 1 (id 2), token 50: a statement whose
	// WHERE selects only row 2 succeeds, whatever plan the server picks.
	t.Run("unmatched-rows", func(t *testing.T) {
		c := e.connect(t, db)
		ctx := ctxT(t)
		setup := func(t *testing.T) {
			t.Helper()
			resetTable(t, d, tError)
			if _, err := d.Exec(ctx, "UPDATE acct SET payload = CASE id WHEN 1 THEN 'high' WHEN 2 THEN 'low' ELSE 'other' END, last_fence = CASE id WHEN 1 THEN 100 WHEN 2 THEN 1 ELSE 200 END"); err != nil {
				t.Fatal(err)
			}
			if _, err := d.Exec(ctx, "ANALYZE acct"); err != nil {
				t.Fatal(err)
			}
		}
		plans := []struct {
			name string
			set  string
		}{
			{"default", "RESET enable_seqscan; RESET enable_indexscan; RESET enable_bitmapscan"},
			{"seqscan", "SET enable_seqscan = on; SET enable_indexscan = off; SET enable_bitmapscan = off"},
			{"indexscan", "SET enable_seqscan = off; SET enable_indexscan = on; SET enable_bitmapscan = off"},
			{"bitmapscan", "SET enable_seqscan = off; SET enable_indexscan = off; SET enable_bitmapscan = on"},
		}
		updates := []string{
			"UPDATE acct SET n = n + 1 WHERE id = 2",
			"UPDATE acct SET n = n + 1 WHERE payload = 'low'",
			"UPDATE acct SET n = n + 1 WHERE last_fence < 50",
			"UPDATE acct SET n = n + 1 WHERE payload = 'low' AND n >= 0 AND id > 0 AND length(payload) = 3",
			"UPDATE acct SET n = n + 1 WHERE n >= 0 AND (id = 2 OR payload = 'nothing') AND last_fence <= 1",
			"UPDATE acct SET n = n + 1 WHERE id IN (SELECT id FROM src WHERE v = 20)",
			"UPDATE acct a SET n = a.n + 1 FROM src s WHERE s.id = a.id AND s.v = 20",
			"UPDATE acct SET n = n + 1 WHERE id = 2 AND random() >= 0",
			"UPDATE acct SET n = n + 1 WHERE id = 2 AND pg_sleep(0) IS NOT NULL",
			"MERGE INTO acct t USING src s ON t.id = s.id AND s.v = 20 WHEN MATCHED THEN UPDATE SET n = t.n + 1",
			"INSERT INTO acct (id) VALUES (2) ON CONFLICT (id) DO UPDATE SET n = acct.n + 1",
		}
		deletes := []string{
			"DELETE FROM acct WHERE id = 2",
			"DELETE FROM acct WHERE payload = 'low'",
			"DELETE FROM acct WHERE last_fence < 50",
			"DELETE FROM acct WHERE payload = 'low' AND n >= 0 AND id > 0 AND length(payload) = 3",
			"DELETE FROM acct WHERE n >= 0 AND (id = 2 OR payload = 'nothing') AND last_fence <= 1",
			"DELETE FROM acct WHERE id IN (SELECT id FROM src WHERE v = 20)",
			"DELETE FROM acct a USING src s WHERE s.id = a.id AND s.v = 20",
			"DELETE FROM acct WHERE id = 2 AND random() >= 0",
			"DELETE FROM acct WHERE id = 2 AND pg_sleep(0) IS NOT NULL",
			"DELETE FROM acct WHERE id = (SELECT max(id) FROM src)",
			"MERGE INTO acct t USING src s ON t.id = s.id WHEN MATCHED AND s.v = 20 THEN DELETE",
		}
		for _, p := range plans {
			t.Run(p.name, func(t *testing.T) {
				if _, err := c.PgConn().Exec(ctx, p.set).ReadAll(); err != nil {
					t.Fatal(err)
				}
				setTokenN(t, c, 50)
				for _, sql := range updates {
					setup(t)
					if n, err := execRows(ctx, c, sql); err != nil || n != 1 {
						t.Errorf("%s: %d rows, %v; want 1 row", sql, n, err)
						continue
					}
					wantRow(t, d, tError, 2, 1, 50)
					wantRow(t, d, tError, 1, 0, 100)
				}
				for _, sql := range deletes {
					setup(t)
					if n, err := execRows(ctx, c, sql); err != nil || n != 1 {
						t.Errorf("%s: %d rows, %v; want 1 row", sql, n, err)
						continue
					}
					if s := snapshot(t, d, tError); len(s) != 2 || s[1].Fence != 100 {
						t.Errorf("%s: table %v", sql, s)
					}
				}
				// A WHERE that also selects the row at 100 fails, and
				// row 2 is not written either.
				for _, sql := range []string{
					"UPDATE acct SET n = n + 1 WHERE payload IN ('low', 'high')",
					"DELETE FROM acct WHERE payload IN ('low', 'high')",
				} {
					setup(t)
					before := snapshot(t, d, tError)
					_, err := c.Exec(ctx, sql)
					wantCode(t, err, "FP001")
					wantUnchanged(t, d, tError, before)
				}
			})
		}
	})

	t.Run("merge-all-actions", func(t *testing.T) {
		// One MERGE updating row 1, deleting row 2 and inserting 600: with
		// a stale token nothing happens; with a current one all of it.
		const merge = `MERGE INTO acct t USING (VALUES (1), (2), (600)) AS s(id) ON t.id = s.id
			WHEN MATCHED AND t.id = 1 THEN UPDATE SET n = t.n + 1
			WHEN MATCHED THEN DELETE
			WHEN NOT MATCHED THEN INSERT (id, payload) VALUES (s.id, 'm')`
		resetTable(t, d, tError)
		setFences(t, d, tError, map[int64]int64{1: 42, 2: 42, 3: 42})
		before := snapshot(t, d, tError)
		c := e.connect(t, db)
		ctx := ctxT(t)
		setTokenN(t, c, 41)
		_, err := c.Exec(ctx, merge)
		wantCode(t, err, "FP001")
		wantUnchanged(t, d, tError, before)
		// Only row 2 (the DELETE) stale.
		setFences(t, d, tError, map[int64]int64{1: 0, 2: 42})
		before = snapshot(t, d, tError)
		_, err = c.Exec(ctx, merge)
		wantCode(t, err, "FP001")
		wantUnchanged(t, d, tError, before)

		setTokenN(t, c, 42)
		if n, err := execRows(ctx, c, merge); err != nil || n != 3 {
			t.Fatalf("MERGE with 42: %d rows, %v", n, err)
		}
		got := snapshot(t, d, tError)
		want := rowSet{
			1:   {1, "a", 1, 42},
			3:   {3, "c", 0, 42},
			600: {600, "m", 0, 42},
		}
		if !got.equal(want) {
			t.Errorf("after MERGE: %v, want %v", got, want)
		}

		// on_stale: skip: the stale row is left alone, the rest happens.
		resetTable(t, d, tSkip)
		setFences(t, d, tSkip, map[int64]int64{2: 50})
		if n, err := execRows(ctx, c, strings.Replace(merge, "acct", "acct_skip", 1)); err != nil || n != 2 {
			t.Fatalf("MERGE into acct_skip with 42: %d rows, %v; want 2", n, err)
		}
		got = snapshot(t, d, tSkip)
		want = rowSet{
			1:   {1, "a", 1, 42},
			2:   {2, "b", 0, 50},
			3:   {3, "c", 0, 0},
			600: {600, "m", 0, 42},
		}
		if !got.equal(want) {
			t.Errorf("after MERGE into acct_skip: %v, want %v", got, want)
		}
	})

	t.Run("on-conflict-do-nothing-stale", func(t *testing.T) {
		// DO NOTHING writes nothing on conflict, so there is nothing to
		// fence: no error, no change, whatever the row's fence.
		resetTable(t, d, tError)
		setFences(t, d, tError, map[int64]int64{1: 42})
		before := snapshot(t, d, tError)
		c := e.connect(t, db)
		setTokenN(t, c, 41)
		if n, err := execRows(ctxT(t), c, "INSERT INTO acct (id, payload) VALUES (1, 'x') ON CONFLICT DO NOTHING"); err != nil || n != 0 {
			t.Fatalf("%d rows, %v; want 0 rows", n, err)
		}
		wantUnchanged(t, d, tError, before)
	})
}

// wantPgError fails the test unless err is a PostgreSQL error with
// SQLSTATE code, and returns it.
func wantPgError(t testing.TB, err error, code string) *pgconn.PgError {
	t.Helper()
	wantCode(t, err, code)
	var pgErr *pgconn.PgError
	errors.As(err, &pgErr)
	return pgErr
}
