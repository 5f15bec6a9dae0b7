package fencing_test

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/pgbouncer"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review of 0fd0823, 4d181fe, 8daa206: reads through views,
// parents and partitions of a lock-fenced table register the session's
// lock. Property: once the newer holder (token 42) has read acct through
// any relation via the proxy, the stale holder (41, registered earlier) is
// refused (FP001) and acct is unchanged, checked on a direct connection.
//
// Holes found, and what became of them (a case that shows one skips
// with "HOLE:"; one refused with FP003 holds):
//   - a DO block through the proxy that reads a reader which is no write
//     path (a view that is not updatable): now registers;
//   - a view or function over a reader created through the proxy and used
//     in the same text (temporary view) or at once (before the
//     notification): left, documented (protecting-tables.md). Refusing
//     such DDL through the proxy was tried and withdrawn: it refused
//     ordinary reporting functions over views of protected tables
//     (TestReviewOverOrdinaryDDL);
//   - a temporary view named pg_temp.tv, a temporary function called as
//     pg_temp.f(): pg_temp now matches any pg_temp_N;
//   - REFRESH MATERIALIZED VIEW through the proxy (reads acct now): a
//     refresh of a materialized view over acct registers;
//   - a rule whose action reads acct (DO INSTEAD SELECT on src), a row
//     security policy whose expression reads acct: their relations are
//     readers.
// Left as designed (OVER-REFUSAL skip): an unqualified name counts for
// every reader of that name, as for protected tables.

// rrLong is a 63-byte view name (PostgreSQL's limit); statements name it
// with a longer spelling that the server truncates to it.
var rrLong = strings.Repeat("l", 60) + "_vw"

// rrViews: relations that read acct in many shapes, and an unrelated
// relation with a reader's name in another schema.
var rrViews = `
CREATE VIEW acct_v AS SELECT * FROM acct;
CREATE SCHEMA s;
CREATE VIEW s.w AS SELECT * FROM acct_v;
CREATE VIEW "Mixed View" AS SELECT * FROM acct;
CREATE VIEW "vüe" AS SELECT * FROM acct;
CREATE VIEW ` + rrLong + ` AS SELECT * FROM acct;
CREATE VIEW lat AS SELECT a.id, x.payload FROM plain a, LATERAL (SELECT payload FROM acct WHERE acct.id = 3) x;
CREATE VIEW sel_sub AS SELECT id, (SELECT payload FROM acct WHERE id = 3) AS payload FROM plain;
CREATE VIEW cte_v AS WITH c AS (SELECT * FROM acct) SELECT * FROM c;
CREATE VIEW exists_v AS SELECT 3::bigint AS id, 'c'::text AS payload WHERE EXISTS (SELECT FROM acct WHERE id = 3);
CREATE SCHEMA other;
CREATE TABLE other.acct_v (id bigint, payload text);
INSERT INTO other.acct_v VALUES (3, 'o');
`

// rrResult is what one round of the property found.
type rrResult struct {
	readErr  error  // the newer holder's read
	mark     int64  // the watermark after it
	staleErr error  // the stale holder's UPDATE of acct after it
	changed  bool   // acct changed
	diff     string // before/after when changed
}

// rrRound resets the watermark to 41 (the stale holder's), has a newer
// holder (42, a new session in mode) run read, then the stale holder
// update acct row 3; acct is restored afterwards.
func rrRound(t *testing.T, p *proxytest.Proxy, db string, d, stale *pgx.Conn, mode pgx.QueryExecMode, read func(c *pgx.Conn) error) rrResult {
	t.Helper()
	execDirect(t, d, "UPDATE fenceproxy.locks SET token = 41 WHERE name = 'L'")
	fresh := readerSession(t, p, db, "L", "42", mode)
	var r rrResult
	r.readErr = read(fresh)
	r.mark = lockWatermark(t, d, "L")
	t.Logf("read: %v; watermark %d", r.readErr, r.mark)
	before := tableText(t, d, "acct")
	// A catalog change made by the round (a view created) may refuse the
	// stale write once, before it runs, as moved (FP003): retried.
	r.staleErr = rvRuleTry(func() error {
		_, err := stale.Exec(ctxT(t), "UPDATE acct SET payload = 'stale' WHERE id = $1", 3)
		return err
	})
	after := tableText(t, d, "acct")
	if after != before {
		r.changed = true
		r.diff = "\n before " + before + "\n after  " + after
		execDirect(t, d, "UPDATE acct SET payload = 'c' WHERE id = 3")
	}
	_ = fresh.Close(ctxT(t))
	return r
}

