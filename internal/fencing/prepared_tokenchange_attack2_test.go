package fencing_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Second round of attacks on the token form of prepared statements
// (77166f4..adc0587). Every check reads the rows on a direct connection
// afterwards. Rows start at last_fence 55; the session's token is 60
// (atkSetup).
//
// They were written against a token form for prepared statements that
// kept the token as a constant, since withdrawn: a statement "in the token
// form of N" is now one parsed while the session's token was N, which the
// server keeps in the parameter form (the token bound at each Bind) or in
// the form that reads the setting. The outcomes asserted are the same: the
// rows carry the session's token at each run.

// a2Sleep is a pipeline head that keeps the server busy for a while, so
// that the proxy reads and relays the messages after it before the
// server has answered the segment it ends.
func a2Sleep(sec string) []pgproto3.FrontendMessage {
	return []pgproto3.FrontendMessage{
		&pgproto3.Close{ObjectType: 'S', Name: "a2sleep"},
		&pgproto3.Parse{Name: "a2sleep", Query: "SELECT pg_catalog.pg_sleep(" + sec + ")"},
		&pgproto3.Bind{DestinationPortal: "a2sleep", PreparedStatement: "a2sleep"},
		&pgproto3.Execute{Portal: "a2sleep"},
	}
}

// a2Set sets the session's token with set_config through a named
// portal (the unnamed statement and portal stay), then more.
func a2Set(tok string, more ...pgproto3.FrontendMessage) []pgproto3.FrontendMessage {
	return append([]pgproto3.FrontendMessage{
		&pgproto3.Close{ObjectType: 'S', Name: "a2cfg"},
		&pgproto3.Parse{Name: "a2cfg", Query: "SELECT pg_catalog.set_config('fence.token', $1, false)"},
		&pgproto3.Bind{DestinationPortal: "a2cfg", PreparedStatement: "a2cfg", Parameters: [][]byte{[]byte(tok)}},
		&pgproto3.Execute{Portal: "a2cfg"},
	}, more...)
}

// a2Stmt is what the server has under name, read on the hijacked
// connection a (pg_prepared_statements is per session).
func (a *atkRaw) a2Stmt(name string) string {
	a.t.Helper()
	return a.value("SELECT statement FROM pg_prepared_statements WHERE name = '" + name + "'")
}

// a2Form names the form of a prepared statement's text.
func a2Form(q string) string {
	if q == "" {
		return "none"
	}
	if tok := tokenWrittenIn(q); tok != "" {
		return "token " + tok
	}
	if tokenParam(q) {
		return "param"
	}
	if strings.Contains(q, "pg_catalog.current_setting") {
		return "setting"
	}
	return "?"
}

