package fencing_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
)

// formKind says how a statement form touches its table, and so how a test
// tells an accepted run from a rejected one.
type formKind int

const (
	// kindUpdate changes existing rows (targets); every accepted run
	// increments their n.
	kindUpdate formKind = iota
	// kindDelete removes existing rows (targets).
	kindDelete
	// kindInsert adds rows whose ids are targets.
	kindInsert
	// kindRefused is never forwarded: FP003 whatever the token.
	kindRefused
)

// result is what a form's run reports: rows affected (-1 when the command
// does not report them) and, for RETURNING forms, the fence values returned.
type result struct {
	rows   int64
	fences []int64
}

// form is one way of writing a protected table. Its SQL takes the table
// name as %[1]s.
type form struct {
	name    string
	kind    formKind
	targets []int64 // kindInsert: nil accepts any new ids
	rows    int64   // rows reported by an accepted run; -1: not reported
	// skipRefused: refused (FP003) on an on_stale: skip table.
	skipRefused bool
	// prepare runs once per session, before any token is set (to show
	// that a prepared statement reads the token when it executes).
	prepare func(ctx context.Context, c *pgx.Conn, table string) error
	run     func(ctx context.Context, c *pgx.Conn, table string) (result, error)
}

// execForm is a form run by pgx's default (extended, cached statement) mode.
func execForm(sql string) func(context.Context, *pgx.Conn, string) (result, error) {
	return func(ctx context.Context, c *pgx.Conn, table string) (result, error) {
		n, err := execRows(ctx, c, fmt.Sprintf(sql, table))
		return result{rows: n}, err
	}
}

// returningForm runs a statement whose RETURNING list is (id, last_fence).
func returningForm(sql string) func(context.Context, *pgx.Conn, string) (result, error) {
	return func(ctx context.Context, c *pgx.Conn, table string) (result, error) {
		rows, err := c.Query(ctx, fmt.Sprintf(sql, table))
		if err != nil {
			return result{}, err
		}
		var res result
		for rows.Next() {
			var id, fence int64
			if err := rows.Scan(&id, &fence); err != nil {
				rows.Close()
				return result{}, err
			}
			res.fences = append(res.fences, fence)
		}
		res.rows = int64(len(res.fences))
		return res, rows.Err()
	}
}

// countForm runs a SELECT that returns the number of rows written (a
// writable CTE).
func countForm(sql string) func(context.Context, *pgx.Conn, string) (result, error) {
	return func(ctx context.Context, c *pgx.Conn, table string) (result, error) {
		var n int64
		err := c.QueryRow(ctx, fmt.Sprintf(sql, table)).Scan(&n)
		return result{rows: n}, err
	}
}

