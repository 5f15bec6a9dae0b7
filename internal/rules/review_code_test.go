package rules_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// rcSet: mid is a path to items (ON DELETE CASCADE); lv a latent view,
// lt a latent table (a disabled rule).
func rcSet() *rules.IndirectSet {
	return rules.NewIndirectSet([]rules.Indirect{
		{Schema: "public", Name: "mid", Ops: []string{"DELETE", "MERGE", "TRUNCATE"}, Target: `public.items`, Via: "ON DELETE CASCADE"},
		{Schema: "public", Name: "lv", Target: "public.items", Via: "view with INSTEAD NOTHING rules", Latent: true},
		{Schema: "public", Name: "lt", Target: "public.items", Via: "disabled rule", Latent: true},
	})
}

type rcCase struct {
	name, sql string
	refuse    bool
	hole      string
}

func rcRun(t *testing.T, cases []rcCase) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.hole != "" {
				t.Skip(c.hole)
			}
			s := rcSet()
			e := s.Check(c.sql)
			if (e != nil) != c.refuse {
				t.Errorf("Check(%q) = %v, want refuse %v", c.sql, e, c.refuse)
			}
		})
	}
}

// TestReviewCodeUnit: the stored-code check of path (mid) and latent
// (lv, lt) relations. Holds, except the skipped holes.
func TestReviewCodeUnit(t *testing.T) {
	rcRun(t, []rcCase{
		{name: "E escape", sql: `DO $$BEGIN EXECUTE E'DELETE FROM mi\x64'; END$$`, refuse: true},
		{name: "format of escaped name", sql: `DO $$BEGIN EXECUTE format('DELETE FROM %I WHERE id = 1', E'mi\x64'); END$$`, refuse: true},
		{name: "quote_ident of octal escape", sql: `DO $$BEGIN EXECUTE format('DELETE FROM %I', quote_ident(E'\155id')); END$$`, refuse: true},
		{name: "dollar quote and unicode escape", sql: `DO $$BEGIN EXECUTE $q$DELETE FROM $q$ || E'\u006did'; END$$`, refuse: true},
		{name: "dollar quote inside escaped EXECUTE", sql: `DO $$BEGIN EXECUTE E'EXECUTE $x$DELETE FROM m\x69d$x$'; END$$`, refuse: true},
		{name: "procedure", sql: `CREATE PROCEDURE p() LANGUAGE plpgsql AS $$BEGIN EXECUTE E'DELETE FROM mi\x64'; END$$`, refuse: true},
		{name: "create or replace", sql: `CREATE OR REPLACE FUNCTION f() RETURNS void LANGUAGE plpgsql AS $$BEGIN EXECUTE E'DELETE FROM mi\x64'; END$$`, refuse: true},
		{name: "begin atomic", sql: `CREATE FUNCTION f() RETURNS void LANGUAGE sql BEGIN ATOMIC SELECT E'DELETE FROM mi\x64'; END`, refuse: true},
		{name: "DO LANGUAGE", sql: `DO LANGUAGE plpgsql $$BEGIN EXECUTE E'DELETE FROM mi\x64'; END$$`, refuse: true},
		{name: "DO comment", sql: `DO /* c */ $$BEGIN EXECUTE E'DELETE FROM mi\x64'; END$$`, refuse: true},
		{name: "DO line comment", sql: "DO -- c\n $$BEGIN EXECUTE E'DELETE FROM mi\\x64'; END$$", refuse: true},
		{name: "DO form feed", sql: "DO\f$$BEGIN EXECUTE E'DELETE FROM mi\\x64'; END$$", refuse: true},
		{name: "DO after upsert", sql: `INSERT INTO t (a) VALUES ('x') ON CONFLICT DO NOTHING; DO $$BEGIN EXECUTE E'DELETE FROM mi\x64'; END$$`, refuse: true},
		{name: "latent escaped", sql: `DO $$BEGIN EXECUTE E'DROP \x52ULE r1 ON l\x76'; END$$`, refuse: true},
		{name: "json upsert", sql: `INSERT INTO docs (id, body) VALUES (1, '{"a":"x\"y do it"}') ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body`},
		{name: "plain function with backslash", sql: `CREATE FUNCTION e(t text) RETURNS text LANGUAGE sql AS $$ SELECT replace(t, '\', '\\') $$`},
		{name: "continuation spells path", sql: "DO $$BEGIN EXECUTE 'DELETE FROM mi'\n'd WHERE id = 1'; END$$", refuse: true},
		{name: "continuation spells path, SQL body", sql: "CREATE FUNCTION f() RETURNS void LANGUAGE sql AS 'DELETE FROM mi'\n'd WHERE id = 1'", refuse: true},
		{name: "continuation spells RULE", sql: "DO $$BEGIN EXECUTE 'ALTER TABLE lt ENABLE RU'\n'LE lt_u'; END$$", refuse: true},
		{name: "continuation spells RULE, parsed", sql: "DO $$BEGIN EXECUTE 'ALTER TABLE lt ENABLE RU'\n'LE lt_u'; END$$ -- rule", refuse: true},
		{name: "concatenated RULE", sql: "DO $$BEGIN EXECUTE 'ALTER TABLE lt ENABLE ' || 'RU' || 'LE lt_u'; END$$", refuse: true},
		{name: "continuation spells latent name", sql: "DO $$BEGIN EXECUTE 'DROP RULE r1 ON l'\n'v'; END$$", refuse: true},
		// The standard_conforming_strings off split is LexingRefusal's
		// (TestIndirectLexingRefusal): Check reads the text as the parser does.
	})
}

