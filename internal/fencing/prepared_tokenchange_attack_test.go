package fencing_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Attacks on the token form of prepared statements (commit 77166f4): every
// check reads the rows on a direct connection afterwards. The invariant: a
// write to a protected table lands only with the token the session has
// (per the proxy's record) when the write runs; a stale or missing token
// is refused.
//
// They were written against a token form for prepared statements that
// kept the token as a constant, since withdrawn: a statement "in the token
// form of N" is now one parsed while the session's token was N, which the
// server keeps in the parameter form (the token bound at each Bind) or in
// the form that reads the setting. The outcomes asserted are the same: the
// rows carry the session's token at each run.

// atkRaw is a hijacked connection for sending protocol messages by hand.
type atkRaw struct {
	t  *testing.T
	fe *pgproto3.Frontend
}

func atkHijack(t *testing.T, c *pgx.Conn) *atkRaw {
	t.Helper()
	hc, err := c.PgConn().Hijack()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = hc.Conn.Close() })
	return &atkRaw{t: t, fe: hc.Frontend}
}

// rt sends msgs and reads up to ReadyForQuery; it returns the errors and
// the CommandComplete tags.
func (a *atkRaw) rt(msgs ...pgproto3.FrontendMessage) (errs []pgproto3.ErrorResponse, tags []string) {
	a.t.Helper()
	errs, tags, _ = a.tpPipe(1, msgs...)
	return errs, tags
}

// value runs a simple Query that must succeed and returns the first
// column of its last row ("" for none).
func (a *atkRaw) value(sql string) string {
	a.t.Helper()
	a.fe.Send(&pgproto3.Query{String: sql})
	if err := a.fe.Flush(); err != nil {
		a.t.Fatal(err)
	}
	var out string
	for {
		m, err := a.fe.Receive()
		if err != nil {
			a.t.Fatal(err)
		}
		switch m := m.(type) {
		case *pgproto3.DataRow:
			out = string(m.Values[0])
		case *pgproto3.ErrorResponse:
			a.t.Fatalf("%s: %s", sql, m.Message)
		case *pgproto3.ReadyForQuery:
			return out
		}
	}
}

// q runs a simple Query that must succeed.
func (a *atkRaw) q(sql string) []string {
	a.t.Helper()
	errs, tags := a.rt(&pgproto3.Query{String: sql})
	if len(errs) > 0 {
		a.t.Fatalf("%s: %s %s", sql, errs[0].Code, errs[0].Message)
	}
	return tags
}

func atkErrs(errs []pgproto3.ErrorResponse) string {
	var b strings.Builder
	for _, e := range errs {
		b.WriteString(e.Code + " " + e.Message + "; ")
	}
	return b.String()
}

// atkSetup starts a proxy with the raisers, a database whose acct row 1
// has last_fence 55, a proxy connection with token 60 and a direct one.
func atkSetup(t *testing.T) (c *pgx.Conn, d *pgx.Conn) {
	t.Helper()
	c, d, _, _ = atkSetupEnv(t)
	return c, d
}

func atkSetupEnv(t *testing.T, edit ...func(*pgx.ConnConfig)) (c *pgx.Conn, d *pgx.Conn, e *env, db string) {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL")
	e = startRaisersEnv(t)
	db = e.newDB(t)
	d = direct(t, db)
	if _, err := d.Exec(ctxT(t), "UPDATE acct SET last_fence = 55"); err != nil {
		t.Fatal(err)
	}
	c = e.connect(t, db, edit...)
	setToken(t, c, "60")
	return c, d, e, db
}

const atkUpd = "UPDATE acct SET n = n + 1 WHERE id = $1"

// atkForms are the two ways a statement is prepared: "token" (the session
// has token 60 at the Parse) and "setting" (no token at the Parse). Both
// give a form that keeps no token (the parameter form, or the form that
// reads the setting); the attacks run on both.
var atkForms = []string{"token", "setting"}

// atkPrepare prepares sql as name in form, leaving the session's token
// at 60.
func atkPrepare(t *testing.T, c *pgx.Conn, form, name, sql string) {
	t.Helper()
	if form == "setting" {
		resetToken(t, c)
	} else {
		setToken(t, c, "60")
	}
	if _, err := c.Prepare(ctxT(t), name, sql); err != nil {
		t.Fatal(err)
	}
	q := preparedText(t, c, name)
	if !keepsNoToken(q) {
		t.Fatalf("prepared (%s): %s; want a form that keeps no token (reads the setting or takes it as a parameter)", form, q)
	}
	setToken(t, c, "60")
}

