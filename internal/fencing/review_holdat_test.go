package fencing_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// An adversarial review of fenceproxy.hold_at (objects version 8): a
// simple Query that registers a lock goes as one call with the session's
// lock and token as values, without the SET LOCALs. holdat_test.go has
// the feature's own tests; these try to break it, reading the data, the
// watermarks and what code on the server saw back from PostgreSQL.

// rvHolder connects to db through p with lock lk and token tok (simple
// protocol, marked by runPid).
func rvHolder(t *testing.T, p *proxytest.Proxy, db, lk, tok string) *pgx.Conn {
	t.Helper()
	return runPid(t, connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
		c.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
		if lk != "" {
			c.RuntimeParams["fence.lock"] = lk
		}
		if tok != "" {
			c.RuntimeParams["fence.token"] = tok
		}
	}))
}

// rvExec runs sql on c as one simple Query (every statement's result
// read), retrying a catalog change's FP003.
func rvExec(t *testing.T, c *pgx.Conn, sql string) error {
	t.Helper()
	var err error
	for i := 0; i < 100; i++ {
		if _, err = c.PgConn().Exec(ctxT(t), sql).ReadAll(); sqlState(err) != "FP003" {
			return err
		}
	}
	return err
}

// withLockTok sets both fence settings in the startup packet.
func withLockTok(lk, tok string) func(*pgx.ConnConfig) {
	return func(c *pgx.ConnConfig) { c.RuntimeParams["fence.token"] = tok; c.RuntimeParams["fence.lock"] = lk }
}

// TestReviewHoldAtBeginInTextBehindPooler: why: the relay takes the
// session to be idle before the text, but a text that opens a
// transaction (BEGIN; UPDATE of a lock-fenced table) leaves it open
// after. Before hold_at the SET LOCALs in front of it put the session's
// values in force for the rest of that transaction; hold_at sets none
// (its common case), so a later Query of the same transaction that reads
// fence.token (no protected table: no prelude of its own) reads what the
// pooled server connection carries from another client. The row
// prelude's review found and mended exactly this for a BEGIN sent in a
// Query of its own (TestReviewPreludeLaterQueryInTransaction).
func TestReviewHoldAtBeginInTextBehindPooler(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, lockRules)
	pe := startPoolerEnvSized(t, pol, 1)
	db, d := preludeDB(t, specs, "CREATE TABLE seen (tok text);")
	poolerReset(t, d) // lock L at 42
	execDirect(t, d, "ALTER DATABASE "+db+" SET track_functions = 'pl'")
	fresh := pe.session(t, db, pgx.QueryExecModeSimpleProtocol, withLockTok("L", "44"))
	rvWarm(t, fresh, d, db, "UPDATE jobs SET state = state WHERE id = 1")
	pe.pollute(t, db, "43", "X")
	if err := rvExec(t, fresh, "BEGIN; UPDATE jobs SET state = 'w44' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	if err := rvExec(t, fresh, "INSERT INTO seen VALUES (current_setting('fence.token', true) || '/' || current_setting('fence.lock', true))"); err != nil {
		t.Fatal(err)
	}
	if err := rvExec(t, fresh, "COMMIT"); err != nil {
		t.Fatal(err)
	}
	if got := testutil.QueryStrings(t, d, "SELECT state FROM jobs WHERE id = 1"); len(got) != 1 || got[0] != "w44" {
		t.Errorf("jobs row 1 = %q, want w44", got)
	}
	if w := lockWatermark(t, d, "L"); w != 44 {
		t.Errorf("lock L watermark %d, want 44", w)
	}
	if seen := seenToks(t, d); len(seen) != 1 || seen[0] != "44/L" {
		t.Errorf("in the transaction the text BEGIN; UPDATE jobs … opened, a later Query read fence.token/fence.lock = %q, want the session's [44/L] (what the SET LOCALs gave before hold_at; the server connection carries 43/X from another client)", seen)
	}
}

