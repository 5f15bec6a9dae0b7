package rules_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/rules"
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
		{"audit not yet", rules.Config{Tables: []rules.Table{{Table: "public.a", Mode: "audit"}}},
			`tables[0].mode: "audit" is not supported yet; use "enforce" or "off"`},
		{"bad mode", rules.Config{Tables: []rules.Table{{Table: "public.a", Mode: "on"}}},
			`tables[0].mode: must be "enforce" or "off", got "on"`},
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
