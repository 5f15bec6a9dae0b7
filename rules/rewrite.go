package rules

import (
	"fmt"
	"slices"
	"strings"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/proto"
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
		d := refuse(res.tables, fmt.Sprintf("fenceproxy: cannot rewrite this statement on %s", describeTables(res.tables)), err.Error(), "")
		if allAudit(res.written) {
			return Decision{Action: Forward, Tables: res.tables, AuditRefusal: d.Err}
		}
		return d
	}
	return Decision{Action: Rewrite, SQL: out, Tables: res.tables, AuditRefusal: res.audit}
}

// rewritten is a parse tree whose protected writes have been rewritten in
// place.
type rewritten struct {
	tree      *pg.ParseResult
	rewritten []bool // per statement: whether it was changed
	tables    []string
	written   []*tableRule
	audit     *Error // see Decision.AuditRefusal
}

// rewrite parses sql and rewrites its protected writes. It returns a final
// decision instead when there is nothing to rewrite (Forward) or the
// statement is refused.
func (r *Rules) rewrite(sql string) (*rewritten, *Decision) {
	if d := r.tooDeep(sql); d != nil {
		return nil, d // parsing it could overflow the stack
	}
	tree, err := pg.Parse(sql)
	if err != nil {
		tables := r.mentioned(sql)
		if len(tables) == 0 && !r.unicodeEscape(sql) {
			// MayTouch fired on a schema name after "alter" only: the
			// statement names no protected table.
			return nil, &Decision{Action: Forward}
		}
		d := refuse(displays(tables), fmt.Sprintf("fenceproxy: cannot parse a statement that mentions %s, so it cannot be fenced", describeTables(displays(tables))),
			err.Error(), "")
		// MayTouch may have fired on "U&" alone: then the statement may
		// name any table, in disguise, and is refused.
		if allAudit(tables) && !r.unicodeEscape(sql) {
			d = Decision{Action: Forward, Tables: d.Tables, AuditRefusal: d.Err}
		}
		return nil, &d
	}
	w := &walker{r: r}
	for i, raw := range tree.Stmts {
		w.stmt = i
		w.walk(raw.ProtoReflect())
		if w.err != nil {
			break
		}
	}
	changed := make([]bool, len(tree.Stmts))
	if w.err == nil {
		w.apply(changed)
	}
	if w.err != nil {
		return nil, &Decision{Action: Refuse, Err: w.err, Tables: sortedUnique(w.errTables)}
	}
	if !slices.Contains(changed, true) {
		d := Decision{Action: Forward}
		if w.audit != nil {
			d.Tables, d.AuditRefusal = sortedUnique(w.auditTables), w.audit
		}
		return nil, &d
	}
	return &rewritten{tree: tree, rewritten: changed, tables: sortedUnique(w.tables), written: w.written, audit: w.audit}, nil
}

// allAudit reports whether tables is not empty and all of them are in
// audit mode: then a refusal concerning them is only recorded.
func allAudit(tables []*tableRule) bool {
	for _, t := range tables {
		if !t.audit {
			return false
		}
	}
	return len(tables) > 0
}

func displays(tables []*tableRule) []string {
	out := make([]string, len(tables))
	for i, t := range tables {
		out[i] = t.display
	}
	return sortedUnique(out)
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
	stmt      int // index of the statement being walked
	pending   []pendingWrite
	tables    []string     // protected tables written
	written   []*tableRule // their rules
	err       *Error       // first refusal
	errTables []string
	// audit is the first refusal that concerned audit-mode tables only:
	// recorded, not fatal (see Decision.AuditRefusal).
	audit       *Error
	auditTables []string
}

// pendingWrite is a queued rewrite of node, a write to t in statement stmt.
type pendingWrite struct {
	stmt  int
	t     *tableRule
	node  proto.Message
	apply func() *Error
}

// refuse records a refusal concerning tables (none when the statement may
// concern any protected table). It is fatal, and the whole string is
// refused, unless every table concerned is in audit mode: audit never
// blocks a write, so the write is then left as the client sent it and the
// refusal only recorded. It reports whether it was fatal.
func (w *walker) refuse(tables []*tableRule, msg, detail, hint string) bool {
	if w.err != nil {
		return true
	}
	e := &Error{Code: CodeRefused, Message: msg, Detail: detail, Hint: hint}
	if len(tables) > 0 {
		e.Table = tables[0].display
	}
	if allAudit(tables) {
		if w.audit == nil {
			w.audit = e
		}
		w.auditTables = append(w.auditTables, displays(tables)...)
		return false
	}
	w.err = e
	w.errTables = append(w.errTables, displays(tables)...)
	return true
}

