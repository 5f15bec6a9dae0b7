package fencing_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Review 32: the session's fence settings and spareRegistration, attacked.
// Every test asserts the safe outcome and checks PostgreSQL's data.

// r32Watermark is the lock's watermark in fenceproxy.locks (0: none).
func r32Watermark(t *testing.T, d *pgx.Conn, lock string) int64 {
	t.Helper()
	var tok int64
	if err := d.QueryRow(context.Background(), "SELECT coalesce(max(token), 0) FROM fenceproxy.locks WHERE name = $1", lock).Scan(&tok); err != nil {
		t.Fatal(err)
	}
	return tok
}

func r32Row(t *testing.T, d *pgx.Conn, id int64) (n int32, fence int64) {
	t.Helper()
	if err := d.QueryRow(context.Background(), "SELECT n, last_fence FROM acct WHERE id = $1", id).Scan(&n, &fence); err != nil {
		t.Fatal(err)
	}
	return n, fence
}

// TestReview32SettingsSameTextLockChange: in an open transaction that
// registered lock L with token 5, a Query whose text first changes the
// lock (SET LOCAL fence.lock = 'M') and then writes a lock-fenced table
// must register M: the spare decision must not be taken from the record
// as it was before the text's own SET.
func TestReview32SettingsSameTextLockChange(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	for i, set := range []string{
		"SET LOCAL fence.lock = 'M'",
		"SET fence.lock = 'M'",
		"SELECT set_config('fence.lock', 'M', true)",
		`SET SESSION fence.lock TO "M"`,
	} {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			db := newLockDB(t, true)
			d := direct(t, db)
			ctx := ctxT(t)
			h := e.holder(t, db, "L", 5, pgx.QueryExecModeSimpleProtocol)
			mustExec(t, h, "BEGIN")
			mustExec(t, h, "UPDATE acct SET n = n + 1 WHERE id = 1")
			if _, err := h.PgConn().Exec(ctx, set+"; UPDATE acct SET n = n + 1 WHERE id = 2").ReadAll(); err != nil {
				// A SELECT before the write may call any function: the
				// proxy refuses the text (the hint says to use SET).
				if sqlState(err) != "FP003" || strings.HasPrefix(set, "SET") {
					t.Fatal(err)
				}
				_, _ = h.Exec(ctx, "ROLLBACK")
				if n, f := r32Row(t, d, 2); n != 0 || f != 0 {
					t.Errorf("%s: refused, but row 2 is n=%d fence=%d", set, n, f)
				}
				return
			}
			mustExec(t, h, "COMMIT")
			if w := r32Watermark(t, d, "M"); w != 5 {
				t.Errorf("%s: lock M's watermark is %d after a write under M with token 5, want 5 (the registration was spared)", set, w)
			}
			// Consequence: a stale holder of M (token 4) can still write.
			s := e.holder(t, db, "M", 4, pgx.QueryExecModeSimpleProtocol)
			_, err := s.Exec(ctx, "UPDATE acct SET n = n + 100 WHERE id = 3")
			if n, f := r32Row(t, d, 3); n != 0 || f != 0 {
				t.Errorf("%s: stale holder of M (4) wrote row 3 after M's holder of 5 wrote: n=%d fence=%d err=%v", set, n, f, err)
			}
		})
	}
}

// TestReview32SettingsSameTextTokenChange: the same with the token: a
// text that lowers the token with SET LOCAL before its write, in a
// transaction that registered 5, must meet the watermark 5 (FP001) and
// write nothing.
func TestReview32SettingsSameTextTokenChange(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	h := e.holder(t, db, "L", 5, pgx.QueryExecModeSimpleProtocol)
	mustExec(t, h, "BEGIN")
	mustExec(t, h, "UPDATE acct SET n = n + 1 WHERE id = 1")
	_, err := h.PgConn().Exec(ctx, "SET LOCAL fence.token = '3'; UPDATE acct SET n = n + 1 WHERE id = 2").ReadAll()
	r32Code(t, err, "FP001")
	_, cerr := h.Exec(ctx, "COMMIT")
	t.Logf("commit: %v; L watermark %d", cerr, r32Watermark(t, d, "L"))
	if n, f := r32Row(t, d, 2); n != 0 || f != 0 {
		t.Errorf("row 2 written with token 3 under lock L whose watermark is 5: n=%d fence=%d", n, f)
	}
}

