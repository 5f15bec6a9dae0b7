package fencing_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// readerSession connects to db through p with lock lk and token tok (none
// where empty), in mode.
func readerSession(t *testing.T, p *proxytest.Proxy, db, lk, tok string, mode pgx.QueryExecMode) *pgx.Conn {
	t.Helper()
	return connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
		c.DefaultQueryExecMode = mode
		if lk != "" {
			c.RuntimeParams["fence.lock"] = lk
		}
		if tok != "" {
			c.RuntimeParams["fence.token"] = tok
		}
	})
}

// readerKinds are relations whose reads reach acct without naming it,
// created on a direct connection before the proxy first sees the
// database, and a read of row 3 through each.
var readerKinds = []struct{ name, schema, read string }{
	{"view", "CREATE VIEW acct_v AS SELECT * FROM acct", "SELECT payload FROM acct_v WHERE id = $1"},
	{"view over a view", "CREATE VIEW acct_v AS SELECT * FROM acct; CREATE SCHEMA s; CREATE VIEW s.w AS SELECT v.payload, v.id FROM plain p RIGHT JOIN acct_v v USING (id)",
		"SELECT payload FROM s.w WHERE id = $1"},
	{"view reading it in a subquery", "CREATE VIEW sub AS SELECT id, payload FROM plain WHERE EXISTS (SELECT 1 FROM acct WHERE acct.id = 3) UNION ALL SELECT 3, 'c'",
		"SELECT payload FROM sub WHERE id = $1"},
	{"partitioned parent", mpPathSchema + "ALTER TABLE pparent ATTACH PARTITION acct FOR VALUES FROM (0) TO (1000)",
		"SELECT payload FROM pparent WHERE id = $1"},
	{"inheritance parent", "ALTER TABLE acct INHERIT inh_parent", "SELECT payload FROM inh_parent WHERE id = $1"},
	{"inheritance child", "CREATE TABLE acct_child () INHERITS (acct); INSERT INTO acct_child (id, payload) VALUES (3, 'c')",
		"SELECT payload FROM acct_child WHERE id = $1"},
	{"function", "CREATE FUNCTION acct_payload(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM acct WHERE id = $1$$",
		"SELECT acct_payload($1)"},
	{"function in a view", "CREATE FUNCTION acct_payload(bigint) RETURNS text LANGUAGE plpgsql STABLE AS $f$BEGIN RETURN (SELECT payload FROM acct WHERE id = $1); END$f$; " +
		"CREATE VIEW pv AS SELECT 3::bigint AS id, acct_payload(3) AS payload", "SELECT payload FROM pv WHERE id = $1"},
}

// TestReadThroughReaders: a newer holder (token 42) whose only statement
// reads acct through a view, a parent or a child registers its token, in
// every protocol form; the stale holder (41), which registered before,
// is then refused (FP001) and acct is unchanged.
func TestReadThroughReaders(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	modes := []struct {
		name string
		mode pgx.QueryExecMode
	}{
		{"simple", pgx.QueryExecModeSimpleProtocol},
		{"prepared", pgx.QueryExecModeCacheStatement},
		{"unnamed", pgx.QueryExecModeDescribeExec},
		{"exec", pgx.QueryExecModeExec},
	}
	for _, k := range readerKinds {
		for _, m := range modes {
			t.Run(k.name+"/"+m.name, func(t *testing.T) {
				db, d := rvSetupDB(t, specs, "rdr")
				execDirect(t, d, k.schema)
				stale := readerSession(t, p, db, "L", "41", m.mode)
				mustExec(t, stale, "SELECT n FROM acct WHERE id = 1")
				fresh := readerSession(t, p, db, "L", "42", m.mode)
				var got string
				if err := fresh.QueryRow(ctxT(t), k.read, 3).Scan(&got); err != nil {
					t.Fatal(err)
				}
				if w := lockWatermark(t, d, "L"); w != 42 {
					t.Errorf("watermark after the newer holder's read: %d, want 42", w)
				}
				before := tableText(t, d, "acct")
				_, err := stale.Exec(ctxT(t), "UPDATE acct SET payload = 'stale' WHERE id = $1", 3)
				if rvCode(err) != "FP001" {
					t.Errorf("stale UPDATE: %v, want FP001", err)
				}
				_, err = stale.Exec(ctxT(t), "INSERT INTO acct (id, payload) VALUES ($1, 'stale')", 90)
				if rvCode(err) != "FP001" {
					t.Errorf("stale INSERT: %v, want FP001", err)
				}
				if after := tableText(t, d, "acct"); after != before {
					t.Errorf("acct changed:\n before %s\n after  %s", before, after)
				}
			})
		}
	}
}