var forms = []form{
	// UPDATE.
	{name: "update/plain", kind: kindUpdate, targets: []int64{1}, rows: 1,
		run: execForm(`UPDATE %[1]s SET n = n + 1 WHERE id = 1`)},
	{name: "update/alias", kind: kindUpdate, targets: []int64{1}, rows: 1,
		run: execForm(`UPDATE %[1]s AS a SET n = a.n + 1 WHERE a.id = 1`)},
	{name: "update/from-join", kind: kindUpdate, targets: []int64{1, 2}, rows: 2,
		run: execForm(`UPDATE %[1]s a SET n = a.n + s.v FROM src s WHERE s.id = a.id AND a.id IN (1, 2)`)},
	{name: "update/returning", kind: kindUpdate, targets: []int64{1, 3}, rows: 2,
		run: returningForm(`UPDATE %[1]s SET n = n + 1 WHERE id IN (1, 3) RETURNING id, last_fence`)},
	{name: "update/only", kind: kindUpdate, targets: []int64{2}, rows: 1,
		run: execForm(`UPDATE ONLY %[1]s SET n = n + 1 WHERE id = 2`)},
	{name: "update/where-current-of", kind: kindUpdate, targets: []int64{1}, rows: 1, skipRefused: true,
		run: func(ctx context.Context, c *pgx.Conn, table string) (result, error) {
			tx, err := c.Begin(ctx)
			if err != nil {
				return result{}, err
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, fmt.Sprintf(`DECLARE cur CURSOR FOR SELECT id FROM %s WHERE id = 1 FOR UPDATE`, table)); err != nil {
				return result{}, err
			}
			if _, err := tx.Exec(ctx, `FETCH cur`); err != nil {
				return result{}, err
			}
			tag, err := tx.Exec(ctx, fmt.Sprintf(`UPDATE %s SET n = n + 1 WHERE CURRENT OF cur`, table))
			if err != nil {
				return result{}, err
			}
			return result{rows: tag.RowsAffected()}, tx.Commit(ctx)
		}},
	// The proxy owns the fence column: a client's value is overridden.
	{name: "update/assigns-fence", kind: kindUpdate, targets: []int64{1}, rows: 1,
		run: returningForm(`UPDATE %[1]s SET n = n + 1, last_fence = 1000000 WHERE id = 1 RETURNING id, last_fence`)},
	{name: "update/assigns-fence-zero", kind: kindUpdate, targets: []int64{1}, rows: 1,
		run: returningForm(`UPDATE %[1]s SET last_fence = 0, n = n + 1 WHERE id = 1 RETURNING id, last_fence`)},
	{name: "update/assigns-fence-multi-column", kind: kindUpdate, targets: []int64{1}, rows: 1,
		run: returningForm(`UPDATE %[1]s SET (n, last_fence) = (n + 1, 0) WHERE id = 1 RETURNING id, last_fence`)},
	{name: "update/writable-cte", kind: kindUpdate, targets: []int64{1}, rows: 1,
		run: countForm(`WITH u AS (UPDATE %[1]s SET n = n + 1 WHERE id = 1 RETURNING *) SELECT count(*) FROM u`)},
	{name: "update/prepare-execute", kind: kindUpdate, targets: []int64{2}, rows: 1,
		prepare: func(ctx context.Context, c *pgx.Conn, table string) error {
			_, err := c.PgConn().Exec(ctx, fmt.Sprintf(`PREPARE upd(int, bigint) AS UPDATE %s SET n = n + $1 WHERE id = $2`, table)).ReadAll()
			return err
		},
		run: func(ctx context.Context, c *pgx.Conn, table string) (result, error) {
			res, err := c.PgConn().Exec(ctx, `EXECUTE upd(1, 2)`).ReadAll()
			if err != nil {
				return result{}, err
			}
			return result{rows: res[0].CommandTag.RowsAffected()}, nil
		}},
	{name: "update/multi-statement", kind: kindUpdate, targets: []int64{1, 2}, rows: 2,
		run: func(ctx context.Context, c *pgx.Conn, table string) (result, error) {
			sql := fmt.Sprintf(`UPDATE src SET v = v WHERE id = 1; UPDATE %[1]s SET n = n + 1 WHERE id = 1; SELECT 1; UPDATE %[1]s AS x SET n = x.n + 1 WHERE x.id = 2`, table)
			res, err := c.PgConn().Exec(ctx, sql).ReadAll()
			if err != nil {
				return result{}, err
			}
			return result{rows: res[1].CommandTag.RowsAffected() + res[3].CommandTag.RowsAffected()}, nil
		}},
	{name: "update/pgx-prepared", kind: kindUpdate, targets: []int64{3}, rows: 1,
		prepare: func(ctx context.Context, c *pgx.Conn, table string) error {
			_, err := c.Prepare(ctx, "pgx_upd", fmt.Sprintf(`UPDATE %s SET n = n + $1 WHERE id = $2`, table))
			return err
		},
		run: func(ctx context.Context, c *pgx.Conn, table string) (result, error) {
			n, err := execRows(ctx, c, "pgx_upd", 1, int64(3))
			return result{rows: n}, err
		}},
	{name: "update/explain-analyze", kind: kindUpdate, targets: []int64{1}, rows: -1,
		run: func(ctx context.Context, c *pgx.Conn, table string) (result, error) {
			_, err := c.PgConn().Exec(ctx, fmt.Sprintf(`EXPLAIN ANALYZE UPDATE %s SET n = n + 1 WHERE id = 1`, table)).ReadAll()
			return result{rows: -1}, err
		}},

	// DELETE.
	{name: "delete/plain", kind: kindDelete, targets: []int64{1}, rows: 1,
		run: execForm(`DELETE FROM %[1]s WHERE id = 1`)},
	{name: "delete/using", kind: kindDelete, targets: []int64{1, 2}, rows: 2,
		run: execForm(`DELETE FROM %[1]s a USING src s WHERE s.id = a.id AND a.id IN (1, 2)`)},
	{name: "delete/returning", kind: kindDelete, targets: []int64{2}, rows: 1,
		run: returningForm(`DELETE FROM %[1]s WHERE id = 2 RETURNING id, last_fence`)},
	{name: "delete/writable-cte", kind: kindDelete, targets: []int64{3}, rows: 1,
		run: countForm(`WITH d AS (DELETE FROM %[1]s WHERE id = 3 RETURNING *) SELECT count(*) FROM d`)},

	// INSERT.
	{name: "insert/values-multi-row", kind: kindInsert, targets: []int64{10, 11}, rows: 2,
		run: execForm(`INSERT INTO %[1]s (id, payload) VALUES (10, 'x'), (11, 'y')`)},
	{name: "insert/client-fence-value", kind: kindInsert, targets: []int64{12, 13}, rows: 2,
		run: returningForm(`INSERT INTO %[1]s (id, payload, last_fence) VALUES (12, 'x', 999999), (13, 'y', DEFAULT) RETURNING id, last_fence`)},
	{name: "insert/select", kind: kindInsert, targets: []int64{101, 102}, rows: 2,
		run: execForm(`INSERT INTO %[1]s (id, payload) SELECT id + 100, 'sel' FROM src`)},
	// Identity values are consumed even by a refused insert: nil targets
	// accept any new ids.
	{name: "insert/default-values", kind: kindInsert, rows: 1,
		run: execForm(`INSERT INTO %[1]s DEFAULT VALUES`)},
	{name: "insert/returning", kind: kindInsert, rows: 2,
		run: returningForm(`INSERT INTO %[1]s (payload) VALUES ('r1'), ('r2') RETURNING id, last_fence`)},
	{name: "insert/writable-cte", kind: kindInsert, targets: []int64{30}, rows: 1,
		run: countForm(`WITH i AS (INSERT INTO %[1]s (id, payload) VALUES (30, 'c') RETURNING id) SELECT count(*) FROM i`)},
	{name: "insert/on-conflict-do-nothing", kind: kindInsert, targets: []int64{20}, rows: 1,
		run: execForm(`INSERT INTO %[1]s (id, payload) VALUES (1, 'dup'), (20, 'new') ON CONFLICT DO NOTHING`)},
	{name: "insert/no-column-list", kind: kindRefused,
		run: execForm(`INSERT INTO %[1]s VALUES (40, 'x', 0, 0)`)},
	{name: "insert/on-conflict-do-update", kind: kindUpdate, targets: []int64{1}, rows: 1,
		run: execForm(`INSERT INTO %[1]s (id, payload) VALUES (1, 'u') ON CONFLICT (id) DO UPDATE SET n = %[1]s.n + 1`)},
	{name: "insert/on-conflict-do-update-excluded", kind: kindUpdate, targets: []int64{1, 2}, rows: 2,
		run: returningForm(`INSERT INTO %[1]s AS t (id, payload, last_fence) VALUES (1, 'u', 0), (2, 'v', 0) ON CONFLICT (id) DO UPDATE SET n = t.n + 1, last_fence = excluded.last_fence RETURNING id, last_fence`)},

	// MERGE.
	{name: "merge/matched-update", kind: kindUpdate, targets: []int64{1}, rows: 1,
		run: execForm(`MERGE INTO %[1]s t USING (SELECT 1 AS id) s ON t.id = s.id WHEN MATCHED THEN UPDATE SET n = t.n + 1`)},
	{name: "merge/matched-update-condition", kind: kindUpdate, targets: []int64{1, 2}, rows: 2,
		run: execForm(`MERGE INTO %[1]s t USING src s ON t.id = s.id WHEN MATCHED AND s.v > 0 THEN UPDATE SET n = t.n + s.v WHEN MATCHED THEN DO NOTHING`)},
	{name: "merge/matched-delete", kind: kindDelete, targets: []int64{2}, rows: 1,
		run: execForm(`MERGE INTO %[1]s t USING (SELECT 2 AS id) s ON t.id = s.id WHEN MATCHED THEN DELETE`)},
	{name: "merge/not-matched-insert", kind: kindInsert, targets: []int64{500}, rows: 1,
		run: execForm(`MERGE INTO %[1]s t USING (VALUES (500, 'm')) AS s(id, p) ON t.id = s.id WHEN NOT MATCHED THEN INSERT (id, payload) VALUES (s.id, s.p)`)},
}

