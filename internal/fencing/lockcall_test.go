package fencing_test

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// callSchema: procedures created on a direct connection. bump writes the
// lock-fenced acct; bump_commit does too and commits in between; tick
// writes only the unprotected plain and commits.
const callSchema = `
CREATE TABLE plain (id bigint PRIMARY KEY, n int NOT NULL DEFAULT 0);
CREATE PROCEDURE bump(i bigint) LANGUAGE sql AS $$UPDATE acct SET n = n + 1 WHERE id = i$$;
CREATE PROCEDURE bump_commit(i bigint) LANGUAGE plpgsql AS $$
BEGIN
	UPDATE acct SET n = n + 1 WHERE id = i;
	COMMIT;
	UPDATE acct SET n = n + 1 WHERE id = i;
END$$;
CREATE PROCEDURE tick() LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO plain (id, n) VALUES (100, 0) ON CONFLICT (id) DO UPDATE SET n = plain.n + 1;
	COMMIT;
END$$;`

// TestLockCallOfProcedure: a CALL of a procedure whose body writes a
// lock-fenced table registers the session's lock as any statement that
// reads or writes it does (the database's readers list the procedure), in
// the simple and the extended protocol, pipelined too. A stale holder's
// CALL fails with FP001 and changes nothing; a newer holder whose first
// touch is a CALL moves the watermark, so the older holder's next write
// is refused. A procedure that commits cannot keep its registration for
// what it writes after the COMMIT: it fails and writes nothing (in a
// simple Query and in a transaction block the server refuses its COMMIT;
// in the extended protocol outside one the proxy refuses it). A CALL of
// a procedure that reaches no protected table registers nothing and may
// commit as it would directly.
func TestLockCallOfProcedure(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, callSchema)
	oldQ := runPid(t, readerSession(t, p, db, "L", "50", pgx.QueryExecModeSimpleProtocol))
	oldB := runPid(t, readerSession(t, p, db, "L", "50", pgx.QueryExecModeCacheStatement))

	// The holder of 50 registers by its first CALL.
	if err := rvExec(t, oldQ, "CALL bump(3)"); err != nil {
		t.Fatalf("CALL bump(3) of the current holder: %v", err)
	}
	if w := lockWatermark(t, d, "L"); w != 50 {
		t.Fatalf("watermark after the first CALL: %d, want 50", w)
	}
	if _, err := oldB.Exec(ctxT(t), "CALL bump($1)", 3); err != nil {
		t.Fatalf("CALL bump($1) of the current holder: %v", err)
	}
	if r := snapshot(t, d, "acct")[3]; r.N != 2 {
		t.Fatalf("row 3 after two CALLs: %+v", r)
	}

	// The newer holder's first touch is a CALL: it registers 51.
	newer := runPid(t, readerSession(t, p, db, "L", "51", pgx.QueryExecModeCacheStatement))
	if _, err := newer.Exec(ctxT(t), "CALL bump($1)", 2); err != nil {
		t.Fatal(err)
	}
	if w := lockWatermark(t, d, "L"); w != 51 {
		t.Fatalf("watermark after the newer holder's CALL: %d, want 51", w)
	}

	before := snapshot(t, d, "acct")
	if err := rvExec(t, oldQ, "UPDATE acct SET n = n + 1 WHERE id = 1"); sqlState(err) != "FP001" {
		t.Errorf("stale UPDATE after the newer holder's CALL: %v, want FP001", err)
	}
	for _, sql := range []string{"CALL bump(1)", "CALL public.bump(1)", "call BUMP(1); SELECT 1"} {
		if err := rvExec(t, oldQ, sql); sqlState(err) != "FP001" {
			t.Errorf("stale %q: %v, want FP001", sql, err)
		}
	}
	if _, err := oldB.Exec(ctxT(t), "CALL bump($1)", 1); sqlState(err) != "FP001" {
		t.Errorf("stale CALL bump($1): %v, want FP001", err)
	}
	if _, err := oldB.Prepare(ctxT(t), "b", "CALL bump($1)"); err != nil {
		t.Fatal(err)
	}
	errs := raPipeline(t, oldB, 1,
		&pgproto3.Bind{PreparedStatement: "b", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{},
		&pgproto3.Bind{PreparedStatement: "b", Parameters: [][]byte{[]byte("2")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) == 0 {
		t.Error("stale pipeline of two CALLs ran")
	}
	for _, e := range errs {
		if !strings.HasPrefix(e, "FP001:") {
			t.Errorf("stale pipeline of two CALLs: %v, want FP001", e)
		}
	}
	wantUnchanged(t, d, "acct", before)

	// The current holder's procedure that commits, in a simple Query:
	// the registration in front makes the Query one implicit transaction
	// block, where the server refuses the procedure's COMMIT (2D000):
	// nothing is written.
	newerQ := runPid(t, readerSession(t, p, db, "L", "51", pgx.QueryExecModeSimpleProtocol))
	if err := rvExec(t, newerQ, "CALL bump_commit(1)"); sqlState(err) != "2D000" {
		t.Errorf("CALL bump_commit(1): %v, want 2D000 (its COMMIT would end the registration's transaction)", err)
	}
	wantUnchanged(t, d, "acct", before)
	// In the extended protocol outside a transaction block the server
	// would let it commit: the proxy refuses the Bind (FP003), also for a
	// DO block that commits; a procedure whose code cannot commit runs.
	if _, err := newer.Exec(ctxT(t), "CALL bump_commit($1)", 1); sqlState(err) != "FP003" || !strings.Contains(err.Error(), "may commit") {
		t.Errorf("CALL bump_commit($1) outside a transaction block: %v, want FP003", err)
	}
	if _, err := newer.Exec(ctxT(t), "DO $$BEGIN UPDATE acct SET n = n + 1 WHERE id = 1; COMMIT; END$$"); sqlState(err) != "FP003" {
		t.Errorf("a DO block that commits, outside a transaction block: %v, want FP003", err)
	}
	wantUnchanged(t, d, "acct", before)
	// Inside one (BEGIN answered before, or sent in the same pipeline, as
	// JDBC does) the proxy lets it go and the server refuses its COMMIT.
	tx, err := newer.Begin(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctxT(t), "CALL bump_commit($1)", 1); sqlState(err) != "2D000" {
		t.Errorf("CALL bump_commit($1) in a transaction block: %v, want 2D000", err)
	}
	_ = tx.Rollback(ctxT(t))
	rbPrepare(t, newer, "bc", "CALL bump_commit($1)")
	rbPrepare(t, newer, "begin", "BEGIN")
	rbPrepare(t, newer, "commit", "COMMIT")
	errs = raPipeline(t, newer, 1,
		&pgproto3.Bind{PreparedStatement: "begin"}, &pgproto3.Execute{},
		&pgproto3.Bind{PreparedStatement: "bc", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{},
		&pgproto3.Bind{PreparedStatement: "commit"}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 || !strings.HasPrefix(errs[0], "2D000") {
		t.Errorf("BEGIN, CALL bump_commit, COMMIT in one pipeline: %v, want one 2D000", errs)
	}
	if err := rvExec(t, newer, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	// After a COMMIT in the same segment the block is over: refused.
	errs = raPipeline(t, newer, 1,
		&pgproto3.Bind{PreparedStatement: "begin"}, &pgproto3.Execute{},
		&pgproto3.Bind{PreparedStatement: "commit"}, &pgproto3.Execute{},
		&pgproto3.Bind{PreparedStatement: "bc", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 || !strings.HasPrefix(errs[0], "FP003") {
		t.Errorf("BEGIN, COMMIT, CALL bump_commit in one pipeline: %v, want one FP003", errs)
	}
	wantUnchanged(t, d, "acct", before)
	if _, err := newer.Exec(ctxT(t), "CALL bump($1)", 3); err != nil {
		t.Errorf("CALL bump($1) outside a transaction block: %v", err)
	}
	before = snapshot(t, d, "acct")
	if before[3].N != 3 || before[3].Fence != 0 {
		t.Errorf("row 3 after the newer holder's CALL: %+v", before[3])
	}

	// A procedure that reaches no protected table commits as it would
	// directly, and registers nothing.
	for _, c := range []*pgx.Conn{oldQ, newerQ} {
		if err := rvExec(t, c, "CALL tick()"); err != nil {
			t.Errorf("CALL tick(): %v", err)
		}
	}
	if got := testutil.QueryStrings(t, d, "SELECT n::text FROM plain WHERE id = 100"); len(got) != 1 || got[0] != "1" {
		t.Errorf("plain row 100 after two ticks: %v, want [1]", got)
	}
	if w := lockWatermark(t, d, "L"); w != 51 {
		t.Errorf("watermark %d, want 51", w)
	}
}

// bumpFSchema: a function that writes the lock-fenced acct.
const bumpFSchema = `CREATE FUNCTION bump_f(i bigint) RETURNS int LANGUAGE sql AS $$UPDATE acct SET n = n + 1 WHERE id = i RETURNING n$$;`

// TestLockFunctionCallMessage: the protocol's FunctionCall message runs
// a function by OID, with no statement a lock registration could go
// before. In a session that names a lock, a user's function is refused
// (FP003) and writes nothing, even one that would register as SELECT
// f(), and so is one of PostgreSQL's that runs SQL text (query_to_xml);
// the large-object functions still run, and in a session that names no
// lock a user's function runs as it would directly.
func TestLockFunctionCallMessage(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, bumpFSchema)
	var bumpF, toXML, loCreat, loUnlink uint32
	if err := d.QueryRow(ctxT(t), `SELECT 'bump_f(bigint)'::regprocedure::oid, 'query_to_xml(text, boolean, boolean, text)'::regprocedure::oid,
		'lo_creat(integer)'::regprocedure::oid, 'lo_unlink(oid)'::regprocedure::oid`).Scan(&bumpF, &toXML, &loCreat, &loUnlink); err != nil {
		t.Fatal(err)
	}
	call := func(c *pgx.Conn, oid uint32, args ...string) (string, []string) {
		t.Helper()
		fe := c.PgConn().Frontend()
		var vals [][]byte
		for _, a := range args {
			vals = append(vals, []byte(a))
		}
		fe.Send(&pgproto3.FunctionCall{Function: oid, ArgFormatCodes: []uint16{0}, Arguments: vals})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		var result string
		var errs []string
		for {
			msg, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := msg.(type) {
			case *pgproto3.FunctionCallResponse:
				result = string(m.Result)
			case *pgproto3.ErrorResponse:
				errs = append(errs, m.Code+": "+m.Message)
			case *pgproto3.ReadyForQuery:
				return result, errs
			}
		}
	}
	stale, newer := staleBehind(t, p, db, d, "SELECT bump_f(3)")
	before := snapshot(t, d, "acct")
	if _, errs := call(stale, bumpF, "1"); len(errs) != 1 || !strings.HasPrefix(errs[0], "FP003") {
		t.Errorf("a stale holder's FunctionCall of bump_f: %v, want FP003", errs)
	}
	if _, errs := call(newer, bumpF, "1"); len(errs) != 1 || !strings.HasPrefix(errs[0], "FP003") {
		t.Errorf("the current holder's FunctionCall of bump_f: %v, want FP003", errs)
	}
	// One of PostgreSQL's own that runs SQL text: refused too.
	if _, errs := call(stale, toXML, "SELECT bump_f(1)", "f", "f", ""); len(errs) != 1 || !strings.HasPrefix(errs[0], "FP003") {
		t.Errorf("a stale holder's FunctionCall of query_to_xml: %v, want FP003", errs)
	}
	wantUnchanged(t, d, "acct", before)
	// The large-object functions libpq calls this way run.
	lo, errs := call(stale, loCreat, "-1")
	if len(errs) > 0 || lo == "" {
		t.Fatalf("FunctionCall of lo_creat: %q %v", lo, errs)
	}
	if got, errs := call(stale, loUnlink, lo); len(errs) > 0 || got != "1" {
		t.Errorf("FunctionCall of lo_unlink(%s): %q %v, want 1", lo, got, errs)
	}
	// The session goes on.
	if err := rvExec(t, stale, "SELECT 1"); err != nil {
		t.Errorf("after the refused FunctionCall: %v", err)
	}
	plain := runPid(t, readerSession(t, p, db, "", "", pgx.QueryExecModeSimpleProtocol))
	if got, errs := call(plain, bumpF, "2"); len(errs) > 0 || got != "1" {
		t.Errorf("FunctionCall of bump_f without a lock: %q %v, want 1", got, errs)
	}
	if w := lockWatermark(t, d, "L"); w != 51 {
		t.Errorf("watermark %d, want 51", w)
	}
}

// TestLockTemporaryCode: a stale holder creates, through the proxy,
// temporary code that reaches a lock-fenced table (a function that reads
// it through a view, a procedure that calls one that writes it). The catalog watch
// counts temporary functions and procedures, so the proxy learns them as
// readers (pg_temp's, in any session's temporary schema): once it has,
// their calls register and fail with FP001, in the simple and the
// extended protocol, and nothing is written.
func TestLockTemporaryCode(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, callSchema+"CREATE VIEW acct_v AS SELECT DISTINCT id, n FROM acct;")
	stale, _ := staleBehind(t, p, db, d, "UPDATE acct SET n = n + 1 WHERE id = 2")
	// Every check of the database the proxy started has ended: only the
	// watch's notification of what follows can have it checked again.
	rrSeen(t, p, db, d)
	time.Sleep(2 * time.Second)
	// (The proxy refuses a body that names a protected table, or a view
	// it could write it through.)
	if err := rvExec(t, stale, `CREATE FUNCTION pg_temp.peek(i bigint) RETURNS int LANGUAGE sql AS $$SELECT n FROM acct_v WHERE id = i$$;
		CREATE PROCEDURE pg_temp.tp(i bigint) LANGUAGE sql AS $$CALL public.bump(i)$$`); err != nil {
		t.Fatal(err)
	}
	// A read of the stale holder's is refused once the proxy knows the
	// function (the notification comes after the commit).
	waitUntil(t, "the temporary function listed as a reader", func() bool {
		return sqlState(rvExec(t, stale, "SELECT pg_temp.peek(1)")) == "FP001"
	})
	before := snapshot(t, d, "acct")
	if err := rvExec(t, stale, "CALL pg_temp.tp(1)"); sqlState(err) != "FP001" {
		t.Errorf("a stale CALL of the temporary procedure: %v, want FP001", err)
	}
	errs := raPipeline(t, stale, 1, &pgproto3.Parse{Query: "CALL pg_temp.tp($1)"},
		&pgproto3.Bind{Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 || !strings.HasPrefix(errs[0], "FP001") {
		t.Errorf("a stale CALL of the temporary procedure, extended: %v, want FP001", errs)
	}
	wantUnchanged(t, d, "acct", before)
	if w := lockWatermark(t, d, "L"); w != 51 {
		t.Errorf("watermark %d, want 51", w)
	}
}

// staleBehind connects two holders of lock L to db through p (simple
// protocol): one with token 50 that registers by a read of acct, then
// one with token 51 that registers by first, so that the first one is
// stale.
func staleBehind(t *testing.T, p *proxytest.Proxy, db string, d *pgx.Conn, first string) (stale, newer *pgx.Conn) {
	t.Helper()
	stale = runPid(t, readerSession(t, p, db, "L", "50", pgx.QueryExecModeSimpleProtocol))
	if err := rvExec(t, stale, "SELECT n FROM acct WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	newer = runPid(t, readerSession(t, p, db, "L", "51", pgx.QueryExecModeSimpleProtocol))
	if err := rvExec(t, newer, first); err != nil {
		t.Fatal(err)
	}
	if w := lockWatermark(t, d, "L"); w != 51 {
		t.Fatalf("watermark %d after the newer holder's %q, want 51", w, first)
	}
	return stale, newer
}

// TestLockSQLTextFunctions: PostgreSQL's functions that run SQL given as
// text (query_to_xml) register the session's lock whatever the text, so
// a stale holder cannot write through a function it names there, even by
// a computed name; the current holder's call runs.
func TestLockSQLTextFunctions(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, bumpFSchema)
	stale, newer := staleBehind(t, p, db, d, "SELECT bump_f(3)")
	before := snapshot(t, d, "acct")
	for _, q := range []string{
		"SELECT query_to_xml('SELECT bump_f(1)', false, false, '')",
		"SELECT pg_catalog.query_to_xml('SELECT bump_' || 'f(1)', false, false, '')",
		"SELECT query_to_xml_and_xmlschema(format('SELECT %s(1)', 'bump_f'), false, false, '')",
	} {
		if err := rvExec(t, stale, q); sqlState(err) != "FP001" {
			t.Errorf("stale %s: %v, want FP001", q, err)
		}
	}
	wantUnchanged(t, d, "acct", before)
	if err := rvExec(t, newer, "SELECT query_to_xml('SELECT bump_' || 'f(1)', false, false, '')"); err != nil {
		t.Errorf("the current holder's query_to_xml: %v", err)
	}
	if r := snapshot(t, d, "acct")[1]; r.N != before[1].N+1 {
		t.Errorf("row 1 after the current holder's call: %+v, was %+v", r, before[1])
	}
}
