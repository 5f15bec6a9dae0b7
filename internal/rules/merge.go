package rules

import (
	pg "github.com/pganalyze/pg_query_go/v6"
)

// rewriteMerge fences a MERGE into a protected table.
//
// on_stale: error: every UPDATE action assigns the fence column with a
// self-contained check (MERGE has no WHERE clause to carry the guard):
//
//	CASE WHEN NOT V THEN RAISE(token) WHEN FRESH THEN TOK ELSE RAISE(stale) END
//
// and every DELETE action is preceded by a clause with the same match kind
// and condition that catches stale rows and raises:
//
//	WHEN MATCHED AND (cond) AND CASE WHEN V THEN FRESH IS NOT TRUE ELSE true END
//	  THEN UPDATE SET F = CASE WHEN V THEN RAISE(stale) ELSE RAISE(token) END
//
// on_stale: skip: a first clause per match kind on target rows makes stale
// rows do nothing, so no later action (fenced or not) can touch them:
//
//	WHEN MATCHED AND CASE WHEN V THEN FRESH IS NOT TRUE ELSE RAISE(token) END THEN DO NOTHING
//
// and UPDATE actions set F = TOK. INSERT actions are stamped in both modes.
//
// With missing_token: allow, a DELETE action's condition also records an
// invalid token: CASE WHEN (cond) THEN CASE WHEN V THEN true ELSE
// NOTIFY(missing_token, true) END ELSE false END.
//
// audit: UPDATE actions assign auditSetValue(true); a DELETE action's
// condition becomes CASE WHEN (cond) THEN <auditCheck> ELSE false END, which
// records a stale row or an invalid token and never changes which action
// runs (cond is evaluated once, and nothing is recorded for a row the
// action does not take).
func (r *Rules) rewriteMerge(m *pg.MergeStmt, t *tableRule, sp *splicer) *Error {
	f := r.fencer(t, m.Relation, sp)
	clauses := sp.mergeClauses(m)
	if sp.err != nil {
		return nil
	}
	var out []*pg.Node
	needGuard := map[pg.MergeMatchKind]bool{}
	for k, n := range m.MergeWhenClauses {
		c := n.GetMergeWhenClause()
		if c == nil {
			return refused(t, "fenceproxy: cannot rewrite an unexpected MERGE into protected table %s", "", "")
		}
		mc := clauses[k]
		switch c.CommandType {
		case pg.CmdType_CMD_UPDATE:
			var key string
			var val func() *pg.Node
			switch {
			case t.audit:
				key, val = "audit-set-v", func() *pg.Node { return f.auditSetValue(true) }
			case t.skip:
				needGuard[c.MatchKind] = true
				key, val = "skip-set-v", func() *pg.Node { return f.skipSetValue(true) }
			default:
				key, val = "error-set-v", func() *pg.Node { return f.errorSetValue(true) }
			}
			set := mc.then + 2
			if set >= len(sp.toks) || sp.toks[mc.then+1].tok != pg.Token_UPDATE {
				sp.fail("MERGE UPDATE not found")
				return nil
			}
			items, _ := sp.setList(set, pg.Token_WHEN, pg.Token_RETURNING)
			if sp.err != nil {
				return nil
			}
			tl, err := sp.assignFence(c.TargetList, items, t, f.key(key), val)
			if err != nil {
				return err
			}
			c.TargetList = tl
		case pg.CmdType_CMD_DELETE:
			if t.audit {
				sp.onlyIf(c, mc, f.key("audit-check"), f.auditCheck())
				break
			}
			if t.skip {
				needGuard[c.MatchKind] = true
			} else {
				invalid, raise := aBool(true), caseExpr([]*pg.Node{f.valid(), f.raiseStale("int8")}, f.raiseToken("int8"))
				rkey := "raise-both"
				if t.allow {
					invalid, raise, rkey = aBool(false), f.raiseStale("int8"), "raise-stale"
				}
				nf := f.notFresh(invalid)
				nfText := sp.exprText(f.key("not-fresh|"+rkey), nf)
				condText := nfText
				if c.Condition != nil {
					condText = cat(lit("("+sp.text(mc.and+1, mc.then)+") AND "), nfText)
				}
				raiseText := sp.exprText(f.key(rkey), raise)
				sp.insert(sp.toks[mc.when].start, cat(lit("WHEN "+sp.text(mc.when+1, mc.head)+" AND "), condText,
					lit(" THEN UPDATE SET "+quoteCol(t.column)+" = "), raiseText, lit(" ")))
				out = append(out, &pg.Node{Node: &pg.Node_MergeWhenClause{MergeWhenClause: &pg.MergeWhenClause{
					MatchKind:   c.MatchKind,
					CommandType: pg.CmdType_CMD_UPDATE,
					Override:    pg.OverridingKind_OVERRIDING_NOT_SET,
					Condition:   and(cloneNode(c.Condition), nf),
					TargetList:  []*pg.Node{setTarget(t.column, raise)},
				}}})
			}
			if t.allow {
				// Record the invalid token of a row the action deletes.
				sp.onlyIf(c, mc, f.key("guard"), f.tokenGuard())
			}
		case pg.CmdType_CMD_INSERT:
			if err := sp.stampMergeInsert(c, mc, f, t); err != nil {
				return err
			}
		case pg.CmdType_CMD_NOTHING:
		default:
			return refused(t, "fenceproxy: cannot rewrite an unexpected MERGE action on protected table %s", "", "")
		}
		out = append(out, n)
	}
	if t.skip {
		invalid := f.raiseToken("bool")
		ikey := "raise-token"
		if t.allow {
			invalid, ikey = aBool(false), "false"
		}
		var guards []*pg.Node
		var text txt
		for _, k := range []pg.MergeMatchKind{pg.MergeMatchKind_MERGE_WHEN_MATCHED, pg.MergeMatchKind_MERGE_WHEN_NOT_MATCHED_BY_SOURCE} {
			if needGuard[k] {
				cond := f.notFresh(cloneNode(invalid))
				condText := sp.exprText(f.key("not-fresh|"+ikey), cond)
				guards = append(guards, &pg.Node{Node: &pg.Node_MergeWhenClause{MergeWhenClause: &pg.MergeWhenClause{
					MatchKind:   k,
					CommandType: pg.CmdType_CMD_NOTHING,
					Override:    pg.OverridingKind_OVERRIDING_NOT_SET,
					Condition:   cond,
				}}})
				kind := "MATCHED"
				if k == pg.MergeMatchKind_MERGE_WHEN_NOT_MATCHED_BY_SOURCE {
					kind = "NOT MATCHED BY SOURCE"
				}
				text = cat(text, lit("WHEN "+kind+" AND "), condText, lit(" THEN DO NOTHING "))
			}
		}
		if text.real != "" {
			sp.insert(sp.toks[clauses[0].when].start, text)
		}
		out = append(guards, out...)
	}
	m.MergeWhenClauses = out
	return nil
}

