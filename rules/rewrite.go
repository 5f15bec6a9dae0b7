package rules

import (
	"fmt"
	"strings"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// decide parses sql, finds every write to a protected table anywhere in the
// tree (top level, writable CTEs, PREPARE, EXPLAIN, COPY (query) TO, every
// statement of a multi-statement string) and either rewrites them all or
// refuses the whole string.
func (r *Rules) decide(sql string) Decision {
	res, final := r.rewrite(sql)
	if final != nil {
		return *final
	}
	out, err := render(sql, res.tree, res.rewritten)
	if err != nil {
		return refuse(res.tables, fmt.Sprintf("fenceproxy: cannot rewrite this statement on %s", describeTables(res.tables)), err.Error(), "")
	}
	return Decision{Action: Rewrite, SQL: out, Tables: res.tables}
}

// rewritten is a parse tree whose protected writes have been rewritten in
// place.
type rewritten struct {
	tree      *pg.ParseResult
	rewritten []bool // per statement: whether it was changed
	tables    []string
}

// rewrite parses sql and rewrites its protected writes. It returns a final
// decision instead when there is nothing to rewrite (Forward) or the
// statement is refused.
func (r *Rules) rewrite(sql string) (*rewritten, *Decision) {
	tree, err := pg.Parse(sql)
	if err != nil {
		tables := r.mentioned(sql)
		d := refuse(tables, fmt.Sprintf("fenceproxy: cannot parse a statement that mentions %s, so it cannot be fenced", describeTables(tables)),
			err.Error(), "")
		return nil, &d
	}
	w := &walker{r: r}
	changed := make([]bool, len(tree.Stmts))
	for i, raw := range tree.Stmts {
		n := len(w.pending)
		w.walk(raw.ProtoReflect())
		if w.err != nil {
			break
		}
		changed[i] = len(w.pending) > n
	}
	if w.err == nil {
		for _, apply := range w.pending {
			if w.err = apply(); w.err != nil {
				break
			}
		}
	}
	if w.err != nil {
		return nil, &Decision{Action: Refuse, Err: w.err, Tables: sortedUnique(w.errTables)}
	}
	if len(w.pending) == 0 {
		return nil, &Decision{Action: Forward}
	}
	return &rewritten{tree: tree, rewritten: changed, tables: sortedUnique(w.tables)}, nil
}

// render produces the text to send: a single statement is deparsed; in a
// multi-statement string only the rewritten statements are deparsed and the
// others keep their original text, cut at the statement boundaries the
// parser reports, so statements the proxy has no business with (SET,
// comments and all) reach the server exactly as the client wrote them.
// Every deparsed statement is checked by deparseChecked.
func render(sql string, tree *pg.ParseResult, rewritten []bool) (string, error) {
	var b strings.Builder
	for i, raw := range tree.Stmts {
		if i > 0 {
			b.WriteString("; ")
		}
		if rewritten[i] {
			one, err := deparseChecked(tree.Version, raw)
			if err != nil {
				return "", err
			}
			b.WriteString(one)
			continue
		}
		start, end := int(raw.StmtLocation), int(raw.StmtLocation+raw.StmtLen)
		if raw.StmtLen == 0 && i == len(tree.Stmts)-1 {
			end = len(sql) // the last statement runs to the end of the input
		}
		if start < 0 || start >= end || end > len(sql) {
			return "", fmt.Errorf("statement %d has bounds %d..%d outside the input", i+1, start, end)
		}
		// Trimmed at the start only: a line comment at the end of the
		// statement keeps the newline that ends it, so the separator
		// cannot be swallowed.
		b.WriteString(strings.TrimLeft(sql[start:end], " \t\r\n\f"))
	}
	out := b.String()
	if len(tree.Stmts) > 1 {
		// The spliced string must still split into the same statements.
		back, err := pg.Parse(out)
		if err != nil {
			return "", fmt.Errorf("the rewritten string does not parse: %v", err)
		}
		if len(back.Stmts) != len(tree.Stmts) {
			return "", fmt.Errorf("the rewritten string has %d statements, not %d", len(back.Stmts), len(tree.Stmts))
		}
	}
	return out, nil
}

func refuse(tables []string, msg, detail, hint string) Decision {
	e := &Error{Code: CodeRefused, Message: msg, Detail: detail, Hint: hint}
	if len(tables) > 0 {
		e.Table = tables[0]
	}
	return Decision{Action: Refuse, Tables: tables, Err: e}
}

func describeTables(tables []string) string {
	switch len(tables) {
	case 0:
		return "a protected table"
	case 1:
		return "protected table " + tables[0]
	}
	return "protected tables " + strings.Join(tables, ", ")
}

// walker visits every message of a parse tree. Writes to protected tables
// are queued in pending (in post-order) and applied after the walk, so the
// walk never sees nodes the rewriter added.
type walker struct {
	r         *Rules
	pending   []func() *Error
	tables    []string // protected tables written
	err       *Error   // first refusal
	errTables []string
}

func (w *walker) refuse(t string, msg, detail, hint string) {
	if w.err != nil {
		return
	}
	w.err = &Error{Code: CodeRefused, Message: msg, Detail: detail, Hint: hint, Table: t}
	if t != "" {
		w.errTables = append(w.errTables, t)
	}
}

func (w *walker) walk(m protoreflect.Message) {
	if w.err != nil || !m.IsValid() {
		return
	}
	if !w.pre(m.Interface()) {
		return
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Message() == nil || fd.IsMap() {
			return true
		}
		if fd.IsList() {
			l := v.List()
			for i := 0; i < l.Len() && w.err == nil; i++ {
				w.walk(l.Get(i).Message())
			}
		} else {
			w.walk(v.Message())
		}
		return w.err == nil
	})
	if w.err == nil {
		w.post(m.Interface())
	}
}

