package fencing_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestOperatorSearchPath: everything the rewrite adds is schema-qualified,
// operators included (docs/design.md, "Safety invariants"). A session whose search_path puts a
// schema with look-alike operators before pg_catalog must still be fenced:
// a stale write fails (or, with on_stale: skip, touches nothing), an
// invalid token is still FP002, and no watermark moves.
func TestOperatorSearchPath(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	db := e.newDB(t)
	d := direct(t, db)
	// Operators that would let every row through: <= and < say true, ~
	// accepts any token, || yields a harmless text.
	if _, err := d.PgConn().Exec(ctxT(t), `
CREATE FUNCTION public.fake_le(bigint, bigint) RETURNS bool LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR public.<= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.fake_le);
CREATE OPERATOR public.< (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.fake_le);
CREATE FUNCTION public.fake_match(text, text) RETURNS bool LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR public.~ (LEFTARG = text, RIGHTARG = text, FUNCTION = public.fake_match);
CREATE FUNCTION public.fake_cat(text, text) RETURNS text LANGUAGE sql AS 'SELECT ''1''';
CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = public.fake_cat);
`).ReadAll(); err != nil {
		t.Fatal(err)
	}
	c := e.connect(t, db)
	if _, err := c.Exec(ctxT(t), "SET search_path = public, pg_catalog"); err != nil {
		t.Fatal(err)
	}
	// The look-alikes are in force in this session.
	var shadowed bool
	if err := c.QueryRow(ctxT(t), "SELECT 50::bigint <= 42::bigint AND 'abc' ~ '^[0-9]+$'").Scan(&shadowed); err != nil || !shadowed {
		t.Fatalf("look-alike operators not in force: %v, %v", shadowed, err)
	}

	writes := []string{
		"UPDATE %[1]s SET n = n + 1 WHERE id = 1",
		"UPDATE %[1]s SET n = n + 1",
		"DELETE FROM %[1]s WHERE id = 1",
		"DELETE FROM %[1]s WHERE payload = 'a' OR id = 1",
		"INSERT INTO %[1]s (id, payload) VALUES (1, 'x') ON CONFLICT (id) DO UPDATE SET n = %[1]s.n + 1",
		"MERGE INTO %[1]s t USING src s ON t.id = s.id WHEN MATCHED THEN UPDATE SET n = t.n + 1",
		"MERGE INTO %[1]s t USING src s ON t.id = s.id WHEN MATCHED THEN DELETE",
		"MERGE INTO %[1]s t USING src s ON t.id = s.id WHEN MATCHED AND s.v = 10 THEN UPDATE SET n = 5 WHEN MATCHED THEN DELETE",
	}
	for _, tbl := range []string{tError, tSkip, tStrict} {
		t.Run(tbl, func(t *testing.T) {
			resetTable(t, d, tbl)
			setFences(t, d, tbl, map[int64]int64{1: 50, 2: 50, 3: 50})
			before := snapshot(t, d, tbl)
			// Stale: 42 < 50; for the strict table an equal token is
			// stale too.
			toks := []int64{42}
			if tbl == tStrict {
				toks = append(toks, 50)
			}
			for _, tok := range toks {
				setTokenN(t, c, tok)
				for _, w := range writes {
					sql := fmt.Sprintf(w, tbl)
					tag, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
					switch code := sqlState(err); {
					case tbl == tSkip:
						if err != nil || len(tag) != 1 || tag[0].CommandTag.RowsAffected() != 0 {
							t.Errorf("token %d: %s: %v, %v; want 0 rows", tok, sql, tag, err)
						}
					case code != "FP001":
						t.Errorf("token %d: %s: %v (SQLSTATE %q), want FP001", tok, sql, err, code)
					}
					wantUnchanged(t, d, tbl, before)
				}
			}
			// An invalid token is refused by the real ~, whatever the
			// look-alike says.
			for _, tok := range []string{"abc", "0", "-1"} {
				setToken(t, c, tok)
				for _, w := range append(writes, "INSERT INTO %[1]s (id, payload) VALUES (7, 'x')") {
					sql := fmt.Sprintf(w, tbl)
					_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
					if code := sqlState(err); code != "FP002" {
						t.Errorf("token %q: %s: %v (SQLSTATE %q), want FP002", tok, sql, err, code)
					}
					wantUnchanged(t, d, tbl, before)
				}
			}
		})
	}
}