// TestReviewHoldAtBeginInTextDirect: why: the same text without a
// pooler, to show what the server ran: hold_at in front of BEGIN, so the
// transaction the text leaves open has no transaction-local values.
// Also: the registration's advisory lock lasts (BEGIN turns the implicit
// block into the explicit transaction), so a newer holder waits for the
// older one's transaction, and after it the older one is refused.
func TestReviewHoldAtBeginInTextDirect(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "INSERT INTO jobs VALUES (2, 'queued');")
	h7 := rvHolder(t, p, db, "L", "7")
	if err := rvExec(t, h7, "UPDATE jobs SET state = 'h7-0' WHERE id = 2"); err != nil {
		t.Fatal(err)
	}
	if err := rvExec(t, h7, "BEGIN; UPDATE jobs SET state = 'h7a' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	sent := sentText(t, d, h7)
	t.Logf("sent: %s", sent)
	var shared int
	if err := d.QueryRow(ctxT(t), "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE a.query = $1 AND l.locktype = 'advisory' AND l.mode = 'ShareLock' AND l.granted", sent).Scan(&shared); err != nil {
		t.Fatal(err)
	}
	if shared != 1 {
		t.Errorf("the open transaction holds %d shared advisory locks, want 1 (the registration's)", shared)
	}
	h9 := rvHolder(t, p, db, "L", "9")
	pid9 := raPid(t, h9)
	done := raGo(h9, "UPDATE jobs SET state = 'h9' WHERE id = 2")
	if !raWaits(t, d, pid9, done) {
		t.Errorf("the newer holder did not wait for the older one's open transaction: %v", <-done)
	}
	// Still the holder within its transaction: its second write runs.
	if err := rvExec(t, h7, "UPDATE jobs SET state = 'h7b' WHERE id = 1"); err != nil {
		t.Errorf("the older holder's second write in its transaction: %v", err)
	}
	if err := rvExec(t, h7, "COMMIT"); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("newer holder: %v", err)
	}
	before := tableText(t, d, "jobs")
	for _, stmt := range []string{
		"UPDATE jobs SET state = 'h7c' WHERE id = 1",
		"BEGIN; UPDATE jobs SET state = 'h7d' WHERE id = 1",
	} {
		if err := rvExec(t, h7, stmt); sqlState(err) != "FP001" {
			t.Errorf("%s by the older holder after 9 registered: %v, want FP001", stmt, err)
		}
		_ = rvExec(t, h7, "ROLLBACK")
	}
	if after := tableText(t, d, "jobs"); after != before {
		t.Errorf("the stale holder changed jobs:\n before %s\n after  %s", before, after)
	}
	if w := lockWatermark(t, d, "L"); w != 9 {
		t.Errorf("lock L watermark %d, want 9", w)
	}
}

