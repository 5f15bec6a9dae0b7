package fencing_test

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// hijackRules fence acct with lock: optional (and by row), racct with
// lock: required and a fence column, and jobs with lock: required alone.
var hijackRules = rules.Config{Tables: []rules.Table{
	{Table: "public.acct"},
	{Table: "public.racct", Lock: rules.LockRequired, Column: "last_fence"},
	{Table: "public.jobs", Lock: rules.LockRequired},
}}

// hijackSchema is lockSchema's acct and jobs, racct shaped like acct, and
// the stored code that takes the names of the proxy's own statements
// (which any session can read in pg_prepared_statements) for statements
// of its own. Each replacement sets fence.token to 99, past every holder
// of the tests: were it run in place of the proxy's statement, the stale
// holder would pass for the newest.
const hijackSchema = `
CREATE TABLE acct (id bigint PRIMARY KEY, payload text NOT NULL DEFAULT 'new', n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO acct (id, payload) VALUES (1, 'a'), (2, 'b'), (3, 'c');
CREATE TABLE racct (LIKE acct INCLUDING ALL);
INSERT INTO racct (id, payload) VALUES (1, 'a'), (2, 'b'), (3, 'c');
CREATE TABLE jobs (id bigint PRIMARY KEY, state text NOT NULL);
INSERT INTO jobs VALUES (1, 'queued'), (2, 'queued');

-- Dynamic SQL with format(): DEALLOCATE and PREPARE under each name.
CREATE FUNCTION hijack() RETURNS int LANGUAGE plpgsql AS $f$
DECLARE n text; k int := 0;
BEGIN
	FOR n IN SELECT name FROM pg_prepared_statements WHERE name LIKE 'fenceproxy%' LOOP
		EXECUTE format('DEALLOCATE %I', n);
		EXECUTE format('PREPARE %I AS SELECT pg_catalog.set_config(''fence.token'', ''999999'', false) AS hijacked', n);
		k := k + 1;
	END LOOP;
	RETURN k;
END $f$;

-- DEALLOCATE ALL, then the names again, the statements built by
-- concatenation; the session's other statements are prepared again as
-- they were (the server's text, the same parameter types), so that the
-- client does not notice.
CREATE FUNCTION hijack_all() RETURNS int LANGUAGE plpgsql AS $f$
DECLARE ps record; k int := 0;
BEGIN
	CREATE TEMP TABLE IF NOT EXISTS hijack_saved AS SELECT name, statement, parameter_types FROM pg_prepared_statements WHERE false;
	TRUNCATE hijack_saved;
	INSERT INTO hijack_saved SELECT name, statement, parameter_types FROM pg_prepared_statements;
	EXECUTE 'DEALLOCATE ' || 'ALL';
	FOR ps IN SELECT * FROM hijack_saved LOOP
		IF ps.name LIKE 'fenceproxy%' THEN
			EXECUTE 'PREPARE ' || quote_ident(ps.name) || ' AS SELECT pg_catalog.set_config(''fence.token'', ''999999'', false) AS hijacked';
			k := k + 1;
		ELSIF cardinality(ps.parameter_types) = 0 THEN
			EXECUTE format('PREPARE %I AS %s', ps.name, regexp_replace(ps.statement, '^PREPARE \S+(\([^)]*\))? AS ', ''));
		ELSE
			EXECUTE format('PREPARE %I(%s) AS %s', ps.name, array_to_string(ps.parameter_types, ','), regexp_replace(ps.statement, '^PREPARE \S+(\([^)]*\))? AS ', ''));
		END IF;
	END LOOP;
	RETURN k;
END $f$;
`

// hijackForm is one way for a stale holder's session to replace the
// proxy's statements; it returns how many it replaced.
type hijackForm struct {
	name string
	run  func(t *testing.T, c *pgx.Conn) int
}