// TestTokenReadOnce: the token is read by the statement itself, so a
// statement that writes a protected table and also changes the setting
// (set_config anywhere in it) is refused with FP003 before anything runs;
// setting the token in an earlier statement of the same string works.
func TestTokenReadOnce(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	db := e.newDB(t)
	d := direct(t, db)
	c := e.connect(t, db)
	sc := "set_config('fence.token', '100', false)"
	stmts := []string{
		// WHERE
		"UPDATE acct SET n = n + 1 WHERE id = 1 AND " + sc + " IS NOT NULL",
		"DELETE FROM acct WHERE id = 1 AND " + sc + " = '100'",
		"UPDATE acct SET n = n + 1 WHERE id = (SELECT 1 FROM (SELECT " + sc + ") x)",
		// SET list
		"UPDATE acct SET payload = " + sc + " WHERE id = 1",
		"UPDATE acct SET (payload, n) = (SELECT " + sc + ", 1) WHERE id = 1",
		// CTE
		"WITH x AS (SELECT " + sc + ") UPDATE acct SET n = n + 1 WHERE id = 1",
		"WITH x AS (SELECT " + sc + " AS s) UPDATE acct SET n = n + 1 FROM x WHERE id = 1",
		"WITH x AS MATERIALIZED (SELECT " + sc + ") DELETE FROM acct WHERE id = 1",
		"WITH x AS (SELECT * FROM " + sc + ") INSERT INTO acct (id, payload) VALUES (1, 'x') ON CONFLICT (id) DO UPDATE SET n = 9",
		// VALUES
		"INSERT INTO acct (id, payload) VALUES (1, " + sc + ") ON CONFLICT (id) DO UPDATE SET payload = EXCLUDED.payload",
		"INSERT INTO acct (id, payload) VALUES (20, " + sc + ")",
		"INSERT INTO acct (id, payload) SELECT 1, s FROM " + sc + " s ON CONFLICT (id) DO UPDATE SET n = 9",
		// MERGE source
		"MERGE INTO acct t USING (SELECT 1 AS id, " + sc + " AS s) s ON t.id = s.id WHEN MATCHED THEN UPDATE SET n = t.n + 1",
		"MERGE INTO acct t USING (SELECT id FROM src WHERE " + sc + " IS NOT NULL) s ON t.id = s.id WHEN MATCHED THEN DELETE",
		"MERGE INTO acct t USING src s ON t.id = s.id AND " + sc + " IS NOT NULL WHEN MATCHED THEN UPDATE SET n = 1",
		// Spellings
		"UPDATE acct SET n = n + 1 WHERE id = 1 AND pg_catalog." + sc + " IS NOT NULL",
		"UPDATE acct SET n = n + 1 WHERE id = 1 AND PG_CATALOG.SET_CONFIG('fence.token', '100', false) IS NOT NULL",
		`UPDATE acct SET n = n + 1 WHERE id = 1 AND "set_config"('fence.token', '100', false) IS NOT NULL`,
		"UPDATE acct SET n = n + 1 WHERE id = 1 AND set_config('fence.token', '100', is_local => true) IS NOT NULL",
		// The write in a writable CTE, set_config in the main query.
		"WITH u AS (UPDATE acct SET n = n + 1 WHERE id = 1 RETURNING id) SELECT " + sc + " FROM u",
	}
	setFences(t, d, tError, map[int64]int64{1: 50, 2: 50, 3: 50})
	before := snapshot(t, d, tError)
	for _, sql := range stmts {
		setTokenN(t, c, 42) // stale for every row
		_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
		if code := sqlState(err); code != "FP003" {
			t.Errorf("%s: %v (SQLSTATE %q), want FP003", sql, err, code)
		}
		wantUnchanged(t, d, tError, before)
		// Nothing ran: the session's token is still 42.
		var tok string
		if err := c.QueryRow(ctxT(t), "SELECT current_setting('fence.token')").Scan(&tok); err != nil || tok != "42" {
			t.Errorf("%s: fence.token = %q, %v; want 42 (the statement ran)", sql, tok, err)
		}
	}
	for id, r := range snapshot(t, d, tError) {
		if r.Fence == 100 {
			t.Errorf("row %d stored the token set inside a write: %+v", id, r)
		}
	}

	// Setting the token in its own statement before the write, in the
	// same simple-query string, works.
	setTokenN(t, c, 42)
	res, err := c.PgConn().Exec(ctxT(t), "SELECT "+sc+"; UPDATE acct SET n = n + 1 WHERE id = 1; "+
		"INSERT INTO acct (id, payload) VALUES (30, 'x'); SELECT set_config('fence.token', '101', false); DELETE FROM acct WHERE id = 2").ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	var tags []string
	for _, r := range res {
		tags = append(tags, r.CommandTag.String())
	}
	if got, want := strings.Join(tags, ","), "SELECT 1,UPDATE 1,INSERT 0 1,SELECT 1,DELETE 1"; got != want {
		t.Errorf("command tags %s, want %s", got, want)
	}
	after := snapshot(t, d, tError)
	if r := after[1]; r.N != 1 || r.Fence != 100 {
		t.Errorf("row 1 = %+v, want n 1 fence 100", r)
	}
	if r := after[30]; r.Fence != 100 {
		t.Errorf("row 30 = %+v, want fence 100", r)
	}
	if _, ok := after[2]; ok {
		t.Errorf("row 2 not deleted: %v", after)
	}
}