// pre handles statements that are refused or must not be descended into;
// it returns false to skip the node's children.
func (w *walker) pre(m protoreflect.ProtoMessage) bool {
	switch n := m.(type) {
	case *pg.CopyStmt:
		if n.IsFrom {
			if t := w.match(n.Relation); t != nil {
				w.refuse(t.display, fmt.Sprintf("fenceproxy: COPY ... FROM into protected table %s is not allowed", t.display),
					"Rows loaded by COPY cannot be stamped with the fencing token.",
					"Load the rows with INSERT statements, which fenceproxy fences, or load them without the proxy.")
			}
		}
	case *pg.TruncateStmt:
		for _, rel := range n.Relations {
			if t := w.match(rel.GetRangeVar()); t != nil {
				w.refuse(t.display, fmt.Sprintf("fenceproxy: TRUNCATE of protected table %s is not allowed", t.display),
					"TRUNCATE removes every row without looking at the fence column.",
					"Use DELETE, which fenceproxy fences, or run maintenance without the proxy.")
				return false
			}
		}
	case *pg.DoStmt:
		for _, a := range n.Args {
			if d := a.GetDefElem(); d != nil && d.Defname == "as" {
				w.refuseBody("DO block", d.Arg)
			}
		}
		return false
	case *pg.CreateFunctionStmt:
		kind := "function"
		if n.IsProcedure {
			kind = "procedure"
		}
		for _, o := range n.Options {
			if d := o.GetDefElem(); d != nil && d.Defname == "as" {
				w.refuseBody(kind+" body", d.Arg)
			}
		}
		w.refuseBody(kind+" body", n.SqlBody)
		return false
	case *pg.RuleStmt:
		// A rule's actions run whenever the rule fires, inside statements
		// that do not name the protected table: a hidden write path.
		for _, a := range n.Actions {
			sub := &walker{r: w.r}
			sub.walk(a.ProtoReflect())
			if sub.err != nil {
				w.err, w.errTables = sub.err, sub.errTables
				return false
			}
			if len(sub.tables) > 0 {
				t := sub.tables[0]
				w.refuse(t, fmt.Sprintf("fenceproxy: a rule that writes protected table %s is not allowed", t),
					"The rule's actions would run later, inside statements fenceproxy cannot see.", "")
				return false
			}
		}
		return false
	}
	return true
}