// TestPreparedTokenChangeAttackSQLExecute: a named protocol-level statement
// prepared in the token form of 60, then the token set to 50 (stale: the
// row's last_fence is 55), then run by SQL EXECUTE (which reaches the same
// server-side statement as a Bind would). The write must be refused; it
// must not land with 60. With a newer token (70) it lands with 70, in
// either form.
func TestPreparedTokenChangeAttackSQLExecute(t *testing.T) {
	t.Parallel()
	for _, form := range atkForms {
		t.Run(form, func(t *testing.T) {
			t.Parallel()
			c, d := atkSetup(t)
			atkPrepare(t, c, form, "s1", atkUpd)
			exec := func(sql string) error {
				_, err := c.Exec(ctxT(t), sql, pgx.QueryExecModeSimpleProtocol)
				return err
			}
			// Stale: 50 < 55.
			setToken(t, c, "50")
			err := exec("EXECUTE s1(1)")
			n, f := rowOf(t, d, 1)
			t.Logf("EXECUTE s1(1) with token 50: err %v; row 1: n %d, last_fence %d", err, n, f)
			if err == nil || n != 0 || f != 55 {
				t.Errorf("stale token 50 (row at 55): EXECUTE gave err %v and row 1 n %d last_fence %d; want refused, row unchanged (n 0, 55)", err, n, f)
			}
			// A newer token: the write carries the session's, whether 60
			// is written in (its guard fails) or not.
			setToken(t, c, "70")
			err = exec("EXECUTE s1(2)")
			n, f = rowOf(t, d, 2)
			t.Logf("EXECUTE s1(2) with token 70: err %v; row 2: n %d, last_fence %d", err, n, f)
			if err != nil || n != 1 || f != 70 {
				t.Errorf("token 70: EXECUTE gave err %v, row 2 n %d last_fence %d; want n 1, 70", err, n, f)
			}
			// Back to 60, the token written in, now stale for row 2.
			setToken(t, c, "60")
			err = exec("EXECUTE s1(2)")
			if n, f = rowOf(t, d, 2); err == nil || n != 1 || f != 70 {
				t.Errorf("token 60 after 70: EXECUTE gave err %v, row 2 n %d last_fence %d; want refused, row unchanged", err, n, f)
			}
			// No token: refused (missing_token: reject).
			resetToken(t, c)
			err = exec("EXECUTE s1(3)")
			n, f = rowOf(t, d, 3)
			t.Logf("EXECUTE s1(3) without a token: err %v; row 3: n %d, last_fence %d", err, n, f)
			if err == nil || n != 0 || f != 55 {
				t.Errorf("no token: EXECUTE gave err %v and row 3 n %d last_fence %d; want refused, row unchanged (n 0, 55)", err, n, f)
			}
			// The same through the extended protocol (a Parse of EXECUTE).
			setToken(t, c, "50")
			_, err = c.Exec(ctxT(t), "EXECUTE s1(1)", pgx.QueryExecModeDescribeExec)
			n, f = rowOf(t, d, 1)
			t.Logf("extended EXECUTE s1(1) with token 50: err %v; row 1: n %d, last_fence %d", err, n, f)
			if err == nil || f == 50 || (form == "setting" && n != 0) {
				t.Errorf("stale token 50: extended EXECUTE gave err %v and row 1 n %d last_fence %d; want refused", err, n, f)
			}
			// EXPLAIN ANALYZE EXECUTE runs it too.
			before, _ := rowOf(t, d, 1)
			_, err = c.Exec(ctxT(t), "EXPLAIN ANALYZE EXECUTE s1(1)", pgx.QueryExecModeSimpleProtocol)
			n, f = rowOf(t, d, 1)
			t.Logf("EXPLAIN ANALYZE EXECUTE s1(1) with token 50: err %v; row 1: n %d, last_fence %d", err, n, f)
			if n != before {
				t.Errorf("stale token 50: EXPLAIN ANALYZE EXECUTE wrote row 1: n %d last_fence %d", n, f)
			}
		})
	}
}

// TestPreparedTokenChangeAttackFetchPortal: a portal of the token form of 60
// (UPDATE ... RETURNING), then the token set to 50 (stale) in the same
// transaction, then FETCH / MOVE on the portal by SQL: PostgreSQL runs the
// portal's UPDATE at its first FETCH, with no Execute message for the
// proxy's check (checkPortalToken) to see.
func TestPreparedTokenChangeAttackFetchPortal(t *testing.T) {
	t.Parallel()
	for _, form := range atkForms {
		for _, cmd := range []string{"FETCH ALL FROM p", "MOVE ALL IN p"} {
			t.Run(form+"/"+strings.Fields(cmd)[0], func(t *testing.T) {
				t.Parallel()
				c, d := atkSetup(t)
				atkPrepare(t, c, form, "s1", atkUpd+" RETURNING n")
				a := atkHijack(t, c)
				a.q("BEGIN")
				if errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Sync{}); len(errs) > 0 {
					t.Fatalf("Bind: %s", atkErrs(errs))
				}
				a.q("SET fence.token = '50'")
				errs, tags := a.rt(&pgproto3.Query{String: cmd})
				if len(errs) == 0 {
					a.q("COMMIT")
				} else {
					a.q("ROLLBACK")
				}
				n, f := rowOf(t, d, 1)
				t.Logf("%s with token 50: errors %s tags %v; row 1: n %d, last_fence %d", cmd, atkErrs(errs), tags, n, f)
				if n != 0 || f != 55 {
					t.Errorf("stale token 50 (row at 55): %s on a portal bound with 60 wrote row 1 n %d last_fence %d; want unchanged (n 0, 55)", cmd, n, f)
				}
			})
		}
	}
}

// TestPreparedTokenChangeAttackDuplicatePortalSavepoint: a portal p of the
// token form of 60 in a transaction; in a savepoint, a second Bind of p
// (from an unfenced statement) fails on the server, and the proxy's entry
// for p becomes the failed Bind's; ROLLBACK TO brings the transaction back
// with the first portal p still open. Then the token is set to 50 (stale)
// and p is executed.
func TestPreparedTokenChangeAttackDuplicatePortalSavepoint(t *testing.T) {
	t.Parallel()
	for _, form := range atkForms {
		t.Run(form, func(t *testing.T) {
			t.Parallel()
			c, d := atkSetup(t)
			atkPrepare(t, c, form, "s1", atkUpd)
			if _, err := c.Prepare(ctxT(t), "plain", "SELECT 1"); err != nil {
				t.Fatal(err)
			}
			a := atkHijack(t, c)
			a.q("BEGIN")
			if errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Sync{}); len(errs) > 0 {
				t.Fatalf("Bind: %s", atkErrs(errs))
			}
			a.q("SAVEPOINT s")
			errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "plain"}, &pgproto3.Sync{})
			t.Logf("second Bind of p: %s", atkErrs(errs))
			a.q("ROLLBACK TO SAVEPOINT s")
			a.q("SET fence.token = '50'")
			errs, tags := a.rt(&pgproto3.Execute{Portal: "p"}, &pgproto3.Sync{})
			if len(errs) == 0 {
				a.q("COMMIT")
			} else {
				a.q("ROLLBACK")
			}
			n, f := rowOf(t, d, 1)
			t.Logf("Execute p with token 50: errors %s tags %v; row 1: n %d, last_fence %d", atkErrs(errs), tags, n, f)
			if n != 0 || f != 55 {
				t.Errorf("stale token 50 (row at 55): the first portal p ran: row 1 n %d last_fence %d; want unchanged (n 0, 55)", n, f)
			}
		})
	}
}

