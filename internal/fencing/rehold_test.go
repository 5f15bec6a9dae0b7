package fencing_test

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// A session whose registration of a lock and a token committed before
// registers the same values again with fenceproxy.rehold_at (objects
// version 9): the lock taken shared before the one read of the watermark,
// where hold_at reads it on both sides of the lock. These tests look at
// the procedure the server ran, the data and the watermarks.

// sentProc runs stmt on c (FP003 retried) and returns which of hold_at
// and rehold_at the server ran in front of it ("" for neither), and
// stmt's error.
func sentProc(t *testing.T, d, c *pgx.Conn, stmt string) (string, error) {
	t.Helper()
	err := rvExec(t, c, stmt)
	q := sentText(t, d, c)
	switch {
	case strings.HasPrefix(q, "CALL fenceproxy.rehold_at("):
		return "rehold_at", err
	case strings.HasPrefix(q, "CALL fenceproxy.hold_at("):
		return "hold_at", err
	}
	return "", err
}

func TestReholdAt(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	const upd = "UPDATE acct SET n = n + 1 WHERE id = 3"

	// The first registration of a session reads the watermark twice; once
	// it committed, the next one reads it once.
	h7 := rvHolder(t, p, db, "L", "7")
	for i, want := range []string{"hold_at", "rehold_at", "rehold_at"} {
		if proc, err := sentProc(t, d, h7, upd); err != nil || proc != want {
			t.Fatalf("write %d: %v, sent %s; want %s", i+1, err, sentText(t, d, h7), want)
		}
	}
	if r := snapshot(t, d, "acct")[3]; r.N != 3 || r.Fence != 7 {
		t.Errorf("row 3 = %+v, want n 3 fence 7", r)
	}
	if w := lockWatermark(t, d, "L"); w != 7 {
		t.Errorf("lock L's watermark %d, want 7", w)
	}
	// A lock-only table, the same lock and token: rehold_at too.
	if proc, err := sentProc(t, d, h7, "UPDATE jobs SET state = 'h7' WHERE id = 1"); err != nil || proc != "rehold_at" {
		t.Errorf("a lock-only table: %v, sent %s; want rehold_at", err, sentText(t, d, h7))
	}

	// A newer holder registers on another session; the holder of 7, with
	// its memory of 7, is refused by rehold_at and changes nothing.
	h9 := rvHolder(t, p, db, "L", "9")
	if proc, err := sentProc(t, d, h9, "UPDATE jobs SET state = 'h9' WHERE id = 1"); err != nil || proc != "hold_at" {
		t.Fatalf("the newer holder: %v, sent %s; want hold_at", err, sentText(t, d, h9))
	}
	before, beforeJobs := snapshot(t, d, "acct"), tableText(t, d, "jobs")
	// The first refusal goes through rehold_at; a registration that failed
	// is forgotten, so the next reads the watermark first (hold_at).
	for i, stmt := range []string{upd, "UPDATE jobs SET state = 'stale' WHERE id = 1"} {
		want := []string{"rehold_at", "hold_at"}[i]
		proc, err := sentProc(t, d, h7, stmt)
		if sqlState(err) != "FP001" || !strings.Contains(err.Error(), "stale token 7") || proc != want {
			t.Errorf("%s after the newer holder: %v (sent %s), want FP001 through %s", stmt, err, proc, want)
		}
	}
	wantUnchanged(t, d, "acct", before)
	if after := tableText(t, d, "jobs"); after != beforeJobs {
		t.Errorf("stale writes changed jobs:\n before %s\n after  %s", beforeJobs, after)
	}

	// A registration whose transaction did not commit is not remembered:
	// rolled back, or failed later in its Query.
	const updM = "UPDATE acct SET n = n + 1 WHERE id = 2"
	hm := rvHolder(t, p, db, "M", "5")
	mustExec(t, hm, "BEGIN")
	if proc, err := sentProc(t, d, hm, updM); err != nil || proc != "" {
		t.Fatalf("in a transaction: %v, sent %s; want the prelude and hold", err, sentText(t, d, hm))
	}
	mustExec(t, hm, "ROLLBACK")
	if w := lockWatermark(t, d, "M"); w != 0 {
		t.Fatalf("lock M's watermark %d after the rollback, want none", w)
	}
	if proc, err := sentProc(t, d, hm, updM+" AND pg_catalog.int4div(1, n - n) = 1"); sqlState(err) != "22012" || proc != "hold_at" {
		t.Fatalf("a write failing after its registration: %v, sent %s; want 22012 after hold_at", err, sentText(t, d, hm))
	}
	if proc, err := sentProc(t, d, hm, updM); err != nil || proc != "hold_at" {
		t.Errorf("after a failed Query: %v, sent %s; want hold_at (nothing committed)", err, proc)
	}
	if proc, err := sentProc(t, d, hm, updM); err != nil || proc != "rehold_at" {
		t.Errorf("after a committed registration: %v, sent %s; want rehold_at", err, proc)
	}
	// A new token is a new registration; an explicit transaction that
	// commits is remembered as well.
	mustExec(t, hm, "SET fence.token = '6'")
	mustExec(t, hm, "BEGIN")
	if _, err := sentProc(t, d, hm, updM); err != nil {
		t.Fatal(err)
	}
	mustExec(t, hm, "COMMIT")
	if proc, err := sentProc(t, d, hm, updM); err != nil || proc != "rehold_at" {
		t.Errorf("token 6 after its transaction committed: %v, sent %s; want rehold_at", err, proc)
	}

	// The watermark deleted by hand (the one case where the memory is
	// wrong): rehold_at hands the registration to register, which
	// restores it; the write runs with its fence.
	execDirect(t, d, "DELETE FROM fenceproxy.locks WHERE name = 'M'")
	if proc, err := sentProc(t, d, hm, "UPDATE acct SET payload = 'm6' WHERE id = 2"); err != nil || proc != "rehold_at" {
		t.Errorf("the watermark deleted: %v, sent %s; want rehold_at and register's outcome", err, proc)
	}
	if w := lockWatermark(t, d, "M"); w != 6 {
		t.Errorf("lock M's watermark %d, want 6 restored", w)
	}
	if r := snapshot(t, d, "acct")[2]; r.Payload != "m6" || r.Fence != 6 {
		t.Errorf("row 2 = %+v, want payload m6 fence 6", r)
	}

	// REPEATABLE READ: rehold_at leaves the registration to register's
	// own path for it; an older token is still refused.
	mustExec(t, hm, "SET default_transaction_isolation = 'repeatable read'")
	if proc, err := sentProc(t, d, hm, updM); err != nil || proc != "rehold_at" {
		t.Errorf("repeatable read: %v, sent %s", err, proc)
	}
	execDirect(t, d, "UPDATE fenceproxy.locks SET token = 8 WHERE name = 'M'")
	before = snapshot(t, d, "acct")
	if _, err := sentProc(t, d, hm, updM); sqlState(err) != "FP001" {
		t.Errorf("repeatable read, watermark 8, token 6: %v, want FP001", err)
	}
	wantUnchanged(t, d, "acct", before)
}

