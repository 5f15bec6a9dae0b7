package proxy

import (
	"reflect"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func TestMayChangeFence(t *testing.T) {
	for sql, want := range map[string]bool{
		"SELECT 1":                                 false,
		"UPDATE config SET payload = 'x'":          false,
		"set fence.lock = 'L'":                     true,
		"/* a /* nested */ comment */ SET x=1":     true,
		"/* a /* nested */ */ SELECT 1":            false,
		"SELECT 1; reset all":                      true,
		"-- comment\nDISCARD ALL":                  true,
		"SELECT 'x; SET y'":                        false,
		`SELECT "x; SET y"`:                        false,
		"SELECT $$; SET y$$":                       false,
		"SELECT $a$; SET y$a$ ; SET z = 1":         true,
		"SELECT a$b; SET y = 1":                    true,
		"select Set_Config('x', 'y', false)":       true,
		`select "set_config"('x', 'y', false)`:     true,
		`select U&"s\0065t_config"('x','y',false)`: true,
		"SELECT E'\\''; SET x = 1":                 true, // a backslash: parse
		"BEGIN":                                    true,
		"end":                                      true,
		"SELECT CASE WHEN true THEN 1 END":         false,
		"DO $$ BEGIN END $$":                       true,
		"PREPARE p AS SELECT 1":                    true,
		"EXPLAIN SELECT 1":                         false,
		"WITH x AS (SELECT 1) SELECT * FROM x":     false,
		"SELECT $1":                                false,
	} {
		if got := mayChangeFence(sql, Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}); got != want {
			t.Errorf("mayChangeFence(%q) = %v, want %v", sql, got, want)
		}
	}
}

func TestMayChangeFenceEscapes(t *testing.T) {
	off := Lexing{ClientEncoding: "UTF8"} // standard_conforming_strings off
	if mayChangeFence("SELECT 'a\\'; SET x = 1'", off) {
		t.Error("with standard_conforming_strings off the string hides the SET")
	}
	if !mayChangeFence("SELECT 'a\\'; SET x = 1", Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}) {
		t.Error("with standard_conforming_strings on the SET is a statement")
	}
	// In SJIS, 0x95 0x5c is one character: its second byte is no escape.
	sjis := Lexing{ClientEncoding: "SJIS"}
	if mayChangeFence("SELECT E'\x95\\'; SELECT 1", sjis) {
		t.Error("SJIS: the character's second byte read as an escape")
	}
	if !mayChangeFence("SELECT E'\x95\\'; SET x = 1", sjis) {
		t.Error("SJIS: the SET after the string was missed")
	}
}

func TestStartupOptionSettings(t *testing.T) {
	for in, want := range map[string][][2]string{
		"-c fence.lock=L":                  {{"fence.lock", "L"}},
		"-cfence.lock=L":                   {{"fence.lock", "L"}},
		"--fence.lock=L -c fence.token=42": {{"fence.lock", "L"}, {"fence.token", "42"}},
		`-c fence.lock=my\ lock`:           {{"fence.lock", "my lock"}},
		`-c fence.lock=a\\b`:               {{"fence.lock", `a\b`}},
		"-c fence-x.lock=L":                {{"fence_x.lock", "L"}},
		"-e -c fence.lock=L":               {{"fence.lock", "L"}},
		"-ec fence.lock=L":                 {{"fence.lock", "L"}},
		"-B 10 -c fence.lock=L":            {{"fence.lock", "L"}},
		"  -c   fence.lock=L  ":            {{"fence.lock", "L"}},
		"-c fence.lock":                    nil,
	} {
		if got := startupOptionSettings(in); !reflect.DeepEqual(got, want) {
			t.Errorf("startupOptionSettings(%q) = %q, want %q", in, got, want)
		}
	}
	which := func(n string) uint8 {
		switch n {
		case "fence.token":
			return rules.SettingToken
		case "fence.lock":
			return rules.SettingLock
		}
		return 0
	}
	// The parameter itself wins over options, as in PostgreSQL.
	v, tok, lk := startupFenceValues(map[string]string{"options": "-c fence.lock=A -c fence.token=1", "fence.lock": "B"}, which)
	if v.lock != "B" || v.token != "1" || !tok || !lk {
		t.Errorf("startupFenceValues = %+v %v %v", v, tok, lk)
	}
}