// rrJudge fails t where the property broke after a read that ran (a
// read that registered nothing and let the stale write land included:
// rrKnownHole skips the documented ones).
func rrJudge(t *testing.T, what string, r rrResult) {
	t.Helper()
	switch {
	case r.readErr != nil:
		t.Errorf("%s: the newer holder's read failed: %v", what, r.readErr)
		if r.changed {
			t.Errorf("%s: and acct changed:%s", what, r.diff)
		}
	case r.mark != 42 && r.changed:
		t.Errorf("HOLE: %s: the newer holder's read registered nothing (watermark %d) and the stale UPDATE landed (%v):%s", what, r.mark, r.staleErr, r.diff)
	case r.mark != 42:
		t.Errorf("%s: watermark %d after the newer holder's read, want 42 (stale UPDATE: %v)", what, r.mark, r.staleErr)
	case rvCode(r.staleErr) != "FP001" || r.changed:
		t.Errorf("%s: stale UPDATE after the newer holder's read: %v, want FP001%s", what, r.staleErr, r.diff)
	}
}

// rrKnownHole skips t where r shows the documented hole why (the read
// registered nothing and the stale write landed); otherwise it is
// rrJudge.
func rrKnownHole(t *testing.T, what string, r rrResult, why string) {
	t.Helper()
	if r.readErr == nil && r.mark != 42 && r.changed {
		t.Skipf("HOLE (documented: %s): %s: watermark %d, the stale UPDATE landed (%v):%s", why, what, r.mark, r.staleErr, r.diff)
	}
	rrJudge(t, what, r)
}

// rrCreatedWindow is the documented hole of objects created through the
// proxy and read through at once.
const rrCreatedWindow = "an object created through the proxy counts once the proxy has learned of it from the catalog"

// rrStale opens the stale holder's session (41) and registers it.
func rrStale(t *testing.T, p *proxytest.Proxy, db string, mode pgx.QueryExecMode) *pgx.Conn {
	t.Helper()
	c := readerSession(t, p, db, "L", "41", mode)
	if err := execStmt(t, c, "SELECT n FROM acct WHERE id = 1", nil, mode != pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	return c
}

// rrSimpleRead is a read sent as one simple Query.
func rrSimpleRead(sql string) func(c *pgx.Conn) error {
	return func(c *pgx.Conn) error { return mpSimple(c, sql) }
}

// TestReviewReadersSpellings: every spelling and statement shape that
// reads acct through a reader registers the newer holder.
func TestReviewReadersSpellings(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rrspell")
	execDirect(t, d, rrViews)
	stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
	cases := []struct{ name, sql, want string }{
		{"upper case", "SELECT payload FROM ACCT_V WHERE id = 3", ""},
		{"quoted", `SELECT payload FROM "acct_v" WHERE id = 3`, ""},
		{"schema-qualified", "SELECT payload FROM public.acct_v WHERE id = 3", ""},
		{"quoted schema-qualified", `SELECT payload FROM "public"."acct_v" WHERE id = 3`, ""},
		{"database-qualified", fmt.Sprintf(`SELECT payload FROM %q.public.acct_v WHERE id = 3`, db), ""},
		{"unicode escape", `SELECT payload FROM U&"acct\005fv" WHERE id = 3`, ""},
		{"unicode escape UESCAPE", `SELECT payload FROM U&"!0061cct_v" UESCAPE '!' WHERE id = 3`, ""},
		{"search_path", "SET search_path = s, public; SELECT payload FROM w WHERE id = 3", ""},
		{"search_path upper", "SET search_path = s, public; SELECT payload FROM W WHERE id = 3", ""},
		{"view over view qualified", "SELECT payload FROM S.W WHERE id = 3", ""},
		{"mixed-case quoted name", `SELECT payload FROM "Mixed View" WHERE id = 3`, ""},
		{"non-ASCII name", `SELECT payload FROM "vüe" WHERE id = 3`, ""},
		{"non-ASCII name unicode escape", `SELECT payload FROM U&"v\00fce" WHERE id = 3`, ""},
		{"name truncated by the server", "SELECT payload FROM " + rrLong + "_and_more_bytes WHERE id = 3", ""},
		{"quoted name truncated by the server", `SELECT payload FROM "` + rrLong + `xyz" WHERE id = 3`, ""},
		{"TABLE", "TABLE acct_v", ""},
		{"scalar subquery in the select list", "SELECT (SELECT payload FROM acct_v WHERE id = 3)", ""},
		{"LATERAL", "SELECT x.payload FROM plain p, LATERAL (SELECT payload FROM acct_v WHERE id = p.id + 2) x", ""},
		{"CTE", "WITH c AS MATERIALIZED (SELECT * FROM acct_v) SELECT payload FROM c WHERE id = 3", ""},
		{"CTE named like the view over it", "WITH acct_v AS (SELECT * FROM public.acct_v) SELECT payload FROM acct_v WHERE id = 3", ""},
		{"view with LATERAL", "SELECT payload FROM lat", ""},
		{"view with a scalar subquery", "SELECT payload FROM sel_sub", ""},
		{"view with a CTE", "SELECT payload FROM cte_v WHERE id = 3", ""},
		{"view with EXISTS", "SELECT payload FROM exists_v", ""},
		{"COPY query", "COPY (SELECT payload FROM acct_v WHERE id = 3) TO STDOUT", ""},
		{"EXPLAIN ANALYZE", "EXPLAIN ANALYZE SELECT payload FROM acct_v WHERE id = 3", ""},
		{"CREATE TABLE AS", "CREATE TEMP TABLE snap1 AS SELECT * FROM acct_v", ""},
		{"SELECT INTO", "SELECT * INTO TEMP snap2 FROM acct_v", ""},
		{"cursor", "BEGIN; DECLARE c CURSOR FOR SELECT payload FROM acct_v; FETCH ALL FROM c; COMMIT", ""},
		{"INSERT into an unrelated table from the view", "INSERT INTO plain (id, payload) SELECT id + 100, payload FROM acct_v WHERE id = 3", ""},
		{"UPDATE FROM the view", "UPDATE plain SET payload = a.payload FROM acct_v a WHERE plain.id = 1 AND a.id = 3", ""},
		{"DELETE USING the view", "DELETE FROM plain USING acct_v a WHERE plain.id = a.id + 1000", ""},
		{"MERGE USING the view", "MERGE INTO plain p USING acct_v a ON p.id = a.id WHEN MATCHED THEN UPDATE SET n = p.n", ""},
		{"IN subquery", "SELECT payload FROM plain WHERE id IN (SELECT id FROM acct_v)", ""},
		// Refused as documented (EXECUTE alone in its text).
		{"PREPARE then EXECUTE", "PREPARE rr_p AS SELECT payload FROM acct_v WHERE id = 3; EXECUTE rr_p; DEALLOCATE rr_p", "FP003"},
		{"PREPARE alone", "PREPARE rr_q AS SELECT payload FROM acct_v WHERE id = 3", ""},
		// Stored code naming the table, or a reader that is a write path
		// (an updatable view), is refused.
		{"DO block over the table", "DO $$BEGIN PERFORM payload FROM acct WHERE id = 3; END$$", "FP003"},
		{"DO block over an updatable view", "DO $$BEGIN PERFORM payload FROM acct_v WHERE id = 3; END$$", "FP003"},
		{"DO block, dynamic SQL over a read-only view", "DO $$BEGIN EXECUTE 'SELECT payload FROM exists_v'; END$$", "FP003"},
	}
	for _, k := range cases {
		t.Run(k.name, func(t *testing.T) {
			read := rrSimpleRead(k.sql)
			if k.name == "PREPARE alone" {
				read = func(c *pgx.Conn) error {
					if err := mpSimple(c, k.sql); err != nil {
						return err
					}
					return mpSimple(c, "EXECUTE rr_q")
				}
			}
			r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol, read)
			if k.want != "" {
				if rvCode(r.readErr) != k.want || r.mark != 41 {
					t.Errorf("%s: %v, watermark %d; want %s and 41", k.sql, r.readErr, r.mark, k.want)
				}
				return
			}
			rrJudge(t, k.sql, r)
		})
	}
}

