package fencing_test

import (
	"encoding/binary"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
)

// The parameter form: a Parse of a fenced write goes to the server with the
// token as its last parameter, which the proxy binds at every Bind
// (internal/proxy/tokenparam.go). These tests speak the protocol by hand
// where the form's edges are (format codes, counts, Describe, EXECUTE by
// SQL and by stored code) and check the rows in PostgreSQL.

// tpDescribe sends Describe of statement name and Sync, and returns the
// parameter types the client is told of.
func tpDescribe(t *testing.T, a *atkRaw, name string) []uint32 {
	t.Helper()
	a.fe.Send(&pgproto3.Describe{ObjectType: 'S', Name: name})
	a.fe.Send(&pgproto3.Sync{})
	if err := a.fe.Flush(); err != nil {
		t.Fatal(err)
	}
	var oids []uint32
	got := false
	for {
		m, err := a.fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		switch m := m.(type) {
		case *pgproto3.ParameterDescription:
			oids, got = append([]uint32(nil), m.ParameterOIDs...), true
		case *pgproto3.ErrorResponse:
			t.Fatalf("Describe %s: %s %s", name, m.Code, m.Message)
		case *pgproto3.ReadyForQuery:
			if !got {
				t.Fatalf("Describe %s: no ParameterDescription", name)
			}
			return oids
		}
	}
}

