package fencing_test

import (
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Prepared statements across a rules reload: a statement prepared under
// older rules must run under the rules in force (fenced, or refused), in
// both directions, through drivers' statement caches, named statements and
// SQL PREPARE/EXECUTE. Each case runs its own proxy, whose policy the test
// swaps, against a database of its own, and checks the rows themselves.

const reloadSchema = `
CREATE TABLE doc (id int PRIMARY KEY, payload text NOT NULL, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO doc (id, payload) VALUES (1, 'a'), (2, 'b'), (3, 'c');
CREATE TABLE note (id int PRIMARY KEY, payload text NOT NULL);
INSERT INTO note VALUES (1, 'a');
`

const updDoc = "UPDATE doc SET payload = $1 WHERE id = $2"

// reloadEnv is one proxy with a swappable policy, and one database.
type reloadEnv struct {
	pol    *policy.Policy
	proxy  *proxytest.Proxy
	db     string
	direct *pgx.Conn
}

// docRules returns the rules with public.doc in mode ("unlisted": not in
// the configuration).
func docRules(t testing.TB, mode string) *rules.Rules {
	t.Helper()
	cfg := rules.Config{}
	if mode != "unlisted" {
		cfg.Tables = []rules.Table{{Table: "public.doc", Mode: mode}}
	}
	rs, err := rules.Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

func startReload(t *testing.T, mode string, edit ...func(*proxy.Options)) *reloadEnv {
	t.Helper()
	r := &reloadEnv{pol: policy.New(docRules(t, mode), false, policy.Options{})}
	r.proxy = startProxy(t, r.pol, edit...)
	r.db = schemaDB(t, "reload", reloadSchema)
	r.direct = direct(t, r.db)
	return r
}

func (r *reloadEnv) reload(t testing.TB, mode string) {
	t.Helper()
	r.pol.Swap(docRules(t, mode), false)
}

// doc reads one row of doc directly.
func (r *reloadEnv) doc(t testing.TB, id int) (payload string, fence int64) {
	t.Helper()
	if err := r.direct.QueryRow(ctxT(t), "SELECT payload, last_fence FROM doc WHERE id = $1", id).Scan(&payload, &fence); err != nil {
		t.Fatal(err)
	}
	return payload, fence
}

func (r *reloadEnv) wantDoc(t testing.TB, id int, payload string, fence int64) {
	t.Helper()
	if p, f := r.doc(t, id); p != payload || f != fence {
		t.Fatalf("doc %d = (%q, fence %d), want (%q, fence %d)", id, p, f, payload, fence)
	}
}

// preparer is one way of preparing updDoc and running it again.
type preparer struct {
	name string
	// sqlLevel: SQL PREPARE/EXECUTE, which the proxy refuses (rather than
	// prepares again) when the rules in force decide it differently.
	sqlLevel bool
	open     func(t *testing.T, r *reloadEnv) *preparedClient
}

type preparedClient struct {
	setToken func(tok string)
	prepare  func()
	exec     func(payload string, id int) error
	// reprepare prepares the statement again (SQL level: DEALLOCATE and
	// PREPARE); nil when the driver needs nothing.
	reprepare func()
}

var preparers = []preparer{
	{name: "pgx-statement-cache", open: func(t *testing.T, r *reloadEnv) *preparedClient {
		c := connectDSN(t, r.proxy.DSN("postgres", "", r.db)) // QueryExecModeCacheStatement
		return &preparedClient{
			setToken: func(tok string) { setTokenOrReset(t, c, tok) },
			prepare:  func() {},
			exec: func(payload string, id int) error {
				_, err := c.Exec(ctxT(t), updDoc, payload, id)
				return err
			},
		}
	}},
	{name: "pgconn-named-parse", open: func(t *testing.T, r *reloadEnv) *preparedClient {
		c := connectDSN(t, r.proxy.DSN("postgres", "", r.db))
		return &preparedClient{
			setToken: func(tok string) { setTokenOrReset(t, c, tok) },
			prepare: func() {
				if _, err := c.PgConn().Prepare(ctxT(t), "upd_doc", updDoc, nil); err != nil {
					t.Fatalf("prepare: %v", err)
				}
			},
			exec: func(payload string, id int) error {
				_, err := c.PgConn().ExecPrepared(ctxT(t), "upd_doc", [][]byte{[]byte(payload), []byte(strconv.Itoa(id))}, nil, nil).Close()
				return err
			},
		}
	}},
	// An unnamed Parse of the same text for every execution (as pgbench
	// -M extended and drivers without a statement cache): the proxy keeps
	// one definition while the text, rules and decision stay the same.
	{name: "pgx-exec-mode-unnamed", open: func(t *testing.T, r *reloadEnv) *preparedClient {
		c := connectDSN(t, r.proxy.DSN("postgres", "", r.db))
		return &preparedClient{
			setToken: func(tok string) { setTokenOrReset(t, c, tok) },
			prepare:  func() {},
			exec: func(payload string, id int) error {
				_, err := c.Exec(ctxT(t), updDoc, pgx.QueryExecModeExec, payload, id)
				return err
			},
		}
	}},
	sqlPreparer("sql-execute", "EXECUTE upd_doc('%s', %d)"),
	// The PREPARE itself sent as an unnamed Parse, Bind and Execute: the
	// proxy reads the Parse's text in place and must keep its own copy of
	// what the PREPARE defines until the Execute (and after).
	{name: "sql-prepare-in-parse", sqlLevel: true, open: func(t *testing.T, r *reloadEnv) *preparedClient {
		c := connectDSN(t, r.proxy.DSN("postgres", "", r.db))
		prepare := func() {
			if _, err := c.PgConn().Prepare(ctxT(t), "", "PREPARE upd_doc(text, int) AS "+updDoc, nil); err != nil {
				t.Fatalf("Parse of a PREPARE: %v", err)
			}
			if _, err := c.PgConn().ExecPrepared(ctxT(t), "", nil, nil, nil).Close(); err != nil {
				t.Fatalf("Execute of a PREPARE: %v", err)
			}
			// Other messages go through the read buffer before the
			// statement runs.
			for i := range 20 {
				if _, err := c.Exec(ctxT(t), fmt.Sprintf("SELECT '%s', %d", strings.Repeat("x", 200), i)); err != nil {
					t.Fatal(err)
				}
			}
		}
		return &preparedClient{
			setToken: func(tok string) { setTokenOrReset(t, c, tok) },
			prepare:  prepare,
			exec: func(payload string, id int) error {
				_, err := c.Exec(ctxT(t), fmt.Sprintf("EXECUTE upd_doc('%s', %d)", payload, id))
				return err
			},
			reprepare: func() {
				if _, err := c.Exec(ctxT(t), "DEALLOCATE upd_doc"); err != nil {
					t.Fatalf("DEALLOCATE: %v", err)
				}
				prepare()
			},
		}
	}},
	sqlPreparer("sql-explain-analyze-execute", "EXPLAIN (ANALYZE, COSTS OFF) EXECUTE upd_doc('%s', %d)"),
	{name: "lib-pq-prepare", open: func(t *testing.T, r *reloadEnv) *preparedClient {
		c := pinnedPQ(t, r.proxy.DSN("postgres", "", r.db))
		var stmt *sql.Stmt
		return &preparedClient{
			setToken: func(tok string) {
				q := "SET fence.token = '" + tok + "'"
				if tok == "" {
					q = "RESET fence.token"
				}
				if _, err := c.ExecContext(ctxT(t), q); err != nil {
					t.Fatal(err)
				}
			},
			prepare: func() {
				var err error
				if stmt, err = c.PrepareContext(ctxT(t), updDoc); err != nil {
					t.Fatalf("prepare: %v", err)
				}
				t.Cleanup(func() { _ = stmt.Close() })
			},
			exec: func(payload string, id int) error {
				_, err := stmt.ExecContext(ctxT(t), payload, id)
				return err
			},
		}
	}},
}

// sqlPreparer prepares with SQL PREPARE and runs execFmt (payload, id)
// through pgx's simple protocol.
func sqlPreparer(name, execFmt string) preparer {
	return preparer{name: name, sqlLevel: true, open: func(t *testing.T, r *reloadEnv) *preparedClient {
		c := connectDSN(t, r.proxy.DSN("postgres", "", r.db))
		prepare := func() {
			if _, err := c.Exec(ctxT(t), "PREPARE upd_doc(text, int) AS "+updDoc); err != nil {
				t.Fatalf("PREPARE: %v", err)
			}
		}
		return &preparedClient{
			setToken: func(tok string) { setTokenOrReset(t, c, tok) },
			prepare:  prepare,
			exec: func(payload string, id int) error {
				_, err := c.Exec(ctxT(t), fmt.Sprintf(execFmt, payload, id))
				return err
			},
			reprepare: func() {
				if _, err := c.Exec(ctxT(t), "DEALLOCATE upd_doc"); err != nil {
					t.Fatalf("DEALLOCATE: %v", err)
				}
				prepare()
			},
		}
	}}
}

func setTokenOrReset(t testing.TB, c *pgx.Conn, tok string) {
	t.Helper()
	if tok == "" {
		resetToken(t, c)
		return
	}
	setToken(t, c, tok)
}

// TestReloadToEnforce: a statement prepared while doc was not enforced
// (off, audit, not listed) runs after the switch to enforce with a stale
// token: it is fenced (FP001) or refused (FP003, SQL level), and the row
// is unchanged. A fresh token then writes through the same driver cache.
func TestReloadToEnforce(t *testing.T) {
	for _, mode := range []string{"off", "audit", "unlisted"} {
		for _, p := range preparers {
			t.Run(mode+"/"+p.name, func(t *testing.T) {
				t.Parallel()
				r := startReload(t, mode)
				c := p.open(t, r)
				c.setToken("41")
				c.prepare()
				if err := c.exec("warm", 2); err != nil {
					t.Fatalf("before the reload: %v", err)
				}
				r.wantDoc(t, 2, "warm", map[string]int64{"off": 0, "audit": 41, "unlisted": 0}[mode])
				// The lock's new holder wrote row 1 with token 50.
				if _, err := r.direct.Exec(ctxT(t), "UPDATE doc SET payload = 'new', last_fence = 50 WHERE id = 1"); err != nil {
					t.Fatal(err)
				}

				r.reload(t, "enforce")
				err := c.exec("stale", 1)
				want := rules.CodeStaleToken
				if p.sqlLevel {
					want = rules.CodeRefused
				}
				if got := anyCode(err); got != want {
					t.Fatalf("stale write after the reload: got %v (SQLSTATE %q), want SQLSTATE %s", err, got, want)
				}
				r.wantDoc(t, 1, "new", 50)

				c.setToken("60")
				if p.sqlLevel {
					if err := c.exec("fresh", 1); anyCode(err) != rules.CodeRefused {
						t.Fatalf("EXECUTE of the stale statement with a fresh token: got %v, want FP003", err)
					}
					r.wantDoc(t, 1, "new", 50)
					c.reprepare()
				}
				if err := c.exec("fresh", 1); err != nil {
					t.Fatalf("fresh token after the reload: %v", err)
				}
				r.wantDoc(t, 1, "fresh", 60)
				// And once more, from the driver's cache.
				c.setToken("41")
				if err := c.exec("stale2", 1); anyCode(err) != rules.CodeStaleToken {
					t.Fatalf("stale write after re-preparing: got %v, want FP001", err)
				}
				r.wantDoc(t, 1, "fresh", 60)
			})
		}
	}
}

// TestReloadFromEnforce: a statement prepared (and fenced) under enforce
// runs after the switch to off or audit under those rules: a write without
// a token succeeds and is not fenced by the old rules.
func TestReloadFromEnforce(t *testing.T) {
	for _, mode := range []string{"off", "audit"} {
		for _, p := range preparers {
			t.Run(mode+"/"+p.name, func(t *testing.T) {
				t.Parallel()
				r := startReload(t, "enforce")
				c := p.open(t, r)
				c.setToken("60")
				c.prepare()
				if err := c.exec("warm", 2); err != nil {
					t.Fatalf("before the reload: %v", err)
				}
				r.wantDoc(t, 2, "warm", 60)

				r.reload(t, mode)
				c.setToken("")
				err := c.exec("nofence", 1)
				if p.sqlLevel {
					if anyCode(err) != rules.CodeRefused {
						t.Fatalf("EXECUTE of a statement prepared under enforce: got %v, want FP003", err)
					}
					r.wantDoc(t, 1, "a", 0)
					c.reprepare()
					err = c.exec("nofence", 1)
				}
				if err != nil {
					t.Fatalf("write without a token after the switch to %s: %v", mode, err)
				}
				r.wantDoc(t, 1, "nofence", 0)
			})
		}
	}
}

// TestReloadUnprotectedStatementsUnaffected: statements the reload does not
// concern keep running from the driver's cache, without error.
func TestReloadUnprotectedStatementsUnaffected(t *testing.T) {
	r := startReload(t, "off")
	c := connectDSN(t, r.proxy.DSN("postgres", "", r.db))
	ctx := ctxT(t)
	if _, err := c.Exec(ctx, "PREPARE note_upd(text) AS UPDATE note SET payload = $1 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	for i, mode := range []string{"off", "enforce", "audit", "unlisted", "enforce"} {
		r.reload(t, mode)
		if _, err := c.Exec(ctx, "EXECUTE note_upd('x')"); err != nil {
			t.Fatalf("EXECUTE after reload to %s: %v", mode, err)
		}
		if _, err := c.Exec(ctx, "UPDATE note SET payload = $1 WHERE id = $2", strconv.Itoa(i), 1); err != nil {
			t.Fatalf("after reload to %s: %v", mode, err)
		}
		var n int
		if err := c.QueryRow(ctx, "SELECT count(*) FROM note WHERE payload = $1", strconv.Itoa(i)).Scan(&n); err != nil || n != 1 {
			t.Fatalf("after reload to %s: count %d, %v", mode, n, err)
		}
	}
}

// TestReloadRefusedBindInBand: a named statement that the rules in force
// refuse fails at its Bind with the refusal, in-band: the rest of the
// pipeline is skipped up to Sync and the session goes on.
func TestReloadRefusedBindInBand(t *testing.T) {
	r := startReload(t, "unlisted")
	c := connectDSN(t, r.proxy.DSN("postgres", "", r.db))
	ctx := ctxT(t)
	pc := c.PgConn()
	// DELETE ... WHERE CURRENT OF cannot be fenced: refused under enforce.
	if _, err := pc.Prepare(ctx, "del_cur", "DELETE FROM doc WHERE CURRENT OF cur", nil); err != nil {
		t.Fatal(err)
	}
	r.reload(t, "enforce")
	if _, err := c.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "DECLARE cur CURSOR FOR SELECT * FROM doc WHERE id = 1 FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "FETCH cur"); err != nil {
		t.Fatal(err)
	}
	_, err := pc.ExecPrepared(ctx, "del_cur", nil, nil, nil).Close()
	wantCode(t, err, rules.CodeRefused)
	if _, err := c.Exec(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	r.wantDoc(t, 1, "a", 0)
	// The session still works.
	var n int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM doc WHERE id = $1", 1).Scan(&n); err != nil || n != 1 {
		t.Fatalf("after the refusal: %d, %v", n, err)
	}
}

// TestReloadStalePortal: a portal bound before the reload whose statement
// the rules in force decide differently does not run: its Execute fails
// in-band. A portal on an unprotected table runs.
func TestReloadStalePortal(t *testing.T) {
	r := startReload(t, "off")
	c := connectDSN(t, r.proxy.DSN("postgres", "", r.db))
	ctx := ctxT(t)
	setToken(t, c, "41")
	if _, err := r.direct.Exec(ctx, "UPDATE doc SET last_fence = 50 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	fe := c.PgConn().Frontend()
	roundTrip := func(msgs ...pgproto3.FrontendMessage) []pgproto3.BackendMessage {
		t.Helper()
		for _, m := range msgs {
			fe.Send(m)
		}
		fe.Send(&pgproto3.Sync{})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		var got []pgproto3.BackendMessage
		for {
			m, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := m.(type) {
			case *pgproto3.ErrorResponse:
				e := *m
				got = append(got, &e)
			case *pgproto3.ReadyForQuery:
				return got
			default:
				got = append(got, m)
			}
		}
	}
	roundTrip(
		&pgproto3.Parse{Name: "", Query: updDoc},
		&pgproto3.Bind{DestinationPortal: "p_doc", Parameters: [][]byte{[]byte("stale"), []byte("1")}},
		&pgproto3.Parse{Name: "", Query: "UPDATE note SET payload = $1 WHERE id = $2"},
		&pgproto3.Bind{DestinationPortal: "p_note", Parameters: [][]byte{[]byte("portal"), []byte("1")}},
	)
	r.reload(t, "enforce")
	got := roundTrip(&pgproto3.Execute{Portal: "p_note"}, &pgproto3.Execute{Portal: "p_doc"})
	if len(got) != 2 {
		t.Fatalf("got %d responses %#v, want CommandComplete and ErrorResponse", len(got), got)
	}
	if _, ok := got[0].(*pgproto3.CommandComplete); !ok {
		t.Fatalf("Execute of the portal on note: got %#v, want CommandComplete", got[0])
	}
	if e, ok := got[1].(*pgproto3.ErrorResponse); !ok || e.Code != rules.CodeRefused {
		t.Fatalf("Execute of the stale portal: got %#v, want FP003", got[1])
	}
	if _, err := c.Exec(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	r.wantDoc(t, 1, "a", 50)
}

// TestReloadPipelinedReprepare: a statement re-prepared transparently in
// the middle of a pipeline keeps the responses aligned, also when an
// earlier message of the pipeline fails (the injected messages are then
// skipped by the server).
func TestReloadPipelinedReprepare(t *testing.T) {
	r := startReload(t, "off")
	c := connectDSN(t, r.proxy.DSN("postgres", "", r.db))
	ctx := ctxT(t)
	setToken(t, c, "41")
	pc := c.PgConn()
	if _, err := pc.Prepare(ctx, "upd_doc", updDoc, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := r.direct.Exec(ctx, "UPDATE doc SET last_fence = 50 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	r.reload(t, "enforce")

	// An error before the stale statement: the server skips the injected
	// Close and Parse along with the client's Bind and Execute.
	b := &pgconn.Batch{}
	b.ExecParams("SELECT 1/0", nil, nil, nil, nil)
	b.ExecPrepared("upd_doc", [][]byte{[]byte("stale"), []byte("1")}, nil, nil)
	_, err := pc.ExecBatch(ctx, b).ReadAll()
	wantCode(t, err, "22012")
	r.wantDoc(t, 1, "a", 50)

	// Then in a pipeline after other statements: fenced.
	b = &pgconn.Batch{}
	b.ExecParams("SELECT 1", nil, nil, nil, nil)
	b.ExecPrepared("upd_doc", [][]byte{[]byte("stale"), []byte("1")}, nil, nil)
	b.ExecParams("SELECT 2", nil, nil, nil, nil)
	res, err := pc.ExecBatch(ctx, b).ReadAll()
	wantCode(t, err, rules.CodeStaleToken)
	if len(res) < 1 || res[0].Err != nil {
		t.Fatalf("first statement of the pipeline: %#v", res)
	}
	r.wantDoc(t, 1, "a", 50)

	setToken(t, c, "60")
	b = &pgconn.Batch{}
	b.ExecParams("SELECT 1", nil, nil, nil, nil)
	b.ExecPrepared("upd_doc", [][]byte{[]byte("fresh"), []byte("1")}, nil, nil)
	b.ExecPrepared("upd_doc", [][]byte{[]byte("fresh2"), []byte("2")}, nil, nil)
	if _, err := pc.ExecBatch(ctx, b).ReadAll(); err != nil {
		t.Fatal(err)
	}
	r.wantDoc(t, 1, "fresh", 60)
	r.wantDoc(t, 2, "fresh2", 60)
}