// TestReviewReadersStoredCode: a DO block, or a function created through
// the proxy, that reads acct through a view that is not updatable (so not
// a write path) registers nothing and is not refused, where the same code
// naming acct, or an updatable view over it, is refused (FP003, "DO block
// mentions protected table", "stored code mentions ... which writes
// protected table"). The read runs in the client's own text.
func TestReviewReadersStoredCode(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rrcode")
	execDirect(t, d, rrViews)
	stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
	// Baseline: the same code naming acct is refused.
	anon := readerSession(t, p, db, "L", "42", pgx.QueryExecModeSimpleProtocol)
	for _, q := range []string{
		"DO $$DECLARE x text; BEGIN SELECT payload INTO x FROM acct WHERE id = 3; RAISE NOTICE 'read %', x; END$$",
		"CREATE FUNCTION pg_temp.rr_g() RETURNS text LANGUAGE sql AS $$SELECT payload FROM public.acct WHERE id = 3$$",
	} {
		if err := mpSimple(anon, q); rvCode(err) != "FP003" {
			t.Errorf("%s: %v, want FP003", q, err)
		}
	}
	_ = anon.Close(ctxT(t))
	for _, k := range []struct {
		name string
		read func(c *pgx.Conn) error
		hole string // documented
	}{
		{"DO block", rrSimpleRead("DO $$DECLARE x text; BEGIN SELECT payload INTO x FROM exists_v; RAISE NOTICE 'read %', x; END$$"), ""},
		{"function created through the proxy, called at once", func(c *pgx.Conn) error {
			if err := mpSimple(c, "CREATE FUNCTION rr_f() RETURNS text LANGUAGE sql AS $$SELECT payload FROM public.exists_v$$"); err != nil {
				return err
			}
			return mpSimple(c, "SELECT rr_f()")
		}, rrCreatedWindow},
		{"function, called once the proxy has seen it", func(c *pgx.Conn) error {
			if err := mpSimple(c, "CREATE FUNCTION rr_g() RETURNS text LANGUAGE sql AS $$SELECT payload FROM public.exists_v$$"); err != nil {
				return err
			}
			rrSeen(t, p, db, d)
			return mpSimple(c, "SELECT rr_g()")
		}, ""},
		{"temporary function, called once the proxy has seen it", func(c *pgx.Conn) error {
			if err := mpSimple(c, "CREATE FUNCTION pg_temp.rr_h() RETURNS text LANGUAGE sql AS $$SELECT payload FROM public.exists_v$$"); err != nil {
				return err
			}
			rrSeen(t, p, db, d)
			return mpSimple(c, "SELECT pg_temp.rr_h()")
		}, ""},
	} {
		t.Run(k.name, func(t *testing.T) {
			r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol, k.read)
			if k.hole != "" {
				rrKnownHole(t, k.name+" reading the read-only view exists_v", r, k.hole)
				return
			}
			rrJudge(t, k.name+" reading the read-only view exists_v", r)
		})
	}
}

