package rules_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestReadersDecide: with a database's readers, DecideFor registers the
// session's lock before every statement that reads through one, as it
// does for a statement that names the table, and only for tables lock
// fencing applies to in the session's set.
func TestReadersDecide(t *testing.T) {
	r := mustCompile(t, rules.Config{CacheSize: rules.DefaultCacheSize, Tables: []rules.Table{
		{Table: "public.acct"},
		{Table: "public.jobs", Lock: rules.LockRequired},
		{Table: "public.notes", Lock: rules.LockOff},
		{Table: "public.aud", Mode: rules.ModeAudit},
	}})
	readers := rules.NewReaders([]rules.Reader{
		{Schema: "public", Name: "acct_v", Target: "public.acct"},
		{Schema: "public", Name: "jobs_parent", Target: "public.jobs"},
		{Schema: "public", Name: "notes_v", Target: "public.notes"}, // lock: off
		{Schema: "s", Name: "aud_v", Target: "public.aud"},
		{Schema: "public", Name: "read_jobs", Target: "public.jobs", Function: true},
		{Schema: "public", Name: "mv", Target: "public.acct", Refresh: true},
		{Schema: "public", Name: "trg_jobs", Target: "public.jobs", Maybe: true},
	})
	s := rules.Session{Lexing: utf8, Readers: readers}
	for _, c := range []struct {
		sql      string
		action   rules.Action
		calls    []int // nil: no registration
		required bool
		audit    bool
	}{
		{"SELECT * FROM acct_v WHERE id = 1", rules.Forward, []int{0}, false, false},
		{"SELECT * FROM public.acct_v", rules.Forward, []int{0}, false, false},
		{"SELECT * FROM other.acct_v", rules.Forward, nil, false, false}, // another schema's relation
		{"select n from (select * from ACCT_V) x", rules.Forward, []int{0}, false, false},
		{`SELECT * FROM "acct_v"`, rules.Forward, []int{0}, false, false},
		{"SELECT * FROM jobs_parent", rules.Forward, []int{0}, true, false},
		{"SELECT * FROM notes_v", rules.Forward, nil, false, false},
		{"SELECT * FROM s.aud_v", rules.Forward, []int{0}, false, true},
		{"SELECT 'acct_v'", rules.Forward, nil, false, false}, // the name in a string only
		{"SELECT 1; SELECT * FROM acct_v; SELECT 2; TABLE jobs_parent", rules.Forward, []int{1, 4}, true, false},
		// Also where the rules register already: each statement that
		// reads through a reader gets its registration.
		{"SELECT * FROM public.acct; SELECT * FROM acct_v", rules.Forward, []int{0, 2}, false, false},
		// A rewrite of a row-fenced table that reads through a reader.
		{"UPDATE public.acct SET n = (SELECT max(n) FROM jobs_parent) WHERE id = 1", rules.Rewrite, []int{0}, true, false},
		{"COPY (SELECT * FROM acct_v) TO STDOUT", rules.Forward, []int{0}, false, false},
		// A function that may read jobs (lock: required) registers, but
		// does not require a lock.
		{"SELECT read_jobs()", rules.Forward, []int{0}, false, false},
		{"SELECT * FROM public.read_jobs() AS x(n)", rules.Forward, []int{0}, false, false},
		{"SELECT n FROM plain WHERE n < read_jobs()", rules.Forward, []int{0}, false, false},
		{"SELECT other.read_jobs()", rules.Forward, nil, false, false},
		{"SELECT * FROM read_jobs", rules.Forward, nil, false, false}, // a relation of that name
		{"SELECT read_jobs(); SELECT * FROM jobs_parent", rules.Forward, []int{0, 2}, true, false},
		// A procedure the readers list (one whose body names jobs) is
		// run by CALL: it registers, as the function does; so does a
		// CALL whose arguments read a table. Another procedure does not.
		{"CALL read_jobs()", rules.Forward, []int{0}, false, false},
		{"call public.READ_JOBS(1, 'x')", rules.Forward, []int{0}, false, false},
		{"SELECT 1; CALL read_jobs()", rules.Forward, []int{1}, false, false},
		{"CALL other.read_jobs()", rules.Forward, nil, false, false},
		{"CALL unlisted(1)", rules.Forward, nil, false, false},
		{"CALL unlisted((SELECT max(n) FROM jobs_parent))", rules.Forward, []int{0}, true, false},
		{"CALL unlisted((SELECT max(n) FROM public.acct))", rules.Forward, []int{0}, false, false},
		// A materialized view's refresh reads acct; a read of it does not.
		{"REFRESH MATERIALIZED VIEW mv", rules.Forward, []int{0}, false, false},
		{"REFRESH MATERIALIZED VIEW CONCURRENTLY public.mv WITH DATA", rules.Forward, []int{0}, false, false},
		{"SELECT * FROM mv", rules.Forward, nil, false, false},
		// A relation that may read jobs (its trigger, say): registers,
		// not required.
		{"INSERT INTO trg_jobs VALUES (1)", rules.Forward, []int{0}, false, false},
	} {
		d, final, ok := r.DecideFor(s, c.sql)
		if !ok || final {
			t.Errorf("%q: ok %v final %v", c.sql, ok, final)
			continue
		}
		if d.Action != c.action {
			t.Errorf("%q: action %v, want %v (%+v)", c.sql, d.Action, c.action, d.Err)
			continue
		}
		if !checkLockCall(t, c.sql, d, c.calls, c.required) {
			continue
		}
		if d.Lock.Audit != c.audit {
			t.Errorf("%q: audit %v, want %v", c.sql, d.Lock.Audit, c.audit)
		}
		// The quick decision finds it in the cache now.
		q := s
		q.Quick = true
		if dq, _, ok := r.DecideFor(q, c.sql); !ok || dq.Lock == nil || dq.Lock.Query != d.Lock.Query {
			t.Errorf("%q: quick decision %v %+v", c.sql, ok, dq.Lock)
		}
	}

	// Without readers, nothing registers for them; a session whose set
	// has no lock fencing ignores them.
	if d, _, _ := r.DecideFor(rules.Session{Lexing: utf8}, "SELECT * FROM acct_v"); d.Lock != nil {
		t.Errorf("no readers: %+v", d.Lock)
	}
	rowOnly := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: "public.acct", Lock: rules.LockOff}}})
	if d, _, _ := rowOnly.DecideFor(s, "SELECT * FROM acct_v"); d.Lock != nil {
		t.Errorf("row fencing only: %+v", d.Lock)
	}

	// A reload (another root) does not reuse the verdicts of the one
	// before, with or without a cache of its own.
	for _, size := range []int{rules.DefaultCacheSize, 0} {
		off := mustCompile(t, rules.Config{CacheSize: size, Tables: []rules.Table{{Table: "public.acct", Lock: rules.LockOff}, {Table: "public.jobs"}}})
		if d, _, _ := off.DecideFor(s, "SELECT * FROM acct_v WHERE id = 1"); d.Lock != nil {
			t.Errorf("cache %d: acct's lock turned off on reload: %+v", size, d.Lock)
		}
		if d, _, _ := off.DecideFor(s, "SELECT * FROM jobs_parent"); d.Lock == nil || d.Lock.Required {
			t.Errorf("cache %d: jobs optional on reload: %+v", size, d.Lock)
		}
	}

	// PREPARE: the registration is for EXECUTE.
	d, _, _ := r.DecideFor(s, "PREPARE p AS SELECT * FROM acct_v")
	if d.Lock == nil || len(d.Lock.Calls) != 0 || d.Lock.Call == "" {
		t.Errorf("PREPARE: %+v", d.Lock)
	}

	// A quick decision of a text not yet decided with the readers asks for
	// the full one.
	q := s
	q.Quick = true
	if _, _, ok := r.DecideFor(q, "SELECT id FROM acct_v WHERE id = 99"); ok {
		t.Error("quick decision of an undecided read through a reader: ok")
	}

	// The server may read a text with backslashes otherwise: refused, as
	// for the table itself.
	off := s
	off.Lexing = rules.Lexing{ClientEncoding: "UTF8", Backslash: true}
	if d, final, _ := r.DecideFor(off, `SELECT 'a\' FROM acct_v`); d.Action != rules.Refuse || !final {
		t.Errorf("backslash with standard_conforming_strings off: %+v final %v", d, final)
	}
	// A Unicode escape may spell a reader's name.
	if d, _, _ := r.DecideFor(s, `SELECT * FROM U&"acct\005fv"`); d.Lock == nil {
		t.Errorf("Unicode escape: no registration (%+v)", d)
	}
}

