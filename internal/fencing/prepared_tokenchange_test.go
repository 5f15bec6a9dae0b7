package fencing_test

import (
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// preparedText is what the server has under a prepared statement's name.
func preparedText(t *testing.T, c *pgx.Conn, name string) string {
	t.Helper()
	var q string
	if err := c.QueryRow(ctxT(t), "SELECT statement FROM pg_prepared_statements WHERE name = $1", name).Scan(&q); err != nil {
		t.Fatalf("prepared statement %s: %v", name, err)
	}
	return q
}

// rowOf reads n and last_fence of acct's row id, on a direct connection.
func rowOf(t *testing.T, d *pgx.Conn, id int) (n int, fence int64) {
	t.Helper()
	if err := d.QueryRow(ctxT(t), "SELECT n, last_fence FROM acct WHERE id = $1", id).Scan(&n, &fence); err != nil {
		t.Fatal(err)
	}
	return n, fence
}

// TestPreparedTokenChange: a prepared statement keeps no token of its own,
// whatever token the session had at its Parse (it is sent in the parameter
// form, the token bound at each Bind, or in the form reading the setting),
// across changes of the token between its Binds, and the rows written
// carry the session's token every time. A portal bound with one token and
// run once the session's token is another writes the later one.
func TestPreparedTokenChange(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startRaisersEnv(t)
	db := e.newDB(t)
	d := direct(t, db)
	c := e.connect(t, db)
	const upd = "UPDATE acct SET n = n + 1 WHERE id = $1"
	settingForm := keepsNoToken
	exec := func(name string, id int) {
		t.Helper()
		if _, err := c.Exec(ctxT(t), name, id); err != nil {
			t.Fatalf("execute %s: %v", name, err)
		}
	}
	prepare := func(name string) {
		t.Helper()
		if _, err := c.Prepare(ctxT(t), name, upd); err != nil {
			t.Fatalf("prepare %s: %v", name, err)
		}
	}

	// Parsed with token 60: it reads the setting, and writes 60.
	setToken(t, c, "60")
	prepare("soon")
	if q := preparedText(t, c, "soon"); !settingForm(q) {
		t.Fatalf("prepared with token 60: %s", q)
	}
	exec("soon", 1)
	if n, f := rowOf(t, d, 1); n != 1 || f != 60 {
		t.Fatalf("row 1: n %d, fence %d; want 1 and 60", n, f)
	}
	// The token changes after one Bind: the next Binds write 61.
	setToken(t, c, "61")
	for range 10 {
		exec("soon", 1)
	}
	if q := preparedText(t, c, "soon"); !settingForm(q) {
		t.Fatalf("after a change of token at the second Bind: %s", q)
	}
	if n, f := rowOf(t, d, 1); n != 11 || f != 61 {
		t.Fatalf("row 1: n %d, fence %d; want 11 and 61", n, f)
	}

	// Bound 8 times with token 61, then changed to 62 (spelled 0062).
	prepare("often")
	for range 8 {
		exec("often", 2)
	}
	setToken(t, c, "0062")
	exec("often", 2)
	if q := preparedText(t, c, "often"); !settingForm(q) {
		t.Fatalf("after 8 Binds with 61 and a change to 0062: %s", q)
	}
	if n, f := rowOf(t, d, 2); n != 9 || f != 62 {
		t.Fatalf("row 2: n %d, fence %d; want 9 and 62", n, f)
	}

	// A stale token: the same error whether the statement was parsed with
	// a token or without one, nothing written.
	stale := func(name string) *pgconn.PgError {
		t.Helper()
		_, err := c.Exec(ctxT(t), name, 2)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) {
			t.Fatalf("%s with a stale token: %v, want an error", name, err)
		}
		return pe
	}
	setToken(t, c, "55")
	prepare("stale_tok")
	if q := preparedText(t, c, "stale_tok"); !settingForm(q) {
		t.Fatalf("prepared with token 55: %s", q)
	}
	got := stale("stale_tok")
	resetToken(t, c)
	prepare("stale_set")
	setToken(t, c, "55")
	want := stale("stale_set")
	if q := preparedText(t, c, "stale_set"); !settingForm(q) {
		t.Fatalf("prepared without a token: %s", q)
	}
	if got.Code != "FP001" || got.Code != want.Code || got.Message != want.Message || got.Detail != want.Detail || got.Hint != want.Hint {
		t.Errorf("stale token:\n parsed with 55: %s %s %s %s\n setting:    %s %s %s %s", got.Code, got.Message, got.Detail, got.Hint, want.Code, want.Message, want.Detail, want.Hint)
	}
	// The token removed: FP002.
	for range 8 {
		setToken(t, c, "62")
		exec("often", 2)
	}
	resetToken(t, c)
	if pe := stale("often"); pe.Code != "FP002" {
		t.Errorf("without a token: %s %s, want FP002", pe.Code, pe.Message)
	}
	if q := preparedText(t, c, "often"); !settingForm(q) {
		t.Fatalf("after the token was removed: %s", q)
	}
	if n, f := rowOf(t, d, 2); n != 17 || f != 62 {
		t.Fatalf("row 2: n %d, fence %d; want 17 and 62", n, f)
	}

	// Parsed without a token, then bound 9 times with one.
	prepare("upgrade")
	setToken(t, c, "63")
	for range 8 {
		exec("upgrade", 3)
	}
	if q := preparedText(t, c, "upgrade"); !settingForm(q) {
		t.Fatalf("after 8 Binds: %s", q)
	}
	exec("upgrade", 3)
	if q := preparedText(t, c, "upgrade"); !settingForm(q) {
		t.Fatalf("after 9 Binds: %s", q)
	}
	if n, f := rowOf(t, d, 3); n != 9 || f != 63 {
		t.Fatalf("row 3: n %d, fence %d; want 9 and 63", n, f)
	}

	// A portal bound with token 63, then the token set to 64 before it
	// runs: it writes 64.
	prepare("portal")
	if q := preparedText(t, c, "portal"); !settingForm(q) {
		t.Fatalf("prepared with token 63: %s", q)
	}
	a := atkHijack(t, c)
	roundTrip := func(msgs ...pgproto3.FrontendMessage) []pgproto3.ErrorResponse {
		t.Helper()
		errs, _ := a.rt(msgs...)
		return errs
	}
	// The unnamed portal, with a SET through a named portal between its
	// Bind and its Execute, in a transaction: it runs with the token the
	// session has then, as the form that reads the setting would (its
	// guard fails for another token), whether the token is another or
	// the same spelled otherwise.
	for _, tc := range []struct{ tok string }{{"'64'"}, {"'00064'"}} {
		if errs := roundTrip(&pgproto3.Query{String: "BEGIN"}); len(errs) > 0 {
			t.Fatalf("BEGIN: %s", errs[0].Message)
		}
		errs := roundTrip(
			&pgproto3.Bind{PreparedStatement: "portal", Parameters: [][]byte{[]byte("3")}},
			&pgproto3.Parse{Name: "set_tok", Query: "SET fence.token = " + tc.tok},
			&pgproto3.Bind{DestinationPortal: "set", PreparedStatement: "set_tok"},
			&pgproto3.Execute{Portal: "set"},
			&pgproto3.Close{ObjectType: 'S', Name: "set_tok"},
			&pgproto3.Execute{},
			&pgproto3.Sync{})
		if len(errs) > 0 {
			t.Errorf("token %s: %s", tc.tok, errs[0].Message)
		}
		if errs := roundTrip(&pgproto3.Query{String: "COMMIT"}); len(errs) > 0 {
			t.Fatalf("COMMIT: %s", errs[0].Message)
		}
	}
	if n, f := rowOf(t, d, 3); n != 11 || f != 64 {
		t.Fatalf("row 3: n %d, fence %d; want 11 and 64 (each portal wrote with the token set before its Execute)", n, f)
	}
	// So does a named portal: bound, then the token set to 65 before its
	// Execute, it writes 65.
	if errs := roundTrip(&pgproto3.Query{String: "BEGIN"}); len(errs) > 0 {
		t.Fatal(errs[0].Message)
	}
	if errs := roundTrip(&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "portal", Parameters: [][]byte{[]byte("3")}}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatalf("Bind p: %s", errs[0].Message)
	}
	if errs := roundTrip(&pgproto3.Query{String: "SET fence.token = '65'"}); len(errs) > 0 {
		t.Fatal(errs[0].Message)
	}
	if errs := roundTrip(&pgproto3.Execute{Portal: "p"}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatalf("Execute p: %s", errs[0].Message)
	}
	if errs := roundTrip(&pgproto3.Query{String: "COMMIT"}); len(errs) > 0 {
		t.Fatal(errs[0].Message)
	}
	if n, f := rowOf(t, d, 3); n != 12 || f != 65 {
		t.Fatalf("row 3: n %d, fence %d; want 12 and 65 (the named portal ran with the session's token)", n, f)
	}
}

// tokenWrittenIn returns the token a rewritten text has written in (a
// token form reads no setting); "" for the form that reads the setting.
// tokenParam reports whether q is in the parameter form: its fences
// compare with a parameter of the statement ($k::bigint), which the proxy
// binds to the token at every Bind, and hold no token.
func tokenParam(q string) bool {
	return !regexp.MustCompile(`'[0-9]+'::bigint`).MatchString(q) &&
		regexp.MustCompile(`OPERATOR\(pg_catalog\.<=\) \$[0-9]+::bigint`).MatchString(q)
}

// keepsNoToken reports whether q, a prepared statement's text, holds no
// token of its own: it reads the setting, or takes the token as a
// parameter.
func keepsNoToken(q string) bool {
	return tokenWrittenIn(q) == "" && (strings.Contains(q, "pg_catalog.current_setting") || tokenParam(q))
}

func tokenWrittenIn(q string) string {
	if strings.Contains(q, "pg_catalog.current_setting") {
		return ""
	}
	m := regexp.MustCompile(`'([0-9]+)'::bigint`).FindAllStringSubmatch(q, -1)
	if m == nil {
		return ""
	}
	for _, g := range m {
		if g[1] != m[0][1] {
			return ""
		}
	}
	return m[0][1]
}
