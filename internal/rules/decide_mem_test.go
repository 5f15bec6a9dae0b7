package rules_test

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
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
// names (issue 27, part 4: DecisionCost charges the proxy's memory
// budget only the text's size for such a decision).
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

// The shapes of text DecisionCost must bound the decision of: what
// drivers and ORMs send in bulk, and the shapes whose decision holds the
// most per byte. Each fills about size bytes.
var costShapes = []struct {
	name string
	sql  func(size int) string
}{
	{"VALUES rows", func(n int) string { return fill("INSERT INTO config (a, b, c) VALUES ", "(1, 'k', 2)", ", ", "", n) }},
	{"VALUES one-item rows", func(n int) string { return fill("INSERT INTO config (a) VALUES ", "(1)", ",", "", n) }},
	// The rewrite keeps the client's fence values: every row is parsed.
	{"VALUES rows with the fence column", func(n int) string {
		return fill("INSERT INTO config (a, last_fence, c) VALUES ", "(1, 5, 2)", ", ", "", n)
	}},
	{"VALUES rows with calls", func(n int) string {
		return fill("INSERT INTO config (a, b, c) VALUES ", "(1, 'k', now())", ", ", "", n)
	}},
	{"IN list", func(n int) string { return fill("UPDATE config SET a = 1 WHERE id IN (", "1", ", ", ")", n) }},
	{"IN list of names", func(n int) string { return fill("UPDATE config SET a = 1 WHERE id IN (", "a", ",", ")", n) }},
	{"RETURNING list", func(n int) string { return fill("UPDATE config SET a = 1 RETURNING ", "a", ",", "", n) }},
	{"SET list", func(n int) string { return fill("UPDATE config SET ", "a=1", ",", "", n) }},
	{"fenced statements", func(n int) string { return fill("", "UPDATE config SET a = 1 WHERE id = 7;", " ", "", n) }},
	{"short fenced statements", func(n int) string { return fill("", "DELETE FROM config", ";", "", n) }},
	{"empty SELECTs", func(n int) string { return fill("UPDATE config SET a = 1;", "SELECT", ";", "", n) }},
	{"string", func(n int) string { return largeText("UPDATE config SET a = '", "'", n) }},
	{"JSON literal", func(n int) string { return fill("UPDATE config SET a = '{", `"a":1`, ",", "}'", n) }},
	{"identifier", func(n int) string { return largeText(`UPDATE config SET a = "`, `"`, n) }},
	{"long names", func(n int) string {
		return fill("UPDATE config SET a = 1 WHERE id IN (", strings.Repeat("b", 63), ",", ")", n)
	}},
	{"comment", func(n int) string { return largeText("UPDATE config SET a = 1 /*", "*/", n) }},
	{"dollar-quoted string of commas", func(n int) string { return fill("UPDATE config SET a = $$", ",", "", "$$", n) }},
	// Left-deep chains of 2,000 operators, and 400 nested brackets: deep,
	// but under maxNestingEstimate.
	{"operator chains", func(n int) string {
		return fill("UPDATE config SET a = 1 WHERE id IN (", strings.TrimSuffix(strings.Repeat("1+", 2000), "+"), ",", ")", n)
	}},
	{"nested brackets", func(n int) string {
		return fill("UPDATE config SET a = 1 WHERE id IN (", strings.Repeat("(", 400)+"1"+strings.Repeat(")", 400), ",", ")", n)
	}},
	{"CASE arms", func(n int) string { return fill("UPDATE config SET a = CASE ", "WHEN a THEN 1", " ", " END", n) }},
	{"DO block", func(n int) string {
		return fill("DO $$ BEGIN ", "PERFORM 1;", " ", " UPDATE config SET a = 1; END $$", n)
	}},
	{"DO block of strings", func(n int) string {
		return fill("DO $$ BEGIN PERFORM ", "'a b'", ",", "; UPDATE config SET a = 1; END $$", n)
	}},
	{"SQL function", func(n int) string {
		return fill("CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$ ", "SELECT 1;", " ", " UPDATE config SET a = 1 $$", n)
	}},
}

