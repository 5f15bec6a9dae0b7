package fencing_test

import (
	"database/sql"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/pgbouncer"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/pgxlock"
)

// Fencing through a transaction pooler (issue 26). PgBouncer in
// transaction mode hands each transaction of a client to whichever server
// connection is free, and does not carry custom settings such as
// fence.token and fence.lock from one transaction to the next: a server
// connection keeps what the last client set on it. The proxy in front of
// PgBouncer must therefore run every statement on a protected table with
// its own client session's values, whatever the server connection carries.
//
// The tables are lockRules' (acct: row and lock fencing, lock optional).
// Every check reads the data back directly from PostgreSQL.
//
// The extended protocol is pgx's QueryExecModeExec (unnamed statements,
// one round trip): pgx's default names its prepared statements, which
// PgBouncer 1.18 in transaction mode cannot carry between server
// connections, with or without the proxy.

// poolerPoolSize is default_pool_size: two server connections.
const poolerPoolSize = 2

// poolerEnv is fenceproxy → PgBouncer (transaction mode) → PostgreSQL.
type poolerEnv struct {
	bouncer *pgbouncer.Server
	proxy   *proxytest.Proxy
	size    int // the pool's size; 0: poolerPoolSize
}

func (pe *poolerEnv) poolSize() int {
	if pe.size == 0 {
		return poolerPoolSize
	}
	return pe.size
}

// poolerIgnored are the startup parameters PgBouncer accepts and drops:
// the fence settings reach the server only as the proxy applies them.
var poolerIgnored = []string{"options", "extra_float_digits", "fence.token", "fence.lock"}

// poolerRole is a second login role, for settings from ALTER ROLE … SET
// (PgBouncer's pool is per user and database).
const poolerRole = "fp_pooler_role"

// startPoolerBouncer starts the transaction-mode PgBouncer of the
// pooler tests, for postgres and poolerRole (created if need be).
func startPoolerBouncer(t *testing.T) *pgbouncer.Server {
	t.Helper()
	return startPoolerBouncerSized(t, poolerPoolSize)
}

// startPoolerBouncerSized is startPoolerBouncer with pools of size
// connections.
func startPoolerBouncerSized(t *testing.T, size int) *pgbouncer.Server {
	t.Helper()
	if err := cluster.ExecDB(ctxT(t), "postgres", `DO $$BEGIN CREATE ROLE `+poolerRole+` LOGIN SUPERUSER; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END$$`); err != nil {
		t.Fatal(err)
	}
	return pgbouncer.StartOptions(t, cluster.Addr(), pgbouncer.Options{
		PoolMode:                "transaction",
		PoolSize:                size,
		IgnoreStartupParameters: poolerIgnored,
		Users:                   []string{"postgres", poolerRole},
	})
}

func startPoolerEnv(t *testing.T) *poolerEnv {
	t.Helper()
	rs, err := rules.Compile(lockRules)
	if err != nil {
		t.Fatal(err)
	}
	return startPoolerEnvWith(t, policy.New(rs, false, policy.Options{}))
}

// startPoolerEnvWith starts the pooler tests' PgBouncer and a proxy in
// front of it with pol.
func startPoolerEnvWith(t *testing.T, pol proxy.Policy) *poolerEnv {
	t.Helper()
	return startPoolerEnvSized(t, pol, poolerPoolSize)
}

// startPoolerEnvSized is startPoolerEnvWith with pools of size
// connections.
func startPoolerEnvSized(t *testing.T, pol proxy.Policy, size int) *poolerEnv {
	t.Helper()
	b := startPoolerBouncerSized(t, size)
	p := proxytest.Start(t, b.Addr(), proxy.Options{
		Policy: pol,
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)).Named("proxy"),
	})
	return &poolerEnv{bouncer: b, proxy: p, size: size}
}

// poolerModes are the client protocols: simple Query, and the extended
// protocol with unnamed statements.
var poolerModes = []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec}

func extendedMode(m pgx.QueryExecMode) bool { return m != pgx.QueryExecModeSimpleProtocol }

// session connects through the proxy (and PgBouncer behind it) in mode,
// with edit applied to the configuration.
func (pe *poolerEnv) session(t *testing.T, db string, mode pgx.QueryExecMode, edit ...func(*pgx.ConnConfig)) *pgx.Conn {
	t.Helper()
	return pe.sessionAs(t, "postgres", db, mode, edit...)
}

func (pe *poolerEnv) sessionAs(t *testing.T, user, db string, mode pgx.QueryExecMode, edit ...func(*pgx.ConnConfig)) *pgx.Conn {
	t.Helper()
	return connectDSN(t, pe.proxy.DSN(user, "", db), append([]func(*pgx.ConnConfig){func(c *pgx.ConnConfig) {
		c.DefaultQueryExecMode = mode
	}}, edit...)...)
}

// bouncerDirect connects to PgBouncer without the proxy, simple protocol.
func (pe *poolerEnv) bouncerDirect(t *testing.T, user, db string) *pgx.Conn {
	t.Helper()
	return connectDSN(t, pe.bouncer.DSN(user, db), func(c *pgx.ConnConfig) {
		c.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	})
}

// send runs stmt on c in c's protocol: a simple Query, or an unnamed
// Parse/Bind/Execute (pgx would send a text without arguments as a
// simple Query); with args, pgx's Exec in c's mode.
func send(t testing.TB, c *pgx.Conn, stmt string, args ...any) error {
	t.Helper()
	return execStmt(t, c, stmt, args, extendedMode(c.Config().DefaultQueryExecMode))
}

