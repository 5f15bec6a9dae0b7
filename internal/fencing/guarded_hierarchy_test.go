package fencing_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// guardedHierRules protect a partition (gpart, of gparent), an
// inheritance child (gchild, of gbase) and a partitioned table (gpt, with
// the partition gpt_1); the database guard goes on all three.
var guardedHierRules = rules.Config{Tables: []rules.Table{
	{Table: "public.gpart"},
	{Table: "public.gchild"},
	{Table: "public.gpt"},
}}

const guardedHierSchema = `
CREATE TABLE gparent (id bigint NOT NULL, payload text NOT NULL DEFAULT 'new', n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0) PARTITION BY RANGE (id);
CREATE TABLE gpart PARTITION OF gparent FOR VALUES FROM (0) TO (1000);
CREATE TABLE gbase (id bigint NOT NULL, payload text NOT NULL DEFAULT 'new', n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE gchild () INHERITS (gbase);
CREATE TABLE gpt (LIKE gbase INCLUDING DEFAULTS) PARTITION BY RANGE (id);
CREATE TABLE gpt_1 PARTITION OF gpt FOR VALUES FROM (0) TO (1000);
INSERT INTO gpart (id, payload) VALUES (1, 'a'), (2, 'b');
INSERT INTO gchild (id, payload) VALUES (1, 'a'), (2, 'b');
INSERT INTO gpt (id, payload) VALUES (1, 'a'), (2, 'b');
UPDATE gpart SET last_fence = 50;
UPDATE gchild SET last_fence = 50;
UPDATE gpt SET last_fence = 50;
-- A row trigger that lowers the watermark of every row it sees.
CREATE FUNCTION fp_lower() RETURNS trigger LANGUAGE plpgsql AS $f$ BEGIN NEW.last_fence := 0; RETURN NEW; END $f$;
CREATE TABLE scratch (id int);
`

// hierState is what the DDL of TestGuardedHierarchyDDL could change, read
// through d, a direct connection: the protected tables' rows, the columns
// and triggers of every table of the schema, and the hierarchy.
func hierState(t *testing.T, d *pgx.Conn) string {
	t.Helper()
	var b strings.Builder
	for _, tbl := range []string{"gpart", "gchild", "gpt"} {
		fmt.Fprintf(&b, "%s: %s\n", tbl, tableText(t, d, tbl))
	}
	for _, q := range []string{
		`SELECT c.relname || '(' || coalesce((SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod), ', ' ORDER BY a.attnum)
			FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '') || ')'
		FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p') ORDER BY 1`,
		`SELECT tgrelid::regclass || '.' || tgname FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1`,
		`SELECT inhrelid::regclass || ' < ' || inhparent::regclass FROM pg_inherits ORDER BY 1`,
	} {
		b.WriteString(strings.Join(testutil.QueryStrings(t, d, q), "; "))
		b.WriteString("\n")
	}
	return b.String()
}

