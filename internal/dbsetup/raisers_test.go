package dbsetup_test

import (
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestRaisers: setup installs the error raisers; they raise FP001 and FP002
// with the markers the proxy translates into the same errors as the inline
// form's; check reports them usable only while they are objects.sql's and
// callable by every role, and setup restores them.
func TestRaisers(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, "CREATE TABLE config (id int PRIMARY KEY, last_fence bigint NOT NULL DEFAULT 0)")
	// Row fencing only: the raisers serve it too, and need no lock objects.
	sp := specs(t, rules.Table{Table: "public.config", Lock: "off"})
	setup := func() {
		t.Helper()
		if _, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	raisers := func() bool {
		t.Helper()
		rep, err := dbsetup.Check(t.Context(), conn, sp)
		if err != nil {
			t.Fatal(err)
		}
		if !rep.OK() {
			t.Fatalf("check: %+v", rep.Problems)
		}
		return rep.Raisers
	}
	if raisers() {
		t.Fatal("Raisers before setup")
	}
	setup()
	if !raisers() {
		t.Fatal("no Raisers after setup")
	}

	// What they raise, and what the proxy makes of it.
	raise := func(sql string) *pgconn.PgError {
		t.Helper()
		_, err := conn.Exec(t.Context(), sql)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) {
			t.Fatalf("%s: %v, want an error", sql, err)
		}
		return pe
	}
	for _, tc := range []struct{ set, detail string }{
		{"", "fence.token is not set."}, // never set in the session
		{"SET fence.token = 'ab''c'", `fence.token is "ab'c".`},
		{"SET fence.token = ''", "fence.token is not set (or empty)."},
	} {
		if tc.set != "" {
			execSQL(t, conn, tc.set)
		}
		for _, call := range []string{"no_token('fence.token', '13:public.config:11:fence.token:')", "no_token_b('fence.token', '13:public.config:11:fence.token:')",
			"tok('fence.token', '13:public.config:11:fence.token:')", "tok_b('fence.token', '13:public.config:11:fence.token:')",
			"advance('fence.token', 0, false, '13:public.config', '13:public.config:11:fence.token:')"} {
			fn, _, _ := strings.Cut(call, "(")
			pe := raise("SELECT fenceproxy." + call)
			fe, ok := rules.TranslateError(pe.Code, pe.Message)
			if pe.Code != "FP002" || !ok || fe.Code != rules.CodeMissingToken || fe.Detail != tc.detail || fe.Table != "public.config" {
				t.Errorf("%s after %s: %s %q → %+v", fn, tc.set, pe.Code, pe.Message, fe)
			}
		}
	}

	execSQL(t, conn, "SET fence.token = '007'")
	for _, fn := range []string{"stale", "stale_b"} {
		pe := raise("SELECT fenceproxy." + fn + "('fence.token', 9, '13:public.config')")
		if pe.Code != "FP001" || pe.Message != "fenceproxy:stale:007:9:13:public.config" {
			t.Errorf("%s: %s %q", fn, pe.Code, pe.Message)
		}
		fe, ok := rules.TranslateError(pe.Code, pe.Message)
		if !ok || fe.Code != rules.CodeStaleToken || fe.Message != "fenceproxy: stale fencing token 7 for table public.config (stored watermark 9)" {
			t.Errorf("%s translated: %+v, %v", fn, fe, ok)
		}
	}
	for _, fn := range []string{"stale('fence.token', NULL, '13:public.config')",
		"advance('fence.token', NULL, false, '13:public.config', '13:public.config:11:fence.token:')"} {
		pe := raise("SELECT fenceproxy." + fn)
		if fe, ok := rules.TranslateError(pe.Code, pe.Message); !ok || !strings.HasSuffix(fe.Message, "(stored watermark NULL)") {
			t.Errorf("NULL fence, %s: %q → %+v", fn, pe.Message, fe)
		}
	}
	testCheckingRaisers(t, conn, raise)
	// Check finds each way they could stop being usable; setup mends it.
	for _, tc := range []struct{ name, breakSQL string }{
		{"dropped", "DROP FUNCTION fenceproxy.no_token_b(text, text)"},
		{"replaced", "CREATE OR REPLACE FUNCTION fenceproxy.stale(token_setting text, fence bigint, sized_table text) RETURNS bigint LANGUAGE sql STABLE AS 'SELECT 1::bigint'"},
		{"overloaded", "CREATE FUNCTION fenceproxy.stale(token_setting text, fence integer, sized_table text) RETURNS bigint LANGUAGE sql AS 'SELECT 1::bigint'"},
		{"execute revoked", "REVOKE EXECUTE ON FUNCTION fenceproxy.stale_b(text, bigint, text) FROM PUBLIC"},
		{"schema usage revoked", "REVOKE USAGE ON SCHEMA fenceproxy FROM PUBLIC"},
		{"anyone may create in the schema", "GRANT CREATE ON SCHEMA fenceproxy TO PUBLIC"},
		{"owned by another role", "CREATE ROLE raiser_owner; ALTER FUNCTION fenceproxy.no_token(text, text) OWNER TO raiser_owner"},
		{"version 1", "UPDATE fenceproxy.meta SET value = '1' WHERE key = 'version'"},
		{"version 2", "UPDATE fenceproxy.meta SET value = '2' WHERE key = 'version'"},
		{"advance replaced", "CREATE OR REPLACE FUNCTION fenceproxy.advance(token_setting text, fence bigint, strict boolean, sized_table text, sized_names text) RETURNS bigint LANGUAGE sql STABLE AS 'SELECT 1::bigint'"},
		{"tok_b dropped", "DROP FUNCTION fenceproxy.tok_b(text, text)"},
		{"tok_b immutable", "ALTER FUNCTION fenceproxy.tok_b(text, text) IMMUTABLE"},
		{"advance strict", "ALTER FUNCTION fenceproxy.advance(text, bigint, boolean, text, text) STRICT"},
		{"tok security definer", "ALTER FUNCTION fenceproxy.tok(text, text) SECURITY DEFINER"},
		{"stale with a setting", "ALTER FUNCTION fenceproxy.stale(text, bigint, text) SET search_path = public"},
	} {
		execSQL(t, conn, tc.breakSQL)
		if raisers() {
			t.Errorf("%s: check still reports the raisers usable", tc.name)
		}
		switch tc.name {
		case "overloaded":
			execSQL(t, conn, "DROP FUNCTION fenceproxy.stale(text, integer, text)")
		case "owned by another role":
			execSQL(t, conn, "ALTER FUNCTION fenceproxy.no_token(text, text) OWNER TO CURRENT_USER; DROP ROLE raiser_owner")
		}
		setup()
		if !raisers() {
			t.Errorf("%s: setup did not restore the raisers", tc.name)
		}
	}
}

