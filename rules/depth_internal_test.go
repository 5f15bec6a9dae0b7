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
		{"union", stmt("select 1", " union select 1", "")},
		{"union-all", stmt("select 1", " union all select 1", "")},
		{"intersect", stmt("select 1", " intersect select 1", "")},
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