// TestTokenParamForm: what the server has, what the client is told, and
// what each way of binding writes.
func TestTokenParamForm(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t) // acct rows 1..3 at 55, the session's token 60
	a := atkHijack(t, c)
	const upd2 = "UPDATE acct SET payload = $2, n = n + 1 WHERE id = $1"
	if errs, _ := a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Parse{Name: "s2", Query: upd2},
		&pgproto3.Parse{Name: "s3", Query: atkUpd, ParameterOIDs: []uint32{20, 25, 23}}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	// The server has the parameter form, with one parameter more, bigint;
	// the client is told of its own.
	for _, tc := range []struct {
		name  string
		types string
		own   int
	}{{"s1", "{bigint,bigint}", 1}, {"s2", "{bigint,text,bigint}", 2}, {"s3", "{bigint,text,integer,bigint}", 3}} {
		if q := a.a2Stmt(tc.name); !tokenParam(q) {
			t.Errorf("%s on the server: %s; want the parameter form", tc.name, q)
		}
		if got := a.value("SELECT parameter_types::text FROM pg_prepared_statements WHERE name = '" + tc.name + "'"); got != tc.types {
			t.Errorf("%s: the server's parameter types %s, want %s", tc.name, got, tc.types)
		}
		if oids := tpDescribe(t, a, tc.name); len(oids) != tc.own {
			t.Errorf("Describe %s: %d parameter types %v, want the client's %d", tc.name, len(oids), oids, tc.own)
		}
	}

	// Every format-code shape of a Bind writes the session's token.
	bin8 := func(v int64) []byte { return binary.BigEndian.AppendUint64(nil, uint64(v)) }
	for _, tc := range []struct {
		name string
		bind *pgproto3.Bind
		id   int
		tok  string
	}{
		{"no codes (text)", &pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, 1, "61"},
		{"one text code", &pgproto3.Bind{PreparedStatement: "s1", ParameterFormatCodes: []int16{0}, Parameters: [][]byte{[]byte("1")}}, 1, "62"},
		{"one binary code for all", &pgproto3.Bind{PreparedStatement: "s1", ParameterFormatCodes: []int16{1}, Parameters: [][]byte{bin8(2)}}, 2, "63"},
		{"a code per parameter", &pgproto3.Bind{PreparedStatement: "s2", ParameterFormatCodes: []int16{1, 0}, Parameters: [][]byte{bin8(3), []byte("x")}}, 3, "0064"},
		{"binary results too", &pgproto3.Bind{PreparedStatement: "s2", ParameterFormatCodes: []int16{0, 0}, Parameters: [][]byte{[]byte("3"), []byte("y")}, ResultFormatCodes: []int16{1}}, 3, "65"},
	} {
		a.q("SET fence.token = '" + tc.tok + "'")
		if errs, _ := a.rt(tc.bind, &pgproto3.Execute{}, &pgproto3.Sync{}); len(errs) > 0 {
			t.Errorf("%s: %s", tc.name, atkErrs(errs))
		}
		want := strings.TrimLeft(tc.tok, "0")
		if _, f := rowOf(t, d, tc.id); strconv.FormatInt(f, 10) != want {
			t.Errorf("%s: row %d fence %d, want %s", tc.name, tc.id, f, want)
		}
	}
	a.q("SET fence.token = '60'")

	// The wrong number of parameters: PostgreSQL's error, counting the
	// client's; nothing written.
	before := atkRows(t, d, "acct")
	errs, _ := a.rt(&pgproto3.Bind{PreparedStatement: "s2", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "08P01" || errs[0].Message != `bind message supplies 1 parameters, but prepared statement "s2" requires 2` {
		t.Errorf("a Bind of 1 value for s2: %s", atkErrs(errs))
	}
	errs, _ = a.rt(&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1"), []byte("999")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "08P01" || errs[0].Message != `bind message supplies 2 parameters, but prepared statement "s1" requires 1` {
		t.Errorf("a Bind of s1 with a token of the client's own: %s", atkErrs(errs))
	}
	atkWantRows(t, d, before)

	// A stale token: FP001, nothing written, the same error as the form
	// that reads the setting gives.
	a.q("SET fence.token = '50'")
	errs, _ = a.rt(&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	a.q("PREPARE sql_upd(bigint) AS " + atkUpd)
	errs2, _ := a.rt(&pgproto3.Query{String: "EXECUTE sql_upd(1)"})
	if len(errs) != 1 || errs[0].Code != "FP001" || len(errs2) != 1 || errs[0].Message != errs2[0].Message || errs[0].Detail != errs2[0].Detail || errs[0].Hint != errs2[0].Hint {
		t.Errorf("stale token 50: parameter form %s; the form reading the setting %s", atkErrs(errs), atkErrs(errs2))
	}
	atkWantRows(t, d, before)

	// Stored code that runs the statement by name must give a token of its
	// own: with the client's parameters alone it fails.
	a.q("SET fence.token = '66'")
	errs, _ = a.rt(&pgproto3.Query{String: "DO $$ BEGIN EXECUTE 'EXECUTE s1(1)'; END $$"})
	if len(errs) != 1 {
		t.Errorf("EXECUTE s1(1) in stored code: %s, want an error", atkErrs(errs))
	}
	atkWantRows(t, d, before)

	// EXECUTE by SQL: the statement is prepared again in the form that
	// reads the setting, and runs with the session's token.
	errs, _ = a.rt(&pgproto3.Query{String: "EXECUTE s1(1)"})
	if len(errs) > 0 {
		t.Errorf("EXECUTE s1(1): %s", atkErrs(errs))
	}
	if n, f := rowOf(t, d, 1); int64(n) != before[1][0]+1 || f != 66 {
		t.Errorf("row 1 after EXECUTE s1(1) with 66: n %d fence %d; want %d and 66", n, f, before[1][0]+1)
	}
	if q := a.a2Stmt("s1"); a2Form(q) != "setting" {
		t.Errorf("s1 after EXECUTE: %s, want the form that reads the setting", q)
	}
	if oids := tpDescribe(t, a, "s1"); len(oids) != 1 {
		t.Errorf("Describe s1 in the setting's form: %v", oids)
	}
	// And by Bind from then on, in that form.
	a.q("SET fence.token = '67'")
	if errs, _ := a.rt(&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Errorf("Bind of s1 after EXECUTE: %s", atkErrs(errs))
	}
	if _, f := rowOf(t, d, 1); f != 67 {
		t.Errorf("row 1: fence %d, want 67", f)
	}
}

// TestTokenParamInvalidToken: bound without a valid token, the statement is
// prepared again in the form that reads the setting, whose error the client
// gets; with a valid token again it writes it.
func TestTokenParamInvalidToken(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	if _, err := c.Prepare(ctxT(t), "s1", atkUpd); err != nil {
		t.Fatal(err)
	}
	if q := preparedText(t, c, "s1"); !tokenParam(q) {
		t.Fatalf("s1: %s", q)
	}
	for _, tok := range []string{"", "abc", "9223372036854775808", "-1", "0"} {
		if tok == "" {
			resetToken(t, c)
		} else {
			setToken(t, c, tok)
		}
		_, err := c.Exec(ctxT(t), "s1", 1)
		if sqlState(err) != "FP002" {
			t.Errorf("token %q: %v, want FP002", tok, err)
		}
		if q := preparedText(t, c, "s1"); tokenParam(q) {
			t.Errorf("token %q: s1 still in the parameter form", tok)
		}
	}
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
	setToken(t, c, "70")
	if _, err := c.Exec(ctxT(t), "s1", 1); err != nil {
		t.Fatal(err)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 70}, 2: {0, 55}, 3: {0, 55}})
}