// TestReviewHoldAtEndsInText: why: the registration goes before the
// text's first statement only; a statement after the end of that
// transaction in the same text (COMMIT, END, ABORT, ROLLBACK, COMMIT AND
// CHAIN, PREPARE TRANSACTION) would run in a new transaction without the
// advisory lock, the registration or the catalog check. Each must be
// refused, or carry a registration after the end; nothing may change
// when it is refused.
func TestReviewHoldAtEndsInText(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	h := rvHolder(t, p, db, "L", "7")
	for _, stmt := range []string{
		"UPDATE jobs SET state = 'a' WHERE id = 1; COMMIT; UPDATE jobs SET state = 'after' WHERE id = 1",
		"UPDATE jobs SET state = 'a' WHERE id = 1; END; UPDATE jobs SET state = 'after' WHERE id = 1",
		"UPDATE jobs SET state = 'a' WHERE id = 1; ABORT; UPDATE jobs SET state = 'after' WHERE id = 1",
		"BEGIN; UPDATE jobs SET state = 'a' WHERE id = 1; COMMIT AND CHAIN; UPDATE jobs SET state = 'after' WHERE id = 1; COMMIT",
		"BEGIN; UPDATE jobs SET state = 'a' WHERE id = 1; END; UPDATE jobs SET state = 'after' WHERE id = 1",
		"UPDATE jobs SET state = 'a' WHERE id = 1; COMMIT; UPDATE acct SET n = 100 WHERE id = 1",
		"BEGIN; UPDATE jobs SET state = 'a' WHERE id = 1; PREPARE TRANSACTION 'rvx'; UPDATE jobs SET state = 'after' WHERE id = 1",
	} {
		beforeJobs, beforeAcct := tableText(t, d, "jobs"), tableText(t, d, "acct")
		err := rvExec(t, h, stmt)
		_ = rvExec(t, h, "ROLLBACK")
		execDirect(t, d, "SELECT 1") // d stays usable
		if err != nil {
			if a, b := tableText(t, d, "jobs"), tableText(t, d, "acct"); a != beforeJobs || b != beforeAcct {
				t.Errorf("%s: refused (%v), yet it changed the data:\n jobs %s -> %s\n acct %s -> %s", stmt, err, beforeJobs, a, beforeAcct, b)
			}
			t.Logf("%s: refused: %v", stmt, err)
			continue
		}
		sent := sentText(t, d, h)
		t.Logf("%s: ran, sent: %s", stmt, sent)
		if strings.Count(sent, "fenceproxy.hold")+strings.Count(sent, "fenceproxy.register") < 2 {
			t.Errorf("%s: ran with one registration in front only (a statement after the end of its transaction unregistered): %s", stmt, sent)
		}
	}
	if gid := testutil.QueryStrings(t, d, "SELECT gid FROM pg_prepared_xacts WHERE gid = 'rvx'"); len(gid) > 0 {
		execDirect(t, d, "ROLLBACK PREPARED 'rvx'")
		t.Errorf("PREPARE TRANSACTION in the text left a prepared transaction")
	}
}

// TestReviewHoldAtTokenSpellings: why: hold_at registers the token as the
// client spelt it (the text's value), while the token form writes the
// canonical token into the fences: leading zeros, 18 and 19 digits (the
// common case stops at 18 bytes; register decides the rest). Rows and
// watermark must agree, and an older token be refused after.
func TestReviewHoldAtTokenSpellings(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	for _, c := range []struct {
		tok  string
		want int64
	}{
		{"007", 7},
		{"00000000000000008", 8},
		{"0000000000000000009", 9},
		{"000000000000000000000000000000010", 10},
	} {
		h := rvHolder(t, p, db, "L", c.tok)
		ok, err := sentHoldAt(t, d, h, "UPDATE acct SET n = n + 1 WHERE id = 1")
		r := snapshot(t, d, "acct")[1]
		w := lockWatermark(t, d, "L")
		t.Logf("token %q: err %v hold_at %t; row 1 fence %d; watermark %d", c.tok, err, ok, r.Fence, w)
		if err != nil {
			continue
		}
		if r.Fence != c.want || w != c.want {
			t.Errorf("token %q: row 1 fence %d watermark %d, want both %d", c.tok, r.Fence, w, c.want)
		}
	}
	before := snapshot(t, d, "acct")
	h := rvHolder(t, p, db, "L", "0009")
	if _, err := sentHoldAt(t, d, h, "UPDATE acct SET n = 1000 WHERE id = 2"); sqlState(err) != "FP001" {
		t.Errorf("an older token after the newer ones: %v, want FP001", err)
	}
	wantUnchanged(t, d, "acct", before)
}