func mustSend(t testing.TB, c *pgx.Conn, stmt string, args ...any) {
	t.Helper()
	if err := send(t, c, stmt, args...); err != nil {
		t.Fatalf("%s: %v", stmt, err)
	}
}

// poolerReset gives acct rows 1 'a' (fence 42), 2 'b' and 3 'c' (fence 0)
// and lock L watermark 42, directly.
func poolerReset(t testing.TB, d *pgx.Conn) rowSet {
	t.Helper()
	if _, err := d.PgConn().Exec(ctxT(t), `
		DELETE FROM acct;
		INSERT INTO acct (id, payload, last_fence) VALUES (1, 'a', 42), (2, 'b', 0), (3, 'c', 0);
		DELETE FROM fenceproxy.locks;
		INSERT INTO fenceproxy.locks (name, token) VALUES ('L', 42);
	`).ReadAll(); err != nil {
		t.Fatalf("reset: %v", err)
	}
	return snapshot(t, d, "acct")
}

func lockWatermark(t testing.TB, d *pgx.Conn, name string) int64 {
	t.Helper()
	var w int64
	if err := d.QueryRow(ctxT(t), "SELECT coalesce((SELECT token FROM fenceproxy.locks WHERE name = $1), 0)", name).Scan(&w); err != nil {
		t.Fatal(err)
	}
	return w
}

// serverValues reads, on every server connection of the pool at once
// (through PgBouncer, bypassing the proxy: each session holds one in an
// open transaction), what it carries for the fence settings.
func (pe *poolerEnv) serverValues(t *testing.T, user, db string) [][2]string {
	t.Helper()
	var out [][2]string
	var conns []*pgx.Conn
	for range pe.poolSize() {
		c := pe.bouncerDirect(t, user, db)
		conns = append(conns, c)
		mustExec(t, c, "BEGIN")
		var tok, lk *string
		if err := c.QueryRow(ctxT(t), "SELECT current_setting('fence.token', true), current_setting('fence.lock', true)").Scan(&tok, &lk); err != nil {
			t.Fatal(err)
		}
		out = append(out, [2]string{deref(tok), deref(lk)})
	}
	for _, c := range conns {
		mustExec(t, c, "COMMIT")
		c.Close(ctxT(t))
	}
	return out
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// pollute makes every server connection of the pool carry token tok and
// lock lk at session level, set by two other client sessions through the
// proxy that hold both connections at once; it checks the result.
func (pe *poolerEnv) pollute(t *testing.T, db, tok, lk string) {
	t.Helper()
	pe.polluteAs(t, "postgres", db, tok, lk)
}

// polluteAs is pollute for the pool of user.
func (pe *poolerEnv) polluteAs(t *testing.T, user, db, tok, lk string) {
	t.Helper()
	var cs []*pgx.Conn
	for range pe.poolSize() {
		c := pe.sessionAs(t, user, db, pgx.QueryExecModeSimpleProtocol)
		cs = append(cs, c)
		mustSend(t, c, "BEGIN")
		mustSend(t, c, fmt.Sprintf("SET fence.token = '%s'", tok))
		mustSend(t, c, fmt.Sprintf("SET fence.lock = '%s'", lk))
	}
	for _, c := range cs {
		mustSend(t, c, "COMMIT")
		c.Close(ctxT(t))
	}
	for i, v := range pe.serverValues(t, user, db) {
		if v != [2]string{tok, lk} {
			t.Fatalf("test bug: server connection %d carries token %q lock %q after pollution, want %q %q", i, v[0], v[1], tok, lk)
		}
	}
}

func TestPooler(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pe := startPoolerEnv(t)
	// The subtests share one PgBouncer: its pool is per database, and each
	// subtest works in a database of its own, so they run in parallel.
	for _, mode := range poolerModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Run("interleaving, row fencing", func(t *testing.T) { t.Parallel(); testPoolerRowInterleaving(t, pe, mode) })
			t.Run("interleaving, lock fencing", func(t *testing.T) { t.Parallel(); testPoolerLockInterleaving(t, pe, mode) })
			t.Run("fresh holder stamped with its own token", func(t *testing.T) { t.Parallel(); testPoolerFreshHolder(t, pe, mode) })
			t.Run("no token on a connection that had one", func(t *testing.T) { t.Parallel(); testPoolerNoToken(t, pe, mode) })
			t.Run("forms", func(t *testing.T) { t.Parallel(); testPoolerForms(t, pe, mode) })
			t.Run("pipeline", func(t *testing.T) { t.Parallel(); testPoolerPipeline(t, pe, mode) })
			t.Run("ALTER ROLE SET", func(t *testing.T) { t.Parallel(); testPoolerAlterRole(t, pe, mode) })
			if !extendedMode(mode) {
				t.Run("write after COMMIT in one Query", func(t *testing.T) { t.Parallel(); testPoolerAfterCommit(t, pe) })
			}
		})
	}
}

// interleave runs the interleaving: B sets token bTok (and lock
// bLock, registering it when set with a read of row 2), then holds a
// server connection in an open transaction; A, made by newA, sets its
// values with setA while B holds it (so A's statements run on the other
// connection), and B commits. It returns A.
func interleave(t *testing.T, pe *poolerEnv, db string, mode pgx.QueryExecMode, bTok, bLock string, setA []string) *pgx.Conn {
	t.Helper()
	b := pe.session(t, db, mode)
	mustSend(t, b, fmt.Sprintf("SET fence.token = '%s'", bTok))
	if bLock != "" {
		mustSend(t, b, fmt.Sprintf("SET fence.lock = '%s'", bLock))
		mustSend(t, b, "SELECT n FROM acct WHERE id = 2")
	}
	mustSend(t, b, "BEGIN")
	mustSend(t, b, "SELECT 1")
	a := pe.session(t, db, mode)
	for _, st := range setA {
		mustSend(t, a, st)
	}
	mustSend(t, b, "COMMIT")
	return a
}

