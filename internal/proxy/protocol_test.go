package proxy_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestExecModes runs the same parameterised statements in every pgx query
// execution mode, which between them use the simple protocol, named
// (cached) prepared statements, unnamed statements with and without a
// Describe round trip.
func TestExecModes(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	table := newTable(t, "id int PRIMARY KEY, name text, at timestamptz")
	modes := []struct {
		name string
		mode pgx.QueryExecMode
	}{
		{"simple-protocol", pgx.QueryExecModeSimpleProtocol},
		{"cache-statement", pgx.QueryExecModeCacheStatement},
		{"cache-describe", pgx.QueryExecModeCacheDescribe},
		{"describe-exec", pgx.QueryExecModeDescribeExec},
		{"exec", pgx.QueryExecModeExec},
	}
	for i, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			cfg, err := pgx.ParseConfig(superDSN(p))
			if err != nil {
				t.Fatal(err)
			}
			cfg.DefaultQueryExecMode = m.mode
			conn := connectConfig(t, cfg)
			ctx := ctxT(t)
			name := fmt.Sprintf("it's row %d; DROP TABLE x -- $1", i)
			at := time.Date(2024, 2, 29, 12, 0, 0, 0, time.UTC)
			// Twice, so cached statements are also reused.
			for j := range 2 {
				tag, err := conn.Exec(ctx, "INSERT INTO "+table+" VALUES ($1, $2, $3)", 10*i+j, name, at)
				if err != nil {
					t.Fatalf("insert: %v", err)
				}
				if tag.RowsAffected() != 1 {
					t.Fatalf("insert affected %d rows", tag.RowsAffected())
				}
			}
			var (
				gotName string
				gotAt   time.Time
				n       int
			)
			err = conn.QueryRow(ctx, "SELECT name, at, count(*) OVER () FROM "+table+" WHERE id >= $1 AND id < $2 ORDER BY id LIMIT 1",
				10*i, 10*i+10).Scan(&gotName, &gotAt, &n)
			if err != nil {
				t.Fatalf("select: %v", err)
			}
			if gotName != name || !gotAt.Equal(at) || n != 2 {
				t.Errorf("got (%q, %v, %d), want (%q, %v, 2)", gotName, gotAt, n, name, at)
			}
			// NULLs and an empty result.
			var s *string
			if err := conn.QueryRow(ctx, "SELECT $1::text", nil).Scan(&s); err != nil || s != nil {
				t.Errorf("SELECT NULL = %v, %v", s, err)
			}
			if err := conn.QueryRow(ctx, "SELECT 1 WHERE false").Scan(&n); !errors.Is(err, pgx.ErrNoRows) {
				t.Errorf("empty result: err = %v, want ErrNoRows", err)
			}
		})
	}
}

