package fencing_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
)

// testRefusals covers what the proxy refuses on a protected table (FP003,
// nothing sent to the server, the session goes on), and what it forwards
// untouched: reads, other tables, and names that only look protected.
func testRefusals(t *testing.T, e *env) {
	db := e.newDB(t)
	d := direct(t, db)

	t.Run("copy-from-stdin", func(t *testing.T) {
		c := e.connect(t, db)
		ctx := ctxT(t)
		setTokenN(t, c, 42)
		before := snapshot(t, d, tError)
		for _, sql := range []string{
			"COPY acct (id, payload) FROM STDIN",
			"COPY public.acct FROM STDIN WITH (FORMAT csv)",
			"copy ACCT from stdin",
		} {
			_, err := c.PgConn().CopyFrom(ctx, strings.NewReader("77\tcopied\n"), sql)
			wantCode(t, err, "FP003")
			wantUnchanged(t, d, tError, before)
			selectOne(t, c)
		}
		// COPY into an unprotected table works through the proxy.
		tag, err := c.PgConn().CopyFrom(ctx, strings.NewReader("7\t70\n"), "COPY src FROM STDIN")
		if err != nil || tag.RowsAffected() != 1 {
			t.Fatalf("COPY src FROM STDIN: %v, %v", tag, err)
		}
	})

	t.Run("copy-from-in-transaction", func(t *testing.T) {
		c := e.connect(t, db)
		ctx := ctxT(t)
		setTokenN(t, c, 42)
		before := snapshot(t, d, tError)
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		_, err = c.PgConn().CopyFrom(ctx, strings.NewReader("77\tcopied\n"), "COPY acct (id, payload) FROM STDIN")
		wantCode(t, err, "FP003")
		// A refusal aborts the transaction like any error.
		_, err = tx.Exec(ctx, "SELECT 1")
		wantCode(t, err, "25P02")
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		wantUnchanged(t, d, tError, before)
		selectOne(t, c)
	})

	t.Run("truncate", func(t *testing.T) {
		c := e.connect(t, db)
		setTokenN(t, c, 42)
		before := snapshot(t, d, tError)
		for _, sql := range []string{
			"TRUNCATE acct",
			"TRUNCATE TABLE public.acct RESTART IDENTITY",
			"TRUNCATE src, acct_skip",
			"TRUNCATE ONLY acct CASCADE",
		} {
			_, err := c.Exec(ctxT(t), sql)
			wantCode(t, err, "FP003")
		}
		wantUnchanged(t, d, tError, before)
		if n := len(snapshot(t, d, tSkip)); n != 3 {
			t.Errorf("acct_skip has %d rows after a refused TRUNCATE, want 3", n)
		}
		var n int
		if err := d.QueryRow(ctxT(t), "SELECT count(*) FROM src").Scan(&n); err != nil || n == 0 {
			t.Errorf("src has %d rows after a refused TRUNCATE naming it (%v)", n, err)
		}
		selectOne(t, c)
	})

	t.Run("unparseable", func(t *testing.T) {
		c := e.connect(t, db)
		setTokenN(t, c, 42)
		before := snapshot(t, d, tError)
		for _, sql := range []string{
			"UPDATE acct SET n = WHERE id = 1",
			"UPDAT acct SET n = 5",
			"DELETE acct WHERE id = 1",
			"UPDATE acct SET n = 5 WHERE id = 1; SELEC 1",
		} {
			// The simple protocol: the server would answer 42601 if the
			// statement reached it.
			_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
			wantCode(t, err, "FP003")
			// The extended protocol (Parse).
			_, err = c.Exec(ctxT(t), sql)
			wantCode(t, err, "FP003")
		}
		wantUnchanged(t, d, tError, before)
		// A syntax error on an unprotected table is the server's own.
		_, err := c.Exec(ctxT(t), "UPDATE src SET v = WHERE id = 1")
		wantCode(t, err, "42601")
		selectOne(t, c)
	})

	t.Run("copy-to-stdout", func(t *testing.T) {
		c := e.connect(t, db) // no token: reads need none
		for _, sql := range []string{
			"COPY acct TO STDOUT",
			"COPY public.acct (id, payload) TO STDOUT",
			"COPY (SELECT id, payload FROM acct ORDER BY id) TO STDOUT",
		} {
			var buf bytes.Buffer
			tag, err := c.PgConn().CopyTo(ctxT(t), &buf, sql)
			if err != nil || tag.RowsAffected() != 3 || !strings.Contains(buf.String(), "\ta") {
				t.Errorf("%s: %v, %v, %q", sql, tag, err, buf.String())
			}
		}
	})

	t.Run("unqualified-name", func(t *testing.T) {
		c := e.connect(t, db) // no token
		ctx := ctxT(t)
		before := snapshot(t, d, tError)
		for _, sql := range []string{
			"UPDATE acct SET n = n + 1 WHERE id = 1",
			"UPDATE public.acct SET n = n + 1 WHERE id = 1",
			`UPDATE "public"."acct" SET n = n + 1 WHERE id = 1`,
			"UPDATE ACCT SET n = n + 1 WHERE id = 1",
			"DELETE FROM Public.Acct WHERE id = 1",
		} {
			_, err := c.Exec(ctx, sql)
			wantCode(t, err, "FP002")
		}
		wantUnchanged(t, d, tError, before)

		// other.acct, named with its schema, is not protected.
		if n, err := execRows(ctx, c, "UPDATE other.acct SET n = n + 1 WHERE id = 1"); err != nil || n != 1 {
			t.Fatalf("UPDATE other.acct: %d rows, %v", n, err)
		}
		// Unqualified, the proxy cannot know which acct the search_path
		// picks: it fences it (fail closed), whichever table it is.
		if _, err := c.Exec(ctx, "SET search_path = other, public"); err != nil {
			t.Fatal(err)
		}
		_, err := c.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1")
		wantCode(t, err, "FP002")
		setTokenN(t, c, 42)
		if n, err := execRows(ctx, c, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil || n != 1 {
			t.Fatalf("UPDATE acct with search_path other: %d rows, %v", n, err)
		}
		var n, fence int64
		if err := d.QueryRow(ctx, "SELECT n, last_fence FROM other.acct WHERE id = 1").Scan(&n, &fence); err != nil || n != 2 || fence != 42 {
			t.Errorf("other.acct row 1: n %d fence %d (%v), want n 2 fence 42", n, fence, err)
		}
		wantUnchanged(t, d, tError, before)
	})

	t.Run("identifier-case", func(t *testing.T) {
		c := e.connect(t, db) // no token
		ctx := ctxT(t)
		// Unprotected: config and "Settings".
		for _, sql := range []string{
			"UPDATE config SET n = n + 1 WHERE id = 1",
			"UPDATE Config SET n = n + 1 WHERE id = 1",
			"UPDATE CONFIG SET n = n + 1 WHERE id = 1",
			`UPDATE "config" SET n = n + 1 WHERE id = 1`,
			`UPDATE "Settings" SET n = n + 1 WHERE id = 1`,
			`INSERT INTO "Settings" (id) VALUES (2)`,
		} {
			if n, err := execRows(ctx, c, sql); err != nil || n != 1 {
				t.Errorf("%s: %d rows, %v; want 1 row, unfenced", sql, n, err)
			}
		}
		// Protected: "Config" and settings.
		for _, sql := range []string{
			`UPDATE "Config" SET n = n + 1 WHERE id = 1`,
			`UPDATE public."Config" SET n = n + 1 WHERE id = 1`,
			"UPDATE settings SET n = n + 1 WHERE id = 1",
			"UPDATE SETTINGS SET n = n + 1 WHERE id = 1",
			`UPDATE "settings" SET n = n + 1 WHERE id = 1`,
			`INSERT INTO "Config" (id) VALUES (2)`,
			`DELETE FROM Settings WHERE id = 1`,
		} {
			_, err := c.Exec(ctx, sql)
			wantCode(t, err, "FP002")
		}
		setTokenN(t, c, 42)
		if n, err := execRows(ctx, c, `UPDATE "Config" SET n = n + 1 WHERE id = 1`); err != nil || n != 1 {
			t.Fatalf(`UPDATE "Config": %d rows, %v`, n, err)
		}
		for _, q := range []struct {
			table string
			n     int
			fence int64
		}{
			{`"Config"`, 1, 42},
			{"config", 4, 0},
			{"settings", 0, 0},
			{`"Settings"`, 1, 0},
		} {
			var n int
			var fence int64
			if err := d.QueryRow(ctx, "SELECT n, last_fence FROM "+q.table+" WHERE id = 1").Scan(&n, &fence); err != nil || n != q.n || fence != q.fence {
				t.Errorf("%s row 1: n %d fence %d (%v), want n %d fence %d", q.table, n, fence, err, q.n, q.fence)
			}
		}
	})

	t.Run("forwarded-untouched", func(t *testing.T) {
		c := e.connect(t, db) // no token
		ctx := ctxT(t)
		// current_query() returns the text the server received: reads of
		// protected tables and writes of other tables arrive byte for byte.
		for _, sql := range []string{
			"SELECT current_query() FROM acct WHERE id = 1",
			"select   current_query()\n  from ACCT /* a comment: UPDATE acct */ where id = 1 -- trailing",
			"SELECT current_query() FROM acct WHERE id = 1 FOR UPDATE",
			"WITH r AS (SELECT * FROM acct WHERE id = 1) SELECT current_query() FROM r",
			"SELECT current_query() FROM acct_skip a JOIN src s USING (id) WHERE a.id = 1",
			"WITH u AS (UPDATE src SET v = v WHERE id = 1 RETURNING current_query() AS q) SELECT q FROM u",
			"INSERT INTO src (id, v) VALUES (90, 1) RETURNING current_query()",
		} {
			for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
				var got string
				if err := c.QueryRow(ctx, sql, mode).Scan(&got); err != nil {
					t.Fatalf("%s (%v): %v", sql, mode, err)
				}
				// Where the catalog watch runs, a write of another table
				// checks the catalog stamp in its transaction first: the
				// client's bytes follow the check unchanged.
				if got != sql && !(strings.HasPrefix(got, "CALL "+dbsetup.CatalogCheckProc+"(") && strings.HasSuffix(got, ");"+sql)) {
					t.Errorf("%v: server received %q, client sent %q", mode, got, sql)
				}
				if _, err := d.Exec(ctx, "DELETE FROM src WHERE id = 90"); err != nil {
					t.Fatal(err)
				}
			}
		}
		// A protected write is rewritten, and the token is read on the
		// server: the token's value is not in the text.
		setToken(t, c, "4242")
		var got string
		if err := c.QueryRow(ctx, "UPDATE acct SET n = n + 1 WHERE id = 2 RETURNING current_query()").Scan(&got); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(got, "'fence.token'") || strings.Contains(got, "4242") {
			t.Errorf("the server ran %q", got)
		}
	})
}

// selectOne checks that c still answers a query.
func selectOne(t testing.TB, c *pgx.Conn) {
	t.Helper()
	var n int
	if err := c.QueryRow(ctxT(t), "SELECT 1").Scan(&n); err != nil || n != 1 {
		t.Fatalf("SELECT 1 = %d, %v; want 1", n, err)
	}
}