func testPoolerRowInterleaving(t *testing.T, pe *poolerEnv, mode pgx.QueryExecMode) {
	db := newLockDB(t, true)
	d := direct(t, db)
	before := poolerReset(t, d)
	a := interleave(t, pe, db, mode, "43", "", []string{"SET fence.token = '41'"})
	for i := range 2 {
		err := send(t, a, "UPDATE acct SET payload = 'stale' WHERE id = 1")
		if sqlState(err) != "FP001" {
			t.Fatalf("stale write %d behind the pooler: %v, want FP001", i+1, err)
		}
	}
	wantUnchanged(t, d, "acct", before)
	if r := snapshot(t, d, "acct")[1]; r.Payload != "a" || r.Fence != 42 {
		t.Fatalf("row 1 = %+v, want payload a fence 42", r)
	}
}

func testPoolerLockInterleaving(t *testing.T, pe *poolerEnv, mode pgx.QueryExecMode) {
	db := newLockDB(t, true)
	d := direct(t, db)
	poolerReset(t, d)
	a := interleave(t, pe, db, mode, "43", "L", []string{"SET fence.token = '41'", "SET fence.lock = 'L'"})
	if w := lockWatermark(t, d, "L"); w != 43 {
		t.Fatalf("B's read should have registered 43 for L: watermark %d", w)
	}
	before := snapshot(t, d, "acct")
	for _, st := range []struct {
		sql  string
		args []any
	}{
		{"INSERT INTO acct (id, payload) VALUES (50, 'stale')", nil},
		{"UPDATE acct SET payload = 'stale' WHERE id = 3", nil}, // a row B never touched
		{"INSERT INTO acct (id, payload) VALUES ($1, $2)", []any{51, "stale"}},
		{"UPDATE acct SET payload = $1 WHERE id = $2", []any{"stale", 3}},
	} {
		if st.args != nil && !extendedMode(mode) {
			continue
		}
		err := send(t, a, st.sql, st.args...)
		if sqlState(err) != "FP001" {
			t.Fatalf("%s: %v, want FP001 for lock L", st.sql, err)
		}
	}
	wantUnchanged(t, d, "acct", before)
	if w := lockWatermark(t, d, "L"); w != 43 {
		t.Fatalf("watermark of L = %d, want 43", w)
	}
}

func testPoolerFreshHolder(t *testing.T, pe *poolerEnv, mode pgx.QueryExecMode) {
	for _, lk := range []string{"", "L"} {
		t.Run("lock="+lk, func(t *testing.T) {
			db := newLockDB(t, true)
			d := direct(t, db)
			poolerReset(t, d)
			setA := []string{"SET fence.token = '44'"}
			if lk != "" {
				setA = append(setA, "SET fence.lock = 'L'")
			}
			a := interleave(t, pe, db, mode, "43", lk, setA)
			mustSend(t, a, "UPDATE acct SET payload = 'w44' WHERE id = 1")
			mustSend(t, a, "UPDATE acct SET payload = 'w44' WHERE id = 3")
			mustSend(t, a, "INSERT INTO acct (id, payload) VALUES (60, 'w44')")
			if extendedMode(mode) {
				mustSend(t, a, "INSERT INTO acct (id, payload) VALUES ($1, $2)", 61, "w44")
			}
			got := snapshot(t, d, "acct")
			for _, id := range []int64{1, 3, 60} {
				if r := got[id]; r.Payload != "w44" || r.Fence != 44 {
					t.Errorf("row %d = %+v, want payload w44 stamped 44 (never B's 43)", id, r)
				}
			}
			if r, ok := got[61]; extendedMode(mode) && (!ok || r.Fence != 44) {
				t.Errorf("row 61 = %+v, want stamped 44", r)
			}
			if lk != "" {
				if w := lockWatermark(t, d, "L"); w != 44 {
					t.Errorf("watermark of L = %d, want 44", w)
				}
			}
		})
	}
}

func testPoolerNoToken(t *testing.T, pe *poolerEnv, mode pgx.QueryExecMode) {
	db := newLockDB(t, true)
	d := direct(t, db)
	before := poolerReset(t, d)
	a := interleave(t, pe, db, mode, "43", "", nil)
	err := send(t, a, "UPDATE acct SET payload = 'none' WHERE id = 2")
	if sqlState(err) != "FP002" {
		t.Fatalf("a session without a token on a server connection with one: %v, want FP002", err)
	}
	// Every server connection carrying a valid token, and the lock name.
	pe.pollute(t, db, "43", "L")
	for _, st := range []string{
		"UPDATE acct SET payload = 'none' WHERE id = 2",
		"INSERT INTO acct (id, payload) VALUES (70, 'none')",
	} {
		if err := send(t, a, st); sqlState(err) != "FP002" {
			t.Fatalf("%s without a token: %v, want FP002", st, err)
		}
	}
	wantUnchanged(t, d, "acct", before)
	if w := lockWatermark(t, d, "L"); w != 42 {
		t.Fatalf("watermark of L = %d, want 42 (nothing registered)", w)
	}
}

// poolerWant is the outcome a form should give the session.
type poolerWant int

const (
	wantStale   poolerWant = iota // token 41: refused (FP001), nothing changes
	wantMissing                   // no token: refused (FP002), nothing changes
	wantValid                     // token 44: lands, stamped 44
)