// rrProbes numbers the probe views of rrSeen.
var rrProbes atomic.Int64

// rrSeen returns once the proxy decides with a catalog at least as new as
// every change committed before the call: it creates a view over acct
// directly and waits until a read of it registers a lock of its own.
func rrSeen(t *testing.T, p *proxytest.Proxy, db string, d *pgx.Conn) {
	t.Helper()
	n := rrProbes.Add(1)
	view, lk := fmt.Sprintf("rr_probe_%d", n), fmt.Sprintf("P%d", n)
	execDirect(t, d, "CREATE VIEW "+view+" AS SELECT id FROM acct")
	c := readerSession(t, p, db, lk, "1", pgx.QueryExecModeSimpleProtocol)
	defer c.Close(ctxT(t))
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if err := mpSimple(c, "SELECT id FROM "+view+" LIMIT 0"); err != nil {
			t.Fatal(err)
		}
		if lockWatermark(t, d, lk) == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the proxy did not see %s within 10s", view)
		}
	}
}

// TestReviewReadersCatalogChanges: readers that appear while the proxy
// runs.
func TestReviewReadersCatalogChanges(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)

	// The newer holder creates a temporary view over acct through the
	// proxy and reads through it in the same text: no notification can
	// have told the proxy of the view yet.
	t.Run("temp view created and read in one text", func(t *testing.T) {
		t.Parallel()
		db, d := rvSetupDB(t, specs, "rrtmp")
		execDirect(t, d, rrViews)
		stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
		r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol,
			rrSimpleRead("CREATE TEMP VIEW tv AS SELECT id, payload FROM exists_v; SELECT payload FROM tv WHERE id = 3"))
		if rvCode(r.readErr) == "FP003" {
			return
		}
		rrKnownHole(t, "CREATE TEMP VIEW ...; SELECT ... FROM tv", r, rrCreatedWindow)
	})

	// The same with a view created in one Query and read in the next,
	// without waiting.
	t.Run("view created through the proxy, read at once", func(t *testing.T) {
		t.Parallel()
		db, d := rvSetupDB(t, specs, "rrnow")
		execDirect(t, d, rrViews)
		stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
		r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol, func(c *pgx.Conn) error {
			if err := mpSimple(c, "CREATE VIEW made_here AS SELECT id, payload FROM exists_v"); err != nil {
				return err
			}
			return mpSimple(c, "SELECT payload FROM made_here WHERE id = 3")
		})
		if rvCode(r.readErr) == "FP003" {
			return
		}
		rrKnownHole(t, "CREATE VIEW made_here (through the proxy); SELECT ... FROM made_here", r, rrCreatedWindow)
	})

	// A temporary view created through the proxy, read once the proxy has
	// seen it: named through pg_temp (the catalog lists it under
	// pg_temp_N), and without its schema.
	for _, k := range []struct{ name, ref string }{{"rrpgtemp", "pg_temp.tv"}, {"rrtv", "tv"}} {
		t.Run("temp view named "+k.ref, func(t *testing.T) {
			t.Parallel()
			db, d := rvSetupDB(t, specs, k.name)
			execDirect(t, d, rrViews)
			stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
			r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol, func(c *pgx.Conn) error {
				if err := mpSimple(c, "CREATE TEMP VIEW tv AS SELECT id, payload FROM exists_v"); err != nil {
					return err
				}
				rrSeen(t, p, db, d)
				return mpSimple(c, "SELECT payload FROM "+k.ref+" WHERE id = 3")
			})
			rrJudge(t, "SELECT ... FROM "+k.ref, r)
		})
	}

	// A SQL-level PREPARE while v read plain; v is replaced over acct
	// on a direct connection; once the proxy has seen it, EXECUTE.
	t.Run("SQL PREPARE before the view was replaced", func(t *testing.T) {
		t.Parallel()
		db, d := rvSetupDB(t, specs, "rrsqlprep")
		stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
		r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol, func(c *pgx.Conn) error {
			if err := mpSimple(c, "PREPARE rr_v AS SELECT payload FROM v WHERE id = 3"); err != nil {
				return err
			}
			if err := mpSimple(c, "EXECUTE rr_v"); err != nil {
				return err
			}
			execDirect(t, d, "CREATE OR REPLACE VIEW v AS SELECT * FROM acct")
			rrSeen(t, p, db, d)
			err := mpSimple(c, "EXECUTE rr_v")
			// Prepare it again, as documented, while the refusal says the
			// rules moved (a check that ends after the notification moves
			// them once more).
			for i := 0; i < 5 && rvCode(err) == "FP003"; i++ {
				if err = mpSimple(c, "DEALLOCATE rr_v; PREPARE rr_v AS SELECT payload FROM v WHERE id = 3"); err == nil {
					err = mpSimple(c, "EXECUTE rr_v")
				}
			}
			return err
		})
		rrJudge(t, "EXECUTE of a PREPARE made before the view was replaced", r)
	})

	// An unnamed statement parsed while v read plain, bound again (no new
	// Parse) once v reads acct and the proxy has seen it.
	t.Run("unnamed statement bound again after the change", func(t *testing.T) {
		t.Parallel()
		db, d := rvSetupDB(t, specs, "rrunnamed")
		stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
		r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol, func(c *pgx.Conn) error {
			codes := raPipeline(t, c, 1,
				&pgproto3.Parse{Query: "SELECT payload FROM v WHERE id = 3"},
				&pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{})
			if len(codes) > 0 {
				return fmt.Errorf("%v", codes)
			}
			execDirect(t, d, "CREATE OR REPLACE VIEW v AS SELECT * FROM acct")
			rrSeen(t, p, db, d)
			codes = raPipeline(t, c, 1, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{})
			if len(codes) > 0 {
				return fmt.Errorf("%v", codes)
			}
			return nil
		})
		rrJudge(t, "unnamed statement bound again after v was replaced", r)
	})

	// A named statement on pparent prepared before acct was attached to
	// it.
	t.Run("partition attached while prepared", func(t *testing.T) {
		t.Parallel()
		db, d := rvSetupDB(t, specs, "rrattach")
		execDirect(t, d, mpPathSchema)
		stale := rrStale(t, p, db, pgx.QueryExecModeCacheStatement)
		r := rrRound(t, p, db, d, stale, pgx.QueryExecModeCacheStatement, func(c *pgx.Conn) error {
			var n int
			if err := c.QueryRow(ctxT(t), "SELECT count(*) FROM pparent WHERE id = $1", 3).Scan(&n); err != nil {
				return err
			}
			execDirect(t, d, "ALTER TABLE pparent ATTACH PARTITION acct FOR VALUES FROM (0) TO (1000)")
			rrSeen(t, p, db, d)
			if err := c.QueryRow(ctxT(t), "SELECT count(*) FROM pparent WHERE id = $1", 3).Scan(&n); err != nil {
				return err
			}
			if n != 1 {
				return fmt.Errorf("read %d rows through pparent, want 1", n)
			}
			return nil
		})
		rrJudge(t, "prepared read of pparent after ATTACH PARTITION acct", r)
	})

	// REFRESH MATERIALIZED VIEW reads acct now, through the proxy; the
	// newer holder then reads what it read.
	t.Run("REFRESH MATERIALIZED VIEW", func(t *testing.T) {
		t.Parallel()
		db, d := rvSetupDB(t, specs, "rrmv")
		execDirect(t, d, "CREATE MATERIALIZED VIEW mv AS SELECT id, payload FROM acct WITH NO DATA")
		stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
		r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol,
			rrSimpleRead("REFRESH MATERIALIZED VIEW mv; SELECT payload FROM mv WHERE id = 3"))
		if rvCode(r.readErr) == "FP003" {
			return
		}
		rrJudge(t, "REFRESH MATERIALIZED VIEW mv; SELECT ... FROM mv", r)
	})

	// A rule on src whose action reads acct: the newer holder's UPDATE of
	// src returns acct's rows.
	t.Run("rule action reading acct", func(t *testing.T) {
		t.Parallel()
		db, d := rvSetupDB(t, specs, "rrrule")
		execDirect(t, d, "CREATE RULE src_reads AS ON UPDATE TO src DO INSTEAD SELECT id, payload FROM acct WHERE id = 3")
		rrSeen(t, p, db, d)
		stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
		var got string
		r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol, func(c *pgx.Conn) error {
			rows, err := c.PgConn().Exec(ctxT(t), "UPDATE src SET v = v WHERE id = 1").ReadAll()
			if err == nil && len(rows) > 0 && len(rows[0].Rows) > 0 {
				got = string(rows[0].Rows[0][1])
			}
			return err
		})
		if r.readErr == nil && got != "c" {
			t.Fatalf("UPDATE src returned %q, want acct's row 3 payload c", got)
		}
		if rvCode(r.readErr) == "FP003" {
			return
		}
		rrJudge(t, "UPDATE src (an INSTEAD SELECT rule reading acct)", r)
	})
}

