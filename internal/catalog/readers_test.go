package catalog_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
)

// TestReaders: the relations whose reads reach a table's rows, found from
// the catalog, and for each one found, a read of it on the server that
// does return a row of the table (so the list is no wider than it claims
// where it claims it; ONLY is the documented exception).
func TestReaders(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, `
		CREATE TABLE acct (id int, payload text) PARTITION BY RANGE (id);
		CREATE TABLE acct_low PARTITION OF acct FOR VALUES FROM (0) TO (100);
		CREATE TABLE acct_high PARTITION OF acct FOR VALUES FROM (100) TO (200) PARTITION BY RANGE (id);
		CREATE TABLE acct_high_a PARTITION OF acct_high FOR VALUES FROM (100) TO (150);
		CREATE TABLE root (id int, payload text) PARTITION BY RANGE (id);
		ALTER TABLE root ATTACH PARTITION acct FOR VALUES FROM (0) TO (1000);
		INSERT INTO acct VALUES (1, 'low'), (120, 'high');

		-- Unrelated tables.
		CREATE TABLE other (id int, payload text);
		CREATE TABLE inh (id int, payload text);
		CREATE TABLE mixed () INHERITS (other);
		CREATE TABLE plain (id int, payload text);
		INSERT INTO plain VALUES (120, 'p');

		CREATE SCHEMA s;
		CREATE VIEW s.v1 AS SELECT id, payload FROM acct WHERE id > 0;
		CREATE VIEW v2 AS SELECT * FROM s.v1;
		CREATE VIEW agg AS SELECT count(*) AS n FROM root;
		CREATE VIEW sub AS SELECT * FROM plain WHERE id IN (SELECT id FROM acct_high_a);
		CREATE VIEW cte AS WITH x AS (SELECT id FROM acct_low) SELECT * FROM x;
		-- Not readers: a view over other tables, a view over a
		-- materialized view (a read of it reads what its last refresh
		-- stored; the refresh reads acct, and is listed).
		CREATE VIEW unrelated AS SELECT * FROM plain;
		CREATE MATERIALIZED VIEW mat AS SELECT * FROM acct;
		CREATE VIEW over_mat AS SELECT * FROM mat;

		-- Inheritance: inh_child is a child of the protected inh and of
		-- other2; a read of other2 reads its rows.
		CREATE TABLE other2 (id int, payload text);
		CREATE TABLE inh_child () INHERITS (inh, other2);
		CREATE TABLE inh_parent (id int, payload text);
		ALTER TABLE inh INHERIT inh_parent;
		INSERT INTO inh_child VALUES (7, 'child');
		CREATE VIEW inh_v AS SELECT * FROM ONLY inh_parent;

		-- Functions: one reading acct, one calling it, one reading a
		-- reader view (an SQL-standard body), a view calling one, and
		-- two that read nothing of acct.
		CREATE FUNCTION fa() RETURNS bigint LANGUAGE sql AS $$SELECT count(*) FROM acct$$;
		CREATE FUNCTION fb() RETURNS bigint LANGUAGE plpgsql AS $x$BEGIN RETURN fa(); END$x$;
		CREATE FUNCTION s.fc() RETURNS bigint LANGUAGE sql BEGIN ATOMIC SELECT count(*) FROM s.v1; END;
		CREATE VIEW fv AS SELECT fb() AS n;
		CREATE FUNCTION fplain() RETURNS bigint LANGUAGE sql AS $$SELECT count(*) FROM plain$$;
		-- Statements naming these evaluate a read of acct: a rule's
		-- action, a row security policy, a trigger's function, a column
		-- default. A materialized view's refresh reads it.
		CREATE TABLE src (id int);
		CREATE RULE src_reads AS ON UPDATE TO src DO INSTEAD SELECT id, payload FROM acct_low;
		CREATE TABLE pol (id int);
		CREATE POLICY pol_p ON pol USING (EXISTS (SELECT FROM s.v1));
		CREATE TABLE trg (id int);
		CREATE FUNCTION trg_f() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN PERFORM count(*) FROM acct; RETURN NEW; END$$;
		CREATE TRIGGER trg_t BEFORE INSERT ON trg FOR EACH ROW EXECUTE FUNCTION trg_f();
		CREATE TABLE dflt (id int, n bigint DEFAULT fa());
		CREATE MATERIALIZED VIEW mv AS SELECT * FROM v2;
		CREATE MATERIALIZED VIEW mv_plain AS SELECT * FROM plain;
		CREATE TABLE acct_archive (id int);
		CREATE FUNCTION fother() RETURNS bigint LANGUAGE sql AS $$SELECT count(*) FROM acct_archive$$;`)

	reach, err := catalog.Paths(t.Context(), conn, nil, []catalog.Rel{{Schema: "public", Name: "acct"}, {Schema: "public", Name: "inh"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(reach.Paths) != 0 {
		t.Errorf("paths without written tables: %v", reach.Paths)
	}
	var got []string
	for _, r := range reach.Readers {
		if r.Function {
			got = append(got, r.Relation()+"() -> "+r.Target)
			continue
		}
		if r.Refresh {
			got = append(got, "REFRESH "+r.Relation()+" -> "+r.Target)
			continue
		}
		if r.Maybe {
			got = append(got, r.Relation()+" ?-> "+r.Target)
			continue
		}
		got = append(got, r.Relation()+" -> "+r.Target)
	}
	// "?->": Maybe (a statement naming it may read the table, through
	// a function, a rule, a policy, a trigger or a default).
	want := []string{
		"public.acct_high -> public.acct",
		"public.acct_high_a -> public.acct",
		"public.acct_low -> public.acct",
		"public.agg -> public.acct",
		"public.cte -> public.acct",
		"public.dflt ?-> public.acct",
		"public.fa() -> public.acct",
		"public.fb() -> public.acct",
		"public.fv ?-> public.acct",
		"public.inh_child -> public.inh",
		"public.inh_parent -> public.inh",
		// Over ONLY inh_parent, which holds none of inh's rows: listed all
		// the same (the view's reads are not followed per RTE flag).
		"public.inh_v -> public.inh",
		"REFRESH public.mat -> public.acct",
		"REFRESH public.mv -> public.acct",
		"public.other2 -> public.inh",
		"public.pol ?-> public.acct",
		"public.root -> public.acct",
		"public.src ?-> public.acct",
		"public.sub -> public.acct",
		"public.trg ?-> public.acct",
		"public.trg_f() -> public.acct",
		"public.v2 -> public.acct",
		"s.fc() -> public.acct",
		"s.v1 -> public.acct",
	}
	if !slices.Equal(got, want) {
		t.Errorf("readers:\n got  %q\n want %q", got, want)
	}
	// Each reader but the ONLY view, and those that read only when
	// written, returns a row of its target on the server.
	for _, r := range reach.Readers {
		switch r.Name {
		case "inh_v", "src", "pol", "trg", "trg_f", "dflt":
			continue
		case "mv", "mat":
			execSQL(t, conn, "REFRESH MATERIALIZED VIEW public."+r.Name)
		}
		q := fmt.Sprintf("SELECT count(*) FROM %s", r.Relation())
		switch {
		case r.Function:
			q = fmt.Sprintf("SELECT %s()", r.Relation())
		case r.Name == "agg" || r.Name == "fv":
			q = "SELECT n FROM public." + r.Name
		}
		var n int
		if err := conn.QueryRow(t.Context(), q).Scan(&n); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		if n == 0 {
			t.Errorf("%s reads no row of %s", r.Relation(), r.Target)
		}
	}
}

// TestReadersCode: functions found through what calls them without
// naming them in a body (operators, aggregates, argument defaults) and
// through names the word scan must read as PostgreSQL does; relations
// through domain defaults, rule conditions and trigger conditions.
func TestReadersCode(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	long := strings.Repeat("x", 60) + "_vw" // 63 bytes
	execSQL(t, conn, `
		CREATE TABLE acct (id bigint, payload text);
		CREATE VIEW "the view" AS SELECT * FROM acct;
		CREATE VIEW `+long+` AS SELECT * FROM acct;
		CREATE FUNCTION peek(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = $1$$;
		CREATE FUNCTION peek2(a bigint, b bigint) RETURNS bigint LANGUAGE sql AS $$SELECT length(peek(a))::bigint$$;
		CREATE OPERATOR ### (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = peek2);
		CREATE FUNCTION peek_sf(s bigint, v bigint) RETURNS bigint LANGUAGE sql AS $$SELECT s + length(peek(v))$$;
		CREATE AGGREGATE peek_agg(bigint) (SFUNC = peek_sf, STYPE = bigint, INITCOND = '0');
		CREATE FUNCTION with_default(x text DEFAULT peek(3)) RETURNS text LANGUAGE sql AS 'SELECT x';
		CREATE FUNCTION quoted() RETURNS bigint LANGUAGE sql AS $$SELECT count(*) FROM "the view"$$;
		CREATE FUNCTION escaped() RETURNS bigint LANGUAGE sql AS $$SELECT count(*) FROM U&"\0061cct"$$;
		CREATE FUNCTION truncated() RETURNS bigint LANGUAGE sql AS $$SELECT count(*) FROM `+long+`qq$$;
		CREATE FUNCTION unrelated() RETURNS bigint LANGUAGE sql AS $$SELECT 1$$;
		CREATE DOMAIN snapd AS text DEFAULT peek(3);
		CREATE TABLE snaps (id int, v snapd);
		CREATE TABLE gate (id int);
		CREATE RULE gate_r AS ON UPDATE TO gate WHERE (SELECT payload FROM acct WHERE id = 3) = 'c' DO INSTEAD NOTHING;
		CREATE FUNCTION skip_row() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NULL; END$$;
		CREATE TABLE wtab (id bigint);
		CREATE TRIGGER wtab_t BEFORE INSERT ON wtab FOR EACH ROW WHEN (peek(NEW.id) = 'c') EXECUTE FUNCTION skip_row();`)
	reach, err := catalog.Paths(t.Context(), conn, nil, []catalog.Rel{{Schema: "public", Name: "acct"}})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, r := range reach.Readers {
		got[r.Name] = true
	}
	for _, name := range []string{"the view", long, "peek", "peek2", "###", "peek_sf", "peek_agg", "with_default",
		"quoted", "escaped", "truncated", "snaps", "gate", "wtab"} {
		if !got[name] {
			t.Errorf("%s: not a reader of acct", name)
		}
	}
	for _, name := range []string{"unrelated", "skip_row"} {
		if got[name] {
			t.Errorf("%s: listed as a reader of acct", name)
		}
	}
}

// TestReadersEndsTx: a reader is marked EndsTx where it is a procedure
// that may commit or roll back: in PL/pgSQL, a body with COMMIT or
// ROLLBACK anywhere in it, or a CALL of another procedure. Not a
// procedure in SQL (which cannot), one with a SET clause (which may
// not), or a function.
func TestReadersEndsTx(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, `
		CREATE TABLE acct (id bigint, n int);
		CREATE PROCEDURE plain_p(i bigint) LANGUAGE sql AS $$UPDATE acct SET n = n + 1 WHERE id = i$$;
		CREATE PROCEDURE commits_p(i bigint) LANGUAGE plpgsql AS $$BEGIN UPDATE acct SET n = 1 WHERE id = i; Commit; END$$;
		CREATE PROCEDURE rolls_p() LANGUAGE plpgsql AS $$BEGIN DELETE FROM acct; ROLLBACK; END$$;
		CREATE PROCEDURE calls_p() LANGUAGE plpgsql AS $$BEGIN CALL plain_p(1); END$$;
		CREATE PROCEDURE sql_calls_p() LANGUAGE sql AS $$CALL plain_p(1)$$;
		CREATE PROCEDURE set_p() LANGUAGE plpgsql SET work_mem = '1MB' AS $$BEGIN DELETE FROM acct; COMMIT; END$$;
		CREATE FUNCTION commit_f() RETURNS bigint LANGUAGE plpgsql AS $$BEGIN RETURN (SELECT count(*) FROM acct WHERE n > 0); -- commit
		END$$;
		CREATE FUNCTION reads_f() RETURNS bigint LANGUAGE sql AS $$SELECT count(*) FROM acct$$;`)
	reach, err := catalog.Paths(t.Context(), conn, nil, []catalog.Rel{{Schema: "public", Name: "acct"}})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{"plain_p": false, "commits_p": true, "rolls_p": true, "calls_p": true,
		"sql_calls_p": false, "set_p": false, "commit_f": false, "reads_f": false}
	seen := map[string]bool{}
	for _, r := range reach.Readers {
		w, ok := want[r.Name]
		if !ok {
			continue
		}
		seen[r.Name] = true
		if !r.Function || r.EndsTx != w {
			t.Errorf("%s: Function %v EndsTx %v, want a function with EndsTx %v", r.Name, r.Function, r.EndsTx, w)
		}
	}
	for name := range want {
		if !seen[name] {
			t.Errorf("%s: not a reader of acct", name)
		}
	}
}