// TestMultiStatementSimpleQuery sends several statements in one Query
// message; each has its own result and the last ReadyForQuery ends them.
func TestMultiStatementSimpleQuery(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	conn := connect(t, superDSN(p))
	ctx := ctxT(t)
	results, err := conn.PgConn().Exec(ctx, `
		CREATE TEMP TABLE multi (n int);
		INSERT INTO multi SELECT generate_series(1, 5);
		SELECT sum(n) FROM multi;
		SELECT 'a' AS x UNION ALL SELECT 'b';
		DROP TABLE multi`).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	wantTags := []string{"CREATE TABLE", "INSERT 0 5", "SELECT 1", "SELECT 2", "DROP TABLE"}
	if len(results) != len(wantTags) {
		t.Fatalf("got %d results, want %d", len(results), len(wantTags))
	}
	for i, r := range results {
		if r.Err != nil {
			t.Errorf("result %d: %v", i, r.Err)
		}
		if got := r.CommandTag.String(); got != wantTags[i] {
			t.Errorf("result %d: tag %q, want %q", i, got, wantTags[i])
		}
	}
	if got := string(results[2].Rows[0][0]); got != "15" {
		t.Errorf("sum = %s, want 15", got)
	}
	if got := string(results[3].Rows[1][0]); got != "b" {
		t.Errorf("second row = %s, want b", got)
	}

	// An error in the middle stops the rest of the string, as directly.
	const failing = "SELECT 1; SELECT 1/0; SELECT 3"
	results, err = conn.PgConn().Exec(ctx, failing).ReadAll()
	wantSQLState(t, err, "22012")
	direct, err := pgconn.Connect(ctx, cluster.SuperuserDSN("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close(ctx)
	want, _ := direct.Exec(ctx, failing).ReadAll()
	if len(results) != len(want) || len(results) == 0 || string(results[0].Rows[0][0]) != "1" {
		t.Errorf("got %d results before the error stopped the string, want the %d of a direct connection", len(results), len(want))
	}
	selectOne(t, conn)
}

// TestPreparedStatements uses named prepared statements (Parse with a name,
// Describe, Close) and unnamed ones at the pgconn level.
func TestPreparedStatements(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	conn := connect(t, superDSN(p))
	ctx := ctxT(t)

	sd, err := conn.Prepare(ctx, "add", "SELECT $1::int + $2::int AS sum")
	if err != nil {
		t.Fatal(err)
	}
	if len(sd.ParamOIDs) != 2 || len(sd.Fields) != 1 || sd.Fields[0].Name != "sum" {
		t.Errorf("described %d params and fields %v", len(sd.ParamOIDs), sd.Fields)
	}
	for i := range 3 {
		var sum int
		if err := conn.QueryRow(ctx, "add", i, 40).Scan(&sum); err != nil || sum != 40+i {
			t.Fatalf("execute prepared: %d, %v", sum, err)
		}
	}
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_prepared_statements WHERE name = 'add'").Scan(&n); err != nil || n != 1 {
		t.Fatalf("pg_prepared_statements has %d 'add', %v", n, err)
	}
	if err := conn.Deallocate(ctx, "add"); err != nil {
		t.Fatalf("deallocate (Close message): %v", err)
	}
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_prepared_statements WHERE name = 'add'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("after deallocate pg_prepared_statements has %d 'add', %v", n, err)
	}

	// pgconn directly: a named statement, then the unnamed one.
	pc := conn.PgConn()
	if _, err := pc.Prepare(ctx, "upper", "SELECT upper($1)", nil); err != nil {
		t.Fatal(err)
	}
	res := pc.ExecPrepared(ctx, "upper", [][]byte{[]byte("abc")}, nil, nil).Read()
	if res.Err != nil || string(res.Rows[0][0]) != "ABC" {
		t.Fatalf("ExecPrepared = %q, %v", res.Rows, res.Err)
	}
	if _, err := pc.Prepare(ctx, "", "SELECT $1::int * 2", nil); err != nil {
		t.Fatal(err)
	}
	res = pc.ExecPrepared(ctx, "", [][]byte{[]byte("21")}, nil, nil).Read()
	if res.Err != nil || string(res.Rows[0][0]) != "42" {
		t.Fatalf("unnamed ExecPrepared = %q, %v", res.Rows, res.Err)
	}
	res = pc.ExecParams(ctx, "SELECT $1::text || $2::text", [][]byte{[]byte("a"), []byte("b")}, nil, nil, nil).Read()
	if res.Err != nil || string(res.Rows[0][0]) != "ab" {
		t.Fatalf("ExecParams = %q, %v", res.Rows, res.Err)
	}
	if err := pc.Deallocate(ctx, "upper"); err != nil {
		t.Fatal(err)
	}
	// Preparing a bad statement is an error, and the session goes on.
	_, err = pc.Prepare(ctx, "bad", "SELEC 1", nil)
	wantSQLState(t, err, "42601")
	selectOne(t, conn)
}

// TestBatch sends a pgx.Batch: many Parse/Bind/Describe/Execute messages
// and one Sync, all written before any result is read.
func TestBatch(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	table := newTable(t, "id int PRIMARY KEY, v text")
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgx.ParseConfig(superDSN(p))
			if err != nil {
				t.Fatal(err)
			}
			cfg.DefaultQueryExecMode = mode
			conn := connectConfig(t, cfg)
			ctx := ctxT(t)
			base := 100000 * int(mode)
			const n = 1000
			b := &pgx.Batch{}
			for i := range n {
				b.Queue("INSERT INTO "+table+" VALUES ($1, $2)", base+i, strings.Repeat("v", i%50))
				b.Queue("SELECT count(*) FROM "+table+" WHERE id >= $1", base)
			}
			br := conn.SendBatch(ctx, b)
			for i := range n {
				if _, err := br.Exec(); err != nil {
					t.Fatalf("insert %d: %v", i, err)
				}
				var count int
				if err := br.QueryRow().Scan(&count); err != nil {
					t.Fatalf("select %d: %v", i, err)
				}
				if count != i+1 {
					t.Fatalf("count after insert %d = %d", i, count)
				}
			}
			if err := br.Close(); err != nil {
				t.Fatal(err)
			}
			selectOne(t, conn)
		})
	}
}

