package dbsetup_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// The register procedure, called as the proxy calls it, by a login role
// that has only the privileges setup grants to PUBLIC.

// registerDB returns a database with the fenceproxy objects, and the role
// the sessions below connect as.
func registerDB(t *testing.T) (db, role string) {
	t.Helper()
	db = newDatabase(t)
	conn := connect(t, db)
	if _, err := dbsetup.Setup(t.Context(), conn, specs(t, rules.Table{Table: "public.config"}), dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	createRole(t, conn, "register_app")
	return db, "register_app"
}

// session connects as role with fence.lock and fence.token set ("" leaves
// a setting unset).
func session(t *testing.T, db, role, lock, token string) *pgx.Conn {
	t.Helper()
	conn := connect(t, db, role)
	for name, v := range map[string]string{"fence.lock": lock, "fence.token": token} {
		if v == "" {
			continue
		}
		if _, err := conn.Exec(t.Context(), "SELECT set_config($1, $2, false)", name, v); err != nil {
			t.Fatal(err)
		}
	}
	return conn
}

// register calls the procedure as the proxy does before a statement on a
// lock-fenced table.
func register(ctx context.Context, conn *pgx.Conn, required bool) error {
	_, err := conn.Exec(ctx, "CALL fenceproxy.register('fence.lock', 'fence.token', $1, false, 'test', 'public.config')", required)
	return err
}

// hold calls fenceproxy.hold as the proxy does in place of register
// where the database has it (objects version 6).
func hold(ctx context.Context, conn *pgx.Conn, required bool) error {
	_, err := conn.Exec(ctx, "CALL fenceproxy.hold('fence.lock', 'fence.token', $1, false, 'test', 'public.config')", required)
	return err
}

// enter calls fenceproxy.enter as the relay does before a Bind where the
// database has it (objects version 7), with the session's values as the
// relay's record has them ("" for unset) and no catalog check.
func enter(ctx context.Context, conn *pgx.Conn, required bool) error {
	_, err := conn.Exec(ctx, `CALL fenceproxy.enter('fence.token', coalesce(pg_catalog.current_setting('fence.token', true), ''),
		'fence.lock', coalesce(pg_catalog.current_setting('fence.lock', true), ''), NULL, true, $1, false, 'test', 'public.config')`, required)
	return err
}

// holdAt calls fenceproxy.hold_at as the relay does in front of a simple
// Query that registers a lock where the database has it (objects version
// 8): with the catalog's stamp and the session's values as the relay's
// record has them ("" for unset).
func holdAt(ctx context.Context, conn *pgx.Conn, required bool) error {
	return callByValue(ctx, conn, "hold_at", required)
}

// reholdAt calls fenceproxy.rehold_at as holdAt calls hold_at. The relay
// calls it only for a session whose registration of the same lock and
// token committed before; called for any other, it must still have
// register's outcome, but for a token above the watermark while another
// session holds the lock (TestReholdAtBelowToken).
func reholdAt(ctx context.Context, conn *pgx.Conn, required bool) error {
	return callByValue(ctx, conn, "rehold_at", required)
}

// callByValue calls fenceproxy.proc(stamp, lock, token, rest), hold_at's
// arguments.
func callByValue(ctx context.Context, conn *pgx.Conn, proc string, required bool) error {
	var stamp int64
	if err := conn.QueryRow(ctx, "SELECT stamp FROM fenceproxy.catalog").Scan(&stamp); err != nil {
		return err
	}
	rest := "fence.token\nfence.lock\nf\nf\ntest\npublic.config"
	if required {
		rest = "fence.token\nfence.lock\nt\nf\ntest\npublic.config"
	}
	_, err := conn.Exec(ctx, `CALL fenceproxy.`+proc+`($1, coalesce(pg_catalog.current_setting('fence.lock', true), ''),
		coalesce(pg_catalog.current_setting('fence.token', true), ''), $2)`, stamp, rest)
	return err
}

// registrations are the procedures a proxy registers with: the tests of
// register run with each, since hold, enter, hold_at and rehold_at must
// have register's outcome in every case.
var registrations = []struct {
	name string
	call func(context.Context, *pgx.Conn, bool) error
}{{"register", register}, {"hold", hold}, {"enter", enter}, {"hold_at", holdAt}, {"rehold_at", reholdAt}}

// sqlState returns err's SQLSTATE, "" for nil or a non-server error.
func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// watermark reads lock's stored token, 0 when it has none.
func watermark(t *testing.T, db, lock string) int64 {
	t.Helper()
	var w int64
	err := connect(t, db).QueryRow(t.Context(), "SELECT coalesce((SELECT token FROM fenceproxy.locks WHERE name = $1), 0)", lock).Scan(&w)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestRegisterStaleToken: once a token is registered, an older one gets
// FP001; the same token again is fine.
func TestRegisterStaleToken(t *testing.T) {
	for _, reg := range registrations {
		t.Run(reg.name, func(t *testing.T) {
			db, role := registerDB(t)
			if err := reg.call(t.Context(), session(t, db, role, "locks/config", "5"), false); err != nil {
				t.Fatal(err)
			}
			err := reg.call(t.Context(), session(t, db, role, "locks/config", "4"), false)
			if sqlState(err) != "FP001" || !strings.Contains(err.Error(), "stale token 4") {
				t.Errorf("older token: %v, want FP001 naming token 4", err)
			}
			if err := reg.call(t.Context(), session(t, db, role, "locks/config", "5"), false); err != nil {
				t.Errorf("same token: %v", err)
			}
			if err := reg.call(t.Context(), session(t, db, role, "locks/other", "1"), false); err != nil {
				t.Errorf("another lock's first token: %v", err)
			}
			// Tokens past the common path's short pattern (19 digits, zero-padded)
			// register and compare as numbers too.
			for _, tc := range []struct{ token, state string }{
				{"0005", ""}, {"9223372036854775806", ""}, {"09223372036854775807", ""},
				{"9223372036854775806", "FP001"}, {"9223372036854775807", ""},
			} {
				if err := reg.call(t.Context(), session(t, db, role, "locks/big", tc.token), true); sqlState(err) != tc.state {
					t.Errorf("lock locks/big, token %s: %v, want %q", tc.token, err, tc.state)
				}
			}
			if w := watermark(t, db, "locks/big"); w != 9223372036854775807 {
				t.Errorf("locks/big watermark %d, want 2^63-1", w)
			}
			if w := watermark(t, db, "locks/config"); w != 5 {
				t.Errorf("watermark %d, want 5", w)
			}
		})
	}
}

// TestRegisterRequired: without a lock name, or with a lock name and no
// valid token, registration fails with FP002 when the table requires a
// lock and does nothing otherwise.
func TestRegisterRequired(t *testing.T) {
	for _, reg := range registrations {
		t.Run(reg.name, func(t *testing.T) {
			db, role := registerDB(t)
			for _, tc := range []struct{ name, lock, token string }{
				{"no lock", "", "5"},
				{"no token", "locks/config", ""},
				{"not a number", "locks/config", "abc"},
				{"zero", "locks/config", "000"},
				{"too large", "locks/config", "9223372036854775808"},
			} {
				t.Run(tc.name, func(t *testing.T) {
					conn := session(t, db, role, tc.lock, tc.token)
					if err := reg.call(t.Context(), conn, true); sqlState(err) != "FP002" {
						t.Errorf("required: %v, want FP002", err)
					}
					if err := reg.call(t.Context(), conn, false); err != nil {
						t.Errorf("optional: %v, want nothing", err)
					}
				})
			}
			if w := watermark(t, db, "locks/config"); w != 0 {
				t.Errorf("watermark %d after invalid registrations, want none", w)
			}
		})
	}
}

// TestRegisterEqualTokensShare: sessions of the lock's current token, in
// open transactions, do not wait for each other.
func TestRegisterEqualTokensShare(t *testing.T) {
	for _, reg := range registrations {
		t.Run(reg.name, func(t *testing.T) {
			db, role := registerDB(t)
			if err := reg.call(t.Context(), session(t, db, role, "locks/config", "7"), false); err != nil {
				t.Fatal(err)
			}
			a := session(t, db, role, "locks/config", "7")
			b := session(t, db, role, "locks/config", "7")
			execSQL(t, a, "BEGIN")
			execSQL(t, b, "BEGIN")
			if err := reg.call(t.Context(), a, false); err != nil {
				t.Fatal(err)
			}
			// Were b to wait for a, this would time out: a's transaction stays open.
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			if err := reg.call(ctx, b, false); err != nil {
				t.Fatalf("second session of the same token: %v", err)
			}
			execSQL(t, a, "COMMIT")
			execSQL(t, b, "COMMIT")
		})
	}
}

// TestRegisterNewerWaitsForOlder: a newer token's registration waits until
// the transaction that registered the older token ends; once the newer
// token's transaction commits, the older token gets FP001 (its session
// waits for that commit rather than failing early or writing meanwhile).
//
// Not rehold_at: the relay calls it only for a token whose registration
// committed, never above the watermark; there, rather than wait for the
// lock exclusively while holding it shared, it refuses the statement for
// a retry (TestReholdAtBelowToken).
func TestRegisterNewerWaitsForOlder(t *testing.T) {
	for _, reg := range registrations {
		if reg.name == "rehold_at" {
			continue
		}
		t.Run(reg.name, func(t *testing.T) {
			db, role := registerDB(t)
			admin := connect(t, db)
			if err := reg.call(t.Context(), session(t, db, role, "locks/config", "7"), false); err != nil {
				t.Fatal(err)
			}
			older := session(t, db, role, "locks/config", "7")
			newer := session(t, db, role, "locks/config", "8")
			execSQL(t, older, "BEGIN")
			if err := reg.call(t.Context(), older, false); err != nil {
				t.Fatal(err)
			}

			execSQL(t, newer, "BEGIN")
			newerDone := make(chan error, 1)
			go func() { newerDone <- reg.call(t.Context(), newer, false) }()
			waitForLockWait(t, admin, newer.PgConn().PID())
			select {
			case err := <-newerDone:
				t.Fatalf("the newer token registered while the older one's transaction was open (%v)", err)
			default:
			}
			execSQL(t, older, "COMMIT")
			if err := receive(t, newerDone); err != nil {
				t.Fatalf("newer token after the older transaction ended: %v", err)
			}

			// The newer token's transaction is open: the older token waits for it,
			// then is refused.
			execSQL(t, older, "BEGIN")
			olderDone := make(chan error, 1)
			go func() { olderDone <- reg.call(t.Context(), older, false) }()
			waitForLockWait(t, admin, older.PgConn().PID())
			execSQL(t, newer, "COMMIT")
			if err := receive(t, olderDone); sqlState(err) != "FP001" {
				t.Errorf("older token after the newer one committed: %v, want FP001", err)
			}
			execSQL(t, older, "ROLLBACK")
			if w := watermark(t, db, "locks/config"); w != 8 {
				t.Errorf("watermark %d, want 8", w)
			}
		})
	}
}

// receive waits for a registration's result.
func receive(t *testing.T, c <-chan error) error {
	t.Helper()
	select {
	case err := <-c:
		return err
	case <-time.After(20 * time.Second):
		t.Fatal("registration still waiting")
		return nil
	}
}

// TestRegisterEveryCall: every registration reads the watermark, a
// second one of the same lock and token in a transaction included, so that
// a token changed in the transaction (SET LOCAL) is checked; the memo the
// database guard trusts (fenceproxy.guard_registered) does not spare it,
// set by the procedure or by hand for the session.
func TestRegisterEveryCall(t *testing.T) {
	for _, reg := range registrations {
		t.Run(reg.name, func(t *testing.T) {
			db, role := registerDB(t)
			conn := session(t, db, role, "locks/config", "5")
			ctx := t.Context()
			// scans counts this transaction's index scans of the watermarks.
			scans := func() int64 {
				t.Helper()
				var n int64
				if err := conn.QueryRow(ctx, "SELECT idx_scan FROM pg_stat_xact_user_tables WHERE relid = 'fenceproxy.locks'::regclass").Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}
			registers := func(name string) {
				t.Helper()
				before := scans()
				if err := reg.call(ctx, conn, false); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				if scans() == before {
					t.Errorf("%s: the registration read no watermark", name)
				}
			}

			if err := reg.call(ctx, conn, false); err != nil {
				t.Fatal(err)
			}
			execSQL(t, conn, "BEGIN")
			registers("first in the transaction")
			registers("same lock and token again")
			execSQL(t, conn, "SET LOCAL fence.token = '6'")
			registers("newer token")
			execSQL(t, conn, "SET LOCAL fence.token = '5'")
			if err := reg.call(ctx, conn, false); sqlState(err) != "FP001" {
				t.Errorf("the first token again after the newer one: %v, want FP001", err)
			}
			execSQL(t, conn, "ROLLBACK")
			if w := watermark(t, db, "locks/config"); w != 5 {
				t.Errorf("watermark %d after the rollback, want 5", w)
			}

			if err := reg.call(ctx, session(t, db, role, "locks/config", "7"), false); err != nil {
				t.Fatal(err)
			}
			stale := session(t, db, role, "locks/config", "5")
			execSQL(t, stale, `SET fenceproxy.guard_registered = E'locks/config\n5'`)
			for _, tx := range []string{"", "BEGIN; SET LOCAL fenceproxy.guard_registered = E'locks/config\\n5'"} {
				if tx != "" {
					execSQL(t, stale, tx)
				}
				if err := reg.call(ctx, stale, false); sqlState(err) != "FP001" {
					t.Errorf("a stale token with the guard's memo set (%q): %v, want FP001", tx, err)
				}
				if tx != "" {
					execSQL(t, stale, "ROLLBACK")
				}
			}
		})
	}
}

// TestRegisterRestoresLoweredWatermark: a watermark lowered (or deleted)
// by hand while a registration of the equal token waits for the lock is
// put back to the token, so older tokens stay refused.
func TestRegisterRestoresLoweredWatermark(t *testing.T) {
	for _, reg := range registrations {
		t.Run(reg.name, func(t *testing.T) {
			db, role := registerDB(t)
			ctx := t.Context()
			for _, lower := range []string{"UPDATE fenceproxy.locks SET token = 3", "DELETE FROM fenceproxy.locks"} {
				if err := reg.call(ctx, session(t, db, role, "locks/config", "5"), false); err != nil {
					t.Fatal(err)
				}
				admin := connect(t, db)
				execSQL(t, admin, "BEGIN; SELECT pg_advisory_xact_lock(1179667531, hashtext('locks/config')); "+lower)
				holder := session(t, db, role, "locks/config", "5")
				execSQL(t, holder, "BEGIN")
				done := make(chan error, 1)
				go func() { done <- reg.call(ctx, holder, false) }()
				waitForLockWait(t, admin, holder.PgConn().PID())
				execSQL(t, admin, "COMMIT")
				if err := receive(t, done); err != nil {
					t.Fatalf("%s: %v", lower, err)
				}
				execSQL(t, holder, "COMMIT")
				if w := watermark(t, db, "locks/config"); w != 5 {
					t.Errorf("%s: watermark %d after the registration, want 5", lower, w)
				}
				if err := reg.call(ctx, session(t, db, role, "locks/config", "4"), false); sqlState(err) != "FP001" {
					t.Errorf("%s: an older token afterwards: %v, want FP001", lower, err)
				}
			}
		})
	}
}

// TestHoldCommonCase: hold registers the lock's current token without
// calling register (its saving), and calls it for everything else: a
// newer token, REPEATABLE READ, a token past 18 digits.
func TestHoldCommonCase(t *testing.T) {
	db, role := registerDB(t)
	ctx := t.Context()
	if err := hold(ctx, session(t, db, role, "locks/config", "5"), false); err != nil {
		t.Fatal(err)
	}
	// registerCalls runs hold in a transaction of a session of token,
	// counting the calls of register it makes (track_functions is a
	// superuser's setting: the role is given it for the test).
	admin := connect(t, db)
	execSQL(t, admin, "ALTER ROLE "+role+" SET track_functions = 'pl'")
	registerCalls := func(token, begin string) int64 {
		t.Helper()
		conn := session(t, db, role, "locks/config", token)
		execSQL(t, conn, begin)
		defer execSQL(t, conn, "ROLLBACK")
		if err := hold(ctx, conn, false); err != nil {
			t.Fatalf("token %s, %s: %v", token, begin, err)
		}
		var n int64
		if err := conn.QueryRow(ctx, `SELECT coalesce((SELECT calls FROM pg_stat_xact_user_functions
			WHERE schemaname = 'fenceproxy' AND funcname = 'register'), 0)`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, tc := range []struct {
		token, begin string
		calls        int64
	}{
		{"5", "BEGIN", 0},
		{"0005", "BEGIN", 0},
		{"5", "BEGIN ISOLATION LEVEL REPEATABLE READ", 1},
		{"6", "BEGIN", 1},
		{"0000000000000000006", "BEGIN", 1},
	} {
		if n := registerCalls(tc.token, tc.begin); n != tc.calls {
			t.Errorf("token %s, %s: register called %d times, want %d", tc.token, tc.begin, n, tc.calls)
		}
	}
}

// TestHoldSearchPath: hold and enter set no search_path, so a session's
// own operators and functions, found first on its search_path, must
// change nothing: a stale token is still refused, with the watermark
// unmoved.
func TestHoldSearchPath(t *testing.T) {
	for _, reg := range registrations[1:] {
		t.Run(reg.name, func(t *testing.T) { testHoldSearchPath(t, reg.call) })
	}
}

func testHoldSearchPath(t *testing.T, hold func(context.Context, *pgx.Conn, bool) error) {
	db, role := registerDB(t)
	ctx := t.Context()
	if err := hold(ctx, session(t, db, role, "locks/config", "5"), false); err != nil {
		t.Fatal(err)
	}
	admin := connect(t, db)
	execSQL(t, admin, `CREATE SCHEMA evil; GRANT USAGE ON SCHEMA evil TO PUBLIC;
		CREATE FUNCTION evil.yes(bigint, bigint) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT true';
		CREATE OPERATOR evil.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.yes);
		CREATE FUNCTION evil.yes(text, text) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT true';
		CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.yes);
		CREATE FUNCTION evil.current_setting(text, boolean) RETURNS text LANGUAGE sql AS 'SELECT ''5''';
		CREATE FUNCTION evil.ltrim(text, text) RETURNS text LANGUAGE sql AS 'SELECT ''''';
		CREATE FUNCTION evil.set_config(text, text, boolean) RETURNS text LANGUAGE sql AS 'SELECT ''''';
		CREATE TABLE evil.locks (name text, token bigint); INSERT INTO evil.locks VALUES ('locks/config', 4);
		GRANT SELECT ON evil.locks TO PUBLIC`)
	stale := session(t, db, role, "locks/config", "4")
	execSQL(t, stale, "SET search_path = evil, pg_catalog, public")
	if err := hold(ctx, stale, false); sqlState(err) != "FP001" {
		t.Errorf("stale token with the session's operators first on its search_path: %v, want FP001", err)
	}
	if w := watermark(t, db, "locks/config"); w != 5 {
		t.Errorf("watermark %d, want 5", w)
	}

	// Type names too: PL/pgSQL resolves those of the body on the caller's
	// search_path, where pg_temp comes first. A text that compares
	// without trailing blanks would read lock 'L1 ' (at 10) as 'L1' (at
	// 9); a temporary table named text would break every call.
	for lock, token := range map[string]string{"L1": "9", "L1 ": "10"} {
		if err := hold(ctx, session(t, db, role, lock, token), false); err != nil {
			t.Fatal(err)
		}
	}
	for _, shadow := range []string{"CREATE DOMAIN pg_temp.text AS pg_catalog.bpchar", "CREATE TEMP TABLE text (x int)"} {
		conn := session(t, db, role, "L1 ", "9")
		execSQL(t, conn, shadow)
		if err := hold(ctx, conn, false); sqlState(err) != "FP001" {
			t.Errorf("%s: a stale token: %v, want FP001", shadow, err)
		}
		conn = session(t, db, role, "L1 ", "10")
		execSQL(t, conn, shadow)
		if err := hold(ctx, conn, false); err != nil {
			t.Errorf("%s: the current token: %v", shadow, err)
		}
	}
}

// TestEnterSettings: enter applies the values it is given, for the
// transaction only, before it registers: a server connection that
// carries another session's newer token (behind a pooler) cannot stand
// in for a stale one, and a session's own set_config, first on its
// search_path, changes nothing.
func TestEnterSettings(t *testing.T) {
	db, role := registerDB(t)
	ctx := t.Context()
	if err := hold(ctx, session(t, db, role, "locks/config", "5"), false); err != nil {
		t.Fatal(err)
	}
	admin := connect(t, db)
	execSQL(t, admin, `CREATE SCHEMA evil; GRANT USAGE ON SCHEMA evil TO PUBLIC;
		CREATE FUNCTION evil.set_config(text, text, boolean) RETURNS text LANGUAGE sql AS 'SELECT ''''';`)
	conn := session(t, db, role, "locks/other", "9")
	execSQL(t, conn, "SET search_path = evil, pg_catalog, public")
	call := func(token string, register bool) error {
		_, err := conn.Exec(ctx, `CALL fenceproxy.enter('fence.token', $1, 'fence.lock', 'locks/config', NULL, $2, false, false, 'test', 'public.config')`, token, register)
		return err
	}
	settings := func() string {
		var s string
		if err := conn.QueryRow(ctx, "SELECT pg_catalog.current_setting('fence.lock') || '=' || pg_catalog.current_setting('fence.token')").Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	// Each step in a transaction of its own: the call, the settings in
	// the transaction ("" when the call fails), its end, and the settings
	// after it (the session's again).
	for _, st := range []struct {
		name, token string
		register    bool
		state, in   string
		end         string
	}{
		{"a stale token given, a newer one on the connection", "4", true, "FP001", "", "ROLLBACK"},
		{"the current token", "5", true, "", "locks/config=5", "COMMIT"},
		{"no registration: it only sets them", "4", false, "", "locks/config=4", "ROLLBACK"},
	} {
		execSQL(t, conn, "BEGIN")
		if err := call(st.token, st.register); sqlState(err) != st.state || (st.state == "" && err != nil) {
			t.Errorf("%s: %v, want SQLSTATE %q", st.name, err, st.state)
		}
		if st.in != "" {
			if got := settings(); got != st.in {
				t.Errorf("%s, in the transaction: %s, want %s", st.name, got, st.in)
			}
		}
		execSQL(t, conn, st.end)
		if got := settings(); got != "locks/other=9" {
			t.Errorf("%s, after the transaction: %s, want the session's locks/other=9", st.name, got)
		}
	}
	if w := watermark(t, db, "locks/config"); w != 5 {
		t.Errorf("watermark %d, want 5", w)
	}
}

// TestEnterCheckCommonCase: enter's common case of the catalog check is
// catalog_at's first statement, word for word, so that it never passes a
// statement catalog_at would stop (every other case calls catalog_at).
func TestEnterCheckCommonCase(t *testing.T) {
	first := func(file, tag string) string {
		t.Helper()
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		_, body, ok := strings.Cut(string(b), "AS $"+tag+"$")
		if !ok {
			t.Fatalf("%s: no $%s$ body", file, tag)
		}
		i := strings.Index(body, "PERFORM FROM fenceproxy.catalog c")
		if i < 0 {
			t.Fatalf("%s: $%s$ does not read fenceproxy.catalog", file, tag)
		}
		stmt, _, _ := strings.Cut(body[i:], ";")
		return strings.Join(strings.Fields(stmt), " ")
	}
	at := first("watch.sql", "at")
	for _, proc := range []string{"enter", "hold_at", "rehold_at"} {
		if got := first("objects.sql", proc); got != at {
			t.Errorf("%s's common case differs from catalog_at's:\n catalog_at: %s\n %s: %s", proc, at, proc, got)
		}
	}
}

// TestHoldAtCommonCase: hold_at's common case of the registration is
// hold's, word for word, from the test of the values to the return, so
// that it never spares a registration hold would make (every other case
// calls register).
func TestHoldAtCommonCase(t *testing.T) {
	b, err := os.ReadFile("objects.sql")
	if err != nil {
		t.Fatal(err)
	}
	common := func(tag string) string {
		t.Helper()
		_, body, ok := strings.Cut(string(b), "AS $"+tag+"$")
		if !ok {
			t.Fatalf("objects.sql: no $%s$ body", tag)
		}
		i := strings.Index(body, "IF pg_catalog.octet_length(lk)")
		j := strings.Index(body, "RETURN;")
		if i < 0 || j < i {
			t.Fatalf("objects.sql: $%s$ has no common case", tag)
		}
		return strings.Join(strings.Fields(body[i:j]), " ")
	}
	if hold, at := common("hold"), common("hold_at"); hold != at {
		t.Errorf("hold_at's common case differs from hold's:\n hold:    %s\n hold_at: %s", hold, at)
	}
}

// TestReholdAtSlowPath: every case of rehold_at but its common one (and
// the refusal of a watermark below the token) is hold_at's: it ends by
// calling hold_at with its own arguments, unchanged.
func TestReholdAtSlowPath(t *testing.T) {
	b, err := os.ReadFile("objects.sql")
	if err != nil {
		t.Fatal(err)
	}
	_, body, ok := strings.Cut(string(b), "AS $rehold_at$")
	if !ok {
		t.Fatal("objects.sql: no $rehold_at$ body")
	}
	body, _, _ = strings.Cut(body, "$rehold_at$")
	tail := strings.Join(strings.Fields(body[strings.LastIndex(body, "END IF;")+len("END IF;"):]), " ")
	if want := "-- Not the common case: hold_at's, which ends in register (its check -- of the catalog passes now, and a shared lock held twice is held). CALL fenceproxy.hold_at(want, lk, tk, rest); END"; tail != want {
		t.Errorf("rehold_at's slow path is not a call of hold_at with its arguments:\n got  %s\n want %s", tail, want)
	}
}

// TestEnterCatalogCheck: enter passes the stamp the catalog has without
// calling catalog_at, and hands any other to it, which refuses it (FP003).
func TestEnterCatalogCheck(t *testing.T) {
	db, role := registerDB(t)
	ctx := t.Context()
	admin := connect(t, db)
	var stamp int64
	if err := admin.QueryRow(ctx, "SELECT stamp FROM fenceproxy.catalog").Scan(&stamp); err != nil {
		t.Fatalf("the catalog watch (setup as a superuser installs it): %v", err)
	}
	execSQL(t, admin, "ALTER ROLE "+role+" SET track_functions = 'pl'")
	check := func(want int64) (string, error) {
		t.Helper()
		conn := session(t, db, role, "", "")
		execSQL(t, conn, "BEGIN")
		defer execSQL(t, conn, "ROLLBACK")
		_, err := conn.Exec(ctx, "CALL fenceproxy.enter('fence.token', '', 'fence.lock', '', $1, false, false, false, '', '')", want)
		if err != nil {
			return "", err
		}
		var calls string
		if err := conn.QueryRow(ctx, `SELECT coalesce(string_agg(funcname || '=' || calls, ' ' ORDER BY funcname), '')
			FROM pg_stat_xact_user_functions WHERE schemaname = 'fenceproxy'`).Scan(&calls); err != nil {
			t.Fatal(err)
		}
		return calls, nil
	}
	if calls, err := check(stamp); err != nil || calls != "enter=1" {
		t.Errorf("the catalog's stamp: %q, %v; want enter=1 alone", calls, err)
	}
	_, err := check(stamp - 1)
	if sqlState(err) != "FP003" || !strings.Contains(err.Error(), "changed since the proxy checked it") {
		t.Errorf("an older stamp: %v, want catalog_at's FP003", err)
	}
}

// TestReholdAtBelowToken: rehold_at with a token above the watermark (the
// relay's memory of a commit made wrong: a watermark lowered by hand, a
// commit lost in a failover) registers where no other session holds the
// lock, and otherwise refuses the statement with FP003, changing
// nothing, instead of waiting for the lock exclusively while it holds it
// shared (two such sessions would wait for each other).
func TestReholdAtBelowToken(t *testing.T) {
	db, role := registerDB(t)
	if err := register(t.Context(), session(t, db, role, "locks/config", "7"), false); err != nil {
		t.Fatal(err)
	}
	if err := reholdAt(t.Context(), session(t, db, role, "locks/config", "8"), false); err != nil {
		t.Fatalf("alone, above the watermark: %v", err)
	}
	if w := watermark(t, db, "locks/config"); w != 8 {
		t.Fatalf("watermark %d, want 8", w)
	}
	holder := session(t, db, role, "locks/config", "8")
	execSQL(t, holder, "BEGIN")
	if err := register(t.Context(), holder, false); err != nil {
		t.Fatal(err)
	}
	newer := session(t, db, role, "locks/config", "9")
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := reholdAt(ctx, newer, false); sqlState(err) != "FP003" {
		t.Errorf("above the watermark while another session holds the lock: %v, want FP003", err)
	}
	if w := watermark(t, db, "locks/config"); w != 8 {
		t.Errorf("watermark %d after the refusal, want 8", w)
	}
	execSQL(t, holder, "COMMIT")
	if err := reholdAt(t.Context(), newer, false); err != nil {
		t.Errorf("retried once the other session is done: %v", err)
	}
	if w := watermark(t, db, "locks/config"); w != 9 {
		t.Errorf("watermark %d after the retry, want 9", w)
	}
}