// poolerForm sets (or removes) the session's token and lock by one form.
type poolerForm struct {
	name    string
	startup func(*pgx.ConnConfig)
	// before: statements in their own transactions, then the pool is
	// polluted with pollTok/pollLock (default 43 and no lock).
	before []string
	args   []any // bound parameters of before's last statement
	// tx: statements of the transaction the writes run in, after the
	// pollution, before the writes; the transaction rolls back after the
	// checks.
	tx       []string
	txArgs   []any
	pollLock string
	lock     bool // the session names lock L
	want     poolerWant
	extended bool // extended protocol only
	simple   bool // simple protocol only
	// A statement of before starting with "?" has an effect the statement
	// does not show: the proxy may read it back or refuse it (FP003).
	// Refused, it changed nothing, and the outcome is refusedWant (with
	// refusedLock) instead of want (with lock).
	refusedWant poolerWant
	refusedLock bool
}

func poolerForms() []poolerForm {
	return []poolerForm{
		{name: "startup options", startup: options(`-c fence.token=41 -c fence.lock=L`), lock: true, want: wantStale},
		{name: "startup options escaped", startup: options(`-c fence\.token=4\1 --fence.lock=L`), lock: true, want: wantStale},
		{name: "startup parameters", startup: both(param("fence.token", "41"), param("fence.lock", "L")), lock: true, want: wantStale},
		{name: "startup valid", startup: both(param("fence.token", "44"), param("fence.lock", "L")), lock: true, want: wantValid},
		{name: "SET", before: []string{"SET fence.token = '41'", `SET "fence"."lock" = 'L'`}, lock: true, want: wantStale},
		{name: "SET token only", before: []string{"SET fence.token = '41'"}, want: wantStale},
		{name: "SET valid", before: []string{"SET fence.token = '44'", "SET fence.lock = 'L'"}, lock: true, want: wantValid},
		{name: "set_config constants", before: []string{"SELECT set_config('fence.token', '41', false)", "SELECT pg_catalog.set_config('FENCE.LOCK', 'L', false)"}, lock: true, want: wantStale},
		{name: "set_config parameters", before: []string{"SELECT set_config('fence.lock', 'L', false)", "SELECT set_config($1, $2, false)"}, args: []any{"fence.token", "41"}, lock: true, want: wantStale, extended: true},
		{name: "set_config both parameters in one", before: []string{"SELECT set_config($1, $3, false), set_config($2, $4, false)"}, args: []any{"fence.token", "fence.lock", "41", "L"}, lock: true, want: wantStale, extended: true},
		{name: "SET LOCAL", tx: []string{"SET LOCAL fence.token = '41'", "SET LOCAL fence.lock = 'L'"}, lock: true, want: wantStale},
		{name: "SET LOCAL over a valid session token", before: []string{"SET fence.token = '44'"}, tx: []string{"SET LOCAL fence.token = '41'", "SET LOCAL fence.lock = 'L'"}, lock: true, want: wantStale},
		{name: "set_config local", tx: []string{"SELECT set_config('fence.token', '41', true), set_config('fence.lock', 'L', true)"}, lock: true, want: wantStale},
		{name: "set_config local parameters", tx: []string{"SELECT set_config('fence.token', $1, true), set_config('fence.lock', $2, true)"}, txArgs: []any{"41", "L"}, lock: true, want: wantStale, extended: true},
		{name: "SET LOCAL ends with its transaction", before: []string{"SET fence.token = '41'", "BEGIN", "SET LOCAL fence.token = '44'", "COMMIT"}, want: wantStale},
		{name: "set_config local ends with its statement", before: []string{"SET fence.token = '41'", "SELECT set_config('fence.token', '44', true)"}, want: wantStale},
		{name: "RESET", before: []string{"SET fence.token = '41'", "RESET fence.token"}, want: wantMissing},
		{name: "RESET ALL", before: []string{"SET fence.token = '41'", "SET fence.lock = 'L'", "RESET ALL"}, want: wantMissing},
		{name: "DISCARD ALL", before: []string{"SET fence.token = '41'", "SET fence.lock = 'L'", "DISCARD ALL"}, want: wantMissing, simple: true},
		{name: "TO DEFAULT", before: []string{"SET fence.token = '41'", "SET fence.token TO DEFAULT"}, want: wantMissing},
		{name: "set_config NULL", before: []string{"SET fence.token = '41'", "SELECT set_config('fence.token', NULL, false)"}, want: wantMissing},
		{name: "RESET to the startup value", startup: param("fence.token", "44"), before: []string{"SET fence.token = '41'", "RESET fence.token"}, want: wantValid},
		{name: "RESET ALL to the startup options", startup: options("-c fence.token=41 -c fence.lock=L"), before: []string{"SET fence.token = '44'", "SET fence.lock = ''", "RESET ALL"}, lock: true, want: wantStale},
		{name: "RESET of the lock", before: []string{"SET fence.token = '44'", "SET fence.lock = 'L'", "RESET fence.lock"}, pollLock: "L", want: wantValid},
		{name: "rollback of a SET", before: []string{"SET fence.token = '41'", "SET fence.lock = 'L'", "BEGIN", "SET fence.token = '44'", "RESET fence.lock", "ROLLBACK"}, lock: true, want: wantStale},
		{name: "rollback of a set_config", before: []string{"SET fence.token = '41'", "BEGIN", "SELECT set_config('fence.token', '44', false)", "ROLLBACK"}, want: wantStale},
		{name: "commit of a SET", before: []string{"SET fence.token = '44'", "BEGIN", "SET fence.token = '41'", "SET fence.lock = 'L'", "COMMIT"}, lock: true, want: wantStale},
		{name: "rollback to savepoint", before: []string{"SET fence.token = '41'", "BEGIN", "SAVEPOINT s", "SET fence.token = '44'", "ROLLBACK TO SAVEPOINT s", "COMMIT"}, want: wantStale},
		{name: "savepoint released", before: []string{"SET fence.token = '44'", "BEGIN", "SAVEPOINT s", "SET fence.token = '41'", "RELEASE SAVEPOINT s", "COMMIT"}, want: wantStale},
		{name: "failed transaction", before: []string{"SET fence.token = '41'", "BEGIN", "SET fence.token = '44'", "!SELECT 1/0", "COMMIT"}, want: wantStale},
		{name: "implicit transaction rolled back", before: []string{"SET fence.token = '41'", "!SET fence.token = '44'; SELECT 1/0"}, want: wantStale, simple: true},
		// Values the statement does not show.
		{name: "set_config of an expression", before: []string{"SET fence.token = '44'", "?SELECT set_config('fence.token', chr(52) || chr(49), false)"}, want: wantStale, refusedWant: wantValid},
		{name: "set_config of a subquery", before: []string{"SET fence.token = '41'", "?SELECT set_config('fence.token', (SELECT '44'), false)"}, want: wantValid, refusedWant: wantStale},
		{name: "set_config of the lock from an expression", before: []string{"SET fence.token = '41'", "?SELECT set_config('fence.lock', chr(76), false)"}, lock: true, want: wantStale, refusedWant: wantStale},
		{name: "DO block", before: []string{"SET fence.token = '44'", "?DO $$BEGIN PERFORM set_config('fence.token', '41', false); PERFORM set_config('fence.lock', 'L', false); END$$"}, lock: true, want: wantStale, refusedWant: wantValid},
		{name: "DO block with dynamic SQL", before: []string{"SET fence.token = '44'", `?DO $$BEGIN EXECUTE 'SET fence.' || 'token = ''41'''; END$$`}, want: wantStale, refusedWant: wantValid},
		{name: "SET in a multi-statement Query in the transaction", before: []string{"SET fence.token = '44'"}, tx: []string{"SET fence.token = '41'; SET fence.lock = 'L'"}, lock: true, want: wantStale, simple: true},
	}
}