// TestPipeline uses pgconn's pipeline mode: messages for several queries,
// Flush requests and Syncs are sent before results are read, and an error
// skips the rest of its pipeline segment until the next Sync.
func TestPipeline(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	conn := connect(t, superDSN(p))
	ctx := ctxT(t)
	pl := conn.PgConn().StartPipeline(ctx)
	pl.SendPrepare("twice", "SELECT $1::int * 2", nil)
	pl.SendQueryPrepared("twice", [][]byte{[]byte("4")}, nil, nil)
	pl.SendQueryParams("SELECT $1::text", [][]byte{[]byte("unnamed")}, nil, nil, nil)
	pl.SendFlushRequest()
	if err := pl.Flush(); err != nil {
		t.Fatal(err)
	}
	// Results arrive after the Flush request, before any Sync.
	wantPipelineResult[*pgconn.StatementDescription](t, pl, nil)
	wantPipelineResult[*pgconn.ResultReader](t, pl, "8")
	wantPipelineResult[*pgconn.ResultReader](t, pl, "unnamed")

	pl.SendDeallocate("twice")
	if err := pl.Sync(); err != nil {
		t.Fatal(err)
	}
	wantPipelineResult[*pgconn.CloseComplete](t, pl, nil)
	wantPipelineResult[*pgconn.PipelineSync](t, pl, nil)

	// A failing query in the second segment: the rest of it is skipped,
	// the third segment runs.
	pl.SendQueryParams("SELECT 1/0", nil, nil, nil, nil)
	pl.SendQueryParams("SELECT 'skipped'", nil, nil, nil, nil)
	if err := pl.Sync(); err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		pl.SendQueryParams("SELECT $1::int", [][]byte{fmt.Appendf(nil, "%d", i)}, nil, nil, nil)
	}
	if err := pl.Sync(); err != nil {
		t.Fatal(err)
	}
	values, errs := readPipelineSegment(t, pl)
	if len(errs) != 1 || sqlState(errs[0]) != "22012" || len(values) != 0 {
		t.Fatalf("failing segment returned %q and errors %v, want only a 22012 error", values, errs)
	}
	values, errs = readPipelineSegment(t, pl)
	if len(errs) != 0 || len(values) != 20 || values[0] != "0" || values[19] != "19" {
		t.Fatalf("segment after the error returned %q and errors %v, want 0…19", values, errs)
	}
	if err := pl.Close(); err != nil {
		t.Fatal(err)
	}
	selectOne(t, conn)
}

// readPipelineSegment reads pipeline results up to the next PipelineSync and
// returns the single values of the queries and the errors.
func readPipelineSegment(t *testing.T, pl *pgconn.Pipeline) (values []string, errs []error) {
	t.Helper()
	for range 1000 {
		res, err := pl.GetResults()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		switch r := res.(type) {
		case *pgconn.PipelineSync:
			return values, errs
		case *pgconn.ResultReader:
			rr := r.Read()
			if rr.Err != nil {
				errs = append(errs, rr.Err)
				continue
			}
			for _, row := range rr.Rows {
				values = append(values, string(row[0]))
			}
		case nil:
			t.Fatal("pipeline ended before its Sync")
		}
	}
	t.Fatal("no PipelineSync in 1000 results")
	return nil, nil
}

// wantPipelineResult reads the next pipeline result and checks its type
// and, for a ResultReader, its single value.
func wantPipelineResult[T any](t *testing.T, pl *pgconn.Pipeline, value any) {
	t.Helper()
	res, err := pl.GetResults()
	if err != nil {
		t.Fatalf("GetResults: %v", err)
	}
	if _, ok := res.(T); !ok {
		t.Fatalf("got pipeline result %T, want %T", res, *new(T))
	}
	if rr, ok := res.(*pgconn.ResultReader); ok {
		r := rr.Read()
		if r.Err != nil {
			t.Fatalf("pipeline query: %v", r.Err)
		}
		if want, ok := value.(string); ok && (len(r.Rows) != 1 || string(r.Rows[0][0]) != want) {
			t.Fatalf("pipeline query returned %q, want %q", r.Rows, want)
		}
	}
}

