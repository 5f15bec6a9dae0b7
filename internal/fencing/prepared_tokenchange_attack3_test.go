package fencing_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Third round of attacks on the token form of prepared statements
// (77166f4..27ccfd9). Every check reads the rows on a direct connection
// afterwards. Rows start at last_fence 55; the session's token is 60
// (atkSetup).
//
// They were written against a token form for prepared statements that
// kept the token as a constant, since withdrawn: a statement "in the token
// form of N" is now one parsed while the session's token was N, which the
// server keeps in the parameter form (the token bound at each Bind) or in
// the form that reads the setting. The outcomes asserted are the same: the
// rows carry the session's token at each run.

// a3Simple runs sql as a simple Query and returns its error.
func a3Simple(t *testing.T, c *pgx.Conn, sql string) error {
	t.Helper()
	_, err := c.Exec(ctxT(t), sql, pgx.QueryExecModeSimpleProtocol)
	return err
}

// TestPreparedTokenChangeAttack3StoredCodeExecute: a named statement in the
// token form of 60, then the session's token set to 50 (stale: rows at
// 55) or 70 (newer), then the statement run by stored code the proxy
// cannot see into: a DO block and a function whose dynamic SQL is
// "EXECUTE s1(1)". In the form that reads the setting the write reads the
// session's token (50: refused; 70: written with 70). With 60 written in,
// the write must not land with 60.
func TestPreparedTokenChangeAttack3StoredCodeExecute(t *testing.T) {
	t.Parallel()
	for _, form := range atkForms {
		for _, via := range []string{"do", "function"} {
			for _, tok := range []string{"50", "70"} {
				t.Run(form+"/"+via+"/"+tok, func(t *testing.T) {
					t.Parallel()
					c, d := atkSetup(t)
					if _, err := d.Exec(ctxT(t), `CREATE FUNCTION run_s1(id int) RETURNS void LANGUAGE plpgsql AS $$ BEGIN EXECUTE format('EXECUTE s1(%s)', id); END $$`); err != nil {
						t.Fatal(err)
					}
					atkPrepare(t, c, form, "s1", atkUpd)
					setToken(t, c, tok)
					sql := "DO $$ BEGIN EXECUTE 'EXECUTE s1(1)'; END $$"
					if via == "function" {
						sql = "SELECT run_s1(1)"
					}
					err := a3Simple(t, c, sql)
					n, f := rowOf(t, d, 1)
					t.Logf("%s form, token %s, %s: err %v; row 1 n %d last_fence %d", form, tok, sql, err, n, f)
					switch {
					case n != 0 && f != 70:
						t.Errorf("session token %s: stored code ran s1 and wrote row 1 with last_fence %d (n %d); want refused or written with the session's token", tok, f, n)
					case tok == "50" && n != 0:
						t.Errorf("stale 50: row 1 written: n %d last_fence %d", n, f)
					}
				})
			}
		}
	}
}

// TestPreparedTokenChangeAttack3AutoPrepareStoredCode: auto_prepare's own
// statement for a repeated simple Query has the token written in (60)
// and stays on the server after its use; its name is in
// pg_prepared_statements. The session's token then goes stale (50; row 1
// is at 60 after the two writes) and stored code runs the proxy's
// statement by name. Without the token form it would read the
// session's 50 and be refused.
func TestPreparedTokenChangeAttack3AutoPrepareStoredCode(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	const q = "UPDATE acct SET n = n + 1 WHERE id = 1"
	for range 3 {
		if err := a3Simple(t, c, q); err != nil {
			t.Fatal(err)
		}
	}
	var name, text string
	if err := c.QueryRow(ctxT(t), "SELECT name, statement FROM pg_prepared_statements WHERE name LIKE 'fenceproxy\\_auto\\_%'", pgx.QueryExecModeSimpleProtocol).Scan(&name, &text); err != nil {
		t.Fatal(err)
	}
	t.Logf("auto statement %s: %s", name, a2Form(text))
	setToken(t, c, "50")
	err := a3Simple(t, c, `DO $$ DECLARE n text; BEGIN SELECT name INTO n FROM pg_prepared_statements WHERE name LIKE 'f' || 'enceproxy' || '\_auto\_%'; EXECUTE format('EXECUTE %I', n); END $$`)
	r := atkRows(t, d, "acct")[1]
	t.Logf("DO block executing %s with token 50: err %v; row 1 %v", name, err, r)
	if r != [2]int64{3, 60} {
		t.Errorf("stale token 50 (row 1 at 60): stored code ran the proxy's auto_prepare statement: row 1 [n last_fence] %v; want [3 60] unchanged", r)
	}
}