// TestPreparedTokenChangeAttack2FailedParseEarlierSegment: the server has
// the statement (s1, or the unnamed one) parsed with token `prep`; the
// session's token is then set to `now`. In one write: a segment that
// sleeps and then sends a Parse of the statement again (it fails or is
// skipped on the server: s1 exists, 42P05; the unnamed one comes after a
// syntax error), Sync, then a second segment with a Bind and Execute of
// the statement, Sync. The proxy decides the Bind before the first
// segment is answered, with the definition the failed Parse would have
// made, while the server still has the one parsed with `prep`. The write
// must carry `now` (70 → 80), or be refused when `now` is stale (90 → 50,
// the row at 55).
func TestPreparedTokenChangeAttack2FailedParseEarlierSegment(t *testing.T) {
	t.Parallel()
	for _, stmt := range []string{"s1", ""} {
		for _, tc := range []struct{ prep, now string }{{"70", "80"}, {"90", "50"}} {
			t.Run(fmt.Sprintf("%q/%s-%s", stmt, tc.prep, tc.now), func(t *testing.T) {
				t.Parallel()
				c, d := atkSetup(t)
				a := atkHijack(t, c)
				a.q("SET fence.token = '" + tc.prep + "'")
				if errs, _ := a.rt(&pgproto3.Parse{Name: stmt, Query: atkUpd}, &pgproto3.Sync{}); len(errs) > 0 {
					t.Fatal(atkErrs(errs))
				}
				if stmt != "" {
					if f := a2Form(a.a2Stmt(stmt)); f != "setting" && f != "param" {
						t.Fatalf("s1 prepared with %s: %s", tc.prep, f)
					}
				}
				// (Extended protocol only: a simple Query drops the
				// unnamed statement.)
				if errs, _ := a.rt(a2Set(tc.now, &pgproto3.Sync{})...); len(errs) > 0 {
					t.Fatal(atkErrs(errs))
				}
				msgs := a2Sleep("0.3")
				if stmt == "" {
					// The unnamed statement: an error first in the
					// segment has the server skip the Parse; the old one
					// stays.
					msgs = append(msgs, &pgproto3.Parse{Name: "bad", Query: "SELEC 1"})
				}
				msgs = append(msgs,
					&pgproto3.Parse{Name: stmt, Query: atkUpd},
					&pgproto3.Sync{},
					&pgproto3.Bind{PreparedStatement: stmt, Parameters: [][]byte{[]byte("1")}},
					&pgproto3.Execute{},
					&pgproto3.Sync{})
				errs, tags := a.rt(msgs...)
				// rt stops at the first ReadyForQuery: read the second.
				errs2, tags2 := a.rt()
				t.Logf("segment 1: %s %v; segment 2: %s %v", atkErrs(errs), tags, atkErrs(errs2), tags2)
				if stmt != "" {
					t.Logf("server's s1 after: %s", a2Form(a.a2Stmt(stmt)))
				}
				if tc.now == "50" {
					if len(errs2) != 1 || errs2[0].Code != "FP001" {
						t.Errorf("stale token 50: segment 2 %s %v; want FP001", atkErrs(errs2), tags2)
					}
					atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
				} else {
					atkWantRows(t, d, map[int64][2]int64{1: {1, 80}, 2: {0, 55}, 3: {0, 55}})
				}
			})
		}
	}
}

// TestPreparedTokenChangeAttack2FailedParseSQLExecute: as
// FailedParseEarlierSegment, but the Parse that fails is decided while a
// change of the token is unanswered (so in the form that reads the
// setting), and the statement is then run by SQL EXECUTE, which the
// proxy lets run without a check when it believes the statement reads
// the setting. The server has 90's form; the session's token is 50,
// stale (row at 55): it must be refused.
func TestPreparedTokenChangeAttack2FailedParseSQLExecute(t *testing.T) {
	t.Parallel()
	for _, via := range []string{"query", "bind"} {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			c, d := atkSetup(t)
			a := atkHijack(t, c)
			a.q("SET fence.token = '90'")
			if errs, _ := a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Sync{}); len(errs) > 0 {
				t.Fatal(atkErrs(errs))
			}
			// The set in a segment of its own, so that the failed Parse
			// after it does not roll it back.
			msgs := a2Sleep("0.3")
			msgs = append(msgs, a2Set("50", &pgproto3.Sync{})...)
			msgs = append(msgs, &pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Sync{})
			if via == "query" {
				msgs = append(msgs, &pgproto3.Query{String: "EXECUTE s1(1)"})
			} else {
				msgs = append(msgs, &pgproto3.Parse{Query: "EXECUTE s1(1)"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{})
			}
			errs, tags := a.rt(msgs...)
			errs1, tags1 := a.rt()
			errs2, tags2 := a.rt()
			t.Logf("set: %s %v; failed Parse: %s %v; EXECUTE: %s %v; server's s1: %s", atkErrs(errs), tags, atkErrs(errs1), tags1, atkErrs(errs2), tags2, a2Form(a.a2Stmt("s1")))
			if len(errs2) != 1 || (errs2[0].Code != "FP001" && errs2[0].Code != "FP003") {
				t.Errorf("EXECUTE with stale token 50: %s %v; want FP001 or FP003", atkErrs(errs2), tags2)
			}
			atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
		})
	}
}