func testPoolerForms(t *testing.T, pe *poolerEnv, mode pgx.QueryExecMode) {
	db := newLockDB(t, true)
	d := direct(t, db)
	for _, f := range poolerForms() {
		if (f.extended && !extendedMode(mode)) || (f.simple && extendedMode(mode)) {
			continue
		}
		t.Run(f.name, func(t *testing.T) {
			before := poolerReset(t, d)
			var edit []func(*pgx.ConnConfig)
			if f.startup != nil {
				edit = append(edit, f.startup)
			}
			a := pe.session(t, db, mode, edit...)
			for i, st := range f.before {
				var args []any
				if i == len(f.before)-1 {
					args = f.args
				}
				if runPoolerStmt(t, a, st, args) {
					t.Logf("refused (FP003): %s", st)
					f.want, f.lock = f.refusedWant, f.refusedLock
				}
			}
			pe.pollute(t, db, "43", f.pollLock)
			inTx := f.tx != nil
			if inTx {
				mustSend(t, a, "BEGIN")
				for i, st := range f.tx {
					var args []any
					if i == len(f.tx)-1 {
						args = f.txArgs
					}
					runPoolerStmt(t, a, st, args)
				}
			}
			checkPoolerWrites(t, a, d, f, before, inTx)
		})
	}
}

// runPoolerStmt sends st: with a "!" prefix it must fail on the server,
// with "?" the proxy may refuse it with FP003 (then it reports true).
func runPoolerStmt(t *testing.T, c *pgx.Conn, st string, args []any) (refused bool) {
	t.Helper()
	err := send(t, c, strings.TrimLeft(st, "!?"), args...)
	switch {
	case strings.HasPrefix(st, "!") && err == nil:
		t.Fatalf("%s succeeded, want an error", st)
	case strings.HasPrefix(st, "!"):
	case strings.HasPrefix(st, "?") && isProxyRefusal(err):
		return true
	case err != nil:
		t.Fatalf("%s: %v", st, err)
	}
	return false
}

// checkPoolerWrites writes through a as the form's outcome says and checks
// the data directly. In a transaction, each refused write aborts it, so
// each runs in its own (a savepoint would be another form to test).
func checkPoolerWrites(t *testing.T, a, d *pgx.Conn, f poolerForm, before rowSet, inTx bool) {
	t.Helper()
	writes := []string{"UPDATE acct SET payload = 'w' WHERE id = 1"}
	if f.lock || f.want != wantStale {
		// A lock makes these fail too; without one, only the row with a
		// newer fence can.
		writes = append(writes, "UPDATE acct SET payload = 'w' WHERE id = 3", "INSERT INTO acct (id, payload) VALUES (80, 'w')")
	}
	rerun := func() {
		// Start the form's transaction again for the next write.
		mustSend(t, a, "ROLLBACK")
		mustSend(t, a, "BEGIN")
		for i, st := range f.tx {
			var args []any
			if i == len(f.tx)-1 {
				args = f.txArgs
			}
			runPoolerStmt(t, a, st, args)
		}
	}
	for i, w := range writes {
		if inTx && i > 0 && f.want != wantValid {
			rerun()
		}
		err := send(t, a, w)
		switch f.want {
		case wantStale:
			if sqlState(err) != "FP001" {
				t.Fatalf("%s with a stale token: %v, want FP001", w, err)
			}
		case wantMissing:
			if sqlState(err) != "FP002" {
				t.Fatalf("%s without a token: %v, want FP002", w, err)
			}
		case wantValid:
			if err != nil {
				t.Fatalf("%s with token 44: %v", w, err)
			}
		}
	}
	if inTx {
		if f.want == wantValid {
			mustSend(t, a, "COMMIT")
		} else {
			mustSend(t, a, "ROLLBACK")
		}
	}
	got := snapshot(t, d, "acct")
	switch f.want {
	case wantStale, wantMissing:
		if !got.equal(before) {
			t.Fatalf("acct changed:\n before %v\n after  %v", before, got)
		}
		if w := lockWatermark(t, d, "L"); w != 42 {
			t.Fatalf("watermark of L = %d, want 42", w)
		}
	case wantValid:
		for _, id := range []int64{1, 3, 80} {
			if r := got[id]; r.Payload != "w" || r.Fence != 44 {
				t.Fatalf("row %d = %+v, want payload w stamped 44 (the pool carries 43)", id, r)
			}
		}
		want := int64(42)
		if f.lock {
			want = 44
		}
		if w := lockWatermark(t, d, "L"); w != want {
			t.Fatalf("watermark of L = %d, want %d", w, want)
		}
	}
}