// testCheckingRaisers: the raisers that check (tok, tok_b, advance) accept
// exactly the tokens the inline form accepts, and advance moves the
// watermark as the inline CASE does, raising FP001 as stale does.
func testCheckingRaisers(t *testing.T, conn *pgx.Conn, raise func(string) *pgconn.PgError) {
	t.Helper()
	for _, tc := range []struct {
		token string
		want  int64 // 0: FP002
	}{
		{"7", 7}, {"007", 7}, {"9223372036854775807", 9223372036854775807}, {"00009223372036854775807", 9223372036854775807},
		{"999999999999999999", 999999999999999999}, {"1000000000000000000", 1000000000000000000}, {"000000000000000000001", 1},
		{"9223372036854775806", 9223372036854775806}, {"99999999999999999999", 0}, {"10000000000000000000", 0}, {"", 0}, {"00", 0},
		{"0", 0}, {"-5", 0}, {"+5", 0}, {" 5", 0}, {"5 ", 0}, {"1e3", 0}, {"0x10", 0}, {"9223372036854775808", 0}, {"٣", 0},
	} {
		execSQL(t, conn, "SELECT pg_catalog.set_config('fence.token', '"+strings.ReplaceAll(tc.token, "'", "''")+"', false)")
		for _, call := range []string{"tok('fence.token', '13:public.config:11:fence.token:')",
			"advance('fence.token', 1, false, '13:public.config', '13:public.config:11:fence.token:')"} {
			if tc.want == 0 {
				if pe := raise("SELECT fenceproxy." + call); pe.Code != "FP002" {
					t.Errorf("token %q, %s: %s %s", tc.token, call, pe.Code, pe.Message)
				}
				continue
			}
			var got int64
			if err := conn.QueryRow(t.Context(), "SELECT fenceproxy."+call).Scan(&got); err != nil || got != tc.want {
				t.Errorf("token %q, %s: %d, %v; want %d", tc.token, call, got, err, tc.want)
			}
		}
		if tc.want == 0 {
			if pe := raise("SELECT fenceproxy.tok_b('fence.token', '13:public.config:11:fence.token:')"); pe.Code != "FP002" {
				t.Errorf("token %q, tok_b: %s %s", tc.token, pe.Code, pe.Message)
			}
		} else {
			var ok bool
			if err := conn.QueryRow(t.Context(), "SELECT fenceproxy.tok_b('fence.token', '13:public.config:11:fence.token:')").Scan(&ok); err != nil || !ok {
				t.Errorf("token %q, tok_b: %v, %v", tc.token, ok, err)
			}
		}
	}
	execSQL(t, conn, "SET fence.token = '007'")
	for _, tc := range []struct {
		fence  int64
		strict bool
		stale  bool
	}{
		{6, false, false}, {6, true, false}, {7, false, false}, {7, true, true}, {8, false, true}, {8, true, true},
	} {
		call := fmt.Sprintf("SELECT fenceproxy.advance('fence.token', %d, %v, '13:public.config', '13:public.config:11:fence.token:')", tc.fence, tc.strict)
		if !tc.stale {
			var got int64
			if err := conn.QueryRow(t.Context(), call).Scan(&got); err != nil || got != 7 {
				t.Errorf("%s: %d, %v; want 7", call, got, err)
			}
			continue
		}
		pe := raise(call)
		if pe.Code != "FP001" || pe.Message != fmt.Sprintf("fenceproxy:stale:007:%d:13:public.config", tc.fence) {
			t.Errorf("%s: %s %q", call, pe.Code, pe.Message)
		}
	}
	// A NULL fence is stale, strict or not; an invalid token is FP002
	// whatever the fence, as the inline form's order has it.
	for _, strict := range []bool{false, true} {
		call := fmt.Sprintf("SELECT fenceproxy.advance('fence.token', NULL, %v, '13:public.config', '13:public.config:11:fence.token:')", strict)
		if pe := raise(call); pe.Code != "FP001" || pe.Message != "fenceproxy:stale:007::13:public.config" {
			t.Errorf("%s: %s %q", call, pe.Code, pe.Message)
		}
	}
	execSQL(t, conn, "SET fence.token = 'x'")
	for _, fence := range []string{"NULL", "100", "1"} {
		call := "SELECT fenceproxy.advance('fence.token', " + fence + ", false, '13:public.config', '13:public.config:11:fence.token:')"
		if pe := raise(call); pe.Code != "FP002" {
			t.Errorf("invalid token, %s: %s %q", call, pe.Code, pe.Message)
		}
	}
}

