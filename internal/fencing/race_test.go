package fencing_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// testRace is the seed's race (docs/design.md) with real row locks: two
// sessions, tokens 41 and 42, write the same row. Whoever takes the row lock
// first, the write with 41 must never land after the one with 42.
func testRace(t *testing.T, e *env) {
	for _, tc := range []struct {
		table string
		skip  bool
	}{{tError, false}, {tSkip, true}} {
		t.Run(tc.table, func(t *testing.T) {
			t.Parallel()
			db := e.newDB(t)
			stale := map[string]string{
				"update": "UPDATE %[1]s SET n = n + 10 WHERE id = 1",
				"merge":  "MERGE INTO %[1]s t USING (SELECT 1 AS id) s ON t.id = s.id WHEN MATCHED THEN UPDATE SET n = t.n + 10",
				"upsert": "INSERT INTO %[1]s (id, payload) VALUES (1, 'x') ON CONFLICT (id) DO UPDATE SET n = %[1]s.n + 10",
				"cte":    "WITH u AS (UPDATE %[1]s SET n = n + 10 WHERE id = 1 RETURNING 1) SELECT 1 FROM u",
			}
			for name, sql := range stale {
				for _, iso := range []string{"read committed", "repeatable read"} {
					t.Run("newer-first/"+name+"/"+iso, func(t *testing.T) {
						raceNewerFirst(t, e, db, tc.table, tc.skip, iso, fmt.Sprintf(sql, tc.table))
					})
				}
			}
			// The newer holder inserts the row; the stale upsert waits for
			// that insert to commit, then takes the conflict path.
			t.Run("newer-first/upsert-after-insert", func(t *testing.T) {
				d := direct(t, db)
				resetTable(t, d, tc.table)
				ctx := ctxT(t)
				newer, older := e.connect(t, db), e.connect(t, db)
				setTokenN(t, newer, 42)
				setTokenN(t, older, 41)
				tx := begin(t, newer, "read committed")
				if n, err := execRows(ctx, tx.Conn(), "INSERT INTO "+tc.table+" (id, payload) VALUES (7, 'new')"); err != nil || n != 1 {
					t.Fatalf("INSERT with 42: %d rows, %v", n, err)
				}
				res := startBlocked(t, d, older, "INSERT INTO "+tc.table+" (id, payload) VALUES (7, 'old') ON CONFLICT (id) DO UPDATE SET payload = excluded.payload")
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				r := <-res
				if tc.skip {
					if r.err != nil || r.rows != 0 {
						t.Fatalf("stale upsert after the newer insert: %d rows, %v; want 0 rows", r.rows, r.err)
					}
				} else {
					wantCode(t, r.err, "FP001")
				}
				if r := snapshot(t, d, tc.table)[7]; r.Payload != "new" || r.Fence != 42 {
					t.Errorf("row 7 = %+v, want the newer holder's", r)
				}
			})
			t.Run("older-first", func(t *testing.T) {
				raceOlderFirst(t, e, db, tc.table)
			})
			// DELETE racing an UPDATE: the stale DELETE re-checks the row
			// version the newer holder committed.
			t.Run("newer-first/delete", func(t *testing.T) {
				d := direct(t, db)
				resetTable(t, d, tc.table)
				ctx := ctxT(t)
				newer, older := e.connect(t, db), e.connect(t, db)
				setTokenN(t, newer, 42)
				setTokenN(t, older, 41)
				tx := begin(t, newer, "read committed")
				if n, err := execRows(ctx, tx.Conn(), "UPDATE "+tc.table+" SET n = n + 1 WHERE id = 1"); err != nil || n != 1 {
					t.Fatalf("UPDATE with 42: %d rows, %v", n, err)
				}
				res := startBlocked(t, d, older, "DELETE FROM "+tc.table+" WHERE id = 1")
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				r := <-res
				if tc.skip {
					if r.err != nil || r.rows != 0 {
						t.Fatalf("stale DELETE after the newer commit: %d rows, %v; want 0 rows", r.rows, r.err)
					}
				} else {
					wantCode(t, r.err, "FP001")
				}
				wantRow(t, d, tc.table, 1, 1, 42)
			})
		})
	}
}