// apply runs the queued rewrites and marks the statements they changed.
// A rewrite of an audit-mode table that is refused leaves its statement as
// the client sent it: the node is restored from a copy, since the rewrite
// may have failed half-way.
func (w *walker) apply(changed []bool) {
	for _, p := range w.pending {
		var saved proto.Message
		if p.t.audit {
			saved = proto.Clone(p.node)
		}
		err := p.apply()
		switch {
		case err == nil:
			changed[p.stmt] = true
		case p.t.audit:
			proto.Reset(p.node)
			proto.Merge(p.node, saved)
			if w.audit == nil {
				w.audit = err
			}
			w.auditTables = append(w.auditTables, p.t.display)
		default:
			w.err = err
			w.errTables = append(w.errTables, p.t.display)
			return
		}
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
				w.refuse([]*tableRule{t}, fmt.Sprintf("fenceproxy: COPY ... FROM into protected table %s is not allowed", t.display),
					"Rows loaded by COPY cannot be stamped with the fencing token.",
					"Load the rows with INSERT statements, which fenceproxy fences, or load them without the proxy.")
			}
		}
	case *pg.TruncateStmt:
		for _, rel := range n.Relations {
			if t := w.match(rel.GetRangeVar()); t != nil {
				if w.refuse([]*tableRule{t}, fmt.Sprintf("fenceproxy: TRUNCATE of protected table %s is not allowed", t.display),
					"TRUNCATE removes every row without looking at the fence column.",
					"Use DELETE, which fenceproxy fences, or run maintenance without the proxy.") {
					return false
				}
			}
		}
	case *pg.RenameStmt:
		w.renameStmt(n)
	case *pg.AlterObjectSchemaStmt:
		w.alterObjectSchemaStmt(n)
	case *pg.AlterTableStmt:
		w.alterTableStmt(n)
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
			if sub.audit != nil && w.audit == nil {
				w.audit = sub.audit
			}
			w.auditTables = append(w.auditTables, sub.auditTables...)
			if len(sub.written) > 0 {
				t := sub.written[0].display
				if w.refuse(sub.written, fmt.Sprintf("fenceproxy: a rule that writes protected table %s is not allowed", t),
					"The rule's actions would run later, inside statements fenceproxy cannot see.", "") {
					return false
				}
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
	var found []*tableRule
	escaped := false
	visitStrings(body.ProtoReflect(), func(s string) {
		found = append(found, w.r.mentioned(s)...)
		escaped = escaped || w.r.unicodeEscape(s)
	})
	if len(found) == 0 && !escaped {
		return
	}
	names := displays(found)
	if escaped {
		// A Unicode escape can name any table: fail closed.
		found = append(found, nil)
	}
	w.refuseNames(found, names, fmt.Sprintf("fenceproxy: %s mentions %s; statements inside it cannot be fenced", what, describeTables(names)),
		"fenceproxy rewrites the SQL it sees; it cannot rewrite statements run inside stored or anonymous code.",
		"Send the writes as plain statements through the proxy.")
}

// refuseNames is refuse for a list that may hold nil, "some table that
// cannot be named", which makes the refusal fatal.
func (w *walker) refuseNames(found []*tableRule, names []string, msg, detail, hint string) {
	if slices.Contains(found, nil) {
		if w.err == nil {
			w.err = &Error{Code: CodeRefused, Message: msg, Detail: detail, Hint: hint}
			if len(names) > 0 {
				w.err.Table = names[0]
			}
			w.errTables = append(w.errTables, names...)
		}
		return
	}
	w.refuse(found, msg, detail, hint)
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
			w.queue(t, n, func() *Error { return w.r.rewriteUpdate(n, t) })
		}
	case *pg.DeleteStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, n, func() *Error { return w.r.rewriteDelete(n, t) })
		}
	case *pg.InsertStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, n, func() *Error { return w.r.rewriteInsert(n, t) })
		}
	case *pg.MergeStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, n, func() *Error { return w.r.rewriteMerge(n, t) })
		}
	}
}