// atkRows reads every acct row's n and last_fence on d.
func atkRows(t *testing.T, d *pgx.Conn, table string) map[int64][2]int64 {
	t.Helper()
	rows, err := d.Query(ctxT(t), "SELECT id, n, last_fence FROM "+table+" ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64][2]int64{}
	for rows.Next() {
		var id, n, f int64
		if err := rows.Scan(&id, &n, &f); err != nil {
			t.Fatal(err)
		}
		out[id] = [2]int64{n, f}
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	return out
}

func atkWantRows(t *testing.T, d *pgx.Conn, want map[int64][2]int64) {
	t.Helper()
	got := atkRows(t, d, "acct")
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("acct rows (id: [n last_fence]): %v; want %v", got, want)
	}
}

// TestPreparedTokenChangeAttackPipelineSetConfig: set_config of the token by
// a Bind and Execute in the same pipeline (no Sync in between) as the
// Binds of a statement prepared in the token form: each write carries the
// token set just before it, whether the statement had fewer or more than
// 8 Binds with the old one; a stale one in the pipeline is refused.
func TestPreparedTokenChangeAttackPipelineSetConfig(t *testing.T) {
	t.Parallel()
	for _, binds := range []int{1, 9} {
		t.Run(fmt.Sprint(binds), func(t *testing.T) {
			t.Parallel()
			c, d := atkSetup(t)
			atkPrepare(t, c, "token", "s1", atkUpd)
			for range binds - 1 {
				if _, err := c.Exec(ctxT(t), "s1", 3); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := c.Prepare(ctxT(t), "cfg", "SELECT pg_catalog.set_config('fence.token', $1, false)"); err != nil {
				t.Fatal(err)
			}
			a := atkHijack(t, c)
			set := func(tok string) []pgproto3.FrontendMessage {
				return []pgproto3.FrontendMessage{&pgproto3.Bind{PreparedStatement: "cfg", Parameters: [][]byte{[]byte(tok)}}, &pgproto3.Execute{}}
			}
			upd := func(id string) []pgproto3.FrontendMessage {
				return []pgproto3.FrontendMessage{&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte(id)}}, &pgproto3.Execute{}}
			}
			var msgs []pgproto3.FrontendMessage
			msgs = append(msgs, set("70")...)
			msgs = append(msgs, upd("1")...)
			msgs = append(msgs, set("0080")...)
			msgs = append(msgs, upd("2")...)
			msgs = append(msgs, upd("2")...)
			msgs = append(msgs, set("60")...)
			msgs = append(msgs, set("90")...)
			msgs = append(msgs, upd("1")...)
			msgs = append(msgs, &pgproto3.Sync{})
			errs, tags := a.rt(msgs...)
			if len(errs) > 0 {
				t.Fatalf("pipeline: %s", atkErrs(errs))
			}
			t.Logf("tags %v", tags)
			want := map[int64][2]int64{1: {2, 90}, 2: {2, 80}, 3: {int64(binds - 1), map[bool]int64{true: 55, false: 60}[binds == 1]}}
			atkWantRows(t, d, want)
			// A stale token in the pipeline: refused, the pipeline's
			// implicit transaction rolled back.
			msgs = append(set("95"), upd("1")...)
			msgs = append(msgs, set("50")...)
			msgs = append(msgs, upd("2")...)
			msgs = append(msgs, &pgproto3.Sync{})
			errs, _ = a.rt(msgs...)
			if len(errs) != 1 || errs[0].Code != "FP001" {
				t.Errorf("stale token in a pipeline: %s; want FP001", atkErrs(errs))
			}
			atkWantRows(t, d, want)
			// The same with the token removed in the pipeline: FP002.
			msgs = append(set("95"), upd("1")...)
			msgs = append(msgs, set("")...)
			msgs = append(msgs, upd("2")...)
			msgs = append(msgs, &pgproto3.Sync{})
			errs, _ = a.rt(msgs...)
			if len(errs) != 1 || errs[0].Code != "FP002" {
				t.Errorf("empty token in a pipeline: %s; want FP002", atkErrs(errs))
			}
			atkWantRows(t, d, want)
		})
	}
}

// atkModes are the pgx modes that prepare (named or unnamed).
var atkModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement,
	pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec,
}

