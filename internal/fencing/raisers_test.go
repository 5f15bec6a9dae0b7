package fencing_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// pid2query returns the text the backend pid last ran, as PostgreSQL saw
// it.
func pid2query(t *testing.T, d *pgx.Conn, pid int) string {
	t.Helper()
	var q string
	if err := d.QueryRow(ctxT(t), "SELECT query FROM pg_stat_activity WHERE pid = $1", pid).Scan(&q); err != nil {
		t.Fatal(err)
	}
	return q
}

// TestRaisersUsed: in a database set up with the error raisers, the proxy
// sends the form that calls them, and its clients see exactly the errors
// the inline form gives; when the raisers are dropped under it, the
// statement fails closed with an error naming the cause, and once the
// database is checked again the proxy fences with the inline form.
func TestRaisersUsed(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	inline, fn := startEnv(t), startRaisersEnv(t)
	dbI, dbF := inline.newDB(t), fn.newDB(t)
	dF := direct(t, dbF)
	if _, err := dF.Exec(ctxT(t), "UPDATE acct SET last_fence = 50 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	if _, err := direct(t, dbI).Exec(ctxT(t), "UPDATE acct SET last_fence = 50 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	cI, cF := inline.connect(t, dbI), fn.connect(t, dbF)
	var pid int
	if err := cF.QueryRow(ctxT(t), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}

	// A fresh write: fenced, through the raisers' token form (the
	// session's token written into the statement, the stale branch
	// raising through fenceproxy.stale_at, objects version 5).
	setToken(t, cF, "60")
	if _, err := cF.Exec(ctxT(t), "UPDATE acct SET n = n + 1 WHERE id = 2", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	if q := pid2query(t, dF, pid); !strings.Contains(q, "'60'::bigint THEN '60'::bigint ELSE fenceproxy.stale_at(acct.last_fence)") || strings.Contains(q, "pg_catalog.current_setting") || strings.Contains(q, "'fenceproxy:stale:'") {
		t.Fatalf("the proxy did not send the raisers' token form: %s", q)
	}
	var fence int64
	if err := dF.QueryRow(ctxT(t), "SELECT last_fence FROM acct WHERE id = 2").Scan(&fence); err != nil || fence != 60 {
		t.Fatalf("fence of the written row: %d, %v; want 60", fence, err)
	}
	if _, err := dF.Exec(ctxT(t), "INSERT INTO acct (id, payload) VALUES (9, 'z')"); err != nil {
		t.Fatal(err)
	}
	// A text that sets the token before its write reads it on the server:
	// the raisers' form, with the value set there.
	if _, err := cF.Exec(ctxT(t), "SET fence.token = '0061'; UPDATE acct SET n = n + 1 WHERE id = 9", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	if q := pid2query(t, dF, pid); !strings.Contains(q, "fenceproxy.advance(") || !strings.Contains(q, "fenceproxy.tok_b(") || strings.Contains(q, "'fenceproxy:stale:'") {
		t.Fatalf("the proxy did not send the raisers' form: %s", q)
	}
	if err := dF.QueryRow(ctxT(t), "SELECT last_fence FROM acct WHERE id = 9").Scan(&fence); err != nil || fence != 61 {
		t.Fatalf("fence of the written row: %d, %v; want 61", fence, err)
	}
	// The next write takes the record's token, written without its zeros
	// (a text not sent before: this environment prepares repeated ones).
	if _, err := cF.Exec(ctxT(t), "UPDATE acct SET n = n + 2 WHERE id = 9", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	// Nothing in this database reads the settings: no SET LOCALs before it.
	if q := pid2query(t, dF, pid); strings.Contains(q, "SET LOCAL") || !strings.Contains(q, "'61'::bigint THEN '61'::bigint") {
		t.Fatalf("the proxy did not send the token form of token 61 alone: %s", q)
	}
	if _, err := dF.Exec(ctxT(t), "DELETE FROM acct WHERE id = 9"); err != nil {
		t.Fatal(err)
	}
	setToken(t, cF, "60")

	// A Parse, named or not, gets the parameter form: the token form with
	// the token a parameter, which the proxy binds at every Bind.
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		if _, err := cF.Exec(ctxT(t), "UPDATE acct SET n = n + 1 WHERE id = $1", mode, 3); err != nil {
			t.Fatal(err)
		}
		if q := pid2query(t, dF, pid); !tokenParam(q) || !strings.Contains(q, "fenceproxy.stale(") || strings.Contains(q, "fenceproxy.advance(") {
			t.Errorf("mode %v: the proxy sent %s", mode, q)
		}
	}
	if err := dF.QueryRow(ctxT(t), "SELECT last_fence FROM acct WHERE id = 3").Scan(&fence); err != nil || fence != 60 {
		t.Fatalf("fence of row 3: %d, %v; want 60", fence, err)
	}
	// Bound without a valid token, a named statement is prepared again in
	// the prepared form (the checks as expressions, a check call only
	// behind the short pattern, raisers in the branches that raise).
	short := "OPERATOR(pg_catalog.~) '" + rules.ShortTokenPattern() + "' OR fenceproxy.tok_b("
	namedText := func(c *pgx.Conn) string {
		t.Helper()
		var q string
		if err := c.QueryRow(ctxT(t), "SELECT statement FROM pg_prepared_statements WHERE name = 'named_upd'").Scan(&q); err != nil {
			t.Fatal(err)
		}
		return q
	}
	for _, c := range []*pgx.Conn{cF, cI} {
		if _, err := c.Prepare(ctxT(t), "named_upd", "UPDATE acct SET n = n + 1 WHERE id = $1"); err != nil {
			t.Fatal(err)
		}
	}
	setToken(t, cF, "x60")
	if _, err := cF.Exec(ctxT(t), "named_upd", 3); sqlState(err) != "FP002" {
		t.Fatalf("invalid token: %v, want FP002", err)
	}
	if q := namedText(cF); !strings.Contains(q, short) || !strings.Contains(q, "fenceproxy.stale(") || strings.Contains(q, "fenceproxy.advance(") {
		t.Errorf("named statement after a Bind without a valid token: %s", q)
	}
	setToken(t, cF, "60")
	// Without the raisers, the same: the parameter form, and after an
	// invalid token the form whose token checks try the short pattern
	// before the full one.
	setToken(t, cI, "60")
	if _, err := cI.Exec(ctxT(t), "named_upd", 3); err != nil {
		t.Fatal(err)
	}
	if q := namedText(cI); !tokenParam(q) || strings.Contains(q, "fenceproxy.") {
		t.Errorf("inline parameter form: %s", q)
	}
	setToken(t, cI, "x60")
	if _, err := cI.Exec(ctxT(t), "named_upd", 3); sqlState(err) != "FP002" {
		t.Fatalf("invalid token, inline: %v, want FP002", err)
	}
	inlineSQL := namedText(cI)
	if !strings.Contains(inlineSQL, "OPERATOR(pg_catalog.~) '"+rules.ShortTokenPattern()+"' OR ") || !strings.Contains(inlineSQL, rules.TokenPattern()) ||
		strings.Contains(inlineSQL, "fenceproxy.") {
		t.Errorf("inline prepared form: %s", inlineSQL)
	}
	setToken(t, cI, "60")

	// Stale, missing and invalid tokens: the same errors in both forms,
	// and nothing written.
	type outcome struct{ code, msg, detail, hint string }
	run := func(c *pgx.Conn, tok, sql string, mode pgx.QueryExecMode) outcome {
		t.Helper()
		if tok == "" {
			resetToken(t, c)
		} else {
			setToken(t, c, tok)
		}
		_, err := c.Exec(ctxT(t), sql, mode)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) {
			t.Fatalf("%s with token %q: %v, want an error", sql, tok, err)
		}
		return outcome{pe.Code, pe.Message, pe.Detail, pe.Hint}
	}
	for _, tc := range []struct{ tok, sql, code string }{
		{"40", "UPDATE acct SET n = n + 1 WHERE id = 1", "FP001"},
		{"40", "DELETE FROM acct WHERE id = 1", "FP001"},
		{"40", "INSERT INTO acct (id, payload) VALUES (1, 'x') ON CONFLICT (id) DO UPDATE SET payload = 'y'", "FP001"},
		{"", "UPDATE acct SET n = n + 1 WHERE id = 1", "FP002"},
		{"", "UPDATE acct SET n = n + 1 WHERE id = 12345", "FP002"}, // no row matches
		{"12abc", "INSERT INTO acct (payload) VALUES ('x')", "FP002"},
		{"0", "DELETE FROM acct WHERE id = 3", "FP002"},
		{"9223372036854775808", "UPDATE acct SET n = 0", "FP002"},
	} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
			oI, oF := run(cI, tc.tok, tc.sql, mode), run(cF, tc.tok, tc.sql, mode)
			if oF.code != tc.code || oF != oI {
				t.Errorf("%s, token %q (mode %v):\n raisers: %+v\n inline:  %+v", tc.sql, tc.tok, mode, oF, oI)
			}
		}
	}
	var n, rows int
	if err := dF.QueryRow(ctxT(t), "SELECT n, (SELECT count(*) FROM acct) FROM acct WHERE id = 1").Scan(&n, &rows); err != nil || n != 0 || rows != 3 {
		t.Errorf("after the refused writes: n %d, %d rows, %v; want 0 and 3", n, rows, err)
	}

	// The raisers dropped behind the proxy's back: fail closed, then the
	// inline form once the database has been checked again. tok_b is
	// called by every form: the simple Query's (a text sent for the first
	// time), the prepared form of a text sent again (which the proxy
	// prepares for itself: the server's statement is analysed again and
	// fails) and of one the proxy prepared before the drop.
	if _, err := dF.Exec(ctxT(t), "DROP FUNCTION fenceproxy.tok_b(text, text)"); err != nil {
		t.Fatal(err)
	}
	setToken(t, cF, "60")
	extra := 0 // writes to row 2 that ran in the inline form
	for i, sql := range []string{
		"UPDATE acct SET n = n + 1 WHERE id = 2 AND true", // first sighting
		"UPDATE acct SET n = n + 1 WHERE id = 2",          // second sighting: prepared now
		"UPDATE acct SET n = n + 1 WHERE id = 1",          // prepared before the drop
	} {
		if i > 0 {
			// The proxy prepares its statements again at every use: once
			// the first failure's recheck is done, the inline form runs.
			if _, err := cF.Exec(ctxT(t), sql, pgx.QueryExecModeSimpleProtocol); err == nil {
				if strings.Contains(sql, "id = 2") {
					extra++
				}
				continue
			}
		}
		_, err := cF.Exec(ctxT(t), sql, pgx.QueryExecModeSimpleProtocol)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "FP003" && strings.Contains(pe.Message, "catalog of database") {
			// The catalog watch saw the DROP FUNCTION first: refused
			// once in the write's transaction, and the retry is decided
			// after the database was checked again, in the inline form.
			if _, err := cF.Exec(ctxT(t), sql, pgx.QueryExecModeSimpleProtocol); err != nil {
				t.Fatalf("%s, retried after the catalog check: %v", sql, err)
			}
			if strings.Contains(sql, "id = 2") {
				extra++
			}
			continue
		}
		if err == nil {
			if strings.Contains(sql, "id = 2") {
				extra++
			}
			continue
		}
		if pe == nil {
			t.Fatalf("%s: %v", sql, err)
		}
		o := outcome{pe.Code, pe.Message, pe.Detail, pe.Hint}
		if !strings.Contains(o.msg, "error raisers") || !strings.Contains(o.detail, "fenceproxy.tok_b") {
			t.Errorf("%s after the raisers were dropped: %+v", sql, o)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, err := cF.Exec(ctxT(t), "UPDATE acct SET n = n + 1 WHERE id = 2", pgx.QueryExecModeSimpleProtocol)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("writes still fail after the recheck: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if q := pid2query(t, dF, pid); !strings.Contains(q, "'fenceproxy:stale:'") {
		t.Errorf("after the recheck the proxy should send the inline form: %s", q)
	}
	if err := dF.QueryRow(ctxT(t), "SELECT n FROM acct WHERE id = 2").Scan(&n); err != nil || n != 2+extra {
		t.Errorf("n of row 2: %d, %v; want 2 (the write before the drop and the one after the recheck)", n, err)
	}
	if o := run(cF, "40", "UPDATE acct SET n = n + 1 WHERE id = 1", pgx.QueryExecModeSimpleProtocol); o.code != "FP001" {
		t.Errorf("stale write with the inline form: %+v", o)
	}
}

// TestRaisersPreparedTokens: prepared statements read the token when they
// execute, not when they were planned — with a generic plan too, where a
// function of constants that PostgreSQL folded at planning time would keep
// the token of the first execution (the guard and the stamp are calls with
// constant arguments) — in both forms; and a prepared write that matches
// no row still fails without a token.
func TestRaisersPreparedTokens(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	for _, form := range []struct {
		name  string
		start func(*testing.T) *env
	}{{"inline", startEnv}, {"raisers", startRaisersEnv}} {
		t.Run(form.name, func(t *testing.T) {
			e := form.start(t)
			db := e.newDB(t)
			c, d := e.connect(t, db), direct(t, db)
			ctx := ctxT(t)
			if _, err := c.Exec(ctx, "SET plan_cache_mode = force_generic_plan"); err != nil {
				t.Fatal(err)
			}
			for name, sql := range map[string]string{
				"upd":    "UPDATE acct SET n = n + 1 WHERE id = $1",
				"ins":    "INSERT INTO acct (id, payload) VALUES ($1, 'x')",
				"norow":  "UPDATE acct SET n = n + 1 WHERE id = 999999",
				"strict": "UPDATE acct_strict SET n = n + 1 WHERE id = 2",
			} {
				if _, err := c.Prepare(ctx, name, sql); err != nil {
					t.Fatalf("prepare %s: %v", name, err)
				}
			}
			fence := func(table string, id int64) int64 {
				t.Helper()
				var f int64
				if err := d.QueryRow(ctx, "SELECT last_fence FROM "+table+" WHERE id = $1", id).Scan(&f); err != nil {
					t.Fatal(err)
				}
				return f
			}
			fails := func(code, name string, args ...any) {
				t.Helper()
				_, err := c.Exec(ctx, name, args...)
				var pe *pgconn.PgError
				if !errors.As(err, &pe) || pe.Code != code {
					t.Errorf("%s %v: %v, want %s", name, args, err, code)
				}
			}
			// Tokens of up to 18 significant digits pass the prepared form's
			// short pattern, zero-padded or not; those of 19 take its call of
			// the raisers' full check (the inline form's full pattern).
			for i, tc := range []struct {
				set string
				tok int64
			}{{"60", 60}, {"070", 70}, {"9223372036854775000", 9223372036854775000}, {"0009223372036854775001", 9223372036854775001}} {
				tok := tc.tok
				setToken(t, c, tc.set)
				for _, run := range []struct {
					name string
					args []any
				}{{"upd", []any{int64(2)}}, {"ins", []any{int64(500 + i)}}, {"norow", nil}, {"strict", nil}} {
					if _, err := c.Exec(ctx, run.name, run.args...); err != nil {
						t.Fatalf("token %d, %s: %v", tok, run.name, err)
					}
				}
				if f, g, h := fence(tError, 2), fence(tError, int64(500+i)), fence(tStrict, 2); f != tok || g != tok || h != tok {
					t.Errorf("token %d: fences %d (updated), %d (inserted), %d (strict); want the token", tok, f, g, h)
				}
			}
			// Stale, equal under strict, no token at all, and invalid ones.
			setTokenN(t, c, 65)
			fails("FP001", "upd", int64(2))
			setTokenN(t, c, 9223372036854775001)
			fails("FP001", "strict")
			resetToken(t, c)
			fails("FP002", "norow")
			fails("FP002", "upd", int64(2))
			fails("FP002", "ins", int64(600))
			for _, bad := range []string{"", "0", "000", "-5", "12abc", " 7", "9223372036854775808", "99999999999999999999"} {
				setToken(t, c, bad)
				fails("FP002", "norow")
				fails("FP002", "upd", int64(2))
				fails("FP002", "ins", int64(600))
			}
			if f := fence(tError, 2); f != 9223372036854775001 {
				t.Errorf("row 2 after the refused writes: fence %d, want 9223372036854775001", f)
			}
			var n int
			if err := d.QueryRow(ctx, "SELECT count(*) FROM acct WHERE id = 600").Scan(&n); err != nil || n != 0 {
				t.Errorf("the refused insert: %d rows, %v", n, err)
			}
		})
	}
}

// TestRaisersPreparedKeptOverReload: a reload that changes nothing keeps a
// named prepared statement as the server has it — decided again in the
// parameter form, it is what was sent, so it is not prepared again.
func TestRaisersPreparedKeptOverReload(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startRaisersEnv(t)
	db := e.newDB(t)
	c, d := e.connect(t, db), direct(t, db)
	ctx := ctxT(t)
	if _, err := c.Prepare(ctx, "upd", "UPDATE acct SET n = n + 1 WHERE id = $1"); err != nil {
		t.Fatal(err)
	}
	prepared := func() (sql string, at time.Time) {
		t.Helper()
		if err := c.QueryRow(ctx, "SELECT statement, prepare_time FROM pg_prepared_statements WHERE name = 'upd'").Scan(&sql, &at); err != nil {
			t.Fatal(err)
		}
		return sql, at
	}
	setTokenN(t, c, 60)
	if _, err := c.Exec(ctx, "upd", 2); err != nil {
		t.Fatal(err)
	}
	sql0, at0 := prepared()
	if !tokenParam(sql0) {
		t.Fatalf("not the parameter form: %s", sql0)
	}
	// A named Parse that runs a SQL PREPARE: the proxy records the SQL-level
	// statement as decided for a Query's text, so the server gets that form.
	if _, err := c.Prepare(ctx, "pq", "PREPARE q AS UPDATE acct SET n = n + 1 WHERE id = 3"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "pq"); err != nil {
		t.Fatal(err)
	}
	var qsql string
	if err := c.QueryRow(ctx, "SELECT statement FROM pg_prepared_statements WHERE name = 'q'").Scan(&qsql); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(qsql, "fenceproxy.advance(") || strings.Contains(qsql, rules.ShortTokenPattern()) {
		t.Errorf("SQL-level statement prepared through a named Parse: %s", qsql)
	}
	again, err := rules.Compile(testRules)
	if err != nil {
		t.Fatal(err)
	}
	e.pol.Swap(again, false)
	setTokenN(t, c, 70)
	if _, err := c.Exec(ctx, "upd", 2); err != nil {
		t.Fatal(err)
	}
	if sql1, at1 := prepared(); sql1 != sql0 || !at1.Equal(at0) {
		t.Errorf("the statement was prepared again after a reload that changed nothing:\n%s (%v)\n%s (%v)", sql0, at0, sql1, at1)
	}
	if _, err := c.Exec(ctx, "EXECUTE q", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Errorf("EXECUTE q after a reload that changed nothing: %v", err)
	}
	var fence int64
	if err := d.QueryRow(ctx, "SELECT last_fence FROM acct WHERE id = 2").Scan(&fence); err != nil || fence != 70 {
		t.Errorf("fence after the reload: %d, %v; want 70", fence, err)
	}
}
