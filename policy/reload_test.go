package policy_test

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/policy"
	"github.com/fenceproxy/fenceproxy/proxy"
	"github.com/fenceproxy/fenceproxy/rules"
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

func startReload(t *testing.T, mode string) *reloadEnv {
	t.Helper()
	r := &reloadEnv{pol: policy.New(docRules(t, mode), false, policy.Options{})}
	r.proxy = proxytest.Start(t, cluster.Addr(), proxy.Options{
		Policy: r.pol,
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)).Named("proxy"),
	})
	r.db = fmt.Sprintf("reload%d", dbSeq.Add(1))
	ctx := ctxT(t)
	if err := cluster.CreateDatabase(ctx, r.db); err != nil {
		t.Fatal(err)
	}
	if err := cluster.ExecDB(ctx, r.db, reloadSchema); err != nil {
		t.Fatal(err)
	}
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
	sqlPreparer("sql-execute", "EXECUTE upd_doc('%s', %d)"),
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
	for i, mode := range []string{"off", "enforce", "audit", "unlisted", "enforce"} {
		r.reload(t, mode)
		if _, err := c.Exec(ctx, "UPDATE note SET payload = $1 WHERE id = $2", strconv.Itoa(i), 1); err != nil {
			t.Fatalf("after reload to %s: %v", mode, err)
		}
		var n int
		if err := c.QueryRow(ctx, "SELECT count(*) FROM note WHERE payload = $1", strconv.Itoa(i)).Scan(&n); err != nil || n != 1 {
			t.Fatalf("after reload to %s: count %d, %v", mode, n, err)
		}
	}
}

var _ = context.Background
