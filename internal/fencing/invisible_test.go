package fencing_test

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestSettingChangedByFunction: what stays invisible. A function that
// sets the token as a side effect is not seen; statements on protected
// tables go on running with the value the session last set in a way the
// proxy saw (here 44), not the function's 41.
func TestSettingChangedByFunction(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	if _, err := d.Exec(ctx, `CREATE FUNCTION sneak() RETURNS text LANGUAGE sql AS $f$ SELECT set_config('fence.token', '41', false) $f$`); err != nil {
		t.Fatal(err)
	}
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		c := e.holder(t, db, "L"+mode.String(), 44, mode)
		var v string
		if err := c.QueryRow(ctx, "SELECT sneak()").Scan(&v); err != nil || v != "41" {
			t.Fatalf("%v: sneak: %q %v", mode, v, err)
		}
		if _, err := c.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 2"); err != nil {
			t.Fatalf("%v: write: %v", mode, err)
		}
		var fence int64
		if err := d.QueryRow(ctx, "SELECT last_fence FROM acct WHERE id = 2").Scan(&fence); err != nil || fence != 44 {
			t.Errorf("%v: row 2 stamped %d (%v), want 44: the record wins", mode, fence, err)
		}
		c.Close(ctx)
	}
}

// TestSettingStatementsNotRead: a statement that may change the fence
// settings and that the proxy cannot read is refused, and the session's
// lock name stays what it was: one its parser (PostgreSQL 17's) rejects
// though PostgreSQL 15 accepts it (a comment before UESCAPE), and one
// longer than max_check_bytes, which it does not parse.
func TestSettingStatementsNotRead(t *testing.T) {
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	ctx := ctxT(t)
	c := e.holder(t, db, "before", 44, pgx.QueryExecModeSimpleProtocol)
	lockNow := func() string {
		t.Helper()
		var v string
		// The setting's name built at run time: this read changes nothing
		// and does not mention the name.
		if err := c.QueryRow(ctx, "SELECT current_setting(n, true) FROM (VALUES ('fence.lo' || 'ck')) v(n)").Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	for name, sql := range map[string]string{
		"comment before UESCAPE":      `SET fence.lock = U&'!004c' /* c */ UESCAPE '!'`,
		"longer than max_check_bytes": "SET fence.lock = '" + strings.Repeat("x", rules.DefaultMaxCheckBytes+1) + "'",
	} {
		_, err := c.Exec(ctx, sql)
		wantCode(t, err, "FP003")
		if got := lockNow(); got != "before" {
			t.Errorf("%s: the lock is %q after the refusal, want %q", name, got, "before")
		}
	}
}