// TestReadersCode: DDL that creates what reads through a reader is
// forwarded (the proxy learns it from the catalog once it commits); a DO
// block that names one runs now and registers, without requiring a
// lock; operators and attribute notation run functions.
func TestReadersCode(t *testing.T) {
	r := mustCompile(t, rules.Config{CacheSize: rules.DefaultCacheSize, Tables: []rules.Table{
		{Table: "public.acct", Lock: rules.LockRequired},
		{Table: "public.notes", Lock: rules.LockOff},
	}})
	s := rules.Session{Lexing: utf8, Readers: rules.NewReaders([]rules.Reader{
		{Schema: "public", Name: "acct_v", Target: "public.acct"},
		{Schema: "pg_temp_3", Name: "tv", Target: "public.acct"},
		{Schema: "public", Name: "read_acct", Target: "public.acct", Function: true, Maybe: true},
		{Schema: "public", Name: "###", Target: "public.acct", Function: true, Maybe: true},
		{Schema: "public", Name: "notes_v", Target: "public.notes"},
		{Schema: "public", Name: "the view", Target: "public.acct"},
	})}
	for _, c := range []struct {
		sql      string
		register bool
	}{
		{"CREATE VIEW w AS SELECT * FROM acct_v", false},
		{"CREATE FUNCTION f() RETURNS bigint LANGUAGE sql AS $$SELECT count(*) FROM acct_v$$", false},
		{"CREATE TRIGGER t AFTER INSERT ON plain FOR EACH ROW EXECUTE FUNCTION read_acct()", false},
		{"DO $$BEGIN PERFORM * FROM acct_v; END$$", true},
		{"DO $$BEGIN PERFORM read_acct(); END$$", true},
		{`DO $$BEGIN EXECUTE E'SELECT * FROM acct\x5fv'; END$$`, true},
		{"DO $$BEGIN PERFORM * FROM notes_v; END$$", false}, // notes has no lock fencing
		{"DO $$BEGIN PERFORM 1; END$$", false},
		{`DO $$BEGIN PERFORM * FROM "the view"; END$$`, true},
		{`DO $$BEGIN PERFORM * FROM "the other view"; END$$`, false},
		{"SELECT 3::bigint ### 0::bigint", true},
		{"SELECT 3::bigint OPERATOR(public.###) 0::bigint", true},
		{"SELECT p.read_acct FROM plain p", true},
		{"SELECT * FROM pg_temp.tv", true},
	} {
		d, _, _ := r.DecideFor(s, c.sql)
		if d.Action == rules.Refuse {
			t.Errorf("%q: refused: %v", c.sql, d.Err)
			continue
		}
		if (d.Lock != nil) != c.register {
			t.Errorf("%q: registration %+v, want %v", c.sql, d.Lock, c.register)
			continue
		}
		if d.Lock != nil && d.Lock.Required != (c.sql == "SELECT * FROM pg_temp.tv") {
			t.Errorf("%q: required %v", c.sql, d.Lock.Required)
		}
	}
}