// TestPreparedTokenChangeAttack2FailedParseNoSleep: FailedParseEarlierSegment
// without the sleep, as a pipelining client sends it (one write, a
// duplicate Parse, Sync, Bind, Execute, Sync), 20 times: how often the
// write lands with the token the server's statement had instead of the
// session's.
func TestPreparedTokenChangeAttack2FailedParseNoSleep(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	wrong := 0
	for i := range 20 {
		name := fmt.Sprintf("s%d", i)
		prep, now := 1000+10*i, 1005+10*i
		a.q(fmt.Sprintf("SET fence.token = '%d'", prep))
		if errs, _ := a.rt(&pgproto3.Parse{Name: name, Query: atkUpd}, &pgproto3.Sync{}); len(errs) > 0 {
			t.Fatal(atkErrs(errs))
		}
		a.q(fmt.Sprintf("SET fence.token = '%d'", now))
		a.rt(&pgproto3.Parse{Name: name, Query: atkUpd}, &pgproto3.Sync{},
			&pgproto3.Bind{PreparedStatement: name, Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
		errs, _ := a.rt()
		if len(errs) > 0 {
			t.Fatalf("round %d: %s", i, atkErrs(errs))
		}
		if _, f := rowOf(t, d, 1); f != int64(now) {
			wrong++
			t.Logf("round %d: session token %d, row 1 last_fence %d", i, now, f)
		}
	}
	if wrong > 0 {
		t.Errorf("%d of 20 writes landed with the statement's old token, not the session's", wrong)
	}
}

// TestPreparedTokenChangeAttack2PoolerUnnamed: PgBouncer in transaction
// mode behind the proxy, two clients with the same statement text: A, an
// old holder (token 45, or none), parses the unnamed statement in one
// transaction (server connection X) and binds it in the next (pgx's
// QueryExecModeDescribeExec does this: Parse+Describe, Sync, then Bind,
// Execute, Sync); B, the new holder (token 50), parses and runs the same
// text on server connection Y between them, and A's Bind lands on Y,
// where the unnamed statement is B's, with 50 written in. A's write must
// be refused (FP001; FP002 without a token), as it is when the
// statement reads the setting (A's prelude applies 45 on Y).
func TestPreparedTokenChangeAttack2PoolerUnnamed(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	for _, tc := range []struct {
		aTok    string
		control bool // B parses before it has a token: the form that reads the setting
	}{{"45", false}, {"", false}, {"45", true}} {
		aTok := tc.aTok
		t.Run(fmt.Sprintf("A=%s/control=%v", aTok, tc.control), func(t *testing.T) {
			pe := startPoolerEnv(t)
			db := newLockDB(t, true)
			d := direct(t, db)
			poolerReset(t, d) // row 1 at 42
			var aEdit []func(*pgx.ConnConfig)
			if aTok != "" {
				aEdit = append(aEdit, param("fence.token", aTok))
			}
			A := atkHijack(t, pe.session(t, db, pgx.QueryExecModeSimpleProtocol, aEdit...))
			var bEdit []func(*pgx.ConnConfig)
			if !tc.control {
				bEdit = append(bEdit, param("fence.token", "50"))
			}
			B := atkHijack(t, pe.session(t, db, pgx.QueryExecModeSimpleProtocol, bEdit...))
			upd := &pgproto3.Parse{Query: atkUpd}
			rel, x := a2HoldAllBut(t, pe, db, 0)
			if errs, _ := A.rt(upd, &pgproto3.Describe{ObjectType: 'S'}, &pgproto3.Sync{}); len(errs) > 0 {
				t.Fatal(atkErrs(errs))
			}
			rel()
			rel, y := a2HoldAllBut(t, pe, db, x)
			bMsgs := []pgproto3.FrontendMessage{upd}
			if tc.control {
				// Parsed while the change is unanswered: the form that
				// reads the setting.
				bMsgs = a2Set("50", upd)
			}
			if errs, _ := B.rt(append(bMsgs, &pgproto3.Bind{Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})...); len(errs) > 0 {
				t.Fatal(atkErrs(errs))
			}
			rel()
			rel, z := a2HoldAllBut(t, pe, db, x)
			errs, tags := A.rt(&pgproto3.Bind{Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
			rel()
			t.Logf("server connections: A's Parse on %d, B's on %d, A's Bind on %d; A's Bind: %s %v", x, y, z, atkErrs(errs), tags)
			want := "FP001"
			if aTok == "" {
				want = "FP002"
			}
			if len(errs) != 1 || errs[0].Code != want {
				t.Errorf("old holder A (token %q) bound the unnamed statement on B's server connection: %s %v; want %s", aTok, atkErrs(errs), tags, want)
			}
			if r := snapshot(t, d, "acct")[1]; r.N != 1 || r.Fence != 50 {
				t.Errorf("row 1 = %+v; want n 1 stamped 50 (B's write only)", r)
			}
		})
	}
}

// a2HoldAllBut is poolerEnv.holdAllBut with the extended protocol and
// named statements only: a simple Query would drop the unnamed statement
// of the server connection it runs on.
func a2HoldAllBut(t *testing.T, pe *poolerEnv, db string, pid int32) (release func(), free int32) {
	t.Helper()
	run := func(a *atkRaw, sql string) (out string) {
		t.Helper()
		for _, m := range []pgproto3.FrontendMessage{
			&pgproto3.Close{ObjectType: 'P', Name: "a2hold"},
			&pgproto3.Close{ObjectType: 'S', Name: "a2hold"},
			&pgproto3.Parse{Name: "a2hold", Query: sql},
			&pgproto3.Bind{DestinationPortal: "a2hold", PreparedStatement: "a2hold"},
			&pgproto3.Execute{Portal: "a2hold"},
			&pgproto3.Sync{},
		} {
			a.fe.Send(m)
		}
		if err := a.fe.Flush(); err != nil {
			t.Fatal(err)
		}
		for {
			m, err := a.fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := m.(type) {
			case *pgproto3.DataRow:
				out = string(m.Values[0])
			case *pgproto3.ErrorResponse:
				t.Fatalf("%s: %s", sql, m.Message)
			case *pgproto3.ReadyForQuery:
				return out
			}
		}
	}
	type held struct {
		a   *atkRaw
		pid string
	}
	var hs []held
	for range poolerPoolSize {
		a := atkHijack(t, pe.bouncerDirect(t, "postgres", db))
		run(a, "BEGIN")
		hs = append(hs, held{a, run(a, "SELECT pg_catalog.pg_backend_pid()")})
	}
	freeAt := 0
	if hs[0].pid == fmt.Sprint(pid) {
		freeAt = 1
	}
	run(hs[freeAt].a, "COMMIT")
	var p int32
	fmt.Sscan(hs[freeAt].pid, &p)
	return func() {
		for i, h := range hs {
			if i != freeAt {
				run(h.a, "COMMIT")
			}
		}
	}, p
}

// TestPreparedTokenChangeAttack2SkippedReprepare: the server has s1 in the
// token form of `prep` (one Bind); the session's token is now `now`. In
// one write: a segment where an error comes first (1/0), then a Bind and
// Execute of s1 (the proxy injects Close and Parse of s1 for the new
// token before it; the server skips all of it), Sync; then a second
// segment with a Bind and Execute of s1, Sync, sent before the first is
// answered. The proxy assumes its own re-prepare was done; the server
// still has `prep`'s form. No client Parse is involved.
func TestPreparedTokenChangeAttack2SkippedReprepare(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ prep, now string }{{"70", "80"}, {"90", "50"}} {
		for _, sleep := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s-%s/sleep=%v", tc.prep, tc.now, sleep), func(t *testing.T) {
				t.Parallel()
				c, d := atkSetup(t)
				a := atkHijack(t, c)
				a.q("SET fence.token = '" + tc.prep + "'")
				if errs, _ := a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("3")}}, &pgproto3.Execute{}, &pgproto3.Sync{}); len(errs) > 0 {
					t.Fatal(atkErrs(errs))
				}
				a.q("SET fence.token = '" + tc.now + "'")
				var msgs []pgproto3.FrontendMessage
				if sleep {
					msgs = a2Sleep("0.3")
				}
				msgs = append(msgs,
					&pgproto3.Parse{Name: "a2div", Query: "SELECT 1/0"}, &pgproto3.Bind{DestinationPortal: "a2div", PreparedStatement: "a2div"}, &pgproto3.Execute{Portal: "a2div"},
					&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("2")}}, &pgproto3.Execute{},
					&pgproto3.Sync{},
					&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{},
					&pgproto3.Sync{})
				errs, _ := a.rt(msgs...)
				errs2, tags2 := a.rt()
				t.Logf("segment 1: %s; segment 2: %s %v; server's s1: %s", atkErrs(errs), atkErrs(errs2), tags2, a2Form(a.a2Stmt("s1")))
				want := map[int64][2]int64{1: {1, 80}, 2: {0, 55}, 3: {1, 70}}
				if tc.now == "50" {
					want = map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {1, 90}}
					if len(errs2) != 1 || errs2[0].Code != "FP001" {
						t.Errorf("stale token 50: segment 2 %s %v; want FP001", atkErrs(errs2), tags2)
					}
				}
				atkWantRows(t, d, want)
			})
		}
	}
}