// rrHierarchy: acct_kid inherits from acct and from mi_other (multiple
// inheritance): a read of mi_other reads acct_kid's rows, which are
// acct's; a view over mi_other too.
const rrHierarchy = `
CREATE TABLE mi_other (id bigint, payload text);
CREATE TABLE acct_kid () INHERITS (acct, mi_other);
INSERT INTO acct_kid (id, payload) VALUES (7, 'k');
CREATE VIEW mi_v AS SELECT id, payload FROM mi_other WHERE id > 0 GROUP BY id, payload;
ALTER TABLE acct INHERIT inh_parent;
`

// TestReviewReadersHierarchy: reads through inheritance and partitioning
// in several protocol forms.
func TestReviewReadersHierarchy(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	for _, g := range []struct {
		name, schema string
		id           int
		reads        []string
	}{
		{"multiple inheritance", rrHierarchy, 7, []string{
			"SELECT payload FROM mi_other WHERE id = $1",
			"SELECT payload FROM mi_v WHERE id = $1",
			"SELECT payload FROM acct_kid WHERE id = $1",
			"SELECT payload FROM ONLY inh_parent WHERE id = $1 UNION ALL SELECT payload FROM inh_parent WHERE id = $1",
		}},
		{"partitioned parent", mpPathSchema + "ALTER TABLE pparent ATTACH PARTITION acct FOR VALUES FROM (0) TO (1000)", 3, []string{
			"SELECT payload FROM pparent WHERE id = $1",
			"SELECT count(*)::text FROM ONLY pparent WHERE id = $1",
			"SELECT payload FROM pparent TABLESAMPLE SYSTEM (100) WHERE id = $1",
		}},
	} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
			t.Run(fmt.Sprintf("%s/%v", g.name, mode), func(t *testing.T) {
				t.Parallel()
				db, d := rvSetupDB(t, specs, "rrhier")
				execDirect(t, d, g.schema)
				stale := rrStale(t, p, db, mode)
				for _, q := range g.reads {
					r := rrRound(t, p, db, d, stale, mode, func(c *pgx.Conn) error {
						var s string
						return c.QueryRow(ctxT(t), q, g.id).Scan(&s)
					})
					rrJudge(t, q, r)
				}
				// COPY of an inheritance parent copies its own rows only:
				// registering for it costs a statement, nothing more.
				r := rrRound(t, p, db, d, stale, mode, func(c *pgx.Conn) error {
					return execStmt(t, c, "COPY (SELECT * FROM mi_other) TO STDOUT", nil, false)
				})
				if g.name == "multiple inheritance" {
					rrJudge(t, "COPY (SELECT * FROM mi_other) TO STDOUT", r)
				}
			})
		}
	}
}

