package rules_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestMigration: the DDL a migration sends, described for the policy's
// catalog lookup; texts with anything else are not.
func TestMigration(t *testing.T) {
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config", Column: "last_fence"}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		sql    string
		ok     bool
		judged bool
		cmds   []rules.NoopCmd
		create bool
	}{
		{sql: `ALTER TABLE "config" ALTER COLUMN "payload" SET NOT NULL;ALTER TABLE "config" ALTER COLUMN "payload" DROP DEFAULT;ALTER TABLE "config" ALTER COLUMN "payload" TYPE TEXT;`, ok: true, judged: true},
		{sql: `ALTER TABLE public.config ALTER COLUMN n TYPE varchar(255), ALTER COLUMN n SET DEFAULT 'x', ADD COLUMN IF NOT EXISTS m int DEFAULT now()`, ok: true, judged: true,
			cmds: []rules.NoopCmd{{Kind: rules.NoopType, Column: "n", Type: "varchar(255)"}, {Kind: rules.NoopSetDefault, Column: "n", Expr: "'x'"}, {Kind: rules.NoopColumnExists, Column: "m"}}},
		{sql: `ALTER TABLE config ALTER COLUMN n TYPE int USING n::int`, ok: true},
		{sql: `ALTER TABLE config DROP COLUMN last_fence`, ok: true},
		{sql: `CREATE TABLE config (id int)`, ok: true, create: true},
		{sql: `DROP TABLE config`, ok: true},
		{sql: `ALTER TABLE other ALTER COLUMN n SET NOT NULL`},
		{sql: `ALTER TABLE config ALTER COLUMN n SET NOT NULL; UPDATE config SET n = 1`},
		{sql: `DROP OWNED BY app`},
		{sql: `ALTER TABLE config ALTER`},
	} {
		stmts, ok := rs.Migration(tc.sql)
		if ok != tc.ok {
			t.Errorf("%s: ok %v, want %v", tc.sql, ok, tc.ok)
			continue
		}
		if !ok {
			continue
		}
		for _, s := range stmts {
			if s.Judged != tc.judged || s.CreatesProtected != tc.create || len(s.Tables) != 1 || s.Tables[0].Display != "public.config" {
				t.Errorf("%s: %+v", tc.sql, s)
			}
		}
		if tc.cmds != nil {
			got := stmts[0].Cmds
			if len(got) != len(tc.cmds) {
				t.Fatalf("%s: cmds %+v", tc.sql, got)
			}
			for i := range got {
				if got[i] != tc.cmds[i] {
					t.Errorf("%s: cmd %d = %+v, want %+v", tc.sql, i, got[i], tc.cmds[i])
				}
			}
		}
	}
}

func TestSameExpression(t *testing.T) {
	for _, tc := range []struct {
		client, catalog string
		same            bool
	}{
		{"0", "0", true},
		{"'x'", "'x'::text", true},
		{"now()", "now()", true},
		{"nextval('s')", "nextval('s'::regclass)", false},
		{"1", "2", false},
		{"'x'::name", "'x'::text", false},
		{"0", "0); SELECT (1", false},
	} {
		if got := rules.SameExpression(tc.client, tc.catalog); got != tc.same {
			t.Errorf("SameExpression(%q, %q) = %v", tc.client, tc.catalog, got)
		}
	}
}