// r32Code is wantCode without stopping the test, so that the data is
// still checked.
func r32Code(t *testing.T, err error, code string) {
	t.Helper()
	if got := sqlState(err); err == nil || got != code {
		t.Errorf("got %v (SQLSTATE %q), want SQLSTATE %s", err, got, code)
	}
}

// TestReview32SettingsRegistrationRecordedWithWrongLock: in an open
// transaction that has registered nothing, a Query
//
//	SET LOCAL fence.lock = 'M'; UPDATE acct …; SET LOCAL fence.lock = 'L'
//
// registers M (the registration runs after the text's first SET), and
// leaves L in force. The next write under L must register L: the proxy
// must not note the registration under the values it held when it sent
// the text.
func TestReview32SettingsRegistrationRecordedWithWrongLock(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	h := e.holder(t, db, "L", 5, pgx.QueryExecModeSimpleProtocol)
	mustExec(t, h, "BEGIN")
	if _, err := h.PgConn().Exec(ctx, "SET LOCAL fence.lock = 'M'; UPDATE acct SET n = n + 1 WHERE id = 1; SET LOCAL fence.lock = 'L'").ReadAll(); err != nil {
		t.Fatal(err)
	}
	mustExec(t, h, "UPDATE acct SET n = n + 1 WHERE id = 2")
	mustExec(t, h, "COMMIT")
	if w := r32Watermark(t, d, "M"); w != 5 {
		t.Errorf("M's watermark %d, want 5", w)
	}
	if w := r32Watermark(t, d, "L"); w != 5 {
		t.Errorf("lock L's watermark is %d after a write under L with token 5, want 5 (the registration was spared)", w)
	}
	s := e.holder(t, db, "L", 4, pgx.QueryExecModeSimpleProtocol)
	_, err := s.Exec(ctx, "UPDATE acct SET n = n + 100 WHERE id = 3")
	if n, f := r32Row(t, d, 3); n != 0 || f != 0 {
		t.Errorf("stale holder of L (4) wrote row 3 after L's holder of 5 wrote row 2: n=%d fence=%d err=%v", n, f, err)
	}
}

// TestReview32SettingsRegistrationRecordedWithWrongToken: the same with
// the token: the text registers 9, leaves 5 in force; a later write with 5
// must meet the watermark 9 (FP001).
func TestReview32SettingsRegistrationRecordedWithWrongToken(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	h := e.holder(t, db, "L", 5, pgx.QueryExecModeSimpleProtocol)
	mustExec(t, h, "BEGIN")
	if _, err := h.PgConn().Exec(ctx, "SET LOCAL fence.token = '9'; UPDATE acct SET n = n + 1 WHERE id = 1; SET LOCAL fence.token = '5'").ReadAll(); err != nil {
		t.Fatal(err)
	}
	_, err := h.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 2")
	r32Code(t, err, "FP001")
	_, _ = h.Exec(ctx, "COMMIT")
	// The failed transaction rolled back the registration of 9 and the
	// write of row 1 with it.
	if n, f := r32Row(t, d, 1); n != 0 || f != 0 {
		t.Errorf("row 1 committed from a failed transaction: n=%d fence=%d", n, f)
	}
	if n, f := r32Row(t, d, 2); n != 0 || f != 0 {
		t.Errorf("row 2 written with token 5 under lock L whose watermark is 9: n=%d fence=%d", n, f)
	}
}

