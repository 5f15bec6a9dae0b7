package lock_test

import (
	"context"
	"database/sql"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/fenceproxy/fenceproxy/internal/pgbouncer"
	"github.com/fenceproxy/fenceproxy/lock"
)

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
					tx, err := lock.BeginTx(ctx, c.conn, c.f, pgx.TxOptions{})
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
		tx, err := lock.BeginTx(ctx, conn, lock.Fence{Token: int64(100 + i), Lock: "L" + strconv.Itoa(i)}, pgx.TxOptions{})
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

// TestBeginSQL: database/sql through PgBouncer in transaction mode, with
// custom setting names; the settings end with the transaction.
func TestBeginSQL(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pg := startPG(t)
	b := pgbouncer.Start(t, pg.Addr(), "transaction", 1)
	cfg, err := pgx.ParseConfig(b.DSN("postgres", "postgres") + "&default_query_exec_mode=exec")
	if err != nil {
		t.Fatal(err)
	}
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	s := lock.Settings{Token: "app.token", Lock: "app.lock"}
	f := lock.Fence{Token: 7, Lock: `a\b c`, Settings: s}

	read := func(q interface {
		QueryRowContext(context.Context, string, ...any) *sql.Row
	}) (string, string) {
		var a, b sql.NullString
		if err := q.QueryRowContext(ctx, "SELECT current_setting('app.token', true), current_setting('app.lock', true)").Scan(&a, &b); err != nil {
			t.Fatal(err)
		}
		return a.String, b.String
	}
	tx, err := lock.BeginSQL(ctx, db, f, nil)
	if err != nil {
		t.Fatal(err)
	}
	if tok, name := read(tx); tok != "7" || name != `a\b c` {
		t.Errorf("in the transaction: %q %q", tok, name)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if tok, name := read(db); tok != "" || name != "" {
		t.Errorf("after the transaction: %q %q", tok, name)
	}
	// Apply on an open transaction, and a bad setting name refused
	// before anything is sent.
	tx, err = db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	if err := f.ApplySQL(ctx, tx); err != nil {
		t.Fatal(err)
	}
	if tok, _ := read(tx); tok != "7" {
		t.Errorf("after ApplySQL: %q", tok)
	}
	if _, err := lock.BeginSQL(ctx, db, lock.Fence{Token: 1, Settings: lock.Settings{Token: "x'; DROP"}}, nil); err == nil {
		t.Error("BeginSQL accepted an invalid setting name")
	}
}

// TestGrantFence: a grant's Fence carries its token and name.
func TestGrantFence(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	l := mustAcquire(t, ctx, newClient(t), "locks/fence", lock.Options{})
	defer mustRelease(t, ctx, l)
	f := l.Fence(lock.Settings{})
	if f.Token != l.Token() || f.Lock != "locks/fence" {
		t.Errorf("Fence() = %+v", f)
	}
	if got, want := f.PGOptions(), l.PGOptions(lock.Settings{}); got != want {
		t.Errorf("Fence.PGOptions %q, Lease.PGOptions %q", got, want)
	}
}
