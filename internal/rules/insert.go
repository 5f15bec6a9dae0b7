package rules

import (
	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// rewriteInsert stamps new rows with the token and fences the DO UPDATE
// branch of ON CONFLICT like an UPDATE (audit: records a stale row and
// keeps its watermark).
func (r *Rules) rewriteInsert(ins *pg.InsertStmt, t *tableRule, sp *splicer) *Error {
	f := r.fencer(t, ins.Relation, sp)
	rel := sp.relTok(ins.Relation)
	if sp.err != nil {
		return nil
	}
	switch {
	case ins.SelectStmt == nil:
		// DEFAULT VALUES
		key, stamp := f.rowStamp(true)
		ins.Cols = []*pg.Node{pg.MakeResTargetNodeWithName(t.column, -1)}
		ins.SelectStmt = &pg.Node{Node: &pg.Node_SelectStmt{SelectStmt: &pg.SelectStmt{
			ValuesLists: []*pg.Node{pg.MakeListNode([]*pg.Node{stamp})},
			LimitOption: pg.LimitOption_LIMIT_OPTION_DEFAULT,
			Op:          pg.SetOperation_SETOP_NONE,
		}}}
		d := sp.level(rel, sp.is(pg.Token_DEFAULT))
		if d+1 >= len(sp.toks) || sp.toks[d].tok != pg.Token_DEFAULT || sp.toks[d+1].tok != pg.Token_VALUES {
			sp.fail("DEFAULT VALUES not found")
			return nil
		}
		sp.replace(sp.toks[d].start, sp.toks[d+1].end, cat(lit("("+quoteCol(t.column)+") VALUES ("), sp.exprText(f.key(key), stamp), lit(")")))
	case len(ins.Cols) == 0:
		return refused(t, "fenceproxy: INSERT into protected table %s must list its columns explicitly",
			"fenceproxy adds the fence column to the column list and cannot look up the table's columns.",
			"Write INSERT INTO table (col1, col2, ...) VALUES (...).")
	default:
		sel := ins.SelectStmt.GetSelectStmt()
		if sel == nil {
			return refused(t, "fenceproxy: cannot rewrite an unexpected INSERT into protected table %s", "", "")
		}
		var idx []int
		for i, c := range ins.Cols {
			if c.GetResTarget().GetName() == t.column {
				idx = append(idx, i)
			}
		}
		if len(idx) == 0 {
			if err := sp.addStampColumn(sel, len(ins.Cols), f, t); err != nil {
				return err
			}
			first := sp.nodeTok(ins.Cols[0])
			if sp.err != nil {
				return nil
			}
			_, close := sp.groupItems(first - 1)
			if close < 0 {
				return nil
			}
			sp.insert(sp.endOf(close), lit(", "+quoteCol(t.column)))
			ins.Cols = append(ins.Cols, pg.MakeResTargetNodeWithName(t.column, -1))
		} else if err := sp.replaceStampColumn(sel, len(ins.Cols), idx, f, t); err != nil {
			return err
		}
	}

	oc := ins.OnConflictClause
	if oc == nil || oc.Action != pg.OnConflictAction_ONCONFLICT_UPDATE {
		return nil
	}
	// The proposed row's stamp has already checked (or recorded) the
	// token: it is computed for every proposed row, conflicting or not.
	var key string
	var val func() *pg.Node
	var conds []*pg.Node
	switch {
	case t.audit:
		key, val = "audit-set", func() *pg.Node { return f.auditSetValue(false) }
	case t.skip:
		// A false DO UPDATE condition leaves the existing row alone and
		// inserts nothing: the skip outcome.
		conds = []*pg.Node{f.skipCond()}
		key, val = "skip-set", func() *pg.Node { return f.skipSetValue(false) }
	default:
		key, val = "error-set", func() *pg.Node { return f.errorSetValue(false) }
	}
	on := sp.tokAt(int(oc.Location))
	if on < 0 {
		sp.fail("ON CONFLICT not found")
		return nil
	}
	set := sp.level(on, sp.is(pg.Token_SET))
	items, end := sp.setList(set, pg.Token_WHERE, pg.Token_RETURNING)
	if sp.err != nil {
		return nil
	}
	tl, err := sp.assignFence(oc.TargetList, items, t, f.key(key), val)
	if err != nil {
		return err
	}
	oc.TargetList = tl
	if len(conds) > 0 {
		w := sp.findWhere(end, pg.Token_RETURNING)
		oc.WhereClause = and(append([]*pg.Node{oc.WhereClause}, conds...)...)
		sp.addConds(w, f.condTexts(sp, conds)...)
	}
	return nil
}

// valuesRow is a row of a VALUES list in the client's text.
type valuesRow struct {
	items [][2]int
	close int // the row's ")"
}

// valuesRows finds the rows of sel's VALUES list in the text.
func (s *splicer) valuesRows(sel *pg.SelectStmt) []valuesRow {
	first := sel.ValuesLists[0].GetList()
	if first == nil || len(first.Items) == 0 {
		s.fail("empty VALUES row")
		return nil
	}
	i := s.nodeTok(first.Items[0])
	if i < 0 {
		return nil
	}
	for i--; i > 0 && s.toks[i].tok == pg.Token_ASCII_40; i-- {
	}
	if i < 0 || s.toks[i].tok != pg.Token_VALUES {
		s.fail("VALUES not found")
		return nil
	}
	rows := make([]valuesRow, 0, len(sel.ValuesLists))
	j := i + 1
	for k := range sel.ValuesLists {
		if k > 0 {
			if j >= len(s.toks) || s.toks[j].tok != pg.Token_ASCII_44 {
				s.fail("VALUES rows not found")
				return nil
			}
			j++
		}
		items, close := s.groupItems(j)
		if close < 0 {
			return nil
		}
		rows = append(rows, valuesRow{items: items, close: close})
		j = close + 1
	}
	return rows
}

// selectListEnd returns the token that ends the SELECT list whose last
// item is last.
func (s *splicer) selectListEnd(last *pg.Node) int {
	i := s.nodeTok(last)
	if i < 0 {
		return -1
	}
	return s.level(i, s.is(pg.Token_ASCII_44, pg.Token_FROM, pg.Token_INTO, pg.Token_WHERE, pg.Token_GROUP_P, pg.Token_HAVING,
		pg.Token_WINDOW, pg.Token_ORDER, pg.Token_LIMIT, pg.Token_OFFSET, pg.Token_FETCH, pg.Token_FOR, pg.Token_UNION,
		pg.Token_INTERSECT, pg.Token_EXCEPT, pg.Token_ON, pg.Token_RETURNING))
}

// addStampColumn appends the stamp to every row a query produces: to each
// VALUES row, to the target list of a SELECT, and to each branch of a set
// operation (the stamp is the same for every row, so UNION, INTERSECT and
// EXCEPT still combine the same rows). In a VALUES list only the first
// row's stamp checks (or records) an invalid token (see fencer.rowStamp):
// the rows are computed in order, so it is computed first.
//
// ncols is the number of columns the client listed. A row or SELECT list of
// another length is refused: PostgreSQL would reject the statement anyway,
// and the stamp must line up with the fence column.
func (s *splicer) addStampColumn(sel *pg.SelectStmt, ncols int, f *fencer, t *tableRule) *Error {
	if sel == nil {
		return refused(t, "fenceproxy: cannot rewrite an unexpected INSERT into protected table %s", "", "")
	}
	if sel.Op != pg.SetOperation_SETOP_NONE && sel.Op != pg.SetOperation_SET_OPERATION_UNDEFINED {
		if err := s.addStampColumn(sel.Larg, ncols, f, t); err != nil {
			return err
		}
		return s.addStampColumn(sel.Rarg, ncols, f, t)
	}
	if len(sel.ValuesLists) > 0 {
		if !rowsHaveLength(sel, ncols) {
			return wrongLength(t)
		}
		rows := s.valuesRows(sel)
		if s.err != nil {
			return nil
		}
		for i, row := range sel.ValuesLists {
			l := row.GetList()
			first := i == 0
			key := f.rowStampKey(first)
			stamp, text := s.leaf(f.key(key), func() *pg.Node { _, n := f.rowStamp(first); return n })
			l.Items = append(l.Items, stamp)
			s.insert(s.endOf(rows[i].close), cat(lit(", "), text))
		}
		return nil
	}
	if !hasStar(sel.TargetList) && len(sel.TargetList) != ncols {
		return wrongLength(t)
	}
	if len(sel.TargetList) == 0 {
		return wrongLength(t)
	}
	key, stamp := f.rowStamp(true)
	if table := s.tableCommand(sel); table >= 0 {
		// TABLE x is SELECT * FROM x, spelled without a list to append to.
		text := s.exprText(f.key(key), stamp)
		sel.TargetList = append(sel.TargetList, pg.MakeResTargetNodeWithVal(stamp, -1))
		s.replace(s.toks[table].start, s.toks[table].end, cat(lit("SELECT *, "), text, lit(" FROM")))
		return nil
	}
	end := s.selectListEnd(sel.TargetList[len(sel.TargetList)-1])
	if s.err != nil {
		return nil
	}
	text := s.exprText(f.key(key), stamp)
	sel.TargetList = append(sel.TargetList, pg.MakeResTargetNodeWithVal(stamp, -1))
	s.insert(s.endOf(end), cat(lit(", "), text))
	return nil
}

// tableCommand returns the token of the TABLE keyword when sel was written
// as TABLE x (a star with no source position, selecting from one
// relation), or -1.
func (s *splicer) tableCommand(sel *pg.SelectStmt) int {
	if len(sel.TargetList) != 1 || len(sel.FromClause) != 1 || sel.FromClause[0].GetRangeVar() == nil {
		return -1
	}
	rt := sel.TargetList[0].GetResTarget()
	cr := rt.GetVal().GetColumnRef()
	if cr == nil || len(cr.Fields) != 1 || cr.Fields[0].GetAStar() == nil || cr.Location >= 0 || rt.Location >= 0 {
		return -1
	}
	i := s.tokAt(int(sel.FromClause[0].GetRangeVar().Location))
	for i--; i >= 0 && s.toks[i].tok == pg.Token_ONLY; i-- {
	}
	if i < 0 || s.toks[i].tok != pg.Token_TABLE {
		return -1
	}
	return i
}

// rowsHaveLength reports whether every VALUES row of sel has n items.
func rowsHaveLength(sel *pg.SelectStmt, n int) bool {
	for _, row := range sel.ValuesLists {
		if l := row.GetList(); l == nil || len(l.Items) != n {
			return false
		}
	}
	return true
}

func wrongLength(t *tableRule) *Error {
	return refused(t, "fenceproxy: INSERT into protected table %s has a different number of values than columns", "", "")
}

// hasStar reports whether a SELECT list contains "*" (or "x.*"), which
// expands to a number of columns only the server knows.
func hasStar(tl []*pg.Node) bool {
	for _, n := range tl {
		if hasNode(n, isStar) {
			return true
		}
	}
	return false
}

// keepValue returns the fence value for a slot where the client gave its
// own value: the client's expression stays, in a branch never taken, so
// its parameters keep their place and type (DEFAULT is replaced):
//
//	CASE WHEN false THEN (client's value) ELSE val END
//
// mkVal builds val (fragment key) afresh for each call.
func (s *splicer) keepValue(key string, mkVal func() *pg.Node, client *pg.Node, text string) (*pg.Node, txt) {
	if client.GetSetToDefault() != nil {
		val := mkVal()
		return val, s.exprText(key, val)
	}
	return s.withHoles(key+"|keep", func(h []*pg.Node) *pg.Node {
		return caseExpr([]*pg.Node{aBool(false), h[0]}, mkVal())
	}, []*pg.Node{client}, []string{text})
}

// replaceStampColumn overrides the client's values for the fence column,
// which the client listed at positions idx.
func (s *splicer) replaceStampColumn(sel *pg.SelectStmt, ncols int, idx []int, f *fencer, t *tableRule) *Error {
	if len(sel.ValuesLists) > 0 && (sel.Op == pg.SetOperation_SETOP_NONE || sel.Op == pg.SetOperation_SET_OPERATION_UNDEFINED) {
		if !rowsHaveLength(sel, ncols) {
			return wrongLength(t)
		}
		rows := s.valuesRows(sel)
		if s.err != nil {
			return nil
		}
		for r, row := range sel.ValuesLists {
			l := row.GetList()
			first := r == 0
			key, _ := f.rowStamp(first)
			mk := func() *pg.Node { _, n := f.rowStamp(first); return n }
			if len(rows[r].items) != ncols {
				s.fail("VALUES row has %d items in the text", len(rows[r].items))
				return nil
			}
			for _, i := range idx {
				it := rows[r].items[i]
				node, text := s.keepValue(f.key(key), mk, l.Items[i], s.text(it[0], it[1]))
				l.Items[i] = node
				s.replace(s.toks[it[0]].start, s.endOf(it[1]), text)
			}
		}
		return nil
	}
	cannot := refused(t, "fenceproxy: INSERT ... SELECT into protected table %s cannot override the fence column in this query",
		"fenceproxy sets the fence column itself; it can replace the column's value only in VALUES or in a plain SELECT list of simple expressions.",
		"Leave the fence column out of the column list.")
	if sel.Op != pg.SetOperation_SETOP_NONE || len(sel.DistinctClause) > 0 || len(sel.GroupClause) > 0 || sel.HavingClause != nil ||
		len(sel.SortClause) > 0 || len(sel.WindowClause) > 0 || len(sel.ValuesLists) > 0 {
		return cannot
	}
	// "*" hides how many columns come before the fence column.
	if hasStar(sel.TargetList) || len(sel.TargetList) != ncols {
		return cannot
	}
	key, _ := f.rowStamp(true)
	mk := func() *pg.Node { _, n := f.rowStamp(true); return n }
	for _, i := range idx {
		if i >= len(sel.TargetList) {
			return cannot
		}
		rt := sel.TargetList[i].GetResTarget()
		// A function call there may be an aggregate or return a set:
		// replacing it would change the rows produced.
		if rt == nil || hasNode(rt.Val, isCallOrSubLink) {
			return cannot
		}
		a := s.nodeTok(rt)
		if s.err != nil {
			return nil
		}
		b := s.level(a, s.is(pg.Token_AS, pg.Token_ASCII_44, pg.Token_FROM, pg.Token_INTO, pg.Token_WHERE, pg.Token_GROUP_P,
			pg.Token_HAVING, pg.Token_WINDOW, pg.Token_ORDER, pg.Token_LIMIT, pg.Token_OFFSET, pg.Token_FETCH, pg.Token_FOR,
			pg.Token_UNION, pg.Token_INTERSECT, pg.Token_EXCEPT, pg.Token_ON, pg.Token_RETURNING))
		node, text := s.keepValue(f.key(key), mk, rt.Val, s.text(a, b))
		rt.Val = node
		s.replace(s.toks[a].start, s.endOf(b), text)
	}
	return nil
}

func isStar(m protoreflect.ProtoMessage) bool {
	_, ok := m.(*pg.A_Star)
	return ok
}

func isCallOrSubLink(m protoreflect.ProtoMessage) bool {
	switch m.(type) {
	case *pg.FuncCall, *pg.SubLink:
		return true
	}
	return false
}

// hasNode reports whether any message under n satisfies pred.
func hasNode(n *pg.Node, pred func(protoreflect.ProtoMessage) bool) bool {
	if n == nil {
		return false
	}
	found := false
	walkMessages(n.ProtoReflect(), func(m protoreflect.Message) bool {
		if found {
			return false
		}
		if pred(m.Interface()) {
			found = true
		}
		return !found
	})
	return found
}
