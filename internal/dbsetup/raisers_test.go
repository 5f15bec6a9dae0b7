package dbsetup_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/rules"
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
		{"SET fence.token = ''", "fence.token is empty."},
	} {
		if tc.set != "" {
			execSQL(t, conn, tc.set)
		}
		for _, fn := range []string{"no_token", "no_token_b"} {
			pe := raise("SELECT fenceproxy." + fn + "('fence.token', '13:public.config:11:fence.token:')")
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
	pe := raise("SELECT fenceproxy.stale('fence.token', NULL, '13:public.config')")
	if fe, ok := rules.TranslateError(pe.Code, pe.Message); !ok || !strings.HasSuffix(fe.Message, "(stored watermark NULL)") {
		t.Errorf("NULL fence: %q → %+v", pe.Message, fe)
	}
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

// TestLockWithVersion1Objects: objects of version 1 (before the raisers)
// still serve lock fencing, with a note that setup upgrades them.
func TestLockWithVersion1Objects(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, "CREATE TABLE config (id int PRIMARY KEY, last_fence bigint NOT NULL DEFAULT 0)")
	sp := specs(t, rules.Table{Table: "public.config", Lock: rules.LockRequired})
	if _, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	execSQL(t, conn, `DROP FUNCTION fenceproxy.stale(text, bigint, text), fenceproxy.stale_b(text, bigint, text),
		fenceproxy.no_token(text, text), fenceproxy.no_token_b(text, text);
		UPDATE fenceproxy.meta SET value = '1' WHERE key = 'version'`)
	rep, err := dbsetup.Check(t.Context(), conn, sp)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK() || rep.Raisers || len(rep.Notes) != 1 || !strings.Contains(rep.Notes[0].Text, "version 1") {
		t.Fatalf("check of version 1 objects: %+v", rep)
	}
	up, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(up.Actions) != 1 || up.Actions[0] != "upgraded the fenceproxy objects from version 1 to 2" {
		t.Errorf("setup: %+v", up.Actions)
	}
	if rep, err = dbsetup.Check(t.Context(), conn, sp); err != nil || !rep.OK() || !rep.Raisers || len(rep.Notes) != 0 {
		t.Errorf("check after the upgrade: %+v, %v", rep, err)
	}
}
