package fencing_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// A simple Query that registers a lock goes, where the database has
// fenceproxy.hold_at (objects version 8) and nothing else may read the
// fence settings, as one call of it with the session's lock and token as
// values, in place of the two SET LOCALs, the catalog check and the call
// of fenceproxy.hold. These tests look at the text the server ran and at
// the data and the watermarks.

// isHoldAtCall reports whether q begins with a call of hold_at or of
// rehold_at, its form for a session whose registration of the same lock
// and token committed before.
func isHoldAtCall(q string) bool {
	return strings.HasPrefix(q, "CALL fenceproxy.hold_at(") || strings.HasPrefix(q, "CALL fenceproxy.rehold_at(")
}

// sentHoldAt runs stmt on c (simple protocol, FP003 retried as
// sentPrelude does) and reports whether the server ran it behind one
// call of hold_at and nothing else of the proxy's; err is stmt's error
// other than FP003.
func sentHoldAt(t *testing.T, d, c *pgx.Conn, stmt string) (bool, error) {
	t.Helper()
	var err error
	for i := 0; i < 100; i++ {
		if _, err = c.Exec(ctxT(t), stmt); sqlState(err) != "FP003" {
			break
		}
	}
	q := sentText(t, d, c)
	return isHoldAtCall(q) && !strings.Contains(q, "SET LOCAL") &&
		!strings.Contains(q, "fenceproxy.hold(") && !strings.Contains(q, "catalog_at("), err
}

