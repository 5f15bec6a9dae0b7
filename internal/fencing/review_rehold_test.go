package fencing_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/audit"
	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// An adversarial review of fenceproxy.rehold_at (objects version 9) and
// of the relay's memory of a committed registration (fenceRecord.held)
// that selects it. rehold_at takes the lock's advisory lock shared before
// it reads the watermark; the claim is that this is safe whatever the
// memory says, and that the memory is wrong only where a watermark was
// lowered or deleted by hand (then, at worst, two sessions deadlock).
// Every check reads the data and the watermarks back from PostgreSQL.

// rvRollbackProc is a procedure that rolls back the transaction it is
// called in (PostgreSQL allows it where the CALL is not atomic: a simple
// Query of its own, or an Execute of the extended protocol outside an
// explicit transaction block, also after other Executes before the same
// Sync). rvDeferredFK is a foreign key checked at COMMIT.
const (
	rvRollbackProc = `
CREATE PROCEDURE rv_rollback() LANGUAGE plpgsql AS $$BEGIN ROLLBACK; END$$;
`
	rvDeferredFK = `
CREATE TABLE rv_parent (id int PRIMARY KEY);
CREATE TABLE rv_child (pid int REFERENCES rv_parent DEFERRABLE INITIALLY DEFERRED);
`
)

// rvBatch sends sqls as one pipeline of the extended protocol (each an
// unnamed Parse, Bind, Describe and Execute; one Sync at the end), as
// pgx's and JDBC's batches do, retrying a catalog change's FP003.
func rvBatch(t *testing.T, c *pgx.Conn, sqls ...string) error {
	t.Helper()
	var err error
	for i := 0; i < 100; i++ {
		b := &pgconn.Batch{}
		for _, s := range sqls {
			b.ExecParams(s, nil, nil, nil, nil)
		}
		if _, err = c.PgConn().ExecBatch(ctxT(t), b).ReadAll(); sqlState(err) != "FP003" {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
	return err
}

// rvPid is the backend pid runPid marked c with.
func rvPid(t *testing.T, c *pgx.Conn) uint32 {
	t.Helper()
	pid, ok := sessionPids.Load(c)
	if !ok {
		t.Fatal("test bug: rvPid on a session that runPid did not mark")
	}
	return pid.(uint32)
}

// rvWaitLocked waits until c's backend waits for a lock, failing the test
// if done has a result first or ten seconds pass.
func rvWaitLocked(t *testing.T, d, c *pgx.Conn, done chan error, what string) {
	t.Helper()
	if !raWaits(t, d, rvPid(t, c), done) {
		var err error
		if len(done) > 0 {
			err = <-done
			done <- err
		}
		t.Fatalf("%s: not waiting for a lock (result %v, sent %s)", what, err, sentText(t, d, c))
	}
}

// rvWait returns done's result, failing the test after 30 seconds.
func rvWait(t *testing.T, done chan error, what string) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: no result in 30 s", what)
		return nil
	}
}

// TestReviewReholdProcedureRollbackMemory (found as a hole in review, and
// mended: the relay keeps no memory of a transaction in which a client
// statement with CALL or DO ran): a registration whose transaction was
// rolled back, with no error and no ROLLBACK statement the relay could
// see, must not be remembered as committed. The client sends, in one
// pipeline before one Sync (pgx's SendBatch, JDBC's executeBatch), a
// write of a lock-fenced table and a CALL of a procedure that rolls back
// (PostgreSQL allows transaction control in an Execute outside an
// explicit block). The relay set cand when the registration answered,
// saw no error, no rollback statement and a ReadyForQuery 'I', and made
// it held. Nothing committed: the watermark is still the older holder's,
// nobody edited it, and yet the session's next write goes through
// rehold_at. (A DO block that rolls back does the same.)
func TestReviewReholdProcedureRollbackMemory(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, rvRollbackProc)
	for i, tail := range []string{"CALL rv_rollback()", "DO $$BEGIN ROLLBACK; END$$"} {
		lock := fmt.Sprintf("R%d", i)
		h7 := rvHolder(t, p, db, lock, "7")
		if err := rvExec(t, h7, "UPDATE acct SET n = n + 1 WHERE id = 3"); err != nil {
			t.Fatal(err)
		}
		h9 := rvHolder(t, p, db, lock, "9")
		before := snapshot(t, d, "acct")
		if err := rvBatch(t, h9, "UPDATE acct SET n = n + 1 WHERE id = 1", tail); err != nil {
			if sqlState(err) == "FP003" {
				t.Logf("%s: the proxy refuses it (%v): not this way", tail, err)
				continue
			}
			t.Fatalf("%s: the pipeline: %v", tail, err)
		}
		// The write and its registration were rolled back.
		wantUnchanged(t, d, "acct", before)
		if w := lockWatermark(t, d, lock); w != 7 {
			t.Fatalf("%s: lock %s's watermark %d after the rolled-back registration, want 7", tail, lock, w)
		}
		// No registration of 9 ever committed: the next write must read
		// the watermark first (hold_at), as for a session without memory.
		proc, err := sentProc(t, d, h9, "UPDATE acct SET payload = 'h9' WHERE id = 1")
		if err != nil {
			t.Fatalf("%s: the next write: %v", tail, err)
		}
		if proc != "hold_at" {
			t.Errorf("pipeline {UPDATE; %s}: rolled back (watermark still 7, nothing edited by hand), yet the session's next write went through %s: the relay remembers a registration of 9 that never committed", tail, proc)
		}
	}
}