// TestReviewCodeParseCost: which statements CheckCached cannot answer
// without a parse (false: IndirectSet.check parses them, once per
// distinct text, cached up to 1024 texts). A statement naming no path nor
// latent relation pays a parse when it may create stored code: the words
// CREATE and FUNCTION or PROCEDURE, or DO followed by a string constant
// or LANGUAGE (string data included: 'C:\Program Files\do').
func TestReviewCodeParseCost(t *testing.T) {
	s := rcSet()
	for _, c := range []struct {
		sql   string
		parse bool
	}{
		{`INSERT INTO docs (id, body) VALUES (1, '{"a":"b\"c"}') ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body`, false},
		{`INSERT INTO docs (id, body) VALUES (1, '{"a":"b\"c"}') ON CONFLICT DO NOTHING`, false},
		{`INSERT INTO docs (id, body) VALUES (1, '{"a":"b\"c"}')`, false},
		// the word "do" in the data
		{`INSERT INTO docs (id, body) VALUES (1, '{"q":"what do you mean\n"}')`, false},
		{`INSERT INTO docs (id, body) VALUES (1, '{"todo":"x\n"}')`, false},
		{`UPDATE docs SET body = '{"fn":"function f() {}\n"}' WHERE id = 1`, false},
		{`INSERT INTO docs (id, body) VALUES (1, '{"a":"b\"c"}') ON CONFLICT (id) DO /* c */ UPDATE SET body = EXCLUDED.body`, false},
		{`INSERT INTO docs (id, body) VALUES (1, '{"a":"b\"c"}') ON CONFLICT (id) DO` + "\f" + `UPDATE SET body = EXCLUDED.body`, false},
		{`SELECT * FROM docs WHERE body LIKE '%do\_it%'`, false},
		{`SELECT * FROM docs WHERE path = 'C:\Program Files\do'`, true},
		{`CREATE FUNCTION e(t text) RETURNS text LANGUAGE sql AS $$ SELECT replace(t, '\', '/') $$`, true},
		{`SELECT * FROM docs WHERE body = 'R&D'`, false},
		// stored code is parsed, backslash or not
		{`CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1'`, true},
		{`DO 'BEGIN NULL; END'`, true},
		{`SELECT * FROM docs WHERE body = 'YOU&ME'`, true}, // "u&", as before
	} {
		_, ok := s.CheckCached(c.sql)
		if ok == c.parse {
			t.Errorf("CheckCached(%q): answered without parse %v, want parse %v", c.sql, ok, c.parse)
		}
	}
}
