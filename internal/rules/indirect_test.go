package rules_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func TestIndirectSet(t *testing.T) {
	s := rules.NewIndirectSet([]rules.Indirect{
		{Schema: "public", Name: "v", Ops: []string{"INSERT", "UPDATE", "DELETE"}, Target: "public.config", Via: "view public.v selects from public.config"},
		{Schema: "public", Name: "events", Ops: []string{"INSERT", "UPDATE", "DELETE", "MERGE", "TRUNCATE"}, Target: "public.events_2024", Via: "partition"},
		{Schema: "public", Name: "tenants", Ops: []string{"DELETE", "MERGE"}, Target: "public.config", Via: "ON DELETE CASCADE", NewPartitions: true},
		{Schema: "public", Name: "tenants", Ops: []string{"TRUNCATE"}, Target: "public.config", Via: "foreign key", CascadeOnly: true, NewPartitions: true},
		{Schema: "public", Name: "region_1", Ops: []string{"INSERT", "UPDATE"}, Target: "public.regions", Via: "partition", NewPartitions: true, NewChildren: true},
		{Schema: "public", Name: "plain", Target: "public.config", Via: "rule", Latent: true},
		{Schema: "app", Name: "Mixed", Ops: []string{"UPDATE"}, Target: "public.config", Via: "rule"},
		{Schema: "public", Name: "inbox", Ops: []string{"INSERT", "UPDATE"}, Target: "public.config", Via: "rule", ByRule: true},
		{Schema: "public", Name: "both", Ops: []string{"INSERT"}, Target: "public.config", Via: "rule", ByRule: true},
		{Schema: "public", Name: "both", Ops: []string{"INSERT"}, Target: "public.events_2024", Via: "partition"},
		{Schema: "public", Name: "owner", Ops: []string{"UPDATE", "MERGE"}, Target: "public.config", Via: "ON UPDATE CASCADE", Columns: []string{"id", "Code"}},
	})
	for _, c := range []struct {
		sql    string
		refuse bool
	}{
		{"SELECT * FROM v", false},
		{"UPDATE v SET a = 1", true},
		{"update public.V set a = 1", true}, // folded
		{"UPDATE other.v SET a = 1", false},
		{"WITH x AS (DELETE FROM v RETURNING 1) SELECT * FROM x", true},
		{"INSERT INTO events VALUES (1)", true},
		{"COPY events FROM STDIN", true},
		{"COPY events TO STDOUT", false},
		// COPY FROM fires no rules: a path whose first step is a rule
		// is not taken; another path of the same relation is.
		{"COPY inbox FROM STDIN", false},
		{"INSERT INTO inbox VALUES (1)", true},
		{"COPY both FROM STDIN", true},
		{"DELETE FROM tenants WHERE id = 1", true},
		{"UPDATE tenants SET name = 'x'", false},
		{"TRUNCATE tenants", false},
		{"TRUNCATE tenants CASCADE", true},
		{"TRUNCATE events", true},
		{`UPDATE app."Mixed" SET a = 1`, true},
		{`UPDATE app.mixed SET a = 1`, false},
		{"INSERT INTO v VALUES (1) ON CONFLICT DO NOTHING", true},
		// An ON UPDATE action: a plain INSERT runs none, an upsert may.
		{"INSERT INTO owner VALUES (1)", false},
		{"INSERT INTO owner VALUES (1) ON CONFLICT DO NOTHING", false},
		{"INSERT INTO owner VALUES (1) ON CONFLICT (id) DO UPDATE SET id = 2", true},
		{"INSERT INTO owner VALUES (1) ON CONFLICT (id) DO UPDATE SET name = 'x'", false},
		// ... which fires when the UPDATE sets a key column.
		{"UPDATE owner SET name = 'x'", false},
		{"UPDATE owner SET ID = 2", true},
		{`UPDATE owner SET "Code" = 'c'`, true},
		{"UPDATE owner SET code = 'c'", false}, // folds to code, not Code
		{"UPDATE owner SET (name, id) = ('x', 2)", true},
		{"UPDATE owner SET id[1] = 2", true},
		{"MERGE INTO owner o USING s ON o.id = s.id WHEN MATCHED THEN UPDATE SET name = 'x'", true},
		{"SELECT 'tenants'", false},
		{"DELETE FROM U&\"\\0076\"", true},    // v in disguise
		{"DELETE FROM tenants WHERE (", true}, // does not parse
		// DDL that would open a path from one, written in the same
		// transaction before the proxy learns of it.
		{"CREATE VIEW pv AS SELECT * FROM v", true},
		{"CREATE TEMP VIEW pv AS SELECT * FROM (SELECT * FROM public.v) s", true},
		{"CREATE VIEW pv AS SELECT * FROM other.v", false},
		{"CREATE OR REPLACE VIEW v AS SELECT 1 AS a", true},
		{"ALTER VIEW v RENAME TO harmless", true},
		{"ALTER TABLE events RENAME TO harmless", true},
		{"ALTER TABLE events RENAME COLUMN a TO b", false},
		{"ALTER TABLE owner RENAME COLUMN name TO id", true}, // a path by columns
		{"ALTER TABLE owner RENAME COLUMN id TO tmp", true},
		{"ALTER TABLE owner RENAME COLUMN name TO full_name", false},
		{"CREATE TRIGGER t BEFORE UPDATE ON owner FOR EACH ROW EXECUTE FUNCTION f()", true},
		{"CREATE TRIGGER t BEFORE UPDATE ON tenants FOR EACH ROW EXECUTE FUNCTION f()", false}, // no path by columns
		{"DROP TRIGGER t ON tenants", false},
		{"CREATE RULE r AS ON UPDATE TO tenants DO ALSO NOTHING", false}, // no rules to change: not latent
		{"ALTER TABLE owner RENAME CONSTRAINT c TO d", false},
		{"ALTER TABLE owner ALTER COLUMN ref SET EXPRESSION AS (id * 2)", true},
		{"ALTER VIEW public.v SET SCHEMA elsewhere", true},
		{"ALTER TABLE tenants INHERIT grand", true},
		{"ALTER TABLE tenants NO INHERIT grand", false},
		{"ALTER TABLE grand ATTACH PARTITION events FOR VALUES IN (1)", true},
		{"ALTER TABLE events ATTACH PARTITION e2 FOR VALUES IN (1)", false},
		{"UPDATE pg_temp.v SET a = 1", false}, // v is public's
		// A new partition gets the foreign keys' actions; a new child of
		// a protected table's descendant writes its rows.
		{"CREATE TABLE t2 PARTITION OF tenants FOR VALUES IN (2)", true},
		{"CREATE TABLE t2 () INHERITS (tenants)", false},
		{"ALTER TABLE tenants ATTACH PARTITION t2 FOR VALUES IN (2)", true},
		{"ALTER TABLE t2 INHERIT tenants", false},
		{"CREATE TABLE r2 () INHERITS (public.region_1)", true},
		{"ALTER TABLE t2 INHERIT region_1", true},
		{"CREATE TABLE e2 PARTITION OF events FOR VALUES IN (2)", false},
		// A foreign key that a path relation's deletes would follow.
		{"ALTER TABLE tenants ADD FOREIGN KEY (a) REFERENCES grand ON DELETE CASCADE", true},
		{"ALTER TABLE tenants ADD CONSTRAINT c CHECK (a > 0)", false},
		{"ALTER TABLE grand ADD FOREIGN KEY (a) REFERENCES tenants ON DELETE CASCADE", false},
		// Rule and trigger DDL on a path relation or a latent one.
		{"ALTER TABLE plain ENABLE RULE r", true},
		{"ALTER TABLE plain ENABLE ALWAYS RULE r", true},
		{"ALTER TABLE plain DISABLE RULE r", true},
		{"DROP RULE r ON public.plain", true},
		{"DROP RULE IF EXISTS r ON other.plain", false},
		{"CREATE OR REPLACE RULE r AS ON UPDATE TO plain DO ALSO NOTHING", true},
		{"CREATE TRIGGER t INSTEAD OF UPDATE ON plain FOR EACH ROW EXECUTE FUNCTION f()", true},
		{"DROP TRIGGER t ON v", false}, // v is a path, not latent here
		{"DROP TRIGGER t ON plain", true},
		{"CREATE TRIGGER t BEFORE UPDATE ON grand FOR EACH ROW EXECUTE FUNCTION f()", false},
		{"ALTER TABLE grand ENABLE RULE r", false},
		{"UPDATE plain SET a = 1", false}, // latent: no write reaches config
		{"CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'UPDATE plain SET a = 1 RETURNING 1'", false},
		{"DO $$BEGIN EXECUTE 'ALTER TABLE plain ENABLE RULE r'; END$$", true},
		{"CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql AS $$BEGIN DROP RULE r ON plain; END$$", true},
		// Renamed, a latent relation's rules could be changed under the
		// new name; a renamed schema hides its relations' paths.
		{"ALTER VIEW plain RENAME TO p2", true},
		{"ALTER TABLE plain SET SCHEMA s2", true},
		{"ALTER SCHEMA public RENAME TO p2", true},
		{"ALTER SCHEMA app RENAME TO app2", true},
		{"ALTER SCHEMA other RENAME TO o2", false},
		{"CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$ALTER VIEW plain RENAME TO p2$$", true},
		// Escaped names in dynamic SQL, as the protected tables' check
		// reads them.
		{`DO $$BEGIN EXECUTE E'DELETE FROM tenant\x73 WHERE id = 1'; END$$`, true},
		{`DO $$BEGIN EXECUTE E'DROP RULE r ON pl\x61in'; END$$`, true},
		{`DO $$BEGIN EXECUTE E'SELECT \x31 FROM other'; END$$`, false},
		{`DO $$BEGIN EXECUTE 'DELETE FROM ' || 'tenants'; END$$`, true},
		{`do language plpgsql $$BEGIN EXECUTE E'DELETE FROM tenant\x73'; END$$`, true},
		{`INSERT INTO other VALUES (E'a\x62') ON CONFLICT DO NOTHING`, false},
		// String continuation: two constants separated by a newline are
		// one.
		{"DO $$BEGIN EXECUTE 'DELETE FROM tenan'\n'ts WHERE id = 1'; END$$", true},
		{"CREATE FUNCTION f() RETURNS void LANGUAGE sql AS 'DELETE FROM tenan'\n'ts'", true},
		{"DO /* c */ $$BEGIN EXECUTE 'ALTER TABLE plain ENABLE RU'\n'LE r'; END$$", true},
		{"DO LANGUAGE plpgsql $$BEGIN EXECUTE 'ALTER TABLE plain ENABLE ' || 'RU' || 'LE r'; END$$", true},
		{"SELECT 'what do you mean'", false},
		// ... but not because it returns trigger.
		{"CREATE FUNCTION f() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN PERFORM count(*) FROM plain; RETURN NULL; END$$", false},
		{"CREATE FUNCTION f() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN EXECUTE 'DROP RULE r ON plain'; RETURN NULL; END$$", true},
		{"CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT count(*) FROM plain; END", false},
		// Renaming a relation's trigger, rule or policy renames no relation.
		{"ALTER TRIGGER t ON plain RENAME TO t2", false},
		{"ALTER RULE r ON plain RENAME TO r2", false},
		{"ALTER POLICY p ON tenants RENAME TO p2", false},
		// An ON SELECT rule makes a view (a table turned into one).
		{`CREATE RULE "_RETURN" AS ON SELECT TO grand DO INSTEAD SELECT * FROM v`, true},
		{`CREATE RULE "_RETURN" AS ON SELECT TO grand DO INSTEAD SELECT * FROM other`, false},
		// A foreign key added with a column.
		{"ALTER TABLE tenants ADD COLUMN g int REFERENCES grand ON DELETE CASCADE", true},
		{"ALTER TABLE tenants ADD COLUMN g int NOT NULL DEFAULT 0", false},
		// Stored code is checked by its own text, not its Query's.
		{"UPDATE grand SET a = 1 WHERE a IN (SELECT 1 FROM tenants); CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1'", false},
		{"SELECT 1 FROM tenants; DO 'BEGIN PERFORM 1; END'", false},
	} {
		e := s.Check(c.sql)
		if (e != nil) != c.refuse {
			t.Errorf("%q: refusal %v, want %v", c.sql, e, c.refuse)
		}
		if again := s.Check(c.sql); (again != nil) != c.refuse { // from the cache
			t.Errorf("%q again: refusal %v, want %v", c.sql, again, c.refuse)
		}
		if e != nil && e.Code != rules.CodeRefused {
			t.Errorf("%q: %+v", c.sql, e)
		}
	}
	if e := s.Check("DELETE FROM tenants"); e == nil || e.Detail != "ON DELETE CASCADE" || e.Table != "public.config" || !strings.Contains(e.Hint, "--guard") {
		t.Errorf("refusal %+v", e)
	}
	// A temporary view of another session is a path too, and pg_temp
	// names the session's own temporary schema.
	tmp := rules.NewIndirectSet([]rules.Indirect{{Schema: "pg_temp_3", Name: "tv", Ops: []string{"UPDATE"}, Target: "public.config", Via: "view"}})
	for _, q := range []string{"UPDATE tv SET a = 1", "UPDATE pg_temp.tv SET a = 1", "UPDATE pg_temp_3.tv SET a = 1"} {
		if tmp.Check(q) == nil {
			t.Errorf("%q: not refused", q)
		}
	}
	if e := tmp.Check("UPDATE pg_temp_4.tv SET a = 1"); e != nil {
		t.Errorf("another temporary schema refused: %v", e)
	}
	if rules.NewIndirectSet(nil).Check("DELETE FROM tenants") != nil {
		t.Error("empty set refused")
	}
}

