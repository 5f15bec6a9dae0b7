package rules_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// mode reports how d fences public.config: "enforce", "audit" or "" when
// it is forwarded.
func mode(t *testing.T, d rules.Decision) string {
	t.Helper()
	switch {
	case d.Action == rules.Forward:
		return ""
	case d.Action != rules.Rewrite:
		t.Fatalf("unexpected decision %+v", d)
	case strings.Contains(d.SQL, "'m', 'audit'"):
		if strings.Contains(d.SQL, "fenceproxy:stale:") {
			t.Fatalf("audit rewrite raises: %s", d.SQL)
		}
		return "audit"
	case strings.Contains(d.SQL, "fenceproxy:stale:"):
		return "enforce"
	}
	t.Fatalf("unrecognised rewrite: %s", d.SQL)
	return ""
}

const scopedUpdate = "UPDATE config SET payload = 'x' WHERE id = 1"

func scopedRules(t testing.TB) *rules.Rules {
	return mustCompile(t, rules.Config{AuditTag: "proxy-a", Tables: []rules.Table{
		{Table: "public.config", Mode: "off", Scope: rules.Scope{Users: []string{"migrator"}}},
		{Table: "public.config", Scope: rules.Scope{ApplicationNames: []string{"billing"}, Databases: []string{"prod"}}},
		{Table: "public.config", Mode: "audit", Scope: rules.Scope{ApplicationNames: []string{"billing", "reports"}}},
		{Table: "public.config", Mode: "audit", Scope: rules.Scope{Databases: []string{"prod"}}},
		{Table: "public.accounts", Scope: rules.Scope{Users: []string{"app"}}},
	}})
}

func TestForSessionFirstMatchingEntryWins(t *testing.T) {
	r := scopedRules(t)
	tests := []struct {
		db, user, app string
		config        string // how public.config is fenced
		accounts      bool   // whether public.accounts is
	}{
		{"prod", "app", "billing", "enforce", true},
		{"prod", "migrator", "billing", "", false}, // the off entry comes first
		{"staging", "app", "billing", "audit", true},
		{"prod", "app", "reports", "audit", true},
		{"prod", "web", "", "audit", false},
		{"staging", "web", "web", "", false},      // no entry matches: not protected
		{"PROD", "app", "billing", "audit", true}, // exact match: no case folding
		{"PROD", "app", "Billing", "", true},
		{"", "", "", "", false},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s/%s/%s", tt.db, tt.user, tt.app), func(t *testing.T) {
			s := r.ForSession(tt.db, tt.user, tt.app)
			if got := mode(t, s.Decide(scopedUpdate)); got != tt.config {
				t.Errorf("public.config: %q, want %q", got, tt.config)
			}
			d := s.Decide("DELETE FROM accounts WHERE id = 1")
			if got := d.Action == rules.Rewrite; got != tt.accounts {
				t.Errorf("public.accounts fenced: %v, want %v (%v)", got, tt.accounts, d.Action)
			}
			// Tables and AuditTables are the configuration's.
			if got := strings.Join(s.Tables(), " "); got != "public.config public.accounts" {
				t.Errorf("Tables() = %q", got)
			}
			if got := strings.Join(s.AuditTables(), " "); got != "public.config" {
				t.Errorf("AuditTables() = %q", got)
			}
			// Decided through a derived set, a statement that names no
			// fenced table is still forwarded unparsed.
			if s.MayTouch("SELECT 1") {
				t.Error("MayTouch(SELECT 1)")
			}
			// ForSession on a derived set is ForSession on the root.
			if s.ForSession(tt.db, tt.user, tt.app) != s {
				t.Error("ForSession on the derived set gave another set")
			}
			if s.TokenSetting() != "fence.token" || s.AuditTag() != "proxy-a" {
				t.Errorf("derived set lost settings: %q %q", s.TokenSetting(), s.AuditTag())
			}
		})
	}
	// The root lists every table some entry fences, whatever the session.
	if got := strings.Join(r.Tables(), " "); got != "public.config public.accounts" {
		t.Errorf("root Tables() = %q", got)
	}
	if got := strings.Join(r.AuditTables(), " "); got != "public.config" {
		t.Errorf("root AuditTables() = %q", got)
	}
	// The root decides for a session that matches no scoped entry.
	if d := r.Decide(scopedUpdate); d.Action != rules.Forward {
		t.Errorf("root decision %+v", d)
	}
}

func TestForSessionUnscopedEntriesApplyToEverySession(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{
		{Table: "public.config", Scope: rules.Scope{ApplicationNames: []string{"billing"}}},
		{Table: "public.config", Mode: "audit"},
		{Table: "public.accounts"},
	}})
	if got := mode(t, r.ForSession("db", "u", "billing").Decide(scopedUpdate)); got != "enforce" {
		t.Errorf("billing: %q", got)
	}
	other := r.ForSession("db", "u", "web")
	if got := mode(t, other.Decide(scopedUpdate)); got != "audit" {
		t.Errorf("web: %q", got)
	}
	// A session matching no scoped entry gets the root set itself.
	if other != r {
		t.Error("a session matching no scope did not get the root set")
	}
	if got := mode(t, r.Decide(scopedUpdate)); got != "audit" {
		t.Errorf("root: %q", got)
	}
	for _, s := range []*rules.Rules{r, r.ForSession("db", "u", "billing")} {
		if d := s.Decide("DELETE FROM accounts"); d.Action != rules.Rewrite {
			t.Errorf("unscoped public.accounts not fenced: %v", d.Action)
		}
	}
}

