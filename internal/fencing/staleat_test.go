package fencing_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestStaleAtErrors: in a database with objects version 5, a simple Query
// sent in its token form raises a stale row's error with
// fenceproxy.stale_at, whose message has the watermark only, and the proxy
// fills in the token and the table. Pipelined Queries of other tables or
// tokens, sent while one of those may still raise, go in the form that
// reads the token on the server, and every error names its own table,
// token and watermark. What the proxy sent is read in pg_stat_activity
// (while the first statement of a pipeline waits for its table, and after
// the last); the rows are unchanged after.
func TestStaleAtErrors(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startRaisersEnv(t)
	db := e.newDB(t)
	d := direct(t, db)
	ctx := ctxT(t)
	resetTable(t, d, tError)
	setFences(t, d, tError, map[int64]int64{1: 42, 2: 50})
	setFences(t, d, `"Config"`, map[int64]int64{1: 60})

	c := e.connect(t, db)
	setTokenN(t, c, 41)
	var pid int
	if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	// hold locks a table against writes until release: a write waits for
	// it as it opens the table, before it reads a row (a stale row raises
	// before the write would wait for a row lock).
	hold := func(table string) (release func()) {
		h := direct(t, db)
		tx, err := h.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "LOCK TABLE "+table+" IN SHARE MODE"); err != nil {
			t.Fatal(err)
		}
		return func() { _ = tx.Rollback(ctx) }
	}
	last := func() string { t.Helper(); return pid2query(t, d, pid) }
	// blocked waits for the proxy's backend to wait for a lock, and
	// returns the text it waits in, which must hold want.
	blocked := func(want string) string {
		t.Helper()
		waitingOnLock(t, d, uint32(pid))
		q := last()
		if !strings.Contains(q, want) {
			t.Fatalf("the proxy's backend waits in %q, want a text with %q", q, want)
		}
		return q
	}
	fe := c.PgConn().Frontend()
	send := func(sqls ...string) { t.Helper(); sendQueries(t, fe, sqls...) }
	// answers reads n Queries' answers and returns their errors.
	answers := func(n int) []string {
		t.Helper()
		var errs []string
		for ready := 0; ready < n; {
			msg, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := msg.(type) {
			case *pgproto3.ErrorResponse:
				errs = append(errs, m.Code+" "+m.Message)
			case *pgproto3.ReadyForQuery:
				ready++
			}
		}
		return errs
	}
	staleMsg := func(tok, table, w string) string {
		return rules.CodeStaleToken + " fenceproxy: stale fencing token " + tok + " for table " + table + " (stored watermark " + w + ")"
	}
	check := func(got []string, want ...string) {
		t.Helper()
		if strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Errorf("errors:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}

	// Each text is sent once: the proxy here runs a repeated text as a
	// prepared statement of its own (auto_prepare), which has no token
	// form.
	t.Run("alone", func(t *testing.T) {
		release := hold(tError)
		send("UPDATE acct SET n = n + 1 WHERE id = 1")
		if q := blocked("UPDATE acct"); !strings.Contains(q, "fenceproxy.stale_at(") || !strings.Contains(q, "'41'::bigint") {
			t.Errorf("sent without stale_at, or without the token written in:\n%s", q)
		}
		release()
		check(answers(1), staleMsg("41", "public.acct", "42"))
	})

	// In the pipelines below, the first statement waits for the table
	// while the proxy reads and sends the next; the proxy's backend is
	// then seen waiting in the first, and the last one's text is read
	// once everything is answered. The pause before the table is released
	// gives the proxy time to send the second while the first waits.
	const pause = 300 * time.Millisecond

	t.Run("pipelined, same table and token", func(t *testing.T) {
		release := hold(tError)
		send("UPDATE acct SET n = n + 2 WHERE id = 1", "UPDATE acct SET n = n + 2 WHERE id = 2")
		blocked("id = 1")
		time.Sleep(pause)
		release()
		check(answers(2), staleMsg("41", "public.acct", "42"), staleMsg("41", "public.acct", "50"))
		// The second was sent while the first could still raise: for the
		// same token and table, it calls stale_at too.
		if q := last(); !strings.Contains(q, "id = 2") || !strings.Contains(q, "fenceproxy.stale_at(") {
			t.Errorf("the second statement of the same pair was sent without stale_at:\n%s", q)
		}
	})

	t.Run("pipelined, another table", func(t *testing.T) {
		release := hold(tError)
		send("UPDATE acct SET n = n + 3 WHERE id = 1", `UPDATE "Config" SET n = n + 3 WHERE id = 1`)
		blocked("UPDATE acct")
		time.Sleep(pause)
		release()
		check(answers(2), staleMsg("41", "public.acct", "42"), staleMsg("41", `public."Config"`, "60"))
		if q := last(); !strings.Contains(q, `UPDATE "Config"`) || strings.Contains(q, "stale_at") || strings.Contains(q, "'41'::bigint") {
			t.Errorf("a statement of another table, sent while the first could raise, is not in the form that reads the token:\n%s", q)
		}
	})

	t.Run("pipelined, another token", func(t *testing.T) {
		release := hold(tError)
		send("UPDATE acct SET n = n + 4 WHERE id = 1", "SET fence.token = '45'", "UPDATE acct SET n = n + 4 WHERE id = 2", "SET fence.token = '41'")
		blocked("id = 1")
		time.Sleep(pause)
		release()
		check(answers(4), staleMsg("41", "public.acct", "42"), staleMsg("45", "public.acct", "50"))
	})

	t.Run("after the pipelines", func(t *testing.T) {
		// Every statement answered: the next pair may be any.
		send(`UPDATE "Config" SET n = n + 5 WHERE id = 1`)
		check(answers(1), staleMsg("41", `public."Config"`, "60"))
		if q := last(); !strings.Contains(q, `UPDATE "Config"`) || !strings.Contains(q, "fenceproxy.stale_at(") {
			t.Errorf("sent without stale_at once idle:\n%s", q)
		}
	})

	// Nothing was written.
	var n, changed int
	if err := d.QueryRow(context.WithoutCancel(ctx), `SELECT (SELECT sum(n) FROM acct) + (SELECT sum(n) FROM "Config"),
		(SELECT count(*) FROM acct WHERE (id, last_fence) NOT IN ((1, 42), (2, 50), (3, 0)))`).Scan(&n, &changed); err != nil {
		t.Fatal(err)
	}
	if n != 0 || changed != 0 {
		t.Errorf("after stale writes: n summed %d, %d rows' watermarks changed", n, changed)
	}
}

// sendQueries sends sqls as simple Queries in one write, without waiting
// for their answers (a pipeline of simple Queries).
func sendQueries(t testing.TB, fe *pgproto3.Frontend, sqls ...string) {
	t.Helper()
	for _, s := range sqls {
		fe.Send(&pgproto3.Query{String: s})
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
}

// TestStaleAtOlderObjects: in a database whose objects are of version 4
// (no stale_at), the token form raises a stale row through
// fenceproxy.stale, whose error names the token and the table itself, and
// the client sees the same error.
func TestStaleAtOlderObjects(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startRaisersEnv(t)
	db := e.newDB(t)
	d := direct(t, db)
	ctx := ctxT(t)
	// Before the proxy's first check of the database.
	if _, err := d.Exec(ctx, `DROP FUNCTION fenceproxy.stale_at_b(bigint), fenceproxy.stale_at(bigint);
		UPDATE fenceproxy.meta SET value = '4' WHERE key = 'version'`); err != nil {
		t.Fatal(err)
	}
	resetTable(t, d, tError)
	setFences(t, d, tError, map[int64]int64{1: 42})
	c := e.connect(t, db)
	setTokenN(t, c, 41)
	var pid int
	if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	_, err := c.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1")
	if pe := wantPgError(t, err, rules.CodeStaleToken); pe != nil && pe.Message != "fenceproxy: stale fencing token 41 for table public.acct (stored watermark 42)" {
		t.Errorf("message %q", pe.Message)
	}
	if q := pid2query(t, d, pid); !strings.Contains(q, "'41'::bigint ELSE fenceproxy.stale('fence.token', acct.last_fence, '11:public.acct')") {
		t.Errorf("sent without the token form of version 4 objects:\n%s", q)
	}
	var n int
	if err := d.QueryRow(ctx, "SELECT n FROM acct WHERE id = 1").Scan(&n); err != nil || n != 0 {
		t.Errorf("the stale row: n = %d, %v", n, err)
	}
}
