package fencing_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Second adversarial review of reads through readers (0fd0823..33f5e5b):
// functions, Maybe readers (rules, policies, triggers, defaults), REFRESH
// MATERIALIZED VIEW, the DDL refusals and followCatalog. Property, as in
// review_readers_test.go: once the newer holder (42) has read acct
// through one of these via the proxy, the stale holder (41, registered
// before) is refused with FP001 and acct is unchanged (rrRound, rrJudge).
// A case that shows a documented hole skips with "HOLE:" (one mended
// since fails), an over-refusal with "OVER-REFUSAL:", a statement broken
// by the proxy with "BREAKAGE:".
//
// Found, and what became of it:
//   - mended: operators, aggregates, attribute notation (p.f), argument
//     and domain defaults, function bodies naming a reader whose name is
//     not one word ("the view"), acct through a Unicode escape, a
//     spelling the server truncates, a rule's WHERE and a trigger's WHEN;
//   - documented limits: casts, an event trigger, CALL's arguments; DDL
//     through the proxy read through before the proxy has learned of it
//     (a function, a default, a view, a rename);
//   - the over-refusals came from the refusal of DDL and code that names
//     a reader through the proxy, since withdrawn: the cases now run.
// Held: lock: required only for surely-reading relations, CALL with
// COMMIT, REFRESH ... CONCURRENTLY, cursors WITH HOLD, set-returning
// functions, pipelines, COPY FROM into a Maybe table, followCatalog for
// prepared statements.

// r2Schema: stored objects, created on a direct connection (so the proxy
// learns them from the catalog), through which a statement reads acct
// without naming acct or a function whose body names it.
var r2Schema = `
CREATE FUNCTION acct_payload(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = $1$$;
CREATE FUNCTION acct_rows() RETURNS TABLE (id bigint, payload text) LANGUAGE sql STABLE AS $$SELECT id, payload FROM acct$$;

-- An operator whose function reads acct.
CREATE FUNCTION acct_peek_op(bigint, bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = $1$$;
CREATE OPERATOR ### (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = acct_peek_op);

-- An aggregate whose transition function reads acct.
CREATE FUNCTION acct_sfunc(text, bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT coalesce($1, '') || (SELECT payload FROM acct WHERE id = $2)$$;
CREATE AGGREGATE peek_agg(bigint) (SFUNC = acct_sfunc, STYPE = text);

-- A cast whose function reads acct.
CREATE TYPE peekt AS (v text);
CREATE FUNCTION to_peekt(bigint) RETURNS peekt LANGUAGE sql STABLE AS $$SELECT ROW(payload)::peekt FROM acct WHERE id = $1$$;
CREATE CAST (bigint AS peekt) WITH FUNCTION to_peekt(bigint);

-- A function called in attribute notation (p.plain_peek).
CREATE FUNCTION plain_peek(plain) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = 3$$;

-- A function whose argument's default calls a reader function.
CREATE FUNCTION with_default(x text DEFAULT acct_payload(3)) RETURNS text LANGUAGE sql STABLE AS $$SELECT x$$;

-- A domain whose default calls a reader function, and a table using it.
CREATE DOMAIN snapd AS text DEFAULT acct_payload(3);
CREATE TABLE snaps (id int, v snapd);

-- Bodies that name a reader, or acct, other than as the word of its name.
CREATE VIEW "the view" AS SELECT id, payload FROM acct WHERE id > 0 GROUP BY id, payload;
CREATE FUNCTION peek_spaced() RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM "the view" WHERE id = 3$$;
CREATE FUNCTION peek_uesc() RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM U&"\0061cct" WHERE id = 3$$;
CREATE FUNCTION peek_long() RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM ` + rrLong + `_and_more WHERE id = 3$$;

-- A rule whose condition (not its action) reads acct.
CREATE TABLE gate (id int PRIMARY KEY, v int);
INSERT INTO gate VALUES (1, 0);
CREATE RULE gate_r AS ON UPDATE TO gate WHERE (SELECT payload FROM acct WHERE id = 3) = 'c' DO INSTEAD NOTHING;

-- A trigger whose WHEN clause (not its function) reads acct.
CREATE FUNCTION acct_is_c(bigint) RETURNS bool LANGUAGE sql STABLE AS $$SELECT payload = 'c' FROM acct WHERE id = $1$$;
CREATE FUNCTION skip_row() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NULL; END$$;
CREATE TABLE wtab (id bigint);
CREATE TRIGGER wtab_t BEFORE INSERT ON wtab FOR EACH ROW WHEN (acct_is_c(NEW.id)) EXECUTE FUNCTION skip_row();

-- A procedure that echoes its argument.
CREATE PROCEDURE echo(INOUT x text) LANGUAGE plpgsql AS $$BEGIN END$$;

-- A table whose trigger reads acct (a Maybe reader), and one whose column
-- default calls a reader function.
CREATE TABLE tlog (id bigint, payload text);
CREATE FUNCTION tlog_fill() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN NEW.payload := (SELECT payload FROM acct WHERE id = 3); RETURN NEW; END$$;
CREATE TRIGGER tlog_t BEFORE INSERT ON tlog FOR EACH ROW EXECUTE FUNCTION tlog_fill();
CREATE TABLE dflt (id bigint, v text DEFAULT acct_payload(3));

-- A function calling helper_fn, which does not exist yet, and a reader
-- function that can be renamed to it.
CREATE FUNCTION caller() RETURNS text LANGUAGE plpgsql STABLE AS $$BEGIN RETURN helper_fn(3); END$$;
CREATE FUNCTION acct_payload2(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = $1$$;

-- A materialized view over a reader function (a Maybe refresh).
CREATE MATERIALIZED VIEW mvf AS SELECT acct_payload(3) AS payload WITH NO DATA;
`

