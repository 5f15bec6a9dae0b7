package rules_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func TestCompileErrors(t *testing.T) {
	tests := []struct {
		name string
		cfg  rules.Config
		want string // exact error text
	}{
		{"missing table", rules.Config{Tables: []rules.Table{{Table: "public.a"}, {}}},
			`tables[1].table: required`},
		{"unqualified table", rules.Config{Tables: []rules.Table{{Table: "config"}}},
			`tables[0].table: must be schema-qualified (e.g. public.config), got "config"`},
		{"three parts", rules.Config{Tables: []rules.Table{{Table: "db.public.config"}}},
			`tables[0].table: must be schema-qualified (e.g. public.config), got "db.public.config"`},
		{"bad identifier", rules.Config{Tables: []rules.Table{{Table: "public.con-fig"}}},
			`tables[0].table: "public.con-fig": unexpected character '-'`},
		{"unterminated quote", rules.Config{Tables: []rules.Table{{Table: `public."config`}}},
			`tables[0].table: "public.\"config": unterminated quoted identifier`},
		{"empty quoted identifier", rules.Config{Tables: []rules.Table{{Table: `public.""`}}},
			`tables[0].table: "public.\"\"": zero-length quoted identifier`},
		{"empty part", rules.Config{Tables: []rules.Table{{Table: "public."}}},
			`tables[0].table: "public.": missing identifier`},
		{"identifier too long", rules.Config{Tables: []rules.Table{{Table: "public." + strings.Repeat("x", 64)}}},
			`tables[0].table: "public.` + strings.Repeat("x", 64) + `": identifier "` + strings.Repeat("x", 64) + `" is longer than 63 bytes`},
		{"duplicate", rules.Config{Tables: []rules.Table{{Table: "public.config"}, {Table: "PUBLIC.Config"}}},
			`tables[1].table: public.config is already listed as tables[0]`},
		{"qualified column", rules.Config{Tables: []rules.Table{{Table: "public.config", Column: "config.last_fence"}}},
			`tables[0].column: must be a plain column name, got "config.last_fence"`},
		{"bad on_stale", rules.Config{Tables: []rules.Table{{Table: "public.a"}, {Table: "public.b", OnStale: "x"}}},
			`tables[1].on_stale: must be "error" or "skip", got "x"`},
		{"bad missing_token", rules.Config{Tables: []rules.Table{{Table: "public.a", MissingToken: "ignore"}}},
			`tables[0].missing_token: must be "reject" or "allow", got "ignore"`},
		{"bad mode", rules.Config{Tables: []rules.Table{{Table: "public.a", Mode: "on"}}},
			`tables[0].mode: must be "enforce", "audit" or "off", got "on"`},
		{"mode is case-sensitive", rules.Config{Tables: []rules.Table{{Table: "public.a", Mode: "Audit"}}},
			`tables[0].mode: must be "enforce", "audit" or "off", got "Audit"`},
		{"duplicate across modes", rules.Config{Tables: []rules.Table{{Table: "public.a", Mode: "audit"}, {Table: "public.a", Mode: "off"}}},
			`tables[1].table: public.a is already listed as tables[0]`},
		{"empty scope value", rules.Config{Tables: []rules.Table{{Table: "public.a"}, {Table: "public.b"},
			{Table: "public.c", Scope: rules.Scope{Users: []string{"", "x"}}}}},
			`tables[2].scope.users[0]: must not be empty`},
		{"empty database", rules.Config{Tables: []rules.Table{{Table: "public.a", Scope: rules.Scope{Databases: []string{"d", ""}}}}},
			`tables[0].scope.databases[1]: must not be empty`},
		{"empty application name", rules.Config{Tables: []rules.Table{{Table: "public.a", Scope: rules.Scope{ApplicationNames: []string{""}}}}},
			`tables[0].scope.application_names[0]: must not be empty`},
		{"same scope twice", rules.Config{Tables: []rules.Table{
			{Table: "public.a", Scope: rules.Scope{ApplicationNames: []string{"billing", "api"}}},
			{Table: "public.b"},
			{Table: "PUBLIC.A", Mode: "audit", Scope: rules.Scope{ApplicationNames: []string{"api", "billing", "api"}}}}},
			`tables[2].scope: public.a is already listed with the same scope as tables[0]`},
		{"scope shadowed by an unscoped entry", rules.Config{Tables: []rules.Table{
			{Table: "public.a", Mode: "audit"},
			{Table: "public.a", Scope: rules.Scope{ApplicationNames: []string{"billing"}}}}},
			`tables[1].scope: never applies: tables[0] lists public.a for every session this scope matches, and the first matching entry wins (list the narrower scope first)`},
		{"scope shadowed by a wider scope", rules.Config{Tables: []rules.Table{
			{Table: "public.a", Scope: rules.Scope{Users: []string{"u1", "u2"}}},
			{Table: "public.a", Mode: "off", Scope: rules.Scope{Users: []string{"u1"}, Databases: []string{"d"}}}}},
			`tables[1].scope: never applies: tables[0] lists public.a for every session this scope matches, and the first matching entry wins (list the narrower scope first)`},
		{"audit_tag too long", rules.Config{AuditTag: strings.Repeat("x", rules.MaxAuditTagLen+1)},
			`audit_tag: must be at most 256 bytes, got 257`},
		{"audit_tag not UTF-8", rules.Config{AuditTag: "a\xffb"},
			`audit_tag: must be valid UTF-8 without NUL bytes`},
		{"audit_tag with NUL", rules.Config{AuditTag: "a\x00b"},
			`audit_tag: must be valid UTF-8 without NUL bytes`},
		{"setting without dot", rules.Config{TokenSetting: "fence_token"},
			`token_setting: "fence_token" is not a valid custom setting name (two or more identifiers joined by dots, e.g. "fence.token")`},
		{"setting with bad char", rules.Config{TokenSetting: "fence.to-ken"},
			`token_setting: "fence.to-ken" is not a valid custom setting name (two or more identifiers joined by dots, e.g. "fence.token")`},
		{"setting starting with digit", rules.Config{TokenSetting: "fence.1token"},
			`token_setting: "fence.1token" is not a valid custom setting name (two or more identifiers joined by dots, e.g. "fence.token")`},
		{"setting ending with dot", rules.Config{TokenSetting: "fence."},
			`token_setting: "fence." is not a valid custom setting name (two or more identifiers joined by dots, e.g. "fence.token")`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := rules.Compile(tt.cfg)
			if err == nil {
				t.Fatalf("Compile succeeded, want error %q", tt.want)
			}
			if err.Error() != tt.want {
				t.Fatalf("got  %q\nwant %q", err.Error(), tt.want)
			}
		})
	}
}