// TestReholdAtBind: a Bind alone before its Sync, in the parameter form,
// registers with rehold_at($1..$4) once the session's registration of the
// same values committed.
func TestReholdAtBind(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, "")
	h7 := bindSession(t, p, db, "L", "7")
	const upd = "UPDATE acct SET n = n + 1 WHERE id = $1"
	for i, want := range []string{"CALL fenceproxy.hold_at($1, $2, $3, $4)", "CALL fenceproxy.rehold_at($1, $2, $3, $4)"} {
		ran := mustBindRan(t, h7, upd, 3)
		if all := strings.Join(ran, "\n"); !byValue(t, ran) || !strings.Contains(all, want) {
			t.Errorf("use %d: want %s:\n%s", i+1, want, all)
		}
	}
	h9 := bindSession(t, p, db, "L", "9")
	mustBindRan(t, h9, upd, 1)
	before := snapshot(t, d, "acct")
	ran, err := bindRan(t, h7, upd, 3)
	if sqlState(err) != "FP001" || !strings.Contains(strings.Join(ran, "\n"), "fenceproxy.rehold_at(") {
		t.Errorf("the holder of 7 after 9: %v, want FP001 through rehold_at:\n%s", err, strings.Join(ran, "\n"))
	}
	wantUnchanged(t, d, "acct", before)
}

