package fencing_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// ORMs map every column of a row, the fence column included, and send the
// values as parameters of the extended protocol: the statement text has a
// parameter where the fence column's value goes. The rewrite must keep
// every parameter the client sent, with the type it would have had
// (docs/design.md, "Safety invariants"), while the stored fence value is the token, never the
// client's.

// ormClient runs a statement with parameters the way one driver does.
type ormClient struct {
	name    string
	connect func(t *testing.T, e *env, db string) execer
}

var ormClients = []ormClient{
	ormPgx(pgx.QueryExecModeExec),
	ormPgx(pgx.QueryExecModeDescribeExec),
	ormPgx(pgx.QueryExecModeCacheStatement),
	ormPgx(pgx.QueryExecModeCacheDescribe),
	// pgx with a named statement prepared explicitly.
	{name: "pgx/prepared", connect: func(t *testing.T, e *env, db string) execer {
		c := e.connect(t, db)
		n := 0
		return func(ctx context.Context, sql string, args ...any) (int64, error) {
			n++
			name := fmt.Sprintf("orm_%d", n)
			if _, err := c.Prepare(ctx, name, sql); err != nil {
				return 0, err
			}
			return execRows(ctx, c, name, args...)
		}
	}},
	// lib/pq prepares the unnamed statement (Parse, Describe) and then
	// binds text parameters.
	{name: "lib-pq/exec", connect: pqConnect},
	// database/sql Prepare: a named statement of lib/pq.
	{name: "lib-pq/prepare", connect: func(t *testing.T, e *env, db string) execer {
		c := pinnedPQ(t, e.proxy.DSN("postgres", "", db))
		return func(ctx context.Context, sql string, args ...any) (int64, error) {
			st, err := c.PrepareContext(ctx, sql)
			if err != nil {
				return 0, err
			}
			defer st.Close()
			res, err := st.ExecContext(ctx, args...)
			if err != nil {
				return 0, err
			}
			return res.RowsAffected()
		}
	}},
}

func ormPgx(mode pgx.QueryExecMode) ormClient {
	return ormClient{name: "pgx/" + mode.String(), connect: func(t *testing.T, e *env, db string) execer {
		c := e.connect(t, db, func(cfg *pgx.ConnConfig) { cfg.DefaultQueryExecMode = mode })
		return func(ctx context.Context, sql string, args ...any) (int64, error) {
			return execRows(ctx, c, sql, args...)
		}
	}}
}

// The ORM statements of the issue, on table %[1]s.
const (
	ormUpdate = "UPDATE %[1]s SET payload = $1, last_fence = $2 WHERE id = $3"
	ormInsert = "INSERT INTO %[1]s (id, payload, last_fence) VALUES ($1, $2, $3)"
	ormUpsert = "INSERT INTO %[1]s (id, payload, last_fence) VALUES ($1, $2, $3) " +
		"ON CONFLICT (id) DO UPDATE SET payload = EXCLUDED.payload, last_fence = EXCLUDED.last_fence"
	ormMerge = "MERGE INTO %[1]s t USING src s ON t.id = s.id " +
		"WHEN MATCHED THEN UPDATE SET payload = $1, last_fence = $2 " +
		"WHEN NOT MATCHED THEN INSERT (id, payload, last_fence) VALUES ($3, $1, $2)"
)