// TestCopy runs COPY FROM STDIN (pgx.CopyFrom, 50k rows) and COPY TO
// STDOUT through the proxy.
func TestCopy(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	conn := connect(t, superDSN(p))
	ctx := ctxT(t)
	table := newTable(t, "id int, name text, score float8")
	const rows = 50000
	n, err := conn.CopyFrom(ctx, pgx.Identifier{table}, []string{"id", "name", "score"},
		pgx.CopyFromSlice(rows, func(i int) ([]any, error) {
			return []any{i, fmt.Sprintf("name-%d", i), float64(i) / 4}, nil
		}))
	if err != nil {
		t.Fatalf("CopyFrom: %v", err)
	}
	if n != rows {
		t.Fatalf("CopyFrom copied %d rows, want %d", n, rows)
	}
	var count, sum int64
	if err := conn.QueryRow(ctx, "SELECT count(*), sum(id) FROM "+table).Scan(&count, &sum); err != nil {
		t.Fatal(err)
	}
	if count != rows || sum != rows*(rows-1)/2 {
		t.Fatalf("table has %d rows summing to %d", count, sum)
	}

	var buf bytes.Buffer
	tag, err := conn.PgConn().CopyTo(ctx, &buf, "COPY (SELECT id, name FROM "+table+" ORDER BY id) TO STDOUT")
	if err != nil {
		t.Fatalf("CopyTo: %v", err)
	}
	if tag.RowsAffected() != rows {
		t.Errorf("COPY TO tag %q, want %d rows", tag, rows)
	}
	var want bytes.Buffer
	for i := range rows {
		fmt.Fprintf(&want, "%d\tname-%d\n", i, i)
	}
	if buf.Len() != want.Len() || !bytes.Equal(buf.Bytes(), want.Bytes()) {
		t.Errorf("COPY TO returned %d bytes, want %d identical ones", buf.Len(), want.Len())
	}

	// COPY FROM with a bad row fails with the server's error; the session
	// goes on.
	_, err = conn.PgConn().CopyFrom(ctx, strings.NewReader("1\tx\t1\nnot-a-number\ty\t2\n"),
		"COPY "+table+" FROM STDIN")
	wantSQLState(t, err, "22P02")
	selectOne(t, conn)
}

// TestListenNotify delivers a notification from one proxied session to
// another.
func TestListenNotify(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	listener := connect(t, superDSN(p))
	notifier := connect(t, superDSN(p))
	ctx := ctxT(t)
	if _, err := listener.Exec(ctx, "LISTEN fence_events"); err != nil {
		t.Fatal(err)
	}
	if _, err := notifier.Exec(ctx, "SELECT pg_notify('fence_events', $1)", "hello"); err != nil {
		t.Fatal(err)
	}
	// The listener is idle: the notification arrives on its own.
	n, err := listener.WaitForNotification(ctx)
	if err != nil {
		t.Fatalf("WaitForNotification: %v", err)
	}
	if n.Channel != "fence_events" || n.Payload != "hello" || n.PID != notifier.PgConn().PID() {
		t.Errorf("got notification %+v from pid %d", n, notifier.PgConn().PID())
	}
	// And one sent inside a transaction arrives at commit.
	tx, err := notifier.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "NOTIFY fence_events, 'in-tx'"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err = listener.WaitForNotification(ctx); err != nil || n.Payload != "in-tx" {
		t.Fatalf("WaitForNotification = %+v, %v", n, err)
	}
}

