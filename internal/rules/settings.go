package rules

import (
	"strconv"
	"strings"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// The session's fence settings, as PostgreSQL would hold them.
//
// The proxy keeps, per client session, the values of the token and lock
// settings (docs/design.md, "The session's fence settings"). SettingOps
// reads, from PostgreSQL's own parse of a text, every statement that can
// change them or that decides whether a change lasts (transaction
// control), so that the proxy never has to look for the settings' names
// as text: the parser has already undone quoting, case, Unicode escapes
// and comments.

// SettingKind is what a SettingOp does.
type SettingKind uint8

const (
	// SetValue sets Which to Value (Local: SET LOCAL, set_config(…, true)).
	SetValue SettingKind = iota + 1
	// SetDefault sets Which to its default (RESET, SET … TO DEFAULT).
	SetDefault
	// ResetAll sets both settings to their defaults (RESET ALL, DISCARD ALL).
	ResetAll
	// SetCurrent makes the effective value the session's (SET … FROM CURRENT).
	SetCurrent
	// SetParams is a set_config whose name, value or is_local is a bound
	// parameter (NameParam, ValueParam, LocalParam: 1-based; 0 when the
	// argument is the constant in Name, Value, Local).
	SetParams
	// SetUnknown: the statement may change a fence setting in a way the
	// statement does not show (an expression, a DO block, a PREPARE whose
	// statement changes one). Why says how.
	SetUnknown
	// Transaction control: each decides whether earlier changes last.
	TxBegin
	TxCommit
	TxRollback
	TxSavepoint
	TxRelease
	TxRollbackTo
	// TxPrepare is PREPARE TRANSACTION: session settings changed in the
	// transaction stay, as at a commit.
	TxPrepare
)

// Which fence setting a SettingOp changes.
const (
	SettingToken uint8 = 1 << iota
	SettingLock
)

// SettingOp is one statement's effect on the fence settings.
type SettingOp struct {
	Stmt  int // index of the statement in the text
	Kind  SettingKind
	Which uint8 // SettingToken, SettingLock, or both
	Value string
	Local bool
	// Null: set_config with a NULL value (PostgreSQL then sets the
	// default, as RESET does).
	Null                              bool
	Name                              string // set_config's constant name, for SetParams
	NameParam, ValueParam, LocalParam int
	Savepoint                         string // for TxSavepoint, TxRelease, TxRollbackTo
	Why                               string // for SetUnknown
	// Chain: COMMIT/ROLLBACK AND CHAIN, which begins a transaction at once.
	Chain bool
}

// SettingText is the result of SettingOps: the operations in statement
// order, and which statements name a protected table.
type SettingText struct {
	Ops []SettingOp
	// Stmts is the number of statements of the text.
	Stmts int
	// Protected[i]: statement i names a protected table (any mode).
	Protected []bool
	// Plain[i]: statement i is SET, RESET, transaction control or SELECT
	// set_config(…) alone, which runs no function of the user's;
	// Execute[i]: it is an EXECUTE; Write[i]: an INSERT, UPDATE, DELETE or
	// MERGE; Calls[i]: its text calls a function or procedure, or runs
	// stored code (DO, EXECUTE).
	Plain, Execute, Write, Calls []bool
	// LockTimeout[i]: statement i may change lock_timeout
	// (changesLockTimeout); MayWrite[i]: it may write a table itself
	// (writesTable).
	LockTimeout, MayWrite []bool
}

// WhichSetting reports which of the fence settings name is (PostgreSQL
// compares setting names without ASCII case), 0 if neither.
func (r *Rules) WhichSetting(name string) uint8 {
	switch {
	case strings.EqualFold(name, r.tokenSetting):
		return SettingToken
	case strings.EqualFold(name, r.lockSetting):
		return SettingLock
	}
	return 0
}

// SettingOps parses sql and returns what its statements do to the fence
// settings. An error means the text does not parse here (the proxy
// refuses it: the server's parser may accept it).
func (r *Rules) SettingOps(sql string) (SettingText, error) {
	if r.maxCheck > 0 && len(sql) > r.maxCheck {
		// Not parsed: a parse costs many times the text.
		return SettingText{Ops: []SettingOp{{Kind: SetUnknown, Which: SettingToken | SettingLock,
			Why: "a text longer than max_check_bytes that may change them"}}}, nil
	}
	tree, err := pg.Parse(sql)
	if err != nil {
		return SettingText{}, err
	}
	n := len(tree.Stmts)
	out := SettingText{Stmts: n, Protected: make([]bool, n), Plain: make([]bool, n), Execute: make([]bool, n), Write: make([]bool, n), Calls: make([]bool, n),
		LockTimeout: make([]bool, n), MayWrite: make([]bool, n)}
	for i, raw := range tree.Stmts {
		if raw.Stmt == nil {
			continue
		}
		out.Protected[i] = r.namesProtected(raw.Stmt)
		out.Calls[i] = callsCode(raw.Stmt)
		out.LockTimeout[i] = changesLockTimeout(raw.Stmt)
		out.MayWrite[i] = writesTable(raw.Stmt)
		switch raw.Stmt.Node.(type) {
		case *pg.Node_VariableSetStmt, *pg.Node_TransactionStmt:
			out.Plain[i] = true
		case *pg.Node_SelectStmt:
			// SELECT set_config(…)[, …] and nothing else.
			out.Plain[i] = plainSelectOf(raw.Stmt, len(raw.Stmt.GetSelectStmt().GetTargetList()))
		case *pg.Node_ExecuteStmt:
			out.Execute[i] = true
		case *pg.Node_InsertStmt, *pg.Node_UpdateStmt, *pg.Node_DeleteStmt, *pg.Node_MergeStmt:
			out.Write[i] = true
		}
		out.Ops = append(out.Ops, r.stmtSettingOps(i, raw.Stmt)...)
	}
	return out, nil
}

// callsCode reports whether n's text calls a function or procedure or
// runs stored code.
func callsCode(n *pg.Node) bool {
	found := false
	walkMessages(n.ProtoReflect(), func(m protoreflect.Message) bool {
		switch m.Interface().(type) {
		case *pg.FuncCall, *pg.CallStmt, *pg.DoStmt, *pg.ExecuteStmt:
			found = true
		}
		return !found
	})
	return found
}

// changesLockTimeout reports whether n may change lock_timeout, which the
// catalog check sets for the rest of a write's transaction while a
// change of the catalog is under way: a SET, SET LOCAL, RESET or SET … TO
// DEFAULT of it, RESET ALL, DISCARD ALL, a call of set_config whose name
// is not a constant naming another setting, or an UPDATE of pg_settings
// (its rule calls set_config). Stored code the statement calls, and views
// over pg_settings, are not seen.
func changesLockTimeout(n *pg.Node) bool {
	switch s := n.Node.(type) {
	case *pg.Node_VariableSetStmt:
		v := s.VariableSetStmt
		return v.Kind == pg.VariableSetKind_VAR_RESET_ALL || strings.EqualFold(v.Name, "lock_timeout")
	case *pg.Node_DiscardStmt:
		return s.DiscardStmt.Target == pg.DiscardMode_DISCARD_ALL
	}
	found := false
	walkMessages(n.ProtoReflect(), func(m protoreflect.Message) bool {
		if u, ok := m.Interface().(*pg.UpdateStmt); ok && u.Relation != nil && strings.EqualFold(u.Relation.Relname, "pg_settings") {
			// pg_settings' rule turns an UPDATE of it into set_config.
			found = true
		}
		if fc, ok := m.Interface().(*pg.FuncCall); ok && isSetConfig(fc) {
			name, ok := "", len(fc.Args) > 0
			if ok {
				name, ok = constText(fc.Args[0])
			}
			found = !ok || strings.EqualFold(name, "lock_timeout")
		}
		return !found
	})
	return found
}

// writesTable reports whether n may write a table itself: an INSERT,
// UPDATE, DELETE or MERGE anywhere in it (a CTE, EXPLAIN ANALYZE's
// statement, COPY's query), COPY … FROM, TRUNCATE, or code it runs
// (EXECUTE, CALL, DO). A function called in a query is not counted.
func writesTable(n *pg.Node) bool {
	found := false
	walkMessages(n.ProtoReflect(), func(m protoreflect.Message) bool {
		switch x := m.Interface().(type) {
		case *pg.InsertStmt, *pg.UpdateStmt, *pg.DeleteStmt, *pg.MergeStmt, *pg.TruncateStmt,
			*pg.ExecuteStmt, *pg.CallStmt, *pg.DoStmt:
			found = true
		case *pg.CopyStmt:
			found = x.IsFrom
		}
		return !found
	})
	return found
}

// namesProtected reports whether n names a protected table anywhere.
func (r *Rules) namesProtected(n *pg.Node) bool {
	found := false
	walkMessages(n.ProtoReflect(), func(m protoreflect.Message) bool {
		if found {
			return false
		}
		if rv, ok := m.Interface().(*pg.RangeVar); ok && len(r.byRel[rv.Relname]) > 0 {
			found = true
		}
		return !found
	})
	return found
}

func (r *Rules) stmtSettingOps(i int, n *pg.Node) []SettingOp {
	switch s := n.Node.(type) {
	case *pg.Node_VariableSetStmt:
		return r.variableSetOps(i, s.VariableSetStmt)
	case *pg.Node_DiscardStmt:
		if s.DiscardStmt.Target == pg.DiscardMode_DISCARD_ALL {
			return []SettingOp{{Stmt: i, Kind: ResetAll, Which: SettingToken | SettingLock}}
		}
		return nil
	case *pg.Node_TransactionStmt:
		return transactionOps(i, s.TransactionStmt)
	case *pg.Node_DoStmt:
		// The body is code the proxy does not run: if it may touch the
		// settings (it mentions set_config, SET or a setting's name), what
		// it does cannot be known from the statement.
		for _, a := range s.DoStmt.Args {
			de := a.GetDefElem()
			if de == nil || de.Defname != "as" {
				continue
			}
			body := de.Arg.GetString_().GetSval()
			if r.mayChangeSettings(body) {
				return []SettingOp{{Stmt: i, Kind: SetUnknown, Which: SettingToken | SettingLock,
					Why: "a DO block that may change " + r.tokenSetting + " or " + r.lockSetting}}
			}
		}
		return nil
	case *pg.Node_PrepareStmt:
		if s.PrepareStmt.Query != nil {
			if ops := r.setConfigOps(i, s.PrepareStmt.Query); len(ops) > 0 {
				return []SettingOp{{Stmt: i, Kind: SetUnknown, Which: SettingToken | SettingLock,
					Why: "a prepared statement that calls set_config (EXECUTE would change the setting where the proxy cannot see the values)"}}
			}
		}
		return nil
	}
	return r.setConfigOps(i, n)
}

// mayChangeSettings is the conservative test for code the proxy cannot
// parse as SQL (a DO block's body): it mentions set_config, RESET or
// DISCARD, a Unicode escape, or the first part of either setting's name
// ("fence" of fence.lock), in any case, quoted or not. Dynamic SQL that
// builds the name from pieces is not seen (docs/design.md).
func (r *Rules) mayChangeSettings(code string) bool {
	lower := strings.ToLower(code)
	for _, w := range []string{"set_config", "reset", "discard", "u&", firstPart(r.tokenSetting), firstPart(r.lockSetting)} {
		if strings.Contains(lower, w) {
			return true
		}
	}
	return false
}

func firstPart(setting string) string {
	p, _, _ := strings.Cut(strings.ToLower(setting), ".")
	return p
}

func (r *Rules) variableSetOps(i int, v *pg.VariableSetStmt) []SettingOp {
	switch v.Kind {
	case pg.VariableSetKind_VAR_RESET_ALL:
		return []SettingOp{{Stmt: i, Kind: ResetAll, Which: SettingToken | SettingLock}}
	case pg.VariableSetKind_VAR_SET_MULTI:
		return nil
	}
	which := r.WhichSetting(v.Name)
	if which == 0 {
		return nil
	}
	op := SettingOp{Stmt: i, Which: which, Local: v.IsLocal}
	switch v.Kind {
	case pg.VariableSetKind_VAR_SET_VALUE:
		if len(v.Args) != 1 {
			return nil // PostgreSQL refuses it: "SET takes only one argument"
		}
		val, ok := setArgValue(v.Args[0])
		if !ok {
			return []SettingOp{{Stmt: i, Kind: SetUnknown, Which: which, Why: "a SET whose value the proxy cannot read"}}
		}
		op.Kind, op.Value = SetValue, val
	case pg.VariableSetKind_VAR_SET_DEFAULT, pg.VariableSetKind_VAR_RESET:
		op.Kind = SetDefault
	case pg.VariableSetKind_VAR_SET_CURRENT:
		op.Kind = SetCurrent
	default:
		return []SettingOp{{Stmt: i, Kind: SetUnknown, Which: which, Why: "a SET of a kind the proxy does not know"}}
	}
	return []SettingOp{op}
}

// setArgValue is the text PostgreSQL makes of a SET's value
// (flatten_set_variable_args): integers in decimal, other numbers and
// strings as written.
func setArgValue(n *pg.Node) (string, bool) {
	c := n.GetAConst()
	if c == nil || c.Isnull {
		return "", false
	}
	switch v := c.Val.(type) {
	case *pg.A_Const_Ival:
		return strconv.FormatInt(int64(v.Ival.Ival), 10), true
	case *pg.A_Const_Fval:
		return v.Fval.Fval, true
	case *pg.A_Const_Sval:
		return v.Sval.Sval, true
	case *pg.A_Const_Boolval:
		if v.Boolval.Boolval {
			return "true", true
		}
		return "false", true
	}
	return "", false
}

func transactionOps(i int, t *pg.TransactionStmt) []SettingOp {
	op := SettingOp{Stmt: i, Chain: t.Chain}
	switch t.Kind {
	case pg.TransactionStmtKind_TRANS_STMT_BEGIN, pg.TransactionStmtKind_TRANS_STMT_START:
		op.Kind = TxBegin
	case pg.TransactionStmtKind_TRANS_STMT_COMMIT:
		op.Kind = TxCommit
	case pg.TransactionStmtKind_TRANS_STMT_ROLLBACK:
		op.Kind = TxRollback
	case pg.TransactionStmtKind_TRANS_STMT_SAVEPOINT:
		op.Kind, op.Savepoint = TxSavepoint, t.SavepointName
	case pg.TransactionStmtKind_TRANS_STMT_RELEASE:
		op.Kind, op.Savepoint = TxRelease, t.SavepointName
	case pg.TransactionStmtKind_TRANS_STMT_ROLLBACK_TO:
		op.Kind, op.Savepoint = TxRollbackTo, t.SavepointName
	case pg.TransactionStmtKind_TRANS_STMT_PREPARE:
		op.Kind = TxPrepare
	default:
		return nil // COMMIT PREPARED, ROLLBACK PREPARED: another transaction
	}
	return []SettingOp{op}
}

// setConfigOps finds the calls of set_config in n. A statement that is
// exactly SELECT set_config(…)[, set_config(…)…] with constant or
// parameter arguments runs each call once, in order: its effects are
// known. A call anywhere else (a WHERE clause, a subquery, a CTE, with a
// FROM list) may run any number of times, or not at all.
func (r *Rules) setConfigOps(i int, n *pg.Node) []SettingOp {
	var calls []*pg.FuncCall
	walkMessages(n.ProtoReflect(), func(m protoreflect.Message) bool {
		if fc, ok := m.Interface().(*pg.FuncCall); ok && isSetConfig(fc) {
			calls = append(calls, fc)
		}
		return true
	})
	if len(calls) == 0 {
		return nil
	}
	plain := plainSelectOf(n, len(calls))
	var ops []SettingOp
	for _, fc := range calls {
		op, mine := r.setConfigOp(i, fc)
		if !mine {
			continue
		}
		if !plain && op.Kind != SetUnknown {
			op = SettingOp{Stmt: i, Kind: SetUnknown, Which: SettingToken | SettingLock,
				Why: "set_config called where it may run any number of times (use SET, or SELECT set_config(…) alone)"}
		}
		ops = append(ops, op)
	}
	return ops
}

func isSetConfig(fc *pg.FuncCall) bool {
	// Up to three parts: PostgreSQL accepts the current database's name
	// before the schema's (db.pg_catalog.set_config).
	names := fc.Funcname
	if len(names) == 0 || len(names) > 3 {
		return false
	}
	return names[len(names)-1].GetString_().GetSval() == "set_config"
}

// plainSelectOf reports whether n is SELECT with only a target list whose
// every entry is a call of set_config (calls of them in all), and nothing
// else: no FROM, WHERE, GROUP BY, HAVING, set operation, LIMIT or locking.
func plainSelectOf(n *pg.Node, calls int) bool {
	s := n.GetSelectStmt()
	if s == nil || s.Op != pg.SetOperation_SETOP_NONE || len(s.FromClause) > 0 || s.WhereClause != nil ||
		s.GroupClause != nil || s.HavingClause != nil || s.LimitCount != nil || s.LimitOffset != nil ||
		s.WithClause != nil || len(s.ValuesLists) > 0 || len(s.LockingClause) > 0 || len(s.DistinctClause) > 0 ||
		s.IntoClause != nil || len(s.WindowClause) > 0 || len(s.TargetList) != calls {
		return false
	}
	for _, t := range s.TargetList {
		rt := t.GetResTarget()
		if rt == nil || rt.Val == nil {
			return false
		}
		fc := rt.Val.GetFuncCall()
		if fc == nil || !isSetConfig(fc) || fc.Over != nil || fc.AggFilter != nil || len(fc.AggOrder) > 0 || fc.AggStar || fc.FuncVariadic {
			return false
		}
	}
	return true
}

// setConfigOp reads one call; mine is false when its constant name is
// neither fence setting.
func (r *Rules) setConfigOp(i int, fc *pg.FuncCall) (op SettingOp, mine bool) {
	unknown := SettingOp{Stmt: i, Kind: SetUnknown, Which: SettingToken | SettingLock,
		Why: "set_config with arguments the proxy cannot read (use constants or parameters)"}
	if len(fc.Args) != 3 {
		return unknown, true // no such function; but do not guess
	}
	op = SettingOp{Stmt: i, Kind: SetValue}
	params := false
	// The name.
	if p := paramNumber(fc.Args[0]); p > 0 {
		op.NameParam, params = p, true
		op.Which = SettingToken | SettingLock
	} else if s, ok := constText(fc.Args[0]); ok {
		op.Which = r.WhichSetting(s)
		if op.Which == 0 {
			return SettingOp{}, false
		}
		op.Name = s
	} else {
		return unknown, true
	}
	// The value.
	if p := paramNumber(fc.Args[1]); p > 0 {
		op.ValueParam, params = p, true
	} else if isNullConst(fc.Args[1]) {
		op.Null = true
	} else if s, ok := constText(fc.Args[1]); ok {
		op.Value = s
	} else {
		return unknown, true
	}
	// is_local.
	if p := paramNumber(fc.Args[2]); p > 0 {
		op.LocalParam, params = p, true
	} else if b, ok := constBool(fc.Args[2]); ok {
		op.Local = b
	} else {
		return unknown, true
	}
	if params {
		op.Kind = SetParams
	}
	return op, true
}

func paramNumber(n *pg.Node) int {
	if tc := n.GetTypeCast(); tc != nil && tc.Arg != nil {
		n = tc.Arg
	}
	if p := n.GetParamRef(); p != nil && p.Number > 0 {
		return int(p.Number)
	}
	return 0
}

func isNullConst(n *pg.Node) bool {
	if tc := n.GetTypeCast(); tc != nil && tc.Arg != nil {
		n = tc.Arg
	}
	c := n.GetAConst()
	return c != nil && c.Isnull
}

// constText reads a string constant, bare or cast to text or varchar.
func constText(n *pg.Node) (string, bool) {
	if tc := n.GetTypeCast(); tc != nil && tc.Arg != nil {
		if !castToText(tc.TypeName) {
			return "", false
		}
		n = tc.Arg
	}
	c := n.GetAConst()
	if c == nil || c.Isnull {
		return "", false
	}
	if s, ok := c.Val.(*pg.A_Const_Sval); ok {
		return s.Sval.Sval, true
	}
	return "", false
}

func castToText(t *pg.TypeName) bool {
	if t == nil || len(t.ArrayBounds) > 0 || len(t.Typmods) > 0 {
		return false
	}
	name := t.Names[len(t.Names)-1].GetString_().GetSval()
	return name == "text" || name == "varchar"
}

// constBool reads set_config's is_local as PostgreSQL's boolean input
// does: true/false keywords, or a string it accepts.
func constBool(n *pg.Node) (bool, bool) {
	if tc := n.GetTypeCast(); tc != nil && tc.Arg != nil {
		n = tc.Arg
	}
	c := n.GetAConst()
	if c == nil || c.Isnull {
		return false, false
	}
	switch v := c.Val.(type) {
	case *pg.A_Const_Boolval:
		return v.Boolval.Boolval, true
	case *pg.A_Const_Sval:
		return ParseBool(v.Sval.Sval)
	}
	return false, false
}

// ParseBool reads a boolean as PostgreSQL's boolin does: t, true, y, yes,
// on, 1 and their negations, any prefix of true/false/yes/no that is
// unambiguous, ASCII case ignored, surrounding white space allowed.
func ParseBool(s string) (bool, bool) {
	s = strings.ToLower(strings.Trim(s, " \t\n\r\f\v"))
	if s == "" {
		return false, false
	}
	switch {
	case strings.HasPrefix("true", s), strings.HasPrefix("yes", s), s == "on", s == "1":
		return true, true
	case strings.HasPrefix("false", s), strings.HasPrefix("no", s), s == "of", s == "off", s == "0":
		return false, true
	}
	return false, false
}
