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
	if r.tooLarge(sql) {
		return *r.refuseTooLarge(sql) // once, before anything reads the whole text
	}
	var toks []scanTok
	if len(sql) >= valuesFastMinBytes && r.tooDeep(sql) == nil {
		var d Decision
		var ok bool
		if d, ok, toks = r.decideValuesFast(sql); ok {
			return d
		}
	}
	d, _ := r.decideFull(sql, toks)
	return d
}

// decideFull decides sql by parsing, rewriting and splicing all of it;
// toks, when not nil, are sql's tokens, already scanned. For a rewrite it
// also returns the rewritten statement, whose splicer holds the edits.
func (r *Rules) decideFull(sql string, toks []scanTok) (Decision, *rewritten) {
	res, final := r.rewrite(sql, toks)
	if final != nil {
		return *final, nil
	}
	out, check, tok, err := res.sp.apply()
	if err == nil {
		err = verify(check, res.tree)
	}
	if err != nil {
		d := refuse(res.tables, fmt.Sprintf("fenceproxy: cannot rewrite this statement on %s", describeTables(res.tables)), err.Error(), "")
		if allAudit(res.written) {
			return Decision{Action: Forward, Tables: res.tables, AuditRefusal: d.Err}, nil
		}
		return d, nil
	}
	d := Decision{Action: Rewrite, SQL: out, Tables: res.tables, AuditRefusal: res.audit}
	d.Preparable = res.audit == nil && preparable(res.tree)
	if res.sp.tokForm && !res.sp.tokFail {
		d.Tok = newTokenForm(out, tok, res.sp.staleAt, res.sp.fencedTables)
	}
	if res.lock != nil {
		d = r.withLock(d, out, res.tree.Version, res.lock)
	}
	return d, res
}

// withLock adds the lock registration to a decision whose text to send is
// final; if it cannot be prepared the statement is refused.
func (r *Rules) withLock(d Decision, final string, version int32, uses []*lockUse) Decision {
	lc, err := r.lockCall(final, version, uses)
	if err != nil {
		var tables []string
		for _, u := range uses {
			if u != nil {
				tables = append(tables, u.enforce...)
				tables = append(tables, u.audit...)
			}
		}
		tables = sortedUnique(tables)
		return refuse(tables, fmt.Sprintf("fenceproxy: cannot prepare the lock registration for a statement on %s", describeTables(tables)), err.Error(),
			"Send the statement on its own, or report it as a fenceproxy bug.")
	}
	d.Lock = lc
	return d
}

// rewritten is a parse tree whose protected writes have been rewritten in
// place.
type rewritten struct {
	tree    *pg.ParseResult
	sp      *splicer // the edits of the client's text
	tables  []string
	written []*tableRule
	audit   *Error     // see Decision.AuditRefusal
	lock    []*lockUse // per statement; nil when none registers
}

// rewrite parses sql and rewrites its protected writes. It returns a final
// decision instead when there is nothing to rewrite (Forward) or the
// statement is refused.
func (r *Rules) rewrite(sql string, toks []scanTok) (*rewritten, *Decision) {
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
	var sp *splicer
	if w.err == nil && len(w.pending) > 0 {
		var err error
		if toks != nil {
			sp = &splicer{sql: sql, toks: toks, frags: map[string]*fragInfo{}}
		} else if sp, err = newSplicer(sql); err != nil {
			d := refuse(sortedUnique(w.tables), fmt.Sprintf("fenceproxy: cannot scan a statement that writes %s", describeTables(sortedUnique(w.tables))), err.Error(), "")
			return nil, &d
		}
		sp.version = tree.Version
		sp.choosePrefix(tree, r.unicodeEscape(sql))
		sp.tokForm = len(sql) < valuesFastMinBytes && !r.prepared && tokenFormStatements(tree) && !containsFoldASCII(sql, tokHoleName) && !r.unicodeEscape(sql)
		sp.staleAt = r.staleAt
		w.apply(tree, sp, changed)
	}
	if w.err != nil {
		return nil, &Decision{Action: Refuse, Err: w.err, Tables: sortedUnique(w.errTables)}
	}
	var uses []*lockUse
	if r.locks {
		uses = r.lockUses(tree, nil)
	}
	if !slices.Contains(changed, true) {
		d := Decision{Action: Forward}
		if w.audit != nil {
			d.Tables, d.AuditRefusal = sortedUnique(w.auditTables), w.audit
		}
		if uses != nil {
			d = r.withLock(d, sql, tree.Version, uses)
		}
		return nil, &d
	}
	return &rewritten{tree: tree, sp: sp, tables: sortedUnique(w.tables), written: w.written, audit: w.audit, lock: uses}, nil
}