// raceNewerFirst: the holder of 42 updates the row and holds its lock; the
// stale holder's staleSQL (41, isolation iso) waits for it; 42 commits; 41
// must fail with FP001 (error) or affect 0 rows (skip) — or, under
// REPEATABLE READ, fail with 40001 — and never succeed.
func raceNewerFirst(t *testing.T, e *env, db, table string, skip bool, iso, staleSQL string) {
	d := direct(t, db)
	resetTable(t, d, table)
	ctx := ctxT(t)
	newer, older := e.connect(t, db), e.connect(t, db)
	setTokenN(t, newer, 42)
	setTokenN(t, older, 41)

	tx := begin(t, newer, "read committed")
	if n, err := execRows(ctx, tx.Conn(), "UPDATE "+table+" SET n = n + 1 WHERE id = 1"); err != nil || n != 1 {
		t.Fatalf("UPDATE with 42: %d rows, %v", n, err)
	}
	olderTx := begin(t, older, iso)
	res := startBlocked(t, d, older, staleSQL)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	switch code := sqlState(r.err); {
	case iso == "repeatable read" && code == "40001":
	case !skip && code == "FP001":
	case skip && r.err == nil && r.rows == 0:
	default:
		t.Errorf("UPDATE with 41 after 42 committed (%s): %d rows, %v (SQLSTATE %q)", iso, r.rows, r.err, code)
	}
	if err := olderTx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	wantRow(t, d, table, 1, 1, 42)
}

// raceOlderFirst: the holder of 41 writes first (the row has not seen 42
// yet, so it is accepted) and holds the lock; 42 waits, then proceeds after
// 41 commits: both succeed, and the row ends at 42.
func raceOlderFirst(t *testing.T, e *env, db, table string) {
	d := direct(t, db)
	resetTable(t, d, table)
	ctx := ctxT(t)
	newer, older := e.connect(t, db), e.connect(t, db)
	setTokenN(t, newer, 42)
	setTokenN(t, older, 41)

	tx := begin(t, older, "read committed")
	if n, err := execRows(ctx, tx.Conn(), "UPDATE "+table+" SET n = n + 10 WHERE id = 1"); err != nil || n != 1 {
		t.Fatalf("UPDATE with 41: %d rows, %v", n, err)
	}
	res := startBlocked(t, d, newer, "UPDATE "+table+" SET n = n + 1 WHERE id = 1")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if r := <-res; r.err != nil || r.rows != 1 {
		t.Fatalf("UPDATE with 42 after 41 committed: %d rows, %v; want 1 row", r.rows, r.err)
	}
	wantRow(t, d, table, 1, 11, 42)
}

func begin(t *testing.T, c *pgx.Conn, iso string) pgx.Tx {
	t.Helper()
	tx, err := c.BeginTx(ctxT(t), pgx.TxOptions{IsoLevel: pgx.TxIsoLevel(iso)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

type execResult struct {
	rows int64
	err  error
}

// startBlocked runs sql on c in a goroutine and returns once the server
// shows c's backend waiting for a lock held by another session (polling
// pg_stat_activity and pg_blocking_pids through d, a direct connection).
// The result arrives on the returned channel.
func startBlocked(t *testing.T, d, c *pgx.Conn, sql string) <-chan execResult {
	t.Helper()
	ctx := ctxT(t)
	var pid int32
	if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	res := make(chan execResult, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		n, err := execRows(ctx, c, sql)
		res <- execResult{n, err}
	}()
	// The goroutine must be done before the test's connections close.
	t.Cleanup(func() {
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Errorf("%s did not finish", sql)
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		var waiting bool
		err := d.QueryRow(ctx, `SELECT coalesce(wait_event_type = 'Lock', false) AND cardinality(pg_blocking_pids(pid)) > 0
			FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		if waiting {
			return res
		}
		select {
		case <-done:
			r := <-res
			t.Fatalf("%s finished without waiting for the row lock: %d rows, %v", sql, r.rows, r.err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("backend %d never waited for a lock running %s", pid, sql)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// wantRow checks row id of table: its n and fence.
func wantRow(t *testing.T, d *pgx.Conn, table string, id int64, n int32, fence int64) {
	t.Helper()
	r, ok := snapshot(t, d, table)[id]
	if !ok || r.N != n || r.Fence != fence {
		t.Errorf("%s row %d = %+v (present %v), want n %d fence %d", table, id, r, ok, n, fence)
	}
}