// r2Retry is what a stale holder does after a refusal of the catalog
// check (FP003, "changed since the proxy checked it": DDL moved the
// stamp): it retries its UPDATE, for up to 5 seconds. r is updated with
// the outcome; acct is restored where it changed.
func r2Retry(t *testing.T, d, stale *pgx.Conn, r *rrResult) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); isCatalogCheck(r.staleErr) && !r.changed && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		before := tableText(t, d, "acct")
		_, r.staleErr = stale.Exec(ctxT(t), "UPDATE acct SET payload = 'stale' WHERE id = $1", 3)
		if after := tableText(t, d, "acct"); after != before {
			r.changed, r.diff = true, "\n before "+before+"\n after  "+after+" (after retrying the catalog check's FP003)"
			execDirect(t, d, "UPDATE acct SET payload = 'c' WHERE id = 3")
		}
	}
}

// TestReviewReaders2Holes: reads of acct through stored objects the
// readers may miss, and through DDL that the proxy lets through, by a
// newer holder whose only statements are these.
func TestReviewReaders2Holes(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rr2holes")
	execDirect(t, d, rrViews+r2Schema)
	stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
	rrSeen(t, p, db, d)
	cases := []struct {
		name, sql string
		note      string // where a hole is documented or its cause
	}{
		// Held (controls).
		{"function call", "SELECT acct_payload(3)", ""},
		{"set-returning function in FROM", "SELECT payload FROM acct_rows() WHERE id = 3", ""},
		{"Maybe: insert into a table whose trigger reads acct", "INSERT INTO tlog (id) VALUES (1) RETURNING payload", ""},
		{"Maybe: insert into a table whose default calls a reader function", "INSERT INTO dflt (id) VALUES (1) RETURNING v", ""},
		{"Maybe: REFRESH of a materialized view over a reader function", "REFRESH MATERIALIZED VIEW mvf; SELECT payload FROM mvf", ""},

		// Mended after this review: calls that name no reader function,
		// bodies the word scan misread, what only some statements
		// evaluate. A case that shows the hole again fails.
		{"operator whose function reads acct", "SELECT 3::bigint ### 0::bigint", ""},
		{"aggregate whose transition function reads acct", "SELECT peek_agg(3::bigint)", ""},
		{"function in attribute notation", "SELECT p.plain_peek FROM plain p WHERE p.id = 1", ""},
		{"argument default calling a reader function", "SELECT with_default()", ""},
		{"domain default calling a reader function", "INSERT INTO snaps (id) VALUES (1) RETURNING v", ""},
		{"body names a reader whose name is not one word", "SELECT peek_spaced()", ""},
		{"body names acct with a Unicode escape", "SELECT peek_uesc()", ""},
		{"body names a reader by a spelling the server truncates", "SELECT peek_long()", ""},
		{"rule condition reads acct", "UPDATE gate SET v = v + 1 WHERE id = 1", ""},
		{"trigger WHEN clause calls a reader function", "INSERT INTO wtab VALUES (3)", ""},

		// Documented limits (clients.md, design.md, protecting-tables.md).
		{"cast whose function reads acct", "SELECT ((3::bigint)::peekt).v",
			"casts' functions (pg_cast.castfunc) are not followed"},
		{"CALL whose argument calls a reader function", "CALL echo(acct_payload(3))",
			"CALL registers nothing, nor do its arguments (a registration in front would keep a procedure from committing)"},
		// DDL through the proxy, forwarded, then a read at once: the
		// proxy learns the new reader only once the change has committed
		// and its notification has been followed.
		{"function named like a reader view, created and called", "CREATE FUNCTION exists_v() RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM public.exists_v$$; SELECT exists_v()",
			"a function created through the proxy and called before the proxy has learned of it"},
		{"function in another schema named like a reader function", "CREATE FUNCTION s.acct_payload(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT public.acct_payload($1)$$; SELECT s.acct_payload(3)",
			"a function created through the proxy and called before the proxy has learned of it"},
		{"ALTER TABLE ADD COLUMN DEFAULT a reader function", "ALTER TABLE plain ADD COLUMN snap text DEFAULT acct_payload(3); SELECT snap FROM plain WHERE id = 1",
			"a default added through the proxy and read before the proxy has learned of it (ALTER TABLE is no data statement)"},
		{"view over a Maybe table (trigger), written through at once", "CREATE TEMP VIEW tlv AS SELECT * FROM tlog; INSERT INTO tlv (id) VALUES (2) RETURNING payload",
			"a view created through the proxy and written through before the proxy has learned of it"},
		{"reader function renamed to a name stored code calls", "ALTER FUNCTION acct_payload2(bigint) RENAME TO helper_fn; SELECT caller()",
			"a rename through the proxy, before the proxy has learned of it"},
	}
	for _, k := range cases {
		t.Run(k.name, func(t *testing.T) {
			var rows []string
			r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol, func(c *pgx.Conn) error {
				res, err := c.PgConn().Exec(ctxT(t), k.sql).ReadAll()
				for _, x := range res {
					rows = append(rows, fmt.Sprintf("%s %q", x.CommandTag, x.Rows))
				}
				// DDL in the read moves the catalog stamp, and the stale
				// UPDATE would fail for that (FP003, "changed since the
				// proxy checked it") until the proxy has read the catalog
				// again, then run: wait for that first.
				return err
			})
			r2Retry(t, d, stale, &r)
			t.Logf("results: %v", rows)
			if rvCode(r.readErr) == "FP003" && r.mark == 41 && !r.changed {
				t.Logf("refused: %v", r.readErr)
				return
			}
			if r.readErr == nil && r.mark != 42 && r.changed && k.note != "" {
				t.Skipf("HOLE: %s: %s read acct (results %v), registered nothing (watermark %d), and the stale UPDATE landed (%v). Cause: %s",
					k.name, k.sql, rows, r.mark, r.staleErr, k.note)
			}
			rrJudge(t, k.sql, r)
		})
	}
}

