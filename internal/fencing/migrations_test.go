package fencing_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

var migrationDBs atomic.Int64

// TestMigrationsAtStartup: DDL on a protected table that changes nothing,
// judged against the real catalog, is forwarded (Sequelize's
// sync({alter: true}) statements); DDL that changes something is refused,
// and forwarded for a user in ddl.allow_roles; when the catalog cannot be
// read the refusal stands.
func TestMigrationsAtStartup(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	ctx := t.Context()
	db := fmt.Sprintf("migr%d", migrationDBs.Add(1))
	if err := cluster.CreateDatabase(ctx, db); err != nil {
		t.Fatal(err)
	}
	if err := cluster.ExecDB(ctx, db, `CREATE TABLE config (id int PRIMARY KEY, payload text NOT NULL, note varchar(255) DEFAULT 'x',
		n int, last_fence bigint NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	if err != nil {
		t.Fatal(err)
	}
	p := policy.New(rs, false, policy.Options{})
	fail := false
	p.SetMigrations(policy.MigrationOptions{AllowRoles: []string{"migrator"},
		Catalog: func(ctx context.Context, database string) (*pgx.Conn, error) {
			if fail {
				return nil, fmt.Errorf("down")
			}
			return pgx.Connect(ctx, cluster.SuperuserDSN(database))
		}})
	app := &proxy.SessionInfo{User: "app", Database: db}
	for _, tc := range []struct {
		sql  string
		want proxy.Action
	}{
		{`ALTER TABLE "config" ALTER COLUMN "payload" SET NOT NULL;ALTER TABLE "config" ALTER COLUMN "payload" DROP DEFAULT;ALTER TABLE "config" ALTER COLUMN "payload" TYPE TEXT;`, proxy.Forward},
		{`ALTER TABLE config ALTER COLUMN note TYPE VARCHAR(255), ALTER COLUMN note SET DEFAULT 'x', ALTER COLUMN n DROP NOT NULL`, proxy.Forward},
		{`ALTER TABLE config ALTER COLUMN last_fence SET NOT NULL, ALTER COLUMN last_fence SET DEFAULT 0, ALTER COLUMN last_fence TYPE bigint`, proxy.Forward},
		{`ALTER TABLE public.config ADD COLUMN IF NOT EXISTS n bigint DEFAULT random()`, proxy.Forward},
		{`CREATE INDEX IF NOT EXISTS config_n ON config (n)`, proxy.Forward},
		// GORM AutoMigrate with a model that differs: these change the table.
		{`ALTER TABLE config ALTER COLUMN payload DROP NOT NULL`, proxy.Refuse},
		{`ALTER TABLE config ALTER COLUMN last_fence DROP DEFAULT`, proxy.Refuse},
		{`ALTER TABLE config ALTER COLUMN note TYPE varchar(100)`, proxy.Refuse},
		{`ALTER TABLE config ALTER COLUMN note SET DEFAULT 'y'`, proxy.Refuse},
		{`ALTER TABLE config ALTER COLUMN payload TYPE text USING payload`, proxy.Refuse},
		{`ALTER TABLE config ALTER COLUMN absent SET NOT NULL`, proxy.Refuse},
		{`ALTER TABLE config ALTER COLUMN payload SET NOT NULL; UPDATE config SET n = 1`, proxy.Refuse},
	} {
		if d := p.Decide(app, proxy.Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}, tc.sql); d.Action != tc.want {
			t.Errorf("%s: action %v, want %v (%v)", tc.sql, d.Action, tc.want, d.Err)
		}
	}
	lex := proxy.Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}
	if d := p.Decide(&proxy.SessionInfo{User: "migrator", Database: db}, lex, `ALTER TABLE config ALTER COLUMN payload DROP NOT NULL`); d.Action != proxy.Forward {
		t.Errorf("migrations role: action %v (%v)", d.Action, d.Err)
	}
	if d := p.Decide(&proxy.SessionInfo{User: "migrator", Database: db}, lex, `DROP OWNED BY app`); d.Action != proxy.Refuse {
		t.Errorf("migrations role, DROP OWNED: action %v", d.Action)
	}
	fail = true
	if d := p.Decide(app, lex, `ALTER TABLE config ALTER COLUMN payload SET NOT NULL`); d.Action != proxy.Refuse {
		t.Errorf("catalog unreadable: action %v, want a refusal", d.Action)
	}
}
