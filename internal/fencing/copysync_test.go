package fencing_test

// A Sync the server ignores during a COPY FROM STDIN (it reads only copy
// messages then) gets no ReadyForQuery. A copy a Query starts while a
// Sync was sent after that Query makes the session give up its
// bookkeeping, so that a later SET of a stale token cannot be missed; a
// Sync after a Query already answered, or an Execute's copy, does not.
// Each case checks the rows (or jobs and the lock's watermark).

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"
)

// csUntil sends msgs and reads until n messages of the wanted kind arrived.
func (a *atkRaw) csUntil(want string, n int, msgs ...pgproto3.FrontendMessage) (errs []pgproto3.ErrorResponse, seen []string) {
	a.t.Helper()
	for _, m := range msgs {
		a.fe.Send(m)
	}
	if err := a.fe.Flush(); err != nil {
		a.t.Fatal(err)
	}
	for n > 0 {
		m, err := a.fe.Receive()
		if err != nil {
			a.t.Fatal(err)
		}
		k := ""
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			errs = append(errs, *m)
			k = "E"
		case *pgproto3.CopyInResponse:
			k = "G"
		case *pgproto3.CommandComplete:
			k = "C:" + string(m.CommandTag)
		case *pgproto3.ReadyForQuery:
			k = "Z"
		default:
			k = "?"
		}
		seen = append(seen, k)
		if k == want {
			n--
		}
	}
	return errs, seen
}

func csData() *pgproto3.CopyData { return &pgproto3.CopyData{Data: []byte("x\n")} }

