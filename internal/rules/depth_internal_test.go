package rules

import (
	"fmt"
	"strings"
	"testing"

	pg "github.com/pganalyze/pg_query_go/v6"
	"github.com/pganalyze/pg_query_go/v6/parser"
)

// nestingForm builds, from a statement prefix ("select 1 from config where
// id = "), a statement whose parse tree nests n times in one way.
type nestingForm struct {
	name  string
	build func(n int) string
}

// nestingForms are the ways a parse tree can grow deep: chains of
// left-associative operators (no bound but the text's length) and nested
// brackets (bounded by the parser's own stack to a few thousand).
var nestingForms = func() []nestingForm {
	where := func(pre, unit, post string) func(int) string {
		return func(n int) string {
			return "select 1 from config where id = " + pre + strings.Repeat(unit, n) + post
		}
	}
	around := func(open, mid, close string) func(int) string {
		return func(n int) string {
			return "select 1 from config where id = " + strings.Repeat(open, n) + mid + strings.Repeat(close, n)
		}
	}
	stmt := func(pre, unit, post string) func(int) string {
		return func(n int) string { return pre + strings.Repeat(unit, n) + post }
	}
	return []nestingForm{
		{"plus", where("1", " + 1", "")},
		{"plus-ident", where("id", "+id", "")},
		{"concat", where("'a'", "||'a'", "")},
		{"json", where("'{}'::jsonb", "->'a'", "")},
		{"json-text", where("'{}'::jsonb", "#>>'{a}'", "")},
		{"cast", where("1", "::int", "")},
		{"collate", where("'a'", ` collate "C"`, "")},
		{"at-time-zone", where("now()", " at time zone 'UTC'", "")},
		{"operator", where("1", " operator(pg_catalog.+) 1", "")},
		{"mixed-ops", where("1", "*1+1-1/1", "")},
		{"plus-minus", where("1", "+-", "1")},
		{"parens", around("(", "1", ")")},
		{"right-parens", around("1+(", "1", ")")},
		{"function", around("abs(", "1", ")")},
		{"subquery", around("(select ", "1", ")")},
		{"exists", around("exists (select ", "1", ")")},
		{"in-subquery", around("1 in (select ", "1", ")")},
		{"array", around("array[", "1", "]")},
		{"array-subquery", around("array(select ", "1", ")")},
		{"row", around("row(", "1", ")")},
		{"case-else", around("case when true then 1 else ", "1", " end")},
		{"case-then", around("case when true then ", "1", " else 1 end")},
		{"case-when", around("case when ", "true", " then 1 end")},
		{"unary-minus", where("", "- ", "id")},
		{"not", where("1 and ", "not ", "true")},
		{"not-between", where("1 and ", "not ", "id between 1 and 2")},
		{"in", around("1 in (", "1", ")")},
		{"not-in", around("1 and not 1 in (", "1", ")")},
		{"coalesce", around("coalesce(", "1", ")")},
		{"cast-function", around("cast(", "1", " as int)")},
		{"subscript", where("(array[1])", "[1]", "")},
		{"indirection", where("(row(1)).f", ".f", "")},
		{"union", stmt("select 1 from config", " union select 1", "")},
		{"union-all", stmt("select 1 from config", " union all select 1", "")},
		{"intersect", stmt("select 1 from config", " intersect select 1", "")},
		{"join", stmt("select 1 from config a", " join config b on true", "")},
		{"cross-join", stmt("select 1 from config a", " cross join config", "")},
		{"from-subquery", func(n int) string {
			return "select 1 from " + strings.Repeat("(select 1 from ", n) + "config" + strings.Repeat(") s", n)
		}},
		{"cte", func(n int) string {
			return strings.Repeat("with a as (", n) + "select 1 from config" + strings.Repeat(") select 1", n)
		}},
		{"update-set", stmt("update config set n = 1", "+1", " where id = 1")},
		{"update-subquery", func(n int) string {
			return "update config set n = " + strings.Repeat("(select ", n) + "1" + strings.Repeat(")", n)
		}},
		{"insert-values", stmt("insert into config (id, n) values (1, 1)", "+1", "")},
		{"delete-where", stmt("delete from config where id = 1", "+1", "")},
	}
}()