// a3Reload swaps e's rules to testRules with acct's rule changed by mode:
// "same" (testRules), "skip", "audit", "unlisted" (acct not protected).
func a3Reload(t *testing.T, e *env, mode string) {
	t.Helper()
	cfg := rules.Config{}
	for _, tb := range testRules.Tables {
		if tb.Table == "public."+tError {
			switch mode {
			case "skip":
				tb.OnStale = "skip"
			case "audit":
				tb.Mode = rules.ModeAudit
			case "unlisted":
				continue
			}
		}
		cfg.Tables = append(cfg.Tables, tb)
	}
	rs, err := rules.Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.pol.Swap(rs, false)
}

// a3Listen listens for audit events on db; the returned func waits for
// at least n and returns the tokens they carry ("<none>" for none).
func a3Listen(t *testing.T, db string) func(n int) []string {
	t.Helper()
	var notes []string
	listener := connectDSN(t, cluster.SuperuserDSN(db), func(c *pgx.ConnConfig) {
		c.OnNotification = func(_ *pgconn.PgConn, n *pgconn.Notification) { notes = append(notes, n.Payload) }
	})
	if _, err := listener.Exec(ctxT(t), "LISTEN "+rules.AuditChannel); err != nil {
		t.Fatal(err)
	}
	return func(n int) []string {
		t.Helper()
		if _, err := listener.Exec(ctxT(t), "SELECT 1"); err != nil {
			t.Fatal(err)
		}
		for len(notes) < n {
			wctx, cancel := contextWithTimeout(ctxT(t))
			_, err := listener.WaitForNotification(wctx)
			cancel()
			if err != nil {
				break
			}
		}
		var got []string
		for _, p := range notes {
			ev, err := rules.ParseAuditEvent(p)
			if err != nil {
				t.Fatalf("payload %s: %v", p, err)
			}
			tok := "<none>"
			if ev.Token != nil {
				tok = *ev.Token
			}
			got = append(got, tok)
		}
		notes = nil
		return got
	}
}