// formMode is a table's fencing rules and the tokens a test uses with them.
type formMode struct {
	name  string
	table string
	skip  bool    // on_stale: skip: a stale run affects 0 rows, no error
	first int64   // accepted first (on fence 0)
	stale int64   // then rejected
	then  []int64 // then accepted again
}

var formModes = []formMode{
	{name: "error", table: tError, first: 42, stale: 41, then: []int64{42, 43}},
	{name: "skip", table: tSkip, skip: true, first: 42, stale: 41, then: []int64{42, 43}},
	// strict: 41 is accepted once; 41 again is stale; 42 is accepted.
	{name: "strict", table: tStrict, first: 41, stale: 41, then: []int64{42}},
}

// testForms runs every statement form against every fencing mode: an
// accepted token stamps the rows it writes; a stale one fails with FP001
// (error, strict) or writes nothing (skip), leaving the data unchanged; a
// current one is accepted again.
func testForms(t *testing.T, e *env) {
	db := e.newDB(t)
	d := direct(t, db)
	for _, f := range forms {
		t.Run(f.name, func(t *testing.T) {
			for _, m := range formModes {
				t.Run(m.name, func(t *testing.T) {
					// A fresh session: no token, no prepared statements.
					c := e.connect(t, db)
					resetTable(t, d, m.table)
					ctx := ctxT(t)
					if f.prepare != nil {
						if err := f.prepare(ctx, c, m.table); err != nil {
							t.Fatalf("prepare: %v", err)
						}
					}
					if m.skip && f.skipRefused {
						before := snapshot(t, d, m.table)
						setTokenN(t, c, m.first)
						_, err := f.run(ctx, c, m.table)
						wantCode(t, err, "FP003")
						wantUnchanged(t, d, m.table, before)
						return
					}
					switch f.kind {
					case kindUpdate:
						runUpdateForm(t, c, d, f, m)
					case kindDelete:
						runDeleteForm(t, c, d, f, m)
					case kindInsert:
						runInsertForm(t, c, d, f, m)
					case kindRefused:
						before := snapshot(t, d, m.table)
						setTokenN(t, c, m.first)
						_, err := f.run(ctx, c, m.table)
						wantCode(t, err, "FP003")
						wantUnchanged(t, d, m.table, before)
					}
				})
			}
		})
	}
}