// hijacked counts the proxy's statement names in c's session that hold a
// statement of the hijack's.
func hijacked(t *testing.T, c *pgx.Conn) int {
	t.Helper()
	var n int
	if err := c.QueryRow(ctxT(t), "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'fenceproxy%' AND statement LIKE '%hijacked%'", pgx.QueryExecModeSimpleProtocol).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// proxyNames lists the proxy's statement names in c's session.
func proxyNames(t *testing.T, c *pgx.Conn) []string {
	t.Helper()
	rows, err := c.Query(ctxT(t), "SELECT name FROM pg_prepared_statements WHERE name LIKE 'fenceproxy%' ORDER BY name", pgx.QueryExecModeSimpleProtocol)
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return names
}

var hijackForms = []hijackForm{
	{"function", func(t *testing.T, c *pgx.Conn) int {
		if err := simple(t, c, "SELECT hijack()"); err != nil {
			t.Fatal(err)
		}
		return hijacked(t, c)
	}},
	{"function DEALLOCATE ALL", func(t *testing.T, c *pgx.Conn) int {
		if err := simple(t, c, "SELECT hijack_all()"); err != nil {
			t.Fatal(err)
		}
		return hijacked(t, c)
	}},
	{"DO block", func(t *testing.T, c *pgx.Conn) int {
		// The prefix spelled so that the proxy's check of DO bodies for
		// the settings' names does not refuse the block.
		err := simple(t, c, `DO $d$
DECLARE n text;
BEGIN
	FOR n IN SELECT name FROM pg_prepared_statements WHERE name LIKE 'f' || 'enceproxy%' LOOP
		EXECUTE format('DEALLOCATE %I', n);
		EXECUTE format('PREPARE %I AS SELECT %L AS hijacked WHERE false', n, 'hijacked');
	END LOOP;
END $d$`)
		if err != nil {
			t.Fatal(err)
		}
		return hijacked(t, c)
	}},
	{"SQL", func(t *testing.T, c *pgx.Conn) int {
		for _, n := range proxyNames(t, c) {
			id := pgx.Identifier{n}.Sanitize()
			mustSimple(t, c, "DEALLOCATE "+id)
			mustSimple(t, c, "PREPARE "+id+" AS SELECT 'hijacked' WHERE false")
		}
		return hijacked(t, c)
	}},
	{"protocol", func(t *testing.T, c *pgx.Conn) int {
		// Close and Parse messages of the client's own under the names,
		// then a Bind and Execute of each.
		pc := c.PgConn()
		for _, n := range proxyNames(t, c) {
			if err := pc.Deallocate(ctxT(t), n); err != nil {
				t.Fatal(err)
			}
			if _, err := pc.Prepare(ctxT(t), n, "SELECT 'hijacked' WHERE false", nil); err != nil {
				t.Fatal(err)
			}
		}
		k := hijacked(t, c)
		for _, n := range proxyNames(t, c) {
			_ = pc.ExecPrepared(ctxT(t), n, nil, nil, nil).Read()
		}
		return k
	}},
}

// hijackStmt is a statement with its one parameter. pgx sends a
// statement without arguments as a simple Query whatever the mode: with
// one, the mode decides.
type hijackStmt struct {
	sql string
	arg int
}

// hijackTable is a protected table of hijackRules and the statements a
// holder runs on it.
type hijackTable struct {
	name  string
	ok    hijackStmt   // a current holder's; it changes the table
	stale []hijackStmt // refused to a stale holder
}

var hijackTables = []hijackTable{
	{"acct", hijackStmt{"UPDATE acct SET n = n + 1 WHERE id = $1", 1}, []hijackStmt{
		{"UPDATE acct SET n = n + 1 WHERE id = $1", 1},
		{"INSERT INTO acct (id, payload) VALUES ($1, 'stale')", 900},
		{"DELETE FROM acct WHERE id = $1", 2},
	}},
	{"racct", hijackStmt{"UPDATE racct SET n = n + 1 WHERE id = $1", 1}, []hijackStmt{
		{"UPDATE racct SET n = n + 1 WHERE id = $1", 1},
		{"INSERT INTO racct (id, payload) VALUES ($1, 'stale')", 900},
		{"DELETE FROM racct WHERE id = $1", 2},
		{"SELECT n FROM racct WHERE id = $1", 1},
	}},
	{"jobs", hijackStmt{"UPDATE jobs SET state = state || '+' WHERE id = $1", 1}, []hijackStmt{
		{"UPDATE jobs SET state = 'stale' WHERE id = $1", 1},
		{"INSERT INTO jobs VALUES ($1, 'stale')", 900},
		{"DELETE FROM jobs WHERE id = $1", 2},
		{"SELECT state FROM jobs WHERE id = $1", 1},
	}},
}

// TestRegistrationHijackRequired: TestRegistrationHijack and
// TestAutoPrepareHijack for lock: required as well as lock: optional, in
// the simple protocol and with named and unnamed statements, with and
// without auto_prepare: stored code (a function, a DO block, dynamic SQL
// with format() and with concatenation, DEALLOCATE ALL), SQL-level
// DEALLOCATE and PREPARE, and protocol-level Close and Parse replace the
// proxy's own statements (the lock registration's, auto_prepare's, the
// settings') with statements of their own. The holder keeps
// working while it is current; once a newer holder (42) has read every
// table, the stale holder (41, a grant before) changes no row and reads none, after the
// hijack, after a hijack in its own transaction, and in a pipeline after
// one; the tables, read directly, are unchanged, and the newer holder
// still writes.
func TestRegistrationHijackRequired(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	rs, err := rules.Compile(hijackRules)
	if err != nil {
		t.Fatal(err)
	}
	for _, auto := range []bool{false, true} {
		var edit []func(*proxy.Options)
		name := "auto_prepare off"
		if auto {
			edit, name = append(edit, autoPrepare), "auto_prepare on"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := startProxy(t, policy.New(rs, false, policy.Options{}), edit...)
			for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
				t.Run(mode.String(), func(t *testing.T) {
					t.Parallel()
					db := newHijackDB(t)
					for i, f := range hijackForms {
						// Each form's holders come after the last
						// form's, whose newer holder stamped the rows.
						base := int64(100 * (i + 1))
						t.Run(f.name, func(t *testing.T) { testHijackRequired(t, p, db, mode, f, base) })
					}
				})
			}
		})
	}
}