// TestReviewReholdRolledBackMemoryDeadlock (a hole found in review, now
// mended as TestReviewReholdProcedureRollbackMemory says) is what the
// wrong memory of TestReviewReholdProcedureRollbackMemory cost, with nothing
// edited by hand: a deadlock error (40P01) that hold_at never produces.
// The new holder of 9 has two pooled sessions whose first writes went in
// a pipeline with a procedure that rolled back (watermark still 7, both
// remember 9). A third session of 9 opens a transaction and registers
// (it holds the lock exclusively); both sessions write meanwhile and wait
// for the shared lock in rehold_at; the third rolls back (an application
// error). PostgreSQL grants both shared requests at once, both read 7,
// both hand over to register, which wants the lock exclusively while the
// other holds it shared: one of them is killed with 40P01.
// TestReviewReholdControlNoDeadlockWithHoldAt runs the same without the
// memory: no error.
func TestReviewReholdRolledBackMemoryDeadlock(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, rvRollbackProc)
	h7 := rvHolder(t, p, db, "L", "7")
	if err := rvExec(t, h7, "UPDATE acct SET n = n + 1 WHERE id = 3"); err != nil {
		t.Fatal(err)
	}
	a := []*pgx.Conn{rvHolder(t, p, db, "L", "9"), rvHolder(t, p, db, "L", "9")}
	for i, c := range a {
		if err := rvBatch(t, c, fmt.Sprintf("UPDATE acct SET n = n + 1 WHERE id = %d", 2*i+1), "CALL rv_rollback()"); err != nil {
			t.Fatalf("session %d: the pipeline: %v", i, err)
		}
	}
	if w := lockWatermark(t, d, "L"); w != 7 {
		t.Fatalf("lock L's watermark %d, want 7", w)
	}
	rvTwoWaitersAfterRollback(t, d, rvHolder(t, p, db, "L", "9"), a, "rehold_at")
}

// TestReviewReholdControlNoDeadlockWithHoldAt: the scenario of
// TestReviewReholdRolledBackMemoryDeadlock with two sessions of 9
// that have no memory (hold_at): both read 7 before the lock and wait for
// it exclusively; they go one after the other, and both writes land.
func TestReviewReholdControlNoDeadlockWithHoldAt(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	h7 := rvHolder(t, p, db, "L", "7")
	if err := rvExec(t, h7, "UPDATE acct SET n = n + 1 WHERE id = 3"); err != nil {
		t.Fatal(err)
	}
	a := []*pgx.Conn{rvHolder(t, p, db, "L", "9"), rvHolder(t, p, db, "L", "9")}
	rvTwoWaitersAfterRollback(t, d, rvHolder(t, p, db, "L", "9"), a, "hold_at")
}

// rvTwoWaitersAfterRollback: third opens a transaction that registers 9
// (exclusively: the watermark is 7); both sessions of a write rows 1 and
// 3 and wait; third rolls back. Both writes must land (no 40P01), with
// fence 9, and the watermark must be 9. proc is what the waiting
// sessions are expected to have sent.
func rvTwoWaitersAfterRollback(t *testing.T, d, third *pgx.Conn, a []*pgx.Conn, proc string) {
	t.Helper()
	mustExec(t, third, "BEGIN")
	if err := rvExec(t, third, "UPDATE acct SET n = n + 1 WHERE id = 2"); err != nil {
		t.Fatal(err)
	}
	done := make([]chan error, len(a))
	for i, c := range a {
		done[i] = raGo(c, fmt.Sprintf("UPDATE acct SET payload = 'a%d' WHERE id = %d", i, 2*i+1))
		rvWaitLocked(t, d, c, done[i], fmt.Sprintf("session %d", i))
		if q := sentText(t, d, c); !strings.HasPrefix(q, "CALL fenceproxy."+proc+"(") {
			t.Logf("session %d waits in %s", i, q)
		}
	}
	mustExec(t, third, "ROLLBACK")
	for i := range a {
		if err := rvWait(t, done[i], fmt.Sprintf("session %d", i)); err != nil {
			t.Errorf("session %d of 9 (via %s): %v (SQLSTATE %s); nothing was edited by hand, and the same writes through hold_at both land", i, proc, err, sqlState(err))
		}
	}
	snap := snapshot(t, d, "acct")
	for i := range a {
		if r := snap[int64(2*i+1)]; r.Fence != 9 && r.Payload == fmt.Sprintf("a%d", i) {
			t.Errorf("row %d = %+v: written without the fence of 9", 2*i+1, r)
		}
	}
	if w := lockWatermark(t, d, "L"); w != 9 {
		t.Errorf("lock L's watermark %d, want 9", w)
	}
}

