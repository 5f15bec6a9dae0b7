package fencing_test

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// The session's values before a Bind are left out where the statement's
// parameter form carries the token, nothing else the Bind's implicit
// transaction runs reads a fence setting, and the database check found no
// code that may read one (internal/proxy/bare.go). These tests read what
// the server ran from its log (log_statement = all in the test's
// database) and check the data; behind a transaction pooler, the error a
// stale write gets, whose message reads the setting on the server.

// bindDB is preludeDB with every statement of its sessions logged.
func bindDB(t *testing.T, extra string) (string, *pgx.Conn) {
	t.Helper()
	_, specs := raPolicy(t, lockRules)
	db, d := preludeDB(t, specs, extra)
	execDirect(t, d, `ALTER DATABASE "`+db+`" SET log_statement = 'all'`)
	return db, d
}

// bindSession connects to db through p with lock lk and token tok, in
// pgx's default mode: named statements, prepared once, each use a Bind,
// Describe, Execute and Sync.
func bindSession(t *testing.T, p *proxytest.Proxy, db, lk, tok string) *pgx.Conn {
	t.Helper()
	return runPid(t, readerSession(t, p, db, lk, tok, pgx.QueryExecModeCacheStatement))
}

// logSize is the server log's size: serverRan reads what is logged after.
func logSize(t *testing.T) int64 {
	t.Helper()
	fi, err := os.Stat(cluster.LogFile())
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

// serverRan returns the lines the server logged for c's backend after
// offset off (its statements, their parameters and errors).
func serverRan(t *testing.T, c *pgx.Conn, off int64) []string {
	t.Helper()
	pid, ok := sessionPids.Load(c)
	if !ok {
		t.Fatal("test bug: serverRan on a session that runPid did not mark")
	}
	f, err := os.Open(cluster.LogFile())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	mark := fmt.Sprintf("[%d] ", pid)
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if _, rest, ok := strings.Cut(sc.Text(), mark); ok {
			out = append(out, rest)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// bindRan runs stmt with args on c and returns what the server ran for
// it, and its error. A statement refused because the catalog changed
// since the last check (FP003, which a client retries) is sent again.
func bindRan(t *testing.T, c *pgx.Conn, stmt string, args ...any) ([]string, error) {
	t.Helper()
	for i := 0; ; i++ {
		off := logSize(t)
		_, err := c.Exec(ctxT(t), stmt, args...)
		if sqlState(err) != "FP003" || i == 100 {
			return serverRan(t, c, off), err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// mustBindRan is bindRan for a statement that must succeed.
func mustBindRan(t *testing.T, c *pgx.Conn, stmt string, args ...any) []string {
	t.Helper()
	ran, err := bindRan(t, c, stmt, args...)
	if err != nil {
		t.Fatalf("%s: %v", stmt, err)
	}
	return ran
}

// bare reports whether ran shows the client's statement, in its
// parameter form, run after the catalog check alone: without the
// session's values (set_config, or fenceproxy.enter, which sets them).
func bare(t *testing.T, ran []string) bool {
	t.Helper()
	all := strings.Join(ran, "\n")
	if !strings.Contains(all, "::bigint") || !strings.Contains(all, "fenceproxy.catalog_at(") && !strings.Contains(all, "fenceproxy.enter(") &&
		!strings.Contains(all, "hold_at(") {
		t.Fatalf("the server ran no fenced statement after a catalog check:\n%s", all)
	}
	return !strings.Contains(all, "set_config(") && !strings.Contains(all, "fenceproxy.enter(")
}

func TestBindPreludeLeftOut(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, "")
	row := bindSession(t, p, db, "", "7")

	const upd = "UPDATE acct SET n = n + 1 WHERE id = $1"
	for i := range 2 {
		ran := mustBindRan(t, row, upd, 1)
		if !bare(t, ran) {
			t.Errorf("use %d: the session's values went before the Bind:\n%s", i+1, strings.Join(ran, "\n"))
		}
		if !strings.Contains(strings.Join(ran, "\n"), "= '7'") {
			t.Errorf("use %d: token 7 not among the bound parameters:\n%s", i+1, strings.Join(ran, "\n"))
		}
	}
	if ran := mustBindRan(t, row, "INSERT INTO acct (id, payload) VALUES ($1, 'i')", 70); !bare(t, ran) {
		t.Errorf("INSERT: the session's values went before the Bind")
	}
	got := snapshot(t, d, "acct")
	if r := got[1]; r.N != 2 || r.Fence != 7 {
		t.Errorf("row 1 = %+v, want n 2, fence 7", r)
	}
	if r := got[70]; r.Fence != 7 {
		t.Errorf("row 70 = %+v, want fence 7", r)
	}

	// A stale holder's write: refused, with its own token in the error.
	stale := bindSession(t, p, db, "", "5")
	before := tableText(t, d, "acct")
	ran, err := bindRan(t, stale, "UPDATE acct SET payload = 'stale' WHERE id = $1", 1)
	if sqlState(err) != "FP001" || !strings.Contains(err.Error(), "stale fencing token 5 ") {
		t.Errorf("stale UPDATE: %v, want FP001 for token 5", err)
	}
	if !bare(t, ran) {
		t.Errorf("stale UPDATE: the session's values went before the Bind")
	}
	if after := tableText(t, d, "acct"); after != before {
		t.Errorf("a stale UPDATE changed acct:\n before %s\n after  %s", before, after)
	}

	// What may read a setting keeps them: the text, an audit record (it
	// reads the token), a lock registration.
	for _, c := range []struct {
		name string
		conn *pgx.Conn
		stmt string
	}{
		{"a text naming the setting", row, "UPDATE acct SET payload = current_setting('fence.token') WHERE id = $1"},
		{"an audited table", row, "UPDATE aud SET body = 'x' WHERE id = $1"},
	} {
		if ran := mustBindRan(t, c.conn, c.stmt, 2); bare(t, ran) {
			t.Errorf("%s: the Bind went without the session's values:\n%s", c.name, strings.Join(ran, "\n"))
		}
	}
	// A lock registration reads them, unless it takes them as values:
	// one call of hold_at (holdat_test.go).
	if ran := mustBindRan(t, bindSession(t, p, db, "L", "7"), "UPDATE acct SET n = n + 1 WHERE id = $1", 2); !byValue(t, ran) {
		t.Errorf("a lock registration: want one call of hold_at:\n%s", strings.Join(ran, "\n"))
	}
	if r := snapshot(t, d, "acct")[2]; r.Payload != "7" || r.Fence != 7 {
		t.Errorf("row 2 = %+v, want payload 7 (the token read), fence 7", r)
	}

	// Two statements before one Sync: a later one could read what the
	// first set, so both keep them.
	off := logSize(t)
	b := &pgx.Batch{}
	b.Queue(upd, 1)
	b.Queue(upd, 2)
	if err := row.SendBatch(ctxT(t), b).Close(); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(strings.Join(serverRan(t, row, off), "\n"), "fenceproxy.enter("); n != 2 {
		t.Errorf("a batch of two: %d calls setting the session's values, want 2", n)
	}
	// In an explicit transaction, too.
	tx, err := row.Begin(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	off = logSize(t)
	if _, err := tx.Exec(ctxT(t), upd, 3); err != nil {
		t.Fatal(err)
	}
	if bare(t, serverRan(t, row, off)) {
		t.Errorf("in a transaction block: the Bind went without the session's values")
	}
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}

	// Code created later that reads the setting brings them back once the
	// proxy has learnt of it; dropped, they go again.
	execDirect(t, d, `CREATE FUNCTION tok_now() RETURNS text LANGUAGE sql STABLE AS $$SELECT current_setting('fence.token', true)$$`)
	waitBare(t, row, false)
	execDirect(t, d, `DROP FUNCTION tok_now()`)
	waitBare(t, row, true)
}

// waitBare runs a row-fenced UPDATE on c until whether it goes without
// the session's values is want, for up to ten seconds.
func waitBare(t *testing.T, c *pgx.Conn, want bool) {
	t.Helper()
	waitUntil(t, fmt.Sprintf("after the catalog change, going without the session's values %v", want), func() bool {
		return bare(t, mustBindRan(t, c, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)) == want
	})
}

// TestBindPreludeBehindPooler: fenceproxy → PgBouncer (transaction mode,
// one server connection, so that named statements stay on it) →
// PostgreSQL, with the database check. The connection carries another
// client's token 43. Where no code reads the settings, Binds go without
// them: the fences carry each session's token, and a stale write's error
// names the session's token, not the connection's; where a trigger reads
// the token, it sees the session's.
func TestBindPreludeBehindPooler(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	pe := startPoolerEnvSized(t, pol, 1)
	session := func(db, tok string) *pgx.Conn {
		t.Helper()
		c := pe.session(t, db, pgx.QueryExecModeCacheStatement)
		if tok != "" {
			if _, err := c.Exec(ctxT(t), "SET fence.token = '"+tok+"'", pgx.QueryExecModeSimpleProtocol); err != nil {
				t.Fatal(err)
			}
		}
		return runPid(t, c)
	}

	t.Run("no code reads the settings", func(t *testing.T) {
		db, d := bindDB(t, "")
		before := poolerReset(t, d)
		// The sessions' SETs go to the one connection: it is polluted
		// after them.
		stale, fresh, none := session(db, "41"), session(db, "44"), session(db, "")
		pe.pollute(t, db, "43", "X")
		ran, err := bindRan(t, stale, "UPDATE acct SET payload = 'stale' WHERE id = $1", 1)
		if sqlState(err) != "FP001" || !strings.Contains(err.Error(), "stale fencing token 41 ") {
			t.Errorf("stale write behind the pooler: %v, want FP001 naming token 41 (never the connection's 43)", err)
		}
		if !bare(t, ran) {
			t.Errorf("the stale write's Bind carried the session's values")
		}
		wantUnchanged(t, d, "acct", before)
		for _, id := range []int64{2, 3} {
			if ran := mustBindRan(t, fresh, "UPDATE acct SET payload = 'w44' WHERE id = $1", id); !bare(t, ran) {
				t.Errorf("row %d: the Bind carried the session's values", id)
			}
		}
		got := snapshot(t, d, "acct")
		for _, id := range []int64{2, 3} {
			if r := got[id]; r.Payload != "w44" || r.Fence != 44 {
				t.Errorf("row %d = %+v, want payload w44 stamped 44", id, r)
			}
		}
		if _, err := bindRan(t, none, "UPDATE acct SET payload = 'none' WHERE id = $1", 3); sqlState(err) != "FP002" {
			t.Errorf("a session with no token on a connection carrying 43: %v, want FP002", err)
		}
		if r := snapshot(t, d, "acct")[3]; r.Payload != "w44" {
			t.Errorf("row 3 = %+v after the write without a token", r)
		}
	})

	t.Run("a trigger reads the token", func(t *testing.T) {
		db, d := bindDB(t, noteTokSchema)
		poolerReset(t, d)
		execDirect(t, d, "DELETE FROM seen")
		fresh := session(db, "44")
		pe.pollute(t, db, "43", "X")
		if ran := mustBindRan(t, fresh, "UPDATE acct SET payload = 'w44' WHERE id = $1", 2); bare(t, ran) {
			t.Errorf("a database whose trigger reads the token: the Bind went without the session's values")
		}
		if seen := seenToks(t, d); len(seen) != 1 || seen[0] != "44" {
			t.Errorf("the trigger saw %q, want the session's own token [44]", seen)
		}
	})
}

// TestBindPreludeUnwatched: in a database without the catalog watch no
// check goes before a write, so a bare Bind goes alone: the fences carry
// the token, and a stale write is refused naming its own token.
func TestBindPreludeUnwatched(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, "")
	execDirect(t, d, "DROP EVENT TRIGGER fenceproxy_catalog_ddl; DROP EVENT TRIGGER fenceproxy_catalog_drop")
	row := bindSession(t, p, db, "", "7")
	alone := func(ran []string) bool {
		all := strings.Join(ran, "\n")
		if !strings.Contains(all, "::bigint") {
			t.Fatalf("the server ran no fenced statement:\n%s", all)
		}
		return !strings.Contains(all, "set_config(") && !strings.Contains(all, "fenceproxy.enter(") && !strings.Contains(all, "catalog_at(")
	}
	if ran := mustBindRan(t, row, "UPDATE acct SET n = n + 1 WHERE id = $1", 1); !alone(ran) {
		t.Errorf("unwatched: something went before the Bind:\n%s", strings.Join(ran, "\n"))
	}
	if r := snapshot(t, d, "acct")[1]; r.N != 1 || r.Fence != 7 {
		t.Errorf("row 1 = %+v, want n 1, fence 7", r)
	}
	stale := bindSession(t, p, db, "", "5")
	before := tableText(t, d, "acct")
	ran, err := bindRan(t, stale, "UPDATE acct SET payload = 'stale' WHERE id = $1", 1)
	if sqlState(err) != "FP001" || !strings.Contains(err.Error(), "stale fencing token 5 ") || !alone(ran) {
		t.Errorf("stale UPDATE, unwatched: %v (alone: %v), want FP001 for token 5", err, alone(ran))
	}
	if after := tableText(t, d, "acct"); after != before {
		t.Errorf("a stale UPDATE changed acct:\n before %s\n after  %s", before, after)
	}
}
