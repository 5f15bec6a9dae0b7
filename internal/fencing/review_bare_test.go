package fencing_test

import (
	"encoding/binary"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review of a2843ce (internal/proxy/bare.go): a Bind of a
// statement's parameter form that goes without the session's values
// (fenceproxy.enter) where nothing else may read a fence setting. Behind
// PgBouncer (transaction mode, one server connection) the connection
// carries another client's token, 43, and the session's is 44: whatever
// reads the setting during the Bind's transaction must see 44. Every
// case checks the data afterwards.

// rbSchema: seen2, which no code reads (the probes' own statements write
// what they read into it), and get_cfg, a helper reading any setting by
// name, whose text names none (a platform team's helper).
const rbSchema = `
CREATE TABLE seen2 (tag text, tok text);
CREATE FUNCTION get_cfg(n text) RETURNS text LANGUAGE sql STABLE AS $$SELECT current_setting(n, true)$$;
`

type rbEnv struct {
	pol *policy.Policy
	pe  *poolerEnv
	db  string
	d   *pgx.Conn
}

// rbStart: fenceproxy (database check, catalog watch) → PgBouncer (one
// server connection) → PostgreSQL, a bindDB with rbSchema, poolerReset.
func rbStart(t *testing.T) *rbEnv {
	t.Helper()
	pol, _ := raPolicy(t, lockRules)
	pe := startPoolerEnvSized(t, pol, 1)
	db, d := bindDB(t, rbSchema)
	poolerReset(t, d)
	return &rbEnv{pol: pol, pe: pe, db: db, d: d}
}

// sess connects with token tok (and lock lk) in its startup packet, which
// PgBouncer drops: the server connection gets them only as the proxy
// applies them. Marked for serverRan.
func (e *rbEnv) sess(t *testing.T, tok, lk string) *pgx.Conn {
	t.Helper()
	c := e.pe.session(t, e.db, pgx.QueryExecModeCacheStatement, func(c *pgx.ConnConfig) {
		c.RuntimeParams["fence.token"] = tok
		if lk != "" {
			c.RuntimeParams["fence.lock"] = lk
		}
	})
	return runPid(t, c)
}

// seen is what the probe tagged tag recorded in seen2.
func (e *rbEnv) seen(t *testing.T, tag string) string {
	t.Helper()
	return strings.Join(testutil.QueryStrings(t, e.d, "SELECT coalesce(tok, '<null>') FROM seen2 WHERE tag = '"+tag+"'"), ",")
}

func rbPrepare(t *testing.T, c *pgx.Conn, name, sql string) {
	t.Helper()
	if _, err := c.PgConn().Prepare(ctxT(t), name, sql, nil); err != nil {
		t.Fatalf("prepare %s: %v", name, err)
	}
}

// TestReviewBareSettingNameBound: in the extended protocol a setting's
// name can arrive as a bound value, which a function the statement calls
// reads with (a helper of the database, query_to_xml given SQL): such a
// Bind keeps the session's values, or the function would read the server
// connection's token (another client's). Found by the review; the Bind's
// values are now read as the text is.
func TestReviewBareSettingNameBound(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := rbStart(t)
	e.pe.pollute(t, e.db, "43", "X")
	c := e.sess(t, "44", "")
	for _, tc := range []struct {
		name, stmt, arg string
		id              int64
		want            string // in the payload written
	}{
		{"a helper of the database given the name", "UPDATE acct SET payload = get_cfg($2) WHERE id = $1", "fence.token", 2, "44"},
		{"query_to_xml given SQL (no code of the database)", "UPDATE acct SET payload = query_to_xml($2, false, false, '')::text WHERE id = $1",
			"SELECT current_setting('fence.token', true) AS t", 3, "<t>44</t>"},
	} {
		ran, err := bindRan(t, c, tc.stmt, tc.id, tc.arg)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		r := snapshot(t, e.d, "acct")[tc.id]
		if r.Fence != 44 {
			t.Errorf("%s: row %d stamped %d, want 44", tc.name, tc.id, r.Fence)
		}
		if !strings.Contains(r.Payload, tc.want) {
			t.Errorf("%s: the function read %q, want the session's token (%s); bare Bind: %v", tc.name, r.Payload, tc.want, bare(t, ran))
		}
	}

	// The session's own temporary function reading the token: the catalog
	// watch does not count pg_temp functions (no FP003), so a Bind right
	// after the CREATE may go bare until the next database check finds it
	// (docs/operating.md, "Limits"); once it has, the session's token is
	// what the function reads.
	if _, err := c.Exec(ctxT(t), "CREATE FUNCTION pg_temp.tokf() RETURNS text LANGUAGE sql STABLE AS $$SELECT current_setting('fence.token', true)$$", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the session's temporary function reading the token: the Binds calling it keep the session's values", func() bool {
		return !bare(t, mustBindRan(t, c, "UPDATE acct SET payload = pg_temp.tokf() WHERE id = $1", 1))
	})
	if r := snapshot(t, e.d, "acct")[1]; r.Payload != "44" || r.Fence != 44 {
		t.Errorf("the session's temporary function read %q (row stamped %d), want 44", r.Payload, r.Fence)
	}
}

