package rules_test

import (
	"fmt"
	"strings"
	"sync"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// checkFenced is an independent check of rewritten SQL: it parses sql and
// verifies that every write to a table protected by cfg carries the fence,
// by looking at the output tree only (not at how the rewriter built it).
// It checks structure (the fence column is assigned exactly once, every
// inserted row is stamped, every DELETE is conditioned, ...) and that the
// fence expressions read the token from the configured setting.
//
// A table in audit mode counts as handled when its writes carry the audit
// expressions (the fence column assigned with the audit CASE, stale rows
// and invalid tokens recorded with pg_notify) and never raise. With
// auditRefused (Decision.AuditRefusal set), writes to audit tables may also
// be left as the client sent them.
func checkFenced(sql string, cfg rules.Config, auditRefused bool) error {
	tree, err := pg.Parse(sql)
	if err != nil {
		return fmt.Errorf("does not parse: %v", err)
	}
	if _, err := pg.Deparse(tree); err != nil {
		return fmt.Errorf("does not deparse: %v", err)
	}
	c := &checker{cfg: cfg}
	c.setting = strings.ToLower(cfg.TokenSetting)
	if c.setting == "" {
		c.setting = rules.DefaultTokenSetting
	}
	c.tok = "pg_catalog.current_setting('" + c.setting + "', true)::bigint"
	for _, tb := range cfg.Tables {
		// The root rule set applies the unscoped entries.
		if tb.Mode == "off" || len(tb.Scope.Databases)+len(tb.Scope.Users)+len(tb.Scope.ApplicationNames) > 0 {
			continue
		}
		parts := splitName(tb.Table)
		col := rules.DefaultColumn
		if tb.Column != "" {
			col = splitName(tb.Column)[0]
		}
		ct := checkTable{schema: parts[0], rel: parts[1], col: col,
			skip: tb.OnStale == "skip", allow: tb.MissingToken == "allow", audit: tb.Mode == "audit", strict: tb.Strict}
		if ct.audit {
			ct.skip, ct.allow = false, false
		}
		c.tables = append(c.tables, ct)
	}
	c.auditRefused = auditRefused
	for _, s := range tree.Stmts {
		walkMessages(s.ProtoReflect(), c.visit)
		if c.err != nil {
			return c.err
		}
	}
	return nil
}

// splitName is a minimal identifier splitter for the test configs.
func splitName(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ".") {
		if strings.HasPrefix(p, `"`) {
			out = append(out, strings.Trim(p, `"`))
		} else {
			out = append(out, strings.ToLower(p))
		}
	}
	return out
}

type checkTable struct {
	schema, rel, col string
	skip, allow      bool
	audit, strict    bool
}

// lenient reports whether an invalid token lets the write through (and
// must be recorded).
func (t *checkTable) lenient() bool { return t.allow || t.audit }

func (t *checkTable) mode() string {
	if t.audit {
		return "audit"
	}
	return "enforce"
}

type checker struct {
	cfg          rules.Config
	setting      string
	tok          string
	tables       []checkTable
	auditRefused bool
	err          error
}

// records reports whether expression text s sends an audit notification
// for reason, in t's mode.
func (c *checker) records(s string, t *checkTable, reason string) bool {
	return strings.Contains(s, "pg_catalog.pg_notify('fenceproxy_audit', pg_catalog.json_build_object('v', 1, ") &&
		strings.Contains(s, "'m', '"+t.mode()+"', 'r', '"+reason+"'")
}

// raises reports whether expression text s can raise a fenceproxy error.
func raises(s string) bool { return raisesStale(s) || raisesToken(s) }

// raisesStale reports whether expression text s can raise the stale-token
// error: inline (a marker cast) or through the server's error raisers.
func raisesStale(s string) bool {
	return strings.Contains(s, "fenceproxy:stale:") || strings.Contains(s, "fenceproxy.stale(") || strings.Contains(s, "fenceproxy.stale_b(") ||
		strings.Contains(s, "fenceproxy.advance(")
}

// raisesToken is raisesStale for the invalid-token error.
func raisesToken(s string) bool {
	return strings.Contains(s, "fenceproxy:token:") || strings.Contains(s, "fenceproxy.no_token(") || strings.Contains(s, "fenceproxy.no_token_b(") ||
		strings.Contains(s, "fenceproxy.tok(") || strings.Contains(s, "fenceproxy.tok_b(") || strings.Contains(s, "fenceproxy.advance(")
}

