package policy_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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

	// A fresh write: fenced, through the raisers' form.
	setToken(t, cF, "60")
	if _, err := cF.Exec(ctxT(t), "UPDATE acct SET n = n + 1 WHERE id = 2", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	if q := pid2query(t, dF, pid); !strings.Contains(q, "fenceproxy.advance(") || !strings.Contains(q, "fenceproxy.tok_b(") || strings.Contains(q, "'fenceproxy:stale:'") {
		t.Fatalf("the proxy did not send the raisers' form: %s", q)
	}
	var fence int64
	if err := dF.QueryRow(ctxT(t), "SELECT last_fence FROM acct WHERE id = 2").Scan(&fence); err != nil || fence != 60 {
		t.Fatalf("fence of the written row: %d, %v; want 60", fence, err)
	}

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
	// inline form once the database has been checked again.
	if _, err := dF.Exec(ctxT(t), "DROP FUNCTION fenceproxy.advance(text, bigint, boolean, text, text)"); err != nil {
		t.Fatal(err)
	}
	setToken(t, cF, "60")
	o := run(cF, "60", "UPDATE acct SET n = n + 1 WHERE id = 2", pgx.QueryExecModeSimpleProtocol)
	if !strings.Contains(o.msg, "error raisers") || !strings.Contains(o.detail, "fenceproxy.advance") {
		t.Errorf("write after the raisers were dropped: %+v", o)
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
	if err := dF.QueryRow(ctxT(t), "SELECT n FROM acct WHERE id = 2").Scan(&n); err != nil || n != 2 {
		t.Errorf("n of row 2: %d, %v; want 2 (the write before the drop and the one after the recheck)", n, err)
	}
	if o := run(cF, "40", "UPDATE acct SET n = n + 1 WHERE id = 1", pgx.QueryExecModeSimpleProtocol); o.code != "FP001" {
		t.Errorf("stale write with the inline form: %+v", o)
	}
}