// TestReviewBareStaleMessageColonTable: a protected table whose name
// holds what reads as the end of a stale marker ("<watermark>:<n>:<n
// bytes>") keeps its name and watermark in a bare Bind's stale-row error,
// whose token the relay rewrites. Found by the review (the marker was
// read from its end only).
func TestReviewBareStaleMessageColonTable(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	cfg := lockRules
	cfg.Tables = append(append([]rules.Table(nil), lockRules.Tables...), rules.Table{Table: `public."t:0:2:y"`})
	pol, specs := raPolicy(t, cfg)
	p := startProxy(t, pol)
	db, d := preludeDB(t, specs, `CREATE TABLE "t:0:2:y" (id bigint PRIMARY KEY, v text, last_fence bigint NOT NULL DEFAULT 0); INSERT INTO "t:0:2:y" VALUES (1, 'a', 7);`)
	execDirect(t, d, `ALTER DATABASE "`+db+`" SET log_statement = 'all'`)
	c := runPid(t, readerSession(t, p, db, "", "5", pgx.QueryExecModeCacheStatement))
	before := tableText(t, d, `"t:0:2:y"`)
	ran, err := bindRan(t, c, `UPDATE "t:0:2:y" SET v = 'stale' WHERE id = $1`, 1)
	if sqlState(err) != "FP001" {
		t.Fatalf("stale UPDATE: %v, want FP001", err)
	}
	if after := tableText(t, d, `"t:0:2:y"`); after != before {
		t.Errorf("a stale UPDATE changed the table: %s -> %s", before, after)
	}
	const want = `stale fencing token 5 for table public."t:0:2:y" (stored watermark 7)`
	if !strings.Contains(err.Error(), want) {
		t.Errorf("stale UPDATE (bare Bind: %v): %v\n want the message to hold %s", bare(t, ran), err, want)
	}
}

// TestReviewBareLaterReaders (held): whatever runs after the Bind in its
// implicit transaction and reads the token sees the session's 44: a Query
// before the Sync, another statement's Parse/Bind/Execute, a row-limited
// Execute, a Close or a Describe before them, a Flush, an explicit
// transaction with a savepoint, a trigger created on another connection
// while the proxy runs (after FP003 retries), the audit form after a
// rules reload.
func TestReviewBareLaterReaders(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := rbStart(t)
	e.pe.pollute(t, e.db, "43", "X")
	c := e.sess(t, "44", "")
	rbPrepare(t, c, "s_up", "UPDATE acct SET n = n + 1 WHERE id >= $1 RETURNING id")
	bind := func(p string) *pgproto3.Bind {
		return &pgproto3.Bind{DestinationPortal: p, PreparedStatement: "s_up", Parameters: [][]byte{[]byte("1")}}
	}
	const rec = "INSERT INTO seen2 VALUES ('%s', current_setting('fence.token', true))"
	q := func(tag string) *pgproto3.Query { return &pgproto3.Query{String: fmt.Sprintf(rec, tag)} }
	for _, tc := range []struct {
		tag   string
		ready int
		msgs  []pgproto3.FrontendMessage
	}{
		{"query", 2, []pgproto3.FrontendMessage{bind(""), &pgproto3.Execute{}, q("query")}},
		{"parse", 1, []pgproto3.FrontendMessage{bind("p"), &pgproto3.Execute{Portal: "p"}, &pgproto3.Parse{Query: fmt.Sprintf(rec, "parse")}, &pgproto3.Bind{}, &pgproto3.Execute{}}},
		{"rowlimit", 2, []pgproto3.FrontendMessage{bind("p"), &pgproto3.Execute{Portal: "p", MaxRows: 1}, &pgproto3.Execute{Portal: "p", MaxRows: 1}, q("rowlimit")}},
		{"close", 2, []pgproto3.FrontendMessage{bind("p"), &pgproto3.Execute{Portal: "p"}, &pgproto3.Close{ObjectType: 'P', Name: "p"}, q("close")}},
		{"describe", 2, []pgproto3.FrontendMessage{bind("p"), &pgproto3.Describe{ObjectType: 'S', Name: "s_up"}, &pgproto3.Execute{Portal: "p"}, q("describe")}},
		{"flush", 2, []pgproto3.FrontendMessage{bind(""), &pgproto3.Execute{}, &pgproto3.Flush{}, q("flush")}},
	} {
		if errs := raPipeline(t, c, tc.ready, append(tc.msgs, &pgproto3.Sync{})...); len(errs) > 0 {
			t.Fatalf("%s: %v", tc.tag, errs)
		}
		if got := e.seen(t, tc.tag); got != "44" {
			t.Errorf("%s: a statement after the Bind, before the Sync, read token %q, want 44", tc.tag, got)
		}
	}

	mustExec(t, c, "BEGIN")
	mustExec(t, c, "SAVEPOINT a")
	mustBindRan(t, c, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)
	mustExec(t, c, "ROLLBACK TO a")
	mustBindRan(t, c, "UPDATE acct SET n = n + 1 WHERE id = $1", 1)
	mustExec(t, c, fmt.Sprintf(rec, "tx"))
	mustExec(t, c, "COMMIT")
	if got := e.seen(t, "tx"); got != "44" {
		t.Errorf("explicit transaction: read %q, want 44", got)
	}

	execDirect(t, e.d, `CREATE FUNCTION nt() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN INSERT INTO seen2 VALUES ('trg', current_setting('fence.token', true)); RETURN NEW; END$$;
		CREATE TRIGGER nt BEFORE UPDATE ON acct FOR EACH ROW EXECUTE FUNCTION nt()`)
	mustBindRan(t, c, "UPDATE acct SET n = n + 1 WHERE id = $1", 3)
	if got := e.seen(t, "trg"); got != "44" {
		t.Errorf("a trigger created on another connection: read %q, want 44", got)
	}
	execDirect(t, e.d, "DROP TRIGGER nt ON acct")

	// A reload puts acct in audit mode: the form reads the token.
	cfg := lockRules
	cfg.Tables = append([]rules.Table(nil), lockRules.Tables...)
	cfg.Tables[0].Mode = rules.ModeAudit
	rs, err := rules.Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.pol.Swap(rs, false)
	for i := range 2 {
		if ran := mustBindRan(t, c, "UPDATE acct SET n = n + 1 WHERE id = $1", 2); bare(t, ran) {
			t.Errorf("audit mode after a reload, use %d: the Bind went bare", i+1)
		}
	}
	for id, r := range snapshot(t, e.d, "acct") {
		if r.Fence != 44 {
			t.Errorf("row %d stamped %d, want 44", id, r.Fence)
		}
	}
}