func TestHoldAtSimpleQuery(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	holder := func(lock, token string) *pgx.Conn {
		return runPid(t, readerSession(t, p, db, lock, token, pgx.QueryExecModeSimpleProtocol))
	}

	h7 := holder("L", "7")
	if ok, err := sentHoldAt(t, d, h7, "UPDATE acct SET n = n + 1 WHERE id = 3"); err != nil || !ok {
		t.Fatalf("a row- and lock-fenced UPDATE: %v, sent %s; want one call of hold_at", err, sentText(t, d, h7))
	}
	if r := snapshot(t, d, "acct")[3]; r.N != 1 || r.Fence != 7 {
		t.Errorf("row 3 = %+v, want n 1 fence 7", r)
	}
	if w := lockWatermark(t, d, "L"); w != 7 {
		t.Errorf("lock L's watermark %d, want 7", w)
	}
	// A lock-only table (no fence column): the registration alone.
	if ok, err := sentHoldAt(t, d, h7, "UPDATE jobs SET state = 'h7' WHERE id = 1"); err != nil || !ok {
		t.Fatalf("a lock-only UPDATE: %v, sent %s; want one call of hold_at", err, sentText(t, d, h7))
	}

	// An older holder is refused by register, which hold_at calls; it
	// changes nothing, in either table.
	before, beforeJobs := snapshot(t, d, "acct"), tableText(t, d, "jobs")
	h5 := holder("L", "5")
	for _, stmt := range []string{"UPDATE acct SET payload = 'stale' WHERE id = 1", "UPDATE jobs SET state = 'stale' WHERE id = 1"} {
		ok, err := sentHoldAt(t, d, h5, stmt)
		if sqlState(err) != "FP001" || !strings.Contains(err.Error(), "stale token 5") || !ok {
			t.Errorf("%s with an older token: %v (hold_at %t), want register's FP001", stmt, err, ok)
		}
	}
	wantUnchanged(t, d, "acct", before)
	if after := tableText(t, d, "jobs"); after != beforeJobs {
		t.Errorf("stale writes changed jobs:\n before %s\n after  %s", beforeJobs, after)
	}

	// A newer holder registers (register's path, through hold_at); the
	// holder of 7 is then refused.
	h9 := holder("L", "9")
	if ok, err := sentHoldAt(t, d, h9, "UPDATE jobs SET state = 'h9' WHERE id = 1"); err != nil || !ok {
		t.Fatalf("a newer holder: %v (hold_at %t)", err, ok)
	}
	if w := lockWatermark(t, d, "L"); w != 9 {
		t.Errorf("lock L's watermark %d after the newer holder, want 9", w)
	}
	if _, err := sentHoldAt(t, d, h7, "UPDATE jobs SET state = 'h7 again' WHERE id = 1"); sqlState(err) != "FP001" {
		t.Errorf("the holder of 7 after 9 registered: %v, want FP001", err)
	}
	if got := testutil.QueryStrings(t, d, "SELECT state FROM jobs WHERE id = 1"); len(got) != 1 || got[0] != "h9" {
		t.Errorf("jobs row 1 = %q, want the newer holder's h9", got)
	}

	// A lock name that needs quoting, and a first token for it.
	odd := `L'x\y$fp$`
	ho := holder(odd, "3")
	if ok, err := sentHoldAt(t, d, ho, "UPDATE acct SET n = n + 1 WHERE id = 2"); err != nil || !ok {
		t.Fatalf("lock %q: %v (hold_at %t)", odd, err, ok)
	}
	if w := lockWatermark(t, d, odd); w != 3 {
		t.Errorf("lock %q's watermark %d, want 3", odd, w)
	}
	if _, err := sentHoldAt(t, d, holder(odd, "2"), "UPDATE acct SET n = n + 1 WHERE id = 2"); sqlState(err) != "FP001" {
		t.Errorf("lock %q, an older token: %v, want FP001", odd, err)
	}

	// A row newer than the token (written on another connection): the
	// registration passes, the row's fence refuses, and the error names
	// the session's token, which the relay wrote into the statement.
	execDirect(t, d, "UPDATE acct SET last_fence = 100 WHERE id = 3")
	before = snapshot(t, d, "acct")
	hm := holder("M", "50")
	if ok, err := sentHoldAt(t, d, hm, "UPDATE acct SET payload = 'old' WHERE id = 3"); !ok || sqlState(err) != "FP001" || !strings.Contains(err.Error(), "stale fencing token 50 ") {
		t.Errorf("a row fenced at 100, token 50: %v (hold_at %t), want FP001 naming token 50", err, ok)
	}
	wantUnchanged(t, d, "acct", before)

	// Where something may read the settings, the session's values go
	// first and hold reads them: a text naming one, an open transaction.
	h11 := holder("L", "11")
	if ok, err := sentHoldAt(t, d, h11, "UPDATE acct SET payload = current_setting('fence.token') WHERE id = 1"); err != nil || ok {
		t.Errorf("a text reading the token: %v, sent %s; want the SET LOCALs and hold", err, sentText(t, d, h11))
	}
	if r := snapshot(t, d, "acct")[1]; r.Payload != "11" || r.Fence != 11 {
		t.Errorf("row 1 = %+v, want payload 11 (the token read) fence 11", r)
	}
	mustExec(t, h11, "BEGIN")
	if ok, err := sentHoldAt(t, d, h11, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil || ok {
		t.Errorf("in a transaction: %v, sent %s; want the SET LOCALs and hold", err, sentText(t, d, h11))
	}
	mustExec(t, h11, "COMMIT")

	// Code that reads a setting, created on another connection, brings
	// the values back once the proxy has learnt of it, and sees the
	// session's token; dropped, hold_at comes back.
	execDirect(t, d, "CREATE TABLE seen (tok text);"+noteTokFunc+";"+noteTokTrigger)
	waitUntil(t, "the values back before the registration", func() bool {
		ok, err := sentHoldAt(t, d, h11, "UPDATE acct SET n = n + 1 WHERE id = 1")
		if err != nil {
			t.Fatal(err)
		}
		return !ok
	})
	execDirect(t, d, "DELETE FROM seen")
	if _, err := sentHoldAt(t, d, h11, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	if seen := seenToks(t, d); len(seen) != 1 || seen[0] != "11" {
		t.Errorf("the trigger saw %q, want the session's token [11]", seen)
	}
	execDirect(t, d, "DROP TRIGGER acct_seen ON acct; DROP FUNCTION note_tok()")
	waitUntil(t, "hold_at back", func() bool {
		ok, err := sentHoldAt(t, d, h11, "UPDATE acct SET n = n + 1 WHERE id = 1")
		if err != nil {
			t.Fatal(err)
		}
		return ok
	})
}

// TestHoldAtBehindPooler: behind a transaction pooler whose one server
// connection carries another client's lock and token, hold_at registers
// each session's own, and a stale one changes nothing.
func TestHoldAtBehindPooler(t *testing.T) {
	holdAtBehindPooler(t, pgx.QueryExecModeSimpleProtocol)
}

// TestHoldAtBindBehindPooler: the same for a Bind's hold_at.
func TestHoldAtBindBehindPooler(t *testing.T) {
	holdAtBehindPooler(t, pgx.QueryExecModeCacheStatement)
}

// holdAtBehindPooler runs the pooler tests with sessions in mode: simple
// Queries, or Binds of prepared statements.
func holdAtBehindPooler(t *testing.T, mode pgx.QueryExecMode) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, lockRules)
	pe := startPoolerEnvSized(t, pol, 1)
	db, d := preludeDB(t, specs, "")
	poolerReset(t, d) // lock L at 42
	// The server connections count their calls of hold_at.
	execDirect(t, d, "ALTER DATABASE "+db+" SET track_functions = 'pl'")

	// write sets payload of row id: in the simple protocol a text of its
	// own, in the extended one a prepared statement bound with the values.
	write := func(c *pgx.Conn, payload string, id int) error {
		if mode == pgx.QueryExecModeSimpleProtocol {
			return send(t, c, fmt.Sprintf("UPDATE acct SET payload = '%s' WHERE id = %d", payload, id))
		}
		// One text per row: two sessions on the pool's one server
		// connection must not prepare the same text (pgx names a
		// statement after it).
		return send(t, c, fmt.Sprintf("UPDATE acct SET payload = $1 WHERE id = %d", id), payload)
	}

	pe.pollute(t, db, "50", "L")
	fresh := pe.session(t, db, mode)
	mustSend(t, fresh, "SET fence.token = '44'")
	mustSend(t, fresh, "SET fence.lock = 'L'")
	if err := write(fresh, "w44", 2); err != nil {
		t.Fatal(err)
	}
	if w := lockWatermark(t, d, "L"); w != 44 {
		t.Errorf("lock L's watermark %d, want the session's 44 (never the connection's 50)", w)
	}
	if r := snapshot(t, d, "acct")[2]; r.Payload != "w44" || r.Fence != 44 {
		t.Errorf("row 2 = %+v, want payload w44 fence 44", r)
	}
	waitPooledCall(t, pe, d, db, "hold_at")

	pe.pollute(t, db, "99", "L")
	stale := pe.session(t, db, mode)
	mustSend(t, stale, "SET fence.token = '41'")
	mustSend(t, stale, "SET fence.lock = 'L'")
	before := snapshot(t, d, "acct")
	if err := write(stale, "stale", 1); sqlState(err) != "FP001" {
		t.Errorf("a stale holder on a connection carrying 99: %v, want FP001", err)
	}
	wantUnchanged(t, d, "acct", before)
	if w := lockWatermark(t, d, "L"); w != 44 {
		t.Errorf("lock L's watermark %d, want 44", w)
	}
}