// TestReviewReaders2EventTrigger: an event trigger whose function reads
// acct runs on any DDL, which registers nothing.
func TestReviewReaders2EventTrigger(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rr2evt")
	execDirect(t, d, `
CREATE FUNCTION et_peek() RETURNS event_trigger LANGUAGE plpgsql AS $$BEGIN RAISE NOTICE 'acct 3 is %', (SELECT payload FROM acct WHERE id = 3); END$$;
CREATE EVENT TRIGGER rr2_et ON ddl_command_end WHEN TAG IN ('CREATE TABLE') EXECUTE FUNCTION et_peek();
`)
	stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
	rrSeen(t, p, db, d)
	execDirect(t, d, "UPDATE fenceproxy.locks SET token = 41 WHERE name = 'L'")
	notices := make(chan string, 4)
	fresh := connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
		c.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
		c.RuntimeParams["fence.lock"], c.RuntimeParams["fence.token"] = "L", "42"
		c.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { notices <- n.Message }
	})
	var r rrResult
	r.readErr = mpSimple(fresh, "CREATE TEMP TABLE rr2_any (id int)")
	var seen string
	select {
	case seen = <-notices:
	default:
	}
	r.mark = lockWatermark(t, d, "L")
	before := tableText(t, d, "acct")
	_, r.staleErr = stale.Exec(ctxT(t), "UPDATE acct SET payload = 'stale' WHERE id = $1", 3)
	if after := tableText(t, d, "acct"); after != before {
		r.changed, r.diff = true, "\n before "+before+"\n after  "+after
		execDirect(t, d, "UPDATE acct SET payload = 'c' WHERE id = 3")
	}
	r2Retry(t, d, stale, &r)
	if r.readErr == nil && r.mark != 42 && r.changed {
		t.Skipf("HOLE: an event trigger whose function reads acct (et_peek, itself a reader function) runs on DDL through the proxy (CREATE TEMP TABLE told %q) and registers nothing (watermark %d); the stale UPDATE landed (%v). Cause: event triggers are not followed, and DDL is no data statement", seen, r.mark, r.staleErr)
	}
	rrJudge(t, "CREATE TEMP TABLE firing an event trigger that reads acct", r)
}