// TestRaisersPattern: the raisers that validate the token do it with the
// inline form's pattern.
func TestRaisersPattern(t *testing.T) {
	objects, err := os.ReadFile("objects.sql")
	if err != nil {
		t.Fatal(err)
	}
	// The short pattern first (up to 18 significant digits, all in range),
	// then the full one: together they accept what the full one accepts.
	test := "IF tk OPERATOR(pg_catalog.~) '" + rules.ShortTokenPattern() + "' OR tk OPERATOR(pg_catalog.~) '" + rules.TokenPattern() + "' THEN"
	uses := strings.Count(string(objects), test)
	if all := strings.Count(string(objects), "OPERATOR(pg_catalog.~)"); uses != 3 || all != 2*uses {
		t.Errorf("objects.sql validates the token with the short and the full pattern %d times (want 3: tok, tok_b, advance), uses ~ %d times", uses, all)
	}
	// The register procedure's common path casts a token the short pattern
	// accepts: it must accept only valid tokens.
	if fast := "tk ~ '" + rules.ShortTokenPattern() + "' THEN\n\t\ttok := tk::bigint;"; strings.Count(string(objects), fast) != 1 {
		t.Errorf("the register procedure's common path does not test the token with the short pattern (%q)", fast)
	}
}

// setupConfig returns a new database with a fenced config table, lock
// fencing as lock says ("" for the default), after setup: its name, a
// superuser's connection and the specs.
func setupConfig(t *testing.T, lock string) (string, *pgx.Conn, []rules.TableSpec) {
	t.Helper()
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, "CREATE TABLE config (id int PRIMARY KEY, last_fence bigint NOT NULL DEFAULT 0)")
	sp := specs(t, rules.Table{Table: "public.config", Lock: lock})
	if _, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	return db, conn, sp
}