// TestPoolerInFront: PgBouncer in transaction mode in front of the proxy,
// the application setting both settings in each transaction with the lock
// package's helper (pgxlock.BeginTx, lock.BeginSQL). The proxy's sessions
// are PgBouncer's server connections, each shared by every client; what
// one client leaves at session level on them must not help another.
func TestPoolerInFront(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	rs, err := rules.Compile(lockRules)
	if err != nil {
		t.Fatal(err)
	}
	p := proxytest.Start(t, cluster.Addr(), proxy.Options{
		Policy: policy.New(rs, false, policy.Options{}),
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)).Named("proxy"),
	})
	b := pgbouncer.StartOptions(t, p.Addr(), pgbouncer.Options{PoolMode: "transaction", PoolSize: poolerPoolSize})
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)

	for _, mode := range poolerModes {
		t.Run(mode.String(), func(t *testing.T) {
			poolerReset(t, d)
			client := func() *pgx.Conn {
				return connectDSN(t, b.DSN("postgres", db), func(c *pgx.ConnConfig) { c.DefaultQueryExecMode = mode })
			}
			// Another client leaves a valid token at session level on both
			// of PgBouncer's connections to the proxy.
			var leak []*pgx.Conn
			for range poolerPoolSize {
				c := client()
				leak = append(leak, c)
				mustExec(t, c, "BEGIN")
				mustExec(t, c, "SET fence.token = '45'")
			}
			for _, c := range leak {
				mustExec(t, c, "COMMIT")
			}

			// The new holder (43) writes row 2 and registers L.
			nw := client()
			tx, err := pgxlock.BeginTx(ctx, nw, lock.Fence{Token: 43, Lock: "L"}, pgx.TxOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, "UPDATE acct SET payload = $1 WHERE id = $2", "new", 2); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if r := snapshot(t, d, "acct")[2]; r.Payload != "new" || r.Fence != 43 {
				t.Fatalf("row 2 = %+v, want new stamped 43", r)
			}
			if w := lockWatermark(t, d, "L"); w != 43 {
				t.Fatalf("watermark %d, want 43", w)
			}

			// The stale holder (41), in transactions with the helper: its
			// own values, not the leaked 45, decide.
			before := snapshot(t, d, "acct")
			old := client()
			for _, w := range []struct {
				sql  string
				args []any
			}{
				{"INSERT INTO acct (id, payload) VALUES ($1, $2)", []any{90, "stale"}},
				{"UPDATE acct SET payload = $1 WHERE id = $2", []any{"stale", 3}},
				{"UPDATE acct SET payload = $1 WHERE id = $2", []any{"stale", 1}},
			} {
				tx, err := pgxlock.BeginTx(ctx, old, lock.Fence{Token: 41, Lock: "L"}, pgx.TxOptions{})
				if err != nil {
					t.Fatal(err)
				}
				_, err = tx.Exec(ctx, w.sql, w.args...)
				if sqlState(err) != "FP001" {
					t.Fatalf("%s by the stale holder: %v, want FP001", w.sql, err)
				}
				_ = tx.Rollback(ctx)
			}
			wantUnchanged(t, d, "acct", before)

			// A fresh holder (44) through the helper: stamped 44, never the
			// leaked 45 nor 43.
			fresh := client()
			tx, err = pgxlock.BeginTx(ctx, fresh, lock.Fence{Token: 44, Lock: "L"}, pgx.TxOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO acct (id, payload) VALUES ($1, $2)", 91, "fresh"); err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, "UPDATE acct SET payload = $1 WHERE id = $2", "fresh", 1); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			got := snapshot(t, d, "acct")
			for _, id := range []int64{1, 91} {
				if r := got[id]; r.Payload != "fresh" || r.Fence != 44 {
					t.Fatalf("row %d = %+v, want fresh stamped 44", id, r)
				}
			}
			if w := lockWatermark(t, d, "L"); w != 44 {
				t.Fatalf("watermark %d, want 44", w)
			}
		})
	}

	// database/sql (lib/pq) with lock.BeginSQL.
	t.Run("database/sql", func(t *testing.T) {
		poolerReset(t, d)
		sdb, err := sql.Open("postgres", b.DSN("postgres", db))
		if err != nil {
			t.Fatal(err)
		}
		defer sdb.Close()
		run := func(tok int64, q string, args ...any) error {
			tx, err := lock.BeginSQL(ctx, sdb, lock.Fence{Token: tok, Lock: "L"}, nil)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback() }()
			if _, err := tx.ExecContext(ctx, q, args...); err != nil {
				return err
			}
			return tx.Commit()
		}
		if err := run(43, "UPDATE acct SET payload = $1 WHERE id = $2", "new", 2); err != nil {
			t.Fatal(err)
		}
		before := snapshot(t, d, "acct")
		err = run(41, "INSERT INTO acct (id, payload) VALUES ($1, $2)", 95, "stale")
		if c := anyCode(err); c != "FP001" {
			t.Fatalf("stale INSERT through database/sql: %v, want FP001", err)
		}
		wantUnchanged(t, d, "acct", before)
		if err := run(44, "INSERT INTO acct (id, payload) VALUES ($1, $2)", 96, "fresh"); err != nil {
			t.Fatal(err)
		}
		if r := snapshot(t, d, "acct")[96]; r.Fence != 44 {
			t.Fatalf("row 96 = %+v, want stamped 44", r)
		}
	})
}