// TestNoticeAndParameterStatus checks that NoticeResponse and
// ParameterStatus messages reach the client.
func TestNoticeAndParameterStatus(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	cfg, err := pgx.ParseConfig(superDSN(p))
	if err != nil {
		t.Fatal(err)
	}
	var notices []*pgconn.Notice
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { notices = append(notices, n) }
	cfg.RuntimeParams["application_name"] = "startup-app"
	cfg.RuntimeParams["search_path"] = "pg_catalog, public"
	conn := connectConfig(t, cfg)
	ctx := ctxT(t)

	// Startup parameters reached the server unchanged.
	if got := conn.PgConn().ParameterStatus("application_name"); got != "startup-app" {
		t.Errorf("ParameterStatus(application_name) after startup = %q", got)
	}
	var sp string
	if err := conn.QueryRow(ctx, "SHOW search_path").Scan(&sp); err != nil || sp != "pg_catalog, public" {
		t.Errorf("search_path = %q, %v", sp, err)
	}
	if conn.PgConn().ParameterStatus("server_version") == "" {
		t.Error("no server_version ParameterStatus")
	}

	if _, err := conn.Exec(ctx, `DO $$ BEGIN RAISE NOTICE 'fence notice %', 42; RAISE WARNING 'fence warning'; END $$`); err != nil {
		t.Fatal(err)
	}
	if len(notices) != 2 {
		t.Fatalf("got %d notices, want 2", len(notices))
	}
	if notices[0].Severity != "NOTICE" || notices[0].Message != "fence notice 42" || notices[0].Code != "00000" {
		t.Errorf("notice = %+v", *notices[0])
	}
	if notices[1].Severity != "WARNING" || notices[1].Message != "fence warning" || notices[1].Code != "01000" {
		t.Errorf("warning = %+v", *notices[1])
	}

	if _, err := conn.Exec(ctx, "SET application_name = 'renamed-app'"); err != nil {
		t.Fatal(err)
	}
	if got := conn.PgConn().ParameterStatus("application_name"); got != "renamed-app" {
		t.Errorf("ParameterStatus(application_name) after SET = %q, want renamed-app", got)
	}
	if _, err := conn.Exec(ctx, "SET TimeZone = 'Asia/Tokyo'"); err != nil {
		t.Fatal(err)
	}
	if got := conn.PgConn().ParameterStatus("TimeZone"); got != "Asia/Tokyo" {
		t.Errorf("ParameterStatus(TimeZone) after SET = %q, want Asia/Tokyo", got)
	}
}

// cancellingConfig returns a config whose context cancellation sends a
// CancelRequest (pgx's default only sets a deadline and breaks the
// connection).
func cancellingConfig(t *testing.T, dsn string) *pgx.ConnConfig {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, DeadlineDelay: 10 * time.Second}
	}
	return cfg
}

// TestCancelRequest cancels a running query with a context timeout: pgx
// sends a CancelRequest through the proxy with the BackendKeyData it was
// given, the server cancels the query and the session stays usable.
func TestCancelRequest(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	conn := connectConfig(t, cancellingConfig(t, superDSN(p)))
	checkCancel(t, conn)

	// pgconn.CancelRequest explicitly, from another goroutine.
	ctx := ctxT(t)
	errc := make(chan error, 1)
	go func() {
		_, err := conn.Exec(ctx, "SELECT pg_sleep(30)")
		errc <- err
	}()
	pid := conn.PgConn().PID()
	waitFor(t, "the query to start", func() bool {
		n, err := pgxQueryDirect(t, fmt.Sprintf(
			"SELECT count(*) FROM pg_stat_activity WHERE pid = %d AND state = 'active' AND query LIKE 'SELECT pg_sleep%%'", pid))
		return err == nil && n == 1
	})
	if err := conn.PgConn().CancelRequest(ctx); err != nil {
		t.Fatalf("CancelRequest: %v", err)
	}
	wantSQLState(t, <-errc, "57014")
	selectOne(t, conn)
}

// checkCancel runs pg_sleep with a short timeout on conn and checks that
// the query was cancelled by the server and the connection survived.
func checkCancel(t *testing.T, conn *pgx.Conn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	_, err := conn.Exec(ctx, "SELECT pg_sleep(5)")
	wantSQLState(t, err, "57014")
	if conn.IsClosed() {
		t.Fatal("connection closed after cancel")
	}
	selectOne(t, conn)
}

// pgxQueryDirect runs a query returning one integer directly against the
// shared cluster, bypassing the proxy.
func pgxQueryDirect(t testing.TB, sql string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, cluster.SuperuserDSN("postgres"))
	if err != nil {
		return 0, err
	}
	defer conn.Close(ctx)
	var n int
	err = conn.QueryRow(ctx, sql).Scan(&n)
	return n, err
}