// TestLockWithOlderObjects: objects of versions 1 (before the raisers),
// 3 (before the cheaper register procedure), 4 (before stale_at), 5
// (before hold), 6 (before enter), 7 (before hold_at) and 8 (before
// rehold_at), each with the
// procedure those versions installed, still serve lock fencing, with a
// note that setup upgrades them; the check accepts the old procedure only
// with versions before 4, reports stale_at (StaleAt) only from version 5,
// hold (Hold) only from version 6, enter (Enter) only from version 7,
// hold_at (HoldAt) only from version 8 and rehold_at (ReholdAt) only from
// version 9; hold, hold_at and rehold_at as those versions installed
// them (their reads by the primary key, without the index of version 10)
// it accepts as this version's.
func TestLockWithOlderObjects(t *testing.T) {
	oldRegister, err := os.ReadFile("register_v1.sql")
	if err != nil {
		t.Fatal(err)
	}
	// hold, hold_at and rehold_at as versions 6 to 9 installed them: the
	// reads of the watermark by the primary key.
	objects, err := os.ReadFile("objects.sql")
	if err != nil {
		t.Fatal(err)
	}
	byKey := func(name string) string {
		t.Helper()
		return dbsetup.ByPrimaryKey(procedureSQL(t, string(objects), name))
	}
	for _, tc := range []struct {
		version          string
		raisers, staleAt bool
		hold, enter      bool
		holdAt, reholdAt bool
		note             string
	}{
		{"1", false, false, false, false, false, false, "whose error raisers and lock registration make fenced writes cheaper"},
		{"3", true, false, false, false, false, false, "whose lock registration and error raisers cost the server less"},
		{"4", true, false, false, false, false, false, "whose lock registration and error raiser for a stale row cost the server less"},
		{"5", true, true, false, false, false, false, "whose lock registration costs the server less"},
		{"6", true, true, true, false, false, false, "with which fenceproxy sends one statement of its own, not three, before a statement of the extended protocol"},
		{"7", true, true, true, true, false, false, "with which fenceproxy sends one statement of its own, not four, in front of a simple Query that registers a lock"},
		{"8", true, true, true, true, true, false, "with which a lock registration reads the watermark once, not twice, for a session that registered the same token before"},
		{"9", true, true, true, true, true, true, "with which the read of a lock's watermark compares names byte by byte, not under the database's collation"},
	} {
		t.Run("version "+tc.version, func(t *testing.T) {
			db, conn, sp := setupConfig(t, rules.LockRequired)
			if tc.version == "1" || tc.version == "3" {
				execSQL(t, conn, string(oldRegister))
			}
			execSQL(t, conn, "UPDATE fenceproxy.meta SET value = '"+tc.version+"' WHERE key = 'version'")
			execSQL(t, conn, "DROP INDEX fenceproxy.locks_name_c")
			if tc.reholdAt {
				execSQL(t, conn, byKey("rehold_at"))
			} else {
				execSQL(t, conn, "DROP PROCEDURE fenceproxy.rehold_at(bigint, text, text, text)")
			}
			if tc.holdAt {
				execSQL(t, conn, byKey("hold_at"))
			} else {
				execSQL(t, conn, "DROP PROCEDURE fenceproxy.hold_at(bigint, text, text, text)")
			}
			if tc.hold {
				execSQL(t, conn, byKey("hold"))
			}
			if !tc.enter {
				execSQL(t, conn, "DROP PROCEDURE fenceproxy.enter(text, text, text, text, bigint, boolean, boolean, boolean, text, text)")
			}
			if !tc.hold {
				execSQL(t, conn, "DROP PROCEDURE fenceproxy.hold(text, text, boolean, boolean, text, text)")
			}
			if !tc.staleAt {
				execSQL(t, conn, "DROP FUNCTION fenceproxy.stale_at_b(bigint), fenceproxy.stale_at(bigint)")
			}
			if tc.version == "1" {
				execSQL(t, conn, `DROP FUNCTION fenceproxy.stale(text, bigint, text), fenceproxy.stale_b(text, bigint, text),
					fenceproxy.no_token(text, text), fenceproxy.no_token_b(text, text)`)
			}
			rep, err := dbsetup.Check(t.Context(), conn, sp)
			if err != nil {
				t.Fatal(err)
			}
			if !rep.OK() || rep.Raisers != tc.raisers || rep.StaleAt != tc.staleAt || rep.Hold != tc.hold || rep.Enter != tc.enter || rep.HoldAt != tc.holdAt || rep.ReholdAt != tc.reholdAt || len(rep.Notes) != 1 ||
				!strings.Contains(rep.Notes[0].Text, "version "+tc.version+": fenceproxy setup upgrades them to version 10, "+tc.note) {
				t.Fatalf("check: %+v", rep)
			}
			// The old procedure registers and refuses a stale token.
			createRole(t, conn, "old_app")
			if err := register(t.Context(), session(t, db, "old_app", "locks/config", "5"), true); err != nil {
				t.Fatalf("old procedure: %v", err)
			}
			if err := register(t.Context(), session(t, db, "old_app", "locks/config", "4"), true); sqlState(err) != "FP001" {
				t.Errorf("old procedure, stale token: %v, want FP001", err)
			}

			up, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if want := "upgraded the fenceproxy objects from version " + tc.version + " to 10"; len(up.Actions) != 1 || up.Actions[0] != want {
				t.Errorf("setup: %+v, want %q", up.Actions, want)
			}
			if rep, err = dbsetup.Check(t.Context(), conn, sp); err != nil || !rep.OK() || !rep.Raisers || !rep.StaleAt || !rep.Hold || !rep.Enter || !rep.HoldAt || !rep.ReholdAt || len(rep.Notes) != 0 {
				t.Errorf("check after the upgrade: %+v, %v", rep, err)
			}
			if w := watermark(t, db, "locks/config"); w != 5 {
				t.Errorf("watermark %d after the upgrade, want 5", w)
			}
			var index bool
			if err := conn.QueryRow(t.Context(), "SELECT pg_catalog.to_regclass('fenceproxy.locks_name_c') IS NOT NULL").Scan(&index); err != nil || !index {
				t.Errorf("index locks_name_c after the upgrade: %v, %v", index, err)
			}

			// Version 10 objects with the old procedure: not this fenceproxy's.
			execSQL(t, conn, string(oldRegister))
			if rep, err = dbsetup.Check(t.Context(), conn, sp); err != nil || rep.OK() || rep.Hold || rep.Enter || rep.HoldAt || rep.ReholdAt ||
				!strings.Contains(rep.Problems[0].Description, "procedure fenceproxy.register is not this fenceproxy's (version 10)") {
				t.Errorf("check of version 10 objects with the old procedure: %+v, %v", rep, err)
			}
		})
	}
}