// preparable reports whether tree is one INSERT, UPDATE, DELETE or MERGE
// that returns no rows and has no parameters ($n): what a named prepared
// statement of its text answers to Bind and Execute is then what a simple
// Query of it answers (a command tag, or an error), and no change of the
// table's columns can make the cached plan's result type differ.
func preparable(tree *pg.ParseResult) bool {
	if len(tree.Stmts) != 1 {
		return false
	}
	n := tree.Stmts[0].Stmt
	var returning []*pg.Node
	switch {
	case n.GetInsertStmt() != nil:
		returning = n.GetInsertStmt().ReturningList
	case n.GetUpdateStmt() != nil:
		returning = n.GetUpdateStmt().ReturningList
	case n.GetDeleteStmt() != nil:
		returning = n.GetDeleteStmt().ReturningList
	case n.GetMergeStmt() != nil:
		returning = n.GetMergeStmt().ReturningList
	default:
		return false
	}
	if len(returning) > 0 {
		return false
	}
	return !hasNode(n, func(m protoreflect.ProtoMessage) bool {
		switch m := m.(type) {
		case *pg.ParamRef:
			return true
		case *pg.A_Const:
			return m.GetSval() != nil && timeDependent(m.GetSval().GetSval())
		case *pg.TypeCast:
			return catalogType(m.GetTypeName())
		}
		return false
	})
}

// timeDependent reports whether a string constant holds a word that
// PostgreSQL's date and time input reads as the current time ('now',
// 'today', 'tomorrow', 'yesterday'). The constant is converted when the
// statement is analysed, so a prepared statement would keep the moment it
// was prepared at, where a simple Query reads the clock every time.
func timeDependent(v string) bool {
	for i := 0; i < len(v); {
		if !isASCIILetter(v[i]) {
			i++
			continue
		}
		j := i
		for j < len(v) && isASCIILetter(v[j]) {
			j++
		}
		switch strings.ToLower(v[i:j]) {
		case "now", "today", "tomorrow", "yesterday":
			return true
		}
		i = j
	}
	return false
}

func isASCIILetter(c byte) bool { return c|0x20 >= 'a' && c|0x20 <= 'z' }

