package rules_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// checkRefusal checks a decision against a wanted action and the table of
// its refusal (Err for Refuse, AuditRefusal for Forward; "" for none).
func checkRefusal(t *testing.T, sql string, d rules.Decision, action rules.Action, table string) *rules.Error {
	t.Helper()
	if d.Action != action {
		t.Errorf("%s: got %v, want %v (%+v)", sql, d.Action, action, d.Err)
		return nil
	}
	e := d.Err
	if d.Action == rules.Forward {
		e = d.AuditRefusal
	}
	switch {
	case table == "" && e != nil:
		t.Errorf("%s: unexpected refusal %v", sql, e)
	case table == "":
	case e == nil:
		t.Errorf("%s: no refusal", sql)
	case e.Code != rules.CodeRefused || e.Table != table || !strings.Contains(e.Message, table) || e.Hint == "" || e.Detail == "":
		t.Errorf("%s: got %+v", sql, e)
	default:
		return e
	}
	return nil
}

func TestDDLThatRemovesProtection(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{
		{Table: "public.acct"},
		{Table: "other.ledger", Column: "gen", Mode: rules.ModeAudit},
	}})
	tests := []struct {
		sql    string
		action rules.Action
		table  string // of Err (Refuse) or AuditRefusal (Forward)
	}{
		{"ALTER TABLE acct RENAME TO acct2", rules.Refuse, "public.acct"},
		{"ALTER TABLE public.acct SET SCHEMA other", rules.Refuse, "public.acct"},
		{"ALTER SCHEMA public RENAME TO p2", rules.Refuse, "public.acct"},
		{"ALTER TABLE acct RENAME COLUMN last_fence TO x", rules.Refuse, "public.acct"},
		// Audit mode: forwarded, and the refusal recorded.
		{"ALTER TABLE ledger RENAME TO ledger2", rules.Forward, "other.ledger"},
		{"ALTER SCHEMA other RENAME TO o2", rules.Forward, "other.ledger"},
		// Not DDL on a protected table.
		{"ALTER TABLE old_acct RENAME TO acct", rules.Forward, ""},
		{"ALTER TABLE other.acct RENAME TO acct2", rules.Forward, ""},
		{"ALTER SCHEMA archive RENAME TO public", rules.Forward, ""},
	}
	for _, tt := range tests {
		if e := checkRefusal(t, tt.sql, r.Decide(tt.sql), tt.action, tt.table); e != nil &&
			(!strings.Contains(e.Message, "configuration first") || !strings.Contains(e.Message, "without the proxy")) {
			t.Errorf("%s: got %+v", tt.sql, e)
		}
	}
}