// TestRaiserNames: the raisers the check knows are exactly the functions
// objects.sql creates.
func TestRaiserNames(t *testing.T) {
	objects, err := os.ReadFile("objects.sql")
	if err != nil {
		t.Fatal(err)
	}
	var created []string
	for _, m := range regexp.MustCompile(`CREATE OR REPLACE FUNCTION fenceproxy\.(\w+)\(`).FindAllStringSubmatch(string(objects), -1) {
		created = append(created, m[1])
	}
	slices.Sort(created)
	if got := dbsetup.RaiserNames(); !slices.Equal(got, created) {
		t.Errorf("RaiserNames() = %v, objects.sql creates %v", got, created)
	}
}

// TestCheckStaleAt: the check reports the raisers of version 5 only when
// they are current too; one replaced or dropped leaves the other raisers
// in use (Raisers) and only the token form without them (StaleAt).
func TestCheckStaleAt(t *testing.T) {
	for _, tc := range []struct {
		name, breakSQL string
	}{
		{"replaced", `CREATE OR REPLACE FUNCTION fenceproxy.stale_at(fence bigint) RETURNS bigint
			LANGUAGE plpgsql STABLE AS $$BEGIN RETURN fence; END$$`},
		{"dropped", "DROP FUNCTION fenceproxy.stale_at_b(bigint)"},
		{"not callable by all", "REVOKE EXECUTE ON FUNCTION fenceproxy.stale_at(bigint) FROM PUBLIC"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, conn, sp := setupConfig(t, "")
			if rep, err := dbsetup.Check(t.Context(), conn, sp); err != nil || !rep.Raisers || !rep.StaleAt {
				t.Fatalf("check after setup: %+v, %v", rep, err)
			}
			execSQL(t, conn, tc.breakSQL)
			if rep, err := dbsetup.Check(t.Context(), conn, sp); err != nil || !rep.Raisers || rep.StaleAt {
				t.Errorf("check: Raisers %v StaleAt %v (%v), want true and false", rep.Raisers, rep.StaleAt, err)
			}
		})
	}
}

