package fencing_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"

	"github.com/fenceproxy/fenceproxy/internal/metrics"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Lock fencing end to end through the relay: sessions name their lock in
// fence.lock, statements on lock-fenced tables register the token first,
// and a stale holder can do nothing on those tables once a newer holder
// has read one of them. Every check looks at the data afterwards.

// lockRules fences acct by row and lock (lock: optional, the default),
// jobs by lock alone (lock: required, no fence column), and notes with a
// lock that is off (row fencing only).
var lockRules = rules.Config{Tables: []rules.Table{
	{Table: "public.acct"},
	{Table: "public.jobs", Lock: rules.LockRequired},
	{Table: "public.notes", Lock: rules.LockOff},
	{Table: "public.aud", Mode: rules.ModeAudit},
}}

const lockSchema = `
CREATE TABLE acct (id bigint PRIMARY KEY, payload text NOT NULL DEFAULT 'new', n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO acct (id, payload) VALUES (1, 'a'), (2, 'b'), (3, 'c');
CREATE TABLE jobs (id bigint PRIMARY KEY, state text NOT NULL);
INSERT INTO jobs VALUES (1, 'queued');
CREATE TABLE notes (id bigint PRIMARY KEY, body text, last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE aud (id bigint PRIMARY KEY, body text, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO aud VALUES (1, 'a', 0);
`

type lockEnv struct {
	proxy *proxytest.Proxy
}

func startLockEnv(t *testing.T) *lockEnv { return startLockEnvWith(t, policy.Options{}) }

func startLockEnvWith(t *testing.T, opts policy.Options, edit ...func(*proxy.Options)) *lockEnv {
	t.Helper()
	rs, err := rules.Compile(lockRules)
	if err != nil {
		t.Fatal(err)
	}
	return &lockEnv{proxy: startProxy(t, policy.New(rs, false, opts), edit...)}
}

// objectsSQL is what `fenceproxy setup` installs.
func objectsSQL(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile("../dbsetup/objects.sql")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// newLockDB makes a database with lockSchema and, when objects, the
// fenceproxy objects.
func newLockDB(t testing.TB, objects bool) string {
	t.Helper()
	sql := lockSchema
	if objects {
		sql += objectsSQL(t)
	}
	return schemaDB(t, "lockdb", sql)
}

// holder connects through the proxy as a holder of lock with token tok,
// both given as startup parameters (as pgxlock.Configure and PGOPTIONS
// do), in the given query mode.
func (e *lockEnv) holder(t *testing.T, db, lock string, tok int64, mode pgx.QueryExecMode) *pgx.Conn {
	t.Helper()
	return connectDSN(t, e.proxy.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
		c.DefaultQueryExecMode = mode
		c.RuntimeParams["fence.lock"] = lock
		c.RuntimeParams["fence.token"] = fmt.Sprint(tok)
	})
}

// plain connects through the proxy without naming a lock.
func (e *lockEnv) plain(t *testing.T, db string, mode pgx.QueryExecMode) *pgx.Conn {
	t.Helper()
	return connectDSN(t, e.proxy.DSN("postgres", "", db), func(c *pgx.ConnConfig) { c.DefaultQueryExecMode = mode })
}

var lockModes = []pgx.QueryExecMode{
	pgx.QueryExecModeSimpleProtocol,
	pgx.QueryExecModeCacheStatement,
	pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec,
}

func TestLockFencing(t *testing.T) {
	t.Parallel()
	testLockFencing(t, startLockEnv(t))
}

