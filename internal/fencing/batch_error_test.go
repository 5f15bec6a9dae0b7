package fencing_test

import (
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestBatchErrorBeforeRegistration: a pipeline (a pgx batch) in which a
// statement fails before one that registers the session's lock. Before
// the registering statement's Bind the proxy waits for the answers to
// what changes the fence settings (a BEGIN, a SAVEPOINT), so the error
// may already have arrived when it sends the registration; the server
// skips both. The batch fails with the statement's error, nothing is
// written, and the session goes on (it was closed as out of step, with
// XX000).
func TestBatchErrorBeforeRegistration(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, callSchema)
	for _, k := range []struct {
		name  string
		begin bool
		stmts []string
	}{
		{"BEGIN, 1/0, CALL, COMMIT", false, []string{"BEGIN", "SELECT 1/0", "CALL bump(3)", "COMMIT"}},
		{"BEGIN, 1/0, UPDATE, COMMIT", false, []string{"BEGIN", "SELECT 1/0", "UPDATE acct SET n = n + 1 WHERE id = 3", "COMMIT"}},
		{"in a transaction: SAVEPOINT, 1/0, CALL", true, []string{"SAVEPOINT a", "SELECT 1/0", "CALL bump(3)"}},
		{"in a transaction: SAVEPOINT, 1/0, UPDATE", true, []string{"SAVEPOINT a", "SELECT 1/0", "UPDATE acct SET n = n + 1 WHERE id = 3"}},
	} {
		t.Run(k.name, func(t *testing.T) {
			c := runPid(t, readerSession(t, p, db, "L", "51", pgx.QueryExecModeCacheStatement))
			before := snapshot(t, d, "acct")
			if k.begin {
				mustExec(t, c, "BEGIN")
			}
			b := &pgx.Batch{}
			for _, s := range k.stmts {
				b.Queue(s)
			}
			if err := c.SendBatch(ctxT(t), b).Close(); sqlState(err) != "22012" {
				t.Errorf("batch: %v, want 22012", err)
			}
			mustExec(t, c, "ROLLBACK")
			var s string
			if err := c.QueryRow(ctxT(t), "SELECT 'ok'").Scan(&s); err != nil || s != "ok" {
				t.Errorf("the session after the batch: %q %v", s, err)
			}
			wantUnchanged(t, d, "acct", before)
		})
	}
}