// TestPreparedTokenChangeAttack2ResetBetween: the unnamed portal bound
// with 60 written in; between its Bind and its Execute, in the same
// pipeline, a named portal removes the token (RESET ALL, RESET
// fence.token, SET fence.token TO DEFAULT, set_config to the empty string), or a
// DISCARD. The form that reads the setting refuses (FP002) or the portal
// is gone; the token form must not write 60.
func TestPreparedTokenChangeAttack2ResetBetween(t *testing.T) {
	t.Parallel()
	for _, form := range atkForms {
		for _, sql := range []string{"RESET ALL", "RESET fence.token", "SET fence.token TO DEFAULT", "SELECT pg_catalog.set_config('fence.token', '', false)", "SET SESSION fence.token = DEFAULT", "DISCARD ALL"} {
			t.Run(form+"/"+sql, func(t *testing.T) {
				t.Parallel()
				c, d := atkSetup(t)
				atkPrepare(t, c, form, "s1", atkUpd)
				a := atkHijack(t, c)
				errs, tags := a.rt(
					&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}},
					&pgproto3.Parse{Name: "r", Query: sql},
					&pgproto3.Bind{DestinationPortal: "r", PreparedStatement: "r"},
					&pgproto3.Execute{Portal: "r"},
					&pgproto3.Execute{},
					&pgproto3.Sync{})
				t.Logf("%s form, %s between Bind and Execute: %s %v", form, sql, atkErrs(errs), tags)
				atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
				if len(errs) == 0 {
					t.Errorf("no error")
				}
			})
		}
	}
}