// TestCheckHold: the check reports hold (Hold) and enter (Enter) only
// when each is objects.sql's, declared as there, callable by every role,
// and the watermarks they read with the caller's rights are readable by
// every role (enter only with hold, which it calls); otherwise the proxy
// does without them, and the database has no problem.
func TestCheckHold(t *testing.T) {
	for _, proc := range []struct {
		name, args, params string
		flag               func(*dbsetup.Report) bool
	}{
		{"hold", "text, text, boolean, boolean, text, text",
			"lock_setting text, token_setting text, required boolean, audit boolean, tag text, tables text",
			func(r *dbsetup.Report) bool { return r.Hold }},
		{"enter", "text, text, text, text, bigint, boolean, boolean, boolean, text, text",
			"token_setting text, token text, lock_setting text, lock text, want bigint, register boolean, required boolean, audit boolean, tag text, tables text",
			func(r *dbsetup.Report) bool { return r.Enter }},
	} {
		sig := "fenceproxy." + proc.name + "(" + proc.args + ")"
		for _, tc := range []struct {
			name, breakSQL string
			kept           bool // setup does not undo it (an owner)
		}{
			{"replaced", "CREATE OR REPLACE PROCEDURE fenceproxy." + proc.name + "(" + proc.params + ") LANGUAGE plpgsql AS $$BEGIN RETURN; END$$", false},
			{"dropped", "DROP PROCEDURE " + sig, false},
			{"security definer", "ALTER PROCEDURE " + sig + " SECURITY DEFINER", false},
			{"a setting", "ALTER PROCEDURE " + sig + " SET search_path = public", false},
			{"not callable by all", "REVOKE EXECUTE ON PROCEDURE " + sig + " FROM PUBLIC", false},
			{"watermarks not readable by all", "REVOKE SELECT ON fenceproxy.locks FROM PUBLIC", false},
			{"another owner", "CREATE ROLE " + proc.name + "_owner_x; ALTER PROCEDURE " + sig + " OWNER TO " + proc.name + "_owner_x", true},
		} {
			t.Run(proc.name+"/"+tc.name, func(t *testing.T) {
				_, conn, sp := setupConfig(t, rules.LockRequired)
				if rep, err := dbsetup.Check(t.Context(), conn, sp); err != nil || !rep.OK() || !rep.Hold || !rep.Enter {
					t.Fatalf("check after setup: %+v, %v", rep, err)
				}
				execSQL(t, conn, tc.breakSQL)
				rep, err := dbsetup.Check(t.Context(), conn, sp)
				// Enter needs hold; hold does not need enter.
				if err != nil || proc.flag(&rep) || rep.Enter || !rep.Raisers || rep.Hold != (proc.name == "enter" && tc.name != "watermarks not readable by all") {
					t.Errorf("check: Hold %v Enter %v Raisers %v (%v)", rep.Hold, rep.Enter, rep.Raisers, err)
				}
				if _, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{}); err != nil {
					t.Fatal(err)
				}
				if rep, err := dbsetup.Check(t.Context(), conn, sp); err != nil || proc.flag(&rep) == tc.kept {
					t.Errorf("check after setup again: %s %v (%v), want %v", proc.name, proc.flag(&rep), err, !tc.kept)
				}
			})
		}
	}
}