// TestReviewHoldAtDropped: why: hold_at dropped on another connection
// after the proxy's check: the statement must fail with nothing of it
// run, and a retry must register by the old statements (a stale holder
// refused there too).
func TestReviewHoldAtDropped(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	h7 := rvHolder(t, p, db, "L", "7")
	if ok, err := sentHoldAt(t, d, h7, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil || !ok {
		t.Fatalf("control: %v, hold_at %t", err, ok)
	}
	execDirect(t, d, "DROP PROCEDURE fenceproxy.hold_at(bigint, text, text, text)")
	before := snapshot(t, d, "acct")
	err := rvExec(t, h7, "UPDATE acct SET n = 50 WHERE id = 2")
	t.Logf("after the drop: %v", err)
	if err != nil {
		wantUnchanged(t, d, "acct", before)
	}
	waitUntil(t, "the old statements back", func() bool {
		if err := rvExec(t, h7, "UPDATE acct SET n = 51 WHERE id = 2"); err != nil {
			return false
		}
		return strings.HasPrefix(sentText(t, d, h7), "SET LOCAL fence.token")
	})
	if r := snapshot(t, d, "acct")[2]; r.N != 51 || r.Fence != 7 {
		t.Errorf("row 2 = %+v, want n 51 fence 7", r)
	}
	before = snapshot(t, d, "acct")
	if err := rvExec(t, rvHolder(t, p, db, "L", "5"), "UPDATE acct SET n = 99 WHERE id = 2"); sqlState(err) != "FP001" {
		t.Errorf("a stale holder after the drop: %v, want FP001", err)
	}
	wantUnchanged(t, d, "acct", before)
}

// TestReviewHoldAtStaleRowMessageBehindPooler: why: a row whose fence is
// above the session's token while the lock's watermark is the token
// (written directly): the token form's stale_at raises, and the relay
// fills in the token. Behind a pooler whose connection carries 99, the
// message must name the session's token (44), and nothing change.
func TestReviewHoldAtStaleRowMessageBehindPooler(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, lockRules)
	pe := startPoolerEnvSized(t, pol, 1)
	db, d := preludeDB(t, specs, "")
	poolerReset(t, d)
	execDirect(t, d, "UPDATE fenceproxy.locks SET token = 44 WHERE name = 'L'; UPDATE acct SET last_fence = 60 WHERE id = 1")
	before := snapshot(t, d, "acct")
	s := pe.session(t, db, pgx.QueryExecModeSimpleProtocol, withLockTok("L", "44"))
	rvWarm(t, s, d, db, "UPDATE jobs SET state = state WHERE id = 1")
	pe.pollute(t, db, "99", "L")
	err := send(t, s, "UPDATE acct SET payload = 'x' WHERE id = 1")
	t.Logf("stale row: %v", err)
	if sqlState(err) != "FP001" {
		t.Errorf("stale row: %v, want FP001", err)
	} else if msg := err.Error(); strings.Contains(msg, "99") || !strings.Contains(msg, "44") {
		t.Errorf("stale row message %q: want the session's token 44, never the connection's 99", msg)
	}
	wantUnchanged(t, d, "acct", before)
	if w := lockWatermark(t, d, "L"); w != 44 {
		t.Errorf("lock L watermark %d, want 44", w)
	}
}