// TestORMColumns runs the ORM statements through every driver and query
// mode with a fresh token, then with a stale one, and checks what is stored.
func TestORMColumns(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	for _, cl := range ormClients {
		t.Run(cl.name, func(t *testing.T) {
			t.Parallel()
			db := e.newDB(t)
			d := direct(t, db)
			ex := cl.connect(t, e, db)
			ctx := ctxT(t)
			token := func(tok string) {
				t.Helper()
				if _, err := ex(ctx, "SELECT pg_catalog.set_config('fence.token', $1, false)", tok); err != nil {
					t.Fatalf("set token %s: %v", tok, err)
				}
			}
			run := func(sql string, args ...any) (int64, error) {
				t.Helper()
				return ex(ctx, sql, args...)
			}
			mustRun := func(want int64, sql string, args ...any) {
				t.Helper()
				n, err := run(sql, args...)
				if err != nil {
					t.Fatalf("%s %v: %v", sql, args, err)
				}
				if n != want {
					t.Fatalf("%s %v: %d rows, want %d", sql, args, n, want)
				}
			}
			want := func(table string, id int64, payload string, fence int64) {
				t.Helper()
				r, ok := snapshot(t, d, table)[id]
				if !ok || r.Payload != payload || r.Fence != fence {
					t.Fatalf("%s row %d = %+v (present %v), want payload %q fence %d", table, id, r, ok, payload, fence)
				}
			}

			// (a) a fresh token: the write happens and the fence column
			// holds the token, whatever value the client mapped to it.
			// Each round writes a row once per token, so that the strict
			// table accepts it too.
			for _, tbl := range []string{tError, tSkip, tStrict, tAllow} {
				for i, clientFence := range []int64{0, 999999999} {
					tok := int64(42 + i)
					token(fmt.Sprint(tok))
					p := fmt.Sprintf("u%d", clientFence)
					mustRun(1, fmt.Sprintf(ormUpdate, tbl), p, clientFence, int64(1))
					want(tbl, 1, p, tok)
					id := int64(100 + i)
					mustRun(1, fmt.Sprintf(ormInsert, tbl), id, "i"+p, clientFence)
					want(tbl, id, "i"+p, tok)
					mustRun(1, fmt.Sprintf(ormUpsert, tbl), int64(2), "c"+p, clientFence)
					want(tbl, 2, "c"+p, tok)
					mustRun(1, fmt.Sprintf(ormUpsert, tbl), int64(200+i), "n"+p, clientFence)
					want(tbl, int64(200+i), "n"+p, tok)
				}
				token("44")
				// src has ids 1 and 2: both rows are matched and updated.
				// (lib/pq reports no row count for MERGE: the data tells.)
				if _, err := run(fmt.Sprintf(ormMerge, tbl), "m", int64(999999999), int64(7)); err != nil {
					t.Fatalf("%s: %v", fmt.Sprintf(ormMerge, tbl), err)
				}
				want(tbl, 1, "m", 44)
				want(tbl, 2, "m", 44)
			}

			// (b) a stale token: the rows carry 50, the token is 42 (and
			// 50 for the strict table, where an equal token is stale).
			for _, tbl := range []string{tError, tSkip, tStrict} {
				resetTable(t, d, tbl)
				setFences(t, d, tbl, map[int64]int64{1: 50, 2: 50})
				tok := "42"
				if tbl == tStrict {
					tok = "50"
				}
				token(tok)
				before := snapshot(t, d, tbl)
				for _, c := range []struct {
					sql  string
					args []any
				}{
					{ormUpdate, []any{"stale", int64(999999999), int64(1)}},
					{ormUpdate, []any{"stale", int64(0), int64(1)}},
					{ormUpsert, []any{int64(2), "stale", int64(999999999)}},
					{ormUpsert, []any{int64(2), "stale", int64(0)}},
					{ormMerge, []any{"stale", int64(999999999), int64(7)}},
				} {
					sql := fmt.Sprintf(c.sql, tbl)
					n, err := run(sql, c.args...)
					if tbl == tSkip {
						// lib/pq reports 0 rows for every MERGE.
						if err != nil || n != 0 {
							t.Fatalf("%s %v: %d rows, %v; want 0 rows", sql, c.args, n, err)
						}
					} else if code := anyCode(err); code != "FP001" {
						t.Fatalf("%s %v: %d rows, %v (SQLSTATE %q); want FP001", sql, c.args, n, err, code)
					}
					wantUnchanged(t, d, tbl, before)
				}
			}
		})
	}
}