// TestTokenReadOnceThroughFunction: set_config called from inside a
// function the statement calls is not visible in the statement's text, so
// the proxy cannot refuse it. Such a function sets the session's token, as
// a SET before the statement would (the token is the client's to choose:
// fencing guards against stale holders, not against clients that pick a
// newer token for themselves). What must hold is that the statement is
// consistent: every row it writes was checked against the token it is
// stamped with, so the watermark is never set to a token that was not
// checked. Either the write is refused and nothing changes, or the row
// carries the token the function set.
func TestTokenReadOnceThroughFunction(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	db := e.newDB(t)
	d := direct(t, db)
	if _, err := d.Exec(ctxT(t), `CREATE FUNCTION public.bump() RETURNS text LANGUAGE sql VOLATILE
AS $$SELECT pg_catalog.set_config('fence.token', '100', false)$$`); err != nil {
		t.Fatal(err)
	}
	c := e.connect(t, db)
	for _, sql := range []string{
		"UPDATE acct SET n = n + 1 WHERE id = 1 AND bump() IS NOT NULL",
		"UPDATE acct SET payload = bump() WHERE id = 1",
		"INSERT INTO acct (id, payload) VALUES (1, bump()) ON CONFLICT (id) DO UPDATE SET n = 7",
		"DELETE FROM acct WHERE id = 1 AND bump() IS NOT NULL",
		"MERGE INTO acct t USING (SELECT 1 AS id, bump() AS b) s ON t.id = s.id WHEN MATCHED THEN UPDATE SET n = 7",
	} {
		resetTable(t, d, tError)
		setFences(t, d, tError, map[int64]int64{1: 50})
		before := snapshot(t, d, tError)
		setTokenN(t, c, 42) // stale for row 1
		_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
		if code := sqlState(err); code == "FP001" || code == "FP003" {
			wantUnchanged(t, d, tError, before)
			continue
		} else if err != nil {
			t.Errorf("%s: %v (SQLSTATE %q)", sql, err, code)
			continue
		}
		after := snapshot(t, d, tError)
		if r, ok := after[1]; ok && r.Fence != 100 {
			t.Errorf("%s: row 1 = %+v: written with a token other than the one it was checked against (100)", sql, r)
		}
		for id, r := range after {
			if id != 1 && r != before[id] {
				t.Errorf("%s: row %d changed: %+v -> %+v", sql, id, before[id], r)
			}
		}
	}
}