// stampsToken reports whether expression text s yields the token for t:
// read inline, or through fenceproxy.tok (which raises for an invalid
// token, so only where that is what t wants).
func (c *checker) stampsToken(s string, t *checkTable) bool {
	return strings.Contains(s, c.tok) || !t.lenient() && strings.Contains(s, "fenceproxy.tok('"+c.setting+"', ")
}

// advanceCall reports whether v is the error raisers' checked fence value
// for t: fenceproxy.advance('<setting>', <qualifier>.<fence column>,
// <t's strictness>, ...).
//
// A fence value that replaces the client's own keeps it in a branch that
// is never taken (CASE WHEN false THEN <client's> ELSE <value> END, so that
// its parameters keep their types): the value is the ELSE.
func (c *checker) advanceCall(v *pg.Node, t *checkTable) bool {
	if ce := v.GetCaseExpr(); ce != nil && len(ce.Args) == 1 && ce.Defresult != nil {
		if cond := ce.Args[0].GetCaseWhen().GetExpr().GetAConst(); cond != nil && cond.GetBoolval() != nil && !cond.GetBoolval().Boolval {
			v = ce.Defresult
		}
	}
	f := v.GetFuncCall()
	if f == nil || len(f.Funcname) != 2 || f.Funcname[0].GetString_().GetSval() != "fenceproxy" ||
		f.Funcname[1].GetString_().GetSval() != "advance" || len(f.Args) != 5 {
		return false
	}
	col := f.Args[1].GetColumnRef()
	if f.Args[0].GetAConst().GetSval().GetSval() != c.setting || col == nil || len(col.Fields) != 2 ||
		col.Fields[1].GetString_().GetSval() != t.col {
		return false
	}
	strict := f.Args[2].GetAConst()
	return strict.GetBoolval() != nil && strict.GetBoolval().Boolval == t.strict &&
		f.Args[3].GetAConst().GetSval() != nil && f.Args[4].GetAConst().GetSval() != nil
}

// unrewritten reports whether an audit write was left as the client sent it
// because enforce would have refused it.
func (c *checker) unrewritten(t *checkTable, m protoreflect.ProtoMessage) bool {
	if !t.audit || !c.auditRefused {
		return false
	}
	// Its own parts, not its WITH clause: a write there (a CTE's DELETE)
	// carries its own audit expressions, which do not make this one
	// rewritten.
	found := false
	var walk func(protoreflect.Message)
	walk = func(pm protoreflect.Message) {
		if !pm.IsValid() || found {
			return
		}
		switch n := pm.Interface().(type) {
		case *pg.WithClause:
			return
		case *pg.FuncCall:
			if len(n.Funcname) == 2 && n.Funcname[1].GetString_().GetSval() == "pg_notify" {
				found = true
				return
			}
		}
		pm.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			switch {
			case fd.Message() == nil || fd.IsMap():
			case fd.IsList():
				for i := 0; i < v.List().Len(); i++ {
					walk(v.List().Get(i).Message())
				}
			default:
				walk(v.Message())
			}
			return true
		})
	}
	walk(m.ProtoReflect())
	return !found
}

func walkMessages(m protoreflect.Message, f func(protoreflect.ProtoMessage)) {
	if !m.IsValid() {
		return
	}
	f(m.Interface())
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Message() == nil || fd.IsMap() {
			return true
		}
		if fd.IsList() {
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				walkMessages(l.Get(i).Message(), f)
			}
		} else {
			walkMessages(v.Message(), f)
		}
		return true
	})
}

func (c *checker) match(rv *pg.RangeVar) *checkTable {
	if rv == nil {
		return nil
	}
	for i, t := range c.tables {
		if t.rel == rv.Relname && (rv.Schemaname == "" || rv.Schemaname == t.schema) {
			return &c.tables[i]
		}
	}
	return nil
}

func (c *checker) fail(format string, args ...any) {
	if c.err == nil {
		c.err = fmt.Errorf(format, args...)
	}
}