// TestGuardedHierarchyDDL: DDL on a partitioned or inheritance parent, or
// a partition, of a table the database guard protects reaches the table
// without naming it, and the guard (row and TRUNCATE triggers) stops none
// of it: DROP TABLE of the parent drops the partition, a recursing ALTER
// TABLE drops or retypes its columns (the fence column among them), a
// row trigger created on the parent is cloned onto the partition (and
// can undo what the guard's trigger checked), and dropping or detaching a
// partition of a guarded partitioned table takes its rows out of it.
// Each is refused through the proxy (FP003) in both protocols, as for
// tables without the guard, and the tables, their columns, triggers,
// hierarchy and rows are unchanged afterwards. The guard stays in place,
// and a DETACH of the guarded partition itself is refused by the rules
// that name it.
func TestGuardedHierarchyDDL(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, guardedHierRules)
	rs, err := rules.Compile(guardedHierRules)
	if err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, policy.New(rs, false, policy.Options{Checks: checker}))
	db := schemaDB(t, "guardhier", guardedHierSchema)
	ctx := ctxT(t)
	d := direct(t, db)
	if _, err := dbsetup.Setup(ctx, d, specs, dbsetup.SetupOptions{Guard: true, Tables: guardedHierRules.Tables}); err != nil {
		t.Fatal(err)
	}
	before := hierState(t, d)
	for _, tbl := range []string{"gpart", "gchild", "gpt", "gpt_1"} {
		if !strings.Contains(before, tbl+".fenceproxy") {
			t.Fatalf("no guard trigger on %s:\n%s", tbl, before)
		}
	}

	refused := []string{
		"DROP TABLE gparent",
		"DROP TABLE public.gparent CASCADE",
		"DROP TABLE IF EXISTS scratch, gparent",
		"ALTER TABLE gparent DROP COLUMN last_fence",
		"ALTER TABLE gparent DROP COLUMN payload",
		"ALTER TABLE gparent ALTER COLUMN n TYPE bigint",
		"ALTER TABLE gparent ALTER COLUMN last_fence TYPE numeric",
		"ALTER TABLE gparent RENAME COLUMN last_fence TO lf",
		"CREATE TRIGGER aa_lower BEFORE UPDATE ON gparent FOR EACH ROW EXECUTE FUNCTION fp_lower()",
		"CREATE TRIGGER zz_lower BEFORE INSERT OR UPDATE ON public.gparent FOR EACH ROW EXECUTE FUNCTION fp_lower()",
		"ALTER TABLE gparent DETACH PARTITION gpart",
		"DROP TABLE gbase CASCADE",
		"ALTER TABLE gbase DROP COLUMN last_fence",
		"ALTER TABLE gbase ALTER COLUMN n TYPE bigint",
		"ALTER TABLE gbase RENAME COLUMN last_fence TO lf",
		"CREATE TRIGGER aa_lower BEFORE UPDATE ON gbase FOR EACH ROW EXECUTE FUNCTION fp_lower()",
		"ALTER TABLE gchild NO INHERIT gbase",
		"DROP TABLE gpt_1",
		"CREATE TRIGGER aa_lower BEFORE UPDATE ON gpt_1 FOR EACH ROW EXECUTE FUNCTION fp_lower()",
		"ALTER TABLE gpt DETACH PARTITION gpt_1",
	}
	for _, x := range execBoth {
		t.Run(x.name, func(t *testing.T) {
			c := connectDSN(t, p.DSN("postgres", "", db))
			for _, sql := range refused {
				err := x.exec(t, c, sql)
				if code := sqlState(err); code != "FP003" {
					t.Errorf("%s: got %v (SQLSTATE %q), want FP003", sql, err, code)
				}
				if after := hierState(t, d); after != before {
					t.Fatalf("%s changed the tables:\n before %s\n after  %s", sql, before, after)
				}
			}
			// DDL that reaches no protected table runs.
			if err := x.exec(t, c, "DROP TABLE IF EXISTS scratch"); err != nil {
				t.Fatalf("DROP TABLE scratch: %v", err)
			}
			if tableExists(t, d, "scratch") {
				t.Fatal("scratch not dropped")
			}
			if _, err := d.Exec(ctx, "CREATE TABLE scratch (id int)"); err != nil {
				t.Fatal(err)
			}
		})
	}

	// Writes through the parents are not refused: the guard fences them,
	// with the session's token.
	c := connectDSN(t, p.DSN("postgres", "", db))
	setToken(t, c, "60")
	mustExec(t, c, "UPDATE gparent SET n = n + 1 WHERE id = $1", 1)
	mustExec(t, c, "UPDATE gbase SET n = n + 1 WHERE id = $1", 1)
	setToken(t, c, "55")
	mustSimple(t, c, "BEGIN")
	_, err = c.Exec(ctx, "UPDATE gparent SET n = n + 1 WHERE id = $1", 1)
	if code := sqlState(err); code != "FP001" {
		t.Errorf("a stale write through the parent: %v, want the guard's FP001", err)
	}
	mustSimple(t, c, "ROLLBACK")
	for _, tbl := range []string{"gpart", "gchild"} {
		if r := snapshot(t, d, tbl)[1]; r.N != 1 || r.Fence != 60 {
			t.Errorf("%s row 1: n=%d fence=%d, want the write at 60 alone", tbl, r.N, r.Fence)
		}
	}
}