// TestReview32SettingsChainEndsRegistration: a registration ends with its
// transaction, also when the next one starts at once (AND CHAIN, or COMMIT
// and BEGIN in one Query): after it, a newer holder registers, and the
// old holder's next write in the chained transaction must meet the newer
// watermark (FP001) and write nothing.
func TestReview32SettingsChainEndsRegistration(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	type step struct {
		chain  string
		simple bool // a multi-statement text: simple protocol only
	}
	steps := []step{
		{"COMMIT AND CHAIN", false},
		{"END AND CHAIN", false},
		{"ROLLBACK AND CHAIN", false},
		{"ABORT AND CHAIN", false},
		{"/* x */ commit work and chain", false},
		{"COMMIT; BEGIN", true},
		{"ROLLBACK; START TRANSACTION ISOLATION LEVEL READ COMMITTED", true},
		{"SELECT 1; COMMIT AND CHAIN", true},
	}
	modes := []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeCacheStatement}
	for _, st := range steps {
		for _, mode := range modes {
			if st.simple && mode != pgx.QueryExecModeSimpleProtocol {
				continue
			}
			t.Run(st.chain+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				db := newLockDB(t, true)
				d := direct(t, db)
				ctx := ctxT(t)
				old := e.holder(t, db, "C", 5, mode)
				mustExec(t, old, "BEGIN")
				mustExec(t, old, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)
				if st.simple {
					if _, err := old.PgConn().Exec(ctx, st.chain).ReadAll(); err != nil {
						t.Fatal(err)
					}
				} else {
					mustExec(t, old, st.chain)
				}
				nw := e.holder(t, db, "C", 6, pgx.QueryExecModeSimpleProtocol)
				mustExec(t, nw, "SELECT 1 FROM acct WHERE id = 3")
				if w := r32Watermark(t, d, "C"); w != 6 {
					t.Fatalf("watermark %d after the newer holder's read, want 6", w)
				}
				_, err := old.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = $1", 2)
				r32Code(t, err, "FP001")
				_, _ = old.Exec(ctx, "COMMIT")
				if n, f := r32Row(t, d, 2); n != 0 || f != 0 {
					t.Errorf("stale holder (5) wrote row 2 in a chained transaction after the watermark became 6: n=%d fence=%d", n, f)
				}
			})
		}
	}
}

// TestReview32SettingsResetInTextBehindPooler: a stale holder that names
// its lock and token in its startup packet (PGOPTIONS, pgxlock.Configure)
// and sends a RESET of a fence setting in the same Query as a write. The
// proxy's record says the RESET returns to the startup values (L, 5); the
// server connection behind a transaction pooler never saw that startup
// packet, so on the server the RESET returns to its own default (no
// lock). The write must still meet L's watermark 6 (FP001) and write
// nothing, as it does without the pooler.
func TestReview32SettingsResetInTextBehindPooler(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pe := startPoolerEnv(t)
	le := startLockEnv(t)
	texts := []string{
		"RESET fence.lock; UPDATE acct SET payload = 'stale' WHERE id = 2",
		"RESET ALL; UPDATE acct SET payload = 'stale' WHERE id = 2",
		"SET fence.lock TO DEFAULT; UPDATE acct SET payload = 'stale' WHERE id = 2",
		"BEGIN; SET LOCAL fence.lock TO DEFAULT; UPDATE acct SET payload = 'stale' WHERE id = 2; COMMIT",
		"RESET fence.token; RESET fence.lock; INSERT INTO acct (id, payload) VALUES (70, 'stale')",
	}
	for _, pooled := range []bool{true, false} {
		for i, text := range texts {
			name := fmt.Sprintf("pooler=%v/%d", pooled, i)
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				db := newLockDB(t, true)
				d := direct(t, db)
				ctx := ctxT(t)
				dsn := le.proxy.DSN("postgres", "", db)
				if pooled {
					dsn = pe.proxy.DSN("postgres", "", db)
				}
				holder := func(tok string) *pgx.Conn {
					return connectDSN(t, dsn, func(c *pgx.ConnConfig) {
						c.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
						c.RuntimeParams["fence.lock"] = "L"
						c.RuntimeParams["fence.token"] = tok
					})
				}
				a := holder("5")
				mustExec(t, a, "SELECT n FROM acct WHERE id = 1") // registers 5
				b := holder("6")
				mustExec(t, b, "SELECT n FROM acct WHERE id = 3") // registers 6
				if w := r32Watermark(t, d, "L"); w != 6 {
					t.Fatalf("watermark %d, want 6", w)
				}
				before := snapshot(t, d, "acct")
				_, err := a.PgConn().Exec(ctx, text).ReadAll()
				t.Logf("%s: %v", text, err)
				if err == nil {
					t.Errorf("%s: no error from the stale holder (5) of L, whose watermark is 6", text)
				}
				wantUnchanged(t, d, "acct", before)
			})
		}
	}
}