// TestNestingEstimateBoundsTree checks the claim maxNestingEstimate rests
// on: wherever the estimate is within the limit, the parse tree is at most
// 2×estimate+16 protobuf messages deep.
func TestNestingEstimateBoundsTree(t *testing.T) {
	md := (&pg.ParseResult{}).ProtoReflect().Descriptor()
	for _, f := range nestingForms {
		t.Run(f.name, func(t *testing.T) {
			for _, n := range []int{0, 1, 2, 5, 10, 50, 200, 700, 1500, 2500} {
				sql := f.build(n)
				est := nestingEstimate(sql, maxNestingEstimate)
				if est > maxNestingEstimate {
					continue
				}
				b, err := parser.ParseToProtobuf(sql)
				if err != nil {
					continue // the parser's own stack limit ("memory exhausted")
				}
				d := protoDepth(b, md)
				if d < 0 || d > 2*est+16 {
					t.Errorf("n=%d: estimate %d, tree %d deep", n, est, d)
				}
			}
		})
	}
}

func TestNestingEstimateFlatLists(t *testing.T) {
	rows := make([]string, 5000)
	for i := range rows {
		rows[i] = fmt.Sprintf("(%d, 'row %d', $%d)", i, i, i+1)
	}
	terms := make([]string, 1000)
	for i := range terms {
		terms[i] = fmt.Sprintf("id = $%d", i+1)
	}
	arms := make([]string, 1000)
	for i := range arms {
		arms[i] = fmt.Sprintf("when id = %d then 'v%d'", i, i)
	}
	for _, tc := range []struct {
		name string
		sql  string
		max  int
	}{
		{"values", "insert into config (id, payload, n) values " + strings.Join(rows, ", "), 20},
		{"in", "update config set n = n + 1 where id in (" + strings.Repeat("$1, ", 999) + "$1000)", 20},
		{"or", "delete from config where " + strings.Join(terms, " or "), 20},
		{"and", "select 1 from config where " + strings.Join(terms, " and "), 20},
		{"case", "update config set payload = case " + strings.Join(arms, " ") + " else payload end", 20},
		{"strings", `select 'a(((' || e'\'(((' || $$((($$ || "((" || u&'(((' from config -- (((` + "\n/* ((( /* ((( */ */", 20},
		{"union-all", "select 1" + strings.Repeat(" union all select 2 from config where id = 1", 2000), 2020},
	} {
		if est := nestingEstimate(tc.sql, maxNestingEstimate); est > tc.max {
			t.Errorf("%s: estimate %d, want at most %d", tc.name, est, tc.max)
		}
	}
}

func TestProtoDepth(t *testing.T) {
	md := (&pg.ParseResult{}).ProtoReflect().Descriptor()
	b, err := parser.ParseToProtobuf("select 1")
	if err != nil {
		t.Fatal(err)
	}
	// ParseResult > RawStmt > Node > SelectStmt > Node > ResTarget > Node > A_Const > Integer
	if d := protoDepth(b, md); d != 9 {
		t.Errorf("depth %d", d)
	}
	if d := protoDepth([]byte{0xff}, md); d != -1 {
		t.Errorf("malformed: %d", d)
	}
}

