package fencing_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review of c1eb5cd (a write whose own text may change
// lock_timeout is refused where the catalog check goes in its
// transaction) and 335d263/e20a6b3 (the check in front of a simple Query
// of several statements). As in TestReviewAloneLockTimeoutReset, a
// migration on a direct connection has created a rule that opens
// top -> side -> items and not committed; the holder of token 5 sends a
// write through the proxy whose cascade into side waits for the rule's
// lock. After the COMMIT, items (fence 9) must be unchanged. The
// review's findings (nine ways through, and texts refused or failing that
// ran before) were mended after it: each case's why says what had let it
// through.

// rfAttack: pre runs first, one simple Query each; write is a simple
// Query, or (ext) one statement in pgx's extended protocol (a named
// prepared statement) with $1 = 1. %DB% in write is the database's name.
// why says, for a case that deletes items, why the check missed it.
type rfAttack struct {
	name, why string
	pre       []string
	write     string
	ext       bool
}

// TestReviewFrontLockWait: writes of top by the holder of token 5 while
// the rule that makes top a path to items is not committed.
func TestReviewFrontLockWait(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxy(t)
	for _, k := range []rfAttack{
		// Held: refused (FP003) or failed by the check's lock_timeout.
		{name: "SET SESSION quoted TO DEFAULT", write: `SET SESSION "lock_timeout" TO DEFAULT; DELETE FROM top WHERE id = 1`},
		{name: "SET LOCAL FROM CURRENT", write: "SET LOCAL lock_timeout FROM CURRENT; DELETE FROM top WHERE id = 1"},
		{name: "set_config of a U& name", write: `DELETE FROM top WHERE id = 1 AND set_config(U&'lock\005ftimeout', '0', true) IS NOT NULL`},
		{name: "set_config with named arguments", write: "DELETE FROM top WHERE id = 1 AND set_config(setting_name => 'lock_timeout', new_value => '0', is_local => true) IS NOT NULL"},
		{name: "set_config in a DO block before", write: "DO $$BEGIN PERFORM set_config('lock_timeout', '0', true); END$$; DELETE FROM top WHERE id = 1"},
		{name: "BEGIN in the middle", write: "SELECT 1; BEGIN; DELETE FROM top WHERE id = 1; COMMIT"},
		{name: "leading comment, several statements", write: "/* c */ SELECT 1; DELETE FROM top WHERE id = 1"},
		// Findings.
		{name: "UPDATE pg_settings before", write: "UPDATE pg_settings SET setting = '0' WHERE name = 'lock_timeout'; DELETE FROM top WHERE id = 1",
			why: "pg_settings' rule calls set_config: changesLockTimeout sees no SET or set_config"},
		{name: "set_config named database.schema.function", write: "DELETE FROM top WHERE id = 1 AND %DB%.pg_catalog.set_config('lock_timeout', '0', true) IS NOT NULL",
			why: "isSetConfig takes at most two name parts; PostgreSQL accepts the current database's name as a third"},
		{name: "SET LOCAL before WITH … DELETE", write: "SET LOCAL lock_timeout = 0; WITH d AS (DELETE FROM top WHERE id = 1 RETURNING id) SELECT id FROM d",
			why: "timeoutBeforeWrite's last write is a top-level INSERT/UPDATE/DELETE/MERGE only (also COPY (DELETE …) TO STDOUT)"},
		{name: "SET LOCAL before EXPLAIN ANALYZE DELETE", write: "SET LOCAL lock_timeout = 0; EXPLAIN ANALYZE DELETE FROM top WHERE id = 1",
			why: "as above: an EXPLAIN ANALYZE is not a write to timeoutBeforeWrite"},
		{name: "ROLLBACK TO a savepoint set before the Query", pre: []string{"BEGIN", "SAVEPOINT a"},
			write: "SELECT 1; ROLLBACK TO SAVEPOINT a; DELETE FROM top WHERE id = 1",
			why:   "the rollback undoes the front check's SET LOCAL; only statements on protected tables after a ROLLBACK TO are refused (statementAfterEnd)"},
		{name: "leading comment", write: "/* c */ DELETE FROM top WHERE id = 1",
			why: "one statement that inBandWrite rejects: checked by a stamp read alone, no lock_timeout (not in design.md's list of what is not covered)"},
		{name: "empty statement after it", write: "DELETE FROM top WHERE id = 1;;",
			why: "as above: inBandWrite rejects the second semicolon, and frontCheck sees one statement"},
		{name: "EXPLAIN ANALYZE alone", write: "EXPLAIN ANALYZE DELETE FROM top WHERE id = 1",
			why: "as above"},
		{name: "extended protocol, leading comment", ext: true, write: "/* c */ DELETE FROM top WHERE id = $1",
			why: "a Parse inBandWrite rejects gets no check at its Binds (stampCheck.on), though design.md says each Bind carries it"},
	} {
		t.Run(k.name, func(t *testing.T) {
			t.Parallel()
			rfRun(t, p, specs, k)
		})
	}
}

// rfRun plays k against an open rule on side (a migration's, on a direct
// connection, not committed): the write must fail (55P03 from the
// check's lock_timeout, or FP003) and items must be unchanged after the
// rule commits.
func rfRun(t *testing.T, p *proxytest.Proxy, specs []rules.TableSpec, k rfAttack) {
	t.Helper()
	db, d := fkDB(t, specs, raSideSchema)
	ctx := ctxT(t)
	mig := direct(t, db)
	for _, s := range []string{"BEGIN", raSideRule} {
		if _, err := mig.Exec(ctx, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	items0 := fkRows(t, d, txItemsQ)
	w := rvSession(t, p, db, "", "5")
	for _, s := range k.pre {
		if err := mpSimple(w, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	sql := strings.ReplaceAll(k.write, "%DB%", db)
	wPid := raPid(t, w)
	var wDone chan error
	if k.ext {
		wDone = make(chan error, 1)
		go func() {
			c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_, err := w.Exec(c, sql, 1)
			wDone <- err
		}()
	} else {
		wDone = raGo(w, sql)
	}
	waited := raWaits(t, d, wPid, wDone)
	if waited {
		time.Sleep(200 * time.Millisecond)
	}
	if _, err := mig.Exec(ctx, "COMMIT"); err != nil {
		t.Fatal(err)
	}
	wErr := <-wDone
	if len(k.pre) > 0 {
		_ = mpSimple(w, "COMMIT")
	}
	items := fkRows(t, d, txItemsQ)
	if items != items0 {
		t.Errorf("FINDING (%s): %q waited for the open rule's lock (%v) and, after its COMMIT, deleted items through it for token 5 (fence 9): %s (were %s); the write got %v",
			k.why, sql, waited, items, items0, wErr)
	} else if rvCode(wErr) != "55P03" && rvCode(wErr) != "FP003" {
		t.Errorf("%q: %v, want 55P03 or FP003", sql, wErr)
	}
}

// TestReviewFrontOrdinary: texts of ordinary clients in a watched
// database, through the proxy (token 7, simple protocol), with no
// catalog change under way. want is the SQLSTATE ("" for success); note
// says why a case that fails is wrong.
func TestReviewFrontOrdinary(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, "CREATE TABLE plain2 (id bigint PRIMARY KEY, n int NOT NULL DEFAULT 0); INSERT INTO plain2 (id) VALUES (1), (2);")
	c := readerSession(t, p, db, "", "7", pgx.QueryExecModeSimpleProtocol)
	ran := 0
	for _, k := range []struct{ q, want, note string }{
		{q: "BEGIN; UPDATE acct SET n = n + 1 WHERE id = 1; COMMIT"},
		{q: "SET search_path = public; UPDATE acct SET n = n + 1 WHERE id = 1"},
		{q: "BEGIN ISOLATION LEVEL READ COMMITTED; UPDATE acct SET n = n + 1 WHERE id = 1; COMMIT"},
		{q: "UPDATE acct SET n = n + 1 WHERE id = 1; SET lock_timeout = '5s'"},
		{q: "SELECT set_config('search_path', 'public', false); UPDATE acct SET n = n + 1 WHERE id = 1"},
		{q: "SET LOCAL lock_timeout = '5s'; SELECT payload FROM acct WHERE id = 1 FOR SHARE"},
		// Documented refusals (operating.md, Limits).
		{q: "SET LOCAL lock_timeout = '5s'; UPDATE plain2 SET n = n + 1 WHERE id = 1", want: "FP003"},
		{q: "RESET ALL; UPDATE plain2 SET n = n + 1 WHERE id = 1", want: "FP003"},
		// Broken by the check in front (335d263): its CALL takes the
		// transaction's first snapshot, after which PostgreSQL refuses to
		// set the isolation level. These ran before it.
		{q: "BEGIN ISOLATION LEVEL REPEATABLE READ; UPDATE acct SET n = n + 1 WHERE id = 1; COMMIT",
			note: "BEGIN ISOLATION LEVEL in front of a write fails with 25001 since the check goes in front of the Query"},
		{q: "BEGIN; SET TRANSACTION ISOLATION LEVEL SERIALIZABLE; UPDATE acct SET n = n + 1 WHERE id = 1; COMMIT",
			note: "SET TRANSACTION ISOLATION LEVEL after BEGIN fails with 25001 since the check goes in front of the Query"},
		// Reads refused as writes (c1eb5cd with 335d263): the word scan
		// (policy.mayWrite) finds UPDATE in FOR UPDATE or in a string.
		{q: "SET LOCAL lock_timeout = '5s'; SELECT id FROM acct WHERE id = 1 FOR UPDATE",
			note: "a SELECT … FOR UPDATE with its lock_timeout is refused as a write that changes lock_timeout"},
		{q: "SET LOCAL lock_timeout = '5s'; SELECT payload FROM acct WHERE payload <> 'update'",
			note: "a read whose string holds the word update is refused as a write that changes lock_timeout"},
	} {
		err := mpSimple(c, k.q)
		if rvCode(err) != k.want {
			t.Errorf("%s: %v, want %q (%s)", k.q, err, k.want, k.note)
		}
		if err == nil && strings.Contains(k.q, "UPDATE acct") {
			ran++
		}
		_ = mpSimple(c, "ROLLBACK")
	}
	if r := snapshot(t, d, "acct")[1]; int(r.N) != ran || r.Fence != 7 {
		t.Errorf("acct row 1 = %+v, want n %d, fence 7", r, ran)
	}
	// COPY in a Query of several statements goes.
	if _, err := c.PgConn().CopyFrom(ctxT(t), strings.NewReader("3\t0\n"), "SET search_path = public; COPY plain2 FROM STDIN"); err != nil {
		t.Errorf("SET search_path; COPY plain2 FROM STDIN: %v", err)
	}
	// A refusal in an explicit transaction aborts it, as PostgreSQL's
	// errors do.
	for _, q := range []string{"BEGIN", "UPDATE plain2 SET n = 9 WHERE id = 2"} {
		if err := mpSimple(c, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if err := mpSimple(c, "SET LOCAL lock_timeout = '5s'; UPDATE plain2 SET n = n + 1 WHERE id = 2"); rvCode(err) != "FP003" {
		t.Errorf("refused in a transaction: %v, want FP003", err)
	}
	if s := c.PgConn().TxStatus(); s != 'E' {
		t.Errorf("transaction status after the refusal: %c, want E", s)
	}
	_ = mpSimple(c, "ROLLBACK")
	if got := testutil.QueryStrings(t, d, "SELECT n::text FROM plain2 ORDER BY id"); strings.Join(got, ",") != "0,0,0" {
		t.Errorf("plain2 n = %v, want 0,0,0", got)
	}
}
