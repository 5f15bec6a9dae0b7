package fencing_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"
)

// The parameter form in pipelines: more than one portal bound before an
// Execute, a Parse of a name in use answered after the Bind that follows
// it, Binds whose format codes PostgreSQL rejects. Each checks the rows.

// tpPipe sends msgs and reads up to the syncs'th ReadyForQuery; it returns
// the errors, the CommandComplete tags and the first column of each
// DataRow.
func (a *atkRaw) tpPipe(syncs int, msgs ...pgproto3.FrontendMessage) (errs []pgproto3.ErrorResponse, tags, vals []string) {
	a.t.Helper()
	for _, m := range msgs {
		a.fe.Send(m)
	}
	if err := a.fe.Flush(); err != nil {
		a.t.Fatal(err)
	}
	for syncs > 0 {
		m, err := a.fe.Receive()
		if err != nil {
			a.t.Fatal(err)
		}
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			errs = append(errs, *m)
		case *pgproto3.CommandComplete:
			tags = append(tags, string(m.CommandTag))
		case *pgproto3.DataRow:
			vals = append(vals, string(m.Values[0]))
		case *pgproto3.ReadyForQuery:
			syncs--
		}
	}
	return errs, tags, vals
}

func tpBind(portal, stmt string, vals ...string) *pgproto3.Bind {
	b := &pgproto3.Bind{DestinationPortal: portal, PreparedStatement: stmt}
	for _, v := range vals {
		b.Parameters = append(b.Parameters, []byte(v))
	}
	return b
}

// tpNewHolder starts a proxy with lockRules and a database with the
// objects, and connects a holder of tenant/7 with token 11 that has
// registered (a read of acct) and set jobs row 1 to 'by11': the lock's
// watermark is 11, and a session at 10 is stale. d is a direct connection.
func tpNewHolder(t *testing.T) (e *lockEnv, db string, d, nw *pgx.Conn) {
	t.Helper()
	e = startLockEnv(t)
	db = newLockDB(t, true)
	d = direct(t, db)
	nw = e.holder(t, db, "tenant/7", 11, pgx.QueryExecModeSimpleProtocol)
	mustExec(t, nw, "SELECT n FROM acct WHERE id = 2")
	mustExec(t, nw, "UPDATE jobs SET state = 'by11' WHERE id = 1")
	return e, db, d, nw
}

// tpWantJobs checks jobs row 1 and the watermark of tenant/7.
func tpWantJobs(t *testing.T, d *pgx.Conn, state string) {
	t.Helper()
	var got string
	var w int64
	if err := d.QueryRow(ctxT(t), "SELECT (SELECT state FROM jobs WHERE id = 1), (SELECT token FROM fenceproxy.locks WHERE name = 'tenant/7')").Scan(&got, &w); err != nil || got != state || w != 11 {
		t.Errorf("jobs row 1 %q, watermark %d (%v); want %q and 11", got, w, err, state)
	}
}

