package fencing_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// execBoth are the two ways these tests send a statement: a simple Query,
// and Parse/Bind/Execute of the unnamed statement (one statement only).
var execBoth = []struct {
	name string
	exec func(*testing.T, *pgx.Conn, string) error
}{
	{"simple", func(t *testing.T, c *pgx.Conn, sql string) error {
		_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
		return err
	}},
	{"extended", func(t *testing.T, c *pgx.Conn, sql string) error {
		return c.PgConn().ExecParams(ctxT(t), sql, nil, nil, nil, nil).Read().Err
	}},
}

// TestStoredCodeDropOwned: as the (non-superuser) owner of a protected
// table, stored code that would drop it, give it away or change its
// extension membership without naming it (DROP OWNED, REASSIGN OWNED,
// extensions, CASCADE, as plain statements in the body or as dynamic SQL)
// is refused when it is sent through the proxy, in both protocols: a DO
// block runs nothing, a function or procedure is not created (so a later
// call finds nothing to run), and the table keeps its rows, owner,
// columns and membership. Stored code that cannot reach an unnamed table
// runs.
func TestStoredCodeDropOwned(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startEnv(t)
	db := e.newDB(t)
	ctx := ctxT(t)
	owner, heir := "fp_sowner_"+db, "fp_sheir_"+db
	if err := cluster.Exec(ctx, fmt.Sprintf("CREATE ROLE %[1]s LOGIN; CREATE ROLE %[2]s; GRANT %[2]s TO %[1]s", owner, heir)); err != nil {
		t.Fatal(err)
	}
	d := ownedSetup(t, db, owner)
	before := snapshot(t, d, tError)

	blocks := []string{
		"DO $$ BEGIN DROP OWNED BY CURRENT_USER; END $$",
		"DO $$ BEGIN EXECUTE 'DROP OWNED BY CURRENT_USER'; END $$",
		"DO $$ BEGIN EXECUTE 'DROP ' || 'OWNED BY ' || quote_ident(current_user); END $$",
		"DO $$ BEGIN EXECUTE format('%s OWNED BY CURRENT_USER', 'DROP'); END $$",
		`DO $$ BEGIN EXECUTE E'DROP \117WNED BY CURRENT_USER'; END $$`,
		"DO $$ BEGIN REASSIGN OWNED BY CURRENT_USER TO " + heir + "; END $$",
		"DO $$ BEGIN ALTER EXTENSION hstore ADD TABLE public.acct; DROP EXTENSION hstore; END $$",
		"DO $$ BEGIN DROP DOMAIN fp_dom CASCADE; END $$",
		"DO $$ BEGIN EXECUTE 'DROP SCHEMA fp_ext CASCADE'; END $$",
	}
	// Each function drops what its owner owns when called.
	functions := []struct{ create, call string }{
		{"CREATE FUNCTION fp_f1() RETURNS void LANGUAGE sql AS $$ DROP OWNED BY CURRENT_USER $$", "SELECT fp_f1()"},
		{"CREATE FUNCTION fp_f2() RETURNS void LANGUAGE plpgsql AS $$ BEGIN DROP OWNED BY CURRENT_USER; END $$", "SELECT fp_f2()"},
		{"CREATE FUNCTION fp_f3() RETURNS void LANGUAGE plpgsql AS $$ BEGIN EXECUTE 'DROP OWNED BY ' || current_user; END $$", "SELECT fp_f3()"},
		{"CREATE PROCEDURE fp_p4() LANGUAGE sql AS $$ REASSIGN OWNED BY CURRENT_USER TO " + heir + " $$", "CALL fp_p4()"},
		{"CREATE PROCEDURE fp_p5() LANGUAGE plpgsql AS $$ BEGIN EXECUTE 'DROP DOMAIN fp_dom CASCADE'; END $$", "CALL fp_p5()"},
	}
	for _, p := range execBoth {
		t.Run(p.name, func(t *testing.T) {
			c := connectDSN(t, e.proxy.DSN(owner, "", db))
			for _, sql := range blocks {
				err := p.exec(t, c, sql)
				if code := sqlState(err); code != "FP003" {
					t.Errorf("%s: got %v (SQLSTATE %q), want FP003", sql, err, code)
				}
				selectOne(t, c)
				wantOwned(t, d, owner, false)
			}
			for _, f := range functions {
				err := p.exec(t, c, f.create)
				if code := sqlState(err); code != "FP003" {
					t.Errorf("%s: got %v (SQLSTATE %q), want FP003", f.create, err, code)
				}
				// Not created, so the call has nothing to run.
				err = p.exec(t, c, f.call)
				if code := sqlState(err); code != "42883" {
					t.Errorf("%s: got %v (SQLSTATE %q), want 42883", f.call, err, code)
				}
				wantOwned(t, d, owner, false)
			}
			// Transparency: stored code that reaches nothing unnamed runs.
			for _, sql := range []string{
				"DO $$ BEGIN CREATE TABLE fp_tmp (a int); DROP TABLE fp_tmp; END $$",
				"DO $$ BEGIN EXECUTE 'CREATE TABLE fp_tmp (a int)'; EXECUTE 'DROP TABLE ' || quote_ident('fp_tmp'); END $$",
				"DO $$ BEGIN RAISE NOTICE 'owned by %', current_user; END $$",
				"CREATE OR REPLACE FUNCTION fp_ok() RETURNS text LANGUAGE plpgsql AS $$ BEGIN RETURN current_database(); END $$",
				"SELECT fp_ok()",
			} {
				if err := p.exec(t, c, sql); err != nil {
					t.Errorf("%s: %v", sql, err)
				}
			}
		})
	}
	wantUnchanged(t, d, tError, before)
}