// TestDDLDefaultDeny: DDL on a protected table is refused unless on the
// allow-list.
func TestDDLDefaultDeny(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{
		{Table: "public.acct"},
		{Table: "other.ledger", Column: "gen", Mode: rules.ModeAudit},
	}})
	refused := []string{
		"DROP TABLE acct",
		"DROP TABLE IF EXISTS public.acct CASCADE",
		"DROP TABLE t1, acct",
		"DROP VIEW acct",
		"DROP SCHEMA public CASCADE",
		"ALTER TABLE acct DROP COLUMN last_fence",
		"ALTER TABLE acct DROP COLUMN note",
		"ALTER TABLE acct ALTER COLUMN last_fence TYPE numeric",
		"ALTER TABLE acct ALTER COLUMN note TYPE int USING 'x'",
		"ALTER TABLE acct ALTER COLUMN last_fence DROP NOT NULL",
		"ALTER TABLE acct ALTER COLUMN last_fence SET DEFAULT 0",
		"ALTER TABLE acct INHERIT base",
		"ALTER TABLE child INHERIT acct",
		"ALTER TABLE child NO INHERIT public.acct",
		"ALTER TABLE parent ATTACH PARTITION acct FOR VALUES IN (1)",
		"ALTER TABLE acct ATTACH PARTITION part FOR VALUES IN (1)",
		"ALTER TABLE parent DETACH PARTITION acct",
		"ALTER TABLE acct DISABLE TRIGGER ALL",
		"ALTER TABLE acct DISABLE TRIGGER fenceproxy_guard",
		"ALTER TABLE acct ENABLE REPLICA TRIGGER t",
		"ALTER TABLE acct SET ACCESS METHOD heap2",
		"ALTER TABLE acct SET UNLOGGED",
		"ALTER TABLE acct OWNER TO someone",
		"ALTER TABLE acct DISABLE ROW LEVEL SECURITY",
		"ALTER TABLE acct ADD CONSTRAINT fk FOREIGN KEY (o) REFERENCES other_t ON DELETE CASCADE",
		"ALTER TABLE acct ADD COLUMN t timestamptz DEFAULT clock_timestamp()",
		"ALTER TABLE acct ADD COLUMN n bigint DEFAULT nextval('s')",
		"ALTER TABLE acct ADD COLUMN id2 int GENERATED ALWAYS AS IDENTITY",
		"ALTER TABLE acct ADD COLUMN g int GENERATED ALWAYS AS (1) STORED",
		"ALTER TABLE acct ADD COLUMN o int REFERENCES other_t ON DELETE CASCADE",
		"ALTER TABLE acct ADD COLUMN x int, DROP COLUMN note",
		"ALTER TABLE acct RENAME COLUMN note TO n2",
		"ALTER TABLE acct RENAME CONSTRAINT c TO c2",
		"ALTER TRIGGER t ON acct RENAME TO t2",
		"CREATE TRIGGER pin BEFORE UPDATE ON acct FOR EACH ROW EXECUTE FUNCTION pin()",
		"CREATE CONSTRAINT TRIGGER c AFTER UPDATE ON other_t FROM acct FOR EACH ROW EXECUTE FUNCTION f()",
		"DROP TRIGGER fenceproxy_guard ON acct",
		"CREATE RULE r AS ON UPDATE TO acct DO INSTEAD NOTHING",
		"DROP RULE r ON public.acct",
		"CREATE POLICY p ON acct USING (true)",
		"ALTER POLICY p ON acct USING (false)",
		"DROP POLICY p ON acct",
		"CREATE TABLE child () INHERITS (acct)",
		"CREATE TABLE part PARTITION OF acct FOR VALUES IN (1)",
		"CREATE TABLE acct (id int) INHERITS (base)",
		"CREATE TABLE public.acct PARTITION OF parent FOR VALUES IN (1)",
		"CREATE VIEW v AS SELECT * FROM acct",
		"CREATE VIEW v AS SELECT * FROM t WHERE id IN (SELECT id FROM public.acct)",
		`CREATE RULE "_RETURN" AS ON SELECT TO t DO INSTEAD SELECT * FROM acct`,
		"CREATE STATISTICS s ON a, b FROM acct",
		"CREATE PUBLICATION p FOR TABLE acct",
		"CREATE SCHEMA s CREATE TABLE child () INHERITS (public.acct)",
		"SELECT 1; DROP TABLE acct",
	}
	for _, sql := range refused {
		if e := checkRefusal(t, sql, r.Decide(sql), rules.Refuse, "public.acct"); e != nil &&
			(!strings.Contains(e.Message, "without the proxy") || !strings.Contains(e.Hint, "CREATE INDEX")) {
			t.Errorf("%s: got %+v", sql, e)
		}
	}
	allowed := []string{
		"CREATE INDEX ON acct (note)",
		"CREATE UNIQUE INDEX CONCURRENTLY i ON public.acct (id)",
		"REINDEX TABLE acct",
		"COMMENT ON TABLE acct IS 'x'",
		"COMMENT ON COLUMN acct.last_fence IS 'watermark'",
		"GRANT SELECT, UPDATE ON acct TO app",
		"REVOKE ALL ON acct FROM app",
		"ANALYZE acct",
		"VACUUM (FULL, ANALYZE) acct",
		"CLUSTER acct USING acct_pkey",
		"LOCK TABLE acct IN SHARE MODE",
		"ALTER TABLE acct ADD COLUMN note text",
		"ALTER TABLE acct ADD COLUMN IF NOT EXISTS n int NOT NULL DEFAULT 0",
		"ALTER TABLE acct ADD COLUMN s text DEFAULT 'x'::text, ADD COLUMN m numeric DEFAULT -1.5",
		"ALTER TABLE other_t ADD CONSTRAINT fk FOREIGN KEY (a) REFERENCES acct",
		"CREATE TABLE acct (id int PRIMARY KEY, last_fence bigint NOT NULL DEFAULT 0)",
		"CREATE TABLE t (LIKE acct)",
		"CREATE TABLE t AS SELECT * FROM acct",
		"CREATE TRIGGER t BEFORE UPDATE ON other_t FOR EACH ROW EXECUTE FUNCTION f()",
		"DROP TABLE other.acct",
		"DROP TABLE acct_archive",
		"DROP INDEX acct_note_idx",
		"DROP SCHEMA archive",
		"CREATE VIEW v AS SELECT * FROM other.acct",
		`CREATE RULE "_RETURN" AS ON SELECT TO t DO INSTEAD SELECT * FROM other.acct`,
	}
	for _, sql := range allowed {
		checkRefusal(t, sql, r.Decide(sql), rules.Forward, "")
	}
	// Audit mode: forwarded, the refusal recorded.
	for _, sql := range []string{
		"DROP TABLE other.ledger",
		"CREATE TRIGGER pin BEFORE UPDATE ON ledger FOR EACH ROW EXECUTE FUNCTION pin()",
		"ALTER TABLE x ATTACH PARTITION other.ledger FOR VALUES IN (1)",
	} {
		checkRefusal(t, sql, r.Decide(sql), rules.Forward, "other.ledger")
	}
}