// TestPreparedTokenChangeAttack3ReloadAudit: named statements prepared in
// the token form of 60 under on_stale error; the rules reloaded to audit
// mode for acct between the Parse and the Bind; then Binds with stale
// tokens (rows at 55) changing every 9 Binds (so the statement is
// re-prepared, goes to the form that reads the setting, is upgraded to
// the token form at the 9th Bind and re-prepared for the next token),
// and an invalid one: every write is audited with the session's token in
// the notification. Then back to error: stale refused, newer written; and
// to skip.
func TestPreparedTokenChangeAttack3ReloadAudit(t *testing.T) {
	t.Parallel()
	c, d, e, db := atkSetupEnv(t)
	wait := a3Listen(t, db)
	ctx := ctxT(t)
	atkPrepare(t, c, "token", "s1", atkUpd)
	// s9: 9 Binds with 60 first (the token form kept across a change).
	atkPrepare(t, c, "token", "s9", atkUpd)
	for range 9 {
		if _, err := c.Exec(ctx, "s9", 3); err != nil {
			t.Fatal(err)
		}
	}
	a3Reload(t, e, "audit")
	var want []string
	for i := range 30 {
		tok := fmt.Sprint(30 + i/9)
		setToken(t, c, tok)
		for _, s := range []string{"s1", "s9"} {
			if _, err := c.Exec(ctx, s, 1); err != nil {
				t.Fatalf("%s write %d with %s under audit: %v", s, i, tok, err)
			}
			want = append(want, tok)
		}
		if i == 12 {
			setToken(t, c, "abc")
			if _, err := c.Exec(ctx, "s1", 2); err != nil {
				t.Fatalf("invalid token under audit: %v", err)
			}
			want = append(want, "abc")
		}
	}
	t.Logf("server's s1: %s; s9: %s", a2Form(preparedText(t, c, "s1")), a2Form(preparedText(t, c, "s9")))
	if got := wait(len(want)); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("audited tokens %v; want the session's %v", got, want)
	}
	rows := atkRows(t, d, "acct")
	t.Logf("rows after the audited writes: %v", rows)
	if rows[1] != [2]int64{60, 55} || rows[2] != [2]int64{1, 55} {
		t.Errorf("rows %v; want row 1 [60 55], row 2 [1 55] (audit never moves the watermark back)", rows)
	}
	// A token above the watermark under audit: written with it.
	setToken(t, c, "56")
	for _, s := range []string{"s1", "s9"} {
		if _, err := c.Exec(ctx, s, 2); err != nil {
			t.Fatal(err)
		}
	}
	if r := atkRows(t, d, "acct")[2]; r != [2]int64{3, 56} {
		t.Errorf("row 2 after writes with 56 under audit: %v; want [3 56]", r)
	}
	if got := wait(0); len(got) != 0 {
		t.Errorf("writes with 56 (row at 55) audited: %v", got)
	}
	a3Reload(t, e, "same")
	setToken(t, c, "54")
	for _, s := range []string{"s1", "s9"} {
		if _, err := c.Exec(ctx, s, 1); sqlState(err) != "FP001" {
			t.Errorf("%s stale 54 after reload back to error: %v; want FP001", s, err)
		}
	}
	a3Reload(t, e, "skip")
	for _, s := range []string{"s1", "s9"} {
		if tag, err := c.Exec(ctx, s, 1); err != nil || tag.RowsAffected() != 0 {
			t.Errorf("%s stale 54 under skip: %v %v; want 0 rows", s, tag, err)
		}
	}
	setToken(t, c, "57")
	for _, s := range []string{"s1", "s9"} {
		if _, err := c.Exec(ctx, s, 1); err != nil {
			t.Errorf("%s with 57 under skip: %v", s, err)
		}
	}
	atkWantRows(t, d, map[int64][2]int64{1: {62, 57}, 2: {3, 56}, 3: {9, 60}})
}

// TestPreparedTokenChangeAttack3ReloadBetweenBindExecute: the unnamed
// portal of a named statement in the token form of 60 (bound 9 times
// before, in a transaction), the rules reloaded between its Bind and its
// Execute (to the same rules: the portal runs, with 60; to skip, audit,
// unlisted: refused, bound under rules that treat it differently), alone
// or with a token change by another portal in the same pipeline (then
// with the session's token: 70 written, 50 stale).
func TestPreparedTokenChangeAttack3ReloadBetweenBindExecute(t *testing.T) {
	t.Parallel()
	for _, to := range []string{"same", "skip", "audit", "unlisted"} {
		for _, set := range []string{"", "70", "0060", "50"} {
			t.Run(to+"/"+set, func(t *testing.T) {
				t.Parallel()
				c, d, e, _ := atkSetupEnv(t)
				atkPrepare(t, c, "token", "s1", atkUpd)
				for range 9 {
					if _, err := c.Exec(ctxT(t), "s1", 3); err != nil {
						t.Fatal(err)
					}
				}
				a := atkHijack(t, c)
				a.q("BEGIN")
				if errs, _ := a.rt(&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Sync{}); len(errs) > 0 {
					t.Fatal(atkErrs(errs))
				}
				a3Reload(t, e, to)
				var msgs []pgproto3.FrontendMessage
				if set != "" {
					msgs = a2Set(set)
				}
				msgs = append(msgs, &pgproto3.Execute{}, &pgproto3.Sync{})
				errs, tags := a.rt(msgs...)
				end := "COMMIT"
				if len(errs) > 0 {
					end = "ROLLBACK"
				}
				a.q(end)
				r := atkRows(t, d, "acct")[1]
				t.Logf("reload to %s, set %q between Bind and Execute: %s %v; row 1 %v", to, set, atkErrs(errs), tags, r)
				want := [2]int64{0, 55}
				if to == "same" {
					switch set {
					case "", "0060":
						want = [2]int64{1, 60}
					case "70":
						want = [2]int64{1, 70}
					}
				}
				switch {
				case r != want:
					t.Errorf("row 1 %v; want %v (%s)", r, want, atkErrs(errs))
				case want[0] == 1 && len(errs) > 0:
					t.Errorf("row 1 written, but %s", atkErrs(errs))
				case want[0] == 0 && len(errs) == 0:
					t.Errorf("row 1 unchanged, without an error")
				}
			})
		}
	}
}

func contextWithTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, 2*time.Second)
}

// TestPreparedTokenChangeAttack3Limit: a session at maxTrackedStatements
// (10000 names: 9999 plain ones and s1 in the token form of 60). A token
// change makes each Bind of s1 re-prepare it (Close and Parse of the
// same name): the write carries the session's token; a stale one is
// refused; a new name is refused at the limit and nothing of it runs.
func TestPreparedTokenChangeAttack3Limit(t *testing.T) {
	t.Parallel()
	c, d := atkSetup(t)
	a := atkHijack(t, c)
	if errs, _ := a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	if errs, _ := a.rt(a2Set("60", &pgproto3.Sync{})...); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	var have int
	fmt.Sscan(a.a2Count(), &have)
	fill := 10000 - have
	t.Logf("the session has %d statements; %d more", have, fill)
	for k := 0; k < fill; k += 1000 {
		var msgs []pgproto3.FrontendMessage
		for i := k; i < min(k+1000, fill); i++ {
			msgs = append(msgs, &pgproto3.Parse{Name: fmt.Sprintf("p%d", i), Query: "SELECT 1"})
		}
		if errs, _ := a.rt(append(msgs, &pgproto3.Sync{})...); len(errs) > 0 {
			t.Fatal(atkErrs(errs))
		}
	}
	errs, _ := a.rt(&pgproto3.Parse{Name: "over", Query: atkUpd}, &pgproto3.Bind{PreparedStatement: "over", Parameters: [][]byte{[]byte("2")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	t.Logf("a new name at the limit: %s", atkErrs(errs))
	if len(errs) != 1 || errs[0].Code != "FP003" {
		t.Errorf("a new name at the limit: %s; want FP003", atkErrs(errs))
	}
	bind := func(id string) []pgproto3.FrontendMessage {
		return []pgproto3.FrontendMessage{&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte(id)}}, &pgproto3.Execute{}}
	}
	// Tokens changing every Bind, then a run of 9, then changes again.
	want := map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}}
	toks := []int{70, 71, 72, 72, 72, 72, 72, 72, 72, 72, 72, 73, 74}
	for i, tok := range toks {
		id := int64(1 + i%3)
		msgs := a2Set(fmt.Sprint(tok), append(bind(fmt.Sprint(id)), &pgproto3.Sync{})...)
		if errs, _ := a.rt(msgs...); len(errs) > 0 {
			t.Fatalf("token %d: %s", tok, atkErrs(errs))
		}
		want[id] = [2]int64{want[id][0] + 1, int64(tok)}
	}
	errs, _ = a.rt(a2Set("60", append(bind("1"), &pgproto3.Sync{})...)...)
	if len(errs) != 1 || errs[0].Code != "FP001" {
		t.Errorf("stale 60 at the limit: %s; want FP001", atkErrs(errs))
	}
	t.Logf("server's s1: %s", a2Form(a.a2Stmt("s1")))
	atkWantRows(t, d, want)
}