func (w *walker) queue(t *tableRule, node proto.Message, apply func() *Error) {
	w.tables = append(w.tables, t.display)
	w.written = append(w.written, t)
	w.pending = append(w.pending, pendingWrite{stmt: w.stmt, t: t, node: node, apply: apply})
}

// match returns the rule protecting the relation rv names, or nil.
//
// A schema-qualified name (catalog.schema.table or schema.table) matches
// exactly. An unqualified name matches every protected table with that
// relation name, whatever its schema, because the proxy cannot know the
// session's search_path (fail closed). If those tables are fenced
// differently, the statement is refused as ambiguous (only recorded, and
// the write left alone, when they are all in audit mode).
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
		w.refuse(cands, fmt.Sprintf("fenceproxy: table name %s is ambiguous: it matches protected tables %s, which are fenced differently",
			quoteIdent(rv.Relname), strings.Join(names, ", ")),
			"fenceproxy cannot know the session's search_path.",
			"Qualify the table name with its schema.")
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
	return &fencer{setting: r.tokenSetting, tag: r.auditTag, t: t, qual: qualifier(rv)}
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
// concurrency EvalPlanQual recomputes it on the newest row version. The
// pseudo-constant token guard is AND-ed to the WHERE clause, so an invalid
// token fails the statement (or, with missing_token: allow, is recorded)
// even if no row matches.
//
// on_stale: skip: WHERE ... AND F CMP TOK? and SET F = TOK.
//
// audit: like on_stale: error, with a recording guard, and a stale row
// recorded and left with its watermark instead of raising.
func (r *Rules) rewriteUpdate(u *pg.UpdateStmt, t *tableRule) *Error {
	f := r.fencer(t, u.Relation)
	tl, err := dropFenceAssignments(u.TargetList, t)
	if err != nil {
		return err
	}
	currentOf := isCurrentOf(u.WhereClause)
	switch {
	case t.audit && currentOf:
		// No other condition can be AND-ed to WHERE CURRENT OF: the SET
		// value records an invalid token itself.
		tl = append(tl, setTarget(t.column, f.auditSetValue(true)))
	case t.audit:
		u.WhereClause = and(u.WhereClause, f.tokenGuard())
		tl = append(tl, setTarget(t.column, f.auditSetValue(false)))
	case t.skip && currentOf:
		return refused(t, "fenceproxy: UPDATE ... WHERE CURRENT OF on protected table %s with on_stale: skip is not supported",
			"WHERE CURRENT OF cannot be combined with the fence condition that skips stale rows.",
			"Update the row by its key instead of through the cursor.")
	case t.skip:
		u.WhereClause = and(u.WhereClause, f.tokenGuard(), f.skipCond())
		tl = append(tl, setTarget(t.column, f.skipSetValue(false)))
	case currentOf:
		// No other condition can be AND-ed to WHERE CURRENT OF: the SET
		// value checks the token itself.
		tl = append(tl, setTarget(t.column, f.errorSetValue(true)))
	default:
		u.WhereClause = and(u.WhereClause, f.tokenGuard())
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
func (r *Rules) rewriteDelete(d *pg.DeleteStmt, t *tableRule) *Error {
	f := r.fencer(t, d.Relation)
	if isCurrentOf(d.WhereClause) {
		return refused(t, "fenceproxy: DELETE ... WHERE CURRENT OF on protected table %s is not supported",
			"WHERE CURRENT OF cannot be combined with the fence check.",
			"Delete the row by its key instead of through the cursor.")
	}
	check := f.freshOrRaise
	if t.audit {
		check = f.freshOrNotify
	}
	guard := f.tokenGuard()
	w := d.WhereClause
	switch {
	case t.skip:
		d.WhereClause = and(w, guard, f.skipCond())
	case w == nil:
		d.WhereClause = and(guard, check(nil))
	case repeatable(w):
		d.WhereClause = and(w, guard, check(cloneNode(w)))
	default:
		d.WhereClause = and(guard, caseExpr([]*pg.Node{w, check(nil)}, aBool(false)))
	}
	return nil
}

// rewriteInsert stamps new rows with the token and fences the DO UPDATE
// branch of ON CONFLICT like an UPDATE (audit: records a stale row and
// keeps its watermark).
func (r *Rules) rewriteInsert(ins *pg.InsertStmt, t *tableRule) *Error {
	f := r.fencer(t, ins.Relation)
	switch {
	case ins.SelectStmt == nil:
		// DEFAULT VALUES
		ins.Cols = []*pg.Node{pg.MakeResTargetNodeWithName(t.column, -1)}
		ins.SelectStmt = &pg.Node{Node: &pg.Node_SelectStmt{SelectStmt: &pg.SelectStmt{
			ValuesLists: []*pg.Node{pg.MakeListNode([]*pg.Node{f.stamp(true)})},
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
	// The proposed row's stamp has already checked (or recorded) the
	// token: it is computed for every proposed row, conflicting or not.
	switch {
	case t.audit:
		tl = append(tl, setTarget(t.column, f.auditSetValue(false)))
	case t.skip:
		// A false DO UPDATE condition leaves the existing row alone and
		// inserts nothing: the skip outcome.
		oc.WhereClause = and(oc.WhereClause, f.skipCond())
		tl = append(tl, setTarget(t.column, f.skipSetValue(false)))
	default:
		tl = append(tl, setTarget(t.column, f.errorSetValue(false)))
	}
	oc.TargetList = tl
	return nil
}

// addStampColumn appends the stamp to every row a query produces: to each
// VALUES row, to the target list of a SELECT, and to each branch of a set
// operation (the stamp is the same for every row, so UNION, INTERSECT and
// EXCEPT still combine the same rows). In a VALUES list only the first
// row's stamp records an invalid token (see fencer.stamp): whatever reads
// the rows, it reads the first one if it reads any.
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
		for i, row := range sel.ValuesLists {
			l := row.GetList()
			if l == nil || len(l.Items) != ncols {
				return wrongLength(t)
			}
			l.Items = append(l.Items, f.stamp(i == 0))
		}
		return nil
	}
	if !hasStar(sel.TargetList) && len(sel.TargetList) != ncols {
		return wrongLength(t)
	}
	sel.TargetList = append(sel.TargetList, pg.MakeResTargetNodeWithVal(f.stamp(true), -1))
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
		for r, row := range sel.ValuesLists {
			l := row.GetList()
			if l == nil || len(l.Items) != ncols {
				return wrongLength(t)
			}
			for _, i := range idx {
				l.Items[i] = f.stamp(r == 0)
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
		rt.Val = f.stamp(true)
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
			switch {
			case t.audit:
				tl = append(tl, setTarget(t.column, f.auditSetValue(true)))
			case t.skip:
				needGuard[c.MatchKind] = true
				tl = append(tl, setTarget(t.column, f.skipSetValue(true)))
			default:
				tl = append(tl, setTarget(t.column, f.errorSetValue(true)))
			}
			c.TargetList = tl
		case pg.CmdType_CMD_DELETE:
			if t.audit {
				c.Condition = onlyIf(c.Condition, f.auditCheck())
				break
			}
			if t.skip {
				needGuard[c.MatchKind] = true
			} else {
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
			}
			if t.allow {
				// Record the invalid token of a row the action deletes.
				c.Condition = onlyIf(c.Condition, f.tokenGuard())
			}
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

// onlyIf returns check when cond is nil, and otherwise
// CASE WHEN (cond) THEN check ELSE false END: true when both are, with check
// evaluated only when cond is true.
func onlyIf(cond, check *pg.Node) *pg.Node {
	if cond == nil {
		return check
	}
	return caseExpr([]*pg.Node{cond, check}, aBool(false))
}

func stampMergeInsert(c *pg.MergeWhenClause, f *fencer, t *tableRule) *Error {
	switch {
	case len(c.TargetList) == 0 && len(c.Values) == 0:
		// INSERT DEFAULT VALUES
		c.TargetList = []*pg.Node{pg.MakeResTargetNodeWithName(t.column, -1)}
		c.Values = []*pg.Node{f.stamp(true)}
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
			c.Values[i] = f.stamp(true)
			found = true
		}
	}
	if !found {
		c.TargetList = append(c.TargetList, pg.MakeResTargetNodeWithName(t.column, -1))
		c.Values = append(c.Values, f.stamp(true))
	}
	return nil
}