// TestLockFencingRaisers: the same behind a real dbsetup.Checker, so that
// in databases with fenceproxy's objects the rewrites call the error
// raisers while the registration runs before them.
func TestLockFencingRaisers(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, _ := startChecker(t, lockRules)
	e := startLockEnvWith(t, policy.Options{Checks: checker}, autoPrepare)

	// The form sent: the registration, then the UPDATE calling the raisers.
	db := newLockDB(t, true)
	c := e.holder(t, db, "L", 7, pgx.QueryExecModeSimpleProtocol)
	var pid int
	if err := c.QueryRow(ctxT(t), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctxT(t), "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	var q string
	if err := direct(t, db).QueryRow(ctxT(t), "SELECT query FROM pg_stat_activity WHERE pid = $1", pid).Scan(&q); err != nil {
		t.Fatal(err)
	}
	// The session's own values first (SET LOCAL), then the registration.
	if !strings.HasPrefix(q, "SET LOCAL fence.token = '7';SET LOCAL fence.lock = 'L';CALL fenceproxy.hold(") || !strings.Contains(q, "'7'::bigint THEN '7'::bigint ELSE fenceproxy.stale_at(acct.last_fence)") {
		t.Fatalf("sent %s; want the session's values, the registration and the raisers' token form", q)
	}

	testLockFencing(t, e)
}

func testLockFencing(t *testing.T, e *lockEnv) {
	t.Run("stale holder refused after new holder's first read", func(t *testing.T) {
		for _, mode := range lockModes {
			t.Run(mode.String(), func(t *testing.T) {
				t.Parallel()
				testStaleHolder(t, e, mode)
			})
		}
	})
	for _, c := range []struct {
		name string
		run  func(*testing.T, *lockEnv)
	}{
		{"same token not serialised, newer waits for older", testLockWaits},
		{"required", testLockRequired},
		{"sessions without a lock name are untouched", testNoLockName},
		{"multi-statement query", testLockMultiStatement},
		{"SQL-level PREPARE and EXECUTE", testLockSQLPrepared},
		{"pipeline", testLockPipeline},
		{"repeatable read", testLockRepeatableRead},
		{"registration statement kept prepared", testLockPreparedRegistration},
		{"audit mode", testLockAudit},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t, e)
		})
	}
}

func testStaleHolder(t *testing.T, e *lockEnv, mode pgx.QueryExecMode) {
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	old := e.holder(t, db, "tenant/7", 10, mode)
	// The old holder works normally, and its statements are prepared
	// (cached by pgx) before the new holder appears.
	mustExec(t, old, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)
	mustExec(t, old, "INSERT INTO acct (id, payload) VALUES ($1, $2)", 40, "old")
	mustExec(t, old, "DELETE FROM acct WHERE id = $1", 40)
	mustExec(t, old, "UPDATE acct SET n = n + 1 WHERE id = $1", 3)
	var n int
	if err := old.QueryRow(ctx, "SELECT n FROM acct WHERE id = $1", 1).Scan(&n); err != nil || n != 1 {
		t.Fatalf("old holder's read: n=%d err=%v", n, err)
	}

	// The new holder only reads row 2: no stamp on any row.
	nw := e.holder(t, db, "tenant/7", 11, mode)
	if err := nw.QueryRow(ctx, "SELECT n FROM acct WHERE id = $1", 2).Scan(&n); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, d, "acct")
	if before[3].Fence != 10 || before[2].Fence != 0 {
		t.Fatalf("rows: %v", before)
	}

	// Everything the old holder does on acct is refused now.
	for _, st := range []struct {
		sql  string
		args []any
	}{
		{"INSERT INTO acct (id, payload) VALUES ($1, $2)", []any{41, "stale"}},                   // a new row
		{"UPDATE acct SET n = n + 1 WHERE id = $1", []any{3}},                                    // a row the new holder never touched
		{"UPDATE acct SET n = n + 1 WHERE id = $1", []any{1}},                                    // prepared before
		{"DELETE FROM acct WHERE id = $1", []any{1}},                                             // a delete
		{"SELECT n FROM acct WHERE id = $1", []any{1}},                                           // and reads
		{"INSERT INTO acct (id, payload) VALUES ($1, $2) ON CONFLICT DO NOTHING", []any{1, "x"}}, // an upsert
	} {
		_, err := old.Exec(ctx, st.sql, st.args...)
		wantCode(t, err, "FP001")
		if !strings.Contains(err.Error(), "tenant/7") || !strings.Contains(err.Error(), "11") {
			t.Fatalf("%s: the error should name the lock and the watermark: %v", st.sql, err)
		}
	}
	wantUnchanged(t, d, "acct", before)

	// Re-insert of a row the new holder deleted.
	mustExec(t, nw, "DELETE FROM acct WHERE id = $1", 2)
	after := snapshot(t, d, "acct")
	_, err := old.Exec(ctx, "INSERT INTO acct (id, payload) VALUES ($1, $2)", 2, "resurrected")
	wantCode(t, err, "FP001")
	wantUnchanged(t, d, "acct", after)
	// The lock-only table too.
	_, err = old.Exec(ctx, "UPDATE jobs SET state = 'stale' WHERE id = 1")
	wantCode(t, err, "FP001")
	var state string
	if err := d.QueryRow(ctx, "SELECT state FROM jobs WHERE id = 1").Scan(&state); err != nil || state != "queued" {
		t.Fatalf("jobs row 1: %q %v", state, err)
	}
	// The new holder's session is unaffected, and tables with lock: off
	// are row-fenced only.
	mustExec(t, nw, "UPDATE jobs SET state = 'running' WHERE id = $1", 1)
	mustExec(t, old, "INSERT INTO notes (id, body) VALUES ($1, $2)", 1, "row fencing only")
	var w int64
	if err := d.QueryRow(ctx, "SELECT token FROM fenceproxy.locks WHERE name = 'tenant/7'").Scan(&w); err != nil || w != 11 {
		t.Fatalf("watermark: %d %v", w, err)
	}
}

