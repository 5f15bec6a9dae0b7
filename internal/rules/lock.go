package rules

import (
	"fmt"
	"slices"
	"strings"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// Lock fencing (docs/design.md, "Lock fencing"): before a statement that
// reads or writes a lock-fenced table runs, the session's token is
// registered for the session's lock by the procedure RegisterProc, in the
// same transaction. The rewriter finds those statements and prepares the
// registration; the proxy decides per session whether to send it.

// RegisterProc is the procedure `fenceproxy setup` installs that registers
// a session's token for its lock.
const RegisterProc = "fenceproxy.register"

// HoldProc is the procedure objects version 6 added: RegisterProc's
// arguments and outcome, its common case cheaper for the server. A Hold
// set's registrations call it.
const HoldProc = "fenceproxy.hold"

// EnterProc is the procedure objects version 7 added: it sets the
// session's fence settings for the transaction, runs the catalog check
// and calls HoldProc, in one call where the extended protocol sent three
// statements (LockCall.Enter).
const EnterProc = "fenceproxy.enter"

// HoldAtProc is the procedure objects version 8 added: the catalog check
// and a lock registration of a lock and a token given as values, in one
// call, which a simple Query's relay may send in place of the session's
// fence settings, the check and the registration (LockCall.HoldAt).
const HoldAtProc = "fenceproxy.hold_at"

// ReholdAtProc is the procedure objects version 9 added: HoldAtProc for a
// session whose registration of the same lock and token committed before,
// which reads the watermark once, after taking the lock shared
// (LockCall.ReholdAt).
const ReholdAtProc = "fenceproxy.rehold_at"

// maxLockTablesArg bounds the table list passed to the procedure (it only
// names tables in messages).
const maxLockTablesArg = 200

// LockCall is how a statement registers the session's token for the
// session's lock before it runs. It is part of a cached Decision: treat it
// as read-only.
type LockCall struct {
	// Call is the registration statement, without a semicolon, when the
	// text is a single statement (as a Parse's text must be): the proxy
	// runs it in the same transaction just before the statement.
	Call string
	// Query is the text to send instead for a simple Query: the decided
	// text (Decision.SQL for a Rewrite, the client's otherwise) with a
	// registration statement before each statement that needs one.
	Query string
	// Calls are the indexes, in Query's list of statements, of the
	// registration statements, whose results the client must not see
	// (each answers with one CommandComplete, "CALL"). Empty when the text
	// only PREPAREs statements that register: Call is then the
	// registration for when the prepared statement is executed (single
	// PREPARE texts), and Query the text unchanged.
	Calls []int
	// Required: a table of the statement (or of the statement a PREPARE
	// prepares) has lock: required, so the registration must run even in
	// a session that never named a lock (it then fails with FP002).
	Required bool
	// Audit: some registration is in audit mode (its tables are all in
	// mode audit): it may return without registering, so its success does
	// not prove the session registered.
	Audit bool
	// Catalog and Pre are the policy's, never the rewriter's. Catalog: the
	// call is not a lock registration but a check of the catalog stamp,
	// which reads no fence setting and is never spared. Pre, with a lock
	// registration, is the catalog check that runs just before it (Query
	// has it in front of the registrations, at Calls[0]), also where the
	// registration is spared or not needed.
	Catalog bool
	Pre     string
	// Stamp is the catalog check's stamp, where Catalog or Pre.
	Stamp int64
	// Args are the registration's arguments, where Call is a single
	// registration of this rule set's procedure (nil otherwise).
	Args *RegArgs
	// Enter, the policy's: the database has EnterProc, so the relay may
	// send the session's fence settings, the catalog check (Stamp) and the
	// registration (Args) before a Bind as one call of it.
	Enter bool
	// HoldAt, the policy's: the database has HoldAtProc, so the relay may
	// send the catalog check (Stamp) and the registration (Args) in front
	// of a simple Query as one call of it with the session's values.
	HoldAt bool
	// ReholdAt, the policy's: the database has ReholdAtProc too.
	ReholdAt bool
	// EndsTx: a statement that registers may commit or roll back its
	// transaction from stored code that reaches a lock-fenced table (a
	// CALL of a procedure the database's readers mark Reader.EndsTx, a DO
	// block whose code may, sqllex.MayEndTx): what it runs after
	// that would go without the registration. A simple Query's
	// registration in front makes the text one transaction block, where
	// the server refuses such a COMMIT; the relay refuses the Bind of such
	// a statement where the server would let it commit (outside a
	// transaction block).
	EndsTx bool
	// at and size: where in the decided text each registration was
	// inserted and how many bytes it took (with its semicolon).
	at, size []int
}

// RegArgs are the arguments of a registration call, in its procedure's
// order after the lock and token settings' names.
type RegArgs struct {
	LockSetting, TokenSetting string
	Required, Audit           bool
	Tag, Tables               string
}

// growAt returns lc for a decided text into which n bytes were inserted at
// byte pos, a place inside a statement (not where a registration goes).
func (lc *LockCall) growAt(final string, pos, n int) *LockCall {
	out := *lc
	k := pos
	for i, a := range lc.at {
		if a <= pos {
			k += lc.size[i]
		}
	}
	out.at = make([]int, len(lc.at))
	for i, a := range lc.at {
		out.at[i] = a
		if a > pos {
			out.at[i] += n
		}
	}
	if len(out.Calls) == 0 {
		out.Query = final
		return &out
	}
	out.Query = lc.Query[:k] + final[pos:pos+n] + lc.Query[k:]
	return &out
}

// HasLocks reports whether some table of the configuration has lock
// fencing (lock: optional or required) for some session.
func (r *Rules) HasLocks() bool { return r.anyLocks }

// ContainsFold reports whether s contains needle, ASCII letters of s
// compared without case (needle in lower case). It does not allocate.
func ContainsFold(s, needle string) bool { return indexFoldASCII(s, needle) >= 0 }

// lockUse is what one statement of a text needs from lock fencing.
type lockUse struct {
	enforce  []string // tables in mode enforce, display names
	audit    []string // tables in mode audit
	required bool     // some table has lock: required (enforce)
	auditReq bool     // some audit-mode table has lock: required
	// prepare: the statement is a PREPARE of a statement that registers;
	// the registration is for when it is executed, not now.
	prepare bool
	// endsTx: LockCall.EndsTx, for this statement.
	endsTx bool
}

// dataStatement reports whether a top-level statement reads or writes
// table data, so that it registers: queries, writes, COPY, cursors,
// EXPLAIN (ANALYZE runs the statement), CREATE TABLE AS, REFRESH
// MATERIALIZED VIEW (which registers only for a materialized view the
// database's Readers list) and CALL (a procedure the Readers list as
// reaching a table, or arguments that name one). DDL and utility
// statements on protected tables do not register.
func dataStatement(n *pg.Node) bool {
	switch n.Node.(type) {
	case *pg.Node_SelectStmt, *pg.Node_InsertStmt, *pg.Node_UpdateStmt, *pg.Node_DeleteStmt,
		*pg.Node_MergeStmt, *pg.Node_CopyStmt, *pg.Node_ExplainStmt, *pg.Node_DeclareCursorStmt,
		*pg.Node_CreateTableAsStmt, *pg.Node_RefreshMatViewStmt, *pg.Node_CallStmt:
		return true
	}
	return false
}

// lockUses returns, for each statement of tree, what lock fencing it
// needs (nil: none). Every relation a data statement names anywhere (FROM
// lists, subqueries, CTEs, targets) counts; an unqualified name counts for
// every protected table of that name. With readers, a relation of theirs
// counts for the tables it reaches.
func (r *Rules) lockUses(tree *pg.ParseResult, readers *Readers) []*lockUse {
	var out []*lockUse
	for i, raw := range tree.Stmts {
		stmt, prepare := raw.Stmt, false
		if p := stmt.GetPrepareStmt(); p != nil && p.Query != nil {
			stmt, prepare = p.Query, true
		}
		do := readers != nil && stmt.GetDoStmt() != nil
		if stmt == nil || !dataStatement(stmt) && !do {
			continue
		}
		var u *lockUse
		// optional: the use does not make the registration required
		// (a function that may read the table).
		add := func(t *tableRule, optional bool) {
			if u == nil {
				u = &lockUse{}
			}
			required := t.lock == lockRequired && !optional
			if t.audit {
				u.audit = append(u.audit, t.display)
				u.auditReq = u.auditReq || required
			} else {
				u.enforce = append(u.enforce, t.display)
				u.required = u.required || required
			}
		}
		if do {
			// A DO block runs now: one whose code names a reader, as a
			// word, registers (maybe: its code is not parsed).
			readers.codeTargets(r, codeBody(stmt.GetDoStmt(), ""), add)
		}
		walkMessages(stmt.ProtoReflect(), func(m protoreflect.Message) bool {
			if do {
				return false
			}
			switch n := m.Interface().(type) {
			case *pg.RangeVar:
				for _, t := range r.byRel[n.Relname] {
					if t.lock == lockOff || (n.Schemaname != "" && n.Schemaname != t.schema) {
						continue
					}
					add(t, false)
				}
				if readers != nil {
					readers.targets(r, n.Schemaname, n.Relname, readRel, add)
				}
			case *pg.RefreshMatViewStmt:
				if readers != nil && n.Relation != nil {
					readers.targets(r, n.Relation.Schemaname, n.Relation.Relname, readRefresh, add)
				}
			case *pg.FuncCall:
				if runsSQLText(n.Funcname) {
					for _, t := range r.tables {
						if t.lock != lockOff {
							add(t, true)
						}
					}
				}
				if readers != nil {
					readers.funcTargets(r, n.Funcname, add)
				}
			case *pg.A_Expr:
				// An operator runs its function.
				if readers != nil {
					readers.funcTargets(r, n.Name, add)
				}
			case *pg.ColumnRef:
				// t.f, where f is a function taking t's row type, calls
				// it (attribute notation).
				if readers != nil && len(n.Fields) > 1 {
					readers.targets(r, "", n.Fields[len(n.Fields)-1].GetString_().GetSval(), readFunc, add)
				}
			}
			return true
		})
		if u != nil {
			u.prepare = prepare
			switch {
			case do:
				u.endsTx = doMayEndTx(stmt.GetDoStmt())
			case stmt.GetCallStmt() != nil && readers != nil:
				if fc := stmt.GetCallStmt().GetFunccall(); fc != nil {
					u.endsTx = readers.endsTx(r, fc.Funcname)
				}
			}
			if out == nil {
				out = make([]*lockUse, len(tree.Stmts))
			}
			out[i] = u
		}
	}
	return out
}

// sqlTextFuncs are PostgreSQL's functions that run SQL given as text
// (query_to_xml, ts_stat) or read the tables of a relation, schema or
// database given by name or OID (table_to_xml and the others): a call of
// one may read any table, and write through any function the text calls,
// so it registers for every lock-fenced table (not required: it may read
// none).
var sqlTextFuncs = []string{
	"query_to_xml", "query_to_xmlschema", "query_to_xml_and_xmlschema",
	"table_to_xml", "table_to_xmlschema", "table_to_xml_and_xmlschema",
	"schema_to_xml", "schema_to_xmlschema", "schema_to_xml_and_xmlschema",
	"database_to_xml", "database_to_xmlschema", "database_to_xml_and_xmlschema",
	"ts_stat",
}

// runsSQLText reports whether the qualified name name (a list of strings)
// calls one of sqlTextFuncs (unqualified or in pg_catalog; a function of
// that name in another schema is judged by its body, as a reader).
func runsSQLText(name []*pg.Node) bool {
	schema, fn, ok := funcName(name)
	return ok && len(name) <= 2 && (schema == "" || schema == "pg_catalog") && slices.Contains(sqlTextFuncs, fn)
}

// doMayEndTx reports whether a DO block may commit or roll back: its
// code in PL/pgSQL does where sqllex.MayEndTx finds it may; code in
// another language may compute what it calls.
func doMayEndTx(do *pg.DoStmt) bool {
	for _, a := range do.GetArgs() {
		if e := a.GetDefElem(); e != nil && e.Defname == "language" && !strings.EqualFold(e.GetArg().GetString_().GetSval(), "plpgsql") {
			return true
		}
	}
	return sqllex.MayEndTx(codeBody(do, ""))
}

// callArgs are what the registration statement for u depends on.
func callArgs(u *lockUse) (list string, required, audit bool) {
	tables := sortedUnique(append(append([]string(nil), u.enforce...), u.audit...))
	list = strings.Join(tables, ", ")
	if len(list) > maxLockTablesArg {
		list = list[:maxLockTablesArg] + "..."
	}
	audit = len(u.enforce) == 0
	required = u.required || (audit && u.auditReq)
	return list, required, audit
}

// callNode builds the registration statement.
func (r *Rules) callNode(list string, required, audit bool) *pg.Node {
	return &pg.Node{Node: &pg.Node_CallStmt{CallStmt: &pg.CallStmt{
		Funccall: &pg.FuncCall{
			Funcname: []*pg.Node{pg.MakeStrNode("fenceproxy"), pg.MakeStrNode(r.procName())},
			Args: []*pg.Node{
				aStr(r.lockSetting), aStr(r.tokenSetting), aBool(required), aBool(audit),
				aStr(r.auditTag), aStr(list),
			},
			Funcformat: pg.CoercionForm_COERCE_EXPLICIT_CALL,
			Location:   -1,
		},
	}}}
}

// procName is the unqualified name of the procedure the set's
// registrations call.
func (r *Rules) procName() string {
	if r.hold {
		return strings.TrimPrefix(HoldProc, "fenceproxy.")
	}
	return strings.TrimPrefix(RegisterProc, "fenceproxy.")
}

// provenCall is a registration statement printed and proven.
type provenCall struct {
	text string
	raw  *pg.RawStmt // read-only once cached
}

// callText prints the registration statement for u and proves that it
// parses back into itself. Statements touch few distinct sets of tables,
// so proven prints are kept (at most maxProvenCalls per rule set).
func (r *Rules) callText(u *lockUse, version int32) (string, *pg.RawStmt, error) {
	list, required, audit := callArgs(u)
	key := fmt.Sprintf("%d|%t|%t|%s", version, required, audit, list)
	if v, ok := r.calls.Load(key); ok {
		c := v.(*provenCall)
		return c.text, c.raw, nil
	}
	raw := &pg.RawStmt{Stmt: r.callNode(list, required, audit)}
	tree := &pg.ParseResult{Version: version, Stmts: []*pg.RawStmt{raw}}
	text, err := pg.Deparse(tree)
	if err != nil {
		return "", nil, err
	}
	if err := verify(text, tree); err != nil {
		return "", nil, err
	}
	if r.nCalls.Add(1) <= maxProvenCalls {
		r.calls.Store(key, &provenCall{text: text, raw: raw})
	}
	return text, raw, nil
}

// maxProvenCalls bounds the registration prints a rule set keeps.
const maxProvenCalls = 1024

// lockCall prepares the registration for a decided text: final is the
// text that will be sent (rewritten or not), uses what each statement of
// the client's text needs (same statements, same order). It returns nil
// and an error when the registration cannot be prepared; the caller
// refuses the statement then.
func (r *Rules) lockCall(final string, version int32, uses []*lockUse) (*LockCall, error) {
	lc := &LockCall{}
	for _, u := range uses {
		if u != nil {
			lc.Required = lc.Required || u.required || (len(u.enforce) == 0 && u.auditReq)
			lc.Audit = lc.Audit || len(u.enforce) == 0
			lc.EndsTx = lc.EndsTx || u.endsTx && !u.prepare
		}
	}
	if len(uses) == 1 {
		text, _, err := r.callText(uses[0], version)
		if err != nil {
			return nil, err
		}
		if r.hold {
			list, required, audit := callArgs(uses[0])
			lc.Args = &RegArgs{LockSetting: r.lockSetting, TokenSetting: r.tokenSetting,
				Required: required, Audit: audit, Tag: r.auditTag, Tables: list}
		}
		if uses[0].prepare {
			lc.Call, lc.Query = text, final
			return lc, nil
		}
		// The registration statement is ASCII and ends at its semicolon,
		// after which the server's scanner is in its initial state
		// whatever the session's settings: the client's text that follows
		// is read exactly as it would be alone.
		lc.Call, lc.Query, lc.Calls = text, text+";"+final, []int{0}
		lc.at, lc.size = []int{0}, []int{len(text) + 1}
		return lc, nil
	}
	// Several statements: each registration goes where the statement's
	// text starts, just after the semicolon that ends the one before
	// (PostgreSQL's statement locations), in the text as sent.
	tree, err := pg.Parse(final)
	if err != nil {
		return nil, err
	}
	if len(tree.Stmts) != len(uses) {
		return nil, fmt.Errorf("the statement count changed in the rewrite")
	}
	var b strings.Builder
	expect := &pg.ParseResult{Version: tree.Version}
	pos := 0
	for i, raw := range tree.Stmts {
		if u := uses[i]; u != nil && !u.prepare {
			text, call, err := r.callText(u, tree.Version)
			if err != nil {
				return nil, err
			}
			loc := int(raw.StmtLocation)
			if loc < pos || loc > len(final) {
				return nil, fmt.Errorf("statement %d has no usable location", i)
			}
			b.WriteString(final[pos:loc])
			b.WriteString(text)
			b.WriteString(";")
			pos = loc
			lc.at, lc.size = append(lc.at, loc), append(lc.size, len(text)+1)
			lc.Calls = append(lc.Calls, len(expect.Stmts))
			expect.Stmts = append(expect.Stmts, call)
		}
		expect.Stmts = append(expect.Stmts, raw)
	}
	b.WriteString(final[pos:])
	lc.Query = b.String()
	if len(lc.Calls) == 0 {
		return lc, nil
	}
	if err := verify(lc.Query, expect); err != nil {
		return nil, err
	}
	return lc, nil
}