// TestReadThroughRequired: jobs has lock: required, so a read of it
// through a view in a session that names no lock fails with FP002, as a
// read of jobs does; with a lock it registers. A function that reads it,
// and a table whose trigger reads it, register too, but do not require a
// lock (the function's body is not parsed; the trigger fires on writes).
func TestReadThroughRequired(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	db, d := rvSetupDB(t, specs, "rdrreq")
	execDirect(t, d, "INSERT INTO jobs VALUES (1, 'queued'); CREATE VIEW jobs_v AS SELECT * FROM jobs; "+
		"CREATE FUNCTION jobs_state(bigint) RETURNS text LANGUAGE sql STABLE AS $$SELECT state FROM jobs WHERE id = $1$$; "+
		"CREATE TABLE jlog (id bigint); "+
		"CREATE FUNCTION jlog_f() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN PERFORM count(*) FROM jobs; RETURN NEW; END$$; "+
		"CREATE TRIGGER jlog_t BEFORE INSERT ON jlog FOR EACH ROW EXECUTE FUNCTION jlog_f()")
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		anon := readerSession(t, p, db, "", "", mode)
		var s string
		if err := anon.QueryRow(ctxT(t), "SELECT state FROM jobs_v WHERE id = $1", 1).Scan(&s); rvCode(err) != "FP002" {
			t.Errorf("%v: read through the view without a lock: %v, want FP002", mode, err)
		}
		holder := readerSession(t, p, db, "J", "7", mode)
		if err := holder.QueryRow(ctxT(t), "SELECT state FROM jobs_v WHERE id = $1", 1).Scan(&s); err != nil || s != "queued" {
			t.Errorf("%v: read through the view with a lock: %q %v", mode, s, err)
		}
		if w := lockWatermark(t, d, "J"); w != 7 {
			t.Errorf("%v: watermark %d, want 7", mode, w)
		}
		if err := anon.QueryRow(ctxT(t), "SELECT jobs_state($1)", 1).Scan(&s); err != nil || s != "queued" {
			t.Errorf("%v: function without a lock: %q %v", mode, s, err)
		}
		later := readerSession(t, p, db, "J", "8", mode)
		if err := later.QueryRow(ctxT(t), "SELECT jobs_state($1)", 1).Scan(&s); err != nil || s != "queued" {
			t.Errorf("%v: function with a lock: %q %v", mode, s, err)
		}
		if w := lockWatermark(t, d, "J"); w != 8 {
			t.Errorf("%v: watermark after the function's call %d, want 8", mode, w)
		}
		// jlog's trigger reads jobs: its writes register, and do not
		// require a lock.
		if _, err := anon.Exec(ctxT(t), "INSERT INTO jlog VALUES ($1)", 1); err != nil {
			t.Errorf("%v: insert into jlog without a lock: %v", mode, err)
		}
		last := readerSession(t, p, db, "J", "9", mode)
		if _, err := last.Exec(ctxT(t), "INSERT INTO jlog VALUES ($1)", 2); err != nil {
			t.Errorf("%v: insert into jlog with a lock: %v", mode, err)
		}
		if w := lockWatermark(t, d, "J"); w != 9 {
			t.Errorf("%v: watermark after the insert into jlog %d, want 9", mode, w)
		}
		execDirect(t, d, "DELETE FROM fenceproxy.locks WHERE name = 'J'")
	}
}

// TestReadThroughViewReplaced: a statement prepared while its view read
// an unprotected table, and then a view over acct created on another
// connection while the proxy runs: once the proxy has seen the change
// (the catalog watch's notification), the same prepared statement, and a
// read through the new view, register.
func TestReadThroughViewReplaced(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := raProxyFor(t, hijackRules)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		t.Run(fmt.Sprint(mode), func(t *testing.T) {
			db, d := rvSetupDB(t, specs, "rdrrepl")
			stale := readerSession(t, p, db, "L", "41", mode)
			mustExec(t, stale, "SELECT n FROM acct WHERE id = 1")
			fresh := readerSession(t, p, db, "L", "42", mode)
			var got string
			// v reads plain (catalogMatrixSchema): nothing registers.
			if err := fresh.QueryRow(ctxT(t), "SELECT payload FROM v WHERE id = $1", 1).Scan(&got); err != nil || got != "p" {
				t.Fatalf("read of v over plain: %q %v", got, err)
			}
			if w := lockWatermark(t, d, "L"); w != 41 {
				t.Fatalf("watermark after a read of plain: %d, want 41", w)
			}
			execDirect(t, d, "CREATE OR REPLACE VIEW v AS SELECT * FROM acct; CREATE VIEW later AS SELECT * FROM acct")
			for _, q := range []string{"SELECT payload FROM v WHERE id = $1", "SELECT payload FROM later WHERE id = $1"} {
				// The notification arrives after the commit: until the
				// proxy has seen it, a read may still register nothing.
				deadline := time.Now().Add(10 * time.Second)
				for {
					if err := fresh.QueryRow(ctxT(t), q, 1).Scan(&got); err != nil {
						t.Fatal(err)
					}
					if lockWatermark(t, d, "L") == 42 {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("%s after the change: the watermark stays at 41", q)
					}
					time.Sleep(20 * time.Millisecond)
				}
				execDirect(t, d, "UPDATE fenceproxy.locks SET token = 41 WHERE name = 'L'")
			}
			execDirect(t, d, "UPDATE fenceproxy.locks SET token = 42 WHERE name = 'L'")
			before := tableText(t, d, "acct")
			if _, err := stale.Exec(ctxT(t), "UPDATE acct SET payload = 'stale' WHERE id = $1", 3); rvCode(err) != "FP001" {
				t.Errorf("stale UPDATE: %v, want FP001", err)
			}
			if after := tableText(t, d, "acct"); after != before {
				t.Errorf("acct changed:\n before %s\n after  %s", before, after)
			}
		})
	}
}