// TestPreparedTokenChangeAttack3TextBudget: the session's statement texts
// fill maxTrackedTextBytes (the proxy keeps no more text), then s1 is
// parsed in the token form of 60, its text not kept. A token change
// before a Bind, and a reload after, must still give writes with the
// session's token or a refusal.
func TestPreparedTokenChangeAttack3TextBudget(t *testing.T) {
	t.Parallel()
	c, d, e, _ := atkSetupEnv(t)
	a := atkHijack(t, c)
	big := "SELECT 1 /*" + strings.Repeat("x", 4<<20) + "*/"
	for i := range 16 {
		if errs, _ := a.rt(&pgproto3.Parse{Name: fmt.Sprintf("big%d", i), Query: big}, &pgproto3.Sync{}); len(errs) > 0 {
			t.Fatal(atkErrs(errs))
		}
	}
	if errs, _ := a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(atkErrs(errs))
	}
	t.Logf("s1: %s", a2Form(a.a2Stmt("s1")))
	run := func(tok string, id string) []pgproto3.ErrorResponse {
		errs, _ := a.rt(a2Set(tok, &pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte(id)}}, &pgproto3.Execute{}, &pgproto3.Sync{})...)
		return errs
	}
	if errs := run("70", "1"); len(errs) > 0 {
		t.Fatalf("70: %s", atkErrs(errs))
	}
	a3Reload(t, e, "skip")
	errs := run("71", "2")
	t.Logf("after a reload, token 71: %s", atkErrs(errs))
	if len(errs) > 0 && errs[0].Code != "FP003" {
		t.Errorf("after a reload: %s; want written or FP003", atkErrs(errs))
	}
	errs = run("50", "1")
	t.Logf("after a reload, stale 50: %s", atkErrs(errs))
	rows := atkRows(t, d, "acct")
	if rows[1] != [2]int64{1, 70} || (rows[2] != [2]int64{1, 71} && rows[2] != [2]int64{0, 55}) {
		t.Errorf("rows %v; want row 1 [1 70], row 2 [1 71] or unchanged", rows)
	}
}

