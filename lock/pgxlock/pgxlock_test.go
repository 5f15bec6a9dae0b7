package pgxlock_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/internal/etcdcluster/etcdtest"
	"github.com/fenceproxy/fenceproxy/internal/pgbouncer"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/etcdlock"
	"github.com/fenceproxy/fenceproxy/lock/pgxlock"
)

func TestMain(m *testing.M) {
	etcdtest.VerifyTestMain(m)
}

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// newClient starts a one-member etcd cluster for the test and returns a
// client for it, for grants to carry to PostgreSQL.
func newClient(t *testing.T) *clientv3.Client {
	t.Helper()
	cli, err := etcdtest.Start(t, 1).Client()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

func mustAcquire(t *testing.T, ctx context.Context, cli *clientv3.Client, key string, opts lock.Options) *etcdlock.Lease {
	t.Helper()
	l, err := etcdlock.Acquire(ctx, cli, key, opts)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", key, err)
	}
	return l
}

func mustRelease(t *testing.T, ctx context.Context, l *etcdlock.Lease) {
	t.Helper()
	if err := l.Release(ctx); err != nil {
		t.Fatalf("Release(%q, token %d): %v", l.Key(), l.Token(), err)
	}
}

// startPG starts a throwaway PostgreSQL cluster for t.
func startPG(t *testing.T) *pgcluster.Cluster {
	t.Helper()
	return pgtest.Start(t, pgcluster.Options{})
}

func show(t *testing.T, ctx context.Context, conn *pgx.Conn, setting string) string {
	t.Helper()
	var v string
	if err := conn.QueryRow(ctx, "SELECT current_setting($1)", setting).Scan(&v); err != nil {
		t.Fatalf("current_setting(%q): %v", setting, err)
	}
	return v
}

// TestConfigure connects with pgx after Configure, and with the
// PGOptions string as the options startup parameter, and reads both
// settings back from PostgreSQL, for lock names with spaces and
// backslashes and for custom setting names.
func TestConfigure(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	pg := startPG(t)

	for _, tc := range []struct {
		name     string
		lock     string
		settings lock.Settings
	}{
		{"plain", "locks/report", lock.Settings{}},
		{"space", "locks/tenant 7 config", lock.Settings{}},
		{"backslash", `locks\a\\b\ c\`, lock.Settings{}},
		{"quotes and tab", "locks/'x\"\ty=z", lock.Settings{}},
		{"custom names", "locks/custom", lock.Settings{Token: "app.fence_token", Lock: "app.fence_lock"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := mustAcquire(t, ctx, cli, tc.lock, lock.Options{KeepAlive: true})
			defer mustRelease(t, ctx, l)
			token, lockSetting := tc.settings.Token, tc.settings.Lock
			if token == "" {
				token, lockSetting = lock.DefaultTokenSetting, lock.DefaultLockSetting
			}

			for _, via := range []string{"RuntimeParams", "options"} {
				cfg, err := pgx.ParseConfig(pg.SuperuserDSN("postgres"))
				if err != nil {
					t.Fatal(err)
				}
				if via == "RuntimeParams" {
					pgxlock.Configure(cfg, l.Fence(tc.settings))
				} else {
					cfg.RuntimeParams["options"] = l.PGOptions(tc.settings)
				}
				conn, err := pgx.ConnectConfig(ctx, cfg)
				if err != nil {
					t.Fatalf("%s: connect: %v", via, err)
				}
				if got := show(t, ctx, conn, token); got != strconv.FormatInt(l.Token(), 10) {
					t.Errorf("%s: %s = %q, want %d", via, token, got, l.Token())
				}
				if got := show(t, ctx, conn, lockSetting); got != tc.lock {
					t.Errorf("%s: %s = %q, want %q", via, lockSetting, got, tc.lock)
				}
				conn.Close(ctx)
			}
		})
	}
}

// settingsIn reads both settings inside q's current transaction; an unset
// custom setting reads as "".
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func settingsIn(t *testing.T, ctx context.Context, q querier, s lock.Settings) (token, name string) {
	t.Helper()
	tk, lk := s.Token, s.Lock
	if tk == "" {
		tk, lk = lock.DefaultTokenSetting, lock.DefaultLockSetting
	}
	var a, b *string
	if err := q.QueryRow(ctx, "SELECT current_setting($1, true), current_setting($2, true)", tk, lk).Scan(&a, &b); err != nil {
		t.Fatal(err)
	}
	if a != nil {
		token = *a
	}
	if b != nil {
		name = *b
	}
	return token, name
}

// TestBeginTxBehindTransactionPooler: two applications share one server
// connection through PgBouncer in transaction mode (pool of 1). Each
// transaction begun with BeginTx sees its own grant, whatever ran on the
// server connection before, and a transaction without the helper sees
// neither: nothing leaks from one transaction to the next.
func TestBeginTxBehindTransactionPooler(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pg := startPG(t)
	b := pgbouncer.Start(t, pg.Addr(), "transaction", 1)

	for _, mode := range []string{"exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			dsn := b.DSN("postgres", "postgres") + "&default_query_exec_mode=" + mode
			connA, err := pgx.Connect(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer connA.Close(ctx)
			connB, err := pgx.Connect(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer connB.Close(ctx)
			fa := lock.Fence{Token: 41, Lock: "locks/config 'a'"}
			fb := lock.Fence{Token: 43, Lock: "locks/config"}

			for round := range 3 {
				for _, c := range []struct {
					conn *pgx.Conn
					f    lock.Fence
				}{{connA, fa}, {connB, fb}} {
					tx, err := pgxlock.BeginTx(ctx, c.conn, c.f, pgx.TxOptions{})
					if err != nil {
						t.Fatal(err)
					}
					tok, name := settingsIn(t, ctx, tx, lock.Settings{})
					if tok != strconv.FormatInt(c.f.Token, 10) || name != c.f.Lock {
						t.Errorf("round %d: in the transaction of %q: token %q lock %q", round, c.f.Lock, tok, name)
					}
					if round == 1 {
						err = tx.Rollback(ctx)
					} else {
						err = tx.Commit(ctx)
					}
					if err != nil {
						t.Fatal(err)
					}
					// The next client's transaction without the helper
					// lands on the same server connection and sees
					// nothing.
					other := connB
					if c.conn == connB {
						other = connA
					}
					tx2, err := other.Begin(ctx)
					if err != nil {
						t.Fatal(err)
					}
					if tok, name := settingsIn(t, ctx, tx2, lock.Settings{}); tok != "" || name != "" {
						t.Errorf("round %d: a plain transaction after %q's sees token %q lock %q", round, c.f.Lock, tok, name)
					}
					tx2.Rollback(ctx) //nolint:errcheck
				}
			}
		})
	}
}

// TestBeginTxOverlapping: with a pool of 2, two transactions open at once
// each see their own grant.
func TestBeginTxOverlapping(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pg := startPG(t)
	b := pgbouncer.Start(t, pg.Addr(), "transaction", 2)
	dsn := b.DSN("postgres", "postgres") + "&default_query_exec_mode=exec"
	var txs []pgx.Tx
	for i := range 2 {
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		tx, err := pgxlock.BeginTx(ctx, conn, lock.Fence{Token: int64(100 + i), Lock: "L" + strconv.Itoa(i)}, pgx.TxOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck
		txs = append(txs, tx)
	}
	for i, tx := range txs {
		if tok, name := settingsIn(t, ctx, tx, lock.Settings{}); tok != strconv.Itoa(100+i) || name != "L"+strconv.Itoa(i) {
			t.Errorf("transaction %d sees token %q lock %q", i, tok, name)
		}
	}
}