// TestReview32SettingsFunctionInSameText: design.md says that a function
// changing a fence setting as a side effect is invisible, and that the
// record then wins for fenced statements. In a multi-statement Query the
// prelude goes before the whole text, so a function called by an earlier
// statement of the text changes what the fenced statement runs with. A
// stale holder (L, 5; watermark 6) must not write, in one Query or two.
func TestReview32SettingsFunctionInSameText(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	for i, text := range []string{
		"SELECT forget_lock(); UPDATE acct SET payload = 'stale' WHERE id = 2",
		"SELECT forget_lock(); INSERT INTO acct (id, payload) VALUES (70, 'stale')",
	} {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			db := newLockDB(t, true)
			d := direct(t, db)
			ctx := ctxT(t)
			if _, err := d.Exec(ctx, `CREATE FUNCTION forget_lock() RETURNS text LANGUAGE sql AS $f$ SELECT set_config('fence.lock', '', true) $f$`); err != nil {
				t.Fatal(err)
			}
			a := e.holder(t, db, "L", 5, pgx.QueryExecModeSimpleProtocol)
			mustExec(t, a, "SELECT n FROM acct WHERE id = 1")
			b := e.holder(t, db, "L", 6, pgx.QueryExecModeSimpleProtocol)
			mustExec(t, b, "SELECT n FROM acct WHERE id = 3")
			before := snapshot(t, d, "acct")
			_, err := a.PgConn().Exec(ctx, text).ReadAll()
			// Refused before it runs (FP003: the proxy applies the
			// session's values once, in front of the text), or stale.
			if c := sqlState(err); c != "FP003" && c != "FP001" {
				t.Errorf("got %v (SQLSTATE %q), want SQLSTATE FP003 or FP001", err, c)
			}
			wantUnchanged(t, d, "acct", before)
		})
	}
}

// TestReview32SettingsRollbackToReleasesRegistration: a registration made
// inside a savepoint is undone by ROLLBACK TO (its advisory lock too, so a
// newer holder registers at once). The old holder's next write in the
// same transaction must register again and fail (FP001), whether the
// savepoint was rolled back after an error or not, and in a pipeline.
func TestReview32SettingsRollbackToReleasesRegistration(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeCacheStatement} {
		for _, withErr := range []bool{false, true} {
			t.Run(fmt.Sprintf("%v/error=%v", mode, withErr), func(t *testing.T) {
				t.Parallel()
				db := newLockDB(t, true)
				d := direct(t, db)
				ctx := ctxT(t)
				old := e.holder(t, db, "R", 5, mode)
				mustExec(t, old, "BEGIN")
				mustExec(t, old, "SAVEPOINT s")
				mustExec(t, old, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)
				if withErr {
					if _, err := old.Exec(ctx, "SELECT 1/0"); err == nil {
						t.Fatal("1/0 did not fail")
					}
				}
				mustExec(t, old, "ROLLBACK TO SAVEPOINT s")
				nctx, cancel := context.WithTimeout(ctx, 3e9)
				defer cancel()
				nw := e.holder(t, db, "R", 6, pgx.QueryExecModeSimpleProtocol)
				if _, err := nw.Exec(nctx, "SELECT 1 FROM acct WHERE id = 3"); err != nil {
					t.Fatalf("the newer holder could not register after ROLLBACK TO: %v", err)
				}
				_, err := old.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = $1", 2)
				r32Code(t, err, "FP001")
				_, _ = old.Exec(ctx, "COMMIT")
				if n, f := r32Row(t, d, 2); n != 0 || f != 0 {
					t.Errorf("stale holder (5) wrote row 2 after ROLLBACK TO and the newer holder's registration: n=%d fence=%d", n, f)
				}
			})
		}
	}
}

