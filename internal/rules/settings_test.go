package rules_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func settingRules(t *testing.T) *rules.Rules {
	t.Helper()
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

// TestSettingOps: every spelling PostgreSQL's grammar gives the lock
// setting's name reads as the lock setting, on the parse and never on
// the text.
func TestSettingOps(t *testing.T) {
	rs := settingRules(t)
	type want struct {
		kind  rules.SettingKind
		which uint8
		value string
		local bool
	}
	lock := func(v string) want { return want{rules.SetValue, rules.SettingLock, v, false} }
	for _, c := range []struct {
		sql  string
		want []want
	}{
		{"SET fence.lock = 'L'", []want{lock("L")}},
		{`SET "fence"."lock" = 'L'`, []want{lock("L")}},
		{`SET "FENCE".LOCK TO L`, []want{lock("l")}},
		{"SET fence /* c */ . -- x\n lock = 'L'", []want{lock("L")}},
		{`SET U&"fence".U&"\006cock" = 'L'`, []want{lock("L")}},
		{`SET U&"fence!006cock" UESCAPE '!' = 'L'`, nil}, // one identifier "fencelock": not the setting
		{`SET U&"fence".U&"!006cock" UESCAPE '!' = U&'!004c' UESCAPE '!'`, []want{lock("L")}},
		{`SET fence.lock = E'\x4c'`, []want{lock("L")}},
		{`SET fence.lock = $x$L$x$`, []want{lock("L")}},
		{`SET SESSION fence.lock = 'L'`, []want{lock("L")}},
		{`SET LOCAL fence.lock = 'L'`, []want{{rules.SetValue, rules.SettingLock, "L", true}}},
		{`SET fence.token = 0042`, []want{{rules.SetValue, rules.SettingToken, "42", false}}},
		{`SET fence.token = -1`, []want{{rules.SetValue, rules.SettingToken, "-1", false}}},
		{`SET fence.token = 4.5`, []want{{rules.SetValue, rules.SettingToken, "4.5", false}}},
		{`RESET fence.lock`, []want{{rules.SetDefault, rules.SettingLock, "", false}}},
		{`SET fence.lock TO DEFAULT`, []want{{rules.SetDefault, rules.SettingLock, "", false}}},
		{`RESET ALL`, []want{{rules.ResetAll, rules.SettingToken | rules.SettingLock, "", false}}},
		{`DISCARD ALL`, []want{{rules.ResetAll, rules.SettingToken | rules.SettingLock, "", false}}},
		{`SELECT set_config('fence.lock', 'L', false)`, []want{lock("L")}},
		{`SELECT pg_catalog.set_config('FENCE.LOCK', 'L'::text, 'f')`, []want{lock("L")}},
		{`select SET_CONFIG(E'fence\x2elock', $q$L$q$, false)`, []want{lock("L")}},
		{`SELECT set_config('fence.lock', 'L', true)`, []want{{rules.SetValue, rules.SettingLock, "L", true}}},
		{`SELECT set_config('other.x', 'L', true)`, nil},
		{`SELECT set_config($1, $2, $3)`, []want{{rules.SetParams, rules.SettingToken | rules.SettingLock, "", false}}},
		{`SELECT set_config('fence.lock', lower('L'), false)`, []want{{rules.SetUnknown, rules.SettingToken | rules.SettingLock, "", false}}},
		{`SELECT set_config('fence.lock', 'L', false) FROM pg_class`, []want{{rules.SetUnknown, rules.SettingToken | rules.SettingLock, "", false}}},
		{`SELECT 1 WHERE set_config('fence.lock', 'L', false) IS NULL`, []want{{rules.SetUnknown, rules.SettingToken | rules.SettingLock, "", false}}},
		{`DO $$BEGIN PERFORM set_config('fence.lock', 'L', false); END$$`, []want{{rules.SetUnknown, rules.SettingToken | rules.SettingLock, "", false}}},
		{`DO $$BEGIN RAISE NOTICE 'x'; END$$`, nil},
		{`DO $$BEGIN EXECUTE format('UPDATE t SET n = %s', 1); END$$`, nil}, // migrations' dynamic SQL
		{`DO $$BEGIN SET "FENCE"."lock" = 'L'; END$$`, []want{{rules.SetUnknown, rules.SettingToken | rules.SettingLock, "", false}}},
		{`DO $$BEGIN RESET ALL; END$$`, []want{{rules.SetUnknown, rules.SettingToken | rules.SettingLock, "", false}}},
		{`PREPARE p AS SELECT set_config('fence.lock', $1, false)`, []want{{rules.SetUnknown, rules.SettingToken | rules.SettingLock, "", false}}},
		{`SET fence.lockx = 'L'`, nil},
		{`UPDATE config SET payload = 'x'`, nil},
		{`BEGIN; SAVEPOINT a; ROLLBACK TO a; RELEASE a; COMMIT`, []want{{kind: rules.TxBegin}, {kind: rules.TxSavepoint}, {kind: rules.TxRollbackTo}, {kind: rules.TxRelease}, {kind: rules.TxCommit}}},
	} {
		t.Run(c.sql, func(t *testing.T) {
			st, err := rs.SettingOps(c.sql)
			if err != nil {
				t.Fatal(err)
			}
			if len(st.Ops) != len(c.want) {
				t.Fatalf("got %d ops %+v, want %d", len(st.Ops), st.Ops, len(c.want))
			}
			for i, w := range c.want {
				g := st.Ops[i]
				if g.Kind != w.kind || g.Which != w.which || g.Value != w.value || g.Local != w.local {
					t.Errorf("op %d = %+v, want %+v", i, g, w)
				}
			}
		})
	}
}

func TestSettingOpsProtected(t *testing.T) {
	rs := settingRules(t)
	st, err := rs.SettingOps("SET fence.token = '1'; COMMIT; UPDATE config SET payload = 'x'; SELECT 1")
	if err != nil {
		t.Fatal(err)
	}
	if st.Stmts != 4 || st.Protected[0] || !st.Protected[2] || st.Protected[3] {
		t.Fatalf("Protected = %v", st.Protected)
	}
}

// TestSettingOpsLockTimeout: the statements that may change lock_timeout,
// whatever the spelling, and those that may not.
func TestSettingOpsLockTimeout(t *testing.T) {
	rs := settingRules(t)
	for sql, want := range map[string]bool{
		"SET lock_timeout = 0":                         true,
		"SET LOCAL \"Lock_Timeout\" TO DEFAULT":        true,
		"RESET lock_timeout":                           true,
		"RESET ALL":                                    true,
		"DISCARD ALL":                                  true,
		"SELECT set_config('LOCK_TIMEOUT', '0', true)": true,
		"UPDATE config SET payload = 'x' WHERE set_config('lock_timeout', '0', true) IS NOT NULL": true,
		"UPDATE config SET payload = pg_catalog.set_config($1, '0', true)":                        true,
		"UPDATE config SET payload = set_config('lock_' || 'timeout', '0', true)":                 true,
		"SET statement_timeout = 0":                                        false,
		"SELECT set_config('app.tenant', '7', true)":                       false,
		"UPDATE config SET payload = 'lock_timeout'":                       false,
		"DISCARD PLANS":                                                    false,
		"UPDATE pg_settings SET setting = '0' WHERE name = 'lock_timeout'": true,
		"WITH u AS (UPDATE pg_catalog.pg_settings SET setting = '0' WHERE name = 'lock_' || 'timeout' RETURNING 1) SELECT * FROM u": true,
		"UPDATE config SET payload = (SELECT setting FROM pg_settings WHERE name = 'fence.token')":                                  false,
		"UPDATE config SET payload = 'x' WHERE postgres.pg_catalog.set_config('lock_timeout', '0', true) IS NOT NULL":               true,
	} {
		st, err := rs.SettingOps(sql)
		if err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		if len(st.LockTimeout) != 1 || st.LockTimeout[0] != want {
			t.Errorf("%s: LockTimeout %v, want %v", sql, st.LockTimeout, want)
		}
	}
}

// TestSettingOpsMayWrite: the statements that may write a table
// themselves, where the write is.
func TestSettingOpsMayWrite(t *testing.T) {
	rs := settingRules(t)
	for sql, want := range map[string]bool{
		"UPDATE config SET payload = 'x'":                              true,
		"WITH d AS (DELETE FROM config RETURNING id) SELECT id FROM d": true,
		"EXPLAIN ANALYZE DELETE FROM config":                           true,
		"COPY (DELETE FROM config RETURNING id) TO STDOUT":             true,
		"COPY config FROM STDIN":                                       true,
		"TRUNCATE config":                                              true,
		"EXECUTE s1(1)":                                                true,
		"CALL p()":                                                     true,
		"SELECT payload FROM config WHERE id = 1 FOR UPDATE":           false,
		"SELECT payload FROM config WHERE payload <> 'update'":         false,
		"COPY config TO STDOUT":                                        false,
		"SELECT count(*) FROM config":                                  false,
	} {
		st, err := rs.SettingOps(sql)
		if err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		if len(st.MayWrite) != 1 || st.MayWrite[0] != want {
			t.Errorf("%s: MayWrite %v, want %v", sql, st.MayWrite, want)
		}
	}
}

func TestParseBool(t *testing.T) {
	for in, want := range map[string]bool{"t": true, "TRUE": true, " yes ": true, "on": true, "1": true, "f": false, "of": false, "off": false, "n": false, "0": false} {
		if got, ok := rules.ParseBool(in); !ok || got != want {
			t.Errorf("ParseBool(%q) = %v, %v", in, got, ok)
		}
	}
	for _, in := range []string{"", "o", "maybe", "2"} {
		if _, ok := rules.ParseBool(in); ok {
			t.Errorf("ParseBool(%q) accepted", in)
		}
	}
}