// TestPreparedTokenChangeAttack2NoLeak: the messages the client gets back
// are exactly the responses to its own, around the proxy's injected
// Close of the unnamed portal (a second Bind of the unnamed portal in a
// transaction), its re-prepares (token changed, named portal), a client
// Close of the unnamed portal, Flush, and Describe of the unnamed
// statement and portal.
func TestPreparedTokenChangeAttack2NoLeak(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	a.q("BEGIN") // (a simple Query drops the unnamed statement: none after the Parse)
	if errs, _ := a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Parse{Query: atkUpd}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	types := func(until func(pgproto3.BackendMessage) bool, msgs ...pgproto3.FrontendMessage) string {
		t.Helper()
		for _, m := range msgs {
			a.fe.Send(m)
		}
		if err := a.fe.Flush(); err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		for {
			m, err := a.fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := m.(type) {
			case *pgproto3.ParseComplete:
				b.WriteString("1")
			case *pgproto3.BindComplete:
				b.WriteString("2")
			case *pgproto3.CloseComplete:
				b.WriteString("3")
			case *pgproto3.CommandComplete:
				b.WriteString("C")
			case *pgproto3.ErrorResponse:
				b.WriteString("E(" + m.Code + ")")
			case *pgproto3.ParameterDescription:
				b.WriteString("t")
			case *pgproto3.NoData:
				b.WriteString("n")
			case *pgproto3.RowDescription:
				b.WriteString("T")
			case *pgproto3.DataRow:
				b.WriteString("D")
			case *pgproto3.ReadyForQuery:
				b.WriteString("Z")
			default:
				b.WriteString(fmt.Sprintf("[%T]", m))
			}
			if until(m) {
				return b.String()
			}
		}
	}
	rfq := func(m pgproto3.BackendMessage) bool { _, ok := m.(*pgproto3.ReadyForQuery); return ok }
	bind := func(stmt, portal, id string) *pgproto3.Bind {
		return &pgproto3.Bind{DestinationPortal: portal, PreparedStatement: stmt, Parameters: [][]byte{[]byte(id)}}
	}
	check := func(what, want string, got string) {
		t.Helper()
		if got != want {
			t.Errorf("%s: client got %s; want %s", what, got, want)
		}
	}
	// Bound twice without an Execute: the proxy closes the first.
	check("two Binds of the unnamed portal", "22CZ", types(rfq, bind("s1", "", "1"), bind("s1", "", "1"), &pgproto3.Execute{}, &pgproto3.Sync{}))
	// The client's own Close of it in between.
	check("Bind, Close, Bind", "232CZ", types(rfq, bind("s1", "", "1"), &pgproto3.Close{ObjectType: 'P'}, bind("s1", "", "1"), &pgproto3.Execute{}, &pgproto3.Sync{}))
	// Flush after a Bind that the proxy re-prepares for (token changed).
	check("SET LOCAL by a named portal", "12CZ", types(rfq, &pgproto3.Parse{Name: "setl", Query: "SET LOCAL fence.token = '70'"}, &pgproto3.Bind{DestinationPortal: "setl", PreparedStatement: "setl"}, &pgproto3.Execute{Portal: "setl"}, &pgproto3.Sync{}))
	bc := func(m pgproto3.BackendMessage) bool { _, ok := m.(*pgproto3.BindComplete); return ok }
	check("Bind after a token change, Flush", "2", types(bc, bind("s1", "", "2"), &pgproto3.Flush{}))
	check("then Execute, Sync", "CZ", types(rfq, &pgproto3.Execute{}, &pgproto3.Sync{}))
	// The unnamed statement (60 written in) with Describes around.
	check("Describe S, Bind, Describe P, Execute", "tn2nCZ", types(rfq, &pgproto3.Describe{ObjectType: 'S'}, bind("", "", "3"), &pgproto3.Describe{ObjectType: 'P'}, &pgproto3.Execute{}, &pgproto3.Sync{}))
	// A named portal (re-prepared to the form that reads the setting).
	check("named portal", "2CZ", types(rfq, bind("s1", "p", "3"), &pgproto3.Execute{Portal: "p"}, &pgproto3.Sync{}))
	// A Parse of the unnamed statement between Bind and Execute.
	check("Bind, Parse unnamed, Execute", "21CZ", types(rfq, bind("", "", "3"), &pgproto3.Parse{Query: "SELECT 1"}, &pgproto3.Execute{}, &pgproto3.Sync{}))
	a.q("COMMIT")
	atkWantRows(t, d, map[int64][2]int64{1: {2, 60}, 2: {1, 70}, 3: {3, 70}})
	for _, n := range []string{"s1"} {
		t.Logf("%s: %s", n, a2Form(a.a2Stmt(n)))
	}
}

