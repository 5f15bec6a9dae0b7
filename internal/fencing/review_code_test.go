package fencing_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review of 0589327 and a6d4b4a: stored code (DO blocks,
// functions, procedures) that writes through a path relation (mid: items
// follow it ON DELETE CASCADE) or changes a latent relation's rules (lv,
// lt, see ltBase); self-referencing keys and rows moved out of a
// partition; and over-refusals of ordinary work. The stale holder
// (fence.token 5) must not change items' rows (fence 9), read on a
// direct connection afterwards.

// rcLatent: zz is a latent view over items whose INSTEAD NOTHING rules
// are named so that no rule's name holds the view's.
const rcLatent = `
CREATE VIEW zz AS SELECT * FROM items;
CREATE RULE r_i AS ON INSERT TO zz DO INSTEAD NOTHING;
CREATE RULE r_u AS ON UPDATE TO zz DO INSTEAD NOTHING;
CREATE RULE r_d AS ON DELETE TO zz DO INSTEAD NOTHING;
`

// TestReviewCodeHeld: stored code spellings that name a path relation or
// a latent one through escapes, nested strings, format/quote_ident,
// dollar quotes in EXECUTE, SQL bodies, procedures, DO with LANGUAGE or
// comments, and a DO after an upsert in one Query. Refused; items
// unchanged. Holds.
func TestReviewCodeHeld(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	del := func(name string, stmts ...string) ltCase { return ltCase{name: name, stmts: stmts} }
	ltCheck(t, []ltCase{
		del("DO: E'' escape in EXECUTE", `DO $$BEGIN EXECUTE E'DELETE FROM mi\x64 WHERE id = 1'; END$$`),
		del("DO: octal escape through quote_ident in format", `DO $$BEGIN EXECUTE format('DELETE FROM %I WHERE id = 1', quote_ident(E'\155id')); END$$`),
		del("DO: format %I of an escaped name", `DO $$BEGIN EXECUTE format('DELETE FROM %I WHERE id = $1', E'mi\x64') USING 1; END$$`),
		del("DO: dollar-quoted string with unicode escape concatenated", `DO $$BEGIN EXECUTE $q$DELETE FROM $q$ || E'\u006did' || $q$ WHERE id = 1$q$; END$$`),
		del("DO: EXECUTE of a nested EXECUTE in a dollar-quoted string", `DO $$BEGIN EXECUTE E'DO $x$BEGIN EXECUTE $y$DELETE FROM m\x69d WHERE id = 1$y$; END$x$'; END$$`),
		del("DO: E'' string with doubled quotes nesting an E'' string", `DO $$BEGIN EXECUTE E'DO $x$BEGIN EXECUTE E''DELETE FROM m\\x69d WHERE id = 1''; END$x$'; END$$`),
		del("DO: variable assigned an escaped name", `DO $$DECLARE r text := E'\x6did'; BEGIN EXECUTE 'DELETE FROM ' || r || ' WHERE id = 1'; END$$`),
		del("DO with LANGUAGE clause", `DO LANGUAGE plpgsql $$BEGIN EXECUTE E'DELETE FROM mi\x64 WHERE id = 1'; END$$`),
		del("DO with LANGUAGE after the body", `DO $$BEGIN EXECUTE E'DELETE FROM mi\x64 WHERE id = 1'; END$$ LANGUAGE plpgsql`),
		del("DO with a block comment before the body", `DO /* x */ $$BEGIN EXECUTE E'DELETE FROM mi\x64 WHERE id = 1'; END$$`),
		del("DO with a line comment before the body", "DO -- x\n$$BEGIN EXECUTE E'DELETE FROM mi\\x64 WHERE id = 1'; END$$"),
		del("DO with an E'' body", `DO E'BEGIN EXECUTE ''DELETE FROM mi\\x64 WHERE id = 1''; END'`),
		del("DO with a U& body", `DO U&'BEGIN DELETE FROM mi\0064 WHERE id = 1; END'`),
		del("procedure with an escape, then CALL", `CREATE PROCEDURE p() LANGUAGE plpgsql AS $$BEGIN EXECUTE E'DELETE FROM mi\x64 WHERE id = 1'; END$$`, "CALL p()"),
		{name: "CREATE OR REPLACE of an existing harmless function", setup: "CREATE FUNCTION f0() RETURNS void LANGUAGE sql AS 'SELECT 1'",
			stmts: []string{`CREATE OR REPLACE FUNCTION f0() RETURNS void LANGUAGE plpgsql AS $$BEGIN EXECUTE E'DELETE FROM mi\x64 WHERE id = 1'; END$$`, "SELECT f0()"}},
		del("SQL function, BEGIN ATOMIC naming the path", `CREATE FUNCTION fa() RETURNS void LANGUAGE sql BEGIN ATOMIC DELETE FROM "mid" WHERE id = 1; END`, "SELECT fa()"),
		del("SQL function, string body with escape", `CREATE FUNCTION fs() RETURNS void LANGUAGE sql AS E'DELETE FROM mi\x64 WHERE id = 1'`, "SELECT fs()"),
		del("latent: DO drops rule, RULE and name escaped", `DO $$BEGIN EXECUTE E'DROP \x52ULE lv_d ON l\x76'; END$$`, "DELETE FROM lv WHERE id = 10"),
		del("latent: DO enables rule, escaped keyword", `DO $$BEGIN EXECUTE E'ALTER TABLE lt ENABLE \x52ULE lt_u'; END$$`, "UPDATE lt SET id = id WHERE id = 10"),
		{name: "latent: other rule names, escaped", setup: rcLatent, stmts: []string{`DO $$BEGIN EXECUTE E'DROP RULE r_d ON z\x7a'; END$$`, "DELETE FROM zz WHERE id = 10"}},
	})
	// A DO after an upsert in one Query (the upsert's DO NOTHING must
	// not hide the DO block); mode one-query sends it as it is.
	ltCheck(t, []ltCase{
		{name: "DO after an upsert in one Query", noTx: true, setup: "CREATE TABLE docs (id bigint PRIMARY KEY, body text)",
			stmts: []string{"INSERT INTO docs (id, body) VALUES (1, 'x') ON CONFLICT DO NOTHING;\nDO $$BEGIN EXECUTE E'DELETE FROM mi\\x64 WHERE id = 1'; END$$"}},
		{name: "DO after an upsert in one Query, no space", noTx: true, setup: "CREATE TABLE docs (id bigint PRIMARY KEY, body text)",
			stmts: []string{"INSERT INTO docs (id, body) VALUES (1, 'x') ON CONFLICT (id) DO UPDATE SET body = 'y';DO'BEGIN EXECUTE E''DELETE FROM mi\\x64 WHERE id = 1''; END'"}},
	})
}

// TestReviewCodeHoles: stored code that reaches items through mid, or
// opens a path through a latent relation, that the proxy relays. Each
// case is skipped ("HOLE: ..."); FENCEPROXY_REVIEW_HOLES=1 runs them.
func TestReviewCodeHoles(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	ltCheck(t, []ltCase{
		// SQL string continuation ('...' newline '...' is one string):
		// the text holds neither "mid", a backslash nor U&, so
		// IndirectSet.CheckCached does not parse it (codeCheck would
		// read the constant as "DELETE FROM mid ...").
		//   DO $$BEGIN EXECUTE 'DELETE FROM mi'
		//   'd WHERE id = 1'; END$$
		// deletes mid row 1 and so items row 10 (fence 9), in any mode.
		{name: "DO: string continuation spells the path", noTx: true,
			stmts: []string{"DO $$BEGIN EXECUTE 'DELETE FROM mi'\n'd WHERE id = 1'; END$$"}},
		//   CREATE FUNCTION fc() RETURNS void LANGUAGE sql AS 'DELETE FROM mi'
		//   'd WHERE id = 1';  SELECT fc();
		{name: "SQL function: continued body spells the path",
			stmts: []string{"CREATE FUNCTION fc() RETURNS void LANGUAGE sql AS 'DELETE FROM mi'\n'd WHERE id = 1'", "SELECT fc()"}},
		// The latent check runs only when the body holds RULE, TRIGGER,
		// RENAME or SCHEMA as a word, a backslash or U&: a keyword
		// spelled by continuation passes both gates (CheckCached, and
		// storedCodeHit's body words).
		//   BEGIN; DO $$BEGIN EXECUTE 'ALTER TABLE lt ENABLE RU'
		//   'LE lt_u'; END$$; UPDATE lt SET id = id WHERE id = 10; COMMIT;
		// (items row 10 deleted by lt's enabled rule)
		{name: "latent: DO enables rule, keyword by continuation",
			stmts: []string{"DO $$BEGIN EXECUTE 'ALTER TABLE lt ENABLE RU'\n'LE lt_u'; END$$", "UPDATE lt SET id = id WHERE id = 10"}},
		// The same with the keyword concatenated: the relation's name is
		// plain in the text, only the keyword is computed.
		//   BEGIN; DO $$BEGIN EXECUTE 'ALTER TABLE lt ENABLE ' || 'RU' ||
		//   'LE lt_u'; END$$; UPDATE lt SET id = id WHERE id = 10; COMMIT;
		{name: "latent: DO enables rule, keyword concatenated",
			stmts: []string{"DO $$BEGIN EXECUTE 'ALTER TABLE lt ENABLE ' || 'RU' || 'LE lt_u'; END$$", "UPDATE lt SET id = id WHERE id = 10"}},
		//   BEGIN; DO $$BEGIN EXECUTE 'DROP RULE r_d ON z'
		//   'z'; END$$; DELETE FROM zz WHERE id = 10; COMMIT;
		{name: "latent: DO drops rule, name by continuation", setup: rcLatent,
			stmts: []string{"DO $$BEGIN EXECUTE 'DROP RULE r_d ON z'\n'z'; END$$", "DELETE FROM zz WHERE id = 10"}},
	})
}

// TestReviewCodeScsOff: with standard_conforming_strings off the server
// reads \' as a quote inside '...', pg_query (always on) does not; the
// IndirectSet parses the text its own way and sees one SELECT of two
// constants where the server runs a DELETE through mid. Protected
// tables' statements with backslashes need the setting on (lexingRefusal),
// paths' do not. Simple protocol, one statement per Query (the SET must
// have run before the Query is lexed).
//
//	SET standard_conforming_strings = off;
//	SELECT 'a\', $$'; DELETE FROM mid WHERE id = 1; --$$
//
// deletes items row 10 (fence 9) by ON DELETE CASCADE.
func TestReviewCodeScsOff(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := fkProxy(t, fkRowRules)
	db, d := fkDB(t, specs, ltBase)
	c := ltSession(t, p, db)
	before := fkRows(t, d, fkItemsQ)
	errs := ltRun(t, c, "simple", []string{"SET standard_conforming_strings = off", `SELECT 'a\', $$'; DELETE FROM mid WHERE id = 1; --$$`}, true)
	after := fkRows(t, d, fkItemsQ)
	t.Logf("errors: %v", errs)
	if after != before {
		t.Errorf("items changed by the stale holder:\n before %s\n after  %s", before, after)
	}
}

// rcSelf: catalog shapes of 0589327 not in review_overrefusal_test.go:
// self-references through inheritance and sub-partitions, rows moved out
// of a sub-partition, by MERGE, through a view over an intermediate
// partition.
const rcMovedSub = ovHead + ovOrders + `
CREATE TABLE owner (id bigint, region int NOT NULL DEFAULT 1, sub int NOT NULL DEFAULT 1, PRIMARY KEY (id, region, sub)) PARTITION BY LIST (region);
CREATE TABLE owner_1 PARTITION OF owner FOR VALUES IN (1) PARTITION BY LIST (sub);
CREATE TABLE owner_2 PARTITION OF owner FOR VALUES IN (2);
CREATE TABLE owner_1_a PARTITION OF owner_1 FOR VALUES IN (1);
CREATE TABLE owner_1_b PARTITION OF owner_1 FOR VALUES IN (2);
ALTER TABLE owner_1_a ADD UNIQUE (id);
INSERT INTO owner (id) VALUES (1), (2);
CREATE VIEW owner_1_v AS SELECT * FROM owner_1;
CREATE TABLE src (id bigint);
INSERT INTO src VALUES (1);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES owner_1_a (id) ON DELETE CASCADE,
	last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, last_fence) VALUES (10, 2, 9), (20, 1, 9);
`

// rcSelfInherit: items' child table items_c references items_c itself
// (a tree inside an inheritance child of the protected table).
const rcSelfInherit = ovHead + ovOrders + `
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint, last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE items_c (PRIMARY KEY (id), FOREIGN KEY (order_id) REFERENCES items_c (id) ON DELETE CASCADE) INHERITS (items);
INSERT INTO items_c (id, order_id, last_fence) VALUES (10, NULL, 3), (20, 10, 9);
`

// rcSelfSubPart: the protected items, partitioned on two levels, reference
// themselves ON DELETE CASCADE.
const rcSelfSubPart = ovHead + ovOrders + `
CREATE TABLE items (id bigint, r int NOT NULL DEFAULT 1, order_id bigint, last_fence bigint NOT NULL DEFAULT 0, PRIMARY KEY (id, r)) PARTITION BY LIST (r);
CREATE TABLE items_1 PARTITION OF items FOR VALUES IN (1) PARTITION BY RANGE (id);
CREATE TABLE items_1_a PARTITION OF items_1 FOR VALUES FROM (0) TO (15);
CREATE TABLE items_1_b PARTITION OF items_1 FOR VALUES FROM (15) TO (100);
ALTER TABLE items_1_a ADD UNIQUE (id);
ALTER TABLE items_1_b ADD FOREIGN KEY (order_id) REFERENCES items_1_a (id) ON DELETE CASCADE;
INSERT INTO items (id, order_id, last_fence) VALUES (10, NULL, 3), (20, 10, 9);
`

// rcSelfUnprot: an unprotected tree t whose cascade deletes rows of a
// referenced key that items follow ON DELETE CASCADE (through t itself).
const rcSelfUnprot = ovHead + ovOrders + `
CREATE TABLE t (id bigint PRIMARY KEY, pid bigint REFERENCES t ON DELETE CASCADE);
INSERT INTO t VALUES (1, NULL), (2, 1);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES t ON DELETE CASCADE, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, last_fence) VALUES (20, 2, 9);
`

// TestReviewCodeCatalogHeld: refused, row 20 (fence 9) unchanged. Holds.
func TestReviewCodeCatalogHeld(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	c := func(name, base string, stmts ...string) ovCase {
		return ovCase{ltCase: ltCase{name: name, stmts: stmts}, base: base, rows: ovItem20Q}
	}
	ovRun(t, false, []ovCase{
		c("moved out of a sub-partition, via the root", rcMovedSub, "UPDATE owner SET region = 2 WHERE id = 1"),
		c("moved between sub-partitions, via the intermediate", rcMovedSub, "UPDATE owner_1 SET sub = 2 WHERE id = 1"),
		c("moved between sub-partitions, via a view over the intermediate", rcMovedSub, "UPDATE owner_1_v SET sub = 2 WHERE id = 1"),
		c("moved by MERGE", rcMovedSub, "MERGE INTO owner o USING src s ON o.id = s.id WHEN MATCHED THEN UPDATE SET region = 2"),
		c("moved by MERGE into the intermediate", rcMovedSub, "MERGE INTO owner_1 o USING src s ON o.id = s.id WHEN MATCHED THEN UPDATE SET sub = 2"),
		c("moved by an UPDATE in a CTE", rcMovedSub, "WITH m AS (UPDATE owner SET region = 2 WHERE id = 1 RETURNING 1) SELECT count(*) FROM m"),
		c("self-reference in an inheritance child of items, delete via parent", rcSelfInherit, "DELETE FROM items WHERE id = 10"),
		c("self-reference in an inheritance child of items, delete named", rcSelfInherit, "DELETE FROM items_c WHERE id = 10"),
		c("self-reference between sub-partitions of items", rcSelfSubPart, "DELETE FROM items WHERE id = 10"),
		c("self-reference between sub-partitions of items, intermediate named", rcSelfSubPart, "DELETE FROM items_1 WHERE id = 10"),
		c("unprotected tree cascading into items", rcSelfUnprot, "DELETE FROM t WHERE id = 1"),
	})
}

// rcDocs: an unrelated table of JSON documents.
const rcDocs = "CREATE TABLE docs (id bigint PRIMARY KEY, body text); CREATE TABLE orders_archive (id bigint PRIMARY KEY, note text)"

// TestReviewCodeOrdinary: ordinary work with backslashes and stored code
// that touches no path runs through the proxy. Holds, except the skipped
// over-refusals.
func TestReviewCodeOrdinary(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	big := "INSERT INTO docs (id, body) VALUES (3, '" + strings.Repeat(`{"todo": "do it\n", "p": "C:\\dir"} `, 30000) + "') ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body"
	ltOK(t, []ltCase{
		{name: "JSON upserts with backslashes", setup: rcDocs, noTx: true, stmts: []string{
			`INSERT INTO docs (id, body) VALUES (1, '{"a": "x\"y", "b": "line\nbreak"}') ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body`,
			`INSERT INTO docs (id, body) VALUES (1, '{"a": "what do you\\mean"}') ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body`,
			`INSERT INTO docs (id, body) VALUES (2, '{"q": "how do I\n"}') ON CONFLICT DO NOTHING`,
			`INSERT INTO docs (id, body) VALUES (4, E'{"fn": "function do() {\\n}"}') ON CONFLICT (id) DO /* c */ UPDATE SET body = EXCLUDED.body`,
		}},
		{name: "functions and DO with backslashes", setup: rcDocs, stmts: []string{
			`CREATE FUNCTION json_esc(t text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT replace(replace(t, '\', '\\'), '"', '\"') $$`,
			`CREATE OR REPLACE FUNCTION json_esc(t text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT replace(replace(t, E'\\', E'\\\\'), '"', '\"') $$`,
			`CREATE PROCEDURE archive_note(i bigint) LANGUAGE plpgsql AS $$BEGIN INSERT INTO orders_archive (id, note) VALUES (i, E'moved\n'); END$$`,
			`CALL archive_note(1)`,
			`DO $$BEGIN RAISE NOTICE E'done\n'; END$$`,
			`SELECT json_esc(E'a\\b')`,
		}},
		{name: "function with a backslash whose text holds a latent name as a word", setup: rcDocs, stmts: []string{
			`CREATE FUNCTION html_esc(t text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT replace(replace(t, '\', '&#92;'), '<', '&lt;') $$`,
		}, hole: "CREATE FUNCTION html_esc(t text) RETURNS text LANGUAGE sql AS $$ SELECT replace(replace(t, '\\', '&#92;'), '<', '&lt;') $$ is refused (stored code mentions public.lt, a latent table): with a backslash in the body the latent check runs, and mentionsWord finds lt as a word of the raw text, a string constant's"},
		// A statement larger than max_check_bytes that names no path
		// nor protected table, with a backslash and the word "do" in
		// its data: CheckCached sends it to check, which refuses it as
		// too large (docs: such statements are relayed whatever their
		// size).
		//   INSERT INTO docs (id, body) VALUES (3, '<1.1 MB of {"todo":
		//   "do it\n", ...}>') ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body
		{name: "bulk upsert larger than max_check_bytes with backslash and do", setup: rcDocs, noTx: true, stmts: []string{big}},
	})
}

// TestReviewCodeProtectedContinuation probes the protected table's own
// stored-code check with a string continuation (not these commits'
// code): DO $$BEGIN EXECUTE 'DELETE FROM ite'\n'ms WHERE id = 10'; END$$.
func TestReviewCodeProtectedContinuation(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	ltCheck(t, []ltCase{
		{name: "DO: continuation spells the protected table", noTx: true,
			stmts: []string{"DO $$BEGIN EXECUTE 'DELETE FROM ite'\n'ms WHERE id = 10'; END$$"}},
	})
}