func TestQuoteFenceValue(t *testing.T) {
	for in, want := range map[string]string{
		"L":      "'L'",
		"it's":   "$fp$it's$fp$",
		`a\b`:    `$fp$a\b$fp$`,
		"x'$fp$": "$fpx$x'$fp$$fpx$",
		"x'$fp":  "$fpx$x'$fp$fpx$",
		"":       "''",
	} {
		if got := quoteFenceValue(in); got != want {
			t.Errorf("quoteFenceValue(%q) = %q, want %q", in, got, want)
		}
		var b strings.Builder
		if writeFenceValue(&b, in); b.String() != want {
			t.Errorf("writeFenceValue(%q) wrote %q, want %q", in, b.String(), want)
		}
	}
}

// TestHoldAtRest: the rest argument written or appended in place is the
// one built (and quoted), and its length is known before.
func TestHoldAtRest(t *testing.T) {
	for _, a := range []rules.RegArgs{
		{LockSetting: "fence.lock", TokenSetting: "fence.token", Tables: "public.config"},
		{LockSetting: "app.lock", TokenSetting: "app.token", Required: true, Audit: true, Tag: "t1", Tables: "a.b\nc.d"},
		{LockSetting: "x.l", TokenSetting: "x.t", Tag: "it's", Tables: `"My Schema"."T"`},
		{LockSetting: "x.l", TokenSetting: "x.t", Tables: `s.a\b`},
		{},
	} {
		rest := holdAtRest(&a)
		if got := string(appendHoldAtRest([]byte("x"), &a)); got != "x"+rest {
			t.Errorf("appendHoldAtRest(%+v) = %q, want %q", a, got, "x"+rest)
		}
		if n := holdAtRestLen(&a); n != len(rest) {
			t.Errorf("holdAtRestLen(%+v) = %d, want %d", a, n, len(rest))
		}
		var b strings.Builder
		if writeHoldAtRest(&b, &a); b.String() != quoteFenceValue(rest) {
			t.Errorf("writeHoldAtRest(%+v) wrote %q, want %q", a, b.String(), quoteFenceValue(rest))
		}
	}
}

// TestFenceRecord plays PostgreSQL's rules for SET, SET LOCAL,
// transactions and savepoints on the record.
func TestFenceRecord(t *testing.T) {
	set := func(v string, local bool) rules.SettingOp {
		return rules.SettingOp{Kind: rules.SetValue, Which: rules.SettingToken, Value: v, Local: local}
	}
	f := &fenceRecord{defaults: fenceValues{token: "d"}}
	f.sess, f.pend, f.cur = f.defaults, f.defaults, f.defaults
	do := func(op rules.SettingOp) { f.apply(op, op.Value, op.Local, op.Null, op.Which) }
	check := func(step, want string) {
		t.Helper()
		if f.cur.token != want {
			t.Fatalf("%s: token %q, want %q", step, f.cur.token, want)
		}
	}
	do(set("1", false))
	f.ready('I')
	check("SET", "1")
	do(set("2", true))
	f.ready('I')
	check("SET LOCAL outside a transaction", "1")
	do(rules.SettingOp{Kind: rules.TxBegin})
	f.ready('T')
	do(set("3", false))
	do(rules.SettingOp{Kind: rules.TxRollback})
	f.ready('I')
	check("rolled back", "1")
	do(rules.SettingOp{Kind: rules.TxBegin})
	do(set("4", true))
	f.ready('T')
	check("SET LOCAL in a transaction", "4")
	do(rules.SettingOp{Kind: rules.TxCommit})
	f.ready('I')
	check("after commit", "1")
	do(rules.SettingOp{Kind: rules.TxBegin})
	do(set("5", false))
	do(rules.SettingOp{Kind: rules.TxSavepoint, Savepoint: "a"})
	do(set("6", false))
	f.ready('E') // failed
	do(rules.SettingOp{Kind: rules.TxRollbackTo, Savepoint: "a"})
	f.ready('T')
	check("rolled back to the savepoint", "5")
	do(rules.SettingOp{Kind: rules.TxCommit})
	f.ready('I')
	check("committed after the savepoint", "5")
	do(set("7", false))
	f.ready('E')
	do(rules.SettingOp{Kind: rules.TxCommit}) // COMMIT of a failed transaction
	f.ready('I')
	check("failed transaction", "5")
	do(rules.SettingOp{Kind: rules.SetDefault, Which: rules.SettingToken})
	f.ready('I')
	check("RESET", "d")
	do(set("8", false))
	f.failed = true // an error later in the same implicit transaction
	f.ready('I')
	check("implicit transaction that failed", "d")
}
