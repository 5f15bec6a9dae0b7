package rules

import (
	"fmt"
	"strings"

	pg "github.com/pganalyze/pg_query_go/v6"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// This file finds, in the client's text, the places where the fence
// fragments of each statement kind go. Every finding is checked in the end
// by verify, so a wrong guess refuses the statement instead of sending it.

// quoteCol always quotes a column name: a fragment must not depend on which
// words are keywords.
func quoteCol(s string) string { return sqllex.QuoteIdent(s) }

// exprText returns the text of node, a fragment, parenthesised, and turns
// node itself into the fragment's placeholder (see verify), so the tree the
// rewriter builds around it is what the checked text must parse into. The
// text is cached under key, so the same key must always build the same
// expression.
func (s *splicer) exprText(key string, node *pg.Node) txt {
	// fragment only prints and checks the node (nothing keeps it), and the
	// node is turned into the placeholder just below: no copy is needed.
	f := s.fragment(key, 0, func([]*pg.Node) *pg.Node { return node })
	name := s.placeholderName(f.id)
	node.Node = &pg.Node_ColumnRef{ColumnRef: &pg.ColumnRef{Fields: []*pg.Node{pg.MakeStrNode(name)}, Location: -1}}
	return f.texts("(" + name + ")")
}

// leaf is exprText for a fragment built by build only when its text is not
// cached yet: it returns the placeholder node for the tree.
func (s *splicer) leaf(key string, build func() *pg.Node) (*pg.Node, txt) {
	if f, ok := s.frags[key]; ok {
		name := s.placeholderName(f.id)
		return pg.MakeColumnRefNode([]*pg.Node{pg.MakeStrNode(name)}, -1), f.texts("(" + name + ")")
	}
	n := build()
	return n, s.exprText(key, n)
}

// withHoles returns the placeholder node of the fragment build makes with
// the client's expressions clients in its holes, and its text with the
// client's texts there. The placeholder is a call of the placeholder's name
// with the client's expressions as arguments.
func (s *splicer) withHoles(key string, build func(h []*pg.Node) *pg.Node, clients []*pg.Node, texts []string) (*pg.Node, txt) {
	f := s.fragment(key, len(clients), build)
	name := s.placeholderName(f.id)
	var b strings.Builder
	b.WriteString("(" + name + "(")
	for i, t := range texts {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("(" + t + ")")
	}
	b.WriteString("))")
	return pg.MakeFuncCallNode([]*pg.Node{pg.MakeStrNode(name)}, clients, -1), f.texts(b.String(), texts...)
}

// relTok returns the token of a statement's target relation.
func (s *splicer) relTok(rv *pg.RangeVar) int {
	if rv == nil {
		s.fail("statement without a target")
		return -1
	}
	return s.nodeTok(rv)
}

// setList splits a SET list starting after token set into its items (token
// ranges), ending at a token for which stop reports true or at the end of
// the statement. It returns the items and the index of the token that ends
// the list.
func (s *splicer) setList(set int, stop ...pg.Token) ([][2]int, int) {
	if set < 0 || set >= len(s.toks) || s.toks[set].tok != pg.Token_SET {
		s.fail("SET list not found")
		return nil, -1
	}
	terms := s.is(stop...)
	comma := s.is(pg.Token_ASCII_44)
	var items [][2]int
	a := set + 1
	for {
		j := s.level(a, func(j int) bool { return comma(j) || terms(j) })
		if a >= j {
			s.fail("empty SET item")
			return nil, -1
		}
		items = append(items, [2]int{a, j})
		if j >= len(s.toks) || s.toks[j].tok != pg.Token_ASCII_44 {
			return items, j
		}
		a = j + 1
	}
}

// assignFence makes the SET list tl (whose text items are items) assign
// the fence column val, whose text is valText. The client's own assignments
// to the fence column stay, in a branch that is never taken, so every
// parameter keeps its place and type:
//
//	F = CASE WHEN false THEN (client's value) ELSE val END
//
// (an assignment of DEFAULT is replaced). Without such an assignment,
// "F = val" is appended. A multi-column assignment from a sub-SELECT that
// includes the fence column is refused: its value cannot be set apart.
func (s *splicer) assignFence(tl []*pg.Node, items [][2]int, t *tableRule, valKey string, mkVal func() *pg.Node) ([]*pg.Node, *Error) {
	keep := func(client *pg.Node, text string) (*pg.Node, txt) {
		return s.keepValue(valKey, mkVal, client, text)
	}
	found := false
	item := 0
	for i := 0; i < len(tl); i++ {
		rt := tl[i].GetResTarget()
		if rt == nil || item >= len(items) {
			return nil, refused(t, "fenceproxy: cannot rewrite an unexpected SET list on protected table %s", "", "")
		}
		a, b := items[item][0], items[item][1]
		item++
		eq := s.level(a, s.is(pg.Token_ASCII_61))
		if eq >= b {
			s.fail("no = in a SET item")
			return tl, nil
		}
		ma := rt.Val.GetMultiAssignRef()
		if ma == nil {
			if rt.Name != t.column {
				continue
			}
			found = true
			node, text := keep(rt.Val, s.text(eq+1, b))
			rt.Val = node
			s.replace(s.toks[eq+1].start, s.toks[b-1].end, text)
			continue
		}
		n := int(ma.Ncolumns)
		if ma.Colno != 1 || n < 1 || i+n > len(tl) {
			return nil, refused(t, "fenceproxy: cannot rewrite an unexpected multi-column SET on protected table %s", "", "")
		}
		group := tl[i : i+n]
		i += n - 1
		at := -1
		for j, g := range group {
			if g.GetResTarget().GetName() == t.column {
				at = j
			}
		}
		if at < 0 {
			continue
		}
		found = true
		row := ma.Source.GetRowExpr()
		if row == nil || len(row.Args) != n {
			return nil, refused(t, "fenceproxy: the fence column of protected table %s cannot be assigned in a multi-column SET from a sub-SELECT",
				"fenceproxy sets the fence column itself and cannot take it out of a sub-SELECT.",
				"Leave the fence column out of the SET list.")
		}
		open := eq + 1
		if s.toks[open].tok == pg.Token_ROW {
			open++
		}
		vals, _ := s.groupItems(open)
		if len(vals) != n {
			s.fail("row constructor has %d items, not %d", len(vals), n)
			return tl, nil
		}
		node, text := keep(row.Args[at], s.text(vals[at][0], vals[at][1]))
		s.replace(s.toks[vals[at][0]].start, s.toks[vals[at][1]-1].end, text)
		for _, g := range group {
			if r := g.GetResTarget().GetVal().GetMultiAssignRef().GetSource().GetRowExpr(); r != nil && len(r.Args) == n {
				r.Args[at] = node
			}
		}
	}
	if item != len(items) {
		s.fail("SET list has %d items in the text, %d in the tree", len(items), item)
	}
	if !found {
		val := mkVal()
		text := s.exprText(valKey, val)
		tl = append(tl, setTarget(t.column, val))
		if len(items) > 0 {
			s.insert(s.endOf(items[len(items)-1][1]), cat(lit(", "+quoteCol(t.column)+" = "), text))
		}
	}
	return tl, nil
}

// whereClause is where a statement's WHERE clause is, or would go.
type whereClause struct {
	from, to int // tokens of the condition (from == to: none)
	at       int // byte offset to insert " WHERE ..." when there is none
}

// findWhere looks for the WHERE clause of the statement level starting at
// token i, which ends before one of the tokens end.
func (s *splicer) findWhere(i int, end ...pg.Token) whereClause {
	stop := append([]pg.Token{pg.Token_WHERE}, end...)
	j := s.level(i, s.is(stop...))
	if j < len(s.toks) && s.toks[j].tok == pg.Token_WHERE {
		k := s.level(j+1, s.is(end...))
		return whereClause{from: j + 1, to: k}
	}
	return whereClause{at: s.endOf(j)}
}

// addConds ANDs conds (with their texts) to the condition w holds, as
// "(W) AND c1 AND c2", or adds "WHERE c1 AND c2".
//
// In the token form, conditions that folded to true (the token's checks)
// are left out, and so is the WHERE when nothing is left.
func (s *splicer) addConds(w whereClause, texts ...txt) {
	if len(texts) == 0 {
		return
	}
	tail := texts[0]
	for _, t := range texts[1:] {
		tail = cat(tail, lit(" AND "), t)
	}
	var kept []string
	for _, t := range texts {
		if t.tok != litTrueText {
			kept = append(kept, t.tok)
		}
	}
	tok := strings.Join(kept, " AND ")
	if w.from < w.to {
		s.insert(s.toks[w.from].start, lit("("))
		and := cat(lit(") AND "), tail)
		and.tok = ")"
		if tok != "" {
			and.tok += " AND " + tok
		}
		s.insert(s.endOf(w.to), and)
		return
	}
	where := cat(lit(" WHERE "), tail)
	where.tok = ""
	if tok != "" {
		where.tok = " WHERE " + tok
	}
	s.insert(w.at, where)
}

// litTrueText is the text of a fragment that folded to true in the token
// form.
const litTrueText = "(true)"

// key builds a fragment cache key for fencer f.
func (f *fencer) key(kind string) string {
	return fmt.Sprintf("%p|%s|%s", f.t, f.qual, kind)
}