// TestReviewReaders2DDLForwarded: DDL through the proxy that creates
// what reads through a reader runs (the refusal these cases were written
// for was withdrawn: it refused ordinary reporting functions, and the
// proxy learns such objects from the catalog once they commit), in a
// session with a lock and in one without; a DO block naming a reader
// runs and, with a lock, registers.
func TestReviewReaders2DDLForwarded(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rr2ddl")
	execDirect(t, d, rrViews+r2Schema)
	rrSeen(t, p, db, d)
	for i, lk := range []string{"L", ""} {
		tok := ""
		if lk != "" {
			tok = "42"
		}
		c := readerSession(t, p, db, lk, tok, pgx.QueryExecModeSimpleProtocol)
		for _, q := range []string{
			"CREATE VIEW r2v%d AS SELECT acct_payload(3) AS payload",
			"CREATE TEMP VIEW r2tv%d AS SELECT * FROM exists_v",
			"CREATE TRIGGER r2t%d BEFORE INSERT ON plain FOR EACH ROW EXECUTE FUNCTION tlog_fill()",
			"CREATE POLICY r2p%d ON plain USING (acct_payload(id) IS NOT NULL)",
			"CREATE RULE r2r%d AS ON INSERT TO plain DO ALSO SELECT acct_payload(3)",
			"DO $$BEGIN PERFORM acct_payload(3); END$$ -- %d",
			"CREATE FUNCTION r2f%d() RETURNS text LANGUAGE sql AS $$SELECT acct_payload(3)$$",
			"CREATE FUNCTION r2g%d() RETURNS text LANGUAGE sql BEGIN ATOMIC SELECT payload FROM exists_v WHERE id = 3; END",
		} {
			if err := mpSimple(c, fmt.Sprintf(q, i)); err != nil {
				t.Errorf("lock %q: %s: %v", lk, fmt.Sprintf(q, i), err)
			}
		}
		if w := lockWatermark(t, d, "L"); lk != "" && w != 42 {
			t.Errorf("the DO block naming a reader function registered nothing: watermark %d", w)
		}
	}
}

// r2OverSchema: readers with names that unrelated code uses as words.
const r2OverSchema = `
CREATE FUNCTION balance(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = $1$$;
CREATE TABLE wallets (id bigint PRIMARY KEY, balance numeric NOT NULL DEFAULT 0, updated_at timestamptz);
CREATE SCHEMA api;
CREATE FUNCTION api.get(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = $1$$;
CREATE SCHEMA cache;
CREATE FUNCTION cache.get(k text) RETURNS text LANGUAGE sql STABLE AS $$SELECT k$$;
CREATE FUNCTION fmt(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = $1$$;
CREATE FUNCTION fmt(text) RETURNS text LANGUAGE sql IMMUTABLE AS $$SELECT upper($1)$$;
`

