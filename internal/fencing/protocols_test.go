package fencing_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/lib/pq"
)

// client is one way of sending a statement: a driver and a protocol.
type client struct {
	name string
	// connect opens a session through the proxy to db.
	connect func(t *testing.T, e *env, db string) execer
	// literal: the client sends no parameters (the simple query protocol),
	// so $1 in a step is replaced by its value.
	literal bool
}

// execer runs one statement and reports rows affected and the SQLSTATE of
// a failure.
type execer func(ctx context.Context, sql string, args ...any) (rows int64, err error)

var clients = []client{
	pgxClient(pgx.QueryExecModeCacheStatement),
	pgxClient(pgx.QueryExecModeCacheDescribe),
	pgxClient(pgx.QueryExecModeDescribeExec),
	pgxClient(pgx.QueryExecModeExec),
	pgxClient(pgx.QueryExecModeSimpleProtocol),
	// lib/pq sends a statement without arguments as a simple Query, and
	// one with arguments through the unnamed statement of the extended
	// protocol.
	{name: "lib-pq/simple", literal: true, connect: pqConnect},
	{name: "lib-pq/extended", connect: pqConnect},
}

func pgxClient(mode pgx.QueryExecMode) client {
	return client{name: "pgx/" + mode.String(), connect: func(t *testing.T, e *env, db string) execer {
		c := e.connect(t, db, func(cfg *pgx.ConnConfig) { cfg.DefaultQueryExecMode = mode })
		return func(ctx context.Context, sql string, args ...any) (int64, error) {
			return execRows(ctx, c, sql, args...)
		}
	}}
}

func pqConnect(t *testing.T, e *env, db string) execer {
	c := pinnedPQ(t, e.proxy.DSN("postgres", "", db))
	return func(ctx context.Context, sql string, args ...any) (int64, error) {
		res, err := c.ExecContext(ctx, sql, args...)
		if err != nil {
			return 0, err
		}
		return res.RowsAffected()
	}
}

// pinnedPQ opens one lib/pq session (a database/sql Conn, so that session
// settings stick), closed when the test ends.
func pinnedPQ(t testing.TB, dsn string) *sql.Conn {
	t.Helper()
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	c, err := db.Conn(ctxT(t))
	if err != nil {
		t.Fatalf("lib/pq connect: %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// anyCode returns the SQLSTATE of a pgx or lib/pq error, or "".
func anyCode(err error) string {
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		return string(pqErr.Code)
	}
	return sqlState(err)
}

func itoa(i int) string { return strconv.Itoa(i) }

// testProtocols runs the core checks (stale UPDATE, upsert and DELETE,
// missing token, refusal) through every pgx query mode and lib/pq, so both
// the simple and the extended protocol carry fenced writes and their
// errors.
func testProtocols(t *testing.T, e *env) {
	for _, cl := range clients {
		t.Run(cl.name, func(t *testing.T) {
			t.Parallel()
			db := e.newDB(t)
			d := direct(t, db)
			ex := cl.connect(t, e, db)
			ctx := ctxT(t)
			// step runs sql with arg as $1 (spliced in for literal
			// clients: test SQL only) and checks the outcome: rows
			// affected, or the SQLSTATE of the error.
			step := func(sql string, arg any, wantRows int64, wantCode string) {
				t.Helper()
				var args []any
				if arg != nil {
					if cl.literal {
						sql = strings.ReplaceAll(sql, "$1", fmt.Sprint(arg))
					} else {
						args = []any{arg}
					}
				}
				before := snapshot(t, d, tError)
				n, err := ex(ctx, sql, args...)
				switch code := anyCode(err); {
				case wantCode != "" && code != wantCode:
					t.Fatalf("%s: %d rows, %v (SQLSTATE %q); want SQLSTATE %s", sql, n, err, code, wantCode)
				case wantCode != "":
					wantUnchanged(t, d, tError, before)
				case err != nil:
					t.Fatalf("%s: %v", sql, err)
				case n != wantRows:
					t.Fatalf("%s: %d rows, want %d", sql, n, wantRows)
				}
			}
			token := func(tok string) {
				t.Helper()
				step("SET fence.token = '"+tok+"'", nil, 0, "")
			}

			token("42")
			step("UPDATE acct SET n = n + 1 WHERE id = $1", 1, 1, "")
			step("INSERT INTO acct (id, payload) VALUES ($1, 'x') ON CONFLICT (id) DO UPDATE SET n = acct.n + 1", 2, 1, "")
			step("UPDATE acct_skip SET n = n + 1 WHERE id = $1", 1, 1, "")
			wantRow(t, d, tError, 1, 1, 42)
			wantRow(t, d, tError, 2, 1, 42)

			token("41")
			step("UPDATE acct SET n = n + 1 WHERE id = $1", 1, 0, "FP001")
			step("INSERT INTO acct (id, payload) VALUES ($1, 'x') ON CONFLICT (id) DO UPDATE SET n = acct.n + 1", 2, 0, "FP001")
			step("DELETE FROM acct WHERE id = $1", 1, 0, "FP001")
			step("UPDATE acct_skip SET n = n + 1 WHERE id = $1", 1, 0, "")
			// A new row is not fenced by another row's watermark (the
			// documented limit of row-level fencing): stamped 41.
			step("INSERT INTO acct (id, payload) VALUES ($1, 'new')", 9, 1, "")
			wantRow(t, d, tError, 9, 0, 41)

			step("RESET fence.token", nil, 0, "")
			step("INSERT INTO acct (id, payload) VALUES ($1, 'x')", 10, 0, "FP002")
			step("UPDATE acct SET n = n + 1 WHERE id = $1", 3, 0, "FP002")

			token("43")
			step("DELETE FROM acct WHERE id = $1", 1, 1, "")
			step("UPDATE acct SET n = n + 1 WHERE id = $1", 2, 1, "")
			wantRow(t, d, tError, 2, 2, 43)

			step("TRUNCATE acct", nil, 0, "FP003")
			step("SELECT 1", nil, 1, "")
		})
	}

	// A stale statement in a pipeline of the extended protocol: the
	// batch is one implicit transaction, so the write before it is
	// rolled back and the statements after it are skipped.
	t.Run("pgx/batch", func(t *testing.T) {
		t.Parallel()
		db := e.newDB(t)
		d := direct(t, db)
		setFences(t, d, tError, map[int64]int64{1: 42})
		before := snapshot(t, d, tError)
		c := e.connect(t, db)
		ctx := ctxT(t)
		b := &pgx.Batch{}
		b.Queue("SELECT set_config('fence.token', $1, false)", "41")
		b.Queue("UPDATE acct SET n = n + 1 WHERE id = $1", 2)
		b.Queue("UPDATE acct SET n = n + 1 WHERE id = $1", 1)
		b.Queue("UPDATE acct SET n = n + 1 WHERE id = $1", 3)
		br := c.SendBatch(ctx, b)
		var errs []string
		for range b.Len() {
			_, err := br.Exec()
			errs = append(errs, anyCode(err))
		}
		if err := br.Close(); err != nil && anyCode(err) != "FP001" {
			t.Fatal(err)
		}
		if want := []string{"", "", "FP001", "FP001"}; strings.Join(errs, ",") != strings.Join(want, ",") {
			t.Errorf("batch results: SQLSTATEs %q, want %q", errs, want)
		}
		wantUnchanged(t, d, tError, before)
		selectOne(t, c)
	})
}