// refuseBody refuses stored code (a DO block, a function body) whose text
// mentions a protected table: its statements run inside the server where the
// proxy cannot fence them.
func (w *walker) refuseBody(what string, body *pg.Node) {
	if body == nil || w.err != nil {
		return
	}
	var found []string
	visitStrings(body.ProtoReflect(), func(s string) {
		found = append(found, w.r.mentioned(s)...)
		if w.r.unicodeEscape(s) {
			found = append(found, "")
		}
	})
	if len(found) == 0 {
		return
	}
	found = sortedUnique(found)
	if found[0] == "" {
		found = found[1:]
	}
	t := ""
	if len(found) > 0 {
		t = found[0]
	}
	w.refuse(t, fmt.Sprintf("fenceproxy: %s mentions %s; statements inside it cannot be fenced", what, describeTables(found)),
		"fenceproxy rewrites the SQL it sees; it cannot rewrite statements run inside stored or anonymous code.",
		"Send the writes as plain statements through the proxy.")
	w.errTables = append(w.errTables, found...)
}

// unicodeEscape reports whether s contains U& (any case), the prefix of a
// Unicode-escaped identifier.
func (r *Rules) unicodeEscape(s string) bool {
	for i := 1; i < len(s); i++ {
		if s[i] == '&' && lowerASCII(s[i-1]) == 'u' {
			return true
		}
	}
	return false
}

// visitStrings calls f with every string field of every message under m.
func visitStrings(m protoreflect.Message, f func(string)) {
	if !m.IsValid() {
		return
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.Kind() == protoreflect.StringKind && !fd.IsList():
			f(v.String())
		case fd.Message() != nil && fd.IsList():
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				visitStrings(l.Get(i).Message(), f)
			}
		case fd.Message() != nil && !fd.IsMap():
			visitStrings(v.Message(), f)
		}
		return true
	})
}

// post queues the rewrite of a write statement whose target is protected.
func (w *walker) post(m protoreflect.ProtoMessage) {
	switch n := m.(type) {
	case *pg.UpdateStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, func() *Error { return w.r.rewriteUpdate(n, t) })
		}
	case *pg.DeleteStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, func() *Error { return w.r.rewriteDelete(n, t) })
		}
	case *pg.InsertStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, func() *Error { return w.r.rewriteInsert(n, t) })
		}
	case *pg.MergeStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, func() *Error { return w.r.rewriteMerge(n, t) })
		}
	}
}

func (w *walker) queue(t *tableRule, apply func() *Error) {
	w.tables = append(w.tables, t.display)
	w.pending = append(w.pending, func() *Error {
		if err := apply(); err != nil {
			w.errTables = append(w.errTables, t.display)
			return err
		}
		return nil
	})
}

// match returns the rule protecting the relation rv names, or nil.
//
// A schema-qualified name (catalog.schema.table or schema.table) matches
// exactly. An unqualified name matches every protected table with that
// relation name, whatever its schema, because the proxy cannot know the
// session's search_path (fail closed). If those tables are fenced
// differently, the statement is refused as ambiguous.
func (w *walker) match(rv *pg.RangeVar) *tableRule {
	if rv == nil {
		return nil
	}
	cands := w.r.byRel[rv.Relname]
	if len(cands) == 0 {
		return nil
	}
	if rv.Schemaname != "" {
		for _, t := range cands {
			if t.schema == rv.Schemaname {
				return t
			}
		}
		return nil
	}
	if len(cands) == 1 {
		return cands[0]
	}
	names := make([]string, len(cands))
	same := true
	for i, t := range cands {
		names[i] = t.display
		same = same && t.sameFencing(cands[0])
	}
	if !same {
		w.refuse(names[0], fmt.Sprintf("fenceproxy: table name %s is ambiguous: it matches protected tables %s, which are fenced differently",
			quoteIdent(rv.Relname), strings.Join(names, ", ")),
			"fenceproxy cannot know the session's search_path.",
			"Qualify the table name with its schema.")
		w.errTables = append(w.errTables, names...)
		return nil
	}
	t := *cands[0]
	t.display = quoteIdent(rv.Relname)
	return &t
}