// TestReviewReaders2OverRefusal: what migration tools and ORMs send
// through the proxy, in a session without a lock, where nothing of it
// reads acct.
func TestReviewReaders2OverRefusal(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rr2over")
	execDirect(t, d, r2OverSchema)
	rrSeen(t, p, db, d)
	c := readerSession(t, p, db, "", "", pgx.QueryExecModeSimpleProtocol)
	for _, k := range []struct{ name, sql, why string }{
		{"trigger function for updated_at", "CREATE FUNCTION set_updated_at() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN NEW.updated_at := now(); RETURN NEW; END$$", ""},
		{"trigger using it", "CREATE TRIGGER wallets_upd BEFORE UPDATE ON wallets FOR EACH ROW EXECUTE FUNCTION set_updated_at()", ""},
		{"view with unrelated functions", "CREATE VIEW wallet_v AS SELECT id, balance, now() AS at FROM wallets", ""},
		{"function whose body names a column called like a reader function", "CREATE FUNCTION credit(w bigint) RETURNS void LANGUAGE sql AS $$UPDATE wallets SET balance = balance + 1 WHERE id = w$$",
			"storedCodeRefusal: mentionsWord(text, \"balance\") matches any word, a column's name too"},
		{"DO block of a migration tool naming such a column", "DO $$BEGIN IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_name = 'wallets' AND column_name = 'balance') THEN ALTER TABLE wallets ADD COLUMN balance numeric; END IF; END$$",
			"storedCodeRefusal: mentionsWord(text, \"balance\") matches a string's word"},
		{"function with a comment holding a reader function's name", "CREATE FUNCTION stamp_now() RETURNS timestamptz LANGUAGE sql STABLE AS $$SELECT now() -- get the time$$",
			"api.get is a reader: the word get anywhere refuses, whatever the schema"},
		{"view calling an unrelated function of another schema with a reader's name", "CREATE VIEW cache_v AS SELECT cache.get('k') AS v", ""},
		{"function calling an unrelated function of another schema with a reader's name", "CREATE FUNCTION cache_k() RETURNS text LANGUAGE sql STABLE AS $$SELECT cache.get('k')$$",
			"storedCodeRefusal matches the word get whatever its schema (cache.get is unrelated to api.get)"},
		{"view calling an overload that reads nothing", "CREATE VIEW fmt_v AS SELECT fmt('x'::text) AS v",
			"readers list functions by name (every overload): documented in catalog.Reader"},
		{"function with a backslash in a regex", `CREATE FUNCTION is_num(t text) RETURNS bool LANGUAGE sql IMMUTABLE AS $$SELECT t ~ '^\d+$'$$`, "mayHideName: a backslash and the word function"},
		{"extension pg_trgm", "CREATE EXTENSION IF NOT EXISTS pg_trgm", ""},
		{"extension earthdistance (SQL functions)", "CREATE EXTENSION IF NOT EXISTS cube; CREATE EXTENSION IF NOT EXISTS earthdistance", ""},
		{"calls into the extensions", "SELECT similarity('abc', 'abd'), earth_distance(ll_to_earth(0, 0), ll_to_earth(1, 1)) > 0", ""},
	} {
		t.Run(k.name, func(t *testing.T) {
			err := mpSimple(c, k.sql)
			if err != nil { // refused when DDL naming a reader was (withdrawn)
				t.Errorf("OVER-REFUSAL: %s: %v (%s)", k.sql, err, k.why)
			}
		})
	}
}