// TestTokenParamTwoPortals: a portal holds its Bind's token, so only one
// can be open at a time; binding a second closes the first, which its
// Execute binds again with the token then. No portal runs with a token
// the session has since replaced.
func TestTokenParamTwoPortals(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t) // rows 1..3 at 55, the session's token 60
	if _, err := c.Prepare(ctxT(t), "s1", atkUpd); err != nil {
		t.Fatal(err)
	}
	a := atkHijack(t, c)
	start := map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}}

	// Two named portals bound with 60, then 50 (stale) set: neither
	// writes.
	a.q("BEGIN")
	if errs, _, _ := a.tpPipe(1, tpBind("p1", "s1", "1"), tpBind("p2", "s1", "2"), &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	a.q("SET LOCAL fence.token = '50'")
	errs, tags, _ := a.tpPipe(1, &pgproto3.Execute{Portal: "p1"}, &pgproto3.Execute{Portal: "p2"}, &pgproto3.Sync{})
	if len(errs) != 1 || len(tags) != 0 {
		t.Errorf("two portals bound with 60, executed after SET LOCAL 50: %s %v; want one error", atkErrs(errs), tags)
	}
	a.q("ROLLBACK")
	atkWantRows(t, d, start)

	// The unnamed portal and a named one in one pipeline.
	a.q("BEGIN")
	if errs, _, _ := a.tpPipe(1, tpBind("", "s1", "1"), tpBind("p2", "s1", "2"), &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	a.q("SET LOCAL fence.token = '50'")
	errs, tags, _ = a.tpPipe(1, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 || len(tags) != 0 {
		t.Errorf("the unnamed portal after SET LOCAL 50: %s %v; want an error", atkErrs(errs), tags)
	}
	a.q("ROLLBACK")
	atkWantRows(t, d, start)

	// A portal bound again at its Execute closes the one bound since.
	a.q("BEGIN")
	if errs, _, _ := a.tpPipe(1, tpBind("p1", "s1", "1"), &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	a.q("SET LOCAL fence.token = '70'")
	errs, tags, _ = a.tpPipe(1, tpBind("p2", "s1", "2"), &pgproto3.Execute{Portal: "p1"}, &pgproto3.Sync{})
	if len(errs) > 0 || len(tags) != 1 || tags[0] != "UPDATE 1" {
		t.Errorf("p1 executed after p2's Bind: %s %v", atkErrs(errs), tags)
	}
	a.q("SET LOCAL fence.token = '50'")
	errs, tags, _ = a.tpPipe(1, &pgproto3.Execute{Portal: "p2"}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "FP001" || len(tags) != 0 {
		t.Errorf("p2, bound with 70, executed after SET LOCAL 50: %s %v; want FP001", atkErrs(errs), tags)
	}
	a.q("ROLLBACK")
	atkWantRows(t, d, start)

	// What a client sees of it, token unchanged: both portals run, each
	// with the session's token.
	a.q("SET fence.token = '70'")
	errs, tags, _ = a.tpPipe(1, tpBind("p1", "s1", "1"), tpBind("p2", "s1", "2"),
		&pgproto3.Execute{Portal: "p1"}, &pgproto3.Execute{Portal: "p2"}, &pgproto3.Sync{})
	if len(errs) > 0 || len(tags) != 2 {
		t.Errorf("Bind p1, Bind p2, Execute p1, Execute p2: %s %v", atkErrs(errs), tags)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 70}, 2: {1, 70}, 3: {0, 55}})
}

// TestTokenParamParseInUse: a Parse of a name in use fails and leaves the
// statement the server has; a Bind sent after its Sync, before the answer,
// meets that one, and the proxy binds it as that one.
func TestTokenParamParseInUse(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)

	// The write first, then a SELECT of two parameters under its name: the
	// second value is no token of the client's.
	errs, tags, _ := a.tpPipe(2, &pgproto3.Parse{Name: "s5", Query: atkUpd},
		&pgproto3.Parse{Name: "s5", Query: "SELECT $1::bigint, $2::bigint"}, &pgproto3.Sync{},
		tpBind("", "s5", "1", "99"), &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 2 || errs[0].Code != "42P05" || errs[1].Code != "08P01" || len(tags) != 0 {
		t.Errorf("Parse of s5 in use, then a Bind of two values: %s %v; want 42P05 and 08P01", atkErrs(errs), tags)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
	errs, tags, _ = a.tpPipe(1, tpBind("", "s5", "1"), &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) > 0 || len(tags) != 1 {
		t.Errorf("s5 bound as the write: %s %v", atkErrs(errs), tags)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {0, 55}, 3: {0, 55}})

	// The other way round: the SELECT stays, and its Bind is the client's.
	errs, tags, vals := a.tpPipe(2, &pgproto3.Parse{Name: "s3", Query: "SELECT $1::bigint"},
		&pgproto3.Parse{Name: "s3", Query: atkUpd}, &pgproto3.Sync{},
		tpBind("", "s3", "1"), &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "42P05" || len(vals) != 1 || vals[0] != "1" || len(tags) != 1 {
		t.Errorf("Parse of s3 in use by a SELECT, then its Bind: %s %v %v; want 42P05 and the row 1", atkErrs(errs), tags, vals)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {0, 55}, 3: {0, 55}})

	// A PREPARE that does not run (an error before it in its Query)
	// leaves the name undefined.
	errs, tags, _ = a.tpPipe(2, &pgproto3.Query{String: "SELECT 1/0; PREPARE s6(bigint, bigint) AS SELECT $1, $2"},
		tpBind("", "s6", "1", "99"), &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 2 || errs[0].Code != "22012" || errs[1].Code != "26000" || len(tags) != 0 {
		t.Errorf("Bind of a PREPARE that did not run: %s %v; want 22012 and 26000", atkErrs(errs), tags)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {0, 55}, 3: {0, 55}})
}

// TestTokenParamParseInUseLock: the same with lock fencing, where a Bind
// taken for a plain SELECT would run without the registration: the stale
// holder is refused and the rows and the watermark stay.
func TestTokenParamParseInUseLock(t *testing.T) {
	t.Parallel()
	e, db, d, _ := tpNewHolder(t)
	old := e.holder(t, db, "tenant/7", 10, pgx.QueryExecModeCacheStatement)
	before := atkRows(t, d, "acct")
	a := atkHijack(t, old)
	// acct is fenced by row too: a second value would be the token.
	errs, tags, _ := a.tpPipe(2, &pgproto3.Parse{Name: "s5", Query: "UPDATE acct SET n = n + 1 WHERE id = $1"},
		&pgproto3.Parse{Name: "s5", Query: "SELECT $1::bigint, $2::bigint"}, &pgproto3.Sync{},
		tpBind("", "s5", "1", "10"), &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 2 || errs[0].Code != "42P05" || errs[1].Code != "08P01" || len(tags) != 0 {
		t.Errorf("the stale holder's Bind of acct's s5 after a Parse of s5 in use: %s %v; want 42P05 and 08P01", atkErrs(errs), tags)
	}
	// jobs is fenced by the lock alone: the registration is the fence.
	errs, tags, _ = a.tpPipe(2, &pgproto3.Parse{Name: "s6", Query: "UPDATE jobs SET state = 'stale' WHERE id = $1"},
		&pgproto3.Parse{Name: "s6", Query: "SELECT $1::bigint"}, &pgproto3.Sync{},
		tpBind("", "s6", "1"), &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 2 || errs[0].Code != "42P05" || errs[1].Code != "FP001" || len(tags) != 0 {
		t.Errorf("the stale holder's Bind of jobs' s6 after a Parse of s6 in use: %s %v; want 42P05 and FP001", atkErrs(errs), tags)
	}
	if after := atkRows(t, d, "acct"); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("acct: %v, was %v", after, before)
	}
	tpWantJobs(t, d, "by11")
}

// TestTokenParamBadFormats: a Bind with format codes PostgreSQL rejects
// gets PostgreSQL's error and writes nothing; the session goes on.
func TestTokenParamBadFormats(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	if _, err := c.Prepare(ctxT(t), "s1", atkUpd); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Prepare(ctxT(t), "s2", "UPDATE acct SET payload = $2 WHERE id = $1"); err != nil {
		t.Fatal(err)
	}
	a := atkHijack(t, c)
	start := map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}}
	for _, tc := range []struct {
		name string
		bind *pgproto3.Bind
		code string
		msg  string
	}{
		{"code 2", &pgproto3.Bind{PreparedStatement: "s1", ParameterFormatCodes: []int16{2}, Parameters: [][]byte{[]byte("1")}}, "22023", "unsupported format code: 2"},
		{"code 2 of two", &pgproto3.Bind{PreparedStatement: "s2", ParameterFormatCodes: []int16{0, 2}, Parameters: [][]byte{[]byte("1"), []byte("x")}}, "22023", "unsupported format code: 2"},
		{"two codes, one value", &pgproto3.Bind{PreparedStatement: "s1", ParameterFormatCodes: []int16{0, 0}, Parameters: [][]byte{[]byte("1")}}, "08P01", "bind message has 2 parameter formats but 1 parameters"},
		{"three codes, two values", &pgproto3.Bind{PreparedStatement: "s2", ParameterFormatCodes: []int16{0, 0, 0}, Parameters: [][]byte{[]byte("1"), []byte("x")}}, "08P01", "bind message has 3 parameter formats but 2 parameters"},
	} {
		errs, tags, _ := a.tpPipe(1, tc.bind, &pgproto3.Execute{}, &pgproto3.Sync{})
		if len(errs) != 1 || errs[0].Code != tc.code || errs[0].Message != tc.msg || len(tags) != 0 {
			t.Errorf("%s: %s %v; want %s %s", tc.name, atkErrs(errs), tags, tc.code, tc.msg)
		}
	}
	atkWantRows(t, d, start)
	if v := a.value("SELECT 7"); v != "7" {
		t.Errorf("the session after: %q", v)
	}
	errs, tags, _ := a.tpPipe(1, tpBind("", "s1", "1"), &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) > 0 || len(tags) != 1 {
		t.Errorf("s1 after: %s %v", atkErrs(errs), tags)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {0, 55}, 3: {0, 55}})
}

