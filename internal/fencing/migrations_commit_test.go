package fencing_test

import (
	"context"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// migratorRole is the migrations role (ddl.allow_roles) of these tests.
const migratorRole = "fp_migrator"

// startMigrationsEnv starts a proxy whose databases are checked, with
// migratorRole as its migrations role.
func startMigrationsEnv(t *testing.T) *env {
	t.Helper()
	checker, specs := startChecker(t, testRules)
	e := startPolicyEnv(t, policy.Options{Checks: checker}, specs)
	e.pol.SetMigrations(policy.MigrationOptions{AllowRoles: []string{migratorRole},
		Catalog: func(ctx context.Context, database string) (*pgx.Conn, error) {
			return pgx.Connect(ctx, cluster.SuperuserDSN(database))
		}})
	// Once: concurrent CREATE ROLE of one name may fail on the catalog's
	// unique index rather than with duplicate_object.
	migratorOnce.Do(func() {
		migratorErr = cluster.Exec(ctxT(t), `DO $$BEGIN CREATE ROLE `+migratorRole+` LOGIN SUPERUSER;
			EXCEPTION WHEN duplicate_object THEN NULL; END$$`)
	})
	if migratorErr != nil {
		t.Fatal(migratorErr)
	}
	return e
}

var (
	migratorOnce sync.Once
	migratorErr  error
)

// TestMigrationCommit: a migrations role drops the fence column of a
// protected table in a transaction through the proxy. From the ALTER on,
// writes to the table through the proxy from another session are refused
// (FP003) without waiting for its lock, and so is the first write after
// the COMMIT, with no wait in between: the proxy had not checked the
// table since. The data is unchanged. Once the role adds the column again
// and the proxy has checked the table after it, writes go through. With
// the catalog watch (fenceproxy setup as the superuser) and without it;
// no notification reaches this proxy (no audit listener), so the end of
// the transaction is what pg_stat_activity shows.
func TestMigrationCommit(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startMigrationsEnv(t)
	for _, watched := range []bool{true, false} {
		name := "watched"
		if !watched {
			name = "unwatched"
		}
		t.Run(name, func(t *testing.T) {
			ctx := ctxT(t)
			db := e.newDB(t)
			d := direct(t, db)
			if !watched {
				execDirect(t, d, "DROP EVENT TRIGGER fenceproxy_catalog_ddl; DROP EVENT TRIGGER fenceproxy_catalog_drop")
			}
			c := e.connect(t, db)
			setToken(t, c, "5")
			write := func() error {
				_, err := c.Exec(ctx, "UPDATE acct SET n = n + 1 WHERE id = 1")
				return err
			}
			if err := write(); err != nil {
				t.Fatalf("write before the migration: %v", err)
			}
			mig := connectDSN(t, e.proxy.DSN(migratorRole, "", db))
			mustExec(t, mig, "BEGIN")
			mustExec(t, mig, "ALTER TABLE acct DROP COLUMN last_fence")
			wantPgError(t, write(), "FP003")
			mustExec(t, mig, "COMMIT")
			wantPgError(t, write(), "FP003")
			var n int
			var cols int
			if err := d.QueryRow(ctx, `SELECT n, (SELECT count(*) FROM pg_attribute WHERE attrelid = 'acct'::regclass
				AND attname = 'last_fence' AND NOT attisdropped) FROM acct WHERE id = 1`).Scan(&n, &cols); err != nil {
				t.Fatal(err)
			}
			if n != 1 || cols != 0 {
				t.Fatalf("after the migration: n = %d, fence columns = %d; want 1, 0", n, cols)
			}
			// Refused until fixed, also once the check has run.
			if err := e.pol.WaitMigrations(ctx, db); err != nil {
				t.Fatal(err)
			}
			wantPgError(t, write(), "FP003")

			mustExec(t, mig, "ALTER TABLE acct ADD COLUMN last_fence bigint NOT NULL DEFAULT 0")
			if err := e.pol.WaitMigrations(ctx, db); err != nil {
				t.Fatal(err)
			}
			if err := write(); err != nil {
				t.Fatalf("write after the fix: %v", err)
			}
			var fence int64
			if err := d.QueryRow(ctx, "SELECT n, last_fence FROM acct WHERE id = 1").Scan(&n, &fence); err != nil {
				t.Fatal(err)
			}
			if n != 2 || fence != 5 {
				t.Fatalf("after the fix: n = %d, last_fence = %d; want 2, 5", n, fence)
			}
			mig.Close(ctx)
		})
	}
}

// TestMigrationEndedByRelay: the relay's report that a session has no
// transaction open (Policy.MigrationEnded) ends its migration: the
// database is checked again, and writes to the table are decided by the
// check again. The session has no backend the policy could look at.
func TestMigrationEndedByRelay(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startMigrationsEnv(t)
	db := e.newDB(t)
	ctx := ctxT(t)
	lex := proxy.Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}
	app := &proxy.SessionInfo{ID: 1, User: "postgres", Database: db}
	const upd = "UPDATE acct_skip SET n = 1 WHERE id = 1"
	if d := e.pol.Decide(app, lex, upd); d.Action != proxy.Rewrite {
		t.Fatalf("write before: %v (%v)", d.Action, d.Err)
	}
	mig := &proxy.SessionInfo{ID: 2, User: migratorRole, Database: db}
	if d := e.pol.Decide(mig, lex, "ALTER TABLE acct_skip ALTER COLUMN payload DROP NOT NULL"); d.Action != proxy.Forward {
		t.Fatalf("migration: %v (%v)", d.Action, d.Err)
	}
	if d := e.pol.Decide(app, lex, upd); d.Action != proxy.Refuse || d.Err == nil || d.Err.Code != "FP003" {
		t.Fatalf("write during the migration: %v (%v), want FP003", d.Action, d.Err)
	}
	e.pol.MigrationEnded(app) // another session: nothing
	e.pol.MigrationEnded(mig)
	if err := e.pol.WaitMigrations(ctx, db); err != nil {
		t.Fatal(err)
	}
	if d := e.pol.Decide(app, lex, upd); d.Action != proxy.Rewrite {
		t.Fatalf("write after: %v (%v)", d.Action, d.Err)
	}
}