// TestReviewBareStaleTokenInError (held): whatever the server connection
// carries (never set, empty, or text with colons and digits shaped like the
// marker's tail), a stale holder's bare UPDATE, DELETE and upsert are
// refused with FP001 naming its own token 41, and acct is unchanged.
func TestReviewBareStaleTokenInError(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	for _, conn := range []string{"<unset>", "", "7:99:11:public.acct", "41:0:2:x"} {
		e := rbStart(t)
		if conn != "<unset>" {
			e.pe.pollute(t, e.db, conn, "X")
		}
		c := e.sess(t, "41", "")
		before := snapshot(t, e.d, "acct")
		for _, q := range []string{
			"UPDATE acct SET payload = 'stale' WHERE id = $1",
			"DELETE FROM acct WHERE id = $1",
			"INSERT INTO acct (id, payload) VALUES ($1, 's') ON CONFLICT (id) DO UPDATE SET payload = 'stale'",
		} {
			ran, err := bindRan(t, c, q, 1)
			if sqlState(err) != "FP001" || !strings.Contains(err.Error(), "stale fencing token 41 for table public.acct (stored watermark 42)") {
				t.Errorf("connection %q, %s: %v, want FP001 naming 41", conn, q, err)
			}
			if !bare(t, ran) {
				t.Errorf("connection %q, %s: not bare (the case is not exercised)", conn, q)
			}
		}
		wantUnchanged(t, e.d, "acct", before)
	}
}