// TestPreparedTokenChangeAttackEveryExecution: the token changes before
// every execution (rising, with leading zeros, sometimes the same one,
// runs of 8 and more with one token), in each pgx mode: every write
// returns and stores the session's token, a stale one is refused, and
// the server ends with no statement other than pgx's own.
func TestPreparedTokenChangeAttackEveryExecution(t *testing.T) {
	t.Parallel()
	for _, mode := range atkModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			c, d := atkSetup(t)
			const q = "UPDATE acct SET n = n + 1 WHERE id = $1 RETURNING n, last_fence"
			tok := int64(60)
			n := int64(0)
			run := func(spell string, want int64) {
				t.Helper()
				setToken(t, c, spell)
				var gn, gf int64
				if err := c.QueryRow(ctxT(t), q, mode, 1).Scan(&gn, &gf); err != nil {
					t.Fatalf("token %s: %v", spell, err)
				}
				n++
				if gn != n || gf != want {
					t.Fatalf("token %s: returned n %d last_fence %d; want %d and %d", spell, gn, gf, n, want)
				}
				if rn, rf := rowOf(t, d, 1); int64(rn) != n || rf != want {
					t.Fatalf("token %s: row 1 n %d last_fence %d; want %d and %d", spell, rn, rf, n, want)
				}
			}
			for i := range 40 {
				switch {
				case i%10 < 9 && i >= 10 && i < 20:
					// a run with one token, spelled otherwise
					run(fmt.Sprintf("%0*d", 1+i%4, tok), tok)
				default:
					tok += int64(1 + i%3)
					run(fmt.Sprint(tok), tok)
				}
			}
			// Stale, after a long run with one token.
			for range 10 {
				run(fmt.Sprint(tok), tok)
			}
			setTokenN(t, c, tok-1)
			_, err := c.Exec(ctxT(t), q, mode, 1)
			if sqlState(err) != "FP001" {
				t.Errorf("stale token %d: %v; want FP001", tok-1, err)
			}
			if rn, rf := rowOf(t, d, 1); int64(rn) != n || rf != tok {
				t.Errorf("after the stale write: row 1 n %d last_fence %d; want %d and %d", rn, rf, n, tok)
			}
			// The server has only pgx's statements.
			rows, err := c.Query(ctxT(t), "SELECT name, statement FROM pg_prepared_statements", pgx.QueryExecModeSimpleProtocol)
			if err != nil {
				t.Fatal(err)
			}
			for rows.Next() {
				var name, st string
				if err := rows.Scan(&name, &st); err != nil {
					t.Fatal(err)
				}
				// (The lock registration's statement is kept by design.)
				if strings.HasPrefix(name, "fenceproxy_") && !strings.HasPrefix(name, "fenceproxy_register_") {
					t.Errorf("server has the proxy's statement %s: %s", name, st)
				}
			}
			if rows.Err() != nil {
				t.Fatal(rows.Err())
			}
		})
	}
}

// TestPreparedTokenChangeAttackBatch: pgx Batches that set the token and
// write, several times, in one round trip (one Sync), in each mode.
func TestPreparedTokenChangeAttackBatch(t *testing.T) {
	t.Parallel()
	for _, mode := range atkModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			c, d := atkSetup(t)
			const q = "UPDATE acct SET n = n + 1 WHERE id = $1 RETURNING last_fence"
			// Warm up the statement: 10 runs with 60.
			for range 10 {
				if _, err := c.Exec(ctxT(t), q, mode, 3); err != nil {
					t.Fatal(err)
				}
			}
			b := &pgx.Batch{}
			toks := []string{"61", "61", "0062", "70", "70", "70", "70", "70", "70", "70", "70", "70", "71", "9223372036854775807"}
			for i, tok := range toks {
				b.Queue("SELECT pg_catalog.set_config('fence.token', $1, false)", tok)
				b.Queue(q, 1+int64(i%2))
			}
			res := c.SendBatch(ctxT(t), b)
			for i, tok := range toks {
				if _, err := res.Exec(); err != nil {
					t.Fatalf("set %s: %v", tok, err)
				}
				var f int64
				if err := res.QueryRow().Scan(&f); err != nil {
					t.Fatalf("write %d with %s: %v", i, tok, err)
				}
				want, _ := rules.CanonicalToken(tok)
				if fmt.Sprint(f) != want {
					t.Errorf("write %d with token %s returned last_fence %d", i, tok, f)
				}
			}
			if err := res.Close(); err != nil {
				t.Fatal(err)
			}
			atkWantRows(t, d, map[int64][2]int64{1: {7, 71}, 2: {7, 9223372036854775807}, 3: {10, 60}})
			// Then a stale write and an out-of-range token in a batch: refused.
			for _, tok := range []string{"70", "9223372036854775808", "-5", "0", "abc", " 70"} {
				b := &pgx.Batch{}
				b.Queue("SELECT pg_catalog.set_config('fence.token', $1, false)", tok)
				b.Queue(q, 1)
				err := c.SendBatch(ctxT(t), b).Close()
				if err == nil {
					t.Errorf("token %q (row 1 at 71): batch succeeded", tok)
				}
				t.Logf("token %q: %v", tok, err)
			}
			atkWantRows(t, d, map[int64][2]int64{1: {7, 71}, 2: {7, 9223372036854775807}, 3: {10, 60}})
		})
	}
}

