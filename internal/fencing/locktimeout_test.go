package fencing_test

import (
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestLockTimeoutInWrite: in a database with the catalog watch the
// proxy's check sets lock_timeout for a write's transaction while a change
// of the catalog is under way, so that the write cannot wait for it and
// then run through a path it opened. A write whose own text may change
// lock_timeout is refused, in either protocol, and changes nothing: here
// writes of a table the proxy does not protect, which a change may make a
// path to one (a protected table's write may not call set_config at all).
// Set in a statement of its own, or in a database without the watch (no
// check to undo), it goes.
func TestLockTimeoutInWrite(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	const plainSchema = "CREATE TABLE plain2 (id bigint PRIMARY KEY, n int NOT NULL DEFAULT 0, s text); INSERT INTO plain2 (id) VALUES (1), (2), (3);"
	db, d := bindDB(t, plainSchema)
	writes := []string{
		"UPDATE plain2 SET n = n + 1 WHERE id = $1 AND pg_catalog.set_config('lock_timeout', '0', true) IS NOT NULL",
		"UPDATE plain2 SET s = set_config('Lock_Timeout', '0', true) WHERE id = $1",
		"DELETE FROM plain2 WHERE id = $1 AND set_config('lock_' || 'timeout', '0', true) = '0'",
	}
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		c := readerSession(t, p, db, "", "7", mode)
		before := testutil.QueryStrings(t, d, "SELECT format('%s:%s:%s', id, n, s) FROM plain2 ORDER BY id")
		for _, w := range writes {
			if _, err := c.Exec(ctxT(t), w, 1); sqlState(err) != "FP003" {
				t.Errorf("%v: %s: %v, want FP003", mode, w, err)
			}
		}
		if after := testutil.QueryStrings(t, d, "SELECT format('%s:%s:%s', id, n, s) FROM plain2 ORDER BY id"); !slices.Equal(after, before) {
			t.Errorf("%v: refused writes changed plain2:\n before %s\n after  %s", mode, before, after)
		}
		if _, err := c.Exec(ctxT(t), "SELECT set_config('lock_timeout', '5s', false)"); err != nil {
			t.Errorf("%v: lock_timeout set in a statement of its own: %v", mode, err)
		}
		if _, err := c.Exec(ctxT(t), "UPDATE acct SET n = n + 1 WHERE id = $1", 2); err != nil {
			t.Errorf("%v: a write after it: %v", mode, err)
		}
	}
	if r := snapshot(t, d, "acct")[2]; r.N != 2 || r.Fence != 7 {
		t.Errorf("row 2 = %+v, want n 2, fence 7", r)
	}

	// Without the watch no check sets lock_timeout: nothing to undo.
	db2, d2 := bindDB(t, plainSchema)
	execDirect(t, d2, "DROP EVENT TRIGGER fenceproxy_catalog_ddl; DROP EVENT TRIGGER fenceproxy_catalog_drop")
	c := readerSession(t, p, db2, "", "7", pgx.QueryExecModeSimpleProtocol)
	if _, err := c.Exec(ctxT(t), writes[0], 3); err != nil {
		t.Errorf("unwatched: %s: %v", writes[0], err)
	}
	if got := testutil.QueryStrings(t, d2, "SELECT n::text FROM plain2 WHERE id = 3"); len(got) != 1 || got[0] != "1" {
		t.Errorf("unwatched: plain2 row 3 n = %v, want 1", got)
	}
}