// TestPreparedTokenChangeAttack3DeallocateBetween: s1 in the token form of
// 60; the token set to 70; then, in one pipeline, DEALLOCATE ALL or
// DISCARD ALL (through a named portal, or a simple Query in front), a
// Parse of s1 again, and its Bind; or a SQL PREPARE of the same name
// (the form that reads the setting) in place of the Parse. Every write
// carries 70; with a stale 50, refused.
func TestPreparedTokenChangeAttack3DeallocateBetween(t *testing.T) {
	t.Parallel()
	for _, what := range []string{"DEALLOCATE ALL", "DISCARD ALL", "DEALLOCATE s1"} {
		for _, how := range []string{"portal", "query"} {
			for _, redo := range []string{"parse", "sqlprepare"} {
				for _, tok := range []string{"70", "50"} {
					t.Run(fmt.Sprintf("%s/%s/%s/%s", what, how, redo, tok), func(t *testing.T) {
						t.Parallel()
						c, d := atkSetup(t)
						a := atkHijack(t, c)
						if errs, _ := a.rt(&pgproto3.Parse{Name: "s1", Query: atkUpd}, &pgproto3.Sync{}); len(errs) > 0 {
							t.Fatal(atkErrs(errs))
						}
						for range 9 {
							if errs, _ := a.rt(&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("3")}}, &pgproto3.Execute{}, &pgproto3.Sync{}); len(errs) > 0 {
								t.Fatal(atkErrs(errs))
							}
						}
						var msgs []pgproto3.FrontendMessage
						if how == "query" {
							msgs = append(msgs, &pgproto3.Query{String: fmt.Sprintf("SET fence.token = '%s'", tok)}, &pgproto3.Query{String: what})
						} else {
							msgs = a2Set(tok, &pgproto3.Parse{Name: "dd", Query: what}, &pgproto3.Bind{DestinationPortal: "dd", PreparedStatement: "dd"}, &pgproto3.Execute{Portal: "dd"})
						}
						if redo == "parse" {
							msgs = append(msgs, &pgproto3.Parse{Name: "s1", Query: atkUpd})
						} else {
							msgs = append(msgs, &pgproto3.Parse{Name: "pp", Query: "PREPARE s1(bigint) AS " + strings.Replace(atkUpd, "$1", "$1", 1)}, &pgproto3.Bind{DestinationPortal: "pp", PreparedStatement: "pp"}, &pgproto3.Execute{Portal: "pp"})
						}
						msgs = append(msgs, &pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
						errs, tags := a.rt(msgs...)
						if how == "query" {
							for range 2 {
								errs2, tags2 := a.rt()
								errs, tags = append(errs, errs2...), append(tags, tags2...)
							}
						}
						r := atkRows(t, d, "acct")[1]
						t.Logf("%s: %s %v; row 1 %v", what, atkErrs(errs), tags, r)
						if what == "DISCARD ALL" {
							// DISCARD ALL resets the token too (FP002 after it); in
							// a pipeline it fails, and the proxy ends the session
							// (as before the token form: lost track).
							if r != [2]int64{0, 55} {
								t.Errorf("%s between Parse and Bind: row 1 %v; want unchanged (errors %s)", what, r, atkErrs(errs))
							}
							return
						}
						t.Logf("s1 %s", a2Form(a.a2Stmt("s1")))
						if tok == "70" && r != [2]int64{1, 70} {
							t.Errorf("token 70: row 1 %v; want [1 70] (errors %s)", r, atkErrs(errs))
						}
						if tok == "50" && r != [2]int64{0, 55} {
							t.Errorf("stale 50: row 1 %v; want unchanged", r)
						}
						// The statement again, on its own, with 80.
						errs, _ = a.rt(a2Set("80", &pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("2")}}, &pgproto3.Execute{}, &pgproto3.Sync{})...)
						if r := atkRows(t, d, "acct")[2]; r != [2]int64{1, 80} && !(len(errs) > 0 && r == [2]int64{0, 55}) {
							t.Errorf("then with 80: %s, row 2 %v", atkErrs(errs), r)
						}
					})
				}
			}
		}
	}
}

// a2Count is the number of the session's prepared statements.
func (a *atkRaw) a2Count() string {
	a.t.Helper()
	return a.value("SELECT count(*) FROM pg_prepared_statements")
}

// TestPreparedTokenChangeAttack3GuardStoredCode: StoredCodeExecute in a
// database with the guard (its triggers read the setting): s1 in the
// token form of 43 (rows at 42), the session's token then 41 (stale),
// and stored code runs "EXECUTE s1(1)".
func TestPreparedTokenChangeAttack3GuardStoredCode(t *testing.T) {
	t.Parallel()
	e := startRaisersEnv(t)
	g := review27Guard(t, e)
	setToken(t, g.c, "43")
	if _, err := g.c.Prepare(ctxT(t), "s1", "UPDATE acct SET n = n + 1 WHERE id = $1"); err != nil {
		t.Fatal(err)
	}
	t.Logf("s1: %s", a2Form(preparedText(t, g.c, "s1")))
	for _, tok := range []string{"41", "44"} {
		setToken(t, g.c, tok)
		err := a3Simple(t, g.c, "DO $$ BEGIN EXECUTE 'EXECUTE s1(1)'; END $$")
		r := snapshot(t, g.d, tError)[1]
		t.Logf("token %s, DO EXECUTE s1(1): err %v; row 1 n %d last_fence %d", tok, err, r.N, r.Fence)
		if r.N != 0 && r.Fence != 44 {
			t.Errorf("session token %s: stored code's EXECUTE of s1 wrote row 1 with last_fence %d", tok, r.Fence)
		}
	}
}