// qualifier is how the target's columns are qualified: its alias, or its
// relation name.
func qualifier(rv *pg.RangeVar) string {
	if rv.Alias != nil && rv.Alias.Aliasname != "" {
		return rv.Alias.Aliasname
	}
	return rv.Relname
}

func (r *Rules) fencer(t *tableRule, rv *pg.RangeVar) *fencer {
	return &fencer{setting: r.tokenSetting, t: t, qual: qualifier(rv)}
}

func refused(t *tableRule, msg, detail, hint string) *Error {
	return &Error{Code: CodeRefused, Message: fmt.Sprintf(msg, t.display), Detail: detail, Hint: hint, Table: t.display}
}

func isCurrentOf(n *pg.Node) bool { return n.GetCurrentOfExpr() != nil }

// rewriteUpdate fences an UPDATE of a protected table.
//
// on_stale: error (the SET-list form): the fence column is assigned
//
//	CASE WHEN FRESH THEN TOK ELSE RAISE(stale) END
//
// The SET list is computed only for rows that passed the client's WHERE, so
// other rows never raise whatever order the quals run in, and under
// concurrency EvalPlanQual recomputes it on the newest row version. With
// missing_token: reject the pseudo-constant guard is AND-ed to the WHERE
// clause, so an invalid token fails the statement even if no row matches.
//
// on_stale: skip: WHERE ... AND F CMP TOK? and SET F = TOK.
func (r *Rules) rewriteUpdate(u *pg.UpdateStmt, t *tableRule) *Error {
	f := r.fencer(t, u.Relation)
	tl, err := dropFenceAssignments(u.TargetList, t)
	if err != nil {
		return err
	}
	currentOf := isCurrentOf(u.WhereClause)
	switch {
	case t.skip && currentOf:
		return refused(t, "fenceproxy: UPDATE ... WHERE CURRENT OF on protected table %s with on_stale: skip is not supported",
			"WHERE CURRENT OF cannot be combined with the fence condition that skips stale rows.",
			"Update the row by its key instead of through the cursor.")
	case t.skip:
		var guard *pg.Node
		if !t.allow {
			guard = f.guard()
		}
		u.WhereClause = and(u.WhereClause, guard, f.skipCond())
		tl = append(tl, setTarget(t.column, f.skipSetValue()))
	case currentOf:
		// No other condition can be AND-ed to WHERE CURRENT OF: the SET
		// value checks the token itself.
		tl = append(tl, setTarget(t.column, f.errorSetValue(true)))
	default:
		if !t.allow {
			u.WhereClause = and(u.WhereClause, f.guard())
		}
		tl = append(tl, setTarget(t.column, f.errorSetValue(false)))
	}
	u.TargetList = tl
	return nil
}