func TestCompileNormalises(t *testing.T) {
	r, err := rules.Compile(rules.Config{
		TokenSetting: "App.Fence_Token$1",
		Tables: []rules.Table{
			{Table: "Public.Config"},
			{Table: ` "My Schema" . "Cfg""x" `, Column: `"Fence"`, OnStale: "skip", Strict: true, MissingToken: "allow", Mode: "enforce"},
			{Table: "public.unprotected", Mode: "off"},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := r.TokenSetting(); got != "app.fence_token$1" {
		t.Errorf("TokenSetting() = %q", got)
	}
	want := []string{"public.config", `"My Schema"."Cfg""x"`}
	if got := r.Tables(); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("Tables() = %q, want %q", got, want)
	}
	// The quoted mixed-case name matches only when quoted.
	if d := r.Decide(`UPDATE "My Schema"."Cfg""x" SET a = 1`); d.Action != rules.Rewrite || !strings.Contains(d.SQL, `"Fence" = `) {
		t.Errorf("quoted table: %+v", d)
	}
	if d := r.Decide(`UPDATE "My Schema".cfg SET a = 1`); d.Action != rules.Forward {
		t.Errorf("unquoted cfg matched the quoted table: %+v", d)
	}
	if d := r.Decide(`UPDATE unprotected SET a = 1`); d.Action != rules.Forward {
		t.Errorf("mode off table rewritten: %+v", d)
	}
}

// Entries for the same table whose scopes overlap without one covering the
// other are fine: the first matching entry wins.
func TestCompileAcceptsOverlappingScopes(t *testing.T) {
	_, err := rules.Compile(rules.Config{Tables: []rules.Table{
		{Table: "public.a", Scope: rules.Scope{ApplicationNames: []string{"billing"}}},
		{Table: "public.a", Mode: "off", Scope: rules.Scope{Users: []string{"migrator"}}},
		{Table: "public.a", Mode: "audit", Scope: rules.Scope{ApplicationNames: []string{"billing", "api"}}},
		{Table: "public.a", Mode: "audit"},
	}})
	if err != nil {
		t.Fatal(err)
	}
}

func TestTablesListsEveryFencedTable(t *testing.T) {
	r, err := rules.Compile(rules.Config{Tables: []rules.Table{
		{Table: "public.b", Mode: "audit"},
		{Table: "public.a", Scope: rules.Scope{Users: []string{"u"}}},
		{Table: "public.off", Mode: "off"},
		{Table: "public.a", Mode: "audit"},
		{Table: "public.c", Mode: "off", Scope: rules.Scope{Users: []string{"u"}}},
		{Table: "public.c"},
		{Table: "public.d", Scope: rules.Scope{Users: []string{"v"}}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(r.Tables(), " "), "public.b public.a public.c public.d"; got != want {
		t.Errorf("Tables() = %s, want %s", got, want)
	}
	if got, want := strings.Join(r.AuditTables(), " "), "public.b public.a"; got != want {
		t.Errorf("AuditTables() = %s, want %s", got, want)
	}
	// The slices are copies.
	r.Tables()[0] = "x"
	if r.Tables()[0] != "public.b" {
		t.Error("Tables() exposes its backing array")
	}
}

func TestCompileDefaults(t *testing.T) {
	r, err := rules.Compile(rules.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if r.TokenSetting() != rules.DefaultTokenSetting {
		t.Errorf("TokenSetting() = %q", r.TokenSetting())
	}
	if d := r.Decide("TRUNCATE config"); d.Action != rules.Forward {
		t.Errorf("no protected tables: %+v", d)
	}
}