func newHijackDB(t *testing.T) string {
	t.Helper()
	return schemaDB(t, "hijackdb", hijackSchema+objectsSQL(t))
}

func testHijackRequired(t *testing.T, p *proxytest.Proxy, db string, mode pgx.QueryExecMode, f hijackForm, base int64) {
	d := direct(t, db)
	ctx := ctxT(t)
	lock := "L/" + f.name
	holder := func(tok int64) *pgx.Conn {
		return connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
			c.DefaultQueryExecMode = mode
			c.RuntimeParams["fence.lock"] = lock
			c.RuntimeParams["fence.token"] = fmt.Sprint(tok)
		})
	}
	old := holder(base + 41)
	work := func(c *pgx.Conn) {
		t.Helper()
		for _, tb := range hijackTables {
			before := tableText(t, d, tb.name)
			mustExec(t, c, tb.ok.sql, tb.ok.arg)
			if tableText(t, d, tb.name) == before {
				t.Fatalf("%s changed nothing", tb.ok.sql)
			}
		}
	}
	// The holder works, each statement sent more than once (auto_prepare
	// prepares from the second sending); one write in the extended
	// protocol gives every session a registration statement to take.
	work(old)
	work(old)
	mustExec(t, old, "UPDATE acct SET n = n + 1 WHERE id = $1", pgx.QueryExecModeExec, 3)
	if n := f.run(t, old); n == 0 {
		t.Fatalf("%s replaced none of the proxy's statements %q", f.name, proxyNames(t, old))
	}
	// While it is current, the hijack costs it nothing.
	work(old)

	newer := holder(base + 42)
	for _, tb := range hijackTables {
		if _, err := newer.Exec(ctx, "SELECT count(*) FROM "+tb.name); err != nil {
			t.Fatal(err)
		}
	}
	before := map[string]string{}
	for _, tb := range hijackTables {
		before[tb.name] = tableText(t, d, tb.name)
	}
	unchanged := func(when string) {
		t.Helper()
		for _, tb := range hijackTables {
			if got := tableText(t, d, tb.name); got != before[tb.name] {
				t.Fatalf("%s: %s changed:\n before %s\n after  %s", when, tb.name, before[tb.name], got)
			}
		}
	}
	stale := func(when string) {
		t.Helper()
		for _, tb := range hijackTables {
			for _, st := range tb.stale {
				for range 3 {
					_, err := old.Exec(ctx, st.sql, st.arg)
					wantCode(t, err, "FP001")
				}
			}
		}
		unchanged(when)
	}
	f.run(t, old)
	stale("after the hijack")

	// The hijack and the stale write in one transaction.
	mustSimple(t, old, "BEGIN")
	f.run(t, old)
	_, err := old.Exec(ctx, "UPDATE jobs SET state = 'stale' WHERE id = $1", 1)
	wantCode(t, err, "FP001")
	mustSimple(t, old, "ROLLBACK")
	unchanged("in a transaction")

	// The hijack and the stale writes in one pipeline (extended protocol).
	if mode != pgx.QueryExecModeSimpleProtocol {
		f.run(t, old)
		for _, tb := range hijackTables {
			b := &pgconn.Batch{}
			b.ExecParams("SELECT hijack()", nil, nil, nil, nil)
			b.ExecParams(tb.stale[0].sql, [][]byte{[]byte(fmt.Sprint(tb.stale[0].arg))}, nil, nil, nil)
			_, err := old.PgConn().ExecBatch(ctx, b).ReadAll()
			wantCode(t, err, "FP001")
		}
		unchanged("in a pipeline")
	}

	// Every name the session holds, executed by the client: nothing
	// that runs there lets the stale holder in.
	for _, n := range proxyNames(t, old) {
		_ = simple(t, old, "EXECUTE "+pgx.Identifier{n}.Sanitize())
	}
	stale("after EXECUTE of the names")

	// The newer holder is not disturbed.
	work(newer)
	var fence int64
	if err := d.QueryRow(ctx, "SELECT last_fence FROM racct WHERE id = 1").Scan(&fence); err != nil || fence != base+42 {
		t.Fatalf("racct 1: fence %d, %v; want %d", fence, err, base+42)
	}
}
