package fencing_test

import (
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestDeallocatedStatement: after a protocol-level Close of a client's own
// named statement (pgx's Deallocate), a Bind of the name gets PostgreSQL's
// own answer, 26000, on which drivers prepare again; then it works again.
func TestDeallocatedStatement(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startEnv(t)
	db := e.newDB(t)
	c := e.connect(t, db)
	ctx := ctxT(t)
	for _, sql := range []string{"SELECT 1", "UPDATE acct SET n = n WHERE id = 1"} {
		pc := c.PgConn()
		if _, err := pc.Prepare(ctx, "ps1", sql, nil); err != nil {
			t.Fatalf("%s: prepare: %v", sql, err)
		}
		if err := c.Deallocate(ctx, "ps1"); err != nil {
			t.Fatalf("%s: deallocate: %v", sql, err)
		}
		r := pc.ExecPrepared(ctx, "ps1", nil, nil, nil).Read()
		var pe *pgconn.PgError
		if !errors.As(r.Err, &pe) || pe.Code != "26000" {
			t.Fatalf("%s: Bind after Close: %v, want SQLSTATE 26000", sql, r.Err)
		}
		// The driver's recovery: prepare again under the name.
		if _, err := pc.Prepare(ctx, "ps1", sql, nil); err != nil {
			t.Fatalf("%s: prepare again: %v", sql, err)
		}
		if err := c.Deallocate(ctx, "ps1"); err != nil {
			t.Fatal(err)
		}
	}
	// Never prepared at all: the same answer as PostgreSQL's.
	r := c.PgConn().ExecPrepared(ctx, "never", nil, nil, nil).Read()
	var pe *pgconn.PgError
	if !errors.As(r.Err, &pe) || pe.Code != "26000" || pe.Message != `prepared statement "never" does not exist` {
		t.Fatalf("Bind of a name never prepared: %v", r.Err)
	}
}