// acceptUpdate runs an update form with tok, which must be accepted: the
// targets change and carry tok, nothing else changes.
func acceptUpdate(t *testing.T, c, d *pgx.Conn, f form, m formMode, tok int64) {
	t.Helper()
	before := snapshot(t, d, m.table)
	setTokenN(t, c, tok)
	res, err := f.run(ctxT(t), c, m.table)
	if err != nil {
		t.Fatalf("token %d: %v", tok, err)
	}
	if f.rows >= 0 && res.rows != f.rows {
		t.Errorf("token %d: %d rows affected, want %d", tok, res.rows, f.rows)
	}
	for _, fence := range res.fences {
		if fence != tok {
			t.Errorf("token %d: RETURNING gave last_fence %d, want %d", tok, fence, tok)
		}
	}
	after := snapshot(t, d, m.table)
	for id, b := range before {
		a, ok := after[id]
		switch {
		case !ok:
			t.Errorf("token %d: row %d disappeared", tok, id)
		case slices.Contains(f.targets, id):
			if a.Fence != tok || a.N == b.N {
				t.Errorf("token %d: row %d went from %+v to %+v, want it written with fence %d", tok, id, b, a, tok)
			}
		case a != b:
			t.Errorf("token %d: row %d (not a target) went from %+v to %+v", tok, id, b, a)
		}
	}
	if len(after) != len(before) {
		t.Errorf("token %d: table went from %v to %v", tok, before, after)
	}
}