// TestPreparedTokenChangeAttackBadTokens: a statement in the token form of
// 60 (and one bound 9 times with it), then tokens that are not valid:
// every write refused as the form that reads the setting refuses it, the
// rows unchanged; a Parse with an invalid token is not in the token form.
func TestPreparedTokenChangeAttackBadTokens(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	atkPrepare(t, c, "token", "once", atkUpd)
	atkPrepare(t, c, "token", "often", atkUpd)
	for range 9 {
		if _, err := c.Exec(ctxT(t), "often", 3); err != nil {
			t.Fatal(err)
		}
	}
	for _, tok := range []string{"9223372036854775808", "-60", "0", "", "abc", " 60", "60 ", "+60", "6e1", "0x3c", "99999999999999999999999"} {
		for _, name := range []string{"once", "often"} {
			atkPrepare(t, c, "token", "tmp", atkUpd) // with 60 written in
			setToken(t, c, tok)
			for _, s := range []string{name, "tmp"} {
				_, err := c.Exec(ctxT(t), s, 1)
				code := sqlState(err)
				if code != "FP002" && code != "FP001" {
					t.Errorf("token %q, statement %s: %v; want refused", tok, s, err)
				}
			}
			if err := c.Deallocate(ctxT(t), "tmp"); err != nil {
				t.Fatal(err)
			}
			setToken(t, c, "60")
			if _, err := c.Exec(ctxT(t), name, 3); err != nil {
				t.Fatalf("back to 60: %v", err)
			}
		}
		// Parsed with the invalid token: not its token form.
		setToken(t, c, tok)
		if _, err := c.Prepare(ctxT(t), "bad", atkUpd); err != nil {
			t.Fatal(err)
		}
		if q := preparedText(t, c, "bad"); strings.Contains(q, "'::bigint THEN '") {
			t.Errorf("parsed with token %q: %s", tok, q)
		}
		if _, err := c.Exec(ctxT(t), "bad", 1); err == nil {
			t.Errorf("token %q: write succeeded", tok)
		}
		if err := c.Deallocate(ctxT(t), "bad"); err != nil {
			t.Fatal(err)
		}
	}
	rows := atkRows(t, d, "acct")
	if rows[1] != [2]int64{0, 55} || rows[2] != [2]int64{0, 55} || rows[3][1] != 60 {
		t.Errorf("rows %v; want row 1 and 2 unchanged at 55, row 3 at 60", rows)
	}
}

// TestPreparedTokenChangeAttackTransactions: SET LOCAL, savepoints,
// ROLLBACK TO, RELEASE and ROLLBACK between executions of a statement in
// the token form: each write carries the token in effect.
func TestPreparedTokenChangeAttackTransactions(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	const q = "UPDATE acct SET n = n + 1 WHERE id = $1 RETURNING last_fence"
	atkPrepare(t, c, "token", "s1", q)
	for range 9 {
		if _, err := c.Exec(ctxT(t), "s1", 3); err != nil {
			t.Fatal(err)
		}
	}
	w := func(want int64) {
		t.Helper()
		var f int64
		if err := c.QueryRow(ctxT(t), "s1", 1).Scan(&f); err != nil {
			t.Fatalf("want %d: %v", want, err)
		}
		if f != want {
			t.Fatalf("wrote last_fence %d; want %d", f, want)
		}
	}
	x := func(sql string) {
		t.Helper()
		if _, err := c.Exec(ctxT(t), sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	x("BEGIN")
	w(60)
	x("SET LOCAL fence.token = '70'")
	w(70)
	x("SAVEPOINT a")
	x("SET LOCAL fence.token = '80'")
	w(80)
	x("ROLLBACK TO SAVEPOINT a")
	w(70)
	x("SAVEPOINT b")
	x("SET fence.token = '90'")
	x("RELEASE SAVEPOINT b")
	w(90)
	x("COMMIT")
	// The SET (not LOCAL) of 90 in the transaction is committed.
	w(90)
	x("BEGIN")
	x("SET fence.token = '95'")
	w(95)
	x("ROLLBACK")
	// The write and the SET rolled back: 90 again, the row at 90.
	w(90)
	x("BEGIN")
	x("SET LOCAL fence.token = '96'")
	w(96)
	x("COMMIT")
	// Back to 90, stale now (the row is at 96).
	_, err := c.Exec(ctxT(t), "s1", 1)
	if sqlState(err) != "FP001" {
		t.Errorf("token 90 after a commit at 96: %v; want FP001", err)
	}
	// A failed transaction: its SET undone.
	x("BEGIN")
	x("SET fence.token = '97'")
	if _, err := c.Exec(ctxT(t), "SELECT 1/0"); err == nil {
		t.Fatal("no error")
	}
	x("ROLLBACK")
	_, err = c.Exec(ctxT(t), "s1", 1)
	if sqlState(err) != "FP001" {
		t.Errorf("token 90 after a failed transaction: %v; want FP001", err)
	}
	// RESET ALL: no token.
	x("SET fence.token = '99'")
	w(99)
	x("RESET ALL")
	_, err = c.Exec(ctxT(t), "s1", 1)
	if sqlState(err) != "FP002" {
		t.Errorf("after RESET ALL: %v; want FP002", err)
	}
	r1 := atkRows(t, d, "acct")[1]
	if r1[1] != 99 {
		t.Errorf("row 1: %v; want last_fence 99", r1)
	}
}

// TestPreparedTokenChangeAttackPortalSavepoints: a portal of the token form
// with the token changed and restored between Bind and Execute by
// ROLLBACK TO runs with the restored one; bound inside a savepoint with a
// SET LOCAL token, then RELEASE, it runs with that one; with another token
// set between Bind and Execute it runs with that one, as the form that
// reads the setting would.
func TestPreparedTokenChangeAttackPortalSavepoints(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	atkPrepare(t, c, "token", "s1", atkUpd)
	a := atkHijack(t, c)
	bind := func(p, id string) {
		t.Helper()
		if errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: p, PreparedStatement: "s1", Parameters: [][]byte{[]byte(id)}}, &pgproto3.Sync{}); len(errs) > 0 {
			t.Fatalf("Bind: %s", atkErrs(errs))
		}
	}
	exec := func(p string) []pgproto3.ErrorResponse {
		errs, _ := a.rt(&pgproto3.Execute{Portal: p}, &pgproto3.Sync{})
		return errs
	}
	a.q("BEGIN")
	bind("p", "1")
	a.q("SAVEPOINT a")
	a.q("SET LOCAL fence.token = '70'")
	a.q("ROLLBACK TO SAVEPOINT a")
	if errs := exec("p"); len(errs) > 0 {
		t.Errorf("token restored by ROLLBACK TO: %s", atkErrs(errs))
	}
	a.q("SAVEPOINT b")
	a.q("SET LOCAL fence.token = '0070'")
	bind("q", "2")
	a.q("RELEASE SAVEPOINT b")
	if errs := exec("q"); len(errs) > 0 {
		t.Errorf("bound with 70 in a savepoint released: %s", atkErrs(errs))
	}
	a.q("COMMIT")
	atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {1, 70}, 3: {0, 55}})
	// s1 is in the form that reads the setting now (its token changed at
	// its second Bind); s2 in 70's form.
	a.q("SET fence.token = '70'")
	if errs, _ := a.rt(&pgproto3.Parse{Name: "s2", Query: atkUpd}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	if errs, _ := a.rt(&pgproto3.Query{String: "SELECT statement FROM pg_prepared_statements WHERE name = 's2' AND statement LIKE '%''70''::bigint%'"}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	bind = func(p, id string) {
		t.Helper()
		if errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: p, PreparedStatement: "s2", Parameters: [][]byte{[]byte(id)}}, &pgproto3.Sync{}); len(errs) > 0 {
			t.Fatalf("Bind: %s", atkErrs(errs))
		}
	}
	// Bound with 70 into a named portal, SET LOCAL 75 before Execute: it
	// runs with 75 (the guard fails).
	a.q("BEGIN")
	bind("p", "3")
	a.q("SET LOCAL fence.token = '75'")
	if errs := exec("p"); len(errs) != 0 {
		t.Errorf("SET LOCAL between Bind and Execute of a named portal: %s", atkErrs(errs))
	}
	if errs, _ := a.rt(&pgproto3.Query{String: "SELECT 1 FROM acct WHERE id = 3 AND last_fence = 75"}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	a.q("ROLLBACK")
	// The unnamed portal: bound with 70 in a pipeline, set_config in the
	// same pipeline through another portal, then Execute, no Sync
	// between: it writes with 75; then with 75 spelled otherwise.
	a.q("SET fence.token = '70'")
	if errs, _ := a.rt(&pgproto3.Parse{Name: "s3", Query: atkUpd}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	for _, tok := range []string{"75", "0075"} {
		errs, _ := a.rt(&pgproto3.Parse{Name: "cfg", Query: "SELECT pg_catalog.set_config('fence.token', $1, false)"},
			&pgproto3.Bind{PreparedStatement: "s3", Parameters: [][]byte{[]byte("3")}},
			&pgproto3.Bind{DestinationPortal: "c", PreparedStatement: "cfg", Parameters: [][]byte{[]byte(tok)}},
			&pgproto3.Execute{Portal: "c"},
			&pgproto3.Execute{},
			&pgproto3.Close{ObjectType: 'S', Name: "cfg"},
			&pgproto3.Sync{})
		if len(errs) != 0 {
			t.Errorf("set_config %s between Bind and Execute of the unnamed portal: %s", tok, atkErrs(errs))
		}
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {1, 70}, 3: {2, 75}})
}

