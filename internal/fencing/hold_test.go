package fencing_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestHoldDropped: fenceproxy.hold dropped while the proxy runs. The
// lock-fenced write that calls it fails with nothing of it written, the
// database is checked again, and registrations go back to
// fenceproxy.register, which still refuses a stale holder. In both
// protocols: a simple Query's registration is spliced in front of it, a
// prepared statement's is sent before its Bind.
func TestHoldDropped(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, _ := startChecker(t, lockRules)
	e := startLockEnvWith(t, policy.Options{Checks: checker})
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			db := newLockDB(t, true)
			d := direct(t, db)
			c := e.holder(t, db, "L", 7, mode)
			var pid int
			if err := c.QueryRow(ctxT(t), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				t.Fatal(err)
			}
			const write = "UPDATE jobs SET state = state || 'x' WHERE id = 1"
			mustExec(t, c, write)
			if q := pid2query(t, d, pid); mode == pgx.QueryExecModeSimpleProtocol && !strings.Contains(q, "CALL fenceproxy.hold(") {
				t.Fatalf("sent %s; want the registration calling fenceproxy.hold", q)
			}
			mustExec(t, d, "DROP PROCEDURE fenceproxy.hold(text, text, boolean, boolean, text, text)")

			// The proxy learns of the drop from the failed call (this
			// database has no catalog watch to tell it sooner).
			writeUntilRecheck(t, c, "fenceproxy.hold", write)
			written := 2
			if q := pid2query(t, d, pid); mode == pgx.QueryExecModeSimpleProtocol && !strings.Contains(q, "CALL fenceproxy.register(") {
				t.Errorf("after the recheck, sent %s; want the registration calling fenceproxy.register", q)
			}

			// A newer holder registers; the older one is refused, through
			// register now, and writes nothing.
			mustExec(t, e.holder(t, db, "L", 8, mode), "SELECT state FROM jobs WHERE id = 1")
			var pe *pgconn.PgError
			if _, err := c.Exec(ctxT(t), write); !errors.As(err, &pe) || pe.Code != "FP001" {
				t.Errorf("stale holder after the drop: %v, want FP001", err)
			}
			var state string
			if err := d.QueryRow(ctxT(t), "SELECT state FROM jobs WHERE id = 1").Scan(&state); err != nil || state != "queued"+strings.Repeat("x", written) {
				t.Errorf("jobs row: %q, %v; want %d writes", state, err, written)
			}
		})
	}
}