// byValue reports whether ran (bindRan's) shows the client's statement
// run after one call of hold_at and nothing else of the proxy's.
func byValue(t *testing.T, ran []string) bool {
	t.Helper()
	all := strings.Join(ran, "\n")
	return (strings.Contains(all, "CALL fenceproxy.hold_at($1, $2, $3, $4)") || strings.Contains(all, "CALL fenceproxy.rehold_at($1, $2, $3, $4)")) &&
		!strings.Contains(all, "set_config(") &&
		!strings.Contains(all, "fenceproxy.enter(") && !strings.Contains(all, "catalog_at(")
}

// TestHoldAtBind: a Bind of a lock-fenced statement in its parameter
// form, alone before its Sync, goes after one call of hold_at with the
// session's values where nothing else reads the settings; a batch of two
// keeps fenceproxy.enter. The data and the watermarks are read back.
func TestHoldAtBind(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, "")

	h7 := bindSession(t, p, db, "L", "7")
	const upd = "UPDATE acct SET n = n + 1 WHERE id = $1"
	for i := range 2 {
		ran := mustBindRan(t, h7, upd, 3)
		if !byValue(t, ran) {
			t.Errorf("use %d: not one call of hold_at:\n%s", i+1, strings.Join(ran, "\n"))
		}
	}
	if r := snapshot(t, d, "acct")[3]; r.N != 2 || r.Fence != 7 {
		t.Errorf("row 3 = %+v, want n 2 fence 7", r)
	}
	if w := lockWatermark(t, d, "L"); w != 7 {
		t.Errorf("lock L's watermark %d, want 7", w)
	}
	// A lock-only table has no parameter form (no token to bind): its
	// Binds keep fenceproxy.enter.
	if ran := mustBindRan(t, h7, "UPDATE jobs SET state = $1 WHERE id = 1", "h7"); byValue(t, ran) || !strings.Contains(strings.Join(ran, "\n"), "fenceproxy.enter(") {
		t.Errorf("a lock-only table: want fenceproxy.enter:\n%s", strings.Join(ran, "\n"))
	}

	// An older holder: refused by register through hold_at, nothing
	// changed; a newer one registers, and the holder of 7 is refused.
	before, beforeJobs := snapshot(t, d, "acct"), tableText(t, d, "jobs")
	h5 := bindSession(t, p, db, "L", "5")
	for _, c := range []struct {
		stmt string
		arg  any
	}{{upd, 1}, {"UPDATE jobs SET state = $1 WHERE id = 1", "stale"}} {
		ran, err := bindRan(t, h5, c.stmt, c.arg)
		if sqlState(err) != "FP001" || !strings.Contains(err.Error(), "stale token 5") || c.stmt == upd && !byValue(t, ran) {
			t.Errorf("%s with an older token: %v, want register's FP001 (through hold_at for acct):\n%s", c.stmt, err, strings.Join(ran, "\n"))
		}
	}
	wantUnchanged(t, d, "acct", before)
	if after := tableText(t, d, "jobs"); after != beforeJobs {
		t.Errorf("stale writes changed jobs:\n before %s\n after  %s", beforeJobs, after)
	}
	h9 := bindSession(t, p, db, "L", "9")
	if ran := mustBindRan(t, h9, upd, 1); !byValue(t, ran) {
		t.Errorf("a newer holder: not one call of hold_at:\n%s", strings.Join(ran, "\n"))
	}
	if w := lockWatermark(t, d, "L"); w != 9 {
		t.Errorf("lock L's watermark %d after the newer holder, want 9", w)
	}
	if _, err := bindRan(t, h7, upd, 3); sqlState(err) != "FP001" {
		t.Errorf("the holder of 7 after 9 registered: %v, want FP001", err)
	}

	// A stale row behind a passing registration: the error names the
	// session's token.
	execDirect(t, d, "UPDATE acct SET last_fence = 100 WHERE id = 2")
	before = snapshot(t, d, "acct")
	if _, err := bindRan(t, h9, upd, 2); sqlState(err) != "FP001" || !strings.Contains(err.Error(), "stale fencing token 9 ") {
		t.Errorf("a row fenced at 100, token 9: %v, want FP001 naming token 9", err)
	}
	wantUnchanged(t, d, "acct", before)

	// Two statements before one Sync: a later one could read what a
	// registration sets, so the values go first (enter).
	b := &pgx.Batch{}
	b.Queue(upd, 1)
	b.Queue("SELECT current_setting('fence.token', true)")
	off := logSize(t)
	var seen string
	br := h9.SendBatch(ctxT(t), b)
	if _, err := br.Exec(); err != nil {
		t.Fatal(err)
	}
	if err := br.QueryRow().Scan(&seen); err != nil {
		t.Fatal(err)
	}
	if err := br.Close(); err != nil {
		t.Fatal(err)
	}
	if ran := serverRan(t, h9, off); byValue(t, ran) || seen != "9" {
		t.Errorf("a batch of two: read %q, ran:\n%s\nwant fenceproxy.enter and token 9", seen, strings.Join(ran, "\n"))
	}
}

