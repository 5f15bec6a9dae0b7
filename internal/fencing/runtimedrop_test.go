package fencing_test

import (
	"fmt"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestRuntimeBuiltDropOwned shows the limit docs/operating.md states
// ("words computed at run time are not seen"): a function whose DROP
// OWNED BY is built at run time, created on a direct connection or
// through the proxy with its words split, and called through the proxy
// by the protected table's owner, in either protocol, drops the table,
// with the database guard or without (its triggers do not see a drop).
// docs/design.md, "DDL that reaches a protected table without naming
// it", says why the proxy cannot tell such a call from a direct one. If
// this test starts failing because the table survives, the limit is
// gone: update both documents.
func TestRuntimeBuiltDropOwned(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startEnv(t)
	specs, err := rules.Specs(testRules)
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	// The words split so that no string of the body holds "owned".
	const body = `$f$ BEGIN EXECUTE 'DR' || 'OP OW' || 'NED BY ' || quote_ident(current_user); END $f$`
	for _, guarded := range []bool{false, true} {
		for _, x := range execBoth {
			for _, where := range []string{"direct", "proxy"} {
				name := fmt.Sprintf("guard=%v/%s/created %s", guarded, x.name, where)
				t.Run(name, func(t *testing.T) {
					db := e.newDB(t)
					owner := "fp_rt_" + db
					if err := cluster.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN", owner)); err != nil {
						t.Fatal(err)
					}
					d := ownedSetup(t, db, owner)
					if guarded {
						if _, err := dbsetup.Setup(ctx, d, specs, dbsetup.SetupOptions{Guard: true, Tables: testRules.Tables}); err != nil {
							t.Fatal(err)
						}
					}
					c := connectDSN(t, e.proxy.DSN(owner, "", db))
					create := "CREATE FUNCTION fp_rt() RETURNS void LANGUAGE plpgsql AS " + body
					if where == "direct" {
						if _, err := d.Exec(ctx, "SET ROLE "+owner+"; "+create+"; RESET ROLE"); err != nil {
							t.Fatal(err)
						}
					} else if err := x.exec(t, c, create); err != nil {
						t.Fatalf("the body's words are not seen, so it is created: %v", err)
					}
					if rows := snapshot(t, d, tError); len(rows) != 3 {
						t.Fatalf("acct before: %v", rows)
					}
					if err := x.exec(t, c, "SELECT fp_rt()"); err != nil {
						t.Fatalf("the call is forwarded: %v", err)
					}
					if tableExists(t, d, tError) {
						t.Fatal("acct survived: the limit is closed, update docs/operating.md and docs/design.md")
					}
				})
			}
		}
	}
}