func deepRules(t testing.TB, mode string) *Rules {
	t.Helper()
	r, err := Compile(Config{Tables: []Table{{Table: "public.config", Mode: mode}}})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestDeepStatements sends every nesting form 30,000 deep, which crashed
// the proxy (SIGSEGV in libpg_query) before the depth check, and 1,000
// deep, which crashed it on small thread stacks or in the deparser.
func TestDeepStatements(t *testing.T) {
	enforce, audit := deepRules(t, ""), deepRules(t, "audit")
	for _, f := range nestingForms {
		t.Run(f.name, func(t *testing.T) {
			for _, n := range []int{1000, 30000} {
				sql := f.build(n)
				if nestingEstimate(sql, maxNestingEstimate) <= maxNestingEstimate {
					if n == 30000 {
						t.Errorf("n=%d: not over the limit", n)
					}
					continue
				}
				d := enforce.Decide(sql)
				if d.Action != Refuse || d.Err.Code != CodeRefused || !strings.Contains(d.Err.Message, "nests too deeply") ||
					d.Err.Table != "public.config" || d.Err.Hint == "" {
					t.Fatalf("n=%d: got %v %+v", n, d.Action, d.Err)
				}
				// Audit mode never blocks: forwarded, the refusal recorded.
				if d := audit.Decide(sql); d.Action != Forward || d.AuditRefusal == nil || d.AuditRefusal.Code != CodeRefused {
					t.Fatalf("n=%d audit: got %v %+v", n, d.Action, d.AuditRefusal)
				}
				// An unprotected table: MayTouch is false, not parsed.
				other := strings.ReplaceAll(sql, "config", "cfg")
				if d := enforce.Decide(other); d.Action != Forward || d.AuditRefusal != nil {
					t.Fatalf("n=%d unprotected: got %v %+v", n, d.Action, d.Err)
				}
				// MayTouch fires on the schema name after "alter" only:
				// the statement names no protected table.
				if d := enforce.Decide(other + " -- alter public"); d.Action != Forward {
					t.Fatalf("n=%d schema only: got %v %+v", n, d.Action, d.Err)
				}
				// U& may spell any name: refused.
				if d := enforce.Decide(other + " -- u&"); d.Action != Refuse || d.Err.Code != CodeRefused {
					t.Fatalf("n=%d U&: got %v %+v", n, d.Action, d.Err)
				}
			}
		})
	}
}

// TestDeepRewriteIsSpliced: deep but allowed statements are rewritten.
func TestDeepRewriteIsSpliced(t *testing.T) {
	r := deepRules(t, "")
	// The client's statement is never printed by the deparser, so a chain
	// the deparser could not print safely is rewritten like any other, and
	// reaches the server as the client sent it.
	for _, n := range []int{600, 2000} {
		chain := "update config set n = 1" + strings.Repeat("+1", n)
		d := r.Decide(chain + " where id = 1")
		if d.Action != Rewrite || !strings.HasPrefix(d.SQL, chain) {
			t.Fatalf("%d terms: got %v %+v", n, d.Action, d.Err)
		}
	}
}

// TestLargeFlatStatementsRewritten: long lists are not deep.
func TestLargeFlatStatementsRewritten(t *testing.T) {
	r := deepRules(t, "")
	rows := make([]string, 5000)
	for i := range rows {
		rows[i] = fmt.Sprintf("(%d, %d)", i, i)
	}
	terms := make([]string, 1000)
	for i := range terms {
		terms[i] = fmt.Sprintf("id = %d", i)
	}
	arms := make([]string, 1000)
	for i := range arms {
		arms[i] = fmt.Sprintf("when %d then %d", i, i)
	}
	for name, sql := range map[string]string{
		"values":  "insert into config (id, n) values " + strings.Join(rows, ", "),
		"in":      "update config set n = n + 1 where id in (" + strings.Repeat("1, ", 999) + "1)",
		"or":      "delete from config where " + strings.Join(terms, " or "),
		"and":     "update config set n = 1 where " + strings.Join(terms, " and "),
		"case":    "update config set n = case id " + strings.Join(arms, " ") + " else n end where id > 0",
		"chain":   "update config set n = n" + strings.Repeat(" + 1", 300) + " where id = 1",
		"unions":  "insert into config (id, n) select 1, 1" + strings.Repeat(" union all select 1, 1", 300),
		"parens":  "update config set n = " + strings.Repeat("(", 100) + "1" + strings.Repeat(")", 100),
		"selects": "update config set n = " + strings.Repeat("(select ", 50) + "1" + strings.Repeat(")", 50),
	} {
		if d := r.Decide(sql); d.Action != Rewrite {
			t.Errorf("%s: got %v %+v", name, d.Action, d.Err)
		}
	}
}

// TestDecisionCacheSkipsHugeStatements: a statement too large to cache is
// neither stored nor looked up (hashing it under the cache's lock would
// hold up every other session).
func TestDecisionCacheSkipsHugeStatements(t *testing.T) {
	c := newDecisionCache(4)
	huge := strings.Repeat("x", maxCachedSQLLen+1)
	c.put(0, huge, Decision{Action: Refuse})
	if _, ok := c.get(0, huge); ok || c.len() != 0 {
		t.Fatal("huge statement cached")
	}
}

// FuzzDepth builds a deep statement from a nesting form, a depth and a
// tail, or takes the tail alone (form 255), and checks that Decide
// survives it, that the estimate bounds the parse tree wherever it lets
// the parser see the statement, and that a statement over the limit that
// names the protected table is refused. The seeds (testdata/fuzz/FuzzDepth)
// are small: the deep text is generated here. Run longer with
//
//	go test ./internal/rules -run '^$' -fuzz FuzzDepth -fuzztime 60s
func FuzzDepth(f *testing.F) {
	r := deepRules(f, "")
	md := (&pg.ParseResult{}).ProtoReflect().Descriptor()
	f.Fuzz(func(t *testing.T, form uint8, n uint16, tail string) {
		sql := tail
		if int(form) < len(nestingForms) {
			sql = nestingForms[form].build(int(n)) + tail
		}
		est := nestingEstimate(sql, maxNestingEstimate)
		d := r.Decide(sql)
		if est > maxNestingEstimate {
			if strings.Contains(sql, "config") && d.Action != Refuse {
				t.Fatalf("estimate %d over the limit, but %v", est, d.Action)
			}
			return
		}
		if b, err := parser.ParseToProtobuf(sql); err == nil {
			if depth := protoDepth(b, md); depth < 0 || depth > 2*est+16 {
				t.Fatalf("estimate %d, tree %d deep: %.200q", est, depth, sql)
			}
		}
	})
}
