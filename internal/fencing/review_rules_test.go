package fencing_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review of commit 32bb1b0: a rewrite rule on a protected
// table whose action writes a protected table (another, or itself) is an
// indirect path, so the write of the protected table that would fire it
// is refused (FP003) unless the database guard protects the target. Each
// case creates the rule on a direct connection while the proxy runs and
// reads the tables back on a direct connection: the stale holder (lock L,
// token 5) must not change racct, whose rows carry fence 9.

// rvRuleState is the listed tables' rows, read through d.
func rvRuleState(t *testing.T, d *pgx.Conn, tables ...string) string {
	t.Helper()
	var b strings.Builder
	for _, tbl := range tables {
		fmt.Fprintf(&b, "%s: %s\n", tbl, tableText(t, d, tbl))
	}
	return b.String()
}

// rvRuleTry runs write, again while the proxy refuses it because the
// catalog changed since its last check (the catalog check in the write's
// transaction, or an EXECUTE decided again), as a client retries FP003,
// at most five times, and returns the last error.
func rvRuleTry(write func() error) error {
	var err error
	for range 5 {
		if err = write(); !rvCatalogMoved(err) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

// rvCatalogMoved reports whether err is a refusal the client retries
// once the proxy has checked the changed catalog.
func rvCatalogMoved(err error) bool {
	var pe *pgconn.PgError
	return isCatalogCheck(err) || errors.As(err, &pe) && pe.Code == rules.CodeRefused && strings.Contains(pe.Message, "changed since the proxy's last check")
}

// rvRuleRefusal reports what is wrong with err as the refusal of a write
// through rule (FP003 naming it), or "" if it is that refusal.
func rvRuleRefusal(err error, rule string) string {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != rules.CodeRefused {
		return fmt.Sprintf("got %v, want FP003 naming rule %s", err, rule)
	}
	if !strings.Contains(pe.Message+" "+pe.Detail, "rule "+rule+" on") {
		return fmt.Sprintf("FP003 not naming rule %s: %s (detail %q)", rule, pe.Message, pe.Detail)
	}
	return ""
}

// rvRuleDB is a database with catalogMatrixSchema (set up, watched),
// racct's rows carrying fence 9 (a newer holder wrote them), one row in
// jobs, and a session through p as the stale holder: lock L, token 5 (lk
// empty: no lock named).
func rvRuleDB(t *testing.T, p *proxytest.Proxy, specs []rules.TableSpec, lk string) (*pgx.Conn, *pgx.Conn) {
	t.Helper()
	db, d := rvSetupDB(t, specs, "rvrules")
	execDirect(t, d, "UPDATE racct SET last_fence = 9; INSERT INTO jobs VALUES (1, 'queued')")
	return d, rvSession(t, p, db, lk, "5")
}

// rvRuleForm is one way a client sends the write: prep (nil: nothing to
// prepare) prepares it, exec runs it.
type rvRuleForm struct {
	name string
	prep func(c *pgx.Conn) error
	exec func(c *pgx.Conn) error
}

const rvRuleWrite = "UPDATE acct SET n = n + 1 WHERE id = $1"

func rvRuleForms(t *testing.T) []rvRuleForm {
	mode := func(m pgx.QueryExecMode) func(c *pgx.Conn) error {
		return func(c *pgx.Conn) error {
			_, err := c.Exec(ctxT(t), rvRuleWrite, m, 1)
			return err
		}
	}
	return []rvRuleForm{
		{name: "simple", exec: mode(pgx.QueryExecModeSimpleProtocol)},
		{name: "cache statement", exec: mode(pgx.QueryExecModeCacheStatement)},
		{name: "cache describe", exec: mode(pgx.QueryExecModeCacheDescribe)},
		{name: "unnamed", exec: mode(pgx.QueryExecModeExec)},
		{
			name: "named",
			prep: func(c *pgx.Conn) error { _, err := c.Prepare(ctxT(t), "rvw", rvRuleWrite); return err },
			exec: func(c *pgx.Conn) error { _, err := c.Exec(ctxT(t), "rvw", 1); return err },
		},
		{
			name: "sql prepare",
			prep: func(c *pgx.Conn) error {
				_, err := c.Exec(ctxT(t), "PREPARE rvsw(bigint) AS "+rvRuleWrite, pgx.QueryExecModeSimpleProtocol)
				return err
			},
			exec: func(c *pgx.Conn) error {
				_, err := c.Exec(ctxT(t), "EXECUTE rvsw(1)", pgx.QueryExecModeSimpleProtocol)
				return err
			},
		},
		{
			name: "pipeline",
			exec: func(c *pgx.Conn) error {
				b := &pgx.Batch{}
				b.Queue("SELECT 1")
				b.Queue(rvRuleWrite, 1)
				b.Queue("SELECT n FROM acct WHERE id = 1")
				br := c.SendBatch(ctxT(t), b)
				_, _ = br.Exec()
				_, err := br.Exec()
				_, _ = br.Exec()
				if cerr := br.Close(); err == nil {
					err = cerr
				}
				return err
			},
		},
	}
}

// TestReviewRulesForms: the rule (ON UPDATE TO acct DO ALSO UPDATE racct)
// is created on a direct connection after the client prepared the write
// ("before") or before it prepares it ("after"), for each way a client
// sends it, with the proxy's auto_prepare off and on. The write is
// refused naming the rule (after at most a few refusals of the catalog
// check), or its preparation is; acct and racct are unchanged. Once the
// rule is dropped the same write works again, and racct still is
// unchanged.
func TestReviewRulesForms(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, hijackRules)
	rs, err := rules.Compile(hijackRules)
	if err != nil {
		t.Fatal(err)
	}
	proxies := map[string]*proxytest.Proxy{
		"auto_prepare off": startProxy(t, policy.New(rs, false, policy.Options{Checks: checker})),
		"auto_prepare on":  startProxy(t, policy.New(rs, false, policy.Options{Checks: checker}), autoPrepare),
	}
	for pname, p := range proxies {
		for _, f := range rvRuleForms(t) {
			for _, when := range []string{"before", "after"} {
				t.Run(pname+"/"+f.name+"/"+when, func(t *testing.T) {
					t.Parallel()
					d, c := rvRuleDB(t, p, specs, "L")
					prepared := false
					prep := func() error {
						if f.prep == nil || prepared {
							return nil
						}
						err := rvRuleTry(func() error { return f.prep(c) })
						prepared = err == nil
						return err
					}
					// again: an EXECUTE refused because its statement,
					// PREPAREd earlier, is decided differently now (the
					// rule came or went) is prepared again, as the
					// refusal's hint says; a few tries, as a client
					// would make. (Other databases' changes, which
					// parallel tests make, no longer move this session's
					// generation: TestGenerationPerDatabase.)
					again := func(err error) error {
						for range 5 {
							if f.name != "sql prepare" || err == nil || !strings.Contains(err.Error(), "prepared under fencing rules or catalog paths that have since changed") {
								return err
							}
							t.Logf("EXECUTE refused, prepared again: %v", err)
							mustExec(t, c, "DEALLOCATE rvsw")
							prepared = false
							if err = prep(); err == nil {
								err = rvRuleTry(func() error { return f.exec(c) })
							}
						}
						return err
					}
					if when == "before" {
						for range 2 { // twice: auto_prepare prepares at the second
							if err := prep(); err != nil {
								t.Fatalf("prepare before the rule: %v", err)
							}
							if err := again(rvRuleTry(func() error { return f.exec(c) })); err != nil {
								t.Fatalf("write before the rule: %v", err)
							}
						}
					}
					execDirect(t, d, "CREATE RULE rv_also AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'via-rule'")
					before := rvRuleState(t, d, "acct", "racct")
					err := prep()
					if err == nil {
						err = rvRuleTry(func() error { return f.exec(c) })
					}
					if f.name == "sql prepare" && sqlState(err) == rules.CodeRefused && strings.Contains(err.Error(), "prepared under fencing rules or catalog paths that have since changed") {
						// A statement PREPAREd before the change whose
						// decision changed: refused, to be prepared again
						// (the message speaks of a reload; it was the
						// catalog).
						t.Logf("EXECUTE of a statement prepared before the rule: %v", err)
					} else if msg := rvRuleRefusal(err, "rv_also"); msg != "" {
						t.Errorf("the write through the rule: %s", msg)
					}
					if after := rvRuleState(t, d, "acct", "racct"); after != before {
						t.Fatalf("written through the rule by the stale holder:\n before %s\n after  %s", before, after)
					}

					execDirect(t, d, "DROP RULE rv_also ON acct")
					if err := prep(); err != nil {
						t.Fatalf("prepare after the rule was dropped: %v", err)
					}
					// PREPAREd while the rule was there, the statement's
					// decision changed again: prepared again.
					if err := again(rvRuleTry(func() error { return f.exec(c) })); err != nil {
						t.Fatalf("the write after the rule was dropped: %v", err)
					}
					after := rvRuleState(t, d, "acct", "racct")
					if strings.Contains(after, "via-rule") || after == before {
						t.Errorf("after the rule was dropped: want acct written and racct not:\n before %s\n after  %s", before, after)
					}
				})
			}
		}
	}
}

// rvRuleCase is a rule (or a change of one) made on a direct connection,
// then a write through the proxy. refused: the write must be refused
// naming rule, and tables must be unchanged; otherwise it must run and
// check must accept the tables afterwards.
type rvRuleCase struct {
	name    string
	setup   string // direct, before the session's first write
	ddl     string // direct, after it
	write   string
	lock    string // the session's fence.lock: "" for L, "-" for none
	rule    string
	tables  []string
	refused bool
	// pgRefuses: PostgreSQL itself refuses the write with this SQLSTATE
	// (an upsert on a table with INSERT or UPDATE rules); the proxy
	// refusing it first is fine too.
	pgRefuses string
	check     func(t *testing.T, before, after string)
}

var rvRuleCases = []rvRuleCase{
	// A conditional DO ALSO rule fires only when its WHERE holds; it is a
	// path all the same.
	{name: "conditional also", ddl: "CREATE RULE rv_cond AS ON UPDATE TO acct WHERE NEW.n > 0 DO ALSO UPDATE racct SET payload = 'cond'",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_cond", tables: []string{"acct", "racct"}, refused: true},
	// An unconditional DO INSTEAD rule replaces the write of acct by one
	// of racct.
	{name: "instead", ddl: "CREATE RULE rv_inst AS ON UPDATE TO acct DO INSTEAD UPDATE racct SET payload = 'instead' WHERE id = OLD.id",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_inst", tables: []string{"acct", "racct"}, refused: true},
	// A conditional DO INSTEAD rule.
	{name: "conditional instead", ddl: "CREATE RULE rv_cinst AS ON UPDATE TO acct WHERE OLD.id = 1 DO INSTEAD UPDATE racct SET payload = 'cinst' WHERE id = OLD.id",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_cinst", tables: []string{"acct", "racct"}, refused: true},
	// ON INSERT rules, the action an UPDATE or an INSERT of racct.
	{name: "insert rule updates", ddl: "CREATE RULE rv_ins AS ON INSERT TO acct DO ALSO UPDATE racct SET payload = 'ins'",
		write: "INSERT INTO acct (id, payload) VALUES (10, 'x')", rule: "rv_ins", tables: []string{"acct", "racct"}, refused: true},
	{name: "insert rule inserts", ddl: "CREATE RULE rv_ins2 AS ON INSERT TO acct DO ALSO INSERT INTO racct (id, payload) VALUES (NEW.id, 'ins2')",
		write: "INSERT INTO acct (id, payload) VALUES (10, 'x')", rule: "rv_ins2", tables: []string{"acct", "racct"}, refused: true},
	// ON DELETE rule.
	{name: "delete rule", ddl: "CREATE RULE rv_del AS ON DELETE TO acct DO ALSO DELETE FROM racct WHERE id = OLD.id",
		write: "DELETE FROM acct WHERE id = 3", rule: "rv_del", tables: []string{"acct", "racct"}, refused: true},
	// The action writes an unprotected, auto-updatable view over racct.
	{name: "action writes view", setup: "CREATE VIEW rv_view AS SELECT * FROM racct",
		ddl:   "CREATE RULE rv_v AS ON UPDATE TO acct DO ALSO UPDATE rv_view SET payload = 'view'",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_v", tables: []string{"acct", "racct"}, refused: true},
	// The action writes racct in a data-modifying WITH.
	{name: "action writes in WITH", ddl: "CREATE RULE rv_cte AS ON UPDATE TO acct DO ALSO WITH x AS (UPDATE racct SET payload = 'cte' RETURNING 1) SELECT 1",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_cte", tables: []string{"acct", "racct"}, refused: true},
	// The action writes an unprotected table whose own rule writes racct.
	{name: "chain through unprotected", setup: "CREATE RULE plain_to_racct AS ON UPDATE TO plain DO ALSO UPDATE racct SET payload = 'chain'",
		ddl:   "CREATE RULE rv_chain AS ON UPDATE TO acct DO ALSO UPDATE plain SET n = n + 1",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_chain", tables: []string{"acct", "racct", "plain"}, refused: true},
	// The action writes the table itself: an INSERT updating a row a
	// newer holder wrote (fence 9), an UPDATE inserting, a DELETE updating.
	{name: "self insert updates", setup: "UPDATE acct SET last_fence = 9 WHERE id = 1",
		ddl:   "CREATE RULE rv_self AS ON INSERT TO acct DO ALSO UPDATE acct SET payload = 'bumped' WHERE id = 1",
		write: "INSERT INTO acct (id, payload) VALUES (10, 'x')", rule: "rv_self", tables: []string{"acct"}, refused: true},
	{name: "self update inserts", ddl: "CREATE RULE rv_self2 AS ON UPDATE TO acct DO ALSO INSERT INTO acct (id, payload, last_fence) VALUES (OLD.id + 100, 'copy', 99)",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_self2", tables: []string{"acct"}, refused: true},
	{name: "self delete updates", setup: "UPDATE acct SET last_fence = 9 WHERE id = 1",
		ddl:   "CREATE RULE rv_self3 AS ON DELETE TO acct DO ALSO UPDATE acct SET payload = 'deleted' WHERE id = 1",
		write: "DELETE FROM acct WHERE id = 3", rule: "rv_self3", tables: []string{"acct"}, refused: true},
	// Statements that run the UPDATE of acct inside another: a
	// data-modifying WITH, EXPLAIN ANALYZE, COPY (UPDATE ... RETURNING),
	// with an unconditional INSTEAD rule with RETURNING (which both need).
	{name: "WITH update", ddl: "CREATE RULE rv_ret AS ON UPDATE TO acct DO INSTEAD UPDATE racct SET payload = 'ret' WHERE id = OLD.id RETURNING racct.*",
		write: "WITH u AS (UPDATE acct SET n = n + 1 WHERE id = 1 RETURNING *) SELECT count(*) FROM u", rule: "rv_ret", tables: []string{"acct", "racct"}, refused: true},
	{name: "EXPLAIN ANALYZE update", ddl: "CREATE RULE rv_ret AS ON UPDATE TO acct DO INSTEAD UPDATE racct SET payload = 'ret' WHERE id = OLD.id RETURNING racct.*",
		write: "EXPLAIN ANALYZE UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_ret", tables: []string{"acct", "racct"}, refused: true},
	{name: "COPY update returning", ddl: "CREATE RULE rv_ret AS ON UPDATE TO acct DO INSTEAD UPDATE racct SET payload = 'ret' WHERE id = OLD.id RETURNING racct.*",
		write: "COPY (UPDATE acct SET n = n + 1 WHERE id = 1 RETURNING *) TO STDOUT", rule: "rv_ret", tables: []string{"acct", "racct"}, refused: true},
	// An upsert of acct, which has an ON UPDATE (or ON INSERT) rule
	// writing racct: PostgreSQL refuses ON CONFLICT there, so either
	// refusal will do, and racct is unchanged.
	{name: "upsert with update rule", ddl: "CREATE RULE rv_up AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'upsert'",
		write: "INSERT INTO acct (id, payload) VALUES (1, 'x') ON CONFLICT (id) DO UPDATE SET payload = excluded.payload",
		rule:  "rv_up", tables: []string{"acct", "racct"}, refused: true, pgRefuses: "0A000"},
	{name: "upsert with insert rule", ddl: "CREATE RULE rv_upi AS ON INSERT TO acct DO ALSO UPDATE racct SET payload = 'upsert'",
		write: "INSERT INTO acct (id, payload) VALUES (1, 'x') ON CONFLICT (id) DO UPDATE SET payload = excluded.payload",
		rule:  "rv_upi", tables: []string{"acct", "racct"}, refused: true, pgRefuses: "0A000"},
	// Lock-only table jobs (lock required, no fence column): its rule
	// writing racct; acct's rule writing jobs, from a session that names
	// no lock (acct's lock is optional, so nothing registers a lock
	// before the rule writes jobs).
	{name: "lock-only table's rule", ddl: "CREATE RULE rv_jobs AS ON UPDATE TO jobs DO ALSO UPDATE racct SET payload = 'jobs'",
		write: "UPDATE jobs SET state = 'done' WHERE id = 1", lock: "L", rule: "rv_jobs", tables: []string{"jobs", "racct"}, refused: true},
	{name: "rule writes lock-only table", ddl: "CREATE RULE rv_tojobs AS ON UPDATE TO acct DO ALSO UPDATE jobs SET state = 'via-acct'",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", lock: "-", rule: "rv_tojobs", tables: []string{"acct", "jobs"}, refused: true},
	// jobs's rule writing jobs itself, the session registering lock L
	// first (jobs requires it). Refused: the checker's lockCovered spares
	// only foreign key and TRUNCATE paths, not rules (conservative).
	{name: "lock-only self", ddl: "CREATE RULE rv_jself AS ON INSERT TO jobs DO ALSO UPDATE jobs SET state = 'bumped' WHERE id = 1",
		write: "INSERT INTO jobs VALUES (10, 'new')", lock: "L", rule: "rv_jself", tables: []string{"jobs"}, refused: true},
	// ENABLE REPLICA and ENABLE ALWAYS: the rule counts.
	{name: "enable replica", setup: "CREATE RULE rv_rep AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'replica'; ALTER TABLE acct DISABLE RULE rv_rep",
		ddl:   "ALTER TABLE acct ENABLE REPLICA RULE rv_rep",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_rep", tables: []string{"acct", "racct"}, refused: true},
	{name: "enable always", setup: "CREATE RULE rv_alw AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'always'; ALTER TABLE acct DISABLE RULE rv_alw",
		ddl:   "ALTER TABLE acct ENABLE ALWAYS RULE rv_alw",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_alw", tables: []string{"acct", "racct"}, refused: true},
	// CREATE OR REPLACE RULE turns a rule writing an unprotected table
	// into one writing racct.
	{name: "replace rule", setup: "CREATE RULE rv_repl AS ON UPDATE TO acct DO ALSO UPDATE plain SET n = n + 1",
		ddl:   "CREATE OR REPLACE RULE rv_repl AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'replaced'",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", rule: "rv_repl", tables: []string{"acct", "racct"}, refused: true},

	// Over-refusal: a rule on acct writing only an unprotected table does
	// not make acct's writes refused, and the rule runs.
	{name: "rule writes unprotected only", ddl: "CREATE RULE rv_plain AS ON UPDATE TO acct DO ALSO UPDATE plain SET n = n + 1",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", tables: []string{"acct", "racct", "plain"},
		check: func(t *testing.T, before, after string) {
			if strings.Count(after, `"n": 1`) != 2 || rvLine(after, "racct") != rvLine(before, "racct") {
				t.Errorf("want acct's and plain's row 1 at n 1, racct unchanged:\n before %s\n after  %s", before, after)
			}
		}},
	// Over-refusal: a rule for another event (ON DELETE writing racct)
	// does not refuse an UPDATE, nor an upsert (whose DO UPDATE fires no
	// rule, and which PostgreSQL allows with ON DELETE rules only).
	{name: "other event update", ddl: "CREATE RULE rv_odel AS ON DELETE TO acct DO ALSO UPDATE racct SET payload = 'del'",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", tables: []string{"acct", "racct"},
		check: rvRuleOnlyAcct},
	{name: "other event upsert", ddl: "CREATE RULE rv_odel2 AS ON DELETE TO acct DO ALSO UPDATE racct SET payload = 'del'",
		write: "INSERT INTO acct (id, payload) VALUES (1, 'upserted') ON CONFLICT (id) DO UPDATE SET payload = excluded.payload", tables: []string{"acct", "racct"},
		check: rvRuleOnlyAcct},
	// Over-refusal: reads of acct, its rule writing racct, still work.
	{name: "reads", ddl: "CREATE RULE rv_read AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'read'",
		write: "SELECT id, n FROM acct ORDER BY id", tables: []string{"acct", "racct"},
		check: rvRuleUnchanged},
	{name: "read for update", ddl: "CREATE RULE rv_read AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'read'",
		write: "SELECT id, n FROM acct WHERE id = 1 FOR UPDATE", tables: []string{"acct", "racct"},
		check: rvRuleUnchanged},
	// Over-refusal: a disabled rule does not fire.
	{name: "disabled", ddl: "CREATE RULE rv_dis AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'disabled'; ALTER TABLE acct DISABLE RULE rv_dis",
		write: "UPDATE acct SET n = n + 1 WHERE id = 1", tables: []string{"acct", "racct"},
		check: rvRuleOnlyAcct},
}

// rvLine is table's line of a rvRuleState.
func rvLine(state, table string) string {
	for _, l := range strings.Split(state, "\n") {
		if strings.HasPrefix(l, table+": ") {
			return l
		}
	}
	return ""
}

func rvRuleOnlyAcct(t *testing.T, before, after string) {
	t.Helper()
	if rvLine(after, "acct") == rvLine(before, "acct") || rvLine(after, "racct") != rvLine(before, "racct") {
		t.Errorf("want acct written, racct unchanged:\n before %s\n after  %s", before, after)
	}
}

func rvRuleUnchanged(t *testing.T, before, after string) {
	t.Helper()
	if after != before {
		t.Errorf("a read changed data:\n before %s\n after  %s", before, after)
	}
}

// TestReviewRulesCases runs rvRuleCases, each in a database of its own:
// the session writes acct once (so that its write is known and cached),
// the rule is created or changed on a direct connection, then the case's
// write runs through the proxy in the extended protocol (pgx's statement
// cache) and, in a database of its own, as a simple Query.
func TestReviewRulesCases(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, _, specs := rvCatalogProxy(t)
	for _, k := range rvRuleCases {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
			t.Run(k.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				lk := k.lock
				switch lk {
				case "":
					lk = "L"
				case "-":
					lk = ""
				}
				d, c := rvRuleDB(t, p, specs, lk)
				if k.setup != "" {
					execDirect(t, d, k.setup)
				}
				// The session's write before the change: acct row 2.
				if err := rvRuleTry(func() error {
					_, err := c.Exec(ctxT(t), "UPDATE acct SET n = n WHERE id = 2", mode)
					return err
				}); err != nil {
					t.Fatalf("write before the change: %v", err)
				}
				execDirect(t, d, k.ddl)
				before := rvRuleState(t, d, k.tables...)
				err := rvRuleTry(func() error {
					_, err := c.Exec(ctxT(t), k.write, mode)
					return err
				})
				after := rvRuleState(t, d, k.tables...)
				t.Logf("%s: %v", k.write, err)
				switch {
				case k.refused:
					if k.pgRefuses != "" && sqlState(err) == k.pgRefuses {
						break
					}
					if msg := rvRuleRefusal(err, k.rule); msg != "" {
						t.Errorf("%s: %s", k.write, msg)
					}
				case err != nil:
					t.Errorf("%s: refused: %v", k.write, err)
				}
				if k.refused && after != before {
					t.Errorf("written through rule %s by the stale holder:\n before %s\n after  %s", k.rule, before, after)
				}
				if k.check != nil {
					k.check(t, before, after)
				}
			})
		}
	}
}

// TestReviewRulesToggle: one rule on acct writing racct, disabled,
// enabled, disabled again and dropped with ALTER TABLE on a direct
// connection while the session keeps its prepared write (pgx's statement
// cache): refused only while the rule is enabled, racct never written.
func TestReviewRulesToggle(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, _, specs := rvCatalogProxy(t)
	d, c := rvRuleDB(t, p, specs, "L")
	write := func() error {
		_, err := c.Exec(ctxT(t), rvRuleWrite, 1)
		return err
	}
	if err := rvRuleTry(write); err != nil {
		t.Fatal(err)
	}
	racct := tableText(t, d, "racct")
	for i, step := range []struct {
		ddl     string
		refused bool
	}{
		{"CREATE RULE rv_t AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'toggle'; ALTER TABLE acct DISABLE RULE rv_t", false},
		{"ALTER TABLE acct ENABLE RULE rv_t", true},
		{"ALTER TABLE acct DISABLE RULE rv_t", false},
		{"ALTER TABLE acct ENABLE RULE rv_t", true},
		{"DROP RULE rv_t ON acct", false},
	} {
		execDirect(t, d, step.ddl)
		acct := tableText(t, d, "acct")
		err := rvRuleTry(write)
		switch msg := rvRuleRefusal(err, "rv_t"); {
		case step.refused && msg != "":
			t.Errorf("step %d (%s): %s", i, step.ddl, msg)
		case !step.refused && err != nil:
			t.Errorf("step %d (%s): refused: %v", i, step.ddl, err)
		}
		if got := tableText(t, d, "acct"); (got != acct) == step.refused {
			t.Errorf("step %d (%s): acct written %v, want %v:\n before %s\n after  %s", i, step.ddl, got != acct, !step.refused, acct, got)
		}
		if got := tableText(t, d, "racct"); got != racct {
			t.Fatalf("step %d (%s): racct written:\n before %s\n after  %s", i, step.ddl, racct, got)
		}
	}
}

// TestReviewRulesRepeatableRead: the session opens a REPEATABLE READ
// transaction and reads (its snapshot predates the rule), the rule is
// created on a direct connection, and the session's UPDATE of acct in
// that transaction is refused (the catalog check's refusal or the rule's);
// after a rollback, the retry in a new transaction is refused naming the
// rule. racct is unchanged.
func TestReviewRulesRepeatableRead(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, _, specs := rvCatalogProxy(t)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			d, c := rvRuleDB(t, p, specs, "L")
			ctx := ctxT(t)
			if err := rvRuleTry(func() error { _, err := c.Exec(ctx, rvRuleWrite, mode, 1); return err }); err != nil {
				t.Fatal(err)
			}
			mustExec(t, c, "BEGIN ISOLATION LEVEL REPEATABLE READ")
			// The snapshot, with no lock on acct (CREATE RULE would wait
			// for it).
			var n int
			if err := c.QueryRow(ctx, "SELECT count(*) FROM src", mode).Scan(&n); err != nil {
				t.Fatal(err)
			}
			execDirect(t, d, "CREATE RULE rv_rr AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'rr'")
			before := rvRuleState(t, d, "acct", "racct")
			_, err := c.Exec(ctx, rvRuleWrite, mode, 1)
			if sqlState(err) != rules.CodeRefused {
				t.Errorf("in the transaction: %v, want FP003", err)
			}
			if err := execIn(ctx, c, "ROLLBACK", mode); err != nil {
				t.Fatal(err)
			}
			err = rvRuleTry(func() error {
				err := execIn(ctx, c, "BEGIN ISOLATION LEVEL REPEATABLE READ", mode)
				if err == nil {
					_, err = c.Exec(ctx, rvRuleWrite, mode, 1)
				}
				if err == nil {
					err = execIn(ctx, c, "COMMIT", mode)
				} else {
					_ = execIn(ctx, c, "ROLLBACK", mode)
				}
				return err
			})
			if msg := rvRuleRefusal(err, "rv_rr"); msg != "" {
				t.Errorf("in a new transaction: %s", msg)
			}
			if after := rvRuleState(t, d, "acct", "racct"); after != before {
				t.Fatalf("written through the rule:\n before %s\n after  %s", before, after)
			}
		})
	}
}

// TestReviewRulesThroughProxy: rule DDL sent through the proxy, then a
// write in the same transaction (whose own DDL the catalog check does not
// count against it), then COMMIT. The DDL or the write must be refused,
// and racct must be unchanged. Held: CREATE RULE on acct and ALTER TABLE
// acct ENABLE RULE (DDL on a protected table), CREATE RULE on an
// unprotected table whose action writes racct; and the DDL on the rules
// and triggers of a relation from which a path would open (a disabled
// rule enabled, an INSTEAD NOTHING rule dropped, disabled or replaced,
// an INSTEAD OF trigger created on a view that reads racct), which the
// catalog lists as latent paths.
func TestReviewRulesThroughProxy(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, _, specs := rvCatalogProxy(t)
	const acctWrite, plainWrite = "UPDATE acct SET n = n + 1 WHERE id = 1", "UPDATE plain SET n = n + 1 WHERE id = 1"
	for _, k := range []struct {
		name, setup, ddl, write string
		// noPath: the write fails before the DDL (it opens the path).
		noPath bool
	}{
		{name: "create rule", ddl: "CREATE RULE rv_px AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'px'", write: acctWrite},
		{name: "enable rule", setup: "CREATE RULE rv_px AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'px'; ALTER TABLE acct DISABLE RULE rv_px",
			ddl: "ALTER TABLE acct ENABLE RULE rv_px", write: acctWrite},
		{name: "create rule on unprotected", ddl: "CREATE RULE rv_px AS ON UPDATE TO plain DO ALSO UPDATE racct SET payload = 'px'", write: plainWrite},
		{name: "create chained rule", setup: "CREATE RULE rv_acct_plain AS ON UPDATE TO acct DO ALSO UPDATE plain SET n = n + 1; CREATE VIEW rv_view AS SELECT * FROM racct",
			ddl: "CREATE RULE rv_px AS ON UPDATE TO plain DO ALSO UPDATE rv_view SET payload = 'px'", write: acctWrite},
		// A disabled rule on plain writing racct, enabled.
		{name: "enable rule on unprotected", setup: "CREATE RULE rv_px AS ON UPDATE TO plain DO ALSO UPDATE racct SET payload = 'px'; ALTER TABLE plain DISABLE RULE rv_px",
			ddl: "ALTER TABLE plain ENABLE RULE rv_px", write: plainWrite},
		// acct's rule writes plain, whose disabled rule writes racct:
		// enabling it opens a path from acct (the fix's new kind).
		{name: "enable chained rule", setup: "CREATE RULE rv_acct_plain AS ON UPDATE TO acct DO ALSO UPDATE plain SET n = n + 1; CREATE RULE rv_px AS ON UPDATE TO plain DO ALSO UPDATE racct SET payload = 'px'; ALTER TABLE plain DISABLE RULE rv_px",
			ddl: "ALTER TABLE plain ENABLE RULE rv_px", write: acctWrite},
		// acct's rule writes a view over racct whose INSTEAD NOTHING rule
		// makes it write nothing: dropping that rule opens a path from
		// acct.
		{name: "drop instead nothing", setup: "CREATE VIEW rv_view AS SELECT * FROM racct; CREATE RULE rv_nothing AS ON UPDATE TO rv_view DO INSTEAD NOTHING; CREATE RULE rv_acct_view AS ON UPDATE TO acct DO ALSO UPDATE rv_view SET payload = 'px'",
			ddl: "DROP RULE rv_nothing ON rv_view", write: acctWrite},
		{name: "disable instead nothing", setup: "CREATE VIEW rv_view AS SELECT * FROM racct; CREATE RULE rv_nothing AS ON UPDATE TO rv_view DO INSTEAD NOTHING; CREATE RULE rv_acct_view AS ON UPDATE TO acct DO ALSO UPDATE rv_view SET payload = 'px'",
			ddl: "ALTER TABLE rv_view DISABLE RULE rv_nothing", write: acctWrite},
		{name: "replace instead nothing", setup: "CREATE VIEW rv_view AS SELECT * FROM racct; CREATE RULE rv_nothing AS ON UPDATE TO rv_view DO INSTEAD NOTHING; CREATE RULE rv_acct_view AS ON UPDATE TO acct DO ALSO UPDATE rv_view SET payload = 'px'",
			ddl: "CREATE OR REPLACE RULE rv_nothing AS ON UPDATE TO public.rv_view DO ALSO NOTHING", write: acctWrite},
		// A view that cannot be written (an aggregate) over racct, and a
		// trigger function writing racct made on a direct connection:
		// an INSTEAD OF trigger makes the view write racct.
		{name: "create instead of trigger", setup: "CREATE VIEW rv_sum AS SELECT sum(n) AS n FROM racct; " +
			"CREATE FUNCTION rv_px() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN UPDATE racct SET payload = 'px'; RETURN NEW; END$$",
			ddl: "CREATE TRIGGER rv_px INSTEAD OF UPDATE ON rv_sum FOR EACH ROW EXECUTE FUNCTION rv_px()", write: "UPDATE rv_sum SET n = 1", noPath: true},
	} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
			t.Run(k.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				d, c := rvRuleDB(t, p, specs, "L")
				ctx := ctxT(t)
				if k.setup != "" {
					execDirect(t, d, k.setup)
				}
				if err := rvRuleTry(func() error { return execIn(ctx, c, k.write, mode) }); err != nil && !k.noPath {
					t.Fatalf("the write before the DDL: %v", err)
				}
				before := tableText(t, d, "racct")
				if err := execIn(ctx, c, "BEGIN", mode); err != nil {
					t.Fatal(err)
				}
				derr := execIn(ctx, c, k.ddl, mode)
				var werr error
				if derr == nil {
					werr = execIn(ctx, c, k.write, mode)
				}
				cerr := execIn(ctx, c, "COMMIT", mode)
				t.Logf("ddl: %v; write: %v; commit: %v", derr, werr, cerr)
				if derr == nil && werr == nil && cerr == nil {
					t.Errorf("%s and %s both ran", k.ddl, k.write)
				}
				if after := tableText(t, d, "racct"); after != before {
					t.Errorf("racct written through a rule changed through the proxy:\n before %s\n after  %s", before, after)
				}
			})
		}
	}
}

// rvHierRules protect a partitioned table (pacct, partition pacct_1) and
// an inheritance parent (iacct, child ichild), row-fenced, and racct.
var rvHierRules = rules.Config{Tables: []rules.Table{
	{Table: "public.pacct"},
	{Table: "public.iacct"},
	{Table: "public.racct", Lock: rules.LockRequired, Column: "last_fence"},
}}

const rvHierSchema = `
CREATE TABLE pacct (id bigint NOT NULL, payload text NOT NULL DEFAULT 'new', n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0) PARTITION BY RANGE (id);
CREATE TABLE pacct_1 PARTITION OF pacct FOR VALUES FROM (0) TO (1000);
CREATE TABLE iacct (id bigint NOT NULL, payload text NOT NULL DEFAULT 'new', n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE ichild () INHERITS (iacct);
CREATE TABLE racct (id bigint PRIMARY KEY, payload text NOT NULL DEFAULT 'new', n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO pacct (id, payload) VALUES (1, 'a'), (2, 'b');
INSERT INTO ichild (id, payload) VALUES (1, 'a'), (2, 'b');
INSERT INTO racct (id, payload, last_fence) VALUES (1, 'a', 9), (2, 'b', 9);
`

// TestReviewRulesHierarchy: rules on a partition (pacct_1) and an
// inheritance child (ichild) of protected parents, writing racct.
// PostgreSQL does not fire a child's rules for a write that names the
// parent: such writes are not refused, and racct is unchanged. A write
// naming the child is refused (the child's rows are the protected
// parent's). A rule on the protected parent itself makes the parent's
// write refused, naming it.
func TestReviewRulesHierarchy(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, rvHierRules)
	rs, err := rules.Compile(rvHierRules)
	if err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, policy.New(rs, false, policy.Options{Checks: checker}))
	for _, k := range []struct{ parent, child string }{{"pacct", "pacct_1"}, {"iacct", "ichild"}} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
			t.Run(k.parent+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				db := schemaDB(t, "rvrhier", rvHierSchema)
				d := direct(t, db)
				if _, err := dbsetup.Setup(ctxT(t), d, specs, dbsetup.SetupOptions{}); err != nil {
					t.Fatal(err)
				}
				c := rvSession(t, p, db, "L", "5")
				ctx := ctxT(t)
				exec := func(sql string) error {
					return rvRuleTry(func() error { return execIn(ctx, c, sql, mode) })
				}
				parentWrite := "UPDATE " + k.parent + " SET n = n + 1 WHERE id = 1"
				if err := exec(parentWrite); err != nil {
					t.Fatal(err)
				}
				execDirect(t, d, "CREATE RULE rv_child AS ON UPDATE TO "+k.child+" DO ALSO UPDATE racct SET payload = 'child'")
				racct := tableText(t, d, "racct")
				parent := tableText(t, d, k.parent)
				if err := exec(parentWrite); err != nil {
					t.Errorf("%s, a rule on %s: refused: %v", parentWrite, k.child, err)
				}
				if got := tableText(t, d, k.parent); got == parent {
					t.Errorf("%s did not write it", parentWrite)
				}
				if err := exec("UPDATE " + k.child + " SET n = n + 1 WHERE id = 2"); sqlState(err) != rules.CodeRefused {
					t.Errorf("the write naming %s: %v, want FP003", k.child, err)
				}
				if got := tableText(t, d, "racct"); got != racct {
					t.Errorf("racct written through %s's rule:\n before %s\n after  %s", k.child, racct, got)
				}
				execDirect(t, d, "CREATE RULE rv_parent AS ON UPDATE TO "+k.parent+" DO ALSO UPDATE racct SET payload = 'parent'")
				parent = tableText(t, d, k.parent)
				if msg := rvRuleRefusal(exec(parentWrite), "rv_parent"); msg != "" {
					t.Errorf("%s, a rule on %s: %s", parentWrite, k.parent, msg)
				}
				if got := tableText(t, d, "racct") + tableText(t, d, k.parent); got != racct+parent {
					t.Errorf("written through %s's rule:\n before %s%s\n after  %s", k.parent, racct, parent, got)
				}
			})
		}
	}
}