// testPoolerPipeline: a batch of statements in one implicit transaction
// (pgx sends the simple protocol's as one Query, the extended protocol's
// as one pipeline with one Sync), on a polluted pool.
func testPoolerPipeline(t *testing.T, pe *poolerEnv, mode pgx.QueryExecMode) {
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	before := poolerReset(t, d)
	old := pe.session(t, db, mode)
	mustSend(t, old, "SET fence.token = '41'")
	mustSend(t, old, "SET fence.lock = 'L'")
	fresh := pe.session(t, db, mode)
	mustSend(t, fresh, "SET fence.token = '44'")
	mustSend(t, fresh, "SET fence.lock = 'L'")
	pe.pollute(t, db, "43", "")

	batch := func(id int64, payload string) *pgx.Batch {
		b := &pgx.Batch{}
		b.Queue("SELECT 1")
		b.Queue("UPDATE acct SET payload = $1 WHERE id = $2", payload, 3)
		b.Queue("INSERT INTO acct (id, payload) VALUES ($1, $2)", id, payload)
		b.Queue("UPDATE acct SET payload = $1 WHERE id = $2", payload, 1)
		return b
	}
	err := old.SendBatch(ctx, batch(100, "stale")).Close()
	if sqlState(err) != "FP001" {
		t.Fatalf("the stale holder's pipeline: %v, want FP001", err)
	}
	wantUnchanged(t, d, "acct", before)

	if err := fresh.SendBatch(ctx, batch(101, "fresh")).Close(); err != nil {
		t.Fatalf("the fresh holder's pipeline: %v", err)
	}
	got := snapshot(t, d, "acct")
	for _, id := range []int64{1, 3, 101} {
		if r := got[id]; r.Payload != "fresh" || r.Fence != 44 {
			t.Fatalf("row %d = %+v, want fresh stamped 44", id, r)
		}
	}
	if w := lockWatermark(t, d, "L"); w != 44 {
		t.Fatalf("watermark of L = %d, want 44", w)
	}
}

// testPoolerAfterCommit: a Query whose statement on a protected table
// follows a COMMIT in the same text runs in a transaction of its own,
// which the pooler may put on another server connection. The proxy may
// refuse it (FP003); if it runs, it runs with the session's values.
func testPoolerAfterCommit(t *testing.T, pe *poolerEnv) {
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	for _, c := range []struct {
		name, session, local string
		want                 poolerWant
	}{
		{"stale session, valid local", "41", "44", wantStale},
		{"valid session, stale local", "44", "41", wantValid},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := poolerReset(t, d)
			a := pe.session(t, db, pgx.QueryExecModeSimpleProtocol)
			mustSend(t, a, "SET fence.token = '"+c.session+"'")
			pe.pollute(t, db, "43", "")
			_, err := a.PgConn().Exec(ctx, "BEGIN; SET LOCAL fence.token = '"+c.local+"'; SELECT 1 FROM acct WHERE id = 2; COMMIT; UPDATE acct SET payload = 'w' WHERE id = 1").ReadAll()
			switch {
			case isProxyRefusal(err):
				t.Logf("refused: %v", err)
				wantUnchanged(t, d, "acct", before)
			case c.want == wantStale:
				if sqlState(err) != "FP001" {
					t.Fatalf("the write after COMMIT with the stale session token: %v, want FP001 or FP003", err)
				}
				wantUnchanged(t, d, "acct", before)
			default:
				if err != nil {
					t.Fatalf("the write after COMMIT with the valid session token: %v", err)
				}
				if r := snapshot(t, d, "acct")[1]; r.Payload != "w" || r.Fence != 44 {
					t.Fatalf("row 1 = %+v, want w stamped 44", r)
				}
			}
		})
	}
}