// fill returns prefix, unit repeated with sep between, and suffix, at most
// size bytes in all.
func fill(prefix, unit, sep, suffix string, size int) string {
	var b strings.Builder
	b.WriteString(prefix)
	for k := 0; b.Len()+len(sep)+len(unit)+len(suffix) <= size; k++ {
		if k > 0 {
			b.WriteString(sep)
		}
		b.WriteString(unit)
	}
	b.WriteString(suffix)
	return b.String()
}

// costForms are the rule sets a shape is decided by: the forms of the
// rewrite (ServerFunctions, Prepared) and the table settings that change
// what it writes.
var costForms = map[string]func(t testing.TB) *rules.Rules{
	"plain": func(t testing.TB) *rules.Rules {
		return mustCompile(t, rules.Config{CacheSize: -1, Tables: []rules.Table{{Table: "public.config"}}})
	},
	"raisers": func(t testing.TB) *rules.Rules {
		return mustCompile(t, rules.Config{CacheSize: -1, Tables: []rules.Table{{Table: "public.config"}}}).ServerFunctions()
	},
	"prepared": func(t testing.TB) *rules.Rules {
		return mustCompile(t, rules.Config{CacheSize: -1, Tables: []rules.Table{{Table: "public.config"}}}).Prepared()
	},
	"lock": func(t testing.TB) *rules.Rules {
		return mustCompile(t, rules.Config{CacheSize: -1, Tables: []rules.Table{{Table: "public.config", Lock: "optional"}}})
	},
	"audit": func(t testing.TB) *rules.Rules {
		return mustCompile(t, rules.Config{CacheSize: -1, Tables: []rules.Table{{Table: "public.config", Mode: "audit"}}})
	},
	"audit prepared": func(t testing.TB) *rules.Rules {
		return mustCompile(t, rules.Config{CacheSize: -1, Tables: []rules.Table{{Table: "public.config", Mode: "audit"}}}).Prepared()
	},
}

// peakEnv names the measurement a child process of
// TestDecisionCostCoversThePeak makes: shape index, size, form.
const peakEnv = "FENCEPROXY_DECIDE_PEAK"

// TestDecisionCostCoversThePeak: for every shape in costShapes, at 60 KiB
// and at max_check_bytes (1 MiB; not with -short), the memory deciding
// the text holds at its peak is within DecisionCost, in the plain form
// and, for the shapes that hold the most, in the others. The peak is the
// growth of the process's peak resident size (VmHWM, reset through
// /proc/self/clear_refs) over the decision, in a process of its own (a
// child running this test) that has decided a small statement first, on
// the same OS thread, with the garbage collector at GOGC=10 so that the
// heap holds little garbage beyond the live data: it counts pg_query's C
// memory and the goroutine's stack, which runtime.MemStats does not see.
// TotalAlloc (Go memory only, all of it garbage by the end) is logged
// beside it. Also: a text of at most 512 bytes holds less than 4 MiB
// (the relay does not ask the cost of texts that short, and charges
// those under 64 KiB only past 4 MiB).
func TestDecisionCostCoversThePeak(t *testing.T) {
	if spec := os.Getenv(peakEnv); spec != "" {
		measurePeak(t, spec)
		return
	}
	if runtime.GOOS != "linux" {
		t.Skip("measures the peak resident size through /proc/self")
	}
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		t.Skipf("cannot reset the peak resident size: %v", err)
	}
	heavy := map[string]bool{"VALUES one-item rows": true, "VALUES rows with the fence column": true, "RETURNING list": true,
		"short fenced statements": true, "fenced statements": true, "operator chains": true, "string": true}
	type run struct {
		shape int
		size  int
		form  string
	}
	var runs []run
	sizes := []int{60 << 10, rules.DefaultMaxCheckBytes}
	if testing.Short() {
		sizes = sizes[:1]
	}
	for i, c := range costShapes {
		for _, size := range sizes {
			runs = append(runs, run{i, size, "plain"})
			if heavy[c.name] && size == sizes[0] {
				for _, f := range []string{"raisers", "prepared", "lock", "audit"} {
					runs = append(runs, run{i, size, f})
				}
			}
		}
	}
	for _, f := range []string{"plain", "audit prepared"} {
		for _, name := range []string{"short fenced statements", "fenced statements"} {
			for i, c := range costShapes {
				if c.name == name {
					runs = append(runs, run{i, 512, f})
				}
			}
		}
	}
	for _, c := range runs {
		name := fmt.Sprintf("%s/%d/%s", costShapes[c.shape].name, c.size, c.form)
		t.Run(name, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestDecisionCostCoversThePeak$", "-test.v")
			cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d:%d:%s", peakEnv, c.shape, c.size, c.form))
			out, err := cmd.CombinedOutput()
			var n, peak, total, cost int64
			var found bool
			for _, l := range strings.Split(string(out), "\n") {
				if _, serr := fmt.Sscanf(strings.TrimSpace(l), "peak: bytes %d peak %d total %d cost %d", &n, &peak, &total, &cost); serr == nil {
					found = true
				}
			}
			if err != nil || !found {
				t.Fatalf("measuring: %v\n%s", err, out)
			}
			t.Logf("%d bytes: peak %d (%.1fx), TotalAlloc %d (%.1fx), DecisionCost %d (%.1fx, %.2f times the peak)",
				n, peak, float64(peak)/float64(n), total, float64(total)/float64(n), cost, float64(cost)/float64(n), float64(cost)/float64(peak))
			if peak > cost {
				t.Errorf("deciding %d bytes held %d at its peak, more than its DecisionCost %d", n, peak, cost)
			}
			if c.size <= 512 && peak >= 4<<20 {
				t.Errorf("deciding %d bytes held %d at its peak, 4 MiB or more", n, peak)
			}
		})
	}
}