// TestPreparedTokenChangeAttack3LockTakeover: lock-fenced acct (lock:
// optional) and jobs (lock: required). Holder A (lock L, token 10) and B
// (L, 11) each have named statements in their token form, bound 9 times.
// B writes (registers 11): A's Binds are refused. A then sets 12 in the
// pipeline of its Bind (A's statements are prepared again; the
// registration reads the setting): A's writes land with 12, and B's
// statements (11 written in) must now be refused.
func TestPreparedTokenChangeAttack3LockTakeover(t *testing.T) {
	t.Parallel()
	checker, _ := startChecker(t, lockRules)
	e := startLockEnvWith(t, policy.Options{Checks: checker})
	db := newLockDB(t, true)
	d := direct(t, db)
	qs := map[string]string{"acct": "UPDATE acct SET n = n + 1 WHERE id = $1", "jobs": "UPDATE jobs SET state = state || 'x' WHERE id = $1"}
	open := func(tok int64) *atkRaw {
		a := atkHijack(t, e.holder(t, db, "L", tok, pgx.QueryExecModeSimpleProtocol))
		for name, q := range qs {
			if errs, _ := a.rt(&pgproto3.Parse{Name: name, Query: q}, &pgproto3.Sync{}); len(errs) > 0 {
				t.Fatal(atkErrs(errs))
			}
		}
		return a
	}
	bind := func(a *atkRaw, name string, pre ...pgproto3.FrontendMessage) []pgproto3.ErrorResponse {
		errs, _ := a.rt(append(pre, &pgproto3.Bind{PreparedStatement: name, Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})...)
		return errs
	}
	A := open(10)
	for range 9 {
		for name := range qs {
			if errs := bind(A, name); len(errs) > 0 {
				t.Fatal(atkErrs(errs))
			}
		}
	}
	t.Logf("A's acct: %s", a2Form(A.a2Stmt("acct")))
	B := open(11)
	for range 9 {
		for name := range qs {
			if errs := bind(B, name); len(errs) > 0 {
				t.Fatal(atkErrs(errs))
			}
		}
	}
	for name := range qs {
		if errs := bind(A, name); len(errs) != 1 || errs[0].Code != "FP001" {
			t.Errorf("A (10) after B (11) registered, %s: %s; want FP001", name, atkErrs(errs))
		}
	}
	for name := range qs {
		if errs := bind(A, name, a2Set("12")...); len(errs) > 0 {
			t.Errorf("A with 12, %s: %s", name, atkErrs(errs))
		}
	}
	for name := range qs {
		if errs := bind(B, name); len(errs) != 1 || errs[0].Code != "FP001" {
			t.Errorf("B (11, written in) after A (12) registered, %s: %s; want FP001", name, atkErrs(errs))
		}
		// B through SQL EXECUTE of its own statement.
		if errs, _ := B.rt(&pgproto3.Query{String: "EXECUTE " + name + "(1)"}); len(errs) != 1 {
			t.Errorf("B's SQL EXECUTE %s after A (12): %s; want refused", name, atkErrs(errs))
		}
	}
	var n int
	var f int64
	var state string
	if err := d.QueryRow(ctxT(t), "SELECT n, last_fence FROM acct WHERE id = 1").Scan(&n, &f); err != nil {
		t.Fatal(err)
	}
	if err := d.QueryRow(ctxT(t), "SELECT state FROM jobs WHERE id = 1").Scan(&state); err != nil {
		t.Fatal(err)
	}
	t.Logf("acct 1: n %d last_fence %d; jobs 1: %d x's", n, f, strings.Count(state, "x"))
	if n != 19 || f != 12 || strings.Count(state, "x") != 19 {
		t.Errorf("acct 1 n %d last_fence %d, jobs 1 %d writes; want 19 at 12, 19 writes", n, f, strings.Count(state, "x"))
	}
}
