package rules_test

import (
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// largeText returns a statement of exactly size bytes: prefix, a string
// literal of x, suffix.
func largeText(prefix, suffix string, size int) string {
	return prefix + strings.Repeat("x", size-len(prefix)-len(suffix)) + suffix
}

// allocatedBy returns the bytes the heap grew by during f.
func allocatedBy(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// TestDecideTooLargeAllocates: deciding a 16 MiB text over max_check_bytes
// (refused, forwarded with an audit refusal, or forwarded because it names
// no protected table) allocates a small fraction of the text: the rules
// neither copy it nor lower-case it while they look for the tables it
// names (issue 27, part 4: the proxy charges its memory budget
// proxy.decisionCost times the text for the decision).
func TestDecideTooLargeAllocates(t *testing.T) {
	const size = 16 << 20
	r := mustCompile(t, rules.Config{Tables: []rules.Table{
		{Table: "public.config"},
		{Table: "public.accounts", OnStale: "skip"},
		{Table: "public.audited", Mode: "audit"},
	}})
	for _, c := range []struct {
		name, prefix, suffix string
		want                 rules.Action
		audit                bool
		tables               string
	}{
		{"refused", "INSERT INTO config VALUES ('", "')", rules.Refuse, false, "public.config"},
		{"refused, name at the end", "SELECT '", "'; UPDATE Public.CONFIG SET a = 1", rules.Refuse, false, "public.config"},
		{"refused, two tables", "UPDATE ACCOUNTS SET a = '", "' FROM config", rules.Refuse, false, "public.accounts,public.config"},
		{"disguised", `UPDATE U&"\0063onfig" SET a = '`, "'", rules.Refuse, false, ""},
		{"audit", "UPDATE Audited SET a = '", "'", rules.Forward, true, "public.audited"},
		{"schema only", "ALTER TABLE public.other ADD COLUMN b text DEFAULT '", "'", rules.Forward, false, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			sql := largeText(c.prefix, c.suffix, size)
			var d rules.Decision
			n := allocatedBy(func() { d = r.Decide(sql) })
			if d.Action != c.want || (d.AuditRefusal != nil) != c.audit || strings.Join(d.Tables, ",") != c.tables {
				t.Fatalf("%v, tables %q, audit %v; want %v, %q, audit %v", d.Action, d.Tables, d.AuditRefusal != nil, c.want, c.tables, c.audit)
			}
			if e := d.Err; c.want == rules.Refuse && (e == nil || !strings.Contains(e.Message, "too large")) {
				t.Fatalf("refusal %+v, want one for a statement too large", e)
			}
			t.Logf("deciding %d bytes allocated %d B (%.4fx)", size, n, float64(n)/size)
			// Less than half the text: no copy of it, in any case.
			if n >= size/2 {
				t.Errorf("deciding a %d-byte text allocated %d B (%.2fx), want less than half its size", size, n, float64(n)/size)
			}
		})
	}
}

// TestIndirectCheckTooLargeAllocates: checking a 16 MiB text for writes
// through relations that reach a protected table (refused: too large)
// copies none of it either.
func TestIndirectCheckTooLargeAllocates(t *testing.T) {
	const size = 16 << 20
	s := rules.NewIndirectSet([]rules.Indirect{{Schema: "public", Name: "config_view", Ops: []string{"UPDATE"}, Target: "public.config", Via: "a view"}})
	sql := largeText("UPDATE Config_View SET a = '", "'", size)
	var e *rules.Error
	n := allocatedBy(func() { e = s.Check(sql) })
	if e == nil || !strings.Contains(e.Message, "too large") {
		t.Fatalf("%+v, want a refusal for a statement too large", e)
	}
	t.Logf("checking %d bytes allocated %d B", size, n)
	if n >= size/2 {
		t.Errorf("checking a %d-byte text allocated %d B (%.2fx), want less than half its size", size, n, float64(n)/size)
	}
}

// TestDecideDoesNotKeepText: a text too large to cache is decided without
// a copy, so nothing in its decision may refer to its bytes: overwriting
// them after Decide leaves the decision as it was (a relay decides texts
// in place, in a buffer it reuses).
func TestDecideDoesNotKeepText(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{
		{Table: "public.config", Lock: "optional"},
		{Table: "public.audited", Mode: "audit"},
	}})
	rows := strings.Repeat("(1, 'x'), ", 5000) + "(2, 'y')"
	for _, sql := range []string{
		"INSERT INTO config (id, payload) VALUES " + rows,
		"INSERT INTO config (id, payload) VALUES " + rows + " RETURNING id, payload",
		"UPDATE config SET payload = 'p' WHERE id IN (SELECT x FROM (VALUES " + strings.Replace(rows, "'x'", "1", -1) + ") v(x, y))",
		"TRUNCATE audited; SELECT '" + strings.Repeat("z", 50000) + "'",
		"INSERT INTO config (id, payload) VALUES " + rows + ", (", // does not parse
		"SELECT payload FROM config WHERE payload = '" + strings.Repeat("q", 50000) + "'",
		// Lock.Query is the text itself when it only PREPAREs.
		"PREPARE p AS SELECT payload FROM config WHERE payload = '" + strings.Repeat("q", 50000) + "'",
	} {
		want := r.Decide(sql) // a copy of the literals, never overwritten
		buf := []byte(sql)
		d := r.Decide(unsafe.String(&buf[0], len(buf)))
		for i := range buf {
			buf[i] = '#'
		}
		if !sameDecision(d, want) {
			t.Errorf("%.60s...: the decision changed when the text's bytes did:\n%+v\nwant %+v", sql, d, want)
		}
	}
}

