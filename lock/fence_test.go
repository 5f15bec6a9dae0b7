package lock_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/fenceproxy/fenceproxy/internal/pgbouncer"
	"github.com/fenceproxy/fenceproxy/lock"
)

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