// parserVersion is the parse tree version Deparse expects.
var parserVersion = sync.OnceValue(func() int32 {
	t, err := pg.Parse("SELECT")
	if err != nil {
		panic(err)
	}
	return t.Version
})

// expr deparses one expression.
func expr(n *pg.Node) string {
	if n == nil {
		return ""
	}
	tree := &pg.ParseResult{Stmts: []*pg.RawStmt{{Stmt: &pg.Node{Node: &pg.Node_SelectStmt{SelectStmt: &pg.SelectStmt{
		TargetList:  []*pg.Node{pg.MakeResTargetNodeWithVal(n, 0)},
		LimitOption: pg.LimitOption_LIMIT_OPTION_DEFAULT,
		Op:          pg.SetOperation_SETOP_NONE,
	}}}}}}
	tree.Version = parserVersion()
	s, err := pg.Deparse(tree)
	if err != nil {
		return "<" + err.Error() + ">"
	}
	return strings.TrimPrefix(s, "SELECT ")
}

func (c *checker) visit(m protoreflect.ProtoMessage) {
	switch n := m.(type) {
	case *pg.UpdateStmt:
		if t := c.match(n.Relation); t != nil && !c.unrewritten(t, n) {
			currentOf := n.WhereClause.GetCurrentOfExpr() != nil
			c.checkSet("UPDATE", n.TargetList, t, currentOf)
			where := expr(n.WhereClause)
			if t.skip && !strings.Contains(where, t.col) {
				c.fail("UPDATE (skip) WHERE has no fence condition: %s", where)
			}
			if !t.lenient() && !currentOf && !raisesToken(where) {
				c.fail("UPDATE WHERE has no token guard: %s", where)
			}
			if t.lenient() && !currentOf && !c.records(where, t, "missing_token") {
				c.fail("UPDATE WHERE does not record an invalid token: %s", where)
			}
			if t.audit && raises(where) {
				c.fail("audit UPDATE WHERE can raise: %s", where)
			}
		}
	case *pg.DeleteStmt:
		if t := c.match(n.Relation); t != nil && !c.unrewritten(t, n) {
			where := expr(n.WhereClause)
			if !strings.Contains(where, t.col) || !strings.Contains(where, c.tok) {
				c.fail("DELETE WHERE has no fence condition: %s", where)
			}
			if !t.skip && !t.audit && !raisesStale(where) {
				c.fail("DELETE (error) WHERE does not raise: %s", where)
			}
			if !t.lenient() && !raisesToken(where) {
				c.fail("DELETE WHERE has no token guard: %s", where)
			}
			if t.lenient() && !c.records(where, t, "missing_token") {
				c.fail("DELETE WHERE does not record an invalid token: %s", where)
			}
			if t.audit && (raises(where) || !c.records(where, t, "stale")) {
				c.fail("audit DELETE WHERE raises or does not record stale rows: %s", where)
			}
		}
	case *pg.InsertStmt:
		if t := c.match(n.Relation); t != nil && !c.unrewritten(t, n) {
			c.checkInsert(n, t)
		}
	case *pg.MergeStmt:
		if t := c.match(n.Relation); t != nil && !c.unrewritten(t, n) {
			c.checkMerge(n, t)
		}
	case *pg.CopyStmt:
		if t := c.match(n.Relation); t != nil && n.IsFrom && !(t.audit && c.auditRefused) {
			c.fail("COPY FROM into protected table %s", t.rel)
		}
	case *pg.TruncateStmt:
		for _, r := range n.Relations {
			if t := c.match(r.GetRangeVar()); t != nil && !(t.audit && c.auditRefused) {
				c.fail("TRUNCATE of protected table %s", t.rel)
			}
		}
	}
}