// dropFenceAssignments removes the client's assignments to the fence column
// (the proxy owns it). A multi-column assignment (a, F) = (x, y) from a row
// constructor is split into single assignments first; one from a sub-SELECT
// cannot be split and is refused.
func dropFenceAssignments(tl []*pg.Node, t *tableRule) ([]*pg.Node, *Error) {
	out := make([]*pg.Node, 0, len(tl)+1)
	for i := 0; i < len(tl); i++ {
		rt := tl[i].GetResTarget()
		if rt == nil {
			return nil, refused(t, "fenceproxy: cannot rewrite an unexpected SET list on protected table %s", "", "")
		}
		ma := rt.Val.GetMultiAssignRef()
		if ma == nil {
			if rt.Name != t.column {
				out = append(out, tl[i])
			}
			continue
		}
		n := int(ma.Ncolumns)
		if ma.Colno != 1 || n < 1 || i+n > len(tl) {
			return nil, refused(t, "fenceproxy: cannot rewrite an unexpected multi-column SET on protected table %s", "", "")
		}
		group := tl[i : i+n]
		i += n - 1
		hasFence := false
		for _, g := range group {
			if g.GetResTarget().GetName() == t.column {
				hasFence = true
			}
		}
		if !hasFence {
			out = append(out, group...)
			continue
		}
		row := ma.Source.GetRowExpr()
		if row == nil || len(row.Args) != n {
			return nil, refused(t, "fenceproxy: the fence column of protected table %s cannot be assigned in a multi-column SET from a sub-SELECT",
				"fenceproxy sets the fence column itself and cannot take it out of a sub-SELECT.",
				"Leave the fence column out of the SET list.")
		}
		for j, g := range group {
			grt := g.GetResTarget()
			if grt.GetName() == t.column {
				continue
			}
			out = append(out, &pg.Node{Node: &pg.Node_ResTarget{ResTarget: &pg.ResTarget{
				Name: grt.Name, Indirection: grt.Indirection, Val: row.Args[j], Location: grt.Location,
			}}})
		}
	}
	return out, nil
}

// rewriteDelete fences a DELETE from a protected table.
//
// on_stale: skip: WHERE (W) [AND guard] AND F CMP TOK?.
//
// on_stale: error: a DELETE has no SET list, and AND-ed quals run in any
// order, so the stale error is raised only for rows that match the
// client's condition W, which is repeated inside the check:
//
//	WHERE (W) [AND guard] AND CASE WHEN FRESH THEN true WHEN (W) THEN RAISE(stale) ELSE false END
//
// W stays a separate conjunct so the planner can still use it for index
// scans and joins. When W calls a function that is not known to be free of
// side effects and stable, repeating it could change the outcome, so the
// single-evaluation form is used instead (correct, but opaque to the
// planner):
//
//	WHERE [guard AND] CASE WHEN (W) THEN <fresh or raise> ELSE false END
func (r *Rules) rewriteDelete(d *pg.DeleteStmt, t *tableRule) *Error {
	f := r.fencer(t, d.Relation)
	if isCurrentOf(d.WhereClause) {
		return refused(t, "fenceproxy: DELETE ... WHERE CURRENT OF on protected table %s is not supported",
			"WHERE CURRENT OF cannot be combined with the fence check.",
			"Delete the row by its key instead of through the cursor.")
	}
	var guard *pg.Node
	if !t.allow {
		guard = f.guard()
	}
	w := d.WhereClause
	switch {
	case t.skip:
		d.WhereClause = and(w, guard, f.skipCond())
	case w == nil:
		d.WhereClause = and(guard, f.freshOrRaise(nil))
	case repeatable(w):
		d.WhereClause = and(w, guard, f.freshOrRaise(cloneNode(w)))
	default:
		d.WhereClause = and(guard, caseExpr([]*pg.Node{w, f.freshOrRaise(nil)}, aBool(false)))
	}
	return nil
}