// TestReviewReholdMemoryTransactions: what each way of ending a
// transaction leaves in the memory, read as the procedure the session's
// next write is sent with, against the watermark. Holds: a failed COMMIT
// (deferred foreign key), ROLLBACK AND CHAIN, a rollback to a savepoint
// and a ROLLBACK in a pipeline leave no memory (hold_at next, watermark
// unchanged); COMMIT AND CHAIN and a pipeline that commits do
// (rehold_at, watermark the token).
func TestReviewReholdMemoryTransactions(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, rvDeferredFK)
	cases := []struct {
		name      string
		run       func(c *pgx.Conn) error
		committed bool
	}{
		{"failed COMMIT", func(c *pgx.Conn) error {
			for _, s := range []string{"BEGIN", "UPDATE acct SET n = n + 1 WHERE id = 1", "INSERT INTO rv_child VALUES (1)"} {
				if err := rvExec(t, c, s); err != nil {
					return err
				}
			}
			if err := rvExec(t, c, "COMMIT"); sqlState(err) != "23503" {
				return fmt.Errorf("COMMIT: %v, want 23503", err)
			}
			return nil
		}, false},
		{"ROLLBACK AND CHAIN", func(c *pgx.Conn) error {
			for _, s := range []string{"BEGIN", "UPDATE acct SET n = n + 1 WHERE id = 1", "ROLLBACK AND CHAIN", "COMMIT"} {
				if err := rvExec(t, c, s); err != nil {
					return err
				}
			}
			return nil
		}, false},
		{"rollback to a savepoint", func(c *pgx.Conn) error {
			for _, s := range []string{"BEGIN", "SAVEPOINT s", "UPDATE acct SET n = n + 1 WHERE id = 1", "ROLLBACK TO SAVEPOINT s", "COMMIT"} {
				if err := rvExec(t, c, s); err != nil {
					return err
				}
			}
			return nil
		}, false},
		{"ROLLBACK in a pipeline", func(c *pgx.Conn) error {
			return rvBatch(t, c, "UPDATE acct SET n = n + 1 WHERE id = 1", "ROLLBACK")
		}, false},
		{"ABORT in a pipeline", func(c *pgx.Conn) error {
			return rvBatch(t, c, "UPDATE acct SET n = n + 1 WHERE id = 1", "ABORT")
		}, false},
		{"error later in a pipeline", func(c *pgx.Conn) error {
			if err := rvBatch(t, c, "UPDATE acct SET n = n + 1 WHERE id = 1", "SELECT 1/0"); sqlState(err) != "22012" {
				return fmt.Errorf("pipeline: %v, want 22012", err)
			}
			return nil
		}, false},
		{"COMMIT AND CHAIN", func(c *pgx.Conn) error {
			for _, s := range []string{"BEGIN", "UPDATE acct SET n = n + 1 WHERE id = 1", "COMMIT AND CHAIN", "ROLLBACK"} {
				if err := rvExec(t, c, s); err != nil {
					return err
				}
			}
			return nil
		}, true},
		{"a pipeline that commits", func(c *pgx.Conn) error {
			return rvBatch(t, c, "UPDATE acct SET n = n + 1 WHERE id = 1", "SELECT 1")
		}, true},
		{"two Syncs, the second fails", func(c *pgx.Conn) error {
			if err := rvBatch(t, c, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
				return err
			}
			if err := rvBatch(t, c, "SELECT 1/0"); sqlState(err) != "22012" {
				return fmt.Errorf("second pipeline: %v, want 22012", err)
			}
			return nil
		}, true},
	}
	for i, tc := range cases {
		lock := fmt.Sprintf("M%d", i)
		c := rvHolder(t, p, db, lock, "5")
		if err := tc.run(c); err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		w := lockWatermark(t, d, lock)
		if tc.committed != (w == 5) {
			t.Errorf("%s: lock %s's watermark %d (committed %t)", tc.name, lock, w, tc.committed)
		}
		want := "hold_at"
		if tc.committed {
			want = "rehold_at"
		}
		if proc, err := sentProc(t, d, c, "UPDATE acct SET n = n + 1 WHERE id = 2"); err != nil || proc != want {
			t.Errorf("%s: the next write: %v, sent %s, want %s", tc.name, err, proc, want)
		}
		if w := lockWatermark(t, d, lock); w != 5 {
			t.Errorf("%s: lock %s's watermark %d after the next write, want 5", tc.name, lock, w)
		}
	}
}