func TestForSessionWithoutScopesIsTheRootAndDoesNotAllocate(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: "public.config"}, {Table: "public.accounts", Mode: "audit"}}})
	if r.ForSession("db", "u", "app") != r {
		t.Fatal("ForSession without scopes did not return the root")
	}
	if n := testing.AllocsPerRun(100, func() { r.ForSession("db", "user", "app") }); n != 0 {
		t.Errorf("ForSession allocates %v times without scopes", n)
	}
}

func TestForSessionMemoizedDoesNotAllocate(t *testing.T) {
	r := scopedRules(t)
	s := r.ForSession("prod", "app", "billing")
	if r.ForSession("prod", "app", "billing") != s {
		t.Fatal("not memoized")
	}
	// Another session with the same matching entries shares the set.
	if r.ForSession("prod", "app2", "billing") == s {
		t.Error("sessions matching different entries share a set")
	}
	if r.ForSession("prod", "web", "billing") != r.ForSession("prod", "web2", "billing") {
		t.Error("sessions matching the same entries got different sets")
	}
	if n := testing.AllocsPerRun(100, func() { r.ForSession("prod", "app", "billing") }); n != 0 {
		t.Errorf("memoized ForSession allocates %v times", n)
	}
	if n := testing.AllocsPerRun(100, func() { r.ForSession("x", "y", "z") }); n != 0 {
		t.Errorf("ForSession of a session matching no scope allocates %v times", n)
	}
}

// Sets derived from one root share its decision cache, without mixing up
// their decisions.
func TestForSessionSetsKeepTheirOwnDecisions(t *testing.T) {
	r := scopedRules(t)
	enforce, audit := r.ForSession("prod", "app", "billing"), r.ForSession("prod", "app", "reports")
	for range 3 {
		if got := mode(t, enforce.Decide(scopedUpdate)); got != "enforce" {
			t.Fatalf("enforce set: %q", got)
		}
		if got := mode(t, audit.Decide(scopedUpdate)); got != "audit" {
			t.Fatalf("audit set: %q", got)
		}
		if got := mode(t, r.Decide(scopedUpdate)); got != "" {
			t.Fatalf("root: %q", got)
		}
	}
}

// Sessions of many kinds at once (run with -race).
func TestForSessionConcurrent(t *testing.T) {
	r := scopedRules(t)
	sessions := [][3]string{
		{"prod", "app", "billing"}, {"prod", "migrator", "billing"}, {"staging", "app", "billing"},
		{"prod", "app", "reports"}, {"staging", "web", "web"}, {"prod", "web", ""},
	}
	want := make([]string, len(sessions))
	for i, s := range sessions {
		want[i] = mode(t, r.ForSession(s[0], s[1], s[2]).Decide(scopedUpdate))
	}
	fresh := scopedRules(t)
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := range 200 {
				i := (n + g) % len(sessions)
				s := sessions[i]
				d := fresh.ForSession(s[0], s[1], s[2]).Decide(scopedUpdate)
				got := ""
				switch {
				case d.Action == rules.Forward:
				case strings.Contains(d.SQL, "'m', 'audit'"):
					got = "audit"
				default:
					got = "enforce"
				}
				if got != want[i] {
					select {
					case errs <- fmt.Sprintf("%v: got %q want %q", s, got, want[i]):
					default:
					}
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// Beyond the memo bound, sessions still get the right rules.
func TestForSessionBeyondTheMemoBound(t *testing.T) {
	// Table i is fenced for the application names p<k> where bit i of k is
	// set: 2^9 = 512 distinct combinations of matching entries.
	const bits = 9
	var tables []rules.Table
	for i := range bits {
		var apps []string
		for k := range 1 << bits {
			if k&(1<<i) != 0 {
				apps = append(apps, fmt.Sprintf("p%d", k))
			}
		}
		tables = append(tables, rules.Table{Table: fmt.Sprintf("public.t%d", i), Scope: rules.Scope{ApplicationNames: apps}})
	}
	r := mustCompile(t, rules.Config{Tables: tables})
	for k := range 1 << bits {
		s := r.ForSession("db", "u", fmt.Sprintf("p%d", k))
		for i := range bits {
			d := s.Decide(fmt.Sprintf("DELETE FROM t%d", i))
			if got, want := d.Action == rules.Rewrite, k&(1<<i) != 0; got != want {
				t.Fatalf("session p%d, table t%d: fenced %v, want %v", k, i, got, want)
			}
		}
	}
	// Early sessions were memoized, late ones were not.
	if a, b := r.ForSession("db", "u", "p1"), r.ForSession("db", "u", "p1"); a != b {
		t.Error("early session not memoized")
	}
	if a, b := r.ForSession("db", "u", "p511"), r.ForSession("db", "u", "p511"); a == b {
		t.Error("session beyond the bound memoized")
	}
}