// measurePeak is the child's part of TestDecisionCostCoversThePeak.
func measurePeak(t *testing.T, spec string) {
	f := strings.SplitN(spec, ":", 3)
	shape, err1 := strconv.Atoi(f[0])
	size, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil || len(f) != 3 || costForms[f[2]] == nil {
		t.Fatalf("bad %s %q", peakEnv, spec)
	}
	// cgo calls run on the goroutine's thread: the warm-up's allocations
	// (pg_query's memory contexts, the thread's malloc arena) are then
	// the decision's.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r := costForms[f[2]](t)
	sql := costShapes[shape].sql(size)
	for range 3 {
		r.Decide("UPDATE config SET a = 1 WHERE id IN (1, 2, 3); DELETE FROM config")
	}
	cost := r.DecisionCost(sql)
	runtime.GC()
	debug.FreeOSMemory()
	defer debug.SetGCPercent(debug.SetGCPercent(10))
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		t.Fatal(err)
	}
	rss := procStatus(t, "VmRSS")
	d := r.Decide(sql)
	peak := procStatus(t, "VmHWM") - rss
	runtime.ReadMemStats(&after)
	if d.Action == rules.Forward && d.AuditRefusal == nil && !strings.HasPrefix(sql, "DO") && !strings.HasPrefix(sql, "CREATE") {
		t.Errorf("%s: forwarded unchanged, so not checked as meant", costShapes[shape].name)
	}
	fmt.Printf("peak: bytes %d peak %d total %d cost %d\n", len(sql), peak, after.TotalAlloc-before.TotalAlloc, cost)
}

// procStatus returns the field key of /proc/self/status, in bytes.
func procStatus(t *testing.T, key string) int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key+":"); ok {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb); err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no %s in /proc/self/status", key)
	return 0
}