// TestDDLOnParents: with a session through the proxy open, a protected
// table is made a partition, or an inheritance child, of an unprotected
// table on a direct connection; the session's very next DDL on that parent
// that would reach the protected table (DROP TABLE, which drops a
// partitioned table's partitions; ALTER TABLE's DROP COLUMN, ALTER COLUMN
// ... TYPE and RENAME COLUMN, which recurse to the children; a row
// trigger, which is cloned onto partitions) is refused in both protocols,
// and the protected table keeps its rows and columns. ALTER TABLE ONLY,
// DDL on other tables, and, once the parent is detached, DROP TABLE of it
// go through.
func TestDDLOnParents(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, testRules)
	e := startPolicyEnv(t, policy.Options{Checks: checker}, specs)
	db := e.newDB(t)
	d := direct(t, db)
	c := e.connect(t, db)
	// Decided first with the results of the first check.
	if _, err := c.Exec(ctxT(t), "SELECT 1 FROM src"); err != nil {
		t.Fatal(err)
	}

	columns := func(table string) string {
		t.Helper()
		var s string
		if err := d.QueryRow(ctxT(t), `SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum)
			FROM pg_catalog.pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped`, table).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	for _, k := range []struct {
		name, attach, detach string
		table                string // the protected table, as a regclass
		refused, forwarded   []string
	}{
		{
			name: "partitioned parent",
			attach: `CREATE TABLE part_parent (id int NOT NULL, n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0)
					PARTITION BY RANGE (id);
				ALTER TABLE part_parent ATTACH PARTITION "Config" FOR VALUES FROM (0) TO (1000)`,
			detach: `ALTER TABLE part_parent DETACH PARTITION "Config"`,
			table:  `"Config"`,
			refused: []string{
				"DROP TABLE part_parent",
				"DROP TABLE IF EXISTS public.part_parent RESTRICT",
				"ALTER TABLE part_parent DROP COLUMN n",
				"ALTER TABLE part_parent ALTER COLUMN n TYPE bigint",
				"ALTER TABLE part_parent RENAME COLUMN last_fence TO lf",
				"ALTER TABLE part_parent ADD COLUMN r float8 DEFAULT random()",
				"CREATE TRIGGER pin BEFORE UPDATE ON part_parent FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()",
			},
			forwarded: []string{
				"CREATE INDEX ON part_parent (n)",
				"COMMENT ON TABLE part_parent IS 'parent'",
				"ALTER TABLE part_parent OWNER TO CURRENT_USER",
			},
		},
		{
			name: "inheritance parent",
			attach: `CREATE TABLE inh_parent (id bigint, payload text, n int, last_fence bigint);
				ALTER TABLE acct INHERIT inh_parent`,
			detach: "ALTER TABLE acct NO INHERIT inh_parent",
			table:  "acct",
			refused: []string{
				"DROP TABLE inh_parent",
				"ALTER TABLE inh_parent DROP COLUMN payload",
				"ALTER TABLE public.inh_parent ALTER COLUMN n TYPE bigint",
				"ALTER TABLE inh_parent RENAME COLUMN last_fence TO lf",
			},
			forwarded: []string{
				// ONLY: the child keeps the column, as a local one.
				"ALTER TABLE ONLY inh_parent DROP COLUMN payload",
				"ALTER TABLE inh_parent ADD COLUMN payload text",
			},
		},
	} {
		t.Run(k.name, func(t *testing.T) {
			execDirect(t, d, k.attach)
			before, cols := tableText(t, d, k.table), columns(k.table)
			for _, p := range execBoth {
				for _, sql := range k.refused {
					err := p.exec(t, c, sql)
					if code := sqlState(err); code != "FP003" || !strings.Contains(err.Error(), "without naming it") {
						t.Errorf("%s: %s: got %v (SQLSTATE %q), want FP003", p.name, sql, err, code)
					}
					selectOne(t, c)
				}
			}
			if after := tableText(t, d, k.table); after != before {
				t.Errorf("%s changed:\n before %s\n after  %s", k.table, before, after)
			}
			if after := columns(k.table); after != cols {
				t.Errorf("%s columns changed:\n before %s\n after  %s", k.table, cols, after)
			}
			for i, sql := range k.forwarded {
				if err := execBoth[i%2].exec(t, c, sql); err != nil {
					t.Errorf("%s: %v", sql, err)
				}
			}
			// Detached on the direct connection: the very next DROP TABLE
			// of the parent goes through, and the protected table stays.
			execDirect(t, d, k.detach)
			parent := strings.Fields(k.refused[0])[2]
			if err := execBoth[1].exec(t, c, "DROP TABLE "+parent); err != nil {
				t.Fatalf("DROP TABLE %s after the detach: %v", parent, err)
			}
			if after := tableText(t, d, k.table); after != before {
				t.Errorf("%s changed:\n before %s\n after  %s", k.table, before, after)
			}
		})
	}
}