func mustExec(t testing.TB, c *pgx.Conn, sql string, args ...any) {
	t.Helper()
	if _, err := c.Exec(ctxT(t), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// waitingOnLock waits until the session with backend pid is waiting for a
// lock, as pg_stat_activity shows it.
func waitingOnLock(t *testing.T, d *pgx.Conn, pid uint32) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		var waiting bool
		if err := d.QueryRow(ctxT(t), "SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1", int32(pid)).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("session %d never waited for a lock", pid)
}

func testLockWaits(t *testing.T, e *lockEnv) {
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	// Register token 20 first.
	first := e.holder(t, db, "L", 20, pgx.QueryExecModeCacheStatement)
	mustExec(t, first, "SELECT 1 FROM acct")

	// Two sessions of token 20 in open transactions do not wait for each
	// other (a wait would block here until the test's context ends).
	a := e.holder(t, db, "L", 20, pgx.QueryExecModeCacheStatement)
	b := e.holder(t, db, "L", 20, pgx.QueryExecModeSimpleProtocol)
	mustExec(t, a, "BEGIN")
	mustExec(t, a, "UPDATE acct SET n = n + 1 WHERE id = 1")
	mustExec(t, b, "BEGIN")
	mustExec(t, b, "UPDATE acct SET n = n + 1 WHERE id = 2")
	mustExec(t, b, "SELECT * FROM jobs")

	// A newer token waits for both, then sees their writes.
	c := e.holder(t, db, "L", 21, pgx.QueryExecModeCacheStatement)
	type result struct {
		n1, n2 int
		err    error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		r.err = c.QueryRow(context.Background(), "SELECT (SELECT n FROM acct WHERE id = 1), (SELECT n FROM acct WHERE id = 2)").Scan(&r.n1, &r.n2)
		done <- r
	}()
	waitingOnLock(t, d, c.PgConn().PID())
	mustExec(t, a, "UPDATE acct SET n = n + 1 WHERE id = 3") // the older transactions go on meanwhile
	mustExec(t, a, "COMMIT")
	select {
	case r := <-done:
		t.Fatalf("the newer holder's read did not wait for the older transaction: %+v", r)
	default:
	}
	mustExec(t, b, "COMMIT")
	r := <-done
	if r.err != nil || r.n1 != 1 || r.n2 != 1 {
		t.Fatalf("the newer holder's first read: %+v, want both older writes (1, 1)", r)
	}
	// The older token is refused from now on, in every session.
	for _, s := range []*pgx.Conn{a, b, first} {
		_, err := s.Exec(ctx, "SELECT 1 FROM acct")
		wantCode(t, err, "FP001")
	}
	before := snapshot(t, d, "acct")
	_, err := a.Exec(ctx, "UPDATE acct SET n = 100 WHERE id = 3")
	wantCode(t, err, "FP001")
	wantUnchanged(t, d, "acct", before)
	var mu sync.Mutex
	_ = &mu
}

func testLockRequired(t *testing.T, e *lockEnv) {
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	for _, mode := range lockModes {
		p := e.plain(t, db, mode)
		for _, sql := range []string{"SELECT * FROM jobs", "INSERT INTO jobs VALUES (2, 'x')", "UPDATE jobs SET state = 'x'", "DELETE FROM jobs"} {
			_, err := p.Exec(ctx, sql)
			wantCode(t, err, "FP002")
			if !strings.Contains(err.Error(), "fence.lock") {
				t.Fatalf("%s: the error should name the lock setting: %v", sql, err)
			}
		}
		// A lock name with an invalid token.
		mustExec(t, p, "SET fence.lock = 'J'")
		mustExec(t, p, "SET fence.token = 'abc'")
		_, err := p.Exec(ctx, "SELECT * FROM jobs")
		wantCode(t, err, "FP002")
		// Other tables work as before in that session.
		mustExec(t, p, "RESET fence.lock")
		mustExec(t, p, "SET fence.token = '5'")
		mustExec(t, p, "UPDATE acct SET n = n WHERE id = 1")
	}
	var n int
	if err := d.QueryRow(ctx, "SELECT count(*) FROM jobs WHERE state <> 'queued' OR id <> 1").Scan(&n); err != nil || n != 0 {
		t.Fatalf("jobs changed: %d %v", n, err)
	}
	h := e.holder(t, db, "J", 3, pgx.QueryExecModeCacheStatement)
	mustExec(t, h, "INSERT INTO jobs VALUES ($1, $2)", 2, "queued")
	mustExec(t, h, "UPDATE jobs SET state = 'done' WHERE id = $1", 1)
	if err := d.QueryRow(ctx, "SELECT count(*) FROM jobs").Scan(&n); err != nil || n != 2 {
		t.Fatalf("jobs: %d %v", n, err)
	}
}

func testNoLockName(t *testing.T, e *lockEnv) {
	// A database without the fenceproxy objects: a registration would
	// fail there, so statements that succeed were not given one.
	db := newLockDB(t, false)
	ctx := ctxT(t)
	for _, mode := range lockModes {
		p := e.plain(t, db, mode)
		setTokenN(t, p, 5)
		var n int
		if err := p.QueryRow(ctx, "SELECT count(*) FROM acct").Scan(&n); err != nil || n != 3 {
			t.Fatalf("%v: read: %d %v", mode, n, err)
		}
		mustExec(t, p, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)
		mustExec(t, p, "INSERT INTO notes (id, body) VALUES ($1, 'x') ON CONFLICT DO NOTHING", 1)
	}
	// Once a session names a lock, its statements register, and without
	// the objects that fails closed.
	p := e.plain(t, db, pgx.QueryExecModeCacheStatement)
	setTokenN(t, p, 5)
	mustExec(t, p, "SELECT pg_catalog.set_config('fence.lock', 'L', false)")
	_, err := p.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1")
	if err == nil || !strings.Contains(err.Error(), "lock fencing is not set up") {
		t.Fatalf("a lock-named session in a database without the objects: %v", err)
	}
}

func testLockMultiStatement(t *testing.T, e *lockEnv) {
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	p := e.plain(t, db, pgx.QueryExecModeSimpleProtocol)
	res, err := p.PgConn().Exec(ctx, "SET fence.lock = 'M'; SET fence.token = '5'; SELECT id FROM acct ORDER BY id; UPDATE acct SET n = n + 1 WHERE id = 1; SELECT 7; UPDATE jobs SET state = 'm'").ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	var tags []string
	for _, r := range res {
		tags = append(tags, r.CommandTag.String())
	}
	if got, want := strings.Join(tags, ","), "SET,SET,SELECT 3,UPDATE 1,SELECT 1,UPDATE 1"; got != want {
		t.Fatalf("results %s, want %s", got, want)
	}
	// A newer holder, then the same text from the stale one fails whole.
	nw := e.holder(t, db, "M", 6, pgx.QueryExecModeSimpleProtocol)
	mustExec(t, nw, "SELECT 1 FROM jobs")
	before := snapshot(t, d, "acct")
	_, err = p.PgConn().Exec(ctx, "UPDATE notes SET body = 'n'; UPDATE acct SET n = n + 1 WHERE id = 2; SELECT 1").ReadAll()
	wantCode(t, err, "FP001")
	wantUnchanged(t, d, "acct", before)
	// The session goes on working after the error.
	var one int
	if err := p.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
		t.Fatal(err)
	}
}