// TestHoldAtRenamedSettings: a reload that renames the fence settings
// leaves sessions opened before it with a record of the old names. Their
// writes then follow the rules in force, which read the new ones: the
// record's values (of the old names) must not stand in for them, neither
// in hold_at's call nor written into a row's fence.
func TestHoldAtRenamedSettings(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := preludeDB(t, specs, "")
	old := runPid(t, readerSession(t, p, db, "L", "7", pgx.QueryExecModeSimpleProtocol))
	if ok, err := sentHoldAt(t, d, old, "UPDATE jobs SET state = 'h7' WHERE id = 1"); err != nil || !ok {
		t.Fatalf("before the reload: %v, sent %s; want one call of hold_at", err, sentText(t, d, old))
	}

	renamed := lockRules
	renamed.TokenSetting, renamed.LockSetting = "app.token", "app.lock"
	rs, err := rules.Compile(renamed)
	if err != nil {
		t.Fatal(err)
	}
	pol.Swap(rs, false)
	// Until it sets them, the new settings are unset in the old session:
	// the registration the rules in force make reads them, finds no lock
	// named, and refuses a write of a table that requires one (the
	// record's values, of the old names, do not stand in for them).
	before := tableText(t, d, "jobs")
	if _, err := old.Exec(ctxT(t), "UPDATE jobs SET state = 'unnamed' WHERE id = 1"); err == nil {
		t.Errorf("a lock-required write with the new settings unset: no error (sent %s)", sentText(t, d, old))
	} else if sqlState(err) != "FP002" {
		t.Errorf("a lock-required write with the new settings unset: %v, want FP002", err)
	}
	if after := tableText(t, d, "jobs"); after != before {
		t.Errorf("jobs changed:\n before %s\n after  %s", before, after)
	}
	// The old session names the lock and a newer token in the new
	// settings; its old ones still say L and 7.
	mustExec(t, old, "SET app.lock = 'L'")
	mustExec(t, old, "SET app.token = '9'")
	for _, stmt := range []string{"UPDATE jobs SET state = 'h9' WHERE id = 1", "UPDATE acct SET n = n + 1 WHERE id = 1"} {
		var err error
		for i := 0; i < 100; i++ {
			if _, err = old.Exec(ctxT(t), stmt); sqlState(err) != "FP003" {
				break
			}
		}
		if err != nil {
			t.Fatalf("%s after the rename: %v (sent %s)", stmt, err, sentText(t, d, old))
		}
		if w := lockWatermark(t, d, "L"); w != 9 {
			t.Errorf("%s after the rename: lock L's watermark %d, want 9 (app.token's); sent %s", stmt, w, sentText(t, d, old))
		}
	}
	if r := snapshot(t, d, "acct")[1]; r.Fence != 9 {
		t.Errorf("acct row 1 = %+v after the rename, want fence 9 (app.token's)", r)
	}
	// The holder of 7, in the new names, is refused and changes nothing.
	stale := connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
		c.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
		c.RuntimeParams["app.lock"], c.RuntimeParams["app.token"] = "L", "7"
	})
	before = tableText(t, d, "jobs")
	if _, err := stale.Exec(ctxT(t), "UPDATE jobs SET state = 'stale' WHERE id = 1"); sqlState(err) != "FP001" {
		t.Errorf("the holder of 7 in the new names: %v, want FP001", err)
	}
	if after := tableText(t, d, "jobs"); after != before {
		t.Errorf("a stale write changed jobs:\n before %s\n after  %s", before, after)
	}
}

// waitPooledCall waits until the server has counted a call of procedure
// fenceproxy.proc (track_functions) made through pe's pool, whose one
// server connection flushes its counts when next idle.
func waitPooledCall(t *testing.T, pe *poolerEnv, d *pgx.Conn, db, proc string) {
	t.Helper()
	flush := pe.bouncerDirect(t, "postgres", db)
	mustExec(t, flush, "SELECT pg_stat_force_next_flush()")
	flush.Close(ctxT(t))
	waitUntil(t, "a call of "+proc+" counted", func() bool {
		n := testutil.QueryStrings(t, d, "SELECT coalesce(sum(calls), 0)::text FROM pg_stat_user_functions WHERE schemaname = 'fenceproxy' AND funcname = '"+proc+"'")
		return len(n) == 1 && n[0] != "0"
	})
}