// writeUntilRecheck runs write on c, with args, after proc was dropped,
// until the proxy's new check lets it through: each try before that must
// fail with the 42883 saying proc was removed, writing nothing, and at
// least one must (the first write after the drop calls it). One write
// lands.
func writeUntilRecheck(t *testing.T, c *pgx.Conn, proc, write string, args ...any) {
	t.Helper()
	refused := 0
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, err := c.Exec(ctxT(t), write, args...)
		if err == nil {
			break
		}
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "42883" || !strings.Contains(pe.Message, proc+" was removed") {
			t.Fatalf("after the drop: %v, want 42883 saying %s was removed", err, proc)
		}
		refused++
		if time.Now().After(deadline) {
			t.Fatalf("writes still fail after the recheck: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if refused == 0 {
		t.Errorf("no write was refused after the drop of %s", proc)
	}
}

// callCounts reads, in c's open transaction, how often it called the
// procedures of the fenceproxy schema (track_functions 'pl'), as
// "enter=1 hold=1" (names in order, those not called left out). The
// server keeps a session's counts until it reports them, at most once a
// second, and shows those of earlier transactions until then: c should
// be a new session.
func callCounts(t *testing.T, c *pgx.Conn) string {
	t.Helper()
	var s string
	if err := c.QueryRow(ctxT(t), `SELECT coalesce(string_agg(funcname || '=' || calls, ' ' ORDER BY funcname), '')
		FROM pg_stat_xact_user_functions WHERE schemaname = 'fenceproxy'`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// countedWrites runs write, a statement of one parameter, with each id
// in a transaction of a new session holding lock with token tok, in the
// extended protocol, and returns the calls of callCounts after each.
func (e *lockEnv) countedWrites(t *testing.T, db, lock string, tok int64, write string, ids ...int) []string {
	t.Helper()
	c := e.enterHolder(t, db, lock, tok)
	defer c.Close(ctxT(t))
	mustExec(t, c, "BEGIN")
	var out []string
	for _, id := range ids {
		mustExec(t, c, write, id)
		out = append(out, callCounts(t, c))
	}
	mustExec(t, c, "COMMIT")
	return out
}

// enterHolder connects through the proxy as a holder of lock with token
// tok in the extended protocol (prepared statements), counting its calls
// of PL/pgSQL procedures.
func (e *lockEnv) enterHolder(t *testing.T, db, lock string, tok int64) *pgx.Conn {
	t.Helper()
	return connectDSN(t, e.proxy.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
		c.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
		c.RuntimeParams["fence.lock"] = lock
		c.RuntimeParams["fence.token"] = fmt.Sprint(tok)
		c.RuntimeParams["track_functions"] = "pl"
	})
}

// TestEnterUsed: where the database has fenceproxy.enter, a prepared
// statement's fence settings and lock registration go before its Bind as
// one call of it (hold called from it, register not), once per
// transaction; a stale holder is refused through it and writes nothing,
// and the statement runs with the session's token, not one the server
// connection carries.
func TestEnterUsed(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, _ := startChecker(t, lockRules)
	e := startLockEnvWith(t, policy.Options{Checks: checker})
	db := newLockDB(t, true)
	d := direct(t, db)
	const write = "UPDATE acct SET n = n + 1 WHERE id = $1"
	// The first registration of a token moves the watermark: register's.
	if got := e.countedWrites(t, db, "L", 7, write, 1); got[0] != "enter=1 hold=1 register=1" {
		t.Errorf("first write of token 7: %s, want enter=1 hold=1 register=1", got[0])
	}
	// Then hold's common case; the second write of the transaction, of
	// the same lock and token, has its registration spared, and only the
	// settings go before its Bind.
	got := e.countedWrites(t, db, "L", 7, write, 1, 2)
	if want := []string{"enter=1 hold=1", "enter=1 hold=1"}; !slices.Equal(got, want) {
		t.Errorf("two writes in a transaction: %q, want %q", got, want)
	}
	c := e.enterHolder(t, db, "L", 7)

	// A newer holder registers; the older one is refused and writes
	// nothing, in a transaction of its own and in an explicit one.
	mustExec(t, e.enterHolder(t, db, "L", 8), write, 3)
	var pe *pgconn.PgError
	if _, err := c.Exec(ctxT(t), write, 1); !errors.As(err, &pe) || pe.Code != "FP001" {
		t.Errorf("stale holder: %v, want FP001", err)
	}
	mustExec(t, c, "BEGIN")
	if _, err := c.Exec(ctxT(t), write, 2); !errors.As(err, &pe) || pe.Code != "FP001" {
		t.Errorf("stale holder in a transaction: %v, want FP001", err)
	}
	mustExec(t, c, "ROLLBACK")
	var acct string
	if err := d.QueryRow(ctxT(t), "SELECT string_agg(id || '|' || payload || '|' || n || '|' || last_fence, ';' ORDER BY id) FROM acct").Scan(&acct); err != nil {
		t.Fatal(err)
	}
	if acct != "1|a|2|7;2|b|1|7;3|c|1|8" {
		t.Errorf("acct: %s; want rows 1 and 2 written with token 7 (twice, once), row 3 once with 8", acct)
	}
}

// TestEnterDropped: fenceproxy.enter dropped while the proxy runs. The
// prepared statement whose Bind it goes before fails with nothing of it
// written, the database is checked again, and the relay sends the
// settings and the registration as statements of their own, which still
// refuse a stale holder.
func TestEnterDropped(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, _ := startChecker(t, lockRules)
	e := startLockEnvWith(t, policy.Options{Checks: checker})
	db := newLockDB(t, true)
	d := direct(t, db)
	// With a parameter: pgx sends a statement without one as a simple
	// Query.
	const write = "UPDATE jobs SET state = state || 'x' WHERE id = $1"
	if got := e.countedWrites(t, db, "L", 7, write, 1); got[0] != "enter=1 hold=1 register=1" {
		t.Errorf("before the drop: %s, want enter=1 hold=1 register=1", got[0])
	}
	c := e.enterHolder(t, db, "L", 7)
	mustExec(t, c, write, 1)
	mustExec(t, d, "DROP PROCEDURE fenceproxy.enter(text, text, text, text, bigint, boolean, boolean, boolean, text, text)")

	writeUntilRecheck(t, c, "fenceproxy.enter", write, 1)
	written := 3
	if got := e.countedWrites(t, db, "L", 7, write, 1); got[0] != "hold=1" {
		t.Errorf("after the recheck: %s, want hold=1", got[0])
	}
	written++

	mustExec(t, e.enterHolder(t, db, "L", 8), "SELECT state FROM jobs WHERE id = $1", 1)
	var pe *pgconn.PgError
	if _, err := c.Exec(ctxT(t), write, 1); !errors.As(err, &pe) || pe.Code != "FP001" {
		t.Errorf("stale holder after the drop: %v, want FP001", err)
	}
	var state string
	if err := d.QueryRow(ctxT(t), "SELECT state FROM jobs WHERE id = 1").Scan(&state); err != nil || state != "queued"+strings.Repeat("x", written) {
		t.Errorf("jobs row: %q, %v; want %d writes", state, err, written)
	}
}