// TestPreparedTokenChangeAttack2AutoPrepare: auto_prepare (from the 2nd
// sending) with the token changing before every simple Query, invalid
// tokens and a stale one between: each write carries the session's token,
// the others are refused as they are without auto_prepare.
func TestPreparedTokenChangeAttack2AutoPrepare(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	const q = "UPDATE acct SET n = n + 1 WHERE id = 1"
	n := int64(0)
	for i := range 12 {
		tok := 60 + i
		a.q(fmt.Sprintf("SET fence.token = '%d'", tok))
		a.q(q)
		n++
		for _, bad := range []struct{ tok, code string }{{"abc", "FP002"}, {"0", "FP002"}, {"", "FP002"}, {fmt.Sprint(tok - 1), "FP001"}} {
			if i%3 != 0 {
				break
			}
			a.q(fmt.Sprintf("SET fence.token = '%s'", bad.tok))
			errs, _ := a.rt(&pgproto3.Query{String: q})
			if len(errs) != 1 || errs[0].Code != bad.code {
				t.Errorf("token %q: %s; want %s", bad.tok, atkErrs(errs), bad.code)
			}
		}
		a.q(fmt.Sprintf("SET fence.token = '%d'", tok))
		if r := atkRows(t, d, "acct")[1]; r != [2]int64{n, int64(tok)} {
			t.Fatalf("round %d: row 1 %v; want [%d %d]", i, r, n, tok)
		}
	}
	// A SET in a transaction, then the auto-prepared text.
	a.q("BEGIN")
	a.q("SET LOCAL fence.token = '90'")
	a.q(q)
	a.q("ROLLBACK")
	a.q(q)
	if r := atkRows(t, d, "acct")[1]; r != [2]int64{n + 1, 71} {
		t.Errorf("after ROLLBACK: row 1 %v; want [%d 71]", r, n+1)
	}
}

