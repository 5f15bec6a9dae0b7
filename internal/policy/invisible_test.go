package policy_test

import (
	"testing"

	"github.com/jackc/pgx/v5"

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