// ormShapes are statements an ORM may send, on table %[1]s, whose
// parameter description through the proxy must equal PostgreSQL's own.
var ormShapes = []string{
	ormUpdate,
	ormUpdate + " RETURNING id, payload, last_fence",
	"UPDATE %[1]s SET last_fence = $1, payload = $2 WHERE id = $3",
	"UPDATE %[1]s SET payload = $1, n = $2, last_fence = $3 WHERE id = $4 AND last_fence = $3",
	"UPDATE %[1]s SET (payload, last_fence) = ($1, $2) WHERE id = $3",
	"UPDATE %[1]s SET (last_fence, payload) = ROW($1, $2) WHERE id = $3",
	"UPDATE %[1]s SET payload = $1, last_fence = DEFAULT WHERE id = $2",
	"UPDATE %[1]s SET payload = $1, last_fence = $2::int WHERE id = $3",
	"UPDATE %[1]s SET payload = $1, last_fence = $2 + 1 WHERE id = $3",
	ormInsert,
	ormInsert + " RETURNING *",
	"INSERT INTO %[1]s (id, payload, last_fence) VALUES ($1, $2, DEFAULT)",
	"INSERT INTO %[1]s (last_fence, id, payload) VALUES ($1, $2, $3)",
	"INSERT INTO %[1]s (id, payload, last_fence) VALUES ($1, $2, $3), ($4, $5, $6)",
	"INSERT INTO %[1]s (id, payload, last_fence) VALUES ($1, $2, $3), ($4, $5, $6), ($7, $8, $9)",
	"INSERT INTO %[1]s (id, payload, n, last_fence) VALUES ($1, $2, $3, $4), ($5, $6, $7, $8) RETURNING id, last_fence",
	ormUpsert,
	ormUpsert + " RETURNING last_fence",
	"INSERT INTO %[1]s (id, payload, last_fence) VALUES ($1, $2, $3) ON CONFLICT (id) DO UPDATE SET payload = $4, last_fence = $5",
	"INSERT INTO %[1]s (id, payload, last_fence) VALUES ($1, $2, $3), ($4, $5, $6) " +
		"ON CONFLICT (id) DO UPDATE SET payload = EXCLUDED.payload, last_fence = EXCLUDED.last_fence",
	"INSERT INTO %[1]s (id, payload, last_fence) VALUES ($1, $2, $3) ON CONFLICT (id) DO NOTHING",
	"INSERT INTO %[1]s (id, payload, last_fence) SELECT $1, $2, $3",
	"INSERT INTO %[1]s (id, payload, last_fence) SELECT $1::bigint, $2::text, $3::bigint",
	ormMerge,
	"MERGE INTO %[1]s t USING (SELECT $3::bigint AS id) s ON t.id = s.id " +
		"WHEN MATCHED THEN UPDATE SET payload = $1, last_fence = $2 " +
		"WHEN NOT MATCHED THEN INSERT (id, payload, last_fence) VALUES ($3, $1, $2)",
	"MERGE INTO %[1]s t USING src s ON t.id = s.id " +
		"WHEN MATCHED AND t.n = $4 THEN UPDATE SET (payload, last_fence) = ($1, $2) " +
		"WHEN MATCHED THEN DELETE " +
		"WHEN NOT MATCHED THEN INSERT (id, payload, last_fence) VALUES ($3, $1, DEFAULT)",
	"WITH u AS (UPDATE %[1]s SET payload = $1, last_fence = $2 WHERE id = $3 RETURNING *) SELECT * FROM u",
	"UPDATE %[1]s a SET payload = $1, last_fence = $2 FROM src s WHERE a.id = s.id AND s.v = $3",
	"UPDATE %[1]s SET payload = $1, last_fence = COALESCE($2, 0) WHERE id = $3",
	"INSERT INTO %[1]s AS a (id, payload, last_fence) VALUES ($1, $2, $3) " +
		"ON CONFLICT (id) DO UPDATE SET payload = $2, last_fence = $3 WHERE a.last_fence <= $3 RETURNING a.last_fence",
	"INSERT INTO %[1]s (id, payload, last_fence) SELECT $1, $2, $3 FROM src WHERE v = $4",
	"DELETE FROM %[1]s WHERE id = $1 AND last_fence = $2",
	"DELETE FROM %[1]s WHERE id = $1 RETURNING last_fence",
}

// TestORMParamTypes prepares every shape on every protected table through
// the proxy and directly, and compares the parameter types and the result
// columns PostgreSQL describes.
func TestORMParamTypes(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	db := e.newDB(t)
	ctx := ctxT(t)
	viaProxy := e.connect(t, db).PgConn()
	viaDirect := direct(t, db).PgConn()
	for _, tbl := range []string{tError, tSkip, tStrict, tAllow} {
		for _, shape := range ormShapes {
			sql := fmt.Sprintf(shape, tbl)
			want, err := viaDirect.Prepare(ctx, "", sql, nil)
			if err != nil {
				t.Errorf("direct: %s: %v", sql, err)
				continue
			}
			got, err := viaProxy.Prepare(ctx, "", sql, nil)
			if err != nil {
				t.Errorf("proxy: %s: %v", sql, err)
				continue
			}
			if tbl == tError {
				t.Logf("%s: params %v", sql, got.ParamOIDs)
			}
			if !slices.Equal(got.ParamOIDs, want.ParamOIDs) {
				t.Errorf("%s:\n param OIDs direct %v\n           proxy  %v", sql, want.ParamOIDs, got.ParamOIDs)
			}
			if g, w := fieldsString(got.Fields), fieldsString(want.Fields); g != w {
				t.Errorf("%s:\n fields direct %s\n        proxy  %s", sql, w, g)
			}
		}
	}
}

func fieldsString(fs []pgconn.FieldDescription) string {
	var b strings.Builder
	for _, f := range fs {
		fmt.Fprintf(&b, "{%s table=%d attr=%d type=%d size=%d mod=%d fmt=%d}",
			f.Name, f.TableOID, f.TableAttributeNumber, f.DataTypeOID, f.DataTypeSize, f.TypeModifier, f.Format)
	}
	return b.String()
}