func sameDecision(a, b rules.Decision) bool {
	if a.Action != b.Action || a.SQL != b.SQL || strings.Join(a.Tables, ",") != strings.Join(b.Tables, ",") ||
		a.Preparable != b.Preparable || (a.Err == nil) != (b.Err == nil) || (a.AuditRefusal == nil) != (b.AuditRefusal == nil) ||
		(a.Lock == nil) != (b.Lock == nil) {
		return false
	}
	for _, p := range [][2]*rules.Error{{a.Err, b.Err}, {a.AuditRefusal, b.AuditRefusal}} {
		if p[0] != nil && *p[0] != *p[1] {
			return false
		}
	}
	return a.Lock == nil || a.Lock.Call == b.Lock.Call && a.Lock.Query == b.Lock.Query
}

// BenchmarkDecideTooLarge: a refused 16 MiB INSERT, over max_check_bytes
// (cache on, as in the proxy).
func BenchmarkDecideTooLarge(b *testing.B) {
	r := benchRules(b, rules.DefaultCacheSize)
	sql := largeText("INSERT INTO config VALUES ('", "')", 16<<20)
	b.ReportAllocs()
	b.SetBytes(int64(len(sql)))
	for b.Loop() {
		if r.Decide(sql).Action != rules.Refuse {
			b.Fatal("not refused")
		}
	}
}

// TestDecisionCostCoversTheParse: for the batches drivers send at or
// under max_check_bytes (a long VALUES list, a long string), everything
// the decision allocates — more than it holds at any one time — is within
// what DecisionCost charges the relay's large-message budget. A long IN
// list and many small statements allocate more over their decision than
// is charged (logged here; docs/design.md, "Memory of large messages").
// A text over max_check_bytes is charged its size.
func TestDecisionCostCoversTheParse(t *testing.T) {
	const size = 256 << 10
	r := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	row := "(1, 'k', 2), "
	for _, c := range []struct {
		name, sql string
		covered   bool
	}{
		{"values", "INSERT INTO config (a, b, c) VALUES " + strings.Repeat(row, size/len(row)) + "(1, 'k', 2)", true},
		{"string", largeText("UPDATE config SET a = '", "'", size), true},
		{"in list", "UPDATE config SET a = 1 WHERE id IN (" + strings.Repeat("1, ", size/3) + "1)", false},
		{"statements", strings.Repeat("UPDATE config SET a = 1 WHERE id = 7; ", size/38/4), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			cost := r.DecisionCost(c.sql)
			if cost != rules.ParseCost*int64(len(c.sql)) {
				t.Fatalf("cost %d for a text of %d bytes under max_check_bytes, want %d×", cost, len(c.sql), rules.ParseCost)
			}
			var d rules.Decision
			n := allocatedBy(func() { d = r.Decide(c.sql) })
			if d.Action == rules.Forward {
				t.Fatalf("forwarded: the text was meant to be fenced")
			}
			t.Logf("%s: %d bytes, allocated %d (%.1f×), charged %d", c.name, len(c.sql), n, float64(n)/float64(len(c.sql)), cost)
			if c.covered && int64(n) > cost {
				t.Errorf("deciding %d bytes allocated %d, more than the %d charged", len(c.sql), n, cost)
			}
		})
	}
	big := largeText("UPDATE config SET a = '", "'", rules.DefaultMaxCheckBytes+1)
	if got := r.DecisionCost(big); got != int64(len(big)) {
		t.Errorf("over max_check_bytes: cost %d, want %d (decided in place)", got, len(big))
	}
}