// checkSet verifies a SET list assigns the fence column exactly once, with
// an expression of the token (and, in error mode, the stale raise; in audit
// mode, the stale record and no raise). selfContained is true when nothing
// else in the statement deals with an invalid token (WHERE CURRENT OF, a
// MERGE action): the value must raise, or record, it.
func (c *checker) checkSet(what string, tl []*pg.Node, t *checkTable, selfContained bool) {
	count := 0
	for _, n := range tl {
		rt := n.GetResTarget()
		if rt.GetName() != t.col {
			continue
		}
		count++
		val := rt.Val
		if ma := val.GetMultiAssignRef(); ma != nil {
			// The client's row assigns it: the proxy's value replaces the
			// client's inside the row.
			row := ma.Source.GetRowExpr()
			if row == nil || int(ma.Colno) > len(row.Args) {
				c.fail("%s assigns the fence column in a multi-column SET from a sub-SELECT", what)
				return
			}
			val = row.Args[ma.Colno-1]
		}
		v := expr(val)
		advance := c.advanceCall(val, t)
		if !strings.Contains(v, c.tok) && !advance {
			c.fail("%s SET %s = %s does not use the token", what, t.col, v)
		}
		if advance && (t.skip || t.lenient()) {
			// It raises for stale rows and invalid tokens.
			c.fail("%s SET %s = %s: advance in skip, allow or audit mode", what, t.col, v)
		}
		switch {
		case t.audit:
			if raises(v) || !c.records(v, t, "stale") || !strings.Contains(v, t.col+" OPERATOR(pg_catalog.<") {
				c.fail("%s (audit) SET %s = %s raises or does not record stale rows", what, t.col, v)
			}
		case !t.skip:
			if !advance && (!raisesStale(v) || !strings.Contains(v, t.col+" OPERATOR(pg_catalog.<")) {
				c.fail("%s (error) SET %s = %s does not check the fence", what, t.col, v)
			}
		}
		if selfContained && !t.lenient() && !raisesToken(v) {
			c.fail("%s SET %s = %s does not check the token", what, t.col, v)
		}
		if selfContained && t.lenient() && !c.records(v, t, "missing_token") {
			c.fail("%s SET %s = %s does not record an invalid token", what, t.col, v)
		}
	}
	if count != 1 {
		c.fail("%s assigns the fence column %d times", what, count)
	}
}

// checkStamp checks the fence value of a new row; record is true for the
// rows that must record an invalid token (the first of a VALUES list).
func (c *checker) checkStamp(what string, v *pg.Node, t *checkTable, record bool) {
	s := expr(v)
	if !c.stampsToken(s, t) {
		c.fail("%s: fence value %s does not use the token", what, s)
	}
	if !t.lenient() && record && !raisesToken(s) {
		c.fail("%s: fence value %s does not check the token", what, s)
	}
	if t.lenient() && record && !c.records(s, t, "missing_token") {
		c.fail("%s: fence value %s does not record an invalid token", what, s)
	}
	if t.audit && raises(s) {
		c.fail("%s: audit fence value %s can raise", what, s)
	}
}

func (c *checker) checkInsert(n *pg.InsertStmt, t *checkTable) {
	var idx []int
	for i, col := range n.Cols {
		if col.GetResTarget().GetName() == t.col {
			idx = append(idx, i)
		}
	}
	if len(idx) == 0 {
		c.fail("INSERT does not list the fence column")
		return
	}
	sel := n.SelectStmt.GetSelectStmt()
	if sel == nil {
		c.fail("INSERT has no row source")
		return
	}
	var leaf func(s *pg.SelectStmt)
	leaf = func(s *pg.SelectStmt) {
		if s == nil {
			c.fail("INSERT set operation without a branch")
			return
		}
		if s.Op != pg.SetOperation_SETOP_NONE {
			leaf(s.Larg)
			leaf(s.Rarg)
			return
		}
		// pos maps a column position to the item that feeds it; when the
		// fence column is the last column, the stamp must be the last
		// item (a row of the wrong length makes PostgreSQL fail anyway).
		at := func(i, length int) int {
			if i == len(n.Cols)-1 {
				return length - 1
			}
			return i
		}
		if len(s.ValuesLists) > 0 {
			for r, row := range s.ValuesLists {
				items := row.GetList().GetItems()
				for _, i := range idx {
					j := at(i, len(items))
					if j < 0 || j >= len(items) {
						c.fail("INSERT VALUES row too short")
						return
					}
					c.checkStamp("INSERT VALUES", items[j], t, r == 0)
				}
			}
			return
		}
		star := false
		for _, tn := range s.TargetList {
			if cr := tn.GetResTarget().GetVal().GetColumnRef(); cr != nil && cr.Fields[len(cr.Fields)-1].GetAStar() != nil {
				star = true
			}
		}
		if star {
			// "*" expands to an unknown number of columns: the stamp
			// must be the last column of both lists.
			if len(idx) != 1 || idx[0] != len(n.Cols)-1 || len(s.TargetList) == 0 {
				c.fail("INSERT SELECT * without the stamp as the last column")
				return
			}
			c.checkStamp("INSERT SELECT", s.TargetList[len(s.TargetList)-1].GetResTarget().GetVal(), t, true)
			return
		}
		for _, i := range idx {
			j := at(i, len(s.TargetList))
			if j < 0 || j >= len(s.TargetList) {
				c.fail("INSERT SELECT list too short")
				return
			}
			c.checkStamp("INSERT SELECT", s.TargetList[j].GetResTarget().GetVal(), t, true)
		}
	}
	leaf(sel)
	if oc := n.OnConflictClause; oc != nil && oc.Action == pg.OnConflictAction_ONCONFLICT_UPDATE {
		c.checkSet("ON CONFLICT DO UPDATE", oc.TargetList, t, false)
		if t.audit && raises(expr(oc.WhereClause)) {
			c.fail("ON CONFLICT DO UPDATE (audit) WHERE can raise")
		}
		if t.skip && !strings.Contains(expr(oc.WhereClause), t.col) {
			c.fail("ON CONFLICT DO UPDATE (skip) WHERE has no fence condition")
		}
	}
}

