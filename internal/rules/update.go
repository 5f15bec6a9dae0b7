package rules

import (
	pg "github.com/pganalyze/pg_query_go/v6"
)

// rewriteUpdate fences an UPDATE of a protected table.
//
// on_stale: error (the SET-list form): the fence column is assigned
//
//	CASE WHEN FRESH THEN TOK ELSE RAISE(stale) END
//
// The SET list is computed only for rows that passed the client's WHERE, so
// other rows never raise whatever order the quals run in, and under
// concurrency EvalPlanQual recomputes it on the newest row version. The
// pseudo-constant token guard is AND-ed to the WHERE clause, so an invalid
// token fails the statement (or, with missing_token: allow, is recorded)
// even if no row matches.
//
// on_stale: skip: WHERE ... AND F CMP TOK? and SET F = TOK.
//
// audit: like on_stale: error, with a recording guard, and a stale row
// recorded and left with its watermark instead of raising.
func (r *Rules) rewriteUpdate(u *pg.UpdateStmt, t *tableRule, sp *splicer) *Error {
	f := r.fencer(t, u.Relation, sp)
	currentOf := isCurrentOf(u.WhereClause)
	var val func() *pg.Node
	var key string
	var conds []*pg.Node
	switch {
	case t.audit && currentOf:
		// No other condition can be AND-ed to WHERE CURRENT OF: the SET
		// value records an invalid token itself.
		key, val = "audit-set-v", func() *pg.Node { return f.auditSetValue(true) }
	case t.audit:
		conds = []*pg.Node{f.tokenGuard()}
		key, val = "audit-set", func() *pg.Node { return f.auditSetValue(false) }
	case t.skip && currentOf:
		return refused(t, "fenceproxy: UPDATE ... WHERE CURRENT OF on protected table %s with on_stale: skip is not supported",
			"WHERE CURRENT OF cannot be combined with the fence condition that skips stale rows.",
			"Update the row by its key instead of through the cursor.")
	case t.skip:
		conds = []*pg.Node{f.tokenGuard(), f.skipCond()}
		key, val = "skip-set", func() *pg.Node { return f.skipSetValue(false) }
	case currentOf:
		// No other condition can be AND-ed to WHERE CURRENT OF: the SET
		// value checks the token itself.
		key, val = "error-set-v", func() *pg.Node { return f.errorSetValue(true) }
	default:
		conds = []*pg.Node{f.tokenGuard()}
		key, val = "error-set", func() *pg.Node { return f.errorSetValue(false) }
	}
	rel := sp.relTok(u.Relation)
	if sp.err != nil {
		return nil
	}
	set := sp.level(rel, sp.is(pg.Token_SET))
	items, end := sp.setList(set, pg.Token_FROM, pg.Token_WHERE, pg.Token_RETURNING)
	if sp.err != nil {
		return nil
	}
	tl, err := sp.assignFence(u.TargetList, items, t, f.key(key), val)
	if err != nil {
		return err
	}
	u.TargetList = tl
	if len(conds) > 0 {
		w := sp.findWhere(end, pg.Token_RETURNING)
		u.WhereClause = and(append([]*pg.Node{u.WhereClause}, conds...)...)
		sp.addConds(w, f.condTexts(sp, conds)...)
	}
	return nil
}

// condTexts renders WHERE conjuncts built by f; their kinds are told apart
// by position, which is fixed for each statement form.
func (f *fencer) condTexts(sp *splicer, conds []*pg.Node) []txt {
	out := make([]txt, len(conds))
	for i, c := range conds {
		out[i] = sp.exprText(f.key("cond"+string(rune('0'+i))), c)
	}
	return out
}

// rewriteDelete fences a DELETE from a protected table.
//
// on_stale: skip: WHERE (W) AND guard AND F CMP TOK?.
//
// on_stale: error: a DELETE has no SET list, and AND-ed quals run in any
// order, so the stale error is raised only for rows that match the
// client's condition W, which is repeated inside the check:
//
//	WHERE (W) AND guard AND CASE WHEN FRESH THEN true WHEN (W) THEN RAISE(stale) ELSE false END
//
// W stays a separate conjunct so the planner can still use it for index
// scans and joins. When W calls a function that is not known to be free of
// side effects and stable, repeating it could change the outcome, so the
// single-evaluation form is used instead (correct, but opaque to the
// planner):
//
//	WHERE guard AND CASE WHEN (W) THEN <fresh or raise> ELSE false END
//
// guard is tokenGuard: it raises FP002, or records the invalid token.
// audit: the same forms with freshOrNotify, which records a stale row and
// never filters one out.
func (r *Rules) rewriteDelete(d *pg.DeleteStmt, t *tableRule, sp *splicer) *Error {
	f := r.fencer(t, d.Relation, sp)
	if isCurrentOf(d.WhereClause) {
		return refused(t, "fenceproxy: DELETE ... WHERE CURRENT OF on protected table %s is not supported",
			"WHERE CURRENT OF cannot be combined with the fence check.",
			"Delete the row by its key instead of through the cursor.")
	}
	check, kind := f.freshOrRaise, "raise"
	if t.audit {
		check, kind = f.freshOrNotify, "notify"
	}
	rel := sp.relTok(d.Relation)
	if sp.err != nil {
		return nil
	}
	wc := sp.findWhere(rel, pg.Token_RETURNING)
	guard := f.tokenGuard()
	guardText := sp.exprText(f.key("guard"), guard)
	w := d.WhereClause
	switch {
	case t.skip:
		skip := f.skipCond()
		skipText := sp.exprText(f.key("skip"), skip)
		d.WhereClause = and(w, guard, skip)
		sp.addConds(wc, guardText, skipText)
	case w == nil:
		c := check(nil)
		text := sp.exprText(f.key(kind), c)
		d.WhereClause = and(guard, c)
		sp.addConds(wc, guardText, text)
	case repeatable(w):
		c, text := sp.withHoles(f.key(kind+"-w"), func(h []*pg.Node) *pg.Node { return check(h[0]) },
			[]*pg.Node{cloneNode(w)}, []string{sp.text(wc.from, wc.to)})
		d.WhereClause = and(w, guard, c)
		sp.addConds(wc, guardText, text)
	default:
		c, text := sp.withHoles(f.key(kind+"-once"), func(h []*pg.Node) *pg.Node {
			return caseExpr([]*pg.Node{h[0], check(nil)}, aBool(false))
		}, []*pg.Node{w}, []string{sp.text(wc.from, wc.to)})
		d.WhereClause = and(guard, c)
		if wc.from < wc.to {
			sp.replace(sp.toks[wc.from].start, sp.endOf(wc.to), cat(guardText, lit(" AND "), text))
		}
	}
	return nil
}