// TestOtherPositions: pg_query 6 records positions in fields other than
// location (a DefElem's argument, NOTIFY's payload); a statement holding
// one after an inserted registration or fence was refused as not proven
// ("could not be inserted faithfully").
func TestOtherPositions(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: "public.items"}}})
	for _, c := range []struct {
		sql    string
		action rules.Action
	}{
		{"SELECT * FROM items; NOTIFY ch, 'x'", rules.Forward},
		{"UPDATE items SET n = 1 WHERE id = 1; NOTIFY ch, 'x'", rules.Rewrite},
		{"SELECT 1; SELECT * FROM items; DO $$BEGIN PERFORM 1; END$$", rules.Forward},
		{"SELECT * FROM items; CREATE TABLE t (id int) WITH (fillfactor = 70)", rules.Forward},
	} {
		if d := r.Decide(c.sql); d.Action != c.action {
			t.Errorf("%q: %v, want %v (%v)", c.sql, d.Action, c.action, d.Err)
		}
	}
	s := rules.Session{Lexing: utf8, Readers: rules.NewReaders([]rules.Reader{{Schema: "public", Name: "items_v", Target: "public.items"}})}
	if d, _, _ := r.DecideFor(s, "SELECT 1; DO $$BEGIN PERFORM * FROM items_v; END$$"); d.Lock == nil || len(d.Lock.Calls) != 1 || d.Lock.Calls[0] != 1 {
		t.Errorf("DO naming a reader after a statement: %+v %v", d.Lock, d.Err)
	}
}

