package fencing_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// A simple-protocol fenced write a session sends again runs as the
// proxy's own prepared statement (internal/proxy/autoprepare.go). These tests check
// that it is fenced exactly as the Query would be, across everything that
// can take the statement away or change the rules under it, and that the
// rows say so.

// simpleConn connects through e's proxy with a pgx that sends every
// statement as a simple Query (no statement cache of its own to lose to a
// DEALLOCATE ALL).
func simpleConn(t testing.TB, e *env, db string) *pgx.Conn {
	t.Helper()
	return e.connect(t, db, func(cfg *pgx.ConnConfig) { cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol })
}

// simple sends sql as one simple-protocol Query on c.
func simple(t testing.TB, c *pgx.Conn, sql string) error {
	t.Helper()
	_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
	return err
}

func mustSimple(t testing.TB, c *pgx.Conn, sql string) {
	t.Helper()
	if err := simple(t, c, sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// autoStatements lists the proxy's own statements in c's session: their
// texts, as the server has them.
func autoStatements(t testing.TB, c *pgx.Conn) []string {
	t.Helper()
	return testutil.QueryStrings(t, c, "SELECT statement FROM pg_prepared_statements WHERE name LIKE 'fenceproxy\\_auto\\_%' ORDER BY statement")
}

// wantAcct checks row id of acct, read directly: n and the fence.
func wantAcct(t testing.TB, d *pgx.Conn, id, n int, fence int64) {
	t.Helper()
	if r := snapshot(t, d, "acct")[int64(id)]; int(r.N) != n || r.Fence != fence {
		t.Fatalf("acct %d: n=%d fence=%d, want n=%d fence=%d", id, r.N, r.Fence, n, fence)
	}
}

// startAutoEnv is startEnv (the inline form) with the proxy's own
// prepared statements; startRaisersEnv has them too.
func startAutoEnv(t *testing.T) *env {
	t.Helper()
	return startPolicyEnv(t, policy.Options{}, nil, autoPrepare)
}

func TestAutoPrepare(t *testing.T) {
	t.Parallel()
	for _, form := range []struct {
		name  string
		start func(*testing.T) *env
	}{{"inline", startAutoEnv}, {"raisers", startRaisersEnv}} {
		t.Run(form.name, func(t *testing.T) {
			t.Parallel()
			e := form.start(t)
			t.Run("fenced", func(t *testing.T) { t.Parallel(); testAutoFenced(t, e) })
			t.Run("transactions", func(t *testing.T) { t.Parallel(); testAutoTransactions(t, e) })
			t.Run("statements taken away", func(t *testing.T) { t.Parallel(); testAutoTakenAway(t, e) })
			t.Run("pipelined", func(t *testing.T) { t.Parallel(); testAutoPipelined(t, e) })
			t.Run("not prepared", func(t *testing.T) { t.Parallel(); testAutoNotPrepared(t, e) })
			t.Run("many texts", func(t *testing.T) { t.Parallel(); testAutoManyTexts(t, e) })
		})
	}
}

// testAutoFenced: from the second sighting on, the write runs as the
// proxy's statement, in the prepared form, and refuses what the Query
// would: a stale token, a missing one (with no row matched too), an
// invalid one; and nothing of it is written.
func testAutoFenced(t *testing.T, e *env) {
	db := e.newDB(t)
	c, d := simpleConn(t, e, db), direct(t, db)
	setToken(t, c, "60")
	const upd = "UPDATE acct SET n = n + 1 WHERE id = 1"
	mustSimple(t, c, upd)
	if got := autoStatements(t, c); len(got) != 0 {
		t.Fatalf("after the first sighting: %q", got)
	}
	mustSimple(t, c, upd)
	mustSimple(t, c, upd)
	got := autoStatements(t, c)
	if len(got) != 1 || !strings.HasPrefix(got[0], "UPDATE acct SET n = n + 1") || !strings.Contains(got[0], "OPERATOR(pg_catalog.~) '"+rules.ShortTokenPattern()+"'") {
		t.Fatalf("the proxy's statements: %q; want the UPDATE's prepared form", got)
	}
	wantAcct(t, d, 1, 3, 60)

	// A newer token moves the watermark; an older one is refused.
	setToken(t, c, "70")
	mustSimple(t, c, upd)
	wantAcct(t, d, 1, 4, 70)
	setToken(t, c, "65")
	wantCode(t, simple(t, c, upd), "FP001")
	wantCode(t, simple(t, c, upd), "FP001")
	wantAcct(t, d, 1, 4, 70)

	// Missing and invalid tokens, on a row and on no row.
	const none = "UPDATE acct SET n = n + 1 WHERE id = 12345"
	for _, tok := range []string{"", "12abc", "0", "9223372036854775808", " 80"} {
		if tok == "" {
			resetToken(t, c)
		} else {
			setToken(t, c, tok)
		}
		for range 3 {
			wantCode(t, simple(t, c, upd), "FP002")
			wantCode(t, simple(t, c, none), "FP002")
		}
	}
	wantAcct(t, d, 1, 4, 70)

	// INSERT, upsert, DELETE and MERGE, each three times.
	setToken(t, c, "80")
	for i := range 3 {
		mustSimple(t, c, fmt.Sprintf("INSERT INTO acct (id, payload) VALUES (%d, 'x')", 100+i))
		mustSimple(t, c, "INSERT INTO acct (id, payload) VALUES (2, 'x') ON CONFLICT (id) DO UPDATE SET n = acct.n + 1")
		mustSimple(t, c, "MERGE INTO acct USING src ON acct.id = src.id WHEN MATCHED THEN UPDATE SET payload = 'merged'")
	}
	mustSimple(t, c, "INSERT INTO acct (id, payload) VALUES (200, 'x')")
	for range 2 {
		mustSimple(t, c, "DELETE FROM acct WHERE id = 200")
	}
	rows := snapshot(t, d, "acct")
	if rows[2].N != 3 || rows[2].Fence != 80 || rows[1].Payload != "merged" || rows[1].Fence != 80 || rows[102].Fence != 80 {
		t.Fatalf("rows: %v", rows)
	}
	if _, ok := rows[200]; ok {
		t.Fatalf("row 200 not deleted: %v", rows)
	}
	setToken(t, c, "75")
	for range 2 {
		wantCode(t, simple(t, c, "INSERT INTO acct (id, payload) VALUES (2, 'x') ON CONFLICT (id) DO UPDATE SET n = acct.n + 1"), "FP001")
		wantCode(t, simple(t, c, "MERGE INTO acct USING src ON acct.id = src.id WHEN MATCHED THEN UPDATE SET payload = 'merged'"), "FP001")
		wantCode(t, simple(t, c, "DELETE FROM acct WHERE id = 102"), "FP001")
	}
	wantUnchanged(t, d, "acct", rows)
	if n := len(autoStatements(t, c)); n < 5 {
		t.Fatalf("%d statements of the proxy's; want one per repeated text", n)
	}
}

// testAutoTransactions: the statement runs in the client's transaction
// (rolled back with it), and in a failed one fails as the Query would.
func testAutoTransactions(t *testing.T, e *env) {
	db := e.newDB(t)
	c, d := simpleConn(t, e, db), direct(t, db)
	setToken(t, c, "60")
	const upd = "UPDATE acct SET n = n + 1 WHERE id = 1"
	mustSimple(t, c, upd)
	mustSimple(t, c, upd)
	mustSimple(t, c, "BEGIN")
	mustSimple(t, c, upd)
	mustSimple(t, c, upd)
	mustSimple(t, c, "ROLLBACK")
	wantAcct(t, d, 1, 2, 60)

	mustSimple(t, c, "BEGIN")
	wantCode(t, simple(t, c, "SELECT 1/0"), "22012")
	wantCode(t, simple(t, c, upd), "25P02")
	mustSimple(t, c, "ROLLBACK")
	mustSimple(t, c, upd)
	wantAcct(t, d, 1, 3, 60)

	// A stale write fails the transaction it is in.
	setToken(t, c, "50")
	mustSimple(t, c, "BEGIN")
	mustSimple(t, c, "UPDATE acct SET n = n + 1 WHERE id = 2 AND false")
	wantCode(t, simple(t, c, upd), "FP001")
	wantCode(t, simple(t, c, "SELECT 1"), "25P02")
	mustSimple(t, c, "ROLLBACK")
	wantAcct(t, d, 1, 3, 60)
}

// testAutoTakenAway: DEALLOCATE ALL, DISCARD ALL and a DEALLOCATE or
// Close of the proxy's statement by name cost the client nothing: the
// next sighting prepares it again.
func testAutoTakenAway(t *testing.T, e *env) {
	db := e.newDB(t)
	c, d := simpleConn(t, e, db), direct(t, db)
	setToken(t, c, "60")
	const upd = "UPDATE acct SET n = n + 1 WHERE id = 1"
	want := 0
	run := func() {
		t.Helper()
		mustSimple(t, c, upd)
		want++
		if got := autoStatements(t, c); len(got) != 1 {
			t.Fatalf("after %d runs: %q", want, got)
		}
	}
	mustSimple(t, c, upd)
	want++
	run()
	mustSimple(t, c, "DEALLOCATE ALL")
	run()
	mustSimple(t, c, "DISCARD ALL")
	setToken(t, c, "60")
	run()
	var name string
	if err := c.QueryRow(ctxT(t), "SELECT name FROM pg_prepared_statements WHERE name LIKE 'fenceproxy\\_auto\\_%'").Scan(&name); err != nil {
		t.Fatal(err)
	}
	mustSimple(t, c, "DEALLOCATE "+name)
	run()
	if err := c.PgConn().Deallocate(ctxT(t), name); err != nil { // a Close message
		t.Fatal(err)
	}
	run()
	wantAcct(t, d, 1, want, 60)
}

// testAutoPipelined: Queries sent without waiting for their answers. The
// proxy runs its statement only for a Query sent when nothing is
// unanswered (the first of each batch here) and sends the others as they
// are; every Query gets its own answer, in order, the responses to the
// proxy's own messages never reach the client, and a DEALLOCATE ALL among
// them (after a Parse of the proxy's, before its ParseComplete) costs
// nothing.
func testAutoPipelined(t *testing.T, e *env) {
	db := e.newDB(t)
	c, d := simpleConn(t, e, db), direct(t, db)
	setToken(t, c, "60")
	const upd = "UPDATE acct SET n = n + 1 WHERE id = 1"
	mustSimple(t, c, upd)
	f := c.PgConn().Frontend()
	send := func(sqls ...string) { t.Helper(); sendQueries(t, f, sqls...) }
	// recv reads the answers to n Queries: their command tags, or the
	// SQLSTATE of their errors.
	recv := func(n int) []string {
		t.Helper()
		var out []string
		tag := ""
		for len(out) < n {
			m, err := f.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := m.(type) {
			case *pgproto3.CommandComplete:
				tag = string(m.CommandTag)
			case *pgproto3.ErrorResponse:
				tag = m.Code
			case *pgproto3.ReadyForQuery:
				out = append(out, tag)
				tag = ""
			case *pgproto3.ParseComplete, *pgproto3.BindComplete, *pgproto3.CloseComplete, *pgproto3.NoData:
				t.Fatalf("the client got %T, a response to the proxy's own message", m)
			}
		}
		return out
	}
	send(upd, "DEALLOCATE ALL")
	if got := recv(2); strings.Join(got, ",") != "UPDATE 1,DEALLOCATE ALL" {
		t.Fatalf("answers: %q", got)
	}
	send(upd, upd, "DEALLOCATE ALL", upd, "SELECT 1", upd)
	if got := recv(6); strings.Join(got, ",") != "UPDATE 1,UPDATE 1,DEALLOCATE ALL,UPDATE 1,SELECT 1,UPDATE 1" {
		t.Fatalf("answers: %q", got)
	}
	// A stale one in the middle fails alone.
	setToken(t, c, "50")
	send("SELECT pg_catalog.set_config('fence.token', '70', false)", upd, "SELECT pg_catalog.set_config('fence.token', '65', false)", upd, upd, "SELECT pg_catalog.set_config('fence.token', '70', false)", upd)
	if got := recv(7); strings.Join(got, ",") != "SELECT 1,UPDATE 1,SELECT 1,FP001,FP001,SELECT 1,UPDATE 1" {
		t.Fatalf("answers: %q", got)
	}
	wantAcct(t, d, 1, 8, 70)
}

// testAutoNotPrepared: texts that return rows, have parameters, hold
// several statements or name a prepared statement run as the client sent
// them, however often.
func testAutoNotPrepared(t *testing.T, e *env) {
	db := e.newDB(t)
	c, d := simpleConn(t, e, db), direct(t, db)
	setToken(t, c, "60")
	for range 3 {
		var n int
		if err := c.QueryRow(ctxT(t), "UPDATE acct SET n = n + 1 WHERE id = 1 RETURNING n", pgx.QueryExecModeSimpleProtocol).Scan(&n); err != nil {
			t.Fatal(err)
		}
		mustSimple(t, c, "UPDATE acct SET n = n + 1 WHERE id = 2; UPDATE acct SET n = n + 1 WHERE id = 3")
		mustSimple(t, c, "/* prepare */ UPDATE acct SET n = n + 1 WHERE id = 3")
	}
	// Longer than a session keeps (4 KiB).
	long := "UPDATE acct SET payload = '" + strings.Repeat("x", 4100) + "' WHERE id = 2"
	for range 3 {
		mustSimple(t, c, long)
	}
	wantCode(t, simple(t, c, "UPDATE acct SET n = $1 WHERE id = 1"), "42P02")
	wantCode(t, simple(t, c, "UPDATE acct SET n = $1 WHERE id = 1"), "42P02")
	if got := autoStatements(t, c); len(got) != 0 {
		t.Fatalf("the proxy prepared %q", got)
	}
	wantAcct(t, d, 1, 3, 60)
	wantAcct(t, d, 3, 6, 60)
}

// testAutoManyTexts: more repeated texts than a session keeps: the least
// recently sent make room, the server never holds more than the bound,
// and every write lands once.
func testAutoManyTexts(t *testing.T, e *env) {
	db := e.newDB(t)
	c, d := simpleConn(t, e, db), direct(t, db)
	setToken(t, c, "60")
	const texts = 50
	for round := range 2 {
		for i := range texts {
			for range 3 {
				mustSimple(t, c, fmt.Sprintf("UPDATE acct SET n = n + 1 WHERE id = 1 AND %d = %d", i, i))
			}
		}
		// Each slot's statement is closed before the slot is prepared
		// again: exactly one per slot.
		if n := len(autoStatements(t, c)); n != 32 {
			t.Fatalf("round %d: %d statements of the proxy's, want 32", round, n)
		}
	}
	wantAcct(t, d, 1, 2*3*texts, 60)
}

// TestAutoPrepareReload: a text the proxy prepared runs under the rules in
// force after a reload, in both directions, with no error from the
// statement the server still has.
func TestAutoPrepareReload(t *testing.T) {
	t.Parallel()
	r := startReload(t, "enforce", autoPrepare)
	c := connectDSN(t, r.proxy.DSN("postgres", "", r.db), func(cfg *pgx.ConnConfig) { cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol })
	ctx := ctxT(t)
	const upd = "UPDATE doc SET payload = 'p' WHERE id = 1"
	setToken(t, c, "10")
	mustSimple(t, c, upd)
	mustSimple(t, c, upd)
	r.wantDoc(t, 1, "p", 10)
	if got := autoStatements(t, c); len(got) != 1 {
		t.Fatalf("the proxy's statements: %q", got)
	}

	// Unprotected: forwarded as sent, fence untouched.
	r.reload(t, "unlisted")
	setToken(t, c, "5")
	mustSimple(t, c, upd)
	r.wantDoc(t, 1, "p", 10)
	// Audit: stale writes go through.
	r.reload(t, "audit")
	if _, err := r.direct.Exec(ctx, "UPDATE doc SET payload = 'q' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	mustSimple(t, c, upd)
	mustSimple(t, c, upd)
	if p, _ := r.doc(t, 1); p != "p" {
		t.Fatalf("audit mode: payload %q, want p", p)
	}
	// Enforced again: the stale token is refused.
	if _, err := r.direct.Exec(ctx, "UPDATE doc SET payload = 'q', last_fence = 10 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	r.reload(t, "enforce")
	wantCode(t, simple(t, c, upd), "FP001")
	wantCode(t, simple(t, c, upd), "FP001")
	r.wantDoc(t, 1, "q", 10)
	setToken(t, c, "11")
	mustSimple(t, c, upd)
	r.wantDoc(t, 1, "p", 11)
}

// TestAutoPrepareOff: by default the proxy prepares nothing of its own.
func TestAutoPrepareOff(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startEnv(t)
	db := e.newDB(t)
	c, d := simpleConn(t, e, db), direct(t, db)
	setToken(t, c, "60")
	for range 3 {
		mustSimple(t, c, "UPDATE acct SET n = n + 1 WHERE id = 1")
	}
	if got := autoStatements(t, c); len(got) != 0 {
		t.Fatalf("the proxy prepared %q", got)
	}
	wantAcct(t, d, 1, 3, 60)
}

// TestAutoPrepareHijack: a client that takes the name of one of the
// proxy's statements (read from pg_prepared_statements) for a statement
// of its own cannot then run the proxy's statement under that name: once
// the proxy prepares its slot again, the client's definition counts as
// gone and EXECUTE of the name is refused, with nothing written. Neither
// a form decided under older rules (reload) nor one without its lock
// registration runs.
func TestAutoPrepareHijack(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	t.Run("reload", func(t *testing.T) {
		t.Parallel()
		r := startReload(t, "audit", autoPrepare)
		c := connectDSN(t, r.proxy.DSN("postgres", "", r.db), func(cfg *pgx.ConnConfig) { cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol })
		setToken(t, c, "10")
		const upd = "UPDATE doc SET payload = payload || 'x' WHERE id = 1"
		mustSimple(t, c, upd)
		mustSimple(t, c, upd)
		name := autoName(t, c)
		mustSimple(t, c, "DEALLOCATE "+name)
		mustSimple(t, c, "PREPARE "+name+" AS SELECT 1")
		mustSimple(t, c, upd) // the proxy prepares its slot again
		if _, err := r.direct.Exec(ctxT(t), "UPDATE doc SET payload = 'q', last_fence = 20 WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		r.reload(t, "enforce")
		// The proxy's name is not the client's: PostgreSQL's answer for a
		// statement the session does not have, and nothing runs.
		wantCode(t, simple(t, c, "EXECUTE "+name), "26000")
		r.wantDoc(t, 1, "q", 20)
		wantCode(t, simple(t, c, upd), "FP001")
		r.wantDoc(t, 1, "q", 20)
	})
	t.Run("lock", func(t *testing.T) {
		t.Parallel()
		e := startLockEnvWith(t, policy.Options{}, autoPrepare)
		db := newLockDB(t, true)
		d := direct(t, db)
		old := e.holder(t, db, "L", 10, pgx.QueryExecModeSimpleProtocol)
		const upd = "UPDATE acct SET n = n + 1 WHERE id = 1"
		mustSimple(t, old, upd)
		mustSimple(t, old, upd)
		name := autoName(t, old)
		mustSimple(t, old, "DEALLOCATE "+name)
		mustSimple(t, old, "PREPARE "+name+" AS SELECT 1")
		newer := e.holder(t, db, "L", 20, pgx.QueryExecModeSimpleProtocol)
		mustSimple(t, newer, "SELECT n FROM acct WHERE id = 1")
		wantCode(t, simple(t, old, upd), "FP001")
		before := snapshot(t, d, "acct")
		wantCode(t, simple(t, old, "EXECUTE "+name), "26000")
		wantUnchanged(t, d, "acct", before)
	})
}

// autoName is the name of the one statement of the proxy's in c's session.
func autoName(t *testing.T, c *pgx.Conn) string {
	t.Helper()
	var name string
	if err := c.QueryRow(ctxT(t), "SELECT name FROM pg_prepared_statements WHERE name LIKE 'fenceproxy\\_auto\\_%'", pgx.QueryExecModeSimpleProtocol).Scan(&name); err != nil {
		t.Fatal(err)
	}
	return name
}

// TestAutoPrepareAnalysisTime: what PostgreSQL fixes when it analyses a
// statement — 'now' and its kin, a literal timestamp read under the
// session's TimeZone — is what the Query would have had at every sending.
func TestAutoPrepareAnalysisTime(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startAutoEnv(t)
	db := e.newDB(t)
	c, d := simpleConn(t, e, db), direct(t, db)
	setToken(t, c, "60")
	payload := func() string {
		t.Helper()
		var p string
		if err := d.QueryRow(ctxT(t), "SELECT payload FROM acct WHERE id = 1").Scan(&p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const now = "UPDATE acct SET payload = 'now'::timestamptz::text WHERE id = 1"
	seen := map[string]bool{}
	for range 4 {
		mustSimple(t, c, now)
		p := payload()
		if seen[p] {
			t.Fatalf("'now' wrote %q twice", p)
		}
		seen[p] = true
		time.Sleep(20 * time.Millisecond)
	}

	const lit = "UPDATE acct SET payload = '2024-01-01 10:00'::timestamptz::text WHERE id = 1"
	mustSimple(t, c, "SET TimeZone = 'UTC'")
	mustSimple(t, c, lit)
	mustSimple(t, c, lit)
	if p := payload(); p != "2024-01-01 10:00:00+00" {
		t.Fatalf("under UTC: %q", p)
	}
	mustSimple(t, c, "SET TimeZone = 'Asia/Tokyo'")
	mustSimple(t, c, lit)
	if p := payload(); p != "2024-01-01 10:00:00+09" {
		t.Fatalf("under Asia/Tokyo: %q, as if read under the earlier TimeZone", p)
	}
	mustSimple(t, c, "BEGIN")
	mustSimple(t, c, "SET LOCAL DateStyle = 'SQL, DMY'")
	mustSimple(t, c, lit)
	mustSimple(t, c, "COMMIT")
	if p := payload(); p != "01/01/2024 10:00:00 JST" {
		t.Fatalf("under DateStyle SQL: %q", p)
	}
	mustSimple(t, c, lit)
	if p := payload(); p != "2024-01-01 10:00:00+09" {
		t.Fatalf("after the transaction: %q", p)
	}
	if got := autoStatements(t, c); len(got) != 1 {
		t.Fatalf("the proxy's statements: %q", got)
	}
}

// TestRegisterNameTaken: a lock holder that gives one of its own
// statements the name of the proxy's registration statement (read from
// pg_prepared_statements) does not get that statement run in place of the
// registration: the proxy prepares its registration again, and a stale
// holder stays refused. With a driver's named statements (the
// registration runs at each Bind) and with simple Queries the proxy
// prepares for itself.
func TestRegisterNameTaken(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnvWith(t, policy.Options{}, autoPrepare)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			db := newLockDB(t, true)
			d := direct(t, db)
			old := e.holder(t, db, "L", 10, mode)
			const upd = "UPDATE acct SET payload = 'old' WHERE id = 1"
			mustExec(t, old, upd)
			mustExec(t, old, upd)
			var name string
			if err := old.QueryRow(ctxT(t), "SELECT name FROM pg_prepared_statements WHERE name LIKE 'fenceproxy\\_register\\_%'", pgx.QueryExecModeSimpleProtocol).Scan(&name); err != nil {
				t.Fatal(err)
			}
			mustSimple(t, old, "DEALLOCATE "+name)
			mustSimple(t, old, "PREPARE "+name+" AS SELECT WHERE false")
			newer := e.holder(t, db, "L", 20, pgx.QueryExecModeSimpleProtocol)
			mustSimple(t, newer, "SELECT payload FROM acct WHERE id = 1")
			before := snapshot(t, d, "acct")
			_, err := old.Exec(ctxT(t), upd)
			wantCode(t, err, "FP001")
			wantUnchanged(t, d, "acct", before)
		})
	}
}
