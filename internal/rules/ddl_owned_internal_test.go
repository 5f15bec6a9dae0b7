package rules

import (
	"strings"
	"testing"
)

// decideGated is Decide with mayReachUnnamed as part of the pre-check, as
// MayTouch is meant to call it: the statements reachesUnnamed refuses need
// not name a protected table.
func decideGated(r *Rules, sql string) Decision {
	if !r.MayTouch(sql) && !(len(r.tables) > 0 && mayReachUnnamed(sql)) {
		return Decision{Action: Forward}
	}
	return r.decide(sql)
}

// TestDDLReachingUnnamedTables: statements that can drop a protected
// table, move it, or change its owner or extension membership without
// naming it are refused wherever the session fences a table; forms that
// cannot are forwarded.
func TestDDLReachingUnnamedTables(t *testing.T) {
	r := mustCompileInternal(t, Config{Tables: []Table{
		{Table: "public.acct"},
		{Table: "other.ledger", Column: "gen", Mode: ModeAudit},
	}})
	refused := []struct{ sql, what string }{
		// DROP OWNED, every role spelling.
		{"DROP OWNED BY CURRENT_USER", "DROP OWNED"},
		{"drop owned by current_user cascade", "DROP OWNED"},
		{"Drop Owned By Session_User", "DROP OWNED"},
		{"DROP OWNED BY CURRENT_ROLE RESTRICT", "DROP OWNED"},
		{"DROP OWNED BY app", "DROP OWNED"},
		{`DROP OWNED BY "app", "Owner", CURRENT_USER, SESSION_USER`, "DROP OWNED"},
		{`DROP OWNED BY "CURRENT_USER"`, "DROP OWNED"}, // a role of that name
		{"DROP/**/OWNED BY app", "DROP OWNED"},
		{"DROP -- c\nOWNED BY app", "DROP OWNED"},
		// REASSIGN OWNED, alone and with DROP OWNED.
		{"REASSIGN OWNED BY CURRENT_USER TO postgres", "REASSIGN OWNED"},
		{`REASSIGN OWNED BY app, SESSION_USER TO "New Owner"`, "REASSIGN OWNED"},
		{"reassign owned by current_role to current_user", "REASSIGN OWNED"},
		{"REASSIGN OWNED BY CURRENT_USER TO postgres; DROP OWNED BY CURRENT_USER", "REASSIGN OWNED"},
		// Multi-statement texts: the whole text is refused.
		{"SELECT 1; DROP OWNED BY app", "DROP OWNED"},
		{"BEGIN; DROP OWNED BY app; COMMIT", "DROP OWNED"},
		{"UPDATE other_t SET a = 1; REASSIGN OWNED BY app TO b", "REASSIGN OWNED"},
		// Extensions: membership, dropping, updating, moving.
		{"DROP EXTENSION hstore", "DROP EXTENSION"},
		{`DROP EXTENSION IF EXISTS "hstore", citext RESTRICT`, "DROP EXTENSION"},
		{"DROP EXTENSION hstore CASCADE", "DROP EXTENSION"},
		{"ALTER EXTENSION hstore ADD TABLE acct", "ALTER EXTENSION ... ADD"},
		{"ALTER EXTENSION hstore ADD TABLE other_t", "ALTER EXTENSION ... ADD"},
		{`ALTER EXTENSION "hstore" ADD FUNCTION f()`, "ALTER EXTENSION ... ADD"},
		{"ALTER EXTENSION hstore DROP TABLE public.acct", "ALTER EXTENSION ... DROP"},
		{"ALTER EXTENSION hstore DROP SCHEMA archive", "ALTER EXTENSION ... DROP"},
		{"ALTER EXTENSION hstore UPDATE", "ALTER EXTENSION ... UPDATE"},
		{"ALTER EXTENSION hstore UPDATE TO '1.8'", "ALTER EXTENSION ... UPDATE"},
		{"ALTER EXTENSION hstore SET SCHEMA other", "ALTER EXTENSION ... SET SCHEMA"},
		// CASCADE through a dependency: types, domains, sequences,
		// functions of defaults or generated columns, collations, schemas,
		// text search, operators, servers, wrappers, parents, ...
		{"DROP TYPE mood CASCADE", "DROP TYPE ... CASCADE"},
		{`DROP TYPE IF EXISTS "Mood", public.size CASCADE`, "DROP TYPE ... CASCADE"},
		{"DROP DOMAIN posint CASCADE", "DROP DOMAIN ... CASCADE"},
		{"DROP SEQUENCE acct_id_seq CASCADE", "DROP SEQUENCE ... CASCADE"},
		{"DROP FUNCTION next_id() CASCADE", "DROP FUNCTION ... CASCADE"},
		{"DROP ROUTINE next_id CASCADE", "DROP ROUTINE ... CASCADE"},
		{"DROP PROCEDURE p(int) CASCADE", "DROP PROCEDURE ... CASCADE"},
		{"DROP AGGREGATE agg(int) CASCADE", "DROP AGGREGATE ... CASCADE"},
		{"DROP COLLATION c CASCADE", "DROP COLLATION ... CASCADE"},
		{"DROP SCHEMA archive CASCADE", "DROP SCHEMA ... CASCADE"},
		{"DROP SCHEMA IF EXISTS archive, s2 CASCADE", "DROP SCHEMA ... CASCADE"},
		{"DROP TEXT SEARCH CONFIGURATION cfg CASCADE", "DROP TSCONFIGURATION ... CASCADE"},
		{"DROP TEXT SEARCH DICTIONARY d CASCADE", "DROP TSDICTIONARY ... CASCADE"},
		{"DROP OPERATOR ### (int, int) CASCADE", "DROP OPERATOR ... CASCADE"},
		{"DROP OPERATOR CLASS oc USING btree CASCADE", "DROP OPCLASS ... CASCADE"},
		{"DROP CAST (int AS mood) CASCADE", "DROP CAST ... CASCADE"},
		{"DROP SERVER s CASCADE", "DROP FOREIGN SERVER ... CASCADE"},
		{"DROP FOREIGN DATA WRAPPER w CASCADE", "DROP FDW ... CASCADE"},
		{"DROP ACCESS METHOD am CASCADE", "DROP ACCESS METHOD ... CASCADE"},
		{"DROP TABLE parent CASCADE", "DROP TABLE ... CASCADE"},
		// Naming an audit-mode table does not let CASCADE reach the others.
		{"DROP TABLE other.ledger CASCADE", "DROP TABLE ... CASCADE"},
		{"DROP VIEW v CASCADE", "DROP VIEW ... CASCADE"},
		{"DROP INDEX CONCURRENTLY other_t_pkey CASCADE", "DROP INDEX ... CASCADE"},
		{"drop type mood cascade", "DROP TYPE ... CASCADE"},
		{`DROP TYPE "t"CASCADE`, "DROP TYPE ... CASCADE"},
		{"ALTER TABLE other_t DROP COLUMN x CASCADE", "ALTER TABLE ... CASCADE"},
		{"ALTER TABLE other_t ADD COLUMN y int, DROP CONSTRAINT other_t_pkey CASCADE", "ALTER TABLE ... CASCADE"},
		{"ALTER TYPE comp DROP ATTRIBUTE a CASCADE", "ALTER TYPE ... CASCADE"},
		{"ALTER TYPE comp ALTER ATTRIBUTE a TYPE text CASCADE", "ALTER TYPE ... CASCADE"},
		{"ALTER DOMAIN posint DROP CONSTRAINT c CASCADE", "ALTER DOMAIN ... CASCADE"},
		// Databases.
		{"DROP DATABASE appdb", "DROP DATABASE"},
		{"DROP DATABASE IF EXISTS appdb WITH (FORCE)", "DROP DATABASE"},
	}
	for _, tt := range refused {
		d := decideGated(r, tt.sql)
		e := d.Err
		switch {
		case d.Action != Refuse || e == nil:
			t.Errorf("%q: got %v %+v, want a refusal", tt.sql, d.Action, e)
		case e.Code != CodeRefused || e.Table != "public.acct" || !strings.Contains(e.Message, "public.acct") ||
			!strings.Contains(e.Message, tt.what+" is not allowed through the proxy") || e.Detail == "" ||
			!strings.Contains(e.Hint, "direct connection"):
			t.Errorf("%q: got %+v", tt.sql, e)
		}
	}
	// Refused under the rules that were there before: a statement that
	// names a protected table (or its schema) keeps its own message.
	for _, sql := range []string{
		"DROP SCHEMA public",
		"DROP SCHEMA public CASCADE",
		"DROP TABLE acct CASCADE",
	} {
		if d := decideGated(r, sql); d.Action != Refuse || d.Err == nil || d.Err.Table != "public.acct" {
			t.Errorf("%q: got %v %+v, want a refusal", sql, d.Action, d.Err)
		}
	}
	forwarded := []string{
		// RESTRICT (the default): the server refuses to drop a dependent.
		"DROP TYPE mood",
		"DROP TYPE mood RESTRICT",
		"DROP DOMAIN posint",
		"DROP FUNCTION next_id()",
		"DROP SEQUENCE s",
		"DROP SCHEMA archive",
		"DROP SCHEMA archive RESTRICT",
		"DROP TABLE other_t",
		"DROP COLLATION c",
		"DROP SERVER s",
		"ALTER TABLE other_t DROP COLUMN x",
		"ALTER TYPE comp DROP ATTRIBUTE a",
		// Creating an extension drops nothing; its CASCADE installs the
		// extensions it requires.
		"CREATE EXTENSION hstore",
		"CREATE EXTENSION IF NOT EXISTS hstore WITH SCHEMA archive CASCADE",
		"COMMENT ON EXTENSION hstore IS 'x'",
		// Moving other objects, owners of other schemas.
		"ALTER TABLE other_t SET SCHEMA archive",
		"ALTER TYPE mood SET SCHEMA archive",
		"ALTER FUNCTION next_id() SET SCHEMA archive",
		"ALTER SCHEMA archive OWNER TO someone",
		// The owner of a protected table's schema may drop it, but only by
		// a statement that names it or one refused above: the table keeps
		// its owner.
		"ALTER SCHEMA public OWNER TO someone",
		`ALTER SCHEMA "public" OWNER TO CURRENT_USER`,
		"ALTER TYPE mood OWNER TO someone",
		"ALTER SEQUENCE s OWNED BY other_t.id",
		// CASCADE that drops no object: privileges, TRUNCATE (decided
		// with the catalog's paths), subscriptions.
		"REVOKE ALL ON other_t FROM app CASCADE",
		"REVOKE GRANT OPTION FOR SELECT ON acct FROM app CASCADE",
		"REVOKE admin FROM app CASCADE",
		"TRUNCATE other_t CASCADE",
		"DROP SUBSCRIPTION sub CASCADE",
		"DROP ROLE app",
		// The words in strings, identifiers and comments.
		"SELECT 'DROP OWNED BY app'",
		"UPDATE other_t SET owned = true -- drop cascade",
		"SELECT extension, cascade_log FROM other_t",
		// Not preparable, not explainable: a syntax error on the server
		// too, so nothing runs.
		"PREPARE p AS DROP OWNED BY app",
		"EXPLAIN DROP OWNED BY app",
		"CREATE SCHEMA s DROP OWNED BY app",
	}
	for _, sql := range forwarded {
		if d := decideGated(r, sql); d.Action != Forward || d.AuditRefusal != nil {
			t.Errorf("%q: got %v %+v %+v, want forwarded", sql, d.Action, d.Err, d.AuditRefusal)
		}
	}

	// Scoped rules: only where a table applies. In a session fencing only
	// audit-mode tables the statements are forwarded and recorded; in one
	// fencing none they are forwarded.
	scoped := mustCompileInternal(t, Config{Tables: []Table{
		{Table: "public.acct", Scope: Scope{Databases: []string{"app"}}},
		{Table: "other.ledger", Column: "gen", Mode: ModeAudit, Scope: Scope{Databases: []string{"app", "reports"}}},
	}})
	app := scoped.ForSession("app", "owner", "")
	reports := scoped.ForSession("reports", "owner", "")
	none := scoped.ForSession("scratch", "owner", "")
	for _, tt := range refused {
		if d := decideGated(app, tt.sql); d.Action != Refuse || d.Err == nil || d.Err.Table != "public.acct" {
			t.Errorf("app: %q: got %v %+v, want a refusal", tt.sql, d.Action, d.Err)
		}
		if d := decideGated(reports, tt.sql); d.Action != Forward || d.AuditRefusal == nil || d.AuditRefusal.Table != "other.ledger" {
			t.Errorf("reports: %q: got %v %+v, want forwarded and recorded", tt.sql, d.Action, d.AuditRefusal)
		}
		if d := decideGated(none, tt.sql); d.Action != Forward || d.AuditRefusal != nil {
			t.Errorf("scratch: %q: got %v %+v, want forwarded", tt.sql, d.Action, d.AuditRefusal)
		}
	}
}