// TestReviewReadersRequired: jobs has lock: required. A session that
// names no lock is refused (FP002) on reads through its readers; reads of
// unrelated relations that share a reader's name must still run.
func TestReviewReadersRequired(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rrreq")
	execDirect(t, d, `
INSERT INTO jobs VALUES (1, 'queued');
CREATE TABLE jobs_kid () INHERITS (jobs);
CREATE TABLE jobs_top (id bigint, state text);
ALTER TABLE jobs INHERIT jobs_top;
CREATE VIEW jobs_v AS SELECT id, state FROM jobs_top WHERE id > 0 GROUP BY id, state;
CREATE SCHEMA other;
CREATE TABLE other.jobs_v (id bigint, state text);
INSERT INTO other.jobs_v VALUES (1, 'other');
CREATE TABLE other.jobs (id bigint, state text);
INSERT INTO other.jobs VALUES (1, 'other');
`)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		anon := readerSession(t, p, db, "", "", mode)
		ext := mode != pgx.QueryExecModeSimpleProtocol
		for _, q := range []string{
			"SELECT state FROM jobs_v WHERE id = 1",
			"SELECT state FROM jobs_top WHERE id = 1",
			"SELECT state FROM jobs_kid WHERE id = 1",
			"COPY (SELECT state FROM jobs_v) TO STDOUT",
			"SELECT (SELECT max(state) FROM public.jobs_v)",
		} {
			if err := execStmt(t, anon, q, nil, ext); rvCode(err) != "FP002" {
				t.Errorf("%v: %s without a lock: %v, want FP002", mode, q, err)
			}
		}
		// Unrelated relations: schema-qualified, they must run.
		var s string
		if err := anon.QueryRow(ctxT(t), "SELECT state FROM other.jobs_v WHERE id = $1", 1).Scan(&s); err != nil || s != "other" {
			t.Errorf("%v: read of other.jobs_v (unrelated): %q %v", mode, s, err)
		}
	}
	// Unqualified, found through search_path, or a CTE of the reader's
	// name: the proxy cannot tell them from the reader. The same as for
	// the table's own name (other.jobs through search_path)?
	anon := readerSession(t, p, db, "", "", pgx.QueryExecModeSimpleProtocol)
	tableErr := mpSimple(anon, "SET search_path = other; SELECT state FROM jobs WHERE id = 1; RESET search_path")
	_ = mpSimple(anon, "RESET search_path")
	readerErr := mpSimple(anon, "SET search_path = other; SELECT state FROM jobs_v WHERE id = 1; RESET search_path")
	_ = mpSimple(anon, "RESET search_path")
	cteErr := mpSimple(anon, "WITH jobs_kid AS (SELECT 1 AS id, 'x' AS state) SELECT state FROM jobs_kid")
	if readerErr != nil || cteErr != nil {
		t.Skipf("OVER-REFUSAL: a session without a lock reading other.jobs_v through search_path: %v; a CTE named jobs_kid: %v (the table's own name through search_path, other.jobs: %v)", readerErr, cteErr, tableErr)
	}
}