// TestReviewBareProtocol (held): a Sync split across TCP writes, binary
// formats, a Bind over 64 KiB, an unnamed statement parsed in an earlier
// segment, three Bind/Execute/Sync groups in one write (fresh and stale),
// the cached statement after DDL on another connection, and a statement
// on a lock-required table with and without a lock name.
func TestReviewBareProtocol(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := rbStart(t)
	e.pe.pollute(t, e.db, "43", "X")
	c := e.sess(t, "44", "")
	rbPrepare(t, c, "s_up", "UPDATE acct SET payload = $2 WHERE id = $1")
	run := func(name string, ready int, msgs ...pgproto3.FrontendMessage) {
		t.Helper()
		if errs := raPipeline(t, c, ready, msgs...); len(errs) > 0 {
			t.Errorf("%s: %v", name, errs)
		}
	}
	row := func(name string, id int64, payload string) {
		t.Helper()
		if r := snapshot(t, e.d, "acct")[id]; r.Payload != payload || r.Fence != 44 {
			t.Errorf("%s: row %d = %+v, want payload %q stamped 44", name, id, r, payload[:min(len(payload), 20)])
		}
	}

	var buf []byte
	for _, m := range []pgproto3.FrontendMessage{&pgproto3.Bind{PreparedStatement: "s_up", Parameters: [][]byte{[]byte("1"), []byte("split")}}, &pgproto3.Execute{}, &pgproto3.Sync{}} {
		buf, _ = m.Encode(buf)
	}
	nc := c.PgConn().Conn()
	if _, err := nc.Write(buf[:len(buf)-2]); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Write(buf[len(buf)-2:]); err != nil {
		t.Fatal(err)
	}
	run("split Sync", 1)
	row("split Sync", 1, "split")

	id := binary.BigEndian.AppendUint64(nil, 2)
	run("binary", 1, &pgproto3.Bind{PreparedStatement: "s_up", ParameterFormatCodes: []int16{1, 0}, Parameters: [][]byte{id, []byte("bin")}, ResultFormatCodes: []int16{1}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	row("binary", 2, "bin")
	large := strings.Repeat("L", 200<<10)
	run("large", 1, &pgproto3.Bind{PreparedStatement: "s_up", Parameters: [][]byte{[]byte("3"), []byte(large)}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	row("large Bind", 3, large)
	run("parse", 1, &pgproto3.Parse{Query: "UPDATE acct SET payload = 'unnamed' WHERE id = $1"}, &pgproto3.Sync{})
	run("unnamed", 1, &pgproto3.Bind{Parameters: [][]byte{[]byte("1")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	row("unnamed statement", 1, "unnamed")

	var fresh, stale []pgproto3.FrontendMessage
	for i := 1; i <= 3; i++ {
		fresh = append(fresh, &pgproto3.Bind{PreparedStatement: "s_up", Parameters: [][]byte{[]byte(fmt.Sprint(i)), []byte("pipe")}}, &pgproto3.Execute{}, &pgproto3.Sync{})
		stale = append(stale, &pgproto3.Bind{PreparedStatement: "s_st", Parameters: [][]byte{[]byte(fmt.Sprint(i))}}, &pgproto3.Execute{}, &pgproto3.Sync{})
	}
	run("pipelined", 3, fresh...)
	for i := int64(1); i <= 3; i++ {
		row("pipelined", i, "pipe")
	}
	s := e.sess(t, "41", "")
	rbPrepare(t, s, "s_st", "UPDATE acct SET payload = 'stale' WHERE id = $1")
	before := snapshot(t, e.d, "acct")
	errs := raPipeline(t, s, 3, stale...)
	if len(errs) != 3 || strings.Count(strings.Join(errs, "\n"), "FP001: fenceproxy: stale fencing token 41 ") != 3 {
		t.Errorf("a stale holder's three pipelined groups: %q, want three FP001 naming 41", errs)
	}
	wantUnchanged(t, e.d, "acct", before)

	mustBindRan(t, c, "UPDATE acct SET n = n + 1 WHERE id = $1", 3)
	execDirect(t, e.d, "ALTER TABLE acct ADD COLUMN extra int")
	mustBindRan(t, c, "UPDATE acct SET n = n + 1 WHERE id = $1", 3)
	if r := snapshot(t, e.d, "acct")[3]; r.N != 2 || r.Fence != 44 {
		t.Errorf("after DDL on another connection: row 3 = %+v, want n 2 (each write once) stamped 44", r)
	}

	// jobs is lock: required. Without a lock name: refused; with one, the
	// registration goes by value (one call of hold_at, which reads no
	// setting: holdat_test.go).
	both := "WITH j AS (UPDATE jobs SET state = 'x' WHERE id = $1 RETURNING id) UPDATE acct SET n = n + 1 WHERE id IN (SELECT id FROM j)"
	if _, err := bindRan(t, c, both, 1); sqlState(err) != "FP002" {
		t.Errorf("lock-required table without a lock name: %v, want FP002", err)
	}
	if got := tableText(t, e.d, "jobs"); !strings.Contains(got, "queued") {
		t.Errorf("refused write changed jobs: %s", got)
	}
	l := e.sess(t, "44", "L")
	if ran := mustBindRan(t, l, both+" /* l */", 1); !byValue(t, ran) {
		t.Errorf("a lock registration: want one call of hold_at:\n%s", strings.Join(ran, "\n"))
	}
	if w := lockWatermark(t, e.d, "L"); w != 44 || !strings.Contains(tableText(t, e.d, "jobs"), `"x"`) {
		t.Errorf("with lock L: watermark %d, jobs %s; want 44 and state x", w, tableText(t, e.d, "jobs"))
	}
}
