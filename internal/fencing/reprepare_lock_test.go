package fencing_test

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestReprepareKeepsRegistration: a statement prepared before a reload
// that starts fencing its table is prepared again under the rules in
// force at its next Bind, and runs with their lock registration: a stale
// holder's write is refused, the row unchanged.
func TestReprepareKeepsRegistration(t *testing.T) {
	t.Parallel()
	off, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.acct", Mode: "off"}}})
	if err != nil {
		t.Fatal(err)
	}
	on, err := rules.Compile(lockRules)
	if err != nil {
		t.Fatal(err)
	}
	pol := policy.New(off, false, policy.Options{})
	p := startProxy(t, pol)
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	holder := func(tok int) *pgx.Conn {
		return connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
			c.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
			c.RuntimeParams["fence.lock"] = "L"
			c.RuntimeParams["fence.token"] = fmt.Sprint(tok)
		})
	}
	const upd = "UPDATE acct SET n = n + 1 WHERE id = 1"
	old := holder(10)
	if _, err := old.Exec(ctx, upd); err != nil { // prepared, unfenced
		t.Fatal(err)
	}
	pol.Swap(on, false)
	newer := holder(20)
	if _, err := newer.Exec(ctx, "SELECT n FROM acct WHERE id = 2"); err != nil { // registers 20
		t.Fatal(err)
	}
	before := snapshot(t, d, "acct")
	_, err = old.Exec(ctx, upd) // the cached statement: Bind, prepared again
	wantCode(t, err, "FP001")
	wantUnchanged(t, d, "acct", before)
}