// r32Pipeline sends stmts (a "" is a Sync) in one pgconn pipeline,
// unnamed statements without parameters, and returns the errors met.
func r32Pipeline(t *testing.T, c *pgx.Conn, stmts []string) []string {
	t.Helper()
	ctx := ctxT(t)
	p := c.PgConn().StartPipeline(ctx)
	for _, s := range stmts {
		if s == "" {
			p.SendPipelineSync()
			continue
		}
		p.SendQueryParams(s, nil, nil, nil, nil)
	}
	if err := p.Flush(); err != nil {
		t.Fatal(err)
	}
	errs := pipelineErrors(p)
	if err := p.Close(); err != nil {
		errs = append(errs, "close: "+err.Error())
	}
	return errs
}

// TestReview32SettingsPipelineLockSwitch: in one pipeline, an explicit
// transaction that writes under L, switches to M with set_config, writes,
// syncs, switches back, writes, rolls back to a savepoint and writes
// again: both locks end with the watermark 5, and stale holders (4) of
// either can do nothing afterwards.
func TestReview32SettingsPipelineLockSwitch(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	h := e.holder(t, db, "L", 5, pgx.QueryExecModeExec)
	errs := r32Pipeline(t, h, []string{
		"BEGIN",
		"UPDATE acct SET n = n + 1 WHERE id = 1",
		"SELECT set_config('fence.lock', 'M', true)",
		"UPDATE acct SET n = n + 1 WHERE id = 2",
		"",
		"SELECT set_config('fence.lock', 'L', true)",
		"UPDATE acct SET n = n + 1 WHERE id = 3",
		"",
		"SAVEPOINT s",
		"SELECT set_config('fence.lock', 'N', true)",
		"UPDATE acct SET n = n + 1 WHERE id = 1",
		"ROLLBACK TO SAVEPOINT s",
		"UPDATE acct SET n = n + 1 WHERE id = 2",
		"COMMIT",
		"",
	})
	if len(errs) > 0 {
		t.Fatalf("pipeline: %v", errs)
	}
	for lk, want := range map[string]int64{"L": 5, "M": 5, "N": 0} {
		if w := r32Watermark(t, d, lk); w != want {
			t.Errorf("watermark of %s = %d, want %d", lk, w, want)
		}
	}
	before := snapshot(t, d, "acct")
	for _, lk := range []string{"L", "M"} {
		s := e.holder(t, db, lk, 4, pgx.QueryExecModeSimpleProtocol)
		_, err := s.Exec(ctx, "INSERT INTO acct (id, payload) VALUES (80, 'stale')")
		r32Code(t, err, "FP001")
	}
	wantUnchanged(t, d, "acct", before)
}

// TestReview32SettingsPipelineTokenDrop: in one pipeline inside an
// explicit transaction that registered 5, set_config lowers the token to
// 3 before a write: the write must meet the watermark 5 (FP001) and the
// transaction write nothing.
func TestReview32SettingsPipelineTokenDrop(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	d := direct(t, db)
	h := e.holder(t, db, "L", 5, pgx.QueryExecModeExec)
	before := snapshot(t, d, "acct")
	errs := r32Pipeline(t, h, []string{
		"BEGIN",
		"UPDATE acct SET n = n + 1 WHERE id = 1",
		"SELECT set_config('fence.token', '3', true)",
		"UPDATE acct SET n = n + 1 WHERE id = 2",
		"COMMIT",
		"",
	})
	if len(errs) == 0 || !strings.Contains(strings.Join(errs, ";"), "FP001") {
		t.Errorf("pipeline errors %v, want FP001", errs)
	}
	wantUnchanged(t, d, "acct", before)
}

