package rules_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestHierarchySet: DDL that drops or alters a relation whose inheritance
// or partition hierarchy holds a protected table, or creates a row trigger
// on it, is refused; ALTER TABLE ONLY, the allow-list, other relations and
// queries are not.
func TestHierarchySet(t *testing.T) {
	s := rules.NewHierarchySet([]rules.Indirect{
		{Schema: "public", Name: "events", Target: "public.acct", Via: "public.acct is a partition of public.events"},
		{Schema: "app", Name: "Base", Target: "public.acct", Via: `public.acct inherits from app."Base"`},
	})
	refused := []struct{ sql, what string }{
		{"DROP TABLE events", "DROP TABLE on public.events"},
		{"drop table if exists public.events", "DROP TABLE on public.events"},
		{"DROP TABLE other_t, events RESTRICT", "DROP TABLE on public.events"},
		{"DROP FOREIGN TABLE events", "DROP FOREIGN TABLE on public.events"},
		{`DROP TABLE app."Base"`, `DROP TABLE on app."Base"`},
		{"ALTER TABLE events DROP COLUMN note", "ALTER TABLE ... DROP COLUMN on public.events"},
		{"ALTER TABLE IF EXISTS public.events ALTER COLUMN note TYPE varchar(3)", "ALTER TABLE ... ALTER COLUMN ... TYPE on public.events"},
		{"ALTER TABLE events ALTER note SET DATA TYPE int USING 0", "ALTER TABLE ... ALTER COLUMN ... TYPE on public.events"},
		{"ALTER TABLE events ADD COLUMN n int DEFAULT random()", "ALTER TABLE ... ADD COLUMN on public.events"},
		{"ALTER TABLE events ADD CONSTRAINT c CHECK (id > 0)", "ALTER TABLE ... ADD CONSTRAINT on public.events"},
		{"ALTER TABLE events ALTER COLUMN id SET NOT NULL", "on public.events"},
		{"ALTER TABLE events ADD COLUMN n int, DROP COLUMN x", "ALTER TABLE ... DROP COLUMN"},
		{`ALTER TABLE "app"."Base" RENAME COLUMN last_fence TO b`, `ALTER TABLE ... RENAME COLUMN on app."Base"`},
		{"CREATE TRIGGER t BEFORE UPDATE ON events FOR EACH ROW EXECUTE FUNCTION f()", "CREATE TRIGGER ... FOR EACH ROW on public.events"},
		{"SELECT 1; DROP TABLE events", "DROP TABLE on public.events"},
		{"BEGIN; ALTER TABLE events DROP COLUMN x; COMMIT", "DROP COLUMN"},
		{"ALTER TABLE U&\"\\0065vents\" DROP COLUMN x", "DROP COLUMN"},
	}
	for _, tt := range refused {
		e := s.Check(tt.sql)
		switch {
		case e == nil:
			t.Errorf("%q: forwarded, want a refusal", tt.sql)
		case e.Code != rules.CodeRefused || e.Table != "public.acct" || !strings.Contains(e.Message, tt.what) ||
			!strings.Contains(e.Message, "protected table public.acct") || !strings.Contains(e.Detail, "public.acct") || e.Hint == "":
			t.Errorf("%q: got %+v, want %q", tt.sql, e, tt.what)
		}
	}
	for _, sql := range []string{
		"DROP TABLE other_t",
		"DROP TABLE other.events", // another schema
		"DROP TABLE base",         // app."Base" is quoted
		"DROP VIEW events",        // fails on the server: not a view
		"DROP INDEX events_pkey",
		"ALTER TABLE ONLY events DROP COLUMN note",
		"ALTER TABLE events RENAME TO events_old",
		"ALTER TABLE events RENAME CONSTRAINT c TO d",
		"ALTER TABLE events ADD COLUMN n int",
		"ALTER TABLE events ADD COLUMN n int DEFAULT 0 NOT NULL",
		"ALTER TABLE events ATTACH PARTITION p FOR VALUES IN (1)",
		"ALTER TABLE events DETACH PARTITION p",
		"ALTER TABLE events OWNER TO someone",
		"ALTER TABLE other_t DROP COLUMN events",
		"CREATE TRIGGER t AFTER INSERT ON events FOR EACH STATEMENT EXECUTE FUNCTION f()",
		"CREATE INDEX ON events (id)",
		"SELECT * FROM events WHERE dropped",
		"UPDATE events SET x = 1", // IndirectSet's
		"DROP TABLE tmp; SELECT * FROM events",
	} {
		if e := s.Check(sql); e != nil {
			t.Errorf("%q: got %+v, want nil", sql, e)
		}
	}
	if e := s.Check("ALTER TABLE events DROP COLUMN (x"); e == nil || e.Code != rules.CodeRefused {
		t.Errorf("unparsable: got %+v, want a refusal", e)
	}
	var none *rules.HierarchySet
	if rules.NewHierarchySet(nil) != nil || none.Check("DROP TABLE events") != nil || none.MayApply("DROP TABLE events") {
		t.Error("an empty set refuses")
	}
	for sql, want := range map[string]bool{
		"DROP TABLE x": true, "alter table x": true, "CREATE TRIGGER t": true,
		"SELECT dropped, altered FROM x": false, "SELECT 1": false, "UPDATE t SET drop_at = 1": false,
	} {
		if got := rules.MayBeDDL(sql); got != want {
			t.Errorf("MayBeDDL(%q) = %v, want %v", sql, got, want)
		}
	}
}
