package fencing_test

import (
	"fmt"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestDropDatabaseUnfenced: a session the rules do not fence (another
// user) cannot drop, through the proxy, a database in which the
// configuration protects tables; another database it can.
func TestDropDatabaseUnfenced(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	n := dbSeq.Add(1)
	protected, other := fmt.Sprintf("dropme%d", n), fmt.Sprintf("dropother%d", n)
	ctx := ctxT(t)
	for _, db := range []string{protected, other} {
		if err := cluster.CreateDatabase(ctx, db); err != nil {
			t.Fatal(err)
		}
	}
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.acct",
		Scope: rules.Scope{Databases: []string{protected}, Users: []string{"someone_else"}}}}})
	if err != nil {
		t.Fatal(err)
	}
	p := proxytest.Start(t, cluster.Addr(), proxy.Options{Policy: policy.New(rs, false, policy.Options{})})
	c := connectDSN(t, p.DSN("postgres", "", "postgres"))
	_, err = c.Exec(ctx, "DROP DATABASE "+protected)
	wantCode(t, err, "FP003")
	d := direct(t, "postgres")
	exists := func(db string) bool {
		var ok bool
		if err := d.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", db).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !exists(protected) {
		t.Fatal("the protected database was dropped")
	}
	if _, err := c.Exec(ctx, "DROP DATABASE "+other); err != nil {
		t.Fatalf("DROP DATABASE of a database without protected tables: %v", err)
	}
	if exists(other) {
		t.Fatal("the other database is still there")
	}
}