// TestReviewReadersLexing: with standard_conforming_strings off, a
// backslash makes the server read a reader's name where pg_query (which
// reads it on) sees a string: such a text must be refused or register,
// also when the SET is still in flight in the same pipeline.
func TestReviewReadersLexing(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rrlex")
	execDirect(t, d, rrViews)
	stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
	const trick = `SELECT 'x\' AS a, ' FROM exists_v --' AS b`
	for _, k := range []struct {
		name string
		read func(c *pgx.Conn) error
	}{
		{"SET before", func(c *pgx.Conn) error {
			if err := mpSimple(c, "SET standard_conforming_strings = off"); err != nil {
				return err
			}
			return mpSimple(c, trick)
		}},
		{"SET in flight", func(c *pgx.Conn) error {
			codes := raPipeline(t, c, 2, &pgproto3.Query{String: "SET standard_conforming_strings = off"}, &pgproto3.Query{String: trick})
			if len(codes) > 0 {
				return fmt.Errorf("%v", codes)
			}
			return nil
		}},
		{"SET in flight, extended", func(c *pgx.Conn) error {
			codes := raPipeline(t, c, 1,
				&pgproto3.Parse{Query: "SET standard_conforming_strings = off"}, &pgproto3.Bind{}, &pgproto3.Execute{},
				&pgproto3.Parse{Query: trick}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{})
			if len(codes) > 0 {
				return fmt.Errorf("%v", codes)
			}
			return nil
		}},
	} {
		t.Run(k.name, func(t *testing.T) {
			r := rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol, k.read)
			if r.readErr != nil && strings.Contains(r.readErr.Error(), "FP003") {
				if r.mark != 41 {
					t.Errorf("refused, yet the watermark moved to %d", r.mark)
				}
				return
			}
			rrJudge(t, trick+" with standard_conforming_strings off ("+k.name+")", r)
		})
	}
}

// TestReviewReadersRowSecurity: a row security policy of plain reads
// acct: a role subject to it reads acct's rows (their existence) through
// plain, which no catalog reader lists.
func TestReviewReadersRowSecurity(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rrrls")
	execDirect(t, d, `
DO $$BEGIN CREATE ROLE rr_rls LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END$$;
GRANT SELECT, UPDATE ON acct, plain TO rr_rls;
INSERT INTO plain (id, payload) VALUES (3, 'visible while acct row 3 says c');
CREATE POLICY plain_by_acct ON plain USING (EXISTS (SELECT FROM acct WHERE acct.id = plain.id AND acct.payload = 'c'));
ALTER TABLE plain ENABLE ROW LEVEL SECURITY;
`)
	stale := rrStale(t, p, db, pgx.QueryExecModeSimpleProtocol)
	execDirect(t, d, "UPDATE fenceproxy.locks SET token = 41 WHERE name = 'L'")
	fresh := connectDSN(t, p.DSN("rr_rls", "", db), func(c *pgx.ConnConfig) {
		c.RuntimeParams["fence.lock"], c.RuntimeParams["fence.token"] = "L", "42"
	})
	var n int
	if err := fresh.QueryRow(ctxT(t), "SELECT count(*) FROM plain WHERE id = $1", 3).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("plain row 3 visible %d times, want 1 (the policy reads acct)", n)
	}
	r := rrResult{mark: lockWatermark(t, d, "L")}
	before := tableText(t, d, "acct")
	_, r.staleErr = stale.Exec(ctxT(t), "UPDATE acct SET payload = 'stale' WHERE id = $1", 3)
	if after := tableText(t, d, "acct"); after != before {
		r.changed, r.diff = true, "\n before "+before+"\n after  "+after
	}
	rrJudge(t, "SELECT count(*) FROM plain (its row security policy reads acct)", r)
}

// rrParts is the number of partitions of TestReviewReadersManyPartitions.
const rrParts = 1500