// testPoolerAlterRole: the role's settings for the database (ALTER ROLE …
// IN DATABASE … SET), which the server applies when a session starts, are
// the session's values until it changes them, whatever the server
// connection carries later; RESET returns to them.
func testPoolerAlterRole(t *testing.T, pe *poolerEnv, mode pgx.QueryExecMode) {
	db := newLockDB(t, true)
	d := direct(t, db)
	mustExec(t, d, "ALTER ROLE "+poolerRole+" IN DATABASE "+db+" SET fence.token = '41'")
	mustExec(t, d, "ALTER ROLE "+poolerRole+" IN DATABASE "+db+" SET fence.lock = 'L'")
	stale := func(t *testing.T, a *pgx.Conn, before rowSet) {
		t.Helper()
		for _, w := range []string{
			"UPDATE acct SET payload = 'w' WHERE id = 1",
			"UPDATE acct SET payload = 'w' WHERE id = 3",
			"INSERT INTO acct (id, payload) VALUES (110, 'w')",
		} {
			if err := send(t, a, w); sqlState(err) != "FP001" {
				t.Fatalf("%s with the role's stale token: %v, want FP001", w, err)
			}
		}
		wantUnchanged(t, d, "acct", before)
	}

	before := poolerReset(t, d)
	a := pe.sessionAs(t, poolerRole, db, mode)
	pe.polluteAs(t, poolerRole, db, "43", "")
	stale(t, a, before)

	// A valid token set later, then RESET: back to the role's 41.
	mustSend(t, a, "SET fence.token = '44'")
	mustSend(t, a, "RESET fence.token")
	pe.polluteAs(t, poolerRole, db, "43", "")
	stale(t, a, before)
	mustSend(t, a, "SET fence.token = '44'")
	mustSend(t, a, "SET fence.lock = ''")
	mustSend(t, a, "RESET ALL")
	pe.polluteAs(t, poolerRole, db, "43", "")
	stale(t, a, before)
}

// TestPoolerAutoPrepare: the proxy's own prepared statements for repeated
// simple Queries (auto_prepare) behind PgBouncer in transaction mode. A
// statement the proxy prepared on one server connection may be executed
// on another; whatever the proxy does about it, the stale holder never
// writes and the fresh holder's writes carry its own token.
func TestPoolerAutoPrepare(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	b := pgbouncer.StartOptions(t, cluster.Addr(), pgbouncer.Options{
		PoolMode:                "transaction",
		PoolSize:                poolerPoolSize,
		IgnoreStartupParameters: poolerIgnored,
	})
	rs, err := rules.Compile(lockRules)
	if err != nil {
		t.Fatal(err)
	}
	pe := &poolerEnv{bouncer: b, proxy: proxytest.Start(t, b.Addr(), proxy.Options{
		Policy:      policy.New(rs, false, policy.Options{}),
		Logger:      zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)).Named("proxy"),
		AutoPrepare: 2,
	})}
	db := newLockDB(t, true)
	d := direct(t, db)
	poolerReset(t, d)
	mode := pgx.QueryExecModeSimpleProtocol
	old := pe.session(t, db, mode, both(param("fence.token", "41"), param("fence.lock", "L")))
	fresh := pe.session(t, db, mode)
	mustSend(t, fresh, "SET fence.token = '44'")
	mustSend(t, fresh, "SET fence.lock = 'L'")
	const upd = "UPDATE acct SET n = n + 1 WHERE id = 2"
	var want int32
	last := int32(0)
	for i := range 6 {
		for _, w := range []struct {
			c     *pgx.Conn
			stale bool
		}{{fresh, false}, {old, true}} {
			// Each write runs on the other server connection than the last
			// one: the proxy's statements prepared there are not on it.
			pe.pollute(t, db, "43", "")
			release, free := pe.holdAllBut(t, db, last)
			before := snapshot(t, d, "acct")
			err := send(t, w.c, upd)
			release()
			last = free
			if w.stale {
				if sqlState(err) != "FP001" {
					t.Fatalf("stale holder's write %d: %v, want FP001", i+1, err)
				}
				wantUnchanged(t, d, "acct", before)
				continue
			}
			if err != nil {
				t.Fatalf("fresh holder's write %d: %v", i+1, err)
			}
			want++
			if r := snapshot(t, d, "acct")[2]; r.N != want || r.Fence != 44 {
				t.Fatalf("after the fresh holder's write %d: row 2 = %+v, want n %d stamped 44", i+1, r, want)
			}
		}
	}
	// What the server connections hold, for the log: the proxy's own
	// statements, if it prepared any behind the pooler.
	var conns []*pgx.Conn
	for i := range poolerPoolSize {
		c := pe.bouncerDirect(t, "postgres", db)
		conns = append(conns, c)
		mustExec(t, c, "BEGIN")
		var names []string
		rows, err := c.Query(ctxT(t), "SELECT name FROM pg_prepared_statements ORDER BY name")
		if err != nil {
			t.Fatal(err)
		}
		names, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("server connection %d has prepared statements %q", i, names)
	}
	for _, c := range conns {
		mustExec(t, c, "COMMIT")
	}
}

// holdAllBut holds, in open transactions of sessions straight to
// PgBouncer, every server connection of db's pool but one, keeping the
// one whose backend is pid if it is among them (so the next transaction
// from anyone runs on another than pid). It returns a function that
// releases them and the backend left free.
func (pe *poolerEnv) holdAllBut(t *testing.T, db string, pid int32) (release func(), free int32) {
	t.Helper()
	type held struct {
		c   *pgx.Conn
		pid int32
	}
	var hs []held
	for range poolerPoolSize {
		c := pe.bouncerDirect(t, "postgres", db)
		mustExec(t, c, "BEGIN")
		var p int32
		if err := c.QueryRow(ctxT(t), "SELECT pg_backend_pid()").Scan(&p); err != nil {
			t.Fatal(err)
		}
		hs = append(hs, held{c, p})
	}
	// Free one: not pid's.
	freeAt := 0
	if hs[0].pid == pid {
		freeAt = 1
	}
	mustExec(t, hs[freeAt].c, "COMMIT")
	hs[freeAt].c.Close(ctxT(t))
	return func() {
		for i, h := range hs {
			if i != freeAt {
				mustExec(t, h.c, "COMMIT")
				h.c.Close(ctxT(t))
			}
		}
	}, hs[freeAt].pid
}