// rewriteInsert stamps new rows with the token and fences the DO UPDATE
// branch of ON CONFLICT like an UPDATE.
func (r *Rules) rewriteInsert(ins *pg.InsertStmt, t *tableRule) *Error {
	f := r.fencer(t, ins.Relation)
	switch {
	case ins.SelectStmt == nil:
		// DEFAULT VALUES
		ins.Cols = []*pg.Node{pg.MakeResTargetNodeWithName(t.column, -1)}
		ins.SelectStmt = &pg.Node{Node: &pg.Node_SelectStmt{SelectStmt: &pg.SelectStmt{
			ValuesLists: []*pg.Node{pg.MakeListNode([]*pg.Node{f.stamp()})},
			LimitOption: pg.LimitOption_LIMIT_OPTION_DEFAULT,
			Op:          pg.SetOperation_SETOP_NONE,
		}}}
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
			if err := addStampColumn(sel, len(ins.Cols), f, t); err != nil {
				return err
			}
			ins.Cols = append(ins.Cols, pg.MakeResTargetNodeWithName(t.column, -1))
		} else if err := replaceStampColumn(sel, len(ins.Cols), idx, f, t); err != nil {
			return err
		}
	}

	oc := ins.OnConflictClause
	if oc == nil || oc.Action != pg.OnConflictAction_ONCONFLICT_UPDATE {
		return nil
	}
	tl, err := dropFenceAssignments(oc.TargetList, t)
	if err != nil {
		return err
	}
	if t.skip {
		// A false DO UPDATE condition leaves the existing row alone and
		// inserts nothing: the skip outcome.
		oc.WhereClause = and(oc.WhereClause, f.skipCond())
		tl = append(tl, setTarget(t.column, f.skipSetValue()))
	} else {
		// The proposed row's stamp has already checked the token.
		tl = append(tl, setTarget(t.column, f.errorSetValue(false)))
	}
	oc.TargetList = tl
	return nil
}