// TestReholdAtDropped: rehold_at dropped while the proxy runs: a write
// that calls it fails and changes nothing, and once the proxy has checked
// the database again it registers with hold_at.
func TestReholdAtDropped(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	h7 := rvHolder(t, p, db, "L", "7")
	for range 2 {
		if _, err := sentProc(t, d, h7, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
	}
	execDirect(t, d, "DROP PROCEDURE fenceproxy.rehold_at(bigint, text, text, text)")
	before := snapshot(t, d, "acct")
	if err := rvExec(t, h7, "UPDATE acct SET n = 50 WHERE id = 2"); err != nil {
		wantUnchanged(t, d, "acct", before)
	}
	waitUntil(t, "hold_at back", func() bool {
		proc, err := sentProc(t, d, h7, "UPDATE acct SET n = n + 1 WHERE id = 1")
		return err == nil && proc == "hold_at"
	})
}

// TestReholdAtConcurrent: sessions of one holder write at once, with and
// without the memory of their registration, while a newer holder's
// sessions register at once on their first writes (hold_at, so two of
// them never hold the lock shared and wait for it exclusively): no
// deadlock, and once the newer holder's write has committed no write of
// the older one changes a row.
func TestReholdAtConcurrent(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	const sessions = 4
	old := make([]*pgx.Conn, sessions)
	for i := range old {
		old[i] = rvHolder(t, p, db, "L", "7")
		if err := rvExec(t, old[i], "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
	}
	newer := make([]*pgx.Conn, sessions)
	for i := range newer {
		newer[i] = rvHolder(t, p, db, "L", "9")
	}

	var stop atomic.Bool
	var newerDone atomic.Bool // a write of 9 has committed
	var wg sync.WaitGroup
	errs := make(chan error, 4*sessions)
	for i, c := range old {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := 0; !stop.Load(); k++ {
				after := newerDone.Load()
				_, err := c.PgConn().Exec(ctxT(t), fmt.Sprintf("UPDATE acct SET payload = 'h7 %d %d', n = n + 1 WHERE id = %d", i, k, i%3+1)).ReadAll()
				switch {
				case err == nil && after:
					errs <- fmt.Errorf("session %d of 7: a write after the newer holder's committed", i)
					return
				case err != nil && sqlState(err) != "FP001":
					errs <- fmt.Errorf("session %d of 7: %v", i, err)
					return
				}
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	for i, c := range newer {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := c.PgConn().Exec(ctxT(t), fmt.Sprintf("UPDATE acct SET payload = 'h9 %d' WHERE id = %d", i, i%3+1)).ReadAll(); err != nil {
				errs <- fmt.Errorf("session %d of 9: %v", i, err)
				return
			}
			newerDone.Store(true)
		}()
	}
	time.Sleep(500 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if w := lockWatermark(t, d, "L"); w != 9 {
		t.Errorf("lock L's watermark %d, want 9", w)
	}
	for id, r := range snapshot(t, d, "acct") {
		if r.Fence == 9 && !strings.HasPrefix(r.Payload, "h9") {
			t.Errorf("row %d = %+v: fenced by 9, written by the older holder", id, r)
		}
	}
	// Every session of 7 now remembers 7 and is refused.
	for i, c := range old {
		if proc, err := sentProc(t, d, c, "UPDATE acct SET n = 0 WHERE id = 3"); sqlState(err) != "FP001" {
			t.Errorf("session %d of 7 at the end: %v (sent %s), want FP001", i, err, proc)
		}
	}
}

// TestReholdPreparedCallForgets: a statement prepared earlier whose text
// may end the transaction from stored code (a CALL of a procedure that
// rolls back, a DO block) and is bound in a pipeline after a lock-fenced
// write, before one Sync, rolls the registration back where the relay
// sees no error and no ROLLBACK; the relay knows it from the statement's
// text at its Bind (its Parse went in an earlier Sync), keeps no memory
// of the registration, and the session's next write reads the watermark
// first (hold_at).
func TestReholdPreparedCallForgets(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, rvRollbackProc)
	for i, tail := range []string{"CALL rv_rollback()", "DO $$BEGIN ROLLBACK; END$$"} {
		lock := fmt.Sprintf("P%d", i)
		h7 := rvHolder(t, p, db, lock, "7")
		if err := rvExec(t, h7, "UPDATE acct SET n = n + 1 WHERE id = 3"); err != nil {
			t.Fatal(err)
		}
		h9 := rvHolder(t, p, db, lock, "9")
		if _, err := h9.PgConn().Prepare(ctxT(t), "ends", tail, nil); err != nil {
			t.Fatalf("%s: prepare: %v", tail, err)
		}
		before := snapshot(t, d, "acct")
		var err error
		for range 100 {
			b := &pgconn.Batch{}
			b.ExecParams("UPDATE acct SET n = n + 1 WHERE id = 1", nil, nil, nil, nil)
			b.ExecPrepared("ends", nil, nil, nil)
			if _, err = h9.PgConn().ExecBatch(ctxT(t), b).ReadAll(); sqlState(err) != "FP003" {
				break
			}
		}
		if err != nil {
			t.Fatalf("%s: the pipeline: %v", tail, err)
		}
		// The write and its registration were rolled back.
		wantUnchanged(t, d, "acct", before)
		if w := lockWatermark(t, d, lock); w != 7 {
			t.Fatalf("%s: lock %s's watermark %d after the rolled-back registration, want 7", tail, lock, w)
		}
		proc, err := sentProc(t, d, h9, "UPDATE acct SET payload = 'h9' WHERE id = 1")
		if err != nil || proc != "hold_at" {
			t.Errorf("{UPDATE; Bind of the prepared %q}: the next write %v, sent %s; want hold_at (no registration of 9 committed)", tail, err, proc)
		}
		if w := lockWatermark(t, d, lock); w != 9 {
			t.Errorf("%s: lock %s's watermark %d after the next write, want 9", tail, lock, w)
		}
	}
}