// TestReadersEndsTx: a statement that registers and may end its
// transaction from stored code reaching a lock-fenced table is marked
// (LockCall.EndsTx): a CALL of a procedure the readers mark EndsTx, a DO
// block in PL/pgSQL whose code may commit (sqllex.MayEndTx), a DO block
// in another language. Other statements that register are not, nor a
// CALL of such a procedure whose only table is not lock-fenced.
func TestReadersEndsTx(t *testing.T) {
	r := mustCompile(t, rules.Config{CacheSize: rules.DefaultCacheSize, Tables: []rules.Table{
		{Table: "public.acct"},
		{Table: "public.notes", Lock: rules.LockOff},
	}})
	readers := rules.NewReaders([]rules.Reader{
		{Schema: "public", Name: "batch", Target: "public.acct", Function: true, EndsTx: true},
		{Schema: "public", Name: "bump", Target: "public.acct", Function: true},
		{Schema: "public", Name: "notes_batch", Target: "public.notes", Function: true, EndsTx: true},
		{Schema: "public", Name: "acct_v", Target: "public.acct"},
	})
	s := rules.Session{Lexing: utf8, Readers: readers}
	for _, c := range []struct {
		sql    string
		lock   bool // registers
		endsTx bool
	}{
		{"CALL batch(1)", true, true},
		{"call public.BATCH()", true, true},
		{"CALL other.batch()", false, false},
		{"CALL bump(1)", true, false},
		{"SELECT 1; CALL batch(1)", true, true},
		{"CALL notes_batch()", false, false},
		{"SELECT batch()", true, false}, // a function call cannot commit
		{"DO $$BEGIN UPDATE acct_v SET n = 1; COMMIT; END$$", true, true},
		{"DO $$BEGIN PERFORM 1 FROM acct_v; CALL x(); END$$", true, true},
		{"DO $$BEGIN UPDATE acct_v SET n = 1; END$$", true, false},
		{"DO $$BEGIN COMMIT; END$$", false, false}, // reaches no lock-fenced table
		{"DO LANGUAGE plpgsql $$BEGIN UPDATE acct_v SET n = 1; END$$", true, false},
		// In another language the code may compute what it calls.
		{"DO LANGUAGE plpython3u $$plpy.execute('UPDATE acct_v SET n = 1'); getattr(plpy, 'com' + 'mit')()$$", true, true},
		{"DO $$spi_exec_query('UPDATE acct_v SET n = 1'); spi_commit();$$ LANGUAGE plperl", true, true},
		{"SELECT * FROM acct_v", true, false},
		// Functions that run SQL text, or read tables by name, register
		// whatever the text (its names may be computed).
		{"SELECT query_to_xml('SELECT bu' || 'mp(1)', false, false, '')", true, false},
		{"SELECT pg_catalog.table_to_xml('acct', false, false, '')", true, false},
		{"SELECT * FROM ts_stat('SELECT 1')", true, false},
		{"SELECT other.query_to_xml('SELECT 1', false, false, '')", false, false},
	} {
		d, _, ok := r.DecideFor(s, c.sql)
		if !ok {
			t.Errorf("%q: not decided", c.sql)
			continue
		}
		if got := d.Lock != nil && len(d.Lock.Calls) > 0; got != c.lock {
			t.Errorf("%q: registers %v, want %v (%+v)", c.sql, got, c.lock, d.Lock)
			continue
		}
		if got := d.Lock != nil && d.Lock.EndsTx; got != c.endsTx {
			t.Errorf("%q: EndsTx %v, want %v", c.sql, got, c.endsTx)
		}
	}
}