// TestLargeResult streams a result of more than 100 MB and checks the
// proxy does not buffer it: the heap of this process (proxy and client)
// stays far below the result's size. Not parallel, so that other tests do
// not disturb the heap measurement.
func TestLargeResult(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	p := startProxy(t, proxy.Options{})
	conn := connect(t, superDSN(p))
	ctx := ctxT(t)

	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	baseline := ms.HeapInuse
	peak := baseline

	const rowsWanted, width = 110000, 1000
	rows, err := conn.Query(ctx, "SELECT repeat('x', $1) FROM generate_series(1, $2)", width, rowsWanted)
	if err != nil {
		t.Fatal(err)
	}
	var total, n int64
	for rows.Next() {
		v := rows.RawValues()[0]
		total += int64(len(v))
		n++
		if n%10000 == 0 {
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapInuse)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if n != rowsWanted || total != rowsWanted*width {
		t.Fatalf("got %d rows and %d bytes, want %d rows of %d bytes", n, total, rowsWanted, width)
	}
	const limit = 32 << 20
	growth := int64(peak) - int64(baseline)
	t.Logf("streamed %d MB; heap in use grew by at most %d KB", total>>20, growth>>10)
	if growth > limit {
		t.Errorf("heap in use grew by %d MB while streaming %d MB; the result seems to be buffered", growth>>20, total>>20)
	}
	selectOne(t, conn)
}

// TestServerErrors checks that server errors reach the client with their
// SQLSTATE and details, and that the session stays usable, in both
// protocols.
func TestServerErrors(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	table := newTable(t, "id int PRIMARY KEY")
	if err := cluster.Exec(ctxT(t), "INSERT INTO "+table+" VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, sql, code string
	}{
		{"division-by-zero", "SELECT 1/0", "22012"},
		{"unique-violation", "INSERT INTO " + table + " VALUES (1)", "23505"},
		{"syntax-error", "SELEC 1", "42601"},
		{"undefined-table", "SELECT * FROM no_such_table", "42P01"},
		{"raise-exception", "DO $$ BEGIN RAISE EXCEPTION 'fenceproxy-like text' USING ERRCODE = 'P0001'; END $$", "P0001"},
	}
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgx.ParseConfig(superDSN(p))
			if err != nil {
				t.Fatal(err)
			}
			cfg.DefaultQueryExecMode = mode
			conn := connectConfig(t, cfg)
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					_, err := conn.Exec(ctxT(t), tc.sql)
					wantSQLState(t, err, tc.code)
					var pgErr *pgconn.PgError
					errors.As(err, &pgErr)
					if pgErr.Severity != "ERROR" || pgErr.Message == "" {
						t.Errorf("error %+v lacks severity or message", pgErr)
					}
					if tc.code == "23505" && (pgErr.ConstraintName != table+"_pkey" || pgErr.TableName != table) {
						t.Errorf("unique violation names constraint %q table %q", pgErr.ConstraintName, pgErr.TableName)
					}
					selectOne(t, conn)
				})
			}
		})
	}
}

// TestTransactions commits and rolls back through the proxy, including a
// transaction aborted by an error.
func TestTransactions(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	conn := connect(t, superDSN(p))
	ctx := ctxT(t)
	table := newTable(t, "id int PRIMARY KEY")
	count := func() int {
		t.Helper()
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	if got := conn.PgConn().TxStatus(); got != 'T' {
		t.Errorf("TxStatus in transaction = %c, want T", got)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 0 {
		t.Fatalf("%d rows after rollback, want 0", n)
	}

	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES (2)"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 1 {
		t.Fatalf("%d rows after commit, want 1", n)
	}

	// An error aborts the transaction: later statements fail with 25P02
	// until ROLLBACK, and COMMIT rolls back.
	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES (3)"); err != nil {
		t.Fatal(err)
	}
	_, err = tx.Exec(ctx, "INSERT INTO "+table+" VALUES (2)")
	wantSQLState(t, err, "23505")
	if got := conn.PgConn().TxStatus(); got != 'E' {
		t.Errorf("TxStatus after error = %c, want E", got)
	}
	_, err = tx.Exec(ctx, "SELECT 1")
	wantSQLState(t, err, "25P02")
	if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Errorf("commit of aborted transaction: %v, want ErrTxCommitRollback", err)
	}
	if n := count(); n != 1 {
		t.Fatalf("%d rows after aborted transaction, want 1", n)
	}

	// Savepoints.
	_, err = conn.PgConn().Exec(ctx, "BEGIN; INSERT INTO "+table+" VALUES (4); SAVEPOINT s; INSERT INTO "+table+" VALUES (5); ROLLBACK TO SAVEPOINT s; COMMIT").ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 2 {
		t.Fatalf("%d rows after savepoint rollback, want 2", n)
	}
}