// TestPreparedTokenChangeAttack2LongPipeline: pgconn.Pipeline, 300 writes
// through a named statement (bound 9 times with 60 first, so in the token
// form) and the unnamed one, with set_config of a rising token every 1 to
// 4 writes, binary-format parameters, and no Sync until the end (syncs:
// false), or a Sync after every 7 operations with a failing statement
// (1/0) in one segment (syncs: true): every write carries the token set
// before it; the failed segment's writes are rolled back.
func TestPreparedTokenChangeAttack2LongPipeline(t *testing.T) {
	t.Parallel()
	for _, syncs := range []bool{false, true} {
		t.Run(fmt.Sprintf("syncs=%v", syncs), func(t *testing.T) {
			t.Parallel()
			c, d := atkSetup(t)
			atkPrepare(t, c, "token", "s1", atkUpd)
			for range 9 {
				if _, err := c.Exec(ctxT(t), "s1", 3); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := c.Prepare(ctxT(t), "cfg", "SELECT pg_catalog.set_config('fence.token', $1, false)"); err != nil {
				t.Fatal(err)
			}
			ctx := ctxT(t)
			p := c.PgConn().StartPipeline(ctx)
			want := atkRows(t, d, "acct")
			seg := map[int64][2]int64{}
			for k, v := range want {
				seg[k] = v
			}
			tok := int64(60)
			ops, failSeg := 0, 5
			segNo := 0
			bin8 := func(v int64) []byte {
				b := make([]byte, 8)
				for i := range 8 {
					b[7-i] = byte(v >> (8 * i))
				}
				return b
			}
			for i := range 300 {
				if i%(1+i%4) == 0 {
					tok++
					p.SendQueryPrepared("cfg", [][]byte{[]byte(fmt.Sprint(tok))}, nil, nil)
					ops++
				}
				id := int64(1 + i%3)
				if i%2 == 0 {
					p.SendQueryPrepared("s1", [][]byte{bin8(id)}, []int16{1}, nil)
				} else {
					p.SendQueryParams(atkUpd, [][]byte{bin8(id)}, []uint32{20}, []int16{1}, nil)
				}
				ops++
				seg[id] = [2]int64{seg[id][0] + 1, tok}
				if syncs && ops >= 7 {
					if segNo == failSeg {
						p.SendQueryParams("SELECT 1/0", nil, nil, nil, nil)
					} else {
						want = map[int64][2]int64{}
						for k, v := range seg {
							want[k] = v
						}
					}
					if segNo == failSeg {
						// Rolled back: the rows go back to what the last good
						// segment left, and so does the token (set_config is
						// transactional); the next token set rises above
						// anything written.
						for k, v := range want {
							seg[k] = v
						}
						tok = want[1][1]
						for _, v := range want {
							tok = max(tok, v[1])
						}
						tok += 100 // the next set_config rises above anything written
					}
					p.SendPipelineSync()
					ops = 0
					segNo++
				}
			}
			if !syncs || ops > 0 {
				p.SendPipelineSync()
				want = seg
			}
			if err := p.Flush(); err != nil {
				t.Fatal(err)
			}
			errs := pipelineErrors(p)
			if err := p.Close(); err != nil {
				t.Logf("pipeline close: %v", err)
			}
			t.Logf("errors: %v", errs)
			got := atkRows(t, d, "acct")
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("acct rows %v; want %v", got, want)
			}
		})
	}
}
