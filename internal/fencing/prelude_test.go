package fencing_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// The session's values before a simple Query (the prelude: two SET
// LOCALs) are left out where nothing the Query runs reads a fence
// setting: its fences carry the token, it registers no lock, it names no
// setting, and the database check found no code that may read one. These
// tests look at the text the server ran (pg_stat_activity) and at the
// data; behind a transaction pooler, at what code reading the setting
// sees.

// sentText is the last text the server ran for c's session.
func sentText(t *testing.T, d, c *pgx.Conn) string {
	t.Helper()
	pid, ok := sessionPids.Load(c)
	if !ok {
		t.Fatal("test bug: sentText on a session that runPid did not mark")
	}
	var q string
	if err := d.QueryRow(ctxT(t), "SELECT query FROM pg_stat_activity WHERE pid = $1", pid).Scan(&q); err != nil {
		t.Fatal(err)
	}
	return q
}

// runPid marks c with its backend's pid (sentText), which asking for
// would make the last text; through PgBouncer it is unknown.
func runPid(t *testing.T, c *pgx.Conn) *pgx.Conn {
	t.Helper()
	// Asked in a simple Query: a named statement of it would clash with
	// another session's behind a pooler with one server connection.
	var pid uint32
	if err := c.QueryRow(ctxT(t), "SELECT pg_backend_pid()", pgx.QueryExecModeSimpleProtocol).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	sessionPids.Store(c, pid)
	return c
}

// sessionPids are runPid's marks.
var sessionPids sync.Map // *pgx.Conn → uint32