// TestReviewHoldAtReadersInTextBehindPooler: why: texts that read the
// settings on the server in a later statement of the same Query
// (current_setting, SHOW, pg_settings, a quoted or upper-case spelling,
// a function call in a CTE) must keep the values (or be sent so that
// what is read is the session's own), behind a pooler whose connection
// carries another client's 43/X. Results read back from the server.
func TestReviewHoldAtReadersInTextBehindPooler(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, lockRules)
	pe := startPoolerEnvSized(t, pol, 1)
	db, d := preludeDB(t, specs, "CREATE TABLE seen (tok text);")
	for _, stmt := range []string{
		"UPDATE jobs SET state = 'a' WHERE id = 1; INSERT INTO seen VALUES (current_setting('fence.token', true))",
		"UPDATE jobs SET state = 'a' WHERE id = 1; INSERT INTO seen SELECT setting FROM pg_settings WHERE name = 'fence.token'",
		"UPDATE jobs SET state = 'a' WHERE id = 1; INSERT INTO seen VALUES (CURRENT_SETTING('FENCE.TOKEN', true))",
		`UPDATE jobs SET state = 'a' WHERE id = 1; INSERT INTO seen VALUES (pg_catalog."current_setting"('fence.token', true))`,
		"WITH u AS (UPDATE jobs SET state = 'a' WHERE id = 1 RETURNING current_setting('fence.token', true) AS t) INSERT INTO seen SELECT t FROM u",
		"UPDATE jobs SET state = current_setting('fence.token', true) WHERE id = 1 RETURNING state",
		"INSERT INTO seen SELECT current_setting('fence.token', true) FROM jobs WHERE id = 1 FOR UPDATE; UPDATE jobs SET state = 'a' WHERE id = 1",
	} {
		execDirect(t, d, "DELETE FROM seen")
		poolerReset(t, d)
		s := pe.session(t, db, pgx.QueryExecModeSimpleProtocol, withLockTok("L", "44"))
		rvWarm(t, s, d, db, "UPDATE jobs SET state = state WHERE id = 1")
		pe.pollute(t, db, "43", "X")
		if err := rvExec(t, s, stmt); err != nil {
			t.Errorf("%s: %v", stmt, err)
			continue
		}
		seen := seenToks(t, d)
		if st := testutil.QueryStrings(t, d, "SELECT state FROM jobs WHERE id = 1"); len(st) == 1 && st[0] != "a" {
			seen = append(seen, st[0])
		}
		for _, v := range seen {
			if v != "44" {
				t.Errorf("%s: the server read %q, want the session's 44 (the connection carries 43)", stmt, seen)
				break
			}
		}
		if w := lockWatermark(t, d, "L"); w != 44 {
			t.Errorf("%s: lock L watermark %d, want 44", stmt, w)
		}
		s.Close(ctxT(t))
	}
}

// TestReviewHoldAtPiecedNameBehindPooler: why: a text that builds the
// setting's name from pieces (current_' || 'setting, 'f' || 'ence')
// passes sqllex.MayName; with hold_at in place of the SET LOCALs it
// reads the other client's token behind a pooler (seen: the row gets
// 43, the connection's, not the session's 44). A documented limit
// (catalog/settings.go: a name computed from pieces is not found), now
// reaching lock-fenced texts, which the SET LOCALs covered before:
// logged only.
func TestReviewHoldAtPiecedNameBehindPooler(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, lockRules)
	pe := startPoolerEnvSized(t, pol, 1)
	db, d := preludeDB(t, specs, "CREATE TABLE seen (tok text);")
	poolerReset(t, d)
	s := pe.session(t, db, pgx.QueryExecModeSimpleProtocol, withLockTok("L", "44"))
	rvWarm(t, s, d, db, "UPDATE jobs SET state = state WHERE id = 1")
	pe.pollute(t, db, "43", "X")
	// One statement: a text of several keeps the SET LOCALs (probe).
	stmt := `UPDATE jobs SET state = (xpath('//v/text()', query_to_xml('select current_' || 'setting(''f' || 'ence.token'', true) AS v', false, false, '')))[1]::text WHERE id = 1`
	err := rvExec(t, s, stmt)
	t.Logf("pieced name: %v; the server read %q (session 44, connection 43); sent %q", err, testutil.QueryStrings(t, d, "SELECT state FROM jobs WHERE id = 1"), rvPooledSent(t, d, db))
}