// TestPreparedTokenChangeAttackUnnamed: the unnamed statement parsed once in
// the token form and bound again and again in one pipeline with the token
// set between the Binds by another statement.
func TestPreparedTokenChangeAttackUnnamed(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	msgs := []pgproto3.FrontendMessage{
		&pgproto3.Parse{Name: "cfg", Query: "SELECT pg_catalog.set_config('fence.token', $1, false)"},
		&pgproto3.Parse{Query: "UPDATE acct SET n = n + 1, last_fence = last_fence WHERE id = $1"},
	}
	want := map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}}
	tok := 60
	for i := range 30 {
		if i%3 == 0 {
			tok++
		}
		id := int64(1 + i%3)
		msgs = append(msgs, &pgproto3.Bind{PreparedStatement: "cfg", Parameters: [][]byte{[]byte(fmt.Sprint(tok))}}, &pgproto3.Execute{},
			&pgproto3.Bind{Parameters: [][]byte{[]byte(fmt.Sprint(id))}}, &pgproto3.Execute{})
		want[id] = [2]int64{want[id][0] + 1, int64(tok)}
	}
	msgs = append(msgs, &pgproto3.Sync{})
	if errs, _ := a.rt(msgs...); len(errs) > 0 {
		t.Fatalf("pipeline: %s", atkErrs(errs))
	}
	atkWantRows(t, d, want)
	// The unnamed statement, still there, bound with a stale token.
	errs, _ := a.rt(&pgproto3.Bind{PreparedStatement: "cfg", Parameters: [][]byte{[]byte("56")}}, &pgproto3.Execute{},
		&pgproto3.Bind{Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "FP001" {
		t.Errorf("stale: %s; want FP001", atkErrs(errs))
	}
	atkWantRows(t, d, want)
}

// TestPreparedTokenChangeAttackCloseReuse: Close of a statement in the
// token form and a Parse of the name again (the same text, another
// token); a failing Parse of a name already defined, with another token,
// leaves the old definition, which the proxy must still prepare again;
// DISCARD ALL; Describe before Bind.
func TestPreparedTokenChangeAttackCloseReuse(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	a.q("SET fence.token = '60'")
	if errs, _ := a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	a.q("SET fence.token = '70'")
	// Close and Parse again in one pipeline, then Bind.
	errs, _ := a.rt(&pgproto3.Close{ObjectType: 'S', Name: "s1"}, &pgproto3.Parse{Name: "s1", Query: atkUpd},
		&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	// A duplicate Parse under 80 fails; the server keeps 70's form.
	a.q("SET fence.token = '80'")
	errs, _ = a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Sync{})
	if len(errs) != 1 || errs[0].Code != "42P05" {
		t.Fatalf("duplicate Parse: %s", atkErrs(errs))
	}
	errs, _ = a.rt(&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("2")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	// A duplicate Parse in the same pipeline as the Bind: all skipped.
	a.q("SET fence.token = '85'")
	errs, _ = a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("2")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 {
		t.Fatalf("duplicate Parse in a pipeline: %s", atkErrs(errs))
	}
	// Describe, then Bind with a new token.
	a.q("SET fence.token = '90'")
	errs, _ = a.rt(&pgproto3.Describe{ObjectType: 'S', Name: "s1"}, &pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("3")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 70}, 2: {1, 80}, 3: {1, 90}})
	// DISCARD ALL, then the name again with a new token.
	a.q("DISCARD ALL")
	a.q("SET fence.token = '91'")
	errs, _ = a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	a.q("DISCARD ALL")
	errs, _ = a.rt(&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	if len(errs) != 1 || (errs[0].Code != "26000" && errs[0].Code != "FP002") {
		t.Errorf("after DISCARD ALL: %s; want 26000 or FP002", atkErrs(errs))
	}
	atkWantRows(t, d, map[int64][2]int64{1: {2, 91}, 2: {1, 80}, 3: {1, 90}})
}

// TestPreparedTokenChangeAttackReload: statements in the token form while
// the rules are reloaded (acct from on_stale error to skip and back):
// writes carry the session's token, stale ones are refused or skipped as
// the rules in force say.
func TestPreparedTokenChangeAttackReload(t *testing.T) {
	t.Parallel()
	c, d, e, _ := atkSetupEnv(t)
	const q = "UPDATE acct SET n = n + 1 WHERE id = $1"
	atkPrepare(t, c, "token", "s1", q)
	atkPrepare(t, c, "token", "s9", q)
	for range 9 {
		if _, err := c.Exec(ctxT(t), "s9", 3); err != nil {
			t.Fatal(err)
		}
	}
	skip := rules.Config{Tables: append([]rules.Table(nil), testRules.Tables...)}
	skip.Tables[0].OnStale = "skip"
	compile := func(cfg rules.Config) *rules.Rules {
		rs, err := rules.Compile(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return rs
	}
	e.pol.Swap(compile(skip), false)
	setToken(t, c, "50")
	for _, s := range []string{"s1", "s9"} {
		tag, err := c.Exec(ctxT(t), s, 1)
		if err != nil || tag.RowsAffected() != 0 {
			t.Errorf("%s stale under skip: %v %v; want 0 rows", s, tag, err)
		}
	}
	setToken(t, c, "70")
	for i, s := range []string{"s1", "s9"} {
		if _, err := c.Exec(ctxT(t), s, 1+i); err != nil {
			t.Errorf("%s with 70: %v", s, err)
		}
	}
	e.pol.Swap(compile(testRules), false)
	setToken(t, c, "69")
	for _, s := range []string{"s1", "s9"} {
		if _, err := c.Exec(ctxT(t), s, 1); sqlState(err) != "FP001" {
			t.Errorf("%s stale after reload back: %v; want FP001", s, err)
		}
	}
	setToken(t, c, "80")
	for range 10 {
		if _, err := c.Exec(ctxT(t), "s9", 2); err != nil {
			t.Fatal(err)
		}
	}
	e.pol.Swap(compile(testRules), false)
	setToken(t, c, "79")
	if _, err := c.Exec(ctxT(t), "s9", 2); sqlState(err) != "FP001" {
		t.Errorf("s9 stale after a reload of the same rules: %v; want FP001", err)
	}
	setToken(t, c, "81")
	if _, err := c.Exec(ctxT(t), "s9", 2); err != nil {
		t.Fatal(err)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {1, 70}, 2: {12, 81}, 3: {9, 60}})
}

// TestPreparedTokenChangeAttackLibPQ: lib/pq's prepared statements (unnamed
// per Exec with arguments, named by Prepare) with the token changing.
func TestPreparedTokenChangeAttackLibPQ(t *testing.T) {
	t.Parallel()
	_, d, e, db := atkSetupEnv(t)
	pc := pinnedPQ(t, e.proxy.DSN("postgres", "", db)+"&sslmode=disable")
	ctx := ctxT(t)
	set := func(tok string) {
		t.Helper()
		if _, err := pc.ExecContext(ctx, "SELECT pg_catalog.set_config('fence.token', $1, false)", tok); err != nil {
			t.Fatal(err)
		}
	}
	set("60")
	st, err := pc.PrepareContext(ctx, atkUpd)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for i := range 20 {
		set(fmt.Sprint(61 + i))
		if _, err := st.ExecContext(ctx, 1); err != nil {
			t.Fatalf("named, token %d: %v", 61+i, err)
		}
		if _, err := pc.ExecContext(ctx, atkUpd, 2); err != nil {
			t.Fatalf("unnamed, token %d: %v", 61+i, err)
		}
	}
	set("79")
	_, err = st.ExecContext(ctx, 1)
	if anyCode(err) != "FP001" {
		t.Errorf("stale 79: %v; want FP001", err)
	}
	atkWantRows(t, d, map[int64][2]int64{1: {20, 80}, 2: {20, 80}, 3: {0, 55}})
}

// TestPreparedTokenChangeAttackLock: a lock-fenced table (acct of
// lockRules) with pgx's cached statements in the token form: the old
// holder's statement, bound 10 times with its token, is refused once a
// newer holder has written, by a Bind and by SQL EXECUTE of pgx's
// statement; its row keeps the newer holder's token.
func TestPreparedTokenChangeAttackLock(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, _ := startChecker(t, lockRules)
	e := startLockEnvWith(t, policy.Options{Checks: checker})
	db := newLockDB(t, true)
	d := direct(t, db)
	const q = "UPDATE acct SET n = n + 1 WHERE id = $1"
	old := e.holder(t, db, "L", 10, pgx.QueryExecModeCacheStatement)
	for range 10 {
		if _, err := old.Exec(ctxT(t), q, 1); err != nil {
			t.Fatal(err)
		}
	}
	var name, text string
	if err := old.QueryRow(ctxT(t), "SELECT name, statement FROM pg_prepared_statements WHERE statement LIKE 'UPDATE acct%'", pgx.QueryExecModeSimpleProtocol).Scan(&name, &text); err != nil {
		t.Fatal(err)
	}
	t.Logf("old holder's statement %s: %s", name, text)
	newer := e.holder(t, db, "L", 11, pgx.QueryExecModeCacheStatement)
	if _, err := newer.Exec(ctxT(t), q, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Exec(ctxT(t), q, 1); err == nil {
		t.Errorf("old holder's Bind after the newer holder's write: no error")
	}
	if _, err := old.Exec(ctxT(t), fmt.Sprintf("EXECUTE %s(1)", name), pgx.QueryExecModeSimpleProtocol); err == nil {
		t.Errorf("old holder's SQL EXECUTE after the newer holder's write: no error")
	}
	var n int
	var f int64
	if err := d.QueryRow(ctxT(t), "SELECT n, last_fence FROM acct WHERE id = 1").Scan(&n, &f); err != nil {
		t.Fatal(err)
	}
	if n != 11 || f != 11 {
		t.Errorf("row 1: n %d last_fence %d; want 11 and 11", n, f)
	}
}

// TestPreparedTokenChangeAttackFunctionSetConfig: a function that sets the
// token from inside the statement (the proxy cannot see it). The row must
// carry the token the proxy's record has (60), in both forms; logged:
// what each form writes.
func TestPreparedTokenChangeAttackFunctionSetConfig(t *testing.T) {
	t.Parallel()
	for _, form := range atkForms {
		t.Run(form, func(t *testing.T) {
			t.Parallel()
			c, d := atkSetup(t)
			if _, err := d.Exec(ctxT(t), `CREATE FUNCTION sneak(v text) RETURNS text LANGUAGE sql AS $$ SELECT pg_catalog.set_config('fence.'||'token', v, false) $$`); err != nil {
				t.Fatal(err)
			}
			const q = "UPDATE acct SET payload = sneak($2), n = n + 1 WHERE id = $1 RETURNING last_fence"
			atkPrepare(t, c, form, "s1", q)
			var f int64
			err := c.QueryRow(ctxT(t), "s1", 1, "99").Scan(&f)
			n, rf := rowOf(t, d, 1)
			var cur string
			_ = c.QueryRow(ctxT(t), "SHOW fence.token", pgx.QueryExecModeSimpleProtocol).Scan(&cur)
			t.Logf("%s form: err %v; returned %d; row n %d last_fence %d; server's fence.token after: %s", form, err, f, n, rf, cur)
			if err == nil && rf != 60 && rf != 99 {
				t.Errorf("row 1 last_fence %d; want 60 or 99", rf)
			}
		})
	}
}

// TestPreparedTokenChangeAttackSuspendedPortal: a portal of the token form
// of UPDATE ... RETURNING run with a row limit (PostgreSQL runs the whole
// UPDATE at the first Execute), then the token changed and the rest
// fetched. No row may carry the new token; logged: whether the fetch of
// rows already written is refused (FP003, the documented change).
func TestPreparedTokenChangeAttackSuspendedPortal(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	atkPrepare(t, c, "token", "s1", "UPDATE acct SET n = n + 1 WHERE id <= $1 RETURNING id")
	a := atkHijack(t, c)
	a.q("BEGIN")
	errs, _ := a.rt(&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s1", Parameters: [][]byte{[]byte("3")}},
		&pgproto3.Execute{Portal: "p", MaxRows: 1}, &pgproto3.Sync{})
	if len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	a.q("SET LOCAL fence.token = '70'")
	errs, tags := a.rt(&pgproto3.Execute{Portal: "p"}, &pgproto3.Sync{})
	t.Logf("the rest of the portal after a change of token: errors %s tags %v", atkErrs(errs), tags)
	end := "COMMIT"
	if len(errs) > 0 {
		end = "ROLLBACK"
	}
	a.q(end)
	for id, r := range atkRows(t, d, "acct") {
		if r[1] != 55 && r[1] != 60 {
			t.Errorf("row %d: %v; want last_fence 55 or 60", id, r)
		}
	}
}

// TestPreparedTokenChangeAttackSuspendedUnnamed: the unnamed portal of the
// token form of UPDATE ... RETURNING run with a row limit (the whole
// UPDATE runs at the first Execute, with 60), then the token set to 70
// through another portal, then the rest fetched: the rows written carry
// 60, and the rest of the rows comes back (the write is done: no FP003).
func TestPreparedTokenChangeAttackSuspendedUnnamed(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	atkPrepare(t, c, "token", "s1", "UPDATE acct SET n = n + 1 WHERE id <= $1 RETURNING id")
	a := atkHijack(t, c)
	a.q("BEGIN")
	errs, _ := a.rt(&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("3")}},
		&pgproto3.Execute{MaxRows: 1},
		&pgproto3.Parse{Name: "set70", Query: "SET LOCAL fence.token = '70'"},
		&pgproto3.Bind{DestinationPortal: "x", PreparedStatement: "set70"},
		&pgproto3.Execute{Portal: "x"},
		&pgproto3.Execute{},
		&pgproto3.Sync{})
	if len(errs) > 0 {
		t.Errorf("the rest of a run portal after a change of token: %s", atkErrs(errs))
	}
	a.q("COMMIT")
	atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {1, 60}, 3: {1, 60}})
}