// TestMayReachUnnamed: the pre-check's words.
func TestMayReachUnnamed(t *testing.T) {
	for _, tt := range []struct {
		sql  string
		want bool
	}{
		{"DROP OWNED BY x", true},
		{"reassign OWNED by x to y", true},
		{"SELECT owned FROM t", true}, // parsed, then forwarded
		{"drop extension e", true},
		{"ALTER extension e update", true},
		{"DROP TYPE t CASCADE", true},
		{"drop database d", true},
		{`DROP TYPE "t"CASCADE`, true},
		{"DROP\tTYPE t\nCASCADE;", true},
		{"SELECT 1", false},
		{"DROP INDEX i", false},
		{"SELECT extension FROM t", false},
		{"UPDATE t SET owned_by = 1, reassigned = true", false},
		{"SELECT * FROM cascade_log, database_list; DROP TABLE t", false},
		{"ALTERED CASCADES", false},
		{"CREATE EXTENSION e CASCADE", false},
	} {
		if got := mayReachUnnamed(tt.sql); got != tt.want {
			t.Errorf("mayReachUnnamed(%q) = %v, want %v", tt.sql, got, tt.want)
		}
	}
}

func mustCompileInternal(t *testing.T, cfg Config) *Rules {
	t.Helper()
	r, err := Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}
