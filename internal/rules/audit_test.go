package rules_test

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func TestParseAuditEvent(t *testing.T) {
	// As PostgreSQL 15 sends them (json_build_object(...)::text).
	stale := `{"v" : 1, "i" : "proxy-a", "m" : "audit", "r" : "stale", "t" : "public.config", "tok" : "41", "w" : 42}`
	e, err := rules.ParseAuditEvent(stale)
	if err != nil {
		t.Fatal(err)
	}
	if e.Version != 1 || e.Tag != "proxy-a" || e.Mode != rules.ModeAudit || e.Reason != rules.AuditStale ||
		e.Table != "public.config" || e.Token == nil || *e.Token != "41" || e.Watermark == nil || *e.Watermark != 42 {
		t.Errorf("got %+v", e)
	}
	missing := `{"v" : 1, "i" : "", "m" : "enforce", "r" : "missing_token", "t" : "app.\"Accounts\"", "tok" : null, "w" : null}`
	e, err = rules.ParseAuditEvent(missing)
	if err != nil {
		t.Fatal(err)
	}
	if e.Mode != rules.ModeEnforce || e.Reason != rules.AuditMissingToken || e.Table != `app."Accounts"` || e.Token != nil || e.Watermark != nil {
		t.Errorf("got %+v", e)
	}
	for _, bad := range []string{
		``,
		`{}`,
		`{"v" : 2, "i" : "", "m" : "audit", "r" : "stale", "t" : "public.config", "tok" : null, "w" : null}`,
		`{"v" : 1, "i" : "", "m" : "off", "r" : "stale", "t" : "public.config", "tok" : null, "w" : null}`,
		`{"v" : 1, "i" : "", "m" : "audit", "r" : "late", "t" : "public.config", "tok" : null, "w" : null}`,
		`{"v" : 1, "i" : "", "m" : "audit", "r" : "stale", "t" : "", "tok" : null, "w" : null}`,
		`{"v" : 1, "i" : "", "m" : "audit", "r" : "stale", "t" : "public.config", "tok" : null, "w" : 1.5}`,
		`{"v" : 1, "i" : "", "m" : "audit", "r" : "stale", "t" : "public.config", "x" : 1}`,
		`{"v" : 1, "i" : "", "m" : "audit", "r" : "stale", "t" : "public.config"} {}`,
		`not json`,
	} {
		if _, err := rules.ParseAuditEvent(bad); err == nil {
			t.Errorf("ParseAuditEvent(%q) accepted", bad)
		}
	}
}

// The payload the rewritten SQL builds has exactly AuditEvent's keys, in
// order, and carries the configured tag.
func TestAuditPayloadMatchesAuditEvent(t *testing.T) {
	r := mustCompile(t, rules.Config{AuditTag: "it's-a-tag", Tables: []rules.Table{{Table: "public.config", Mode: "audit"}}})
	d := r.Decide("UPDATE config SET payload = 'x' WHERE id = 1")
	if d.Action != rules.Rewrite {
		t.Fatalf("got %+v", d)
	}
	tree, err := pg.Parse(d.SQL)
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	typ := reflect.TypeFor[rules.AuditEvent]()
	for i := range typ.NumField() {
		if tag := typ.Field(i).Tag.Get("json"); !strings.HasSuffix(tag, ",omitempty") {
			want = append(want, tag) // "l" is for the lock registration's events only
		}
	}
	calls := 0
	walkMessages(tree.Stmts[0].ProtoReflect(), func(m protoreflect.ProtoMessage) {
		f, ok := m.(*pg.FuncCall)
		if !ok || f.Funcname[len(f.Funcname)-1].GetString_().GetSval() != "json_build_object" {
			return
		}
		calls++
		var keys []string
		for i := 0; i < len(f.Args); i += 2 {
			keys = append(keys, f.Args[i].GetAConst().GetSval().GetSval())
		}
		if !slices.Equal(keys, want) {
			t.Errorf("payload keys %q, want %q", keys, want)
		}
		if tag := f.Args[3].GetAConst().GetSval().GetSval(); tag != "it's-a-tag" {
			t.Errorf("tag %q", tag)
		}
	})
	if calls != 2 { // the stale record and the invalid-token record
		t.Errorf("%d payloads, want 2", calls)
	}
	if !strings.Contains(d.SQL, "pg_catalog.pg_notify('"+rules.AuditChannel+"', ") {
		t.Errorf("no notification on %s: %s", rules.AuditChannel, d.SQL)
	}
}

func TestAuditRefusalIsRecordedNotEnforced(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{
		{Table: "public.config"},
		{Table: "public.accounts", Mode: "audit"},
	}})
	d := r.Decide("TRUNCATE accounts")
	if d.Action != rules.Forward || d.AuditRefusal == nil || d.AuditRefusal.Code != rules.CodeRefused ||
		d.AuditRefusal.Table != "public.accounts" || strings.Join(d.Tables, ",") != "public.accounts" {
		t.Fatalf("got %+v %+v", d, d.AuditRefusal)
	}
	d = r.Decide("DELETE FROM accounts WHERE CURRENT OF c; UPDATE config SET a = 1")
	if d.Action != rules.Rewrite || d.AuditRefusal == nil || !strings.HasPrefix(d.SQL, "DELETE FROM accounts WHERE CURRENT OF c; UPDATE config SET a = 1, \"last_fence\" = (CASE") {
		t.Fatalf("got %+v", d)
	}
	for _, sql := range []string{"TRUNCATE accounts, config", "DELETE FROM config WHERE CURRENT OF c", "UPDATE accounts, config SET"} {
		if d := r.Decide(sql); d.Action != rules.Refuse || d.AuditRefusal != nil {
			t.Errorf("%s: got %+v", sql, d)
		}
	}
	if d := r.Decide("UPDATE accounts SET a = 1"); d.Action != rules.Rewrite || d.AuditRefusal != nil {
		t.Errorf("got %+v", d)
	}
}