// catalogType reports whether a cast is to one of the object identifier
// types that name catalog objects (regclass, regproc, ...): the name is
// looked up when the statement is analysed, and a prepared statement would
// keep the object of that moment.
func catalogType(t *pg.TypeName) bool {
	if t == nil || len(t.Names) == 0 {
		return false
	}
	name := strings.ToLower(t.Names[len(t.Names)-1].GetString_().GetSval())
	return strings.HasPrefix(name, "reg")
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
	apply func(sp *splicer) *Error
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

// apply runs the queued rewrites, recording their text edits in sp, and
// marks the statements they changed. A rewrite of an audit-mode table that
// is refused leaves its statement as the client sent it: the node is
// restored from a copy, since the rewrite may have failed half-way, and
// its edits are dropped.
func (w *walker) apply(tree *pg.ParseResult, sp *splicer, changed []bool) {
	setsToken := map[int]bool{}
	// Only text that spells set_config, or may spell it in disguise, can
	// call it.
	if containsFoldASCII(sp.sql, "set_config") || w.r.unicodeEscape(sp.sql) {
		for i, raw := range tree.Stmts {
			setsToken[i] = callsSetConfig(raw)
		}
	}
	for _, p := range w.pending {
		var saved proto.Message
		if p.t.audit {
			saved = proto.Clone(p.node)
		}
		mark := len(sp.edits)
		var err *Error
		if setsToken[p.stmt] {
			err = refused(p.t, "fenceproxy: a statement that writes protected table %s must not call set_config",
				"The fencing token is read by the statement itself; changing settings inside the same statement could make its checks disagree.",
				"Set the token in a statement of its own, before the write.")
		} else {
			err = p.apply(sp)
		}
		if err == nil && sp.err != nil {
			err = refused(p.t, "fenceproxy: cannot insert the fence into the text of this statement on protected table %s", sp.err.Error(),
				"Simplify the statement, or report it as a fenceproxy bug.")
		}
		switch {
		case err == nil:
			changed[p.stmt] = true
		case p.t.audit:
			proto.Reset(p.node)
			proto.Merge(p.node, saved)
			sp.edits, sp.err = sp.edits[:mark], nil
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

// callsSetConfig reports whether a statement calls a function named
// set_config (in any schema).
func callsSetConfig(raw *pg.RawStmt) bool {
	return hasNode(raw.Stmt, func(m protoreflect.ProtoMessage) bool {
		fc, ok := m.(*pg.FuncCall)
		if !ok || len(fc.Funcname) == 0 {
			return false
		}
		return fc.Funcname[len(fc.Funcname)-1].GetString_().GetSval() == "set_config"
	})
}

// valuesListsField is SelectStmt.values_lists.
var valuesListsField = (&pg.SelectStmt{}).ProtoReflect().Descriptor().Fields().ByName("values_lists")

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
			if fd == valuesListsField {
				// VALUES rows are expressions: no statement the walker acts
				// on (a write, DDL, stored code) can be inside one, and an
				// INSERT may carry thousands of rows.
				return true
			}
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
		w.storedCode("DO block", n)
		return false
	case *pg.CreateFunctionStmt:
		kind := "function"
		if n.IsProcedure {
			kind = "procedure"
		}
		w.storedCode(kind+" body", n)
		return false
	case *pg.RuleStmt:
		if ts := w.matchAll(n.Relation); len(ts) > 0 && w.denyDDL(ts, "CREATE RULE") {
			return false
		}
		if n.Event == pg.CmdType_CMD_SELECT {
			// An ON SELECT rule defines a view (before PostgreSQL 16 it
			// turns an empty table into one): a view over a protected
			// table, as CREATE VIEW.
			var found []*tableRule
			for _, a := range n.Actions {
				visitRangeVars(a.ProtoReflect(), true, func(rv *pg.RangeVar) {
					found = append(found, w.matchAll(rv)...)
				})
			}
			if len(found) > 0 && w.denyDDL(found, "an ON SELECT rule (a view) over a protected table") {
				return false
			}
		}
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
	default:
		return w.ddl(m)
	}
	return true
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

// post queues the rewrite of a write statement whose target is protected.
func (w *walker) post(m protoreflect.ProtoMessage) {
	switch n := m.(type) {
	case *pg.UpdateStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, n, func(sp *splicer) *Error { return w.r.rewriteUpdate(n, t, sp) })
		}
	case *pg.DeleteStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, n, func(sp *splicer) *Error { return w.r.rewriteDelete(n, t, sp) })
		}
	case *pg.InsertStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, n, func(sp *splicer) *Error { return w.r.rewriteInsert(n, t, sp) })
		}
	case *pg.MergeStmt:
		if t := w.match(n.Relation); t != nil {
			w.queue(t, n, func(sp *splicer) *Error { return w.r.rewriteMerge(n, t, sp) })
		}
	}
}

func (w *walker) queue(t *tableRule, node proto.Message, apply func(sp *splicer) *Error) {
	if t.column == "" {
		// No fence column (lock: required): the lock registration that
		// precedes the statement is the table's only fence.
		return
	}
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

func (r *Rules) fencer(t *tableRule, rv *pg.RangeVar, sp *splicer) *fencer {
	if sp != nil && !slices.Contains(sp.fencedTables, t.display) {
		// Whether or not its fragments are built now (a print proven
		// before serves without a build), the statement writes t.
		sp.fencedTables = append(sp.fencedTables, t.display)
	}
	return &fencer{setting: r.tokenSetting, tag: r.auditTag, t: t, qual: qualifier(rv), raisers: r.raisers, prepared: r.prepared, staleAt: r.staleAt, sp: sp}
}

func refused(t *tableRule, msg, detail, hint string) *Error {
	return &Error{Code: CodeRefused, Message: fmt.Sprintf(msg, t.display), Detail: detail, Hint: hint, Table: t.display}
}

func isCurrentOf(n *pg.Node) bool { return n.GetCurrentOfExpr() != nil }