// addStampColumn appends the stamp to every row a query produces: to each
// VALUES row, to the target list of a SELECT, and to each branch of a set
// operation (the stamp is the same for every row, so UNION, INTERSECT and
// EXCEPT still combine the same rows).
//
// ncols is the number of columns the client listed. A row or SELECT list of
// another length is refused: PostgreSQL would reject the statement anyway,
// and the stamp must line up with the fence column.
func addStampColumn(sel *pg.SelectStmt, ncols int, f *fencer, t *tableRule) *Error {
	if sel == nil {
		return refused(t, "fenceproxy: cannot rewrite an unexpected INSERT into protected table %s", "", "")
	}
	if sel.Op != pg.SetOperation_SETOP_NONE && sel.Op != pg.SetOperation_SET_OPERATION_UNDEFINED {
		if err := addStampColumn(sel.Larg, ncols, f, t); err != nil {
			return err
		}
		return addStampColumn(sel.Rarg, ncols, f, t)
	}
	if len(sel.ValuesLists) > 0 {
		for _, row := range sel.ValuesLists {
			l := row.GetList()
			if l == nil || len(l.Items) != ncols {
				return wrongLength(t)
			}
			l.Items = append(l.Items, f.stamp())
		}
		return nil
	}
	if !hasStar(sel.TargetList) && len(sel.TargetList) != ncols {
		return wrongLength(t)
	}
	sel.TargetList = append(sel.TargetList, pg.MakeResTargetNodeWithVal(f.stamp(), -1))
	return nil
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

// replaceStampColumn overrides the client's values for the fence column,
// which the client listed at positions idx.
func replaceStampColumn(sel *pg.SelectStmt, ncols int, idx []int, f *fencer, t *tableRule) *Error {
	if len(sel.ValuesLists) > 0 && (sel.Op == pg.SetOperation_SETOP_NONE || sel.Op == pg.SetOperation_SET_OPERATION_UNDEFINED) {
		for _, row := range sel.ValuesLists {
			l := row.GetList()
			if l == nil || len(l.Items) != ncols {
				return wrongLength(t)
			}
			for _, i := range idx {
				l.Items[i] = f.stamp()
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
		rt.Val = f.stamp()
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
	var visit func(m protoreflect.Message)
	visit = func(m protoreflect.Message) {
		if found || !m.IsValid() {
			return
		}
		if pred(m.Interface()) {
			found = true
			return
		}
		m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			if fd.Message() == nil || fd.IsMap() {
				return true
			}
			if fd.IsList() {
				l := v.List()
				for i := 0; i < l.Len(); i++ {
					visit(l.Get(i).Message())
				}
			} else {
				visit(v.Message())
			}
			return !found
		})
	}
	visit(n.ProtoReflect())
	return found
}

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
func (r *Rules) rewriteMerge(m *pg.MergeStmt, t *tableRule) *Error {
	f := r.fencer(t, m.Relation)
	var out []*pg.Node
	needGuard := map[pg.MergeMatchKind]bool{}
	for _, n := range m.MergeWhenClauses {
		c := n.GetMergeWhenClause()
		if c == nil {
			return refused(t, "fenceproxy: cannot rewrite an unexpected MERGE into protected table %s", "", "")
		}
		switch c.CommandType {
		case pg.CmdType_CMD_UPDATE:
			tl, err := dropFenceAssignments(c.TargetList, t)
			if err != nil {
				return err
			}
			if t.skip {
				needGuard[c.MatchKind] = true
				tl = append(tl, setTarget(t.column, f.skipSetValue()))
			} else {
				tl = append(tl, setTarget(t.column, f.errorSetValue(true)))
			}
			c.TargetList = tl
		case pg.CmdType_CMD_DELETE:
			if t.skip {
				needGuard[c.MatchKind] = true
				break
			}
			invalid, raise := aBool(true), caseExpr([]*pg.Node{f.valid(), f.raiseStale("int8")}, f.raiseToken("int8"))
			if t.allow {
				invalid, raise = aBool(false), f.raiseStale("int8")
			}
			out = append(out, &pg.Node{Node: &pg.Node_MergeWhenClause{MergeWhenClause: &pg.MergeWhenClause{
				MatchKind:   c.MatchKind,
				CommandType: pg.CmdType_CMD_UPDATE,
				Override:    pg.OverridingKind_OVERRIDING_NOT_SET,
				Condition:   and(cloneNode(c.Condition), f.notFresh(invalid)),
				TargetList:  []*pg.Node{setTarget(t.column, raise)},
			}}})
		case pg.CmdType_CMD_INSERT:
			if err := stampMergeInsert(c, f, t); err != nil {
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
		if t.allow {
			invalid = aBool(false)
		}
		var guards []*pg.Node
		for _, k := range []pg.MergeMatchKind{pg.MergeMatchKind_MERGE_WHEN_MATCHED, pg.MergeMatchKind_MERGE_WHEN_NOT_MATCHED_BY_SOURCE} {
			if needGuard[k] {
				guards = append(guards, &pg.Node{Node: &pg.Node_MergeWhenClause{MergeWhenClause: &pg.MergeWhenClause{
					MatchKind:   k,
					CommandType: pg.CmdType_CMD_NOTHING,
					Override:    pg.OverridingKind_OVERRIDING_NOT_SET,
					Condition:   f.notFresh(cloneNode(invalid)),
				}}})
			}
		}
		out = append(guards, out...)
	}
	m.MergeWhenClauses = out
	return nil
}

func stampMergeInsert(c *pg.MergeWhenClause, f *fencer, t *tableRule) *Error {
	switch {
	case len(c.TargetList) == 0 && len(c.Values) == 0:
		// INSERT DEFAULT VALUES
		c.TargetList = []*pg.Node{pg.MakeResTargetNodeWithName(t.column, -1)}
		c.Values = []*pg.Node{f.stamp()}
		return nil
	case len(c.TargetList) == 0:
		return refused(t, "fenceproxy: MERGE ... INSERT into protected table %s must list its columns explicitly",
			"fenceproxy adds the fence column to the column list and cannot look up the table's columns.",
			"Write WHEN NOT MATCHED THEN INSERT (col1, col2, ...) VALUES (...).")
	case len(c.TargetList) != len(c.Values):
		return refused(t, "fenceproxy: MERGE ... INSERT into protected table %s has a different number of columns and values", "", "")
	}
	found := false
	for i, col := range c.TargetList {
		if col.GetResTarget().GetName() == t.column {
			c.Values[i] = f.stamp()
			found = true
		}
	}
	if !found {
		c.TargetList = append(c.TargetList, pg.MakeResTargetNodeWithName(t.column, -1))
		c.Values = append(c.Values, f.stamp())
	}
	return nil
}
