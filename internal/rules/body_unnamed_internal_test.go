package rules

import (
	"strings"
	"testing"
)

// TestStoredCodeReachingUnnamedTables: a DO block or a function or
// procedure body that can run a statement reaching tables it does not name
// (DROP OWNED, REASSIGN OWNED, extensions, DROP DATABASE, CASCADE), as
// parsed code or as dynamic SQL, is refused where the session fences a
// table; bodies that cannot are forwarded.
func TestStoredCodeReachingUnnamedTables(t *testing.T) {
	r := mustCompileInternal(t, Config{Tables: []Table{{Table: "public.acct"}}})
	refused := []struct{ sql, what string }{
		// Parsed PL/pgSQL statements.
		{"DO $$ BEGIN DROP OWNED BY CURRENT_USER; END $$", "DO block runs DROP OWNED"},
		{"do $$begin reassign owned by current_user to heir; end$$", "DO block runs REASSIGN OWNED"},
		{"DO $$ BEGIN DROP EXTENSION hstore; END $$", "DO block runs DROP EXTENSION"},
		{"DO $$ BEGIN ALTER EXTENSION hstore ADD TABLE t; END $$", "DO block runs ALTER EXTENSION ... ADD"},
		{"DO $$ BEGIN IF true THEN DROP DOMAIN d CASCADE; END IF; END $$", "DO block runs DROP DOMAIN ... CASCADE"},
		{"DO LANGUAGE plpgsql $x$ DECLARE n int; BEGIN ALTER TABLE t DROP COLUMN c CASCADE; END $x$", "DO block runs ALTER TABLE ... CASCADE"},
		// Dynamic SQL: constants, concatenations, format(), escapes,
		// nested DO blocks, variables assigned a constant.
		{"DO $$ BEGIN EXECUTE 'DROP OWNED BY CURRENT_USER'; END $$", "DO block runs dynamic SQL"},
		{"DO $$ BEGIN EXECUTE 'DROP ' || 'OWNED BY ' || current_user; END $$", "DO block runs dynamic SQL"},
		{"DO $$ BEGIN EXECUTE format('%s %s BY CURRENT_USER', 'drop', 'owned'); END $$", "DO block runs dynamic SQL"},
		{"DO $$ DECLARE s text := 'drop extension hstore'; BEGIN EXECUTE s; END $$", "DO block runs dynamic SQL"},
		{`DO $$ BEGIN EXECUTE E'DROP \117WNED BY CURRENT_USER'; END $$`, "DO block runs dynamic SQL"},
		{"DO $$ BEGIN EXECUTE 'DO $y$ BEGIN DROP SCHEMA s CASCADE; END $y$'; END $$", "DO block runs dynamic SQL"},
		{"DO $$ BEGIN EXECUTE 'DROP DATABASE ' || quote_ident('x'); END $$", "DO block runs dynamic SQL"},
		{"DO 'BEGIN EXECUTE ''REASSIGN OWNED BY a TO b''; END'", "DO block runs dynamic SQL"},
		// Functions and procedures: SQL and PL/pgSQL bodies, BEGIN ATOMIC.
		{"CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$ DROP OWNED BY CURRENT_USER $$", "function body runs DROP OWNED"},
		{"CREATE OR REPLACE FUNCTION f() RETURNS void AS 'SELECT 1; DROP EXTENSION hstore CASCADE' LANGUAGE sql", "function body runs DROP EXTENSION"},
		{"CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql AS $$ BEGIN DROP OWNED BY CURRENT_USER; END $$", "function body runs DROP OWNED"},
		{"CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql AS $$ BEGIN EXECUTE 'DROP OWNED BY ' || current_user; END $$", "function body runs dynamic SQL"},
		{"CREATE PROCEDURE p() LANGUAGE sql AS $$ REASSIGN OWNED BY CURRENT_USER TO heir $$", "procedure body runs REASSIGN OWNED"},
		{"CREATE PROCEDURE p() LANGUAGE plpgsql AS $$ BEGIN EXECUTE 'ALTER EXTENSION hstore DROP TABLE t'; END $$", "procedure body runs dynamic SQL"},
		{"CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END; DROP OWNED BY CURRENT_USER", "DROP OWNED is not allowed"},
		// Other languages, and bodies that do not compile: their words.
		{"CREATE FUNCTION f() RETURNS void LANGUAGE plpython3u AS $$ plpy.execute('DROP OWNED BY CURRENT_USER') $$", "function body runs dynamic SQL"},
		{"DO $$ BEGIN DROP OWNED BY CURRENT_USER $$", "DO block runs dynamic SQL"}, // missing END
		// In a multi-statement text, and after a statement that is fine.
		{"SELECT 1; DO $$ BEGIN EXECUTE 'DROP OWNED BY x'; END $$", "DO block runs dynamic SQL"},
	}
	for _, tt := range refused {
		d := r.Decide(tt.sql)
		e := d.Err
		switch {
		case d.Action != Refuse || e == nil:
			t.Errorf("%q: got %v %+v, want a refusal", tt.sql, d.Action, e)
		case e.Code != CodeRefused || e.Table != "public.acct" || !strings.Contains(e.Message, tt.what) ||
			!strings.Contains(e.Message, "public.acct") || e.Detail == "" || !strings.Contains(e.Hint, "direct connection"):
			t.Errorf("%q: got %+v, want %q", tt.sql, e, tt.what)
		}
	}
	forwarded := []string{
		"DO $$ BEGIN DROP TABLE tmp; END $$",
		"DO $$ BEGIN DROP TABLE tmp RESTRICT; CREATE TABLE tmp (a int); END $$",
		"DO $$ BEGIN ALTER TABLE other_t DROP COLUMN c; END $$",
		"DO $$ BEGIN EXECUTE 'DROP TABLE ' || quote_ident('tmp'); END $$",
		"DO $$ BEGIN RAISE NOTICE 'owned by %', current_user; END $$", // a message, never run
		"DO $$ BEGIN INSERT INTO log VALUES ('database is up'); END $$",
		"DO $$ BEGIN EXECUTE 'REVOKE ALL ON other_t FROM app CASCADE'; END $$",
		"DO $$ BEGIN EXECUTE 'TRUNCATE other_t'; END $$",
		"CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
		"CREATE FUNCTION f(owner text) RETURNS text LANGUAGE plpgsql AS $$ BEGIN RETURN current_database(); END $$",
	}
	for _, sql := range forwarded {
		if d := r.Decide(sql); d.Action != Forward || d.AuditRefusal != nil {
			t.Errorf("%q: got %v %+v %+v, want forwarded", sql, d.Action, d.Err, d.AuditRefusal)
		}
	}

	// Only where the session fences a table: in audit mode forwarded and
	// recorded, with none forwarded.
	scoped := mustCompileInternal(t, Config{Tables: []Table{
		{Table: "public.acct", Scope: Scope{Databases: []string{"app"}}},
		{Table: "other.ledger", Column: "gen", Mode: ModeAudit, Scope: Scope{Databases: []string{"reports"}}},
	}})
	app := scoped.ForSession("app", "owner", "")
	reports := scoped.ForSession("reports", "owner", "")
	none := scoped.ForSession("scratch", "owner", "")
	for _, tt := range refused {
		if d := app.Decide(tt.sql); d.Action != Refuse || d.Err == nil || d.Err.Table != "public.acct" {
			t.Errorf("app: %q: got %v %+v, want a refusal", tt.sql, d.Action, d.Err)
		}
		if d := reports.Decide(tt.sql); d.Action != Forward || d.AuditRefusal == nil || d.AuditRefusal.Table != "other.ledger" {
			t.Errorf("reports: %q: got %v %+v, want forwarded and recorded", tt.sql, d.Action, d.AuditRefusal)
		}
		if d := none.Decide(tt.sql); d.Action != Forward || d.AuditRefusal != nil {
			t.Errorf("scratch: %q: got %v %+v, want forwarded", tt.sql, d.Action, d.AuditRefusal)
		}
	}
}