// mergeClause is a WHEN clause of a MERGE in the client's text, as token
// indices: WHEN, the end of its match kind (AND or THEN), the AND before
// its condition (or -1), THEN, and the token that ends the clause.
type mergeClause struct{ when, head, and, then, end int }

func (s *splicer) mergeClauses(m *pg.MergeStmt) []mergeClause {
	rel := s.relTok(m.Relation)
	if rel < 0 {
		return nil
	}
	out := make([]mergeClause, 0, len(m.MergeWhenClauses))
	j := s.level(rel, s.is(pg.Token_WHEN))
	for j < len(s.toks) && s.toks[j].tok == pg.Token_WHEN {
		c := mergeClause{when: j, and: -1}
		c.then = s.level(j+1, s.is(pg.Token_THEN))
		c.head = c.then
		if a := s.level(j+1, s.is(pg.Token_AND, pg.Token_THEN)); a < c.then {
			c.and, c.head = a, a
		}
		c.end = s.level(c.then+1, s.is(pg.Token_WHEN, pg.Token_RETURNING))
		out = append(out, c)
		j = c.end
	}
	if len(out) != len(m.MergeWhenClauses) {
		s.fail("MERGE has %d WHEN clauses in the text, %d in the tree", len(out), len(m.MergeWhenClauses))
		return nil
	}
	for i, n := range m.MergeWhenClauses {
		if c := n.GetMergeWhenClause(); c != nil && (c.Condition != nil) != (out[i].and >= 0) {
			s.fail("MERGE clause condition not found")
			return nil
		}
	}
	return out
}

