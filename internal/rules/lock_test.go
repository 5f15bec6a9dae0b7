package rules_test

import (
	"slices"
	"strings"
	"testing"

	pg "github.com/pganalyze/pg_query_go/v6"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func lockRulesT(t *testing.T, tag string) *rules.Rules {
	t.Helper()
	r, err := rules.Compile(rules.Config{AuditTag: tag, Tables: []rules.Table{
		{Table: "public.acct"},
		{Table: "public.jobs", Lock: rules.LockRequired},
		{Table: "public.notes", Lock: rules.LockOff},
		{Table: "public.aud", Mode: rules.ModeAudit},
		{Table: "other.acct", Lock: rules.LockRequired, Column: "fence"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestLockConfig(t *testing.T) {
	for _, c := range []struct {
		cfg  rules.Config
		want string
	}{
		{rules.Config{Tables: []rules.Table{{Table: "public.t", Lock: "sometimes"}}}, `tables[0].lock: must be "optional", "required" or "off"`},
		{rules.Config{LockSetting: "lock", Tables: []rules.Table{{Table: "public.t"}}}, "lock_setting:"},
		{rules.Config{LockSetting: "Fence.Token", Tables: []rules.Table{{Table: "public.t"}}}, "lock_setting: must differ from token_setting"},
	} {
		_, err := rules.Compile(c.cfg)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: got %v, want %q", c.cfg, err, c.want)
		}
	}
	specs, err := rules.Specs(rules.Config{Tables: []rules.Table{
		{Table: "public.a"}, {Table: "public.b", Lock: "required"}, {Table: "public.c", Lock: "required", Column: "f"}, {Table: "public.d", Mode: "off"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	got := []string{}
	for _, s := range specs {
		got = append(got, s.Display+":"+s.Column+":"+s.Lock+":"+s.Mode)
	}
	want := []string{"public.a:last_fence:optional:enforce", "public.b::required:enforce", "public.c:f:required:enforce", "public.d::off:off"}
	if !slices.Equal(got, want) {
		t.Fatalf("specs %v, want %v", got, want)
	}
}

// stmts parses sql and returns its statements' node kinds.
func stmtKinds(t *testing.T, sql string) []string {
	t.Helper()
	tree, err := pg.Parse(sql)
	if err != nil {
		t.Fatalf("%q does not parse: %v", sql, err)
	}
	var out []string
	for _, s := range tree.Stmts {
		k := strings.TrimPrefix(strings.TrimPrefix(strings.SplitN(s.Stmt.String(), ":", 2)[0], "Node_"), "")
		out = append(out, k)
	}
	return out
}

// checkLockCall reports what is wrong with d's registration for sql:
// calls are the indexes of the registration statements in its Query
// (nil: none expected), required whether it is. It reports whether d
// has a registration to look at further.
func checkLockCall(t *testing.T, sql string, d rules.Decision, calls []int, required bool) bool {
	t.Helper()
	if calls == nil {
		if d.Lock != nil {
			t.Errorf("%q: unexpected registration %+v", sql, d.Lock)
		}
		return false
	}
	if d.Lock == nil {
		t.Errorf("%q: no registration", sql)
		return false
	}
	if !slices.Equal(d.Lock.Calls, calls) || d.Lock.Required != required {
		t.Errorf("%q: calls %v required %v, want %v %v", sql, d.Lock.Calls, d.Lock.Required, calls, required)
	}
	kinds := stmtKinds(t, d.Lock.Query)
	for _, i := range calls {
		if i >= len(kinds) || !strings.Contains(kinds[i], "call_stmt") {
			t.Errorf("%q: statement %d of %q is %v, want a CALL", sql, i, d.Lock.Query, kinds)
		}
	}
	return true
}

func TestLockDecisions(t *testing.T) {
	r := lockRulesT(t, "")
	for _, c := range []struct {
		sql      string
		action   rules.Action
		calls    []int // nil: no registration
		required bool
	}{
		{"SELECT * FROM public.acct WHERE id = 1", rules.Forward, []int{0}, false},
		{"SELECT * FROM acct WHERE id = 1", rules.Forward, []int{0}, true}, // other.acct (required) may be meant
		{"select 1 from (select * from public.acct) s", rules.Forward, []int{0}, false},
		{"WITH x AS (SELECT 1 FROM public.acct) SELECT * FROM x", rules.Forward, []int{0}, false},
		{"SELECT * FROM notes", rules.Forward, nil, false},
		{"SELECT * FROM other.notes, jobs", rules.Forward, []int{0}, true},
		{"UPDATE public.acct SET n = 1 WHERE id = 2", rules.Rewrite, []int{0}, false},
		{"UPDATE acct SET n = 1 WHERE id = 2", rules.Refuse, nil, false}, // ambiguous, fenced differently
		{"UPDATE jobs SET state = 'x'", rules.Forward, []int{0}, true},
		{"DELETE FROM other.acct", rules.Rewrite, []int{0}, true},
		{"COPY (SELECT * FROM public.acct) TO STDOUT", rules.Forward, []int{0}, false},
		{"EXPLAIN ANALYZE SELECT * FROM public.acct", rules.Forward, []int{0}, false},
		{"CREATE INDEX ON public.acct (n)", rules.Forward, nil, false},
		{"SELECT 1; SELECT * FROM public.acct; SET x.y = 1; UPDATE jobs SET state = 'y'", rules.Forward, []int{1, 4}, true},
		{"SELECT * FROM public.aud", rules.Forward, []int{0}, false},
	} {
		d := r.Decide(c.sql)
		if d.Action != c.action {
			t.Errorf("%q: action %v, want %v (%+v)", c.sql, d.Action, c.action, d.Err)
			continue
		}
		if !checkLockCall(t, c.sql, d, c.calls, c.required) {
			continue
		}
		sent := d.SQL
		if d.Action == rules.Forward {
			sent = c.sql
		}
		if len(c.calls) == 1 && c.calls[0] == 0 && d.Lock.Query != d.Lock.Call+";"+sent {
			t.Errorf("%q: query %q, want the call then the text sent", c.sql, d.Lock.Query)
		}
	}
	// The audit table's registration never fails the statement.
	if d := r.Decide("SELECT * FROM public.aud"); !strings.Contains(d.Lock.Call, "false, true") {
		t.Errorf("audit registration: %s", d.Lock.Call)
	}
	// PREPARE: the registration is for EXECUTE, nothing runs now.
	d := r.Decide("PREPARE p AS SELECT * FROM public.acct")
	if d.Lock == nil || len(d.Lock.Calls) != 0 || d.Lock.Call == "" || d.Lock.Query != "PREPARE p AS SELECT * FROM public.acct" {
		t.Errorf("PREPARE: %+v", d.Lock)
	}
}

// The registration's literals must read the same whatever the session's
// standard_conforming_strings: a backslash only inside E'...'.
func TestLockCallLiterals(t *testing.T) {
	r := lockRulesT(t, `proxy 'a' \ b`)
	d := r.Decide("SELECT * FROM public.acct")
	call := d.Lock.Call
	tree, err := pg.Parse(call)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(tree.String(), `proxy 'a' \\ b`) {
		t.Fatalf("the tag does not survive: %s", call)
	}
	if i := strings.Index(call, `\`); i >= 0 && !strings.Contains(call, `E'proxy`) {
		t.Fatalf("backslash outside an E'' literal: %s", call)
	}
}

// A long VALUES list takes the fast path; its registration is the same
// call before the whole statement.
func TestLockValuesFastPath(t *testing.T) {
	r := lockRulesT(t, "")
	var b strings.Builder
	b.WriteString("INSERT INTO public.acct (id, n) VALUES ")
	for i := 0; i < 200; i++ {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("(1, 2)")
	}
	d := r.Decide(b.String())
	if d.Action != rules.Rewrite || d.Lock == nil {
		t.Fatalf("%v %+v", d.Action, d.Err)
	}
	if d.Lock.Query != d.Lock.Call+";"+d.SQL || strings.Count(d.Lock.Query, "(1, 2, ") != 200 {
		t.Fatalf("query does not carry the whole statement")
	}
}

// TestHoldSet: a Hold set's registrations call HoldProc where the set
// without it calls RegisterProc, and nothing else of the decision
// differs, in every combination with the other siblings (derived in
// either order) and through DecideFor.
func TestHoldSet(t *testing.T) {
	r := lockRulesT(t, "")
	const sql = "UPDATE jobs SET state = 'done' WHERE id = 1"
	for _, tc := range []struct {
		name       string
		base, hold *rules.Rules
		s          rules.Session
	}{
		{"plain", r, r.Hold(), rules.Session{Lexing: utf8, Hold: true}},
		{"raisers", r.ServerFunctions(), r.Hold().ServerFunctions(), rules.Session{Lexing: utf8, Raisers: true, Hold: true}},
		{"raisers, stale_at", r.ServerFunctions().StaleAt(), r.Hold().StaleAt(), rules.Session{Lexing: utf8, Raisers: true, StaleAt: true, Hold: true}},
		{"prepared", r.Prepared(), r.Hold().Prepared(), rules.Session{Lexing: utf8Prepared, Hold: true}},
		{"raisers, prepared", r.ServerFunctions().Prepared(), r.Prepared().Hold().ServerFunctions(), rules.Session{Lexing: utf8Prepared, Raisers: true, Hold: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, h := tc.base.Decide(sql), tc.hold.Decide(sql)
			if b.Lock == nil || !strings.HasPrefix(b.Lock.Call, "CALL "+rules.RegisterProc+"(") {
				t.Fatalf("without Hold: %+v", b.Lock)
			}
			if h.Lock == nil || h.Lock.Call != strings.Replace(b.Lock.Call, rules.RegisterProc, rules.HoldProc, 1) ||
				h.Lock.Query != strings.Replace(b.Lock.Query, rules.RegisterProc, rules.HoldProc, 1) || h.SQL != b.SQL {
				t.Fatalf("with Hold:\n%+v %s\nwithout:\n%+v %s", h.Lock, h.SQL, b.Lock, b.SQL)
			}
			if d, _, _ := r.DecideFor(tc.s, sql); d.SQL != h.SQL || d.Lock == nil || d.Lock.Query != h.Lock.Query {
				t.Errorf("DecideFor: %+v, want the Hold set's decision", d.Lock)
			}
		})
	}
}
