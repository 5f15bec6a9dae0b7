package service_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestReloadMigrationRoles: ddl.allow_roles follows a reload. A session of
// the role that stays connected across the reloads has DDL on a protected
// table refused before the role is listed, forwarded once it is, and
// refused again once it is taken off; the table is looked at directly.
func TestReloadMigrationRoles(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	ctx := context.Background()
	const role = "fp_reload_migrator"
	if err := cluster.CreateDatabase(ctx, "migreload"); err != nil {
		t.Fatal(err)
	}
	if err := cluster.ExecDB(ctx, "migreload", `CREATE ROLE `+role+` LOGIN SUPERUSER;
		CREATE TABLE cfgm (id int PRIMARY KEY, v text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	config := func(roles string) {
		writeFile(t, path, fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\ntables:\n  - table: public.cfgm\nddl:\n  allow_roles: [%s]\n",
			cluster.Addr(), roles))
	}
	config("someone_else")
	in, _ := startInstance(t, path)
	c, err := pgx.Connect(ctx, "postgres://"+role+"@"+in.Addr()+"/migreload?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	d, err := pgx.Connect(ctx, cluster.SuperuserDSN("migreload"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close(ctx)
	notNull := func() bool {
		t.Helper()
		var nn bool
		if err := d.QueryRow(ctx, "SELECT attnotnull FROM pg_attribute WHERE attrelid = 'cfgm'::regclass AND attname = 'v'").Scan(&nn); err != nil {
			t.Fatal(err)
		}
		return nn
	}

	const drop = "ALTER TABLE cfgm ALTER COLUMN v DROP NOT NULL"
	if _, err := c.Exec(ctx, drop); sqlstate(err) != "FP003" {
		t.Fatalf("not a migrations role: %v, want FP003", err)
	}
	if !notNull() {
		t.Fatal("the refused ALTER changed the table")
	}

	config("someone_else, " + role)
	if err := in.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, drop); err != nil {
		t.Fatalf("listed after the reload: %v", err)
	}
	if notNull() {
		t.Fatal("the forwarded ALTER did not run")
	}

	config("someone_else")
	if err := in.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "ALTER TABLE cfgm ALTER COLUMN v SET NOT NULL"); sqlstate(err) != "FP003" {
		t.Fatalf("taken off by the reload: %v, want FP003", err)
	}
	if notNull() {
		t.Fatal("the refused ALTER changed the table")
	}
}