// TestIndirectStoredCode: stored code that mentions one of the set's
// relations as a word is refused when it is created, whatever it does with
// it (a write, dynamic SQL, a read); a longer name that only contains it
// is not.
func TestIndirectStoredCode(t *testing.T) {
	s := rules.NewIndirectSet([]rules.Indirect{{Schema: "public", Name: "v", Ops: []string{"UPDATE"}, Target: "public.acct", Via: "a view"}})
	for sql, refused := range map[string]bool{
		"CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$UPDATE v SET a = 1$$":              true,
		"CREATE PROCEDURE p() LANGUAGE plpgsql AS $$BEGIN EXECUTE 'UPDATE V SET a = 1'; END$$": true,
		"DO $$BEGIN PERFORM * FROM public.v; END$$":                                            true,
		"CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$UPDATE v_other SET a = 1$$":        false,
		"CREATE FUNCTION f() RETURNS int LANGUAGE sql AS $$SELECT 1$$":                         false,
		"UPDATE v SET a = 1": true,
		"SELECT * FROM v":    false,
	} {
		if e := s.Check(sql); (e != nil) != refused {
			t.Errorf("%s: refusal %v, want refused %v", sql, e, refused)
		}
	}
}

// TestIndirectLexingRefusal: with standard_conforming_strings off, a
// backslash can end a string the parser reads on, and hide a write
// through a path: a text that may write through one is refused then.
func TestIndirectLexingRefusal(t *testing.T) {
	s := rules.NewIndirectSet([]rules.Indirect{{Schema: "public", Name: "mid", Ops: []string{"DELETE"}, Target: "public.items", Via: "ON DELETE CASCADE"}})
	hidden := `SELECT 'a\', $$'; DELETE FROM mid WHERE id = 1; --$$`
	on := rules.Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8", Backslash: true}
	off := on
	off.StandardConformingStrings = false
	uncertain := on
	uncertain.Uncertain = true
	latin := rules.Lexing{StandardConformingStrings: true, ClientEncoding: "LATIN1", NonASCII: true}
	for _, c := range []struct {
		lex    rules.Lexing
		sql    string
		refuse bool
	}{
		{on, hidden, false},
		{off, hidden, true},
		{uncertain, hidden, true},
		{off, `SELECT 'a\b' FROM other`, false},
		{latin, "SELECT 'é' FROM mid", true},
		{latin, "SELECT 'é' FROM other", false},
	} {
		if e := s.LexingRefusal(c.lex, c.sql); (e != nil) != c.refuse || (e != nil && e.Code != rules.CodeRefused) {
			t.Errorf("%+v %q: %v, want refusal %v", c.lex, c.sql, e, c.refuse)
		}
	}
	if e := (*rules.IndirectSet)(nil).LexingRefusal(off, hidden); e != nil {
		t.Errorf("nil set: %v", e)
	}
}

// BenchmarkIndirectGate: what the paths' check costs a statement that
// names none of its relations (the common case where a database has
// paths): the gate's scans, no parse, no allocation.
func BenchmarkIndirectGate(b *testing.B) {
	s := rules.NewIndirectSet([]rules.Indirect{
		{Schema: "public", Name: "tenants", Ops: []string{"DELETE"}, Target: "public.config", Via: "ON DELETE CASCADE"},
		{Schema: "public", Name: "orders_v", Target: "public.config", Via: "view", Latent: true},
	})
	for _, c := range []struct{ name, sql string }{
		{"update", "UPDATE accounts SET balance = balance + 1, note = 'do it now' WHERE id = 42"},
		{"json upsert", `INSERT INTO docs (id, body) VALUES (7, '{"a":"b\"c","q":"what do you mean\n"}') ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body`},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, ok := s.CheckCached(c.sql); !ok {
					b.Fatal("parsed")
				}
			}
		})
	}
}
