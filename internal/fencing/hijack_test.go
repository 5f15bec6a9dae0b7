package fencing_test

import (
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestRegistrationHijack: stored code that deallocates the proxy's
// registration statement and prepares its own under the name (which a
// client can read in pg_prepared_statements) cannot stand in for the
// registration: the proxy parses it again at every use. The stale
// holder's write is refused and the data is unchanged.
func TestRegistrationHijack(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	if _, err := d.Exec(ctx, `CREATE FUNCTION hijack() RETURNS int LANGUAGE plpgsql AS $f$
DECLARE n text;
BEGIN
	FOR n IN SELECT name FROM pg_prepared_statements WHERE name LIKE 'fenceproxy%' LOOP
		EXECUTE format('DEALLOCATE %I', n);
		EXECUTE format('PREPARE %I AS SELECT 1', n);
	END LOOP;
	RETURN 1;
END $f$`); err != nil {
		t.Fatal(err)
	}
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		lockName := "L" + mode.String()
		old := e.holder(t, db, lockName, 10, mode)
		const upd = "UPDATE acct SET n = n + 1 WHERE id = 1"
		if _, err := old.Exec(ctx, upd); err != nil {
			t.Fatalf("%v: first write: %v", mode, err)
		}
		var replaced int
		if err := old.QueryRow(ctx, "SELECT hijack()").Scan(&replaced); err != nil {
			t.Fatalf("%v: hijack: %v", mode, err)
		}
		newer := e.holder(t, db, lockName, 20, mode)
		if _, err := newer.Exec(ctx, "SELECT n FROM acct WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		before := snapshot(t, d, "acct")
		wantCode(t, execErr(t, old, upd), "FP001")
		wantCode(t, execErr(t, old, "INSERT INTO acct (id, payload) VALUES (900, 'stale')"), "FP001")
		wantUnchanged(t, d, "acct", before)
		old.Close(ctx)
		newer.Close(ctx)
	}
}

func execErr(t *testing.T, c *pgx.Conn, sql string) error {
	_, err := c.Exec(ctxT(t), sql)
	return err
}