// TestReviewReholdMovedWhileWaiting: a holder of 7 that remembers 7 writes
// while a newer holder's registration of 9 holds the lock exclusively in
// an open transaction. rehold_at waits for the shared lock; the newer
// one commits; the read after the lock sees 9: FP001 and nothing
// written. Then the same with the newer one rolling back: the write of 7
// lands (the watermark is 7 again, legitimately).
func TestReviewReholdMovedWhileWaiting(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	h7 := rvHolder(t, p, db, "L", "7")
	for range 2 {
		if err := rvExec(t, h7, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
	}
	for _, commit := range []bool{false, true} {
		tok := "8"
		if commit {
			tok = "9"
		}
		hn := rvHolder(t, p, db, "L", tok)
		mustExec(t, hn, "BEGIN")
		if err := rvExec(t, hn, "UPDATE jobs SET state = 'new "+tok+"' WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		before := snapshot(t, d, "acct")
		done := raGo(h7, "UPDATE acct SET payload = 'h7 late' WHERE id = 2")
		rvWaitLocked(t, d, h7, done, "the holder of 7")
		if q := sentText(t, d, h7); !strings.HasPrefix(q, "CALL fenceproxy.rehold_at(") {
			t.Errorf("the holder of 7 waits in %s, want rehold_at", q)
		}
		if commit {
			mustExec(t, hn, "COMMIT")
			if err := rvWait(t, done, "the holder of 7"); sqlState(err) != "FP001" {
				t.Errorf("the holder of 7 after 9 committed while it waited: %v, want FP001", err)
			}
			wantUnchanged(t, d, "acct", before)
			if w := lockWatermark(t, d, "L"); w != 9 {
				t.Errorf("lock L's watermark %d, want 9", w)
			}
			if got := testutil.QueryStrings(t, d, "SELECT state FROM jobs WHERE id = 1"); len(got) != 1 || got[0] != "new 9" {
				t.Errorf("jobs row 1 = %q, want the newer holder's", got)
			}
		} else {
			mustExec(t, hn, "ROLLBACK")
			if err := rvWait(t, done, "the holder of 7"); err != nil {
				t.Errorf("the holder of 7 after 8 rolled back: %v, want its write", err)
			}
			if r := snapshot(t, d, "acct")[2]; r.Payload != "h7 late" || r.Fence != 7 {
				t.Errorf("row 2 = %+v, want h7 late at fence 7", r)
			}
			if w := lockWatermark(t, d, "L"); w != 7 {
				t.Errorf("lock L's watermark %d, want 7", w)
			}
		}
	}
}

// TestReviewReholdOddValues: a lock name that needs quoting, zero-padded
// tokens and the largest tokens: rehold_at is sent once the registration
// committed, passes for the current holder, and refuses a stale one
// without changing a row.
func TestReviewReholdOddValues(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	cases := []struct{ lock, old, newer string }{
		{`L'x\y$fp$;--"`, "3", "4"},
		{"Z", "007", "0009"},
		{"Z2", "0000000000000000000000000005", "6"},
		{"B", "9223372036854775806", "9223372036854775807"},
		{"é Ünïcode ✓", "12", "000013"},
	}
	for _, tc := range cases {
		// Each case starts from rows no token has fenced yet (row
		// fencing is independent of the lock).
		execDirect(t, d, "UPDATE acct SET last_fence = 0")
		old := rvHolder(t, p, db, tc.lock, tc.old)
		for i, want := range []string{"hold_at", "rehold_at", "rehold_at"} {
			proc, err := sentProc(t, d, old, "UPDATE acct SET n = n + 1 WHERE id = 1")
			if err != nil || proc != want {
				t.Errorf("lock %q token %s, write %d: %v, sent %s, want %s", tc.lock, tc.old, i+1, err, sentText(t, d, old), want)
			}
		}
		oldCanon := strings.TrimLeft(tc.old, "0")
		if w := lockWatermark(t, d, tc.lock); fmt.Sprint(w) != oldCanon {
			t.Errorf("lock %q: watermark %d, want %s", tc.lock, w, oldCanon)
		}
		newer := rvHolder(t, p, db, tc.lock, tc.newer)
		if err := rvExec(t, newer, "UPDATE jobs SET state = 'n' WHERE id = 1"); err != nil {
			t.Fatalf("lock %q newer %s: %v", tc.lock, tc.newer, err)
		}
		before := snapshot(t, d, "acct")
		proc, err := sentProc(t, d, old, "UPDATE acct SET payload = 'stale' WHERE id = 2")
		if sqlState(err) != "FP001" || proc != "rehold_at" {
			t.Errorf("lock %q: stale %s after %s: %v (sent %s), want FP001 through rehold_at", tc.lock, tc.old, tc.newer, err, proc)
		}
		wantUnchanged(t, d, "acct", before)
		// And the newer one, once remembered, passes.
		for range 2 {
			if err := rvExec(t, newer, "UPDATE acct SET n = n + 1 WHERE id = 3"); err != nil {
				t.Errorf("lock %q newer %s: %v", tc.lock, tc.newer, err)
			}
		}
	}
}

// TestReviewReholdIsolation: under REPEATABLE READ and SERIALIZABLE
// rehold_at hands over to register: a holder that remembers 7 is refused
// (40001 while a newer holder's registration is open, FP001 once it
// committed), and no row changes.
func TestReviewReholdIsolation(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	for i, iso := range []string{"repeatable read", "serializable"} {
		lock := fmt.Sprintf("I%d", i)
		h7 := rvHolder(t, p, db, lock, "7")
		for range 2 {
			if err := rvExec(t, h7, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
				t.Fatal(err)
			}
		}
		mustExec(t, h7, "SET default_transaction_isolation = '"+iso+"'")
		if proc, err := sentProc(t, d, h7, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil || proc != "rehold_at" {
			t.Errorf("%s: %v, sent %s, want rehold_at", iso, err, proc)
		}
		h9 := rvHolder(t, p, db, lock, "9")
		mustExec(t, h9, "BEGIN")
		if err := rvExec(t, h9, "UPDATE jobs SET state = 'h9' WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		before := snapshot(t, d, "acct")
		done := raGo(h7, "UPDATE acct SET payload = 'stale' WHERE id = 1")
		var err error
		select {
		case err = <-done:
		case <-time.After(3 * time.Second):
			mustExec(t, h9, "COMMIT")
			err = rvWait(t, done, iso)
		}
		if s := sqlState(err); s != "40001" && s != "FP001" {
			t.Errorf("%s: the holder of 7 while 9 registers: %v, want 40001 or FP001", iso, err)
		}
		if _, e := h9.Exec(ctxT(t), "COMMIT"); e != nil {
			t.Fatal(e)
		}
		if _, err := sentProc(t, d, h7, "UPDATE acct SET payload = 'stale' WHERE id = 1"); sqlState(err) != "FP001" {
			t.Errorf("%s: the holder of 7 after 9 committed: %v, want FP001", iso, err)
		}
		wantUnchanged(t, d, "acct", before)
	}
}

// TestReviewReholdSeveralProxies: the memory is per session; another
// proxy's newer holder is seen by rehold_at through the watermark.
func TestReviewReholdSeveralProxies(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol1, specs := raPolicy(t, lockRules)
	pol2, _ := raPolicy(t, lockRules)
	p1, p2 := startProxy(t, pol1), startProxy(t, pol2)
	db, d := preludeDB(t, specs, "")
	h7 := rvHolder(t, p1, db, "L", "7")
	for range 2 {
		if err := rvExec(t, h7, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
	}
	h9 := rvHolder(t, p2, db, "L", "9")
	if err := rvExec(t, h9, "UPDATE acct SET payload = 'h9' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, d, "acct")
	if proc, err := sentProc(t, d, h7, "UPDATE acct SET payload = 'stale' WHERE id = 1"); sqlState(err) != "FP001" || proc != "rehold_at" {
		t.Errorf("the holder of 7 on proxy 1 after 9 on proxy 2: %v (sent %s), want FP001 through rehold_at", err, proc)
	}
	wantUnchanged(t, d, "acct", before)
}

// TestReviewReholdGuardInstalled: a database guard installed while
// sessions remember their registration: once the proxy knows, it sends
// neither hold_at nor rehold_at (the settings go first, for the guard's
// triggers), and a stale holder is still refused with nothing changed.
func TestReviewReholdGuardInstalled(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := preludeDB(t, specs, "")
	h7 := rvHolder(t, p, db, "L", "7")
	for i, want := range []string{"hold_at", "rehold_at"} {
		if proc, err := sentProc(t, d, h7, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil || proc != want {
			t.Fatalf("write %d: %v, sent %s, want %s", i+1, err, proc, want)
		}
	}
	if _, err := dbsetup.Setup(ctxT(t), d, specs, dbsetup.SetupOptions{Guard: true, Tables: lockRules.Tables}); err != nil {
		t.Fatal(err)
	}
	// The first write after the install may still go through rehold_at
	// with the old stamp: its check refuses it (FP003, retried by rvExec)
	// or, once the proxy knows, the settings go first.
	waitUntil(t, "the proxy sees the guard", func() bool {
		proc, err := sentProc(t, d, h7, "UPDATE acct SET n = n + 1 WHERE id = 1")
		if err != nil && sqlState(err) != "FP003" {
			t.Fatalf("a write after the guard's install: %v (sent %s)", err, proc)
		}
		return err == nil && proc == ""
	})
	for range 3 {
		if proc, err := sentProc(t, d, h7, "UPDATE acct SET n = n + 1 WHERE id = 1"); err != nil || proc != "" {
			t.Errorf("guarded: %v, sent %s, want neither hold_at nor rehold_at", err, sentText(t, d, h7))
		}
	}
	h9 := rvHolder(t, p, db, "L", "9")
	if err := rvExec(t, h9, "UPDATE acct SET payload = 'h9' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, d, "acct")
	if err := rvExec(t, h7, "UPDATE acct SET payload = 'stale' WHERE id = 3"); sqlState(err) != "FP001" {
		t.Errorf("the holder of 7 after 9, guarded: %v, want FP001", err)
	}
	wantUnchanged(t, d, "acct", before)
}

// TestReviewReholdBehindPooler: behind PgBouncer in transaction mode with
// one server connection, clients of different tokens share it, each
// remembering its own registration; the connection carries other
// clients' values (pollute). rehold_at takes the values from the call:
// the current holder's writes land with its fence, the older one's are
// refused and change nothing; rehold_at ran on the server.
func TestReviewReholdBehindPooler(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, lockRules)
	pe := startPoolerEnvSized(t, pol, 1)
	db, d := preludeDB(t, specs, "")
	poolerReset(t, d) // lock L at 42
	execDirect(t, d, "ALTER DATABASE "+db+" SET track_functions = 'pl'")

	client := func(tok string) *pgx.Conn {
		c := pe.session(t, db, pgx.QueryExecModeSimpleProtocol)
		mustSend(t, c, "SET fence.token = '"+tok+"'")
		mustSend(t, c, "SET fence.lock = 'L'")
		return c
	}
	s43, s44 := client("43"), client("44")
	for i := range 2 {
		if err := send(t, s43, fmt.Sprintf("UPDATE acct SET payload = 'w43 %d' WHERE id = 2", i)); err != nil {
			t.Fatal(err)
		}
	}
	pe.pollute(t, db, "99", "L")
	for i := range 2 {
		if err := send(t, s44, fmt.Sprintf("UPDATE acct SET payload = 'w44 %d' WHERE id = 3", i)); err != nil {
			t.Fatal(err)
		}
	}
	if w := lockWatermark(t, d, "L"); w != 44 {
		t.Errorf("lock L's watermark %d, want 44", w)
	}
	pe.pollute(t, db, "45", "L")
	before := snapshot(t, d, "acct")
	if err := send(t, s43, "UPDATE acct SET payload = 'stale' WHERE id = 2"); sqlState(err) != "FP001" {
		t.Errorf("the holder of 43 after 44, on a connection carrying 45: %v, want FP001", err)
	}
	wantUnchanged(t, d, "acct", before)
	if err := send(t, s44, "UPDATE acct SET payload = 'w44 again' WHERE id = 3"); err != nil {
		t.Fatal(err)
	}
	if r := snapshot(t, d, "acct")[3]; r.Payload != "w44 again" || r.Fence != 44 {
		t.Errorf("row 3 = %+v, want w44 again at fence 44", r)
	}
	if w := lockWatermark(t, d, "L"); w != 44 {
		t.Errorf("lock L's watermark %d, want 44 (never a connection's 45 or 99)", w)
	}
	waitPooledCall(t, pe, d, db, "rehold_at")
}

// TestReviewReholdConcurrentHolders: three generations of holders, each
// with a pool of sessions writing in loops (after each session's first
// commit through rehold_at), the next generation starting while the
// previous one writes. No deadlock or other error but FP001, and no
// write of an older generation lands once a write of a newer one has
// committed.
func TestReviewReholdConcurrentHolders(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, _ := preludeSession(t, lockRules, "")
	const sessions = 4
	toks := []int{7, 9, 10}
	var committed [3]atomic.Bool // a write of generation g committed
	var stop atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	var landed, refused atomic.Int64
	start := func(g int) {
		for i := range sessions {
			c := rvHolder(t, p, db, "L", fmt.Sprint(toks[g]))
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k := 0; !stop.Load(); k++ {
					newer := false
					for n := g + 1; n < len(toks); n++ {
						newer = newer || committed[n].Load()
					}
					ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
					_, err := c.PgConn().Exec(ctx, fmt.Sprintf("UPDATE acct SET payload = 'g%d s%d k%d', n = n + 1 WHERE id = %d", toks[g], i, k, (i+k)%3+1)).ReadAll()
					cancel()
					switch {
					case err == nil && newer:
						errs <- fmt.Errorf("token %d session %d: a write landed after a newer holder's committed", toks[g], i)
						return
					case err == nil:
						committed[g].Store(true)
						landed.Add(1)
					case sqlState(err) == "FP001" || sqlState(err) == "FP003":
						refused.Add(1)
					default:
						errs <- fmt.Errorf("token %d session %d: %v (SQLSTATE %s)", toks[g], i, err, sqlState(err))
						return
					}
				}
			}()
		}
	}
	start(0)
	time.Sleep(300 * time.Millisecond)
	start(1)
	time.Sleep(600 * time.Millisecond)
	start(2)
	time.Sleep(600 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d writes landed, %d refused", landed.Load(), refused.Load())
	if w := lockWatermark(t, d, "L"); w != 10 {
		t.Errorf("lock L's watermark %d, want 10", w)
	}
	for id, r := range snapshot(t, d, "acct") {
		if r.Fence == 10 && !strings.HasPrefix(r.Payload, "g10") {
			t.Errorf("row %d = %+v: fenced by 10, last written by an older holder", id, r)
		}
	}
}

// TestReviewReholdFailoverBehindPooler: the memory is wrong, with no
// watermark edited by hand, after a failover behind PgBouncer. The
// proxy's client sessions go to PgBouncer, whose client connections
// outlive its server connections: when the primary is replaced by an
// asynchronous replica that had not yet received the last commits (here:
// the registration of 9), the clients stay connected and keep their
// memory of 9, while the watermark they now reach is 7. The failover is
// played by renaming databases (the pooler connects by name): the
// "primary" is renamed away and the "replica", holding lock L at 7,
// takes its name. Then the deadlock of
// TestReviewReholdRolledBackMemoryDeadlock follows: a third session
// of 9 registers in an open transaction and rolls back while the two
// remembering sessions wait in rehold_at; one is killed with 40P01. With
// hold_at (sessions without memory) the same writes all land.
//
// Mended after the review: rehold_at, finding the watermark below the
// token, goes on to register only where no other session holds the lock
// (a try); else it refuses the statement with FP003, the relay forgets
// the memory, and the retry goes through hold_at. Here both sessions
// hold the lock shared when they find 7: both are refused once, and
// their retries (as FP003 asks) land, without a deadlock.
func TestReviewReholdFailoverBehindPooler(t *testing.T) {
	rvFailover(t, true)
}

// TestReviewReholdControlFailoverHoldAt: the failover of
// TestReviewReholdFailoverBehindPooler with the two writing sessions
// connected after it (no memory: hold_at): both writes land.
func TestReviewReholdControlFailoverHoldAt(t *testing.T) {
	rvFailover(t, false)
}

// rvFailover plays the failover; remember: the two writing sessions
// registered 9 on the old primary (else they connect after it).
func rvFailover(t *testing.T, remember bool) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	ctx := ctxT(t)
	checker, specs := startChecker(t, lockRules)
	rs, err := rules.Compile(lockRules)
	if err != nil {
		t.Fatal(err)
	}
	var pol *policy.Policy
	aud := audit.New(audit.Options{
		ConnConfig: func(db string) (*pgconn.Config, error) { return pgconn.ParseConfig(cluster.SuperuserDSN(db)) },
		CatalogChanged: func(db string) {
			checker.CatalogChanged(db)
			pol.CatalogChanged(db)
		},
	})
	t.Cleanup(aud.Close)
	pol = policy.New(rs, false, policy.Options{Checks: checker, Auditor: aud})
	pe := startPoolerEnvSized(t, pol, 4)
	db, d := preludeDB(t, specs, "")
	replica, dr := preludeDB(t, specs, "")
	// Lock L at 7 on both (the replica has the primary's state up to the
	// registration of 9).
	execDirect(t, d, "INSERT INTO fenceproxy.locks (name, token) VALUES ('L', 7)")
	execDirect(t, dr, "INSERT INTO fenceproxy.locks (name, token) VALUES ('L', 7)")
	if err := dr.Close(ctx); err != nil {
		t.Fatal(err)
	}

	client := func(tok, lk string) *pgx.Conn {
		c := pe.session(t, db, pgx.QueryExecModeSimpleProtocol)
		mustSend(t, c, "SET fence.token = '"+tok+"'")
		if lk != "" {
			mustSend(t, c, "SET fence.lock = '"+lk+"'")
		}
		return c
	}
	s := []*pgx.Conn{client("9", "L"), client("9", "L")}
	if !remember {
		s = []*pgx.Conn{client("9", "L")}
	}
	for i, c := range s {
		for k := range 2 {
			if err := rvExec(t, c, fmt.Sprintf("UPDATE acct SET payload = 's%d k%d', n = n + 1 WHERE id = %d", i, k, 2*i+1)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if w := lockWatermark(t, d, "L"); w != 9 {
		t.Fatalf("lock L's watermark %d on the primary, want 9", w)
	}
	if err := d.Close(ctx); err != nil {
		t.Fatal(err)
	}

	// The failover.
	admin := direct(t, "postgres")
	for _, q := range []string{
		`ALTER DATABASE "` + db + `" ALLOW_CONNECTIONS false`,
		`ALTER DATABASE "` + replica + `" ALLOW_CONNECTIONS false`,
	} {
		mustExec(t, admin, q)
	}
	rename := func(from, to string) {
		t.Helper()
		var err error
		for range 100 {
			mustExec(t, admin, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname IN ('`+db+`', '`+replica+`', '`+db+`_old') AND pid <> pg_backend_pid()`)
			if _, err = admin.Exec(ctx, `ALTER DATABASE "`+from+`" RENAME TO "`+to+`"`); err == nil {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatalf("rename %s to %s: %v", from, to, err)
	}
	rename(db, db+"_old")
	rename(replica, db)
	mustExec(t, admin, `ALTER DATABASE "`+db+`" ALLOW_CONNECTIONS true`)
	d = direct(t, db)
	if w := lockWatermark(t, d, "L"); w != 7 {
		t.Fatalf("lock L's watermark %d on the promoted replica, want 7", w)
	}

	// The proxy checks the new server (as the catalog watch's
	// notification or the minute's check would make it), and another
	// client's writes (lock W) go through hold_at again.
	checker.CatalogChanged(db)
	pol.CatalogChanged(db)
	warm := client("1", "W")
	waitUntil(t, "writes through hold_at after the failover", func() bool {
		err := send(t, warm, "UPDATE jobs SET state = 'w' WHERE id = 1")
		if err != nil && sqlState(err) != "FP003" {
			t.Logf("warm-up: %v", err)
		}
		if err != nil {
			checker.CatalogChanged(db)
			pol.CatalogChanged(db)
			return false
		}
		n := testutil.QueryStrings(t, d, `SELECT count(*)::text FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'CALL fenceproxy.%hold_at(%''W''%'`)
		return len(n) == 1 && n[0] != "0"
	})

	if !remember {
		s = []*pgx.Conn{client("9", "L"), client("9", "L")}
	}
	third := client("9", "L")
	mustSend(t, third, "BEGIN")
	if err := send(t, third, "UPDATE acct SET n = n + 1 WHERE id = 2"); err != nil {
		t.Fatal(err)
	}
	done := make([]chan error, len(s))
	for i, c := range s {
		done[i] = raGo(c, fmt.Sprintf("UPDATE acct SET payload = 'after %d' WHERE id = %d", i, 2*i+1))
	}
	var waiting []string
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		waiting = testutil.QueryStrings(t, d, `SELECT left(query, 40) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE 'CALL fenceproxy.%'`)
		if len(waiting) == 2 || len(done[0]) > 0 || len(done[1]) > 0 {
			break
		}
	}
	t.Logf("waiting for the lock: %q", waiting)
	mustSend(t, third, "ROLLBACK")
	for i, c := range s {
		err := rvWait(t, done[i], fmt.Sprintf("session %d", i))
		if remember && sqlState(err) == "FP003" {
			// rehold_at's refusal for a retry: the retry reads the
			// watermark first (hold_at).
			stmt := fmt.Sprintf("UPDATE acct SET payload = 'after %d' WHERE id = %d", i, 2*i+1)
			err = send(t, c, stmt)
		}
		if err != nil {
			t.Errorf("session %d of 9 after the failover: %v (SQLSTATE %s); nothing was edited by hand, and hold_at lets both writes land", i, err, sqlState(err))
		}
	}
	if w := lockWatermark(t, d, "L"); w != 9 {
		t.Errorf("lock L's watermark %d, want 9", w)
	}
}