// TestReviewReaders2Required: jobs has lock: required. In a session
// that names no lock, reads and writes that only maybe read jobs
// (functions, triggers, defaults, views over those, materialized views)
// run; reads through relations that surely read it fail with FP002.
func TestReviewReaders2Required(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rr2req")
	execDirect(t, d, `
INSERT INTO jobs VALUES (1, 'queued');
CREATE FUNCTION jobs_state(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT state FROM jobs WHERE id = $1$$;
CREATE TABLE jlog (id bigint, state text);
CREATE FUNCTION jlog_f() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN NEW.state := (SELECT state FROM jobs WHERE id = 1); RETURN NEW; END$$;
CREATE TRIGGER jlog_t BEFORE INSERT ON jlog FOR EACH ROW EXECUTE FUNCTION jlog_f();
CREATE VIEW jlog_v AS SELECT * FROM jlog;
CREATE VIEW jfn_v AS SELECT jobs_state(1) AS s;
CREATE MATERIALIZED VIEW jobs_mv AS SELECT * FROM jobs;
CREATE MATERIALIZED VIEW jobs_fmv AS SELECT jobs_state(1) AS s;
CREATE TABLE jdef (id bigint, s text DEFAULT jobs_state(1));
CREATE VIEW jobs_v AS SELECT * FROM jobs;
CREATE FUNCTION jobs_v() RETURNS int LANGUAGE sql AS 'SELECT 1';
CREATE FUNCTION log_job(bigint) RETURNS void LANGUAGE sql AS $$INSERT INTO jlog (id) VALUES ($1)$$;
`)
	rrSeen(t, p, db, d)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
		anon := readerSession(t, p, db, "", "", mode)
		ext := mode != pgx.QueryExecModeSimpleProtocol
		for _, k := range []struct{ sql, want string }{
			{"SELECT count(*) FROM jlog", ""},
			{"INSERT INTO jlog (id) VALUES (5)", ""},
			{"INSERT INTO jlog_v (id) VALUES (6)", ""},
			{"SELECT s FROM jfn_v", ""},
			{"SELECT count(*) FROM jobs_mv", ""},
			{"REFRESH MATERIALIZED VIEW jobs_fmv", ""},
			{"INSERT INTO jdef (id) VALUES (1)", ""},
			{"SELECT jobs_v()", ""},
			{"SELECT * FROM jobs_v()", ""},
			{"SELECT log_job(7)", ""},
			{"REFRESH MATERIALIZED VIEW jobs_mv", "FP002"},
			{"SELECT * FROM jobs_v", "FP002"},
		} {
			err := execStmt(t, anon, k.sql, nil, ext)
			switch {
			case rvCode(err) == k.want:
			case k.want == "" && rvCode(err) == "FP002":
				t.Errorf("OVER-REFUSAL (%v): %s without a lock: %v", mode, k.sql, err)
			default:
				t.Errorf("%v: %s without a lock: %v, want %q", mode, k.sql, err, k.want)
			}
		}
	}
	// Through the proxy, a function writing jlog (whose trigger reads
	// jobs) may be created, and a trigger calling it.
	anon := readerSession(t, p, db, "", "", pgx.QueryExecModeSimpleProtocol)
	for _, q := range []string{
		"CREATE FUNCTION log_job2(bigint) RETURNS void LANGUAGE sql AS $$INSERT INTO jlog (id) VALUES ($1)$$",
		"CREATE VIEW jlog_v2 AS SELECT * FROM jlog",
	} {
		if err := mpSimple(anon, q); err != nil {
			t.Errorf("%s: %v", q, err)
		}
	}
	if err := mpSimple(anon, "CREATE FUNCTION calls_log_job() RETURNS void LANGUAGE sql AS $$SELECT log_job(1)$$"); rvCode(err) == "FP003" {
		t.Logf("refused (log_job writes jlog, whose trigger reads jobs: a reader function): %v", err)
	}
}