// TestReviewReadersManyPartitions: a lock-fenced partitioned table with
// rrParts partitions (each a reader): the read through a partition
// registers; the times of the catalog check, of a read through the last
// partition and of a text naming none of them are logged (measured, not
// asserted: the machines are shared).
func TestReviewReadersManyPartitions(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	cfg := rules.Config{Tables: []rules.Table{{Table: "public.events"}}}
	p, specs := raProxyFor(t, cfg)
	db := schemaDB(t, "rrparts", fmt.Sprintf(`
CREATE TABLE events (id bigint NOT NULL, payload text, last_fence bigint NOT NULL DEFAULT 0) PARTITION BY RANGE (id);
DO $$BEGIN FOR i IN 0..%d LOOP
	EXECUTE format('CREATE TABLE events_p%%s PARTITION OF events FOR VALUES FROM (%%s) TO (%%s)', i, i * 10, i * 10 + 10);
END LOOP; END$$;
INSERT INTO events (id, payload) SELECT g, 'x' FROM generate_series(0, %d) g;
CREATE TABLE unrelated (id bigint PRIMARY KEY, body text);
`, rrParts-1, rrParts*10-1))
	d := direct(t, db)
	if _, err := dbsetup.Setup(ctxT(t), d, specs, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	last := fmt.Sprintf("events_p%d", rrParts-1)
	stale := readerSession(t, p, db, "L", "41", pgx.QueryExecModeCacheStatement)
	mustExec(t, stale, "SELECT count(*) FROM events WHERE id = $1", 1)

	// A view created directly: the time until the proxy registers a read
	// through it is the notification and one catalog check.
	start := time.Now()
	execDirect(t, d, "CREATE VIEW events_v AS SELECT id, payload FROM "+last)
	probe := readerSession(t, p, db, "P", "1", pgx.QueryExecModeSimpleProtocol)
	for lockWatermark(t, d, "P") != 1 {
		if time.Since(start) > 10*time.Second {
			t.Fatal("a read through a new view did not register within 10s")
		}
		mustExec(t, probe, "SELECT id FROM events_v LIMIT 0")
		time.Sleep(5 * time.Millisecond)
	}
	seen := time.Since(start)

	fresh := readerSession(t, p, db, "L", "42", pgx.QueryExecModeCacheStatement)
	const n = 200
	start = time.Now()
	for i := 0; i < n; i++ {
		var s string
		if err := fresh.QueryRow(ctxT(t), "SELECT payload FROM "+last+" WHERE id = $1", rrParts*10-1).Scan(&s); err != nil {
			t.Fatal(err)
		}
	}
	perRead := time.Since(start) / n
	if w := lockWatermark(t, d, "L"); w != 42 {
		t.Errorf("watermark %d after reads of %s, want 42", w, last)
	}
	before := tableText(t, d, "events")
	if _, err := stale.Exec(ctxT(t), "UPDATE events SET payload = 'stale' WHERE id = $1", 5); rvCode(err) != "FP001" {
		t.Errorf("stale UPDATE: %v, want FP001", err)
	}
	if after := tableText(t, d, "events"); after != before {
		t.Error("events changed")
	}

	// Many distinct texts naming partitions (no cache hit), and a large
	// text that names none.
	anon := readerSession(t, p, db, "", "", pgx.QueryExecModeSimpleProtocol)
	start = time.Now()
	for i := 0; i < n; i++ {
		mustExec(t, fresh, fmt.Sprintf("SELECT count(*) FROM events_p%d WHERE id > $1", i*7%rrParts), -1)
	}
	perDistinct := time.Since(start) / n
	var b strings.Builder
	b.WriteString("INSERT INTO unrelated VALUES ")
	for i := 0; i < 5000; i++ {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "(%d, 'events_px partition text %d')", i, i)
	}
	start = time.Now()
	if err := mpSimple(anon, b.String()); err != nil {
		t.Fatal(err)
	}
	large := time.Since(start)
	t.Logf("%d partitions: new view seen after %v; %v per cached read of a partition; %v per distinct text; %v for a %d-byte INSERT naming none",
		rrParts, seen, perRead, perDistinct, large, b.Len())
}

// TestReviewReadersPgBouncer: the proxy in front of PgBouncer in
// transaction mode, with the database checker and the catalog watch
// connected directly: reads through readers register.
func TestReviewReadersPgBouncer(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, hijackRules)
	b := pgbouncer.StartOptions(t, cluster.Addr(), pgbouncer.Options{
		PoolMode: "transaction", PoolSize: 2, IgnoreStartupParameters: poolerIgnored, Users: []string{"postgres"},
	})
	p := proxytest.Start(t, b.Addr(), proxy.Options{Policy: pol, Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)).Named("proxy")})
	db, d := rvSetupDB(t, specs, "rrbouncer")
	execDirect(t, d, rrViews+mpPathSchema+"ALTER TABLE pparent ATTACH PARTITION acct FOR VALUES FROM (0) TO (1000)")
	for i, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
		execDirect(t, d, "UPDATE fenceproxy.locks SET token = 41 WHERE name = 'L'")
		stale := rrStale(t, p, db, mode)
		for _, q := range []string{"SELECT payload FROM exists_v WHERE id = $1", "SELECT payload FROM s.w WHERE id = $1", "SELECT payload FROM pparent WHERE id = $1"} {
			r := rrRound(t, p, db, d, stale, mode, func(c *pgx.Conn) error {
				var s string
				return c.QueryRow(ctxT(t), q, 3).Scan(&s)
			})
			rrJudge(t, fmt.Sprintf("%v through PgBouncer: %s", mode, q), r)
		}
		// A newly created view, once seen.
		r := rrRound(t, p, db, d, stale, mode, func(c *pgx.Conn) error {
			later := fmt.Sprintf("later_%d", i)
			execDirect(t, d, "CREATE VIEW "+later+" AS SELECT * FROM exists_v")
			rrSeen(t, p, db, d)
			var s string
			return c.QueryRow(ctxT(t), "SELECT payload FROM "+later+" WHERE id = $1", 3).Scan(&s)
		})
		rrJudge(t, fmt.Sprintf("%v through PgBouncer: a view created while running", mode), r)
	}
}