func (c *checker) checkMerge(n *pg.MergeStmt, t *checkTable) {
	clauses := n.MergeWhenClauses
	seenKind := map[pg.MergeMatchKind]bool{}
	guarded := map[pg.MergeMatchKind]bool{}
	for i, cn := range clauses {
		w := cn.GetMergeWhenClause()
		first := !seenKind[w.MatchKind]
		seenKind[w.MatchKind] = true
		if t.skip && first && w.CommandType == pg.CmdType_CMD_NOTHING && strings.Contains(expr(w.Condition), c.tok) {
			guarded[w.MatchKind] = true
			continue
		}
		switch w.CommandType {
		case pg.CmdType_CMD_UPDATE:
			if t.skip {
				if !guarded[w.MatchKind] {
					c.fail("MERGE (skip) UPDATE action without a leading stale guard")
				}
				c.checkSet("MERGE UPDATE", w.TargetList, t, t.allow)
				continue
			}
			// Error mode: either a fenced UPDATE or the raise clause
			// that guards the DELETE after it.
			if !t.audit && len(w.TargetList) == 1 {
				if val := w.TargetList[0].GetResTarget().GetVal(); raisesStale(expr(val)) &&
					!strings.Contains(expr(val), " THEN "+c.tok) && !c.advanceCall(val, t) {
					continue
				}
			}
			c.checkSet("MERGE UPDATE", w.TargetList, t, true)
		case pg.CmdType_CMD_DELETE:
			cond := expr(w.Condition)
			if t.lenient() && !c.records(cond, t, "missing_token") {
				c.fail("MERGE DELETE condition does not record an invalid token: %s", cond)
			}
			if t.audit {
				if raises(cond) || !c.records(cond, t, "stale") {
					c.fail("MERGE (audit) DELETE condition raises or does not record stale rows: %s", cond)
				}
				continue
			}
			if t.skip {
				if !guarded[w.MatchKind] {
					c.fail("MERGE (skip) DELETE action without a leading stale guard")
				}
				continue
			}
			prev := clauses[max(i-1, 0)].GetMergeWhenClause()
			if i == 0 || prev.CommandType != pg.CmdType_CMD_UPDATE || prev.MatchKind != w.MatchKind ||
				!strings.Contains(expr(prev.Condition), c.tok) {
				c.fail("MERGE (error) DELETE action is not preceded by a stale check")
			}
		case pg.CmdType_CMD_INSERT:
			found := false
			for j, col := range w.TargetList {
				if col.GetResTarget().GetName() == t.col {
					found = true
					if j >= len(w.Values) {
						c.fail("MERGE INSERT with fewer values than columns")
						return
					}
					c.checkStamp("MERGE INSERT", w.Values[j], t, true)
				}
			}
			if !found {
				c.fail("MERGE INSERT does not list the fence column")
			}
		}
	}
}