// TestStoredCode: stored code is decided on its parsed body, by identifier
// tokens.
func TestStoredCode(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{
		{Table: "public.config"},
		{Table: `app."Mixed"`},
		{Table: "other.ledger", Mode: rules.ModeAudit},
	}})
	refused := []string{
		// Plain.
		"DO $$ BEGIN UPDATE config SET a = 1; END $$",
		"CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$ UPDATE config SET a = 1 $$",
		"CREATE PROCEDURE p() LANGUAGE sql BEGIN ATOMIC DELETE FROM public.config; END",
		// Escapes and continuations: the name only exists after the parser.
		`DO E'BEGIN UPDATE con\x66ig SET a = 1; END'`,
		`DO E'BEGIN UPDATE con\146ig SET a = 1; END'`,
		`DO E'BEGIN UPDATE con\u0066ig SET a = 1; END'`,
		"DO 'BEGIN UPDATE con'\n'fig SET a = 1; END'",
		`CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql AS E'BEGIN DELETE FROM con\x66ig; END'`,
		"CREATE FUNCTION f() RETURNS void LANGUAGE sql AS 'UPDATE con'\n'fig SET a = 1'",
		`DO U&'BEGIN UPDATE con\0066ig SET a = 1; END'`,
		// Reads, and other references, count too.
		"DO $$ DECLARE n int; BEGIN SELECT count(*) INTO n FROM config; END $$",
		"DO $$ BEGIN PERFORM 1 FROM CONFIG; END $$",
		`DO $$ BEGIN UPDATE app."Mixed" SET a = 1; END $$`,
		"DO $$ BEGIN DROP TABLE config; END $$",
		"DO $$ BEGIN IF EXISTS (SELECT 1 FROM config) THEN RAISE NOTICE 'x'; END IF; END $$",
		"DO $$ DECLARE v int := (SELECT a FROM config LIMIT 1); BEGIN END $$",
		"DO $$ DECLARE v int; BEGIN v := a FROM config; END $$",
		"DO $$ DECLARE c CURSOR FOR SELECT * FROM config; BEGIN END $$",
		// Dynamic SQL: string constants are read as SQL tokens.
		"DO $$ BEGIN EXECUTE 'UPDATE config SET a = 1'; END $$",
		"DO $$ BEGIN EXECUTE format('UPDATE %I SET a = 1', 'config'); END $$",
		"DO $$ DECLARE q text := 'DELETE FROM public.config'; BEGIN EXECUTE q; END $$",
		`DO $$ BEGIN EXECUTE E'UPDATE con\x66ig SET a = 1'; END $$`,
		"DO $$ BEGIN EXECUTE 'UPDATE con'\n'fig SET a = 1'; END $$",
		"DO $$ BEGIN EXECUTE 'DO $x$ BEGIN UPDATE config SET a = 1; END $x$'; END $$",
		`DO $$ BEGIN EXECUTE 'UPDATE U&"con\0066ig" SET a = 1'; END $$`,
		`DO $$ BEGIN EXECUTE 'UPDATE "Mixed" SET a = 1'; END $$`,
		// Read with escapes when standard_conforming_strings is off.
		`DO $$ BEGIN EXECUTE 'UPDATE con\x66ig SET a = 1'; END $$`,
		// Trigger functions and SQL bodies.
		"CREATE FUNCTION t() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN UPDATE config SET a = NEW.a; RETURN NEW; END $$",
		"CREATE FUNCTION f() RETURNS int LANGUAGE sql RETURN (SELECT count(*) FROM config)",
		"CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$ SELECT 'config'::regclass $$",
		// Other languages: any mention.
		"CREATE FUNCTION f() RETURNS void LANGUAGE plpython3u AS $$ plpy.execute('UPDATE config SET a = 1') $$",
		// Bodies that do not compile are read as tokens.
		"DO $$ BEGIN UPDATE config SET a = ; END $$",
	}
	for _, sql := range refused {
		d := r.Decide(sql)
		if d.Action != rules.Refuse || d.Err == nil || d.Err.Code != rules.CodeRefused {
			t.Errorf("%q: got %v %+v, want a refusal", sql, d.Action, d.Err)
		}
	}
	forwarded := []string{
		"DO $$ BEGIN PERFORM current_setting('myapp.configuration'); END $$",
		"DO $$ BEGIN RAISE NOTICE 'reconfigured'; END $$",
		"DO $$ BEGIN RAISE NOTICE 'config changed: %', 1; END $$",
		"DO $$ BEGIN UPDATE configuration SET a = 1; UPDATE other.config_log SET a = 1; END $$",
		"DO $$ DECLARE reconfig int; BEGIN reconfig := 1; UPDATE t SET config = 1; END $$",
		`DO $$ BEGIN UPDATE "Config" SET a = 1; UPDATE app.mixed SET a = 1; END $$`,
		`DO E'BEGIN UPDATE t SET a = 1; RAISE NOTICE ''config\\t''; END'`,
		"CREATE FUNCTION f() RETURNS text LANGUAGE sql AS $$ SELECT current_setting('myapp.configuration') $$",
		"CREATE FUNCTION t() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN NEW.last_fence := OLD.last_fence; RETURN NEW; END $$",
		"CREATE FUNCTION f() RETURNS int LANGUAGE plpython3u AS $$ return 1 $$",
		`CREATE FUNCTION f(text) RETURNS text LANGUAGE c AS 'reconfigure', 'reconfigure'`,
		"DO 'BEGIN UPDATE t SET a = 1; END'",
		// Concatenated dynamic SQL: a documented limit of static analysis.
		"DO $$ BEGIN EXECUTE 'UPDATE con' || 'fig SET a = 1'; END $$",
	}
	for _, sql := range forwarded {
		d := r.Decide(sql)
		if d.Action != rules.Forward || d.AuditRefusal != nil {
			t.Errorf("%q: got %v %+v, want forwarded", sql, d.Action, d.Err)
		}
	}
	// Audit mode: recorded only.
	sql := "DO $$ BEGIN EXECUTE format('DELETE FROM %I', 'ledger'); END $$"
	checkRefusal(t, sql, r.Decide(sql), rules.Forward, "other.ledger")
	// The cheap pre-check lets disguised names through to the parser.
	for _, sql := range []string{
		`DO E'BEGIN UPDATE con\x66ig SET a = 1; END'`,
		"create function f() returns void language sql as 'update con'\r\n'fig set a = 1'",
	} {
		if !r.MayTouch(sql) {
			t.Errorf("MayTouch(%q) = false", sql)
		}
	}
	for _, sql := range []string{`SELECT E'a\nb' FROM t`, "SELECT 'a'\n'b' FROM done", `SELECT E'\x41' AS "undo"`} {
		if r.MayTouch(sql) {
			t.Errorf("MayTouch(%q) = true", sql)
		}
	}
}