// TestReviewHoldAtSJISLock: why: a lock name in client encoding SJIS
// whose second byte is 0x5C (a backslash byte, 表) goes into the call
// quoted by quoteFenceValue: the server must register the same lock
// as a UTF-8 session naming 表 (a stale one refused), and nothing else.
func TestReviewHoldAtSJISLock(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	// Named in the startup packet (a SET with the 0x5C byte is refused:
	// the proxy cannot tell how the server reads it).
	c := connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
		c.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
		c.RuntimeParams["client_encoding"] = "SJIS"
		c.RuntimeParams["fence.lock"] = "x\x95\x5cy"
		c.RuntimeParams["fence.token"] = "8"
	})
	res, err := c.PgConn().Exec(ctxT(t), "SELECT pg_backend_pid()").ReadAll()
	if err != nil || len(res) != 1 || len(res[0].Rows) != 1 {
		t.Fatalf("pid: %v", err)
	}
	pid, err := strconv.ParseUint(string(res[0].Rows[0][0]), 10, 32)
	if err != nil {
		t.Fatal(err)
	}
	sessionPids.Store(c, uint32(pid))
	err = rvExec(t, c, "UPDATE jobs SET state = 'sjis' WHERE id = 1")
	t.Logf("SJIS lock: %v; sent %s", err, sentText(t, d, c))
	if err != nil {
		t.Fatal(err)
	}
	if w := lockWatermark(t, d, "x表y"); w != 8 {
		t.Errorf("lock x表y watermark %d, want 8; locks: %q", w, testutil.QueryStrings(t, d, "SELECT name || '=' || token FROM fenceproxy.locks"))
	}
	before := tableText(t, d, "jobs")
	if err := rvExec(t, rvHolder(t, p, db, "x表y", "6"), "UPDATE jobs SET state = 'stale' WHERE id = 1"); sqlState(err) != "FP001" {
		t.Errorf("a stale holder of x表y in UTF-8: %v, want FP001", err)
	}
	if after := tableText(t, d, "jobs"); after != before {
		t.Errorf("stale write changed jobs: %s -> %s", before, after)
	}
}