// TestReviewRulesGuarded: with the database guard on the protected
// tables, the rule on acct writing racct is no path the proxy refuses
// (the guard protects the target): the write of acct runs, and the
// guard's trigger on racct refuses the rule's write of rows a newer
// holder wrote; racct and acct are unchanged.
func TestReviewRulesGuarded(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, _, specs := rvCatalogProxy(t)
	db := schemaDB(t, "rvrguard", catalogMatrixSchema+"UPDATE racct SET last_fence = 9;")
	d := direct(t, db)
	if _, err := dbsetup.Setup(ctxT(t), d, specs, dbsetup.SetupOptions{Guard: true, Tables: hijackRules.Tables}); err != nil {
		t.Fatal(err)
	}
	c := rvSession(t, p, db, "L", "5")
	write := func() error { _, err := c.Exec(ctxT(t), rvRuleWrite, 1); return err }
	if err := rvRuleTry(write); err != nil {
		t.Fatal(err)
	}
	execDirect(t, d, "CREATE RULE rv_g AS ON UPDATE TO acct DO ALSO UPDATE racct SET payload = 'guarded'")
	before := rvRuleState(t, d, "acct", "racct")
	err := rvRuleTry(write)
	t.Logf("guarded: %v", err)
	if err == nil {
		t.Errorf("the write through the rule ran")
	}
	if after := rvRuleState(t, d, "acct", "racct"); after != before {
		t.Errorf("written through the rule despite the guard:\n before %s\n after  %s", before, after)
	}
}