// TestDecisionCostOfHarmlessTexts: DecisionCost reads literals, comments
// and dollar-quoted strings as one token each, and a long VALUES list of
// plain rows as what the values fast path decides, so that bulk texts are
// not charged many times what they hold: a 1 MiB JSON literal full of
// commas and a 1 MiB batch of VALUES rows stay far under the default
// large-message budget (256 MiB). It allocates nothing. A text over
// max_check_bytes is decided in place and costs its size.
func TestDecisionCostOfHarmlessTexts(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	const size = rules.DefaultMaxCheckBytes
	row := "(1, 'k', 2)"
	for _, c := range []struct {
		name string
		sql  string
		max  int64 // times the size
	}{
		{"JSON literal", fill("UPDATE config SET a = '{", `"a":1`, ",", "}'", size), 24},
		{"dollar-quoted JSON", fill("UPDATE config SET a = $j${", `"a":1`, ",", "}$j$", size), 24},
		{"commented-out list", fill("UPDATE config SET a = 1 /* ", "1,", "", " */", size), 24},
		{"VALUES rows", fill("INSERT INTO config (a, b, c) VALUES ", row, ", ", "", size), 100},
		{"VALUES rows, typed", fill("INSERT INTO config (a, b, c) VALUES ", "($1::int, -2.5, 'x'::text)", ", ", " ON CONFLICT (a) DO UPDATE SET b = EXCLUDED.b", size), 100},
		{"VALUES rows in a DELETE", fill("DELETE FROM config WHERE (a, b, c) IN (VALUES ", row, ", ", ")", size), 1 << 10},
	} {
		cost := r.DecisionCost(c.sql)
		t.Logf("%s: %d bytes cost %d (%.1fx)", c.name, len(c.sql), cost, float64(cost)/float64(len(c.sql)))
		if cost > c.max*int64(len(c.sql)) {
			t.Errorf("%s: %d bytes cost %d, more than %d times the size", c.name, len(c.sql), cost, c.max)
		}
		if n := testing.AllocsPerRun(5, func() { r.DecisionCost(c.sql) }); n != 0 {
			t.Errorf("%s: DecisionCost allocated %v times", c.name, n)
		}
	}
	// A long list of rows is only cheap where the fast path takes it.
	rows := fill("INSERT INTO config (a, b, c) VALUES ", row, ", ", "", 64<<10)
	cheap := r.DecisionCost(rows)
	for _, sql := range []string{
		strings.Replace(rows, "(a, b, c)", "(a, last_fence, c)", 1), // the client's fence values are kept
		strings.Replace(rows, "'k'", "now()", -1),                   // not plain
		strings.Replace(rows, row+", "+row, row+", (1, 'k')", 1),    // rows of two widths
		rows + "; DELETE FROM config",                               // a DELETE's condition is repeated
		rows + ", (1, 'k', 2",                                       // a row left open
		rows + "; INSERT INTO config VALUES (1)",                    // two lists
	} {
		if cost := r.DecisionCost(sql); cost < 4*cheap {
			t.Errorf("%.50s…%s: cost %d, want the cost of parsing every row (at least %d)", sql, sql[len(sql)-20:], cost, 4*cheap)
		}
	}
	big := largeText("UPDATE config SET a = '", "'", rules.DefaultMaxCheckBytes+1)
	if got := r.DecisionCost(big); got != int64(len(big)) {
		t.Errorf("over max_check_bytes: cost %d, want %d (decided in place)", got, len(big))
	}
}

// BenchmarkDecisionCost: what the relay pays for a text over 512 bytes
// that may touch a protected table, beside MayTouch: for a 2 KiB fenced
// UPDATE with an IN list (the coarse bound: its semicolons counted), a
// 16 KiB one and a 1 MiB VALUES batch (scanned).
func BenchmarkDecisionCost(b *testing.B) {
	r := benchRules(b, rules.DefaultCacheSize)
	for _, c := range []struct{ name, sql string }{
		{"2KiB", fill("UPDATE config SET payload = $1 WHERE id IN (", "12345", ", ", ")", 2<<10)},
		{"16KiB", fill("UPDATE config SET payload = $1 WHERE id IN (", "12345", ", ", ")", 16<<10)},
		{"1MiB", fill("INSERT INTO config (a, b, c) VALUES ", "(1, 'k', 2)", ", ", "", 1<<20)},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(c.sql)))
			for b.Loop() {
				r.DecisionCost(c.sql)
			}
		})
	}
}