// TestReviewHoldAtIsolationAndEmptyToken: why: the common case holds
// only under READ COMMITTED with a valid token; a session-level
// default_transaction_isolation of repeatable read, and a session naming
// a lock with an empty or non-numeric token on a lock-required table,
// go to register: a stale token refused, an invalid one refused, and the
// data unchanged.
func TestReviewHoldAtIsolationAndEmptyToken(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	h := rvHolder(t, p, db, "L", "7")
	if err := rvExec(t, h, "UPDATE jobs SET state = 'h7' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	rr := rvHolder(t, p, db, "L", "6")
	if err := rvExec(t, rr, "SET default_transaction_isolation = 'repeatable read'"); err != nil {
		t.Fatal(err)
	}
	before := tableText(t, d, "jobs")
	if err := rvExec(t, rr, "UPDATE jobs SET state = 'rr6' WHERE id = 1"); sqlState(err) != "FP001" {
		t.Errorf("repeatable read, stale token 6: %v, want FP001 (sent %s)", err, sentText(t, d, rr))
	}
	for _, tok := range []string{"", "x7", "7 ", "-8", "99999999999999999999999"} {
		c := rvHolder(t, p, db, "L", "")
		if tok != "" {
			if err := rvExec(t, c, "SET fence.token = '"+tok+"'"); err != nil {
				t.Logf("SET fence.token = %q: %v", tok, err)
				continue
			}
		}
		err := rvExec(t, c, "UPDATE jobs SET state = 'bad' WHERE id = 1")
		t.Logf("token %q: %v; sent %s", tok, err, sentText(t, d, c))
		if err == nil {
			t.Errorf("token %q on a lock-required table: accepted", tok)
		}
	}
	if after := tableText(t, d, "jobs"); after != before {
		t.Errorf("jobs changed: %s -> %s", before, after)
	}
	if w := lockWatermark(t, d, "L"); w != 7 {
		t.Errorf("lock L watermark %d, want 7", w)
	}
}

// TestReviewHoldAtBeginAfterWriteBehindPooler: why: BEGIN in front of
// the write moves the registration after it (the SET LOCALs stay), but
// BEGIN AFTER the write ("UPDATE jobs …; BEGIN") leaves the registration
// in front of the text, so the relay sends hold_at (the session was
// idle), and the text leaves a transaction open that no SET LOCAL
// covers: a later Query of that transaction that reads fence.token (no
// protected table, so no values of its own) reads what the pooled
// server connection carries from another client. Before hold_at, the
// SET LOCALs in front of the text lasted to the end of that
// transaction. The same for row fencing without a lock (the row
// prelude's own case, older than hold_at), for comparison. Held: a text
// of more than one statement never goes as hold_at (TestReviewHoldAtProbe),
// and the SET LOCALs in front of it last to the end of the transaction.
func TestReviewHoldAtBeginAfterWriteBehindPooler(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, lockRules)
	pe := startPoolerEnvSized(t, pol, 1)
	db, d := preludeDB(t, specs, "CREATE TABLE seen (tok text);")
	for _, c := range []struct {
		name, lock, write string
	}{
		{"lock-only table, hold_at", "L", "UPDATE jobs SET state = 'w44' WHERE id = 1; BEGIN"},
		{"row- and lock-fenced table, hold_at", "L", "UPDATE acct SET payload = 'w44' WHERE id = 2; BEGIN"},
		{"row fencing, no lock (the row prelude, before hold_at)", "", "UPDATE acct SET payload = 'w44' WHERE id = 2; BEGIN"},
	} {
		t.Run(c.name, func(t *testing.T) {
			execDirect(t, d, "DELETE FROM seen")
			poolerReset(t, d) // lock L at 42
			edit := withTok("44")
			if c.lock != "" {
				edit = withLockTok(c.lock, "44")
			}
			s := pe.session(t, db, pgx.QueryExecModeSimpleProtocol, edit)
			defer s.Close(ctxT(t))
			rvWarm(t, s, d, db, "UPDATE acct SET n = n WHERE id = 3")
			pe.pollute(t, db, "43", "X")
			if err := rvExec(t, s, c.write); err != nil {
				t.Fatal(err)
			}
			t.Logf("sent %q", rvPooledSent(t, d, db))
			if err := rvExec(t, s, "INSERT INTO seen VALUES (current_setting('fence.token', true) || '/' || coalesce(current_setting('fence.lock', true), ''))"); err != nil {
				t.Fatal(err)
			}
			if err := rvExec(t, s, "COMMIT"); err != nil {
				t.Fatal(err)
			}
			want := "44/" + c.lock
			if seen := seenToks(t, d); len(seen) != 1 || seen[0] != want {
				t.Errorf("in the transaction %q left open, a later Query read fence.token/fence.lock = %q, want the session's [%s] (the server connection carries 43/X from another client)", c.write, seen, want)
			}
			if c.lock != "" {
				if w := lockWatermark(t, d, "L"); w != 44 {
					t.Errorf("lock L watermark %d, want 44", w)
				}
			}
		})
	}
}

// rvPooledSent is the last text of the pool's server connections to db
// that touched table seen or jobs (behind PgBouncer, the session's pid is
// unknown).
func rvPooledSent(t *testing.T, d *pgx.Conn, db string) []string {
	t.Helper()
	return testutil.QueryStrings(t, d, "SELECT query FROM pg_stat_activity WHERE datname = '"+db+"' AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND query NOT LIKE '%pg_stat_activity%'")
}

// rvWarm sends stmt on s until the server runs it as the relay sends it
// once the database check is known (hold_at, or no prelude at all for a
// session without a lock): the check runs in the background.
func rvWarm(t *testing.T, s, d *pgx.Conn, db, stmt string) {
	t.Helper()
	waitUntil(t, "the database check known", func() bool {
		if err := rvExec(t, s, stmt); err != nil {
			t.Fatalf("warm-up %s: %v", stmt, err)
		}
		for _, q := range rvPooledSent(t, d, db) {
			if isHoldAtCall(q) || strings.HasPrefix(q, "CALL fenceproxy.catalog_at(") {
				return true
			}
		}
		return false
	})
}