// TestLargeMessages moves single messages much larger than the relay's
// buffers in both directions: a 10 MB value in one DataRow, a 5 MB Query,
// a 5 MB Bind parameter, and a 2 MB ErrorResponse.
func TestLargeMessages(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	conn := connect(t, superDSN(p))
	ctx := ctxT(t)

	var big string
	if err := conn.QueryRow(ctx, "SELECT repeat('ab', 5000000)").Scan(&big); err != nil || len(big) != 10000000 {
		t.Fatalf("10 MB value: got %d bytes, %v", len(big), err)
	}
	literal := strings.Repeat("q", 5<<20)
	var n int
	if err := conn.QueryRow(ctx, "SELECT length('"+literal+"')", pgx.QueryExecModeSimpleProtocol).Scan(&n); err != nil || n != len(literal) {
		t.Fatalf("5 MB Query: length %d, %v", n, err)
	}
	if err := conn.QueryRow(ctx, "SELECT length('"+literal+"')", pgx.QueryExecModeExec).Scan(&n); err != nil || n != len(literal) {
		t.Fatalf("5 MB Parse: length %d, %v", n, err)
	}
	if err := conn.QueryRow(ctx, "SELECT length($1::text)", literal).Scan(&n); err != nil || n != len(literal) {
		t.Fatalf("5 MB Bind: length %d, %v", n, err)
	}
	_, err := conn.Exec(ctx, "DO $$ BEGIN RAISE EXCEPTION '%', repeat('e', 2000000) USING ERRCODE = 'P0001'; END $$")
	wantSQLState(t, err, "P0001")
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || len(pgErr.Message) != 2000000 {
		t.Errorf("2 MB error message did not arrive whole: %.100v", err)
	}
	selectOne(t, conn)
}

// TestStartupNegotiation covers startup-phase requests other clients make:
// GSSENCRequest (answered 'N'), NegotiateProtocolVersion from the server
// (relayed), and a client asking for a newer minor protocol version.
func TestStartupNegotiation(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})

	t.Run("gssenc-request", func(t *testing.T) {
		c := dialRaw(t, p.Addr())
		buf, err := (&pgproto3.GSSEncRequest{}).Encode(nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(buf); err != nil {
			t.Fatal(err)
		}
		var answer [1]byte
		if _, err := io.ReadFull(c, answer[:]); err != nil || answer[0] != 'N' {
			t.Fatalf("GSSENCRequest answered %q, %v; want 'N'", answer[0], err)
		}
		// The client goes on in plaintext.
		fe := newFrontend(c)
		sendStartup(t, fe, map[string]string{"user": "postgres", "database": "postgres"})
		wantReady(t, fe)
	})

	t.Run("unknown-protocol-option", func(t *testing.T) {
		c := dialRaw(t, p.Addr())
		fe := newFrontend(c)
		sendStartup(t, fe, map[string]string{"user": "postgres", "database": "postgres", "_pq_.fenceproxy_test": "1"})
		var sawNegotiate bool
		for {
			msg, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := msg.(type) {
			case *pgproto3.NegotiateProtocolVersion:
				sawNegotiate = true
				if len(m.UnrecognizedOptions) != 1 || m.UnrecognizedOptions[0] != "_pq_.fenceproxy_test" {
					t.Errorf("NegotiateProtocolVersion lists %v", m.UnrecognizedOptions)
				}
			case *pgproto3.ErrorResponse:
				t.Fatalf("startup refused: %s", m.Message)
			}
			if _, ok := msg.(*pgproto3.ReadyForQuery); ok {
				break
			}
		}
		if !sawNegotiate {
			t.Error("no NegotiateProtocolVersion relayed")
		}
	})

	t.Run("pgx-protocol-3.2", func(t *testing.T) {
		// The server (PostgreSQL before 18 answers NegotiateProtocolVersion;
		// 18 accepts) and pgx agree on a version through the proxy; the
		// cancel key, longer in 3.2, must still work.
		cfg := cancellingConfig(t, withQuery(p.URL("postgres", "", "postgres"), "max_protocol_version", "3.2"))
		conn := connectConfig(t, cfg)
		checkCancel(t, conn)
	})
}

// wantReady reads startup messages up to ReadyForQuery.
func wantReady(t testing.TB, fe *pgproto3.Frontend) {
	t.Helper()
	for {
		msg, err := fe.Receive()
		if err != nil {
			t.Fatalf("startup: %v", err)
		}
		switch m := msg.(type) {
		case *pgproto3.ErrorResponse:
			t.Fatalf("startup refused: %s (SQLSTATE %s)", m.Message, m.Code)
		case *pgproto3.ReadyForQuery:
			return
		}
	}
}