// sentPrelude runs stmt on c (simple protocol) and reports whether the
// server ran the session's values before it. A statement refused because
// the catalog changed since the last check (FP003, which a client
// retries) is sent again.
func sentPrelude(t *testing.T, d, c *pgx.Conn, stmt string) bool {
	t.Helper()
	for i := 0; ; i++ {
		_, err := c.Exec(ctxT(t), stmt)
		if err == nil {
			break
		}
		if sqlState(err) != "FP003" || i == 100 {
			t.Fatalf("%s: %v", stmt, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	q := sentText(t, d, c)
	if !strings.Contains(q, "'::bigint") && !strings.Contains(q, "CALL ") {
		t.Fatalf("%s: sent %s, want a fenced form", stmt, q)
	}
	return strings.HasPrefix(q, "SET LOCAL fence.token = ")
}

// preludeDB makes a database with lockSchema, then extra, then `fenceproxy
// setup` for specs (the objects and the catalog watch).
func preludeDB(t *testing.T, specs []rules.TableSpec, extra string) (string, *pgx.Conn) {
	t.Helper()
	db := schemaDB(t, "prelude", lockSchema+extra)
	d := direct(t, db)
	if _, err := dbsetup.Setup(ctxT(t), d, specs, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	return db, d
}

// preludeSession starts a proxy for cfg with the database check, makes a
// preludeDB with extra, and connects a session with token 7 (simple
// protocol, marked by runPid).
func preludeSession(t *testing.T, cfg rules.Config, extra string) (p *proxytest.Proxy, db string, d, row *pgx.Conn) {
	t.Helper()
	pol, specs := raPolicy(t, cfg)
	p = startProxy(t, pol)
	db, d = preludeDB(t, specs, extra)
	return p, db, d, runPid(t, readerSession(t, p, db, "", "7", pgx.QueryExecModeSimpleProtocol))
}

// checkedPoolerEnv is startPoolerEnv for cfg with the database check and
// the audit listener (raPolicy).
func checkedPoolerEnv(t *testing.T, cfg rules.Config) (*poolerEnv, []rules.TableSpec) {
	t.Helper()
	pol, specs := raPolicy(t, cfg)
	return startPoolerEnvWith(t, pol), specs
}

// noteTokFunc is a trigger function that records the token it reads in
// table seen; noteTokTrigger fires it on acct; noteTokSchema is all of it.
const (
	noteTokFunc    = `CREATE FUNCTION note_tok() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN INSERT INTO seen VALUES (current_setting('fence.token', true)); RETURN NEW; END$$`
	noteTokTrigger = `CREATE TRIGGER acct_seen BEFORE UPDATE ON acct FOR EACH ROW EXECUTE FUNCTION note_tok()`
	noteTokSchema  = "CREATE TABLE seen (tok text);" + noteTokFunc + ";" + noteTokTrigger
)

// seenToks reads table seen.
func seenToks(t *testing.T, d *pgx.Conn) []string {
	t.Helper()
	return testutil.QueryStrings(t, d, "SELECT coalesce(tok, '<null>') FROM seen")
}

func TestPreludeLeftOut(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, db, d, row := preludeSession(t, lockRules, "")

	if sentPrelude(t, d, row, "UPDATE acct SET n = n + 1 WHERE id = 1") {
		t.Errorf("row fencing, token written in, no code reading the settings: the prelude was sent")
	}
	if r := snapshot(t, d, "acct")[1]; r.Fence != 7 {
		t.Errorf("row 1 = %+v, want fence 7", r)
	}
	stale := readerSession(t, p, db, "", "5", pgx.QueryExecModeSimpleProtocol)
	before := tableText(t, d, "acct")
	if _, err := stale.Exec(ctxT(t), "UPDATE acct SET payload = 'stale' WHERE id = 1"); sqlState(err) != "FP001" {
		t.Errorf("stale UPDATE: %v, want FP001", err)
	}
	if after := tableText(t, d, "acct"); after != before {
		t.Errorf("a stale UPDATE changed acct:\n before %s\n after  %s", before, after)
	}

	// A text that may read a setting keeps it, whatever the spelling.
	for _, stmt := range []string{
		"UPDATE acct SET payload = 'x' /* Fence */ WHERE id = 2",
		"UPDATE acct SET payload = coalesce((SELECT setting FROM pg_settings WHERE name = 'fence.token'), '7') WHERE id = 2",
		`UPDATE acct SET payload = current_setting(U&'\0066ence.token') WHERE id = 2`,
		"UPDATE acct SET payload = current_setting('fence.token') WHERE id = 2",
	} {
		if _, err := row.Exec(ctxT(t), stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
		if q := sentText(t, d, row); !strings.HasPrefix(q, "SET LOCAL fence.token = '7'") {
			t.Errorf("%s: sent %s, want the session's values first", stmt, q)
		}
	}
	if r := snapshot(t, d, "acct")[2]; r.Payload != "7" || r.Fence != 7 {
		t.Errorf("row 2 = %+v, want payload 7 (the token read) fence 7", r)
	}

	// A registration goes as one call of hold_at, which takes the values
	// (holdat_test.go): no prelude either.
	holder := runPid(t, readerSession(t, p, db, "L", "7", pgx.QueryExecModeSimpleProtocol))
	if sentPrelude(t, d, holder, "UPDATE acct SET n = n + 1 WHERE id = 3") || !isHoldAtCall(sentText(t, d, holder)) {
		t.Errorf("lock fencing: sent %s, want one call of hold_at and no prelude", sentText(t, d, holder))
	}

	// Code created later that reads the setting brings it back, once the
	// proxy has learnt of it (the catalog watch's notification); dropped,
	// it goes again.
	execDirect(t, d, `CREATE FUNCTION tok_now() RETURNS text LANGUAGE sql STABLE AS $$SELECT current_setting('fence.token', true)$$`)
	waitPrelude(t, d, row, true)
	execDirect(t, d, `DROP FUNCTION tok_now()`)
	waitPrelude(t, d, row, false)
}

// waitPrelude sends a row-fenced UPDATE on c until the prelude's presence
// is want, for up to ten seconds.
func waitPrelude(t *testing.T, d, c *pgx.Conn, want bool) {
	t.Helper()
	waitUntil(t, fmt.Sprintf("after the catalog change, the prelude's presence %v", want), func() bool {
		return sentPrelude(t, d, c, "UPDATE acct SET n = n + 1 WHERE id = 1") == want
	})
}

// waitUntil calls cond until it reports true, every 20 ms for up to ten
// seconds, and fails the test with what if it does not.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not reached in 10 s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPreludeCodeReaders: each kind of code that may read a setting
// keeps the prelude in its database, found by the check before the
// proxy's first statement there.
func TestPreludeCodeReaders(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, specs := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	for _, c := range []struct{ name, sql string }{
		{"trigger function", noteTokSchema},
		{"column default", `ALTER TABLE notes ADD COLUMN who text DEFAULT current_setting('fence.lock', true)`},
		{"view", `CREATE VIEW tok_v AS SELECT current_setting('Fence.Token', true) AS tok`},
		{"policy", `CREATE POLICY p ON jobs USING (current_setting('fence.token', true) IS NOT NULL)`},
		{"check constraint", `ALTER TABLE jobs ADD CONSTRAINT c CHECK (state <> current_setting('fence.token', true))`},
		{"escaped name in a body", `CREATE FUNCTION f() RETURNS text LANGUAGE plpgsql AS $$BEGIN RETURN current_setting(E'\x66ence.token'); END$$`},
		{"SQL-standard body", `CREATE FUNCTION g() RETURNS text LANGUAGE sql BEGIN ATOMIC SELECT current_setting('fence.token'); END`},
		{"argument default", `CREATE FUNCTION h(x text DEFAULT current_setting('fence.token')) RETURNS text LANGUAGE sql AS 'SELECT 1::text'`},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db, d := preludeDB(t, specs, c.sql)
			row := runPid(t, readerSession(t, p, db, "", "7", pgx.QueryExecModeSimpleProtocol))
			if !sentPrelude(t, d, row, "UPDATE acct SET n = n + 1 WHERE id = 1") {
				t.Errorf("the prelude was left out in a database with %s", c.name)
			}
		})
	}
	// And code that reads other settings, or names the fence column,
	// does not.
	db, d := preludeDB(t, specs, `
		CREATE POLICY p ON jobs USING (current_setting('app.tenant', true) IS NULL);
		CREATE FUNCTION bump() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN NEW.last_fence := OLD.last_fence; RETURN NEW; END$$;
		CREATE TRIGGER notes_bump BEFORE UPDATE ON notes FOR EACH ROW EXECUTE FUNCTION bump()`)
	row := runPid(t, readerSession(t, p, db, "", "7", pgx.QueryExecModeSimpleProtocol))
	if sentPrelude(t, d, row, "UPDATE acct SET n = n + 1 WHERE id = 1") {
		t.Errorf("the prelude was sent in a database whose code reads no fence setting")
	}
}

// TestPreludeBehindPooler: fenceproxy → PgBouncer (transaction mode) →
// PostgreSQL, with the database check. Both server connections carry
// another client's token 43. Where no code reads the settings, the
// prelude is left out and the fences still carry each session's own
// token; where a trigger reads fence.token, it sees the session's own.
func TestPreludeBehindPooler(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pe, specs := checkedPoolerEnv(t, lockRules)
	mode := pgx.QueryExecModeSimpleProtocol

	t.Run("no code reads the settings", func(t *testing.T) {
		db, d := preludeDB(t, specs, "")
		before := poolerReset(t, d)
		pe.pollute(t, db, "43", "X")
		stale := pe.session(t, db, mode)
		mustSend(t, stale, "SET fence.token = '41'")
		if err := send(t, stale, "UPDATE acct SET payload = 'stale' WHERE id = 1"); sqlState(err) != "FP001" {
			t.Fatalf("stale write behind the pooler: %v, want FP001", err)
		}
		wantUnchanged(t, d, "acct", before)
		fresh := pe.session(t, db, mode)
		mustSend(t, fresh, "SET fence.token = '44'")
		mustSend(t, fresh, "UPDATE acct SET payload = 'w44' WHERE id = 2")
		mustSend(t, fresh, "INSERT INTO acct (id, payload) VALUES (70, 'w44')")
		got := snapshot(t, d, "acct")
		for _, id := range []int64{2, 70} {
			if r := got[id]; r.Payload != "w44" || r.Fence != 44 {
				t.Errorf("row %d = %+v, want payload w44 stamped 44 (never the connection's 43)", id, r)
			}
		}
		none := pe.session(t, db, mode)
		if err := send(t, none, "UPDATE acct SET payload = 'none' WHERE id = 3"); sqlState(err) != "FP002" {
			t.Errorf("a session with no token on a connection carrying 43: %v, want FP002", err)
		}
	})

	t.Run("a trigger reads the token", func(t *testing.T) {
		db, d := preludeDB(t, specs, noteTokSchema)
		poolerReset(t, d)
		execDirect(t, d, "DELETE FROM seen")
		pe.pollute(t, db, "43", "X")
		fresh := pe.session(t, db, mode)
		mustSend(t, fresh, "SET fence.token = '44'")
		mustSend(t, fresh, "UPDATE acct SET payload = 'w44' WHERE id = 2")
		if seen := seenToks(t, d); len(seen) != 1 || seen[0] != "44" {
			t.Errorf("the trigger saw %q, want the session's own token [44]", seen)
		}
		if r := snapshot(t, d, "acct")[2]; r.Fence != 44 {
			t.Errorf("row 2 = %+v, want fence 44", r)
		}
	})
}