// TestTokenParamPortal: a portal of the parameter form holds its Bind's
// token, so the proxy closes it when something runs before its Execute and
// binds it again at the Execute with the token then; SQL that runs it by
// name in between finds no portal; a Parse between Bind and Execute leaves
// it open.
func TestTokenParamPortal(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	if _, err := c.Prepare(ctxT(t), "s1", atkUpd+" RETURNING n"); err != nil {
		t.Fatal(err)
	}
	a := atkHijack(t, c)

	// FETCH by SQL between Bind and Execute, token unchanged: the portal
	// is gone (the server says so), nothing is written; the transaction
	// fails.
	a.q("BEGIN")
	if errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	errs, _ := a.rt(&pgproto3.Query{String: "FETCH ALL FROM p"})
	if len(errs) != 1 || errs[0].Code != "34000" {
		t.Errorf("FETCH ALL FROM p after its Bind: %s; want 34000", atkErrs(errs))
	}
	a.q("ROLLBACK")
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})

	// A refcursor in stored code, after a SET: the same.
	a.q("BEGIN")
	if errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	a.q("SET LOCAL fence.token = '50'")
	errs, _ = a.rt(&pgproto3.Query{String: "DO $$ DECLARE c refcursor := 'p'; r record; BEGIN FETCH c INTO r; END $$"})
	if len(errs) != 1 {
		t.Errorf("FETCH through a refcursor: %s; want an error", atkErrs(errs))
	}
	a.q("ROLLBACK")
	atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})

	// Bound with 60, then 70 set by a Query: the Execute writes 70.
	a.q("BEGIN")
	if errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	a.q("SET LOCAL fence.token = '70'")
	if errs, tags := a.rt(&pgproto3.Execute{Portal: "p"}, &pgproto3.Sync{}); len(errs) > 0 || len(tags) != 1 || tags[0] != "UPDATE 1" {
		t.Errorf("Execute p after SET 70: %s %v", atkErrs(errs), tags)
	}
	a.q("COMMIT")
	atkWantRows(t, d, map[int64][2]int64{1: {1, 70}, 2: {0, 55}, 3: {0, 55}})

	// Outside a transaction block the Sync ends the portal: its Execute
	// gets the server's answer, nothing is written.
	if errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s1", Parameters: [][]byte{[]byte("2")}}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	errs, _ = a.rt(&pgproto3.Execute{Portal: "p"}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "34000" {
		t.Errorf("Execute of a portal after the Sync that ended it: %s; want 34000", atkErrs(errs))
	}
	// Bound inside a savepoint rolled back: gone too.
	a.q("BEGIN")
	a.q("SAVEPOINT a")
	if errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s1", Parameters: [][]byte{[]byte("2")}}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	a.q("ROLLBACK TO SAVEPOINT a")
	errs, _ = a.rt(&pgproto3.Execute{Portal: "p"}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "34000" {
		t.Errorf("Execute of a portal bound in a savepoint rolled back: %s; want 34000", atkErrs(errs))
	}
	a.q("ROLLBACK")
	atkWantRows(t, d, map[int64][2]int64{1: {1, 70}, 2: {0, 55}, 3: {0, 55}})

	// The unnamed portal, then a Parse of the unnamed statement and its
	// Execute: the portal runs, with its Bind's token.
	a.q("SET fence.token = '71'")
	errs, tags := a.rt(&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("3")}},
		&pgproto3.Parse{Query: "SELECT 1"}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) > 0 || len(tags) != 1 || tags[0] != "UPDATE 1" {
		t.Errorf("Bind, Parse, Execute: %s %v", atkErrs(errs), tags)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 70}, 2: {0, 55}, 3: {1, 71}})
}