// TestReadsByNameIndex: the reads of the watermark in hold, hold_at and
// rehold_at, as objects.sql writes them, can be served by the index
// locks_name_c, which setup creates (its comparisons are of bytes, the
// primary key's under the database's collation); the reads as earlier
// versions wrote them, comparing under the column's collation, cannot.
func TestReadsByNameIndex(t *testing.T) {
	_, conn, _ := setupConfig(t, rules.LockRequired)
	objects, err := os.ReadFile("objects.sql")
	if err != nil {
		t.Fatal(err)
	}
	// reads returns the reads of the watermark in procedure name of the
	// objects src, with $1 for the lock name.
	reads := func(src, name string) []string {
		t.Helper()
		s := procedureSQL(t, src, name)
		var out []string
		for {
			j := strings.Index(s, "SELECT l.token INTO w FROM fenceproxy.locks l")
			if j < 0 {
				break
			}
			k := strings.IndexByte(s[j:], ';')
			q := s[j : j+k]
			if !strings.HasSuffix(q, " lk") {
				t.Fatalf("%s: a read of the watermark not by lk: %s", name, q)
			}
			out = append(out, strings.TrimSuffix(strings.Replace(q, " INTO w", "", 1), "lk")+"$1")
			s = s[j+k:]
		}
		return out
	}
	plan := func(q string) string {
		t.Helper()
		tx, err := conn.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(t.Context())
		// Where an index can serve the read, the planner takes it.
		execSQL(t, tx.Conn(), "SET LOCAL enable_seqscan = off; SET LOCAL plan_cache_mode = force_generic_plan")
		execSQL(t, tx.Conn(), "PREPARE watermark_read(text) AS "+q)
		defer execSQL(t, tx.Conn(), "DEALLOCATE watermark_read")
		rows, err := tx.Query(t.Context(), "EXPLAIN EXECUTE watermark_read('locks/config')", pgx.QueryExecModeSimpleProtocol)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(lines, "\n")
	}
	for _, tc := range []struct {
		name string
		n    int
	}{
		{"hold", 2},
		{"hold_at", 2},
		{"rehold_at", 1},
	} {
		now, before := reads(string(objects), tc.name), reads(dbsetup.ByPrimaryKey(string(objects)), tc.name)
		if len(now) != tc.n || len(before) != tc.n {
			t.Fatalf("%s: %d reads of the watermark, %d by the primary key; want %d", tc.name, len(now), len(before), tc.n)
		}
		for i := range now {
			if p := plan(now[i]); !strings.Contains(p, "locks_name_c") {
				t.Errorf("%s's read %d does not use locks_name_c:\n%s", tc.name, i+1, p)
			}
			if p := plan(before[i]); strings.Contains(p, "locks_name_c") || !strings.Contains(p, "locks_pkey") {
				t.Errorf("%s's read %d as versions before 10 wrote it, under the column's collation: want the primary key, got\n%s", tc.name, i+1, p)
			}
		}
	}
}

// procedureSQL returns the CREATE statement of procedure name in the
// objects src (objects.sql's text).
func procedureSQL(t *testing.T, src, name string) string {
	t.Helper()
	i := strings.Index(src, "CREATE OR REPLACE PROCEDURE fenceproxy."+name+"(")
	if i < 0 {
		t.Fatalf("objects.sql: no procedure %s", name)
	}
	end := "$" + name + "$;"
	j := strings.Index(src[i:], end)
	if j < 0 {
		t.Fatalf("objects.sql: procedure %s has no %s", name, end)
	}
	return src[i : i+j+len(end)]
}
