package fencing_test

import (
	"testing"
)

// testDDL covers stored code and DDL on protected tables through the
// proxy: bodies that spell a protected name with escapes or string
// continuations are refused and never created, legitimate bodies are
// created, DDL is default-deny with a short allow-list (doc: Refusals).
func testDDL(t *testing.T, e *env) {
	db := e.newDB(t)
	d := direct(t, db)

	exists := func(t *testing.T, query string, args ...any) bool {
		t.Helper()
		var ok bool
		if err := d.QueryRow(ctxT(t), "SELECT EXISTS ("+query+")", args...).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	function := func(t *testing.T, name string) bool {
		t.Helper()
		return exists(t, "SELECT 1 FROM pg_catalog.pg_proc WHERE proname = $1", name)
	}

	t.Run("disguised-bodies-refused", func(t *testing.T) {
		c := e.connect(t, db)
		setTokenN(t, c, 42)
		before := snapshot(t, d, tError)
		for _, tc := range []struct{ fn, sql string }{
			{"esc1", `CREATE FUNCTION esc1() RETURNS void LANGUAGE plpgsql AS E'BEGIN UPDATE ac\x63t SET n = 99; END'`},
			{"esc2", `CREATE FUNCTION esc2() RETURNS void LANGUAGE sql AS E'UPDATE public.ac\143t SET n = 99'`},
			{"cont1", "CREATE FUNCTION cont1() RETURNS void LANGUAGE plpgsql AS 'BEGIN UPDATE ac'\n'ct SET n = 99; END'"},
			{"dyn1", `CREATE FUNCTION dyn1() RETURNS void LANGUAGE plpgsql AS $$ BEGIN EXECUTE format('UPDATE %I SET n = 99', 'acct'); END $$`},
			{"dyn2", `CREATE FUNCTION dyn2() RETURNS void LANGUAGE plpgsql AS $$ BEGIN EXECUTE E'UPDATE ac\x63t SET n = 99'; END $$`},
			{"", `DO E'BEGIN UPDATE ac\x63t SET n = 99; END'`},
			{"", "DO 'BEGIN UPDATE ac'\n'ct SET n = 99; END'"},
		} {
			_, err := c.PgConn().Exec(ctxT(t), tc.sql).ReadAll()
			wantCode(t, err, "FP003")
			if tc.fn != "" && function(t, tc.fn) {
				t.Errorf("%s was created", tc.fn)
			}
			selectOne(t, c)
		}
		wantUnchanged(t, d, tError, before)
	})

	t.Run("legitimate-bodies-forwarded", func(t *testing.T) {
		c := e.connect(t, db)
		for _, tc := range []struct{ fn, sql string }{
			{"legit1", `CREATE FUNCTION legit1() RETURNS text LANGUAGE plpgsql AS $$ BEGIN RAISE NOTICE 'reacct'; RETURN current_setting('myapp.acctx', true); END $$`},
			{"legit2", `CREATE FUNCTION legit2() RETURNS int LANGUAGE sql AS $$ SELECT v FROM src WHERE id = 1 $$`},
		} {
			if _, err := c.PgConn().Exec(ctxT(t), tc.sql).ReadAll(); err != nil {
				t.Fatalf("%s: %v", tc.sql, err)
			}
			if !function(t, tc.fn) {
				t.Errorf("%s was not created", tc.fn)
			}
		}
		if _, err := c.Exec(ctxT(t), "SELECT legit1(), legit2()"); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("trigger-pinning-the-watermark", func(t *testing.T) {
		c := e.connect(t, db)
		// The function names no protected table: created. The trigger
		// that would run it on acct is refused.
		if _, err := c.Exec(ctxT(t), `CREATE FUNCTION pin() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN NEW.last_fence := OLD.last_fence; RETURN NEW; END $$`); err != nil {
			t.Fatal(err)
		}
		_, err := c.Exec(ctxT(t), "CREATE TRIGGER pin BEFORE UPDATE ON acct FOR EACH ROW EXECUTE FUNCTION pin()")
		wantCode(t, err, "FP003")
		if exists(t, "SELECT 1 FROM pg_catalog.pg_trigger WHERE tgname = 'pin'") {
			t.Fatal("trigger pin exists")
		}
		// A stale write is still fenced.
		setTokenN(t, c, 500)
		if _, err := c.Exec(ctxT(t), "UPDATE acct SET n = 1 WHERE id = 3"); err != nil {
			t.Fatal(err)
		}
		setTokenN(t, c, 400)
		_, err = c.Exec(ctxT(t), "UPDATE acct SET n = 2 WHERE id = 3")
		wantCode(t, err, "FP001")
		var n int32
		var fence int64
		if err := d.QueryRow(ctxT(t), "SELECT n, last_fence FROM acct WHERE id = 3").Scan(&n, &fence); err != nil || n != 1 || fence != 500 {
			t.Fatalf("row 3 = (%d, %d), %v; want (1, 500)", n, fence, err)
		}
	})

	t.Run("ddl-refused", func(t *testing.T) {
		c := e.connect(t, db)
		before := snapshot(t, d, tError)
		for _, sql := range []string{
			"ALTER TABLE acct ALTER COLUMN payload TYPE text USING 'x'",
			"ALTER TABLE acct DROP COLUMN n",
			"ALTER TABLE acct INHERIT src",
			"ALTER TABLE acct DISABLE TRIGGER ALL",
			"ALTER TABLE acct ADD COLUMN t timestamptz DEFAULT clock_timestamp()",
			"CREATE TABLE child () INHERITS (acct)",
			"CREATE RULE r AS ON UPDATE TO acct DO INSTEAD NOTHING",
			"CREATE VIEW acct_v AS SELECT * FROM acct",
			"DROP TABLE acct",
		} {
			_, err := c.Exec(ctxT(t), sql)
			wantCode(t, err, "FP003")
			selectOne(t, c)
		}
		wantUnchanged(t, d, tError, before)
		if exists(t, "SELECT 1 FROM pg_catalog.pg_class WHERE relname IN ('child', 'acct_v')") {
			t.Error("a refused relation exists")
		}
	})

	t.Run("ddl-allowed", func(t *testing.T) {
		c := e.connect(t, db)
		for _, sql := range []string{
			"CREATE INDEX acct_n_idx ON acct (n)",
			"COMMENT ON TABLE acct IS 'fenced'",
			"ALTER TABLE acct ADD COLUMN note text DEFAULT 'none'",
			"GRANT SELECT ON acct TO PUBLIC",
			"ANALYZE acct",
		} {
			if _, err := c.Exec(ctxT(t), sql); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
		if !exists(t, "SELECT 1 FROM pg_catalog.pg_indexes WHERE indexname = 'acct_n_idx'") {
			t.Error("index not created")
		}
		if !exists(t, "SELECT 1 WHERE obj_description('public.acct'::regclass, 'pg_class') = 'fenced'") {
			t.Error("comment not set")
		}
		if !exists(t, "SELECT 1 FROM public.acct WHERE id = 1 AND note = 'none'") {
			t.Error("column not added")
		}
	})
}