func testLockSQLPrepared(t *testing.T, e *lockEnv) {
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	old := e.holder(t, db, "P", 30, pgx.QueryExecModeSimpleProtocol)
	mustExec(t, old, "PREPARE bump AS UPDATE acct SET n = n + 1 WHERE id = 3")
	mustExec(t, old, "PREPARE look AS SELECT n FROM acct WHERE id = 3")
	mustExec(t, old, "EXECUTE bump")
	mustExec(t, old, "EXECUTE look")
	_, err := old.Exec(ctx, "EXECUTE bump; SELECT 1")
	wantCode(t, err, "FP003")

	nw := e.holder(t, db, "P", 31, pgx.QueryExecModeCacheStatement)
	mustExec(t, nw, "SELECT 1 FROM acct WHERE id = 1")
	before := snapshot(t, d, "acct")
	_, err = old.Exec(ctx, "EXECUTE bump")
	wantCode(t, err, "FP001")
	_, err = old.Exec(ctx, "EXECUTE look")
	wantCode(t, err, "FP001")
	// EXECUTE through a protocol-level statement.
	_, err = old.PgConn().ExecParams(ctx, "EXECUTE bump", nil, nil, nil, nil).Close()
	wantCode(t, err, "FP001")
	wantUnchanged(t, d, "acct", before)
}