// rejectStale runs f with m's stale token: FP001, or 0 rows with
// on_stale: skip; the table must not change.
func rejectStale(t *testing.T, c, d *pgx.Conn, f form, m formMode) {
	t.Helper()
	before := snapshot(t, d, m.table)
	setTokenN(t, c, m.stale)
	res, err := f.run(ctxT(t), c, m.table)
	if m.skip {
		if err != nil {
			t.Fatalf("stale token %d with on_stale: skip: %v, want no error", m.stale, err)
		}
		if res.rows > 0 || len(res.fences) > 0 {
			t.Errorf("stale token %d with on_stale: skip: %d rows affected (%v returned), want 0", m.stale, res.rows, res.fences)
		}
	} else {
		wantCode(t, err, "FP001")
	}
	wantUnchanged(t, d, m.table, before)
}

func runUpdateForm(t *testing.T, c, d *pgx.Conn, f form, m formMode) {
	acceptUpdate(t, c, d, f, m, m.first)
	rejectStale(t, c, d, f, m)
	for _, tok := range m.then {
		acceptUpdate(t, c, d, f, m, tok)
	}
}

// runDeleteForm stamps every row with m.first (a fenced no-op UPDATE, the
// stamp of docs/design.md), then deletes with the stale token (refused) and with
// the next token (accepted).
func runDeleteForm(t *testing.T, c, d *pgx.Conn, f form, m formMode) {
	ctx := ctxT(t)
	setTokenN(t, c, m.first)
	if n, err := execRows(ctx, c, "UPDATE "+m.table+" SET payload = payload"); err != nil || n != 3 {
		t.Fatalf("stamp with %d: %d rows, %v", m.first, n, err)
	}
	for id, r := range snapshot(t, d, m.table) {
		if r.Fence != m.first {
			t.Fatalf("row %d after the stamp: %+v, want fence %d", id, r, m.first)
		}
	}
	rejectStale(t, c, d, f, m)

	tok := m.then[0]
	before := snapshot(t, d, m.table)
	setTokenN(t, c, tok)
	res, err := f.run(ctx, c, m.table)
	if err != nil {
		t.Fatalf("token %d: %v", tok, err)
	}
	if f.rows >= 0 && res.rows != f.rows {
		t.Errorf("token %d: %d rows affected, want %d", tok, res.rows, f.rows)
	}
	after := snapshot(t, d, m.table)
	for id, b := range before {
		a, ok := after[id]
		switch {
		case slices.Contains(f.targets, id):
			if ok {
				t.Errorf("token %d: row %d not deleted: %+v", tok, id, a)
			}
		case !ok || a != b:
			t.Errorf("token %d: row %d (not a target) went from %+v to %+v (present: %v)", tok, id, b, a, ok)
		}
	}
}

// runInsertForm checks that an insert without a token is refused (FP002)
// and that with m.first the new rows carry it.
func runInsertForm(t *testing.T, c, d *pgx.Conn, f form, m formMode) {
	ctx := ctxT(t)
	before := snapshot(t, d, m.table)
	resetToken(t, c)
	_, err := f.run(ctx, c, m.table)
	wantCode(t, err, "FP002")
	wantUnchanged(t, d, m.table, before)

	tok := m.first
	setTokenN(t, c, tok)
	res, err := f.run(ctx, c, m.table)
	if err != nil {
		t.Fatalf("token %d: %v", tok, err)
	}
	if f.rows >= 0 && res.rows != f.rows {
		t.Errorf("token %d: %d rows affected, want %d", tok, res.rows, f.rows)
	}
	for _, fence := range res.fences {
		if fence != tok {
			t.Errorf("token %d: RETURNING gave last_fence %d, want %d", tok, fence, tok)
		}
	}
	after := snapshot(t, d, m.table)
	if f.targets == nil && int64(len(after)-len(before)) != f.rows {
		t.Errorf("token %d: %d new rows, want %d; table %v", tok, len(after)-len(before), f.rows, after)
	}
	for id, a := range after {
		b, old := before[id]
		switch {
		case old && a != b:
			t.Errorf("token %d: existing row %d went from %+v to %+v", tok, id, b, a)
		case !old && f.targets != nil && !slices.Contains(f.targets, id):
			t.Errorf("token %d: unexpected new row %+v", tok, a)
		case !old && a.Fence != tok:
			t.Errorf("token %d: new row %+v, want fence %d", tok, a, tok)
		}
	}
	for _, id := range f.targets {
		if _, ok := after[id]; !ok {
			t.Errorf("token %d: row %d not inserted; table %v", tok, id, after)
		}
	}
}