// TestReview32SettingsSpareAcrossRequired: a registration for a table
// with lock: optional succeeds without registering anything when the
// token is not valid (row fencing decides). It must not spare the
// registration of a later statement on a lock: required table (jobs, no
// fence column: the registration is its only fence) in the same
// transaction, which must fail with FP002 and write nothing.
func TestReview32SettingsSpareAcrossRequired(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeCacheStatement} {
		for _, tok := range []string{"", "abc", "0"} {
			t.Run(fmt.Sprintf("%v/token=%q", mode, tok), func(t *testing.T) {
				t.Parallel()
				db := newLockDB(t, true)
				d := direct(t, db)
				ctx := ctxT(t)
				c := connectDSN(t, e.proxy.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
					c.DefaultQueryExecMode = mode
					c.RuntimeParams["fence.lock"] = "J"
					if tok != "" {
						c.RuntimeParams["fence.token"] = tok
					}
				})
				mustExec(t, c, "BEGIN")
				mustExec(t, c, "SELECT n FROM acct WHERE id = $1", 1)
				_, err := c.Exec(ctx, "UPDATE jobs SET state = $1 WHERE id = 1", "unfenced")
				r32Code(t, err, "FP002")
				_, _ = c.Exec(ctx, "COMMIT")
				var st string
				if err := d.QueryRow(ctx, "SELECT state FROM jobs WHERE id = 1").Scan(&st); err != nil || st != "queued" {
					t.Errorf("jobs row 1 state %q (%v), want queued: a lock-required table written without a valid token", st, err)
				}
			})
		}
	}
}

// TestReview32SettingsSameTextStaleSecondLock: a worker holding two locks
// in one transaction, switching with SET LOCAL in the Query of its write.
// It holds L (41) and is a stale holder of M (17; M's watermark is 18):
// its write under M must fail with FP001 and write nothing.
func TestReview32SettingsSameTextStaleSecondLock(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	nw := e.holder(t, db, "M", 18, pgx.QueryExecModeSimpleProtocol)
	mustExec(t, nw, "SELECT n FROM acct WHERE id = 3")
	a := e.holder(t, db, "L", 41, pgx.QueryExecModeSimpleProtocol)
	mustExec(t, a, "BEGIN")
	mustExec(t, a, "UPDATE acct SET n = n + 1 WHERE id = 1")
	_, err := a.PgConn().Exec(ctx, "SET LOCAL fence.lock = 'M'; SET LOCAL fence.token = '17'; UPDATE acct SET payload = 'stale' WHERE id = 2").ReadAll()
	r32Code(t, err, "FP001")
	_, _ = a.Exec(ctx, "COMMIT")
	var p string
	var f int64
	if err := d.QueryRow(ctx, "SELECT payload, last_fence FROM acct WHERE id = 2").Scan(&p, &f); err != nil || p != "b" {
		t.Errorf("row 2 = %q fence %d (%v): the stale holder (17) of M (watermark %d) wrote it", p, f, err, r32Watermark(t, d, "M"))
	}
}

// pipelineErrors reads a flushed pipeline's results up to its end and
// returns their errors, in order.
func pipelineErrors(p *pgconn.Pipeline) []string {
	var errs []string
	for {
		res, err := p.GetResults()
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		if res == nil {
			return errs
		}
		if rr, ok := res.(*pgconn.ResultReader); ok {
			if _, err := rr.Close(); err != nil {
				errs = append(errs, err.Error())
			}
		}
	}
}