func testLockPipeline(t *testing.T, e *lockEnv) {
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	h := e.holder(t, db, "B", 50, pgx.QueryExecModeCacheStatement)
	b := &pgx.Batch{}
	b.Queue("UPDATE acct SET n = n + 1 WHERE id = $1", 1)
	b.Queue("SELECT n FROM acct WHERE id = $1", 1)
	b.Queue("UPDATE notes SET body = 'x'")
	b.Queue("INSERT INTO jobs VALUES ($1, 'b')", 5)
	b.Queue("SELECT count(*) FROM jobs")
	br := h.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := br.QueryRow().Scan(&n); err != nil || n != 1 {
		t.Fatalf("n = %d %v", n, err)
	}
	if _, err := br.Exec(); err != nil {
		t.Fatal(err)
	}
	if _, err := br.Exec(); err != nil {
		t.Fatal(err)
	}
	if err := br.QueryRow().Scan(&n); err != nil || n != 2 {
		t.Fatalf("jobs = %d %v", n, err)
	}
	if err := br.Close(); err != nil {
		t.Fatal(err)
	}
	nw := e.holder(t, db, "B", 51, pgx.QueryExecModeCacheStatement)
	mustExec(t, nw, "SELECT 1 FROM jobs")
	before := snapshot(t, d, "acct")
	b = &pgx.Batch{}
	b.Queue("UPDATE notes SET body = 'y'")
	b.Queue("UPDATE acct SET n = n + 1 WHERE id = $1", 2)
	b.Queue("SELECT 1")
	err := h.SendBatch(ctx, b).Close()
	wantCode(t, err, "FP001")
	wantUnchanged(t, d, "acct", before)
	var body string
	if err := d.QueryRow(ctx, "SELECT coalesce(max(body), '') FROM notes").Scan(&body); err != nil || body == "y" {
		t.Fatalf("the pipeline's implicit transaction should have rolled back: notes %q %v", body, err)
	}
}

func testLockRepeatableRead(t *testing.T, e *lockEnv) {
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	old := e.holder(t, db, "R", 60, pgx.QueryExecModeCacheStatement)
	mustExec(t, old, "SELECT 1 FROM acct") // registers 60
	mustExec(t, old, "BEGIN ISOLATION LEVEL REPEATABLE READ")
	mustExec(t, old, "SELECT 1") // the snapshot is taken
	nw := e.holder(t, db, "R", 61, pgx.QueryExecModeCacheStatement)
	mustExec(t, nw, "SELECT 1 FROM acct")
	before := snapshot(t, d, "acct")
	// The old holder's snapshot still shows watermark 60: the registration
	// must not trust it.
	_, err := old.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 3")
	var code string
	if code = sqlState(err); code != "40001" && code != "FP001" {
		t.Fatalf("stale holder in REPEATABLE READ: %v, want 40001 or FP001", err)
	}
	mustExec(t, old, "ROLLBACK")
	wantUnchanged(t, d, "acct", before)
	_, err = old.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 3")
	wantCode(t, err, "FP001")
	if err == nil {
		t.Fatal(errors.New("unreachable"))
	}
}