// TestReviewHoldAtProbe: why: which texts go as hold_at (logged), and
// that none of those sent so reads a setting in the text sent; a direct
// session (no pooler) with lock L and token 7.
func TestReviewHoldAtProbe(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "CREATE TABLE seen (tok text); INSERT INTO jobs VALUES (2, 'q');")
	h := rvHolder(t, p, db, "L", "7")
	rvWarmDirect(t, h, d)
	for _, stmt := range []string{
		"UPDATE jobs SET state = 'a' WHERE id = 1; INSERT INTO seen VALUES ('x')",
		"UPDATE jobs SET state = 'a' WHERE id = 1; INSERT INTO seen SELECT 'y'",
		"UPDATE jobs SET state = 'a' WHERE id = 1; SELECT query_to_xml('select 1', false, false, '')",
		"UPDATE jobs SET state = 'a' WHERE id = 1; BEGIN",
		"UPDATE jobs SET state = 'a' WHERE id = 1; BEGIN; UPDATE jobs SET state = 'b' WHERE id = 2",
		"UPDATE jobs SET state = 'a' WHERE id = 1; SAVEPOINT s",
		"UPDATE jobs SET state = 'a' WHERE id = 1; DO $$BEGIN PERFORM 1; END$$",
		"UPDATE jobs SET state = 'a' WHERE id = 1; SELECT set_config('app.x', '1', true)",
		"UPDATE jobs SET state = 'a' WHERE id = 1; SET LOCAL app.x = '1'",
		"UPDATE jobs SET state = 'a' WHERE id = 1; UPDATE acct SET n = n + 1 WHERE id = 1",
		"UPDATE acct SET n = n + 1 WHERE id = 1; UPDATE jobs SET state = 'c' WHERE id = 1",
		"SELECT 1; UPDATE jobs SET state = 'a' WHERE id = 1",
		"INSERT INTO jobs VALUES (3, 'n') ON CONFLICT (id) DO UPDATE SET state = 'u'",
		"DELETE FROM jobs WHERE id = 3",
		"SELECT * FROM jobs WHERE id = 1 FOR UPDATE",
		"COPY (SELECT 1) TO STDOUT",
		"DO $$BEGIN UPDATE jobs SET state = 'do' WHERE id = 1; END$$",
		"EXPLAIN ANALYZE UPDATE jobs SET state = 'e' WHERE id = 1",
		"WITH u AS (UPDATE jobs SET state = 'w' WHERE id = 1 RETURNING 1) SELECT count(*) FROM u",
		"UPDATE jobs SET state = (SELECT count(*) FROM pg_catalog.pg_settings WHERE false)::text WHERE id = 1",
		"UPDATE jobs SET state = 'u' WHERE id = 1 RETURNING (SELECT 1)",
		"CREATE TEMP TABLE tj AS SELECT * FROM jobs FOR UPDATE",
	} {
		err := rvExec(t, h, stmt)
		q := sentText(t, d, h)
		_ = rvExec(t, h, "ROLLBACK")
		if err != nil {
			t.Logf("%s: %v", stmt, err)
			continue
		}
		ha := isHoldAtCall(q)
		t.Logf("hold_at %t: %s\n  sent: %s", ha, stmt, q)
		if ha {
			body := q[strings.Index(q, ");")+2:]
			for _, r := range settingReads {
				if strings.Contains(body, r) {
					t.Errorf("%s: sent as hold_at, yet the text reads a setting (%s): %s", stmt, r, q)
				}
			}
		}
	}
}

// rvWarmDirect waits until a direct session's lock-fenced UPDATE goes as
// hold_at (the database check runs in the background).
func rvWarmDirect(t *testing.T, h, d *pgx.Conn) {
	t.Helper()
	waitUntil(t, "hold_at in use", func() bool {
		ok, err := sentHoldAt(t, d, h, "UPDATE jobs SET state = state WHERE id = 1")
		if err != nil {
			t.Fatal(err)
		}
		return ok
	})
}