// TestReviewReaders2Breakage: statements through readers in a session
// that names a lock run as they would without the proxy, and register.
func TestReviewReaders2Breakage(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rr2brk")
	execDirect(t, d, `
CREATE FUNCTION acct_payload(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = $1$$;
CREATE FUNCTION acct_rows() RETURNS TABLE (id bigint, payload text) LANGUAGE sql STABLE AS $$SELECT id, payload FROM acct$$;
CREATE PROCEDURE batch_commit(k bigint) LANGUAGE plpgsql AS $$DECLARE x text; BEGIN x := acct_payload(3); COMMIT; INSERT INTO plain (id, payload) VALUES (k, x); COMMIT; END$$;
CREATE MATERIALIZED VIEW mvc AS SELECT id, payload FROM acct;
CREATE UNIQUE INDEX ON mvc (id);
CREATE TABLE tlog (id bigint, payload text);
CREATE FUNCTION tlog_fill() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN NEW.payload := (SELECT payload FROM acct WHERE id = 3); RETURN NEW; END$$;
CREATE TRIGGER tlog_t BEFORE INSERT ON tlog FOR EACH ROW EXECUTE FUNCTION tlog_fill();
`)
	rrSeen(t, p, db, d)
	for mi, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		ext := mode != pgx.QueryExecModeSimpleProtocol
		c := readerSession(t, p, db, "L", "42", mode)
		cases := []struct {
			name     string
			register bool
			run      func() (string, error)
		}{
			{"CALL of a procedure that commits and calls a reader function", false, func() (string, error) {
				k := 600 + mi
				if err := execStmt(t, c, fmt.Sprintf("CALL batch_commit(%d)", k), nil, ext); err != nil {
					return "", err
				}
				var s string
				err := d.QueryRow(ctxT(t), "SELECT payload FROM plain WHERE id = $1", k).Scan(&s)
				return s, err
			}},
			{"REFRESH MATERIALIZED VIEW CONCURRENTLY", true, func() (string, error) {
				return "c", execStmt(t, c, "REFRESH MATERIALIZED VIEW CONCURRENTLY mvc", nil, ext)
			}},
			{"cursor WITH HOLD over a reader function", true, func() (string, error) {
				if err := execStmt(t, c, "DECLARE hc CURSOR WITH HOLD FOR SELECT acct_payload(g) FROM generate_series(1, 3) g", nil, ext); err != nil {
					return "", err
				}
				res, err := c.PgConn().Exec(ctxT(t), "FETCH ALL FROM hc; CLOSE hc").ReadAll()
				if err != nil || len(res) == 0 {
					return "", err
				}
				var out []string
				for _, row := range res[0].Rows {
					out = append(out, string(row[0]))
				}
				return strings.Join(out, ","), nil
			}},
			{"set-returning function in FROM with a parameter", true, func() (string, error) {
				rows, err := c.Query(ctxT(t), "SELECT payload FROM acct_rows() WHERE id <= $1 ORDER BY id", 3)
				if err != nil {
					return "", err
				}
				got, err := pgx.CollectRows(rows, pgx.RowTo[string])
				return strings.Join(got, ","), err
			}},
			{"pipelined batch of reader function calls", true, func() (string, error) {
				b := &pgx.Batch{}
				var got []string
				for i := 1; i <= 3; i++ {
					b.Queue("SELECT acct_payload($1)", i).QueryRow(func(r pgx.Row) error {
						var s string
						err := r.Scan(&s)
						got = append(got, s)
						return err
					})
				}
				b.Queue("SELECT count(*)::text FROM acct_rows()").QueryRow(func(r pgx.Row) error {
					var s string
					err := r.Scan(&s)
					got = append(got, s)
					return err
				})
				err := c.SendBatch(ctxT(t), b).Close()
				return strings.Join(got, ","), err
			}},
			{"COPY FROM STDIN into a table whose trigger reads acct", true, func() (string, error) {
				n, err := c.CopyFrom(ctxT(t), pgx.Identifier{"tlog"}, []string{"id"}, pgx.CopyFromRows([][]any{{int64(1)}, {int64(2)}}))
				if err != nil {
					return "", err
				}
				var s string
				err = d.QueryRow(ctxT(t), "SELECT string_agg(DISTINCT payload, ',') FROM tlog").Scan(&s)
				return fmt.Sprintf("%d %s", n, s), err
			}},
			{"transaction of reader function calls", true, func() (string, error) {
				tx, err := c.Begin(ctxT(t))
				if err != nil {
					return "", err
				}
				defer func() { _ = tx.Rollback(ctxT(t)) }()
				var a, b string
				if err := tx.QueryRow(ctxT(t), "SELECT acct_payload($1)", 1).Scan(&a); err != nil {
					return "", err
				}
				if err := tx.QueryRow(ctxT(t), "SELECT payload FROM acct_rows() WHERE id = $1", 2).Scan(&b); err != nil {
					return "", err
				}
				return a + "," + b, tx.Commit(ctxT(t))
			}},
		}
		want := []string{"c", "c", "a,b,c", "a,b,c", "a,b,c,3", "2 c", "a,b"}
		for i, k := range cases {
			t.Run(fmt.Sprintf("%s/%v", k.name, mode), func(t *testing.T) {
				execDirect(t, d, "DELETE FROM fenceproxy.locks WHERE name = 'L'; TRUNCATE tlog")
				got, err := k.run()
				if err != nil {
					t.Skipf("BREAKAGE: %s (%v): %v", k.name, mode, err)
				}
				if got != want[i] {
					t.Errorf("%s: got %q, want %q", k.name, got, want[i])
				}
				if w := lockWatermark(t, d, "L"); k.register && w != 42 {
					t.Errorf("%s: watermark %d, want 42", k.name, w)
				}
			})
		}
	}
}

// TestReviewReaders2FollowCatalog: a session that only executes a
// statement it prepared (pgx's statement cache) while the function it
// calls read plain; the function is replaced on a direct connection to
// read acct. Without any other statement being decided, its executions
// must come to register (followCatalog).
func TestReviewReaders2FollowCatalog(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rr2follow")
	execDirect(t, d, "CREATE FUNCTION pf(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM plain WHERE id = 1$$")
	stale := rrStale(t, p, db, pgx.QueryExecModeCacheStatement)
	r := rrRound(t, p, db, d, stale, pgx.QueryExecModeCacheStatement, func(c *pgx.Conn) error {
		var s string
		if err := c.QueryRow(ctxT(t), "SELECT pf($1)", 3).Scan(&s); err != nil || s != "p" {
			return fmt.Errorf("pf over plain: %q %v", s, err)
		}
		if w := lockWatermark(t, d, "L"); w != 41 {
			return fmt.Errorf("watermark %d after a call of pf over plain, want 41", w)
		}
		execDirect(t, d, "CREATE OR REPLACE FUNCTION pf(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = $1$$")
		start := time.Now()
		for deadline := start.Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			if err := c.QueryRow(ctxT(t), "SELECT pf($1)", 3).Scan(&s); err != nil {
				return err
			}
			if lockWatermark(t, d, "L") == 42 {
				t.Logf("registered %v after the change", time.Since(start))
				return nil
			}
			if time.Now().After(deadline) {
				return nil // judged below: a HOLE
			}
		}
	})
	r2Retry(t, d, stale, &r)
	rrJudge(t, "prepared SELECT pf($1) after pf came to read acct", r)
}

