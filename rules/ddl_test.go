package rules_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/rules"
)

func TestDDLThatRemovesProtection(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{
		{Table: "public.acct"},
		{Table: "other.ledger", Column: "gen", Mode: rules.ModeAudit},
	}})
	tests := []struct {
		sql    string
		action rules.Action
		table  string // of Err (Refuse) or AuditRefusal (Forward)
	}{
		{"ALTER TABLE acct RENAME TO acct2", rules.Refuse, "public.acct"},
		{"ALTER TABLE public.acct SET SCHEMA other", rules.Refuse, "public.acct"},
		{"ALTER SCHEMA public RENAME TO p2", rules.Refuse, "public.acct"},
		{"ALTER TABLE acct RENAME COLUMN last_fence TO x", rules.Refuse, "public.acct"},
		{"ALTER TABLE acct DROP COLUMN last_fence", rules.Refuse, "public.acct"},
		{"ALTER TABLE acct ALTER COLUMN last_fence TYPE numeric", rules.Refuse, "public.acct"},
		// Audit mode: forwarded, and the refusal recorded.
		{"ALTER TABLE ledger RENAME TO ledger2", rules.Forward, "other.ledger"},
		{"ALTER SCHEMA other RENAME TO o2", rules.Forward, "other.ledger"},
		{"ALTER TABLE other.ledger DROP COLUMN gen", rules.Forward, "other.ledger"},
		// Harmless.
		{"ALTER TABLE acct ALTER COLUMN last_fence DROP NOT NULL", rules.Forward, ""},
		{"ALTER TABLE acct ADD COLUMN note text", rules.Forward, ""},
		{"ALTER TABLE acct DROP COLUMN gen", rules.Forward, ""},
		{"ALTER TABLE old_acct RENAME TO acct", rules.Forward, ""},
		{"ALTER TABLE other.acct RENAME TO acct2", rules.Forward, ""},
		{"ALTER SCHEMA archive RENAME TO public", rules.Forward, ""},
		{"DROP TABLE acct", rules.Forward, ""},
	}
	for _, tt := range tests {
		d := r.Decide(tt.sql)
		if d.Action != tt.action {
			t.Errorf("%s: got %v, want %v (%+v)", tt.sql, d.Action, tt.action, d.Err)
			continue
		}
		e := d.Err
		if d.Action == rules.Forward {
			e = d.AuditRefusal
		}
		switch {
		case tt.table == "" && e != nil:
			t.Errorf("%s: unexpected refusal %v", tt.sql, e)
		case tt.table == "":
		case e == nil:
			t.Errorf("%s: no refusal", tt.sql)
		case e.Code != rules.CodeRefused || e.Table != tt.table || !strings.Contains(e.Message, tt.table) ||
			!strings.Contains(e.Message, "configuration first") || !strings.Contains(e.Message, "without the proxy") || e.Hint == "" || e.Detail == "":
			t.Errorf("%s: got %+v", tt.sql, e)
		}
	}
}

func TestHasNonASCIINames(t *testing.T) {
	tests := []struct {
		name   string
		tables []rules.Table
		want   bool
	}{
		{"none", nil, false},
		{"ascii", []rules.Table{{Table: `public."Config"`, Column: "gen"}}, false},
		{"table", []rules.Table{{Table: "public.cönfig"}}, true},
		{"schema", []rules.Table{{Table: `"schéma".config`}}, true},
		{"column", []rules.Table{{Table: "public.config", Column: `"génération"`}}, true},
		{"off", []rules.Table{{Table: "public.config"}, {Table: "public.cönfig", Mode: "off"}}, false},
		{"audit", []rules.Table{{Table: "public.cönfig", Mode: rules.ModeAudit}}, true},
		// Scoped to a session the root does not serve: still reported,
		// by the root and by every set.
		{"scoped", []rules.Table{{Table: "public.cönfig", Scope: rules.Scope{Users: []string{"app"}}}}, true},
	}
	for _, tt := range tests {
		r := mustCompile(t, rules.Config{Tables: tt.tables})
		if got := r.HasNonASCIINames(); got != tt.want {
			t.Errorf("%s: root: got %v, want %v", tt.name, got, tt.want)
		}
		for _, user := range []string{"app", "other"} {
			if got := r.ForSession("db", user, "").HasNonASCIINames(); got != tt.want {
				t.Errorf("%s: session of %s: got %v, want %v", tt.name, user, got, tt.want)
			}
		}
	}
}