func TestHasNonASCIINames(t *testing.T) {
	tests := []struct {
		name   string
		tables []rules.Table
		want   bool
	}{
		{"none", nil, false},
		{"ascii", []rules.Table{{Table: `public."Config"`, Column: "gen"}}, false},
		{"table", []rules.Table{{Table: "public.cönfig"}}, true},
		{"schema", []rules.Table{{Table: `"schéma".config`}}, true},
		{"column", []rules.Table{{Table: "public.config", Column: `"génération"`}}, true},
		{"off", []rules.Table{{Table: "public.config"}, {Table: "public.cönfig", Mode: "off"}}, false},
		{"audit", []rules.Table{{Table: "public.cönfig", Mode: rules.ModeAudit}}, true},
		// Scoped to a session the root does not serve: still reported,
		// by the root and by every set.
		{"scoped", []rules.Table{{Table: "public.cönfig", Scope: rules.Scope{Users: []string{"app"}}}}, true},
	}
	for _, tt := range tests {
		r := mustCompile(t, rules.Config{Tables: tt.tables})
		if got := r.HasNonASCIINames(); got != tt.want {
			t.Errorf("%s: root: got %v, want %v", tt.name, got, tt.want)
		}
		for _, user := range []string{"app", "other"} {
			if got := r.ForSession("db", user, "").HasNonASCIINames(); got != tt.want {
				t.Errorf("%s: session of %s: got %v, want %v", tt.name, user, got, tt.want)
			}
		}
	}
}