// TestTokenParamQueryAfterExecute: a Query sent after a Bind and Execute
// with no Sync between ends their segment; the proxy reads its answers as
// the Query's, so a SET of the token in it counts and a statement it
// did not run does not.
func TestTokenParamQueryAfterExecute(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	start := map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}}
	if errs, _, _ := a.tpPipe(1, &pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Parse{Name: "s2", Query: "SELECT $1::int"}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	// A fenced Bind, then SET 50 in a Query: the session's token is 50,
	// which is stale for every row.
	errs, _, _ := a.tpPipe(2, tpBind("p1", "s1", "1"), &pgproto3.Query{String: "SET fence.token = '50'"}, &pgproto3.Execute{Portal: "p1"}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "34000" {
		t.Errorf("Bind, Query SET, Execute: %s; want 34000", atkErrs(errs))
	}
	errs, _ = a.rt(&pgproto3.Query{String: "UPDATE acct SET n = n + 1 WHERE id = 2"})
	if len(errs) != 1 || errs[0].Code != "FP001" {
		t.Errorf("UPDATE after SET 50: %s; want FP001", atkErrs(errs))
	}
	atkWantRows(t, d, start)

	// Executes, then a Query whose DEALLOCATE and PREPARE do not run: s1
	// is still the write, and a second value is no token of the client's.
	a.q("SET fence.token = '60'")
	errs, _, _ = a.tpPipe(1, tpBind("a", "s2", "1"), &pgproto3.Execute{Portal: "a"}, tpBind("b", "s2", "2"), &pgproto3.Execute{Portal: "b"},
		tpBind("c", "s2", "3"), &pgproto3.Execute{Portal: "c"}, &pgproto3.Query{String: "SELECT 1/0; DEALLOCATE s1; PREPARE s1(bigint, bigint) AS SELECT $1, $2"})
	if len(errs) != 1 || errs[0].Code != "22012" {
		t.Errorf("Executes, then a Query failing before its DEALLOCATE: %s; want 22012", atkErrs(errs))
	}
	errs, tags, _ := a.tpPipe(1, tpBind("", "s1", "1", "99"), &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "08P01" || len(tags) != 0 {
		t.Errorf("Bind of s1 with two values: %s %v; want 08P01", atkErrs(errs), tags)
	}
	atkWantRows(t, d, start)
}

// TestTokenParamQueryAfterExecuteLock: the same for a lock holder: a SET
// to a stale token after an Execute counts, and the holder is refused.
func TestTokenParamQueryAfterExecuteLock(t *testing.T) {
	t.Parallel()
	_, _, d, nw := tpNewHolder(t)
	a := atkHijack(t, nw)
	if errs, _, _ := a.tpPipe(1, &pgproto3.Parse{Name: "s5", Query: "UPDATE acct SET n = n + 1 WHERE id = $1"}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	if errs, _, _ := a.tpPipe(1, tpBind("p", "s5", "3"), &pgproto3.Execute{Portal: "p"}, &pgproto3.Query{String: "SET fence.token = '10'"}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	errs, _ := a.rt(&pgproto3.Query{String: "UPDATE jobs SET state = 'by10' WHERE id = 1"})
	if len(errs) != 1 || errs[0].Code != "FP001" {
		t.Errorf("the holder's UPDATE after SET 10: %s; want FP001", atkErrs(errs))
	}
	tpWantJobs(t, d, "by11")
}

// TestTokenParamClosedPortalEnds: a portal the proxy closed is not bound
// again once the client closed it or its transaction ended: its Execute
// gets the server's 34000, as it would without the proxy.
func TestTokenParamClosedPortalEnds(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	if _, err := c.Prepare(ctxT(t), "s1", atkUpd); err != nil {
		t.Fatal(err)
	}
	a := atkHijack(t, c)
	start := map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}}
	a.q("BEGIN")
	if errs, _, _ := a.tpPipe(1, tpBind("p1", "s1", "1"), &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	if errs, _, _ := a.tpPipe(1, &pgproto3.Close{ObjectType: 'P', Name: "p1"}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	errs, tags, _ := a.tpPipe(1, &pgproto3.Execute{Portal: "p1"}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "34000" || len(tags) != 0 {
		t.Errorf("Execute of a portal the client closed: %s %v; want 34000", atkErrs(errs), tags)
	}
	a.q("COMMIT")
	atkWantRows(t, d, start)

	// Outside a transaction block a Query between Bind and Execute ends
	// the portal, pipelined or not.
	for _, msgs := range [][]pgproto3.FrontendMessage{
		{tpBind("p1", "s1", "1"), &pgproto3.Query{String: "SELECT 1"}, &pgproto3.Execute{Portal: "p1"}, &pgproto3.Sync{}},
		{tpBind("p1", "s1", "1"), tpBind("p2", "s1", "2"), &pgproto3.Sync{}, &pgproto3.Execute{Portal: "p2"}, &pgproto3.Sync{}},
	} {
		errs, tags, _ := a.tpPipe(2, msgs...)
		if len(errs) != 1 || errs[0].Code != "34000" || slices.Contains(tags, "UPDATE 1") {
			t.Errorf("Execute after the portal's implicit transaction ended: %s %v; want 34000", atkErrs(errs), tags)
		}
	}
	atkWantRows(t, d, start)
}

// TestSkippedQueryGivesUpFencing: after an error in an extended-protocol
// message the server ignores a Query sent before the Sync, which the
// proxy cannot follow: the session gives up fencing (protected tables
// refused, nothing written) and goes on for the rest.
func TestSkippedQueryGivesUpFencing(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	errs, _, _ := a.tpPipe(1, &pgproto3.Parse{Query: "SELEC bogus"}, &pgproto3.Query{String: "SET fence.token = '50'"}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "42601" {
		t.Fatalf("a bad Parse, a Query, a Sync: %s; want 42601 alone", atkErrs(errs))
	}
	for _, q := range []string{"UPDATE acct SET n = n + 1 WHERE id = 1", "SET fence.token = '70'", "UPDATE acct SET n = n + 1 WHERE id = 2"} {
		errs, _ := a.rt(&pgproto3.Query{String: q})
		if q[0] == 'U' && (len(errs) != 1 || errs[0].Code != "FP003") {
			t.Errorf("%s after the skipped Query: %s; want FP003", q, atkErrs(errs))
		}
	}
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
	if v := a.value("SELECT 7"); v != "7" {
		t.Errorf("a read after: %q", v)
	}
}

// TestTokenParamSQLCloseAll: SQL CLOSE ALL between a Bind and its Execute
// ends the portal the proxy had closed, as PostgreSQL would: its Execute
// gets 34000 and nothing is written.
func TestTokenParamSQLCloseAll(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	if _, err := c.Prepare(ctxT(t), "s1", atkUpd); err != nil {
		t.Fatal(err)
	}
	a := atkHijack(t, c)
	a.q("BEGIN")
	errs, tags, _ := a.tpPipe(3, tpBind("p1", "s1", "1"), &pgproto3.Sync{}, &pgproto3.Query{String: "CLOSE ALL"}, &pgproto3.Execute{Portal: "p1"}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "34000" || slices.Contains(tags, "UPDATE 1") {
		t.Errorf("Execute after CLOSE ALL: %s %v; want 34000", atkErrs(errs), tags)
	}
	a.q("ROLLBACK")
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
}