// TestReviewReaders2ManyFunctions: a database with thousands of
// functions, a chain of calls down to acct in the order that makes the
// readers' fixed point slowest (each function created before the one it
// calls, so each pass over the list finds one more). Measured, logged:
// the catalog read (catalog.Paths), the time until the proxy sees a new
// view, a decision per distinct text, a large CREATE FUNCTION through
// the proxy. Asserted: the chain's top registers.
func TestReviewReaders2ManyFunctions(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	const n = 2000
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rr2many")
	execDirect(t, d, fmt.Sprintf(`
DO $do$BEGIN
	FOR i IN REVERSE %d..1 LOOP
		EXECUTE format('CREATE FUNCTION chain_%%s() RETURNS text LANGUAGE plpgsql STABLE AS $f$BEGIN RETURN chain_%%s(); END$f$', i, i - 1);
	END LOOP;
	FOR i IN 1..%d LOOP
		EXECUTE format('CREATE FUNCTION other_%%s(x int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $f$BEGIN /* some words of a body: %%s */ RETURN x + %%s; END$f$', i, repeat('lorem ipsum dolor ', 20), i);
	END LOOP;
END$do$;
CREATE FUNCTION chain_0() RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = 3$$;
`, n, n))
	start := time.Now()
	reach, err := catalog.Paths(ctxT(t), d, nil, []catalog.Rel{{Schema: "public", Name: "acct"}, {Schema: "public", Name: "jobs"}})
	if err != nil {
		t.Fatal(err)
	}
	pathsTime := time.Since(start)
	funcs := 0
	for _, x := range reach.Readers {
		if x.Function {
			funcs++
		}
	}
	if funcs < n+1 {
		t.Errorf("%d reader functions, want at least %d (the chain)", funcs, n+1)
	}
	start = time.Now()
	rrSeen(t, p, db, d)
	seen := time.Since(start)

	c := readerSession(t, p, db, "L", "42", pgx.QueryExecModeSimpleProtocol)
	if err := mpSimple(c, fmt.Sprintf("SELECT CASE WHEN false THEN chain_%d() END", n)); err != nil {
		t.Fatal(err)
	}
	if w := lockWatermark(t, d, "L"); w != 42 {
		t.Errorf("a call of chain_%d (which reads acct through %d calls): watermark %d, want 42", n, n, w)
	}
	const texts = 200
	start = time.Now()
	for i := 0; i < texts; i++ {
		if err := mpSimple(c, fmt.Sprintf("SELECT CASE WHEN false THEN chain_%d() END", i*7%n+1)); err != nil {
			t.Fatal(err)
		}
	}
	perText := time.Since(start) / texts
	var body strings.Builder
	for i := 0; body.Len() < 50000; i++ {
		fmt.Fprintf(&body, "x := x + %d; -- step %d of the computation\n", i, i)
	}
	anon := readerSession(t, p, db, "", "", pgx.QueryExecModeSimpleProtocol)
	ddl := "CREATE OR REPLACE FUNCTION other_1(x int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $f$BEGIN\n" + body.String() + "RETURN x; END$f$"
	start = time.Now()
	if err := mpSimple(anon, ddl); err != nil {
		t.Errorf("a %d-byte CREATE FUNCTION naming no reader but its own name: %v", len(ddl), err)
	}
	large := time.Since(start)
	t.Logf("%d chained + %d other functions: catalog.Paths %v (%d readers); proxy saw a new view after %v; %v per distinct text calling a chain function; %v for a %d-byte CREATE FUNCTION through the proxy",
		n+1, n, pathsTime, len(reach.Readers), seen, perText, large, len(ddl))
}
