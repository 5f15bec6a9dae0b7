package catalog_test

import (
	"context"
	"slices"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
)

// TestSettingsReaders: each kind of code that may read fence.token or
// fence.lock is found, named, in whatever schema; code reading other
// settings, naming the fence column, or fenceproxy's own functions is
// not.
func TestSettingsReaders(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	settings := []string{"fence.token", "fence.lock"}
	find := func() ([]string, bool) {
		t.Helper()
		names, found, err := catalog.SettingsReaders(context.Background(), conn, settings, []string{"own"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		return names, found
	}
	execSQL(t, conn, `
		CREATE TABLE acct (id int, state text, last_fence bigint NOT NULL DEFAULT 0);
		CREATE POLICY tenant ON acct USING (current_setting('app.tenant', true) IS NULL);
		CREATE FUNCTION keep_fence() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN NEW.last_fence := OLD.last_fence; RETURN NEW; END$$;
		CREATE TRIGGER acct_keep BEFORE UPDATE ON acct FOR EACH ROW WHEN (current_setting('app.x', true) IS NULL) EXECUTE FUNCTION keep_fence();
		CREATE VIEW plain_v AS SELECT id, state FROM acct;
		CREATE SCHEMA fenceproxy;
		CREATE FUNCTION fenceproxy.own() RETURNS text LANGUAGE sql AS $$SELECT current_setting('fence.token', true)$$;
	`)
	if names, found := find(); found || len(names) > 0 {
		t.Fatalf("found %q in code that reads no fence setting", names)
	}

	cases := []struct{ sql, name string }{
		{`CREATE FUNCTION f1() RETURNS text LANGUAGE plpgsql AS $$BEGIN RETURN current_setting('fence.token'); END$$`, "function f1()"},
		{`CREATE FUNCTION f2() RETURNS text LANGUAGE sql BEGIN ATOMIC SELECT current_setting('Fence.Lock'); END`, "function f2()"},
		{`CREATE FUNCTION f3(x text DEFAULT current_setting('fence.token')) RETURNS text LANGUAGE sql AS 'SELECT x'`, "function f3(text)"},
		{`CREATE FUNCTION f4() RETURNS text LANGUAGE plpgsql AS $$BEGIN RETURN current_setting(E'\x66ence.token'); END$$`, "function f4()"},
		{`CREATE FUNCTION f5() RETURNS text LANGUAGE plpgsql AS $$BEGIN RETURN current_setting(U&'\0066ence.token'); END$$`, "function f5()"},
		{`CREATE FUNCTION f6() RETURNS text LANGUAGE plpgsql AS $$BEGIN RETURN (SELECT setting FROM pg_settings WHERE name = 'x'); END$$`, "function f6()"},
		// In fenceproxy's schema or pg_catalog, but not fenceproxy's own.
		{`CREATE FUNCTION fenceproxy.other() RETURNS text LANGUAGE sql AS $$SELECT current_setting('fence.token', true)$$`, "function fenceproxy.other()"},
		{`CREATE FUNCTION pg_catalog.mine() RETURNS text LANGUAGE sql AS $$SELECT current_setting('fence.token', true)$$`, "function mine()"},
		{`CREATE VIEW v AS SELECT current_setting('fence.token', true) AS t`, "view v"},
		{`CREATE MATERIALIZED VIEW m AS SELECT current_setting('fence.token', true) AS t`, "view m"},
		{`CREATE TABLE t2 (x text DEFAULT current_setting('fence.lock', true))`, "default of t2"},
		{`CREATE TABLE t3 (x text, CONSTRAINT t3_c CHECK (x <> current_setting('fence.lock', true)))`, "constraint t3_c"},
		{`CREATE DOMAIN d1 AS text DEFAULT current_setting('fence.token', true)`, "default of domain d1"},
		{`CREATE DOMAIN d2 AS text CONSTRAINT d2_c CHECK (VALUE <> current_setting('fence.token', true))`, "constraint d2_c"},
		{`CREATE POLICY p ON acct WITH CHECK (current_setting('fence.token', true) IS NOT NULL)`, "policy p on acct"},
		{`CREATE RULE r AS ON INSERT TO plain_v WHERE current_setting('fence.token', true) IS NULL DO INSTEAD NOTHING`, "rule r on plain_v"},
		{`CREATE TRIGGER tw BEFORE INSERT ON acct FOR EACH ROW WHEN (current_setting('fence.token', true) IS NULL) EXECUTE FUNCTION keep_fence()`, "trigger tw on acct"},
		// The name as a trigger argument, which the function reads as
		// TG_ARGV[0].
		{`CREATE TRIGGER ta BEFORE INSERT ON acct FOR EACH ROW EXECUTE FUNCTION keep_fence('fence.token')`, "trigger ta on acct"},
	}
	for _, c := range cases {
		execSQL(t, conn, "BEGIN; "+c.sql)
		names, found := find()
		if !found || !slices.Contains(names, c.name) {
			t.Errorf("%s: found %v %q, want %q", c.sql, found, names, c.name)
		}
		execSQL(t, conn, "ROLLBACK")
	}

	// Other names of the settings: their first parts.
	execSQL(t, conn, `CREATE FUNCTION g() RETURNS text LANGUAGE sql AS $$SELECT current_setting('myapp.fencing_token')$$`)
	names, found, err := catalog.SettingsReaders(context.Background(), conn, []string{"myapp.fencing_token", "myapp.lock"}, nil, 0)
	if err != nil || !found || !slices.Equal(names, []string{"function g()"}) {
		t.Errorf("settings myapp.*: %q %v %v, want [function g()]", names, found, err)
	}
	if names, found := find(); found {
		t.Errorf("settings fence.*: found %q in code naming myapp's", names)
	}
}
