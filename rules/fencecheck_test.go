package rules_test

import (
	"fmt"
	"strings"
	"sync"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/fenceproxy/fenceproxy/rules"
)

// checkFenced is an independent check of rewritten SQL: it parses sql and
// verifies that every write to a table protected by cfg carries the fence,
// by looking at the output tree only (not at how the rewriter built it).
// It checks structure (the fence column is assigned exactly once, every
// inserted row is stamped, every DELETE is conditioned, ...) and that the
// fence expressions read the token from the configured setting.
func checkFenced(sql string, cfg rules.Config) error {
	tree, err := pg.Parse(sql)
	if err != nil {
		return fmt.Errorf("does not parse: %v", err)
	}
	again, err := pg.Deparse(tree)
	if err != nil {
		return fmt.Errorf("does not deparse: %v", err)
	}
	// A single rewritten statement is the deparser's output, so it must be
	// a fixpoint of parse -> deparse (multi-statement strings keep the
	// untouched statements' original text).
	if len(tree.Stmts) == 1 && again != sql {
		return fmt.Errorf("deparse is not a fixpoint:\n%s\n%s", sql, again)
	}
	c := &checker{cfg: cfg}
	c.setting = strings.ToLower(cfg.TokenSetting)
	if c.setting == "" {
		c.setting = rules.DefaultTokenSetting
	}
	c.tok = "pg_catalog.current_setting('" + c.setting + "', true)::bigint"
	for _, tb := range cfg.Tables {
		if tb.Mode == "off" {
			continue
		}
		parts := splitName(tb.Table)
		col := rules.DefaultColumn
		if tb.Column != "" {
			col = splitName(tb.Column)[0]
		}
		c.tables = append(c.tables, checkTable{schema: parts[0], rel: parts[1], col: col,
			skip: tb.OnStale == "skip", allow: tb.MissingToken == "allow"})
	}
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
}

type checker struct {
	cfg     rules.Config
	setting string
	tok     string
	tables  []checkTable
	err     error
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
		if t := c.match(n.Relation); t != nil {
			currentOf := n.WhereClause.GetCurrentOfExpr() != nil
			c.checkSet("UPDATE", n.TargetList, t, currentOf && !t.allow)
			where := expr(n.WhereClause)
			if t.skip && !strings.Contains(where, t.col) {
				c.fail("UPDATE (skip) WHERE has no fence condition: %s", where)
			}
			if !t.allow && !currentOf && !strings.Contains(where, "fenceproxy:token:") {
				c.fail("UPDATE WHERE has no token guard: %s", where)
			}
		}
	case *pg.DeleteStmt:
		if t := c.match(n.Relation); t != nil {
			where := expr(n.WhereClause)
			if !strings.Contains(where, t.col) || !strings.Contains(where, c.tok) {
				c.fail("DELETE WHERE has no fence condition: %s", where)
			}
			if !t.skip && !strings.Contains(where, "fenceproxy:stale:") {
				c.fail("DELETE (error) WHERE does not raise: %s", where)
			}
			if !t.allow && !strings.Contains(where, "fenceproxy:token:") {
				c.fail("DELETE WHERE has no token guard: %s", where)
			}
		}
	case *pg.InsertStmt:
		if t := c.match(n.Relation); t != nil {
			c.checkInsert(n, t)
		}
	case *pg.MergeStmt:
		if t := c.match(n.Relation); t != nil {
			c.checkMerge(n, t)
		}
	case *pg.CopyStmt:
		if t := c.match(n.Relation); t != nil && n.IsFrom {
			c.fail("COPY FROM into protected table %s", t.rel)
		}
	case *pg.TruncateStmt:
		for _, r := range n.Relations {
			if t := c.match(r.GetRangeVar()); t != nil {
				c.fail("TRUNCATE of protected table %s", t.rel)
			}
		}
	}
}

// checkSet verifies a SET list assigns the fence column exactly once, with
// an expression of the token (and, in error mode, the stale raise).
func (c *checker) checkSet(what string, tl []*pg.Node, t *checkTable, wantTokenRaise bool) {
	count := 0
	for _, n := range tl {
		rt := n.GetResTarget()
		if rt.GetName() != t.col {
			continue
		}
		count++
		if rt.Val.GetMultiAssignRef() != nil {
			c.fail("%s assigns the fence column in a multi-column SET", what)
			return
		}
		v := expr(rt.Val)
		if !strings.Contains(v, c.tok) {
			c.fail("%s SET %s = %s does not use the token", what, t.col, v)
		}
		if !t.skip && (!strings.Contains(v, "fenceproxy:stale:") || !strings.Contains(v, t.col+" <")) {
			c.fail("%s (error) SET %s = %s does not check the fence", what, t.col, v)
		}
		if wantTokenRaise && !strings.Contains(v, "fenceproxy:token:") {
			c.fail("%s SET %s = %s does not check the token", what, t.col, v)
		}
	}
	if count != 1 {
		c.fail("%s assigns the fence column %d times", what, count)
	}
}

func (c *checker) checkStamp(what string, v *pg.Node, t *checkTable) {
	s := expr(v)
	if !strings.Contains(s, c.tok) {
		c.fail("%s: fence value %s does not use the token", what, s)
	}
	if !t.allow && !strings.Contains(s, "fenceproxy:token:") {
		c.fail("%s: fence value %s does not check the token", what, s)
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
			for _, row := range s.ValuesLists {
				items := row.GetList().GetItems()
				for _, i := range idx {
					j := at(i, len(items))
					if j < 0 || j >= len(items) {
						c.fail("INSERT VALUES row too short")
						return
					}
					c.checkStamp("INSERT VALUES", items[j], t)
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
			c.checkStamp("INSERT SELECT", s.TargetList[len(s.TargetList)-1].GetResTarget().GetVal(), t)
			return
		}
		for _, i := range idx {
			j := at(i, len(s.TargetList))
			if j < 0 || j >= len(s.TargetList) {
				c.fail("INSERT SELECT list too short")
				return
			}
			c.checkStamp("INSERT SELECT", s.TargetList[j].GetResTarget().GetVal(), t)
		}
	}
	leaf(sel)
	if oc := n.OnConflictClause; oc != nil && oc.Action == pg.OnConflictAction_ONCONFLICT_UPDATE {
		c.checkSet("ON CONFLICT DO UPDATE", oc.TargetList, t, false)
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
				c.checkSet("MERGE UPDATE", w.TargetList, t, false)
				continue
			}
			// Error mode: either a fenced UPDATE or the raise clause
			// that guards the DELETE after it.
			if len(w.TargetList) == 1 && strings.Contains(expr(w.TargetList[0].GetResTarget().GetVal()), "fenceproxy:stale:") &&
				!strings.Contains(expr(w.TargetList[0].GetResTarget().GetVal()), " THEN "+c.tok) {
				continue
			}
			c.checkSet("MERGE UPDATE", w.TargetList, t, !t.allow)
		case pg.CmdType_CMD_DELETE:
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
					c.checkStamp("MERGE INSERT", w.Values[j], t)
				}
			}
			if !found {
				c.fail("MERGE INSERT does not list the fence column")
			}
		}
	}
}