func testLockAudit(t *testing.T, e *lockEnv) {
	db := newLockDB(t, true)
	ctx := ctxT(t)
	listener := direct(t, db)
	mustExec(t, listener, "LISTEN "+rules.AuditChannel)
	old := e.holder(t, db, "A", 70, pgx.QueryExecModeCacheStatement)
	mustExec(t, old, "SELECT 1 FROM acct")
	nw := e.holder(t, db, "A", 71, pgx.QueryExecModeCacheStatement)
	mustExec(t, nw, "SELECT 1 FROM acct")
	// A statement on audit-mode tables only is never refused: it runs,
	// and what enforce would have done is reported.
	mustExec(t, old, "UPDATE aud SET body = 'stale but audited' WHERE id = 1")
	n, err := listener.WaitForNotification(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := rules.ParseAuditEvent(n.Payload)
	if err != nil {
		t.Fatalf("payload %s: %v", n.Payload, err)
	}
	if ev.Reason != rules.AuditStaleLock || ev.Lock == nil || *ev.Lock != "A" || ev.Watermark == nil || *ev.Watermark != 71 || ev.Token == nil || *ev.Token != "70" {
		t.Fatalf("event %+v", ev)
	}
	var body string
	if err := listener.QueryRow(ctx, "SELECT body FROM aud WHERE id = 1").Scan(&body); err != nil || body != "stale but audited" {
		t.Fatalf("aud: %q %v", body, err)
	}
	// With an enforced table in the same statement, enforce decides.
	_, err = old.Exec(ctx, "UPDATE aud SET body = 'x' WHERE id IN (SELECT id FROM acct)")
	wantCode(t, err, "FP001")
}

// The proxy prepares its registration statement once per session and
// runs it again with Bind and Execute; a client's DEALLOCATE ALL removes
// it, and it is prepared again.
func testLockPreparedRegistration(t *testing.T, e *lockEnv) {
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	// (Describe-exec: pgx's statement cache would itself break on
	// DEALLOCATE ALL, as it does without the proxy.)
	h := e.holder(t, db, "K", 80, pgx.QueryExecModeDescribeExec)
	for i := 0; i < 5; i++ {
		mustExec(t, h, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)
	}
	mustExec(t, h, "DEALLOCATE ALL")
	for i := 0; i < 3; i++ {
		mustExec(t, h, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)
	}
	if _, err := h.Exec(ctx, "DEALLOCATE ALL; SELECT 1"); err != nil {
		t.Fatal(err)
	}
	mustExec(t, h, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)
	var n int
	if err := d.QueryRow(ctx, "SELECT n FROM acct WHERE id = 1").Scan(&n); err != nil || n != 9 {
		t.Fatalf("n = %d %v", n, err)
	}
	// Still registering: a newer holder fences this one.
	nw := e.holder(t, db, "K", 81, pgx.QueryExecModeCacheStatement)
	mustExec(t, nw, "SELECT 1 FROM acct")
	_, err := h.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)
	wantCode(t, err, "FP001")
}

// The lock registration's refusals are counted by lock name and reason.
func TestLockRejectionMetrics(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	e := startLockEnvWith(t, policy.Options{Metrics: m})
	db := newLockDB(t, true)
	ctx := ctxT(t)
	old := e.holder(t, db, "M1", 90, pgx.QueryExecModeCacheStatement)
	mustExec(t, old, "SELECT 1 FROM acct")
	nw := e.holder(t, db, "M1", 91, pgx.QueryExecModeCacheStatement)
	mustExec(t, nw, "SELECT 1 FROM acct")
	for range 2 {
		_, err := old.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1")
		wantCode(t, err, "FP001")
	}
	_, err := e.plain(t, db, pgx.QueryExecModeSimpleProtocol).Exec(ctx, "SELECT * FROM jobs")
	wantCode(t, err, "FP002")
	if got := counterValue(t, m.LockRejections.WithLabelValues("M1", "stale")); got != 2 {
		t.Errorf("stale rejections of lock M1 = %v, want 2", got)
	}
	if got := counterValue(t, m.LockRejections.WithLabelValues("", "missing_lock")); got != 1 {
		t.Errorf("missing-lock rejections = %v, want 1", got)
	}
}

func counterValue(t *testing.T, c interface{ Write(*dto.Metric) error }) float64 {
	t.Helper()
	var d dto.Metric
	if err := c.Write(&d); err != nil {
		t.Fatal(err)
	}
	return d.GetCounter().GetValue()
}