// A: two COPYs in one Query; Sync sent after the first CopyDone (so
// copyEndSent hides it), ignored by the second COPY.
func TestCopySyncTwoCopiesInteractive(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	a.q("CREATE TEMP TABLE src (v text)")
	_, seen := a.csUntil("G", 2, &pgproto3.Query{String: "COPY src FROM STDIN; COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{})
	t.Logf("phase1 %v", seen)
	errs, seen := a.csUntil("Z", 1, csData(), &pgproto3.CopyDone{})
	t.Logf("phase2 %v %s", seen, atkErrs(errs))
	errs, _, _ = a.tpPipe(2, &pgproto3.Query{String: "SET fence.token = '50'"}, &pgproto3.Sync{})
	t.Logf("SET: %s", atkErrs(errs))
	errs, tags := a.rt(&pgproto3.Query{String: "UPDATE acct SET n = n + 1 WHERE id = 1"})
	t.Logf("UPDATE: %s %v", atkErrs(errs), tags)
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
}

// A2: same, fully pipelined, SET via the extended protocol (no Query
// after the Sync to set the flag).
func TestCopySyncTwoCopiesPipelinedExt(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	a.q("CREATE TEMP TABLE src (v text)")
	errs, tags, _ := a.tpPipe(2, &pgproto3.Query{String: "COPY src FROM STDIN; COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{}, csData(), &pgproto3.CopyDone{},
		&pgproto3.Parse{Query: "SET fence.token = '50'"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{})
	t.Logf("pipe: %s %v", atkErrs(errs), tags)
	errs, tags = a.rt(&pgproto3.Query{String: "UPDATE acct SET n = n + 1 WHERE id = 1"})
	t.Logf("UPDATE: %s %v", atkErrs(errs), tags)
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
}

// A3: two COPYs, pipelined, SET by Query (the flag should catch it).
func TestCopySyncTwoCopiesPipelinedQuery(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	a.q("CREATE TEMP TABLE src (v text)")
	errs, tags, _ := a.tpPipe(3, &pgproto3.Query{String: "COPY src FROM STDIN; COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{}, csData(), &pgproto3.CopyDone{},
		&pgproto3.Query{String: "SET fence.token = '50'"}, &pgproto3.Sync{})
	t.Logf("pipe: %s %v", atkErrs(errs), tags)
	errs, tags = a.rt(&pgproto3.Query{String: "UPDATE acct SET n = n + 1 WHERE id = 1"})
	t.Logf("UPDATE: %s %v", atkErrs(errs), tags)
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
}

// A4: lock holder at 11 -> SET 10 after the two-COPY interactive sequence.
func TestCopySyncTwoCopiesLock(t *testing.T) {
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	ld := direct(t, db)
	nw := e.holder(t, db, "tenant/7", 11, pgx.QueryExecModeSimpleProtocol)
	mustExec(t, nw, "UPDATE jobs SET state = 'by11' WHERE id = 1")
	mustExec(t, nw, "CREATE TEMP TABLE src (v text)")
	b := atkHijack(t, nw)
	_, seen := b.csUntil("G", 2, &pgproto3.Query{String: "COPY src FROM STDIN; COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{})
	t.Logf("phase1 %v", seen)
	errs, seen := b.csUntil("Z", 1, csData(), &pgproto3.CopyDone{})
	t.Logf("phase2 %v %s", seen, atkErrs(errs))
	errs, _, _ = b.tpPipe(2, &pgproto3.Query{String: "SET fence.token = '10'"}, &pgproto3.Sync{})
	t.Logf("SET: %s", atkErrs(errs))
	errs, tags := b.rt(&pgproto3.Query{String: "UPDATE jobs SET state = 'by10' WHERE id = 1"})
	t.Logf("UPDATE: %s %v", atkErrs(errs), tags)
	var state string
	if err := ld.QueryRow(ctxT(t), "SELECT state FROM jobs WHERE id = 1").Scan(&state); err != nil || state != "by11" {
		t.Errorf("jobs row 1: %q %v; want by11", state, err)
	}
}

// B: copy started by an Execute after a Query.
func TestCopySyncExecCopyAfterQuery(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	a.q("CREATE TEMP TABLE src (v text)")
	errs, tags, _ := a.tpPipe(3, &pgproto3.Query{String: "SELECT 1"}, &pgproto3.Parse{Query: "COPY src FROM STDIN"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}, csData(), &pgproto3.CopyDone{},
		&pgproto3.Query{String: "SET fence.token = '50'"}, &pgproto3.Sync{})
	t.Logf("pipe: %s %v", atkErrs(errs), tags)
	errs, tags = a.rt(&pgproto3.Query{String: "UPDATE acct SET n = n + 1 WHERE id = 1"})
	t.Logf("UPDATE: %s %v", atkErrs(errs), tags)
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
}

// C: two COPYs inside a transaction block, interactive.
func TestCopySyncTwoCopiesTx(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	a.q("CREATE TEMP TABLE src (v text)")
	_, seen := a.csUntil("G", 2, &pgproto3.Query{String: "BEGIN; COPY src FROM STDIN; COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{})
	t.Logf("phase1 %v", seen)
	errs, seen := a.csUntil("Z", 1, csData(), &pgproto3.CopyDone{})
	t.Logf("phase2 %v %s", seen, atkErrs(errs))
	errs, _, _ = a.tpPipe(2, &pgproto3.Query{String: "SET fence.token = '50'"}, &pgproto3.Sync{})
	t.Logf("SET: %s", atkErrs(errs))
	errs, tags := a.rt(&pgproto3.Query{String: "UPDATE acct SET n = n + 1 WHERE id = 1"})
	t.Logf("UPDATE: %s %v", atkErrs(errs), tags)
	errs, tags = a.rt(&pgproto3.Query{String: "COMMIT"})
	t.Logf("COMMIT: %s %v", atkErrs(errs), tags)
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
}

// FP1: false positive? Query, Sync, then a Query COPY pipelined; the Sync is
// not ignored. Afterwards a valid fenced UPDATE at token 60.
func TestCopySyncFalsePositiveQuerySyncCopy(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	a.q("CREATE TEMP TABLE src (v text)")
	errs, tags, _ := a.tpPipe(3, &pgproto3.Query{String: "SELECT 1"}, &pgproto3.Sync{}, &pgproto3.Query{String: "COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{})
	t.Logf("pipe: %s %v", atkErrs(errs), tags)
	errs, tags = a.rt(&pgproto3.Query{String: "UPDATE acct SET n = n + 1 WHERE id = 1"})
	if len(errs) > 0 {
		t.Errorf("FALSE POSITIVE: valid UPDATE at 60 refused: %s %v", atkErrs(errs), tags)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {0, 55}, 3: {0, 55}})
}

// FP2: simple Query then Sync, waited for; then a COPY later.
func TestCopySyncFalsePositiveQuerySyncWaited(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	a.q("CREATE TEMP TABLE src (v text)")
	errs, tags, _ := a.tpPipe(2, &pgproto3.Query{String: "SELECT 1"}, &pgproto3.Sync{})
	t.Logf("pipe: %s %v", atkErrs(errs), tags)
	errs, tags, _ = a.tpPipe(1, &pgproto3.Query{String: "COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{})
	t.Logf("copy: %s %v", atkErrs(errs), tags)
	errs, tags = a.rt(&pgproto3.Query{String: "UPDATE acct SET n = n + 1 WHERE id = 1"})
	if len(errs) > 0 {
		t.Errorf("FALSE POSITIVE: %s %v", atkErrs(errs), tags)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {0, 55}, 3: {0, 55}})
}

// FP3: Query+Sync then an extended COPY pipelined.
func TestCopySyncFalsePositiveQuerySyncExtCopy(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	a.q("CREATE TEMP TABLE src (v text)")
	_, seen := a.csUntil("G", 1, &pgproto3.Query{String: "SELECT 1"}, &pgproto3.Sync{}, &pgproto3.Parse{Query: "COPY src FROM STDIN"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{})
	t.Logf("seen %v", seen)
	errs, seen := a.csUntil("Z", 1, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{})
	t.Logf("copy: %s %v", atkErrs(errs), seen)
	errs, tags := a.rt(&pgproto3.Query{String: "UPDATE acct SET n = n + 1 WHERE id = 1"})
	if len(errs) > 0 {
		t.Errorf("FALSE POSITIVE: %s %v", atkErrs(errs), tags)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {0, 55}, 3: {0, 55}})
}