// onlyIf makes clause c's condition onlyIf(cond, check), in the tree and
// in the text.
func (s *splicer) onlyIf(c *pg.MergeWhenClause, mc mergeClause, key string, check *pg.Node) {
	if c.Condition == nil {
		text := s.exprText(key, check)
		c.Condition = check
		s.insert(s.endOf(mc.then), cat(lit(" AND "), text))
		return
	}
	node, text := s.withHoles(key+"|if", func(h []*pg.Node) *pg.Node { return onlyIf(h[0], check) },
		[]*pg.Node{c.Condition}, []string{s.text(mc.and+1, mc.then)})
	c.Condition = node
	s.replace(s.toks[mc.and+1].start, s.endOf(mc.then), text)
}

// onlyIf returns check when cond is nil, and otherwise
// CASE WHEN (cond) THEN check ELSE false END: true when both are, with check
// evaluated only when cond is true.
func onlyIf(cond, check *pg.Node) *pg.Node {
	if cond == nil {
		return check
	}
	return caseExpr([]*pg.Node{cond, check}, aBool(false))
}

func (s *splicer) stampMergeInsert(c *pg.MergeWhenClause, mc mergeClause, f *fencer, t *tableRule) *Error {
	key, stamp := f.rowStamp(true)
	key = f.key(key)
	mk := func() *pg.Node { _, n := f.rowStamp(true); return n }
	ins := mc.then + 1
	if ins >= len(s.toks) || s.toks[ins].tok != pg.Token_INSERT {
		s.fail("MERGE INSERT not found")
		return nil
	}
	switch {
	case len(c.TargetList) == 0 && len(c.Values) == 0:
		// INSERT DEFAULT VALUES
		text := s.exprText(key, stamp)
		c.TargetList = []*pg.Node{pg.MakeResTargetNodeWithName(t.column, -1)}
		c.Values = []*pg.Node{stamp}
		d := s.level(ins+1, s.is(pg.Token_DEFAULT))
		if d+1 >= len(s.toks) || s.toks[d].tok != pg.Token_DEFAULT || s.toks[d+1].tok != pg.Token_VALUES {
			s.fail("DEFAULT VALUES not found")
			return nil
		}
		s.replace(s.toks[d].start, s.toks[d+1].end, cat(lit("("+quoteCol(t.column)+") VALUES ("), text, lit(")")))
		return nil
	case len(c.TargetList) == 0:
		return refused(t, "fenceproxy: MERGE ... INSERT into protected table %s must list its columns explicitly",
			"fenceproxy adds the fence column to the column list and cannot look up the table's columns.",
			"Write WHEN NOT MATCHED THEN INSERT (col1, col2, ...) VALUES (...).")
	case len(c.TargetList) != len(c.Values):
		return refused(t, "fenceproxy: MERGE ... INSERT into protected table %s has a different number of columns and values", "", "")
	}
	_, colsClose := s.groupItems(ins + 1)
	if colsClose < 0 {
		return nil
	}
	v := s.level(colsClose+1, s.is(pg.Token_VALUES))
	if v >= len(s.toks) || s.toks[v].tok != pg.Token_VALUES {
		s.fail("MERGE INSERT VALUES not found")
		return nil
	}
	vals, valsClose := s.groupItems(v + 1)
	if valsClose < 0 {
		return nil
	}
	if len(vals) != len(c.Values) {
		s.fail("MERGE INSERT has %d values in the text", len(vals))
		return nil
	}
	found := false
	for i, col := range c.TargetList {
		if col.GetResTarget().GetName() == t.column {
			node, text := s.keepValue(key, mk, c.Values[i], s.text(vals[i][0], vals[i][1]))
			c.Values[i] = node
			s.replace(s.toks[vals[i][0]].start, s.endOf(vals[i][1]), text)
			found = true
		}
	}
	if !found {
		text := s.exprText(key, stamp)
		c.TargetList = append(c.TargetList, pg.MakeResTargetNodeWithName(t.column, -1))
		c.Values = append(c.Values, stamp)
		s.insert(s.endOf(colsClose), lit(", "+quoteCol(t.column)))
		s.insert(s.endOf(valsClose), cat(lit(", "), text))
	}
	return nil
}
