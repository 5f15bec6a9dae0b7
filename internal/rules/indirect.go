package rules

import (
	"fmt"
	"slices"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Writes that reach a protected table without naming it (through a view,
// a rule, a partitioned or inheritance parent, a foreign key's cascading
// action, TRUNCATE ... CASCADE) cannot be fenced by rewriting the text:
// the proxy learns those relations from each database's catalog and
// refuses such writes, unless a database guard fences the target.

// Indirect is a relation through which some statement kinds write a
// protected table.
type Indirect struct {
	Schema, Name string // exact names of the relation a statement names
	// Ops are the statement kinds that reach Target through it: INSERT,
	// UPDATE, DELETE, MERGE, TRUNCATE.
	Ops    []string
	Target string // the protected table reached, display form
	Via    string // how, for the error's detail
	// CascadeOnly: TRUNCATE reaches Target only with CASCADE.
	CascadeOnly bool
	// ByRule: the first step is a rewrite rule of the relation. COPY FROM,
	// which fires no rules, does not take it.
	ByRule bool
	// Columns: an UPDATE reaches Target only when it sets one of them (a
	// foreign key's ON UPDATE action fires when the referenced key
	// changes); empty, any UPDATE does.
	Columns []string
	// Latent: no write through the relation reaches Target, but one would
	// once its rules or triggers changed. Ops is empty; only DDL on its
	// rules and triggers is refused (latentHit).
	Latent bool
	// NewPartitions: a partition created or attached under the relation
	// would reach Target too; NewChildren: an inheritance child too.
	NewPartitions, NewChildren bool
}

// setsAny reports whether SET list set assigns one of cols (exact names,
// as the parser delivers them folded), a field or element of one
// included.
func setsAny(set []*pg.Node, cols []string) bool {
	for _, n := range set {
		rt := n.GetResTarget()
		if rt == nil || slices.Contains(cols, rt.Name) {
			return true
		}
	}
	return false
}

// IndirectSet finds writes through Indirect relations. It is safe for
// concurrent use.
type IndirectSet struct {
	byRel  map[string][]Indirect
	latent map[string][]Indirect // Indirect.Latent, by relation name
	names  nameGate              // byRel's relation names
	// latentNeedles: the latent relations' names, looked for only in
	// statements that hold one of latentWords.
	latentNeedles []string
	// schemaNeedles: the schemas of both, looked for only in statements
	// that hold one of latentWords (ALTER SCHEMA ... RENAME, schemaHit).
	schemaNeedles []string
	// code and latentCode name byRel's and latent's relations for the
	// stored-code check (codeNames).
	code, latentCode *Rules
	// verdicts caches Check's result by text: reads that name such a
	// relation (a partitioned parent, say) would otherwise be parsed every
	// time.
	verdicts *decisionCache
}

// indirectCacheSize bounds IndirectSet's verdicts.
const indirectCacheSize = 1024

// NewIndirectSet returns nil when paths is empty.
func NewIndirectSet(paths []Indirect) *IndirectSet {
	if len(paths) == 0 {
		return nil
	}
	s := &IndirectSet{byRel: make(map[string][]Indirect), latent: make(map[string][]Indirect), verdicts: newDecisionCache(indirectCacheSize)}
	defer func() { s.code, s.latentCode = codeNames(s.byRel), codeNames(s.latent) }()
	for _, p := range paths {
		if sn := asciiLower(p.Schema); !slices.Contains(s.schemaNeedles, sn) {
			s.schemaNeedles = append(s.schemaNeedles, sn)
		}
		switch {
		case !p.Latent && len(s.byRel[p.Name]) == 0:
			s.names.add(p.Name)
		case p.Latent && len(s.latent[p.Name]) == 0:
			n := asciiLower(p.Name)
			s.latentNeedles = append(s.latentNeedles, n)
			if strings.Contains(n, `"`) {
				s.latentNeedles = append(s.latentNeedles, strings.ReplaceAll(n, `"`, `""`))
			}
		}
		if p.Latent {
			s.latent[p.Name] = append(s.latent[p.Name], p)
			continue
		}
		s.byRel[p.Name] = append(s.byRel[p.Name], p)
	}
	return s
}

// Check returns the refusal (FP003) for sql if it writes through one of
// the set's relations, nil otherwise. A statement that names none of them
// is not parsed. One that does and cannot be parsed is refused.
func (s *IndirectSet) Check(sql string) *Error {
	if e, ok := s.CheckCached(sql); ok {
		return e
	}
	e := s.check(sql)
	if len(sql) <= maxCachedSQLLen {
		// Copied only when kept: a large text is decided in place
		// (Rules.Decide), and its verdict refers to none of its bytes.
		s.verdicts.put(0, strings.Clone(sql), Decision{Err: e})
	}
	return e
}

// CheckCached is Check when its answer costs no parse: sql names none of
// the set's relations, or its verdict is cached. It reports false
// otherwise.
func (s *IndirectSet) CheckCached(sql string) (*Error, bool) {
	if s == nil {
		return nil, true
	}
	if !s.mayApply(sql) {
		return nil, true
	}
	if d, ok := s.verdicts.get(0, sql); ok {
		return d.Err, true
	}
	return nil, false
}

// mayApply reports whether sql may be refused by the set: it names one of
// its relations (a latent one, or a schema of either, with the words of
// the DDL that concerns them), or creates stored code (which may spell a
// name its text does not hold: escapes, string continuation), or holds a
// Unicode escape.
func (s *IndirectSet) mayApply(sql string) bool {
	has := func(n string) bool { return containsFoldASCII(sql, n) }
	if s.names.mayName(sql) || (&Rules{}).unicodeEscape(sql) {
		return true
	}
	w := gateWordsIn(sql)
	// latentWords holds "rename", which a schema's rename needs.
	return (w&gateLatent != 0 && (slices.ContainsFunc(s.latentNeedles, has) || slices.ContainsFunc(s.schemaNeedles, has))) ||
		(w&gateCreate != 0 && w&gateCode != 0) || w&gateDo != 0
}

// The words mayApply looks for besides latentWords.
var (
	createWords = []string{"create"}
	codeWords   = []string{"function", "procedure"}
	doWords     = []string{"do"}
)

// gateByLen lists the words gateWordsIn looks for, with their bits, by
// length: a word of the text is compared with those of its length only.
var gateByLen = func() (t [10][]struct {
	word string
	bit  int
}) {
	for _, g := range []struct {
		words []string
		bit   int
	}{{latentWords, gateLatent}, {createWords, gateCreate}, {codeWords, gateCode}, {doWords, gateDo}} {
		for _, w := range g.words {
			t[len(w)] = append(t[len(w)], struct {
				word string
				bit  int
			}{w, g.bit})
		}
	}
	return t
}()

// The words mayApply looks for, as bits of gateWordsIn's result.
const (
	gateLatent = 1 << iota // one of latentWords
	gateCreate             // CREATE
	gateCode               // FUNCTION, PROCEDURE
	gateDo                 // a DO statement (doStatementAt)
)

// gateWordsIn scans sql's words (maximal runs of identifier bytes) once
// and returns which of mayApply's words it holds, ASCII case ignored.
func gateWordsIn(sql string) int {
	bits := 0
	for i := 0; i < len(sql); {
		if !sqllex.IsIdentCont(sql[i]) {
			i++
			continue
		}
		j := i + 1
		for j < len(sql) && sqllex.IsIdentCont(sql[j]) {
			j++
		}
		if w := sql[i:j]; len(w) < len(gateByLen) {
			for _, g := range gateByLen[len(w)] {
				if sqllex.HasPrefixFold(w, g.word) && (g.bit != gateDo || doStatementAt(sql, j)) {
					bits |= g.bit
				}
			}
		}
		i = j
	}
	return bits
}

// LexingRefusal fails closed, as the rule sets do for protected tables,
// when the server may tokenize sql differently from the parser the set's
// check uses (always UTF-8 with standard_conforming_strings on) and sql
// may be refused by the set: with standard_conforming_strings off, a
// backslash can end a string where the parser sees it go on, and hide a
// write through a path. nil for a nil set.
func (s *IndirectSet) LexingRefusal(lex Lexing, sql string) *Error {
	if s == nil || (!lex.Backslash && !lex.NonASCII) || !s.mayApply(sql) {
		return nil
	}
	return lexingProblem(lex, "this statement, which may write through a relation that reaches a protected table,",
		"statements that may write through a relation that reaches a protected table")
}

// check is Check without the cache.
func (s *IndirectSet) check(sql string) *Error {
	if len(sql) > DefaultMaxCheckBytes {
		return &Error{Code: CodeRefused, Message: "fenceproxy: statement too large to check for writes through relations that reach protected tables"}
	}
	if (&Rules{}).tooDeep(sql) != nil {
		return &Error{Code: CodeRefused, Message: "fenceproxy: statement too deeply nested to check for writes through relations that reach protected tables"}
	}
	tree, err := pg.Parse(sql)
	if err != nil {
		return &Error{Code: CodeRefused, Message: "fenceproxy: cannot parse a statement that may write through a relation that reaches a protected table", Detail: err.Error()}
	}
	var out *Error
	for _, raw := range tree.Stmts {
		walkMessages(raw.ProtoReflect(), func(m protoreflect.Message) bool {
			if out != nil {
				return false
			}
			switch n := m.Interface().(type) {
			case *pg.InsertStmt:
				out = s.hit(n.Relation, "INSERT", false, nil)
				if out == nil && n.OnConflictClause != nil && n.OnConflictClause.Action == pg.OnConflictAction_ONCONFLICT_UPDATE {
					out = s.hit(n.Relation, "UPDATE", false, n.OnConflictClause.TargetList)
				}
			case *pg.UpdateStmt:
				out = s.hit(n.Relation, "UPDATE", false, n.TargetList)
			case *pg.DeleteStmt:
				out = s.hit(n.Relation, "DELETE", false, nil)
			case *pg.MergeStmt:
				out = s.hit(n.Relation, "MERGE", false, nil)
			case *pg.CopyStmt:
				if n.IsFrom {
					out = s.hit(n.Relation, "COPY", false, nil)
				}
			case *pg.CreateFunctionStmt, *pg.DoStmt:
				// Stored code runs its statements where the proxy sees
				// only the call: one that mentions such a relation is
				// refused when it is created, as one that mentions a
				// protected table is.
				text := stmtText(sql, raw)
				out = s.storedCodeHit(m.Interface(), text, codeBody(m.Interface(), text))
			case *pg.ViewStmt:
				// A view over such a relation may be updatable through
				// it: a new path, which the statements after it in the
				// same transaction could write before the proxy learns
				// of it (its check compares the catalog as it was when
				// the transaction began).
				walkMessages(n.ProtoReflect(), func(m protoreflect.Message) bool {
					if rv, ok := m.Interface().(*pg.RangeVar); ok && out == nil {
						out = s.ddlHit(rv, "CREATE VIEW over")
					}
					return out == nil
				})
			case *pg.RenameStmt:
				// A renamed relation (or schema) is no longer the one the
				// paths name: a latent one's rules could then be changed
				// under the new name.
				switch n.RenameType {
				case pg.ObjectType_OBJECT_TABCONSTRAINT, pg.ObjectType_OBJECT_TRIGGER, pg.ObjectType_OBJECT_POLICY,
					pg.ObjectType_OBJECT_RULE:
					// Names of a relation's parts, not of the relation.
				case pg.ObjectType_OBJECT_COLUMN:
					// Paths by column name: renamed to or from a key
					// column's name, a column may pass for another.
					out = s.columnsHit(n.Relation, "RENAME COLUMN of", n.Subname, n.Newname)
				case pg.ObjectType_OBJECT_SCHEMA:
					out = s.schemaHit(n.Subname)
				default:
					out = s.latentHit(n.Relation, "RENAME of")
				}
			case *pg.AlterObjectSchemaStmt:
				out = s.latentHit(n.Relation, "SET SCHEMA of")
			case *pg.AlterTableStmt:
				// Under a new parent, or attached as a partition, the
				// relation's writes are reached through the parent, and
				// a new partition's through it; a new foreign key of the
				// relation makes the table it references reach it; a rule
				// enabled or disabled may open a path through it.
				for _, c := range n.Cmds {
					cmd := c.GetAlterTableCmd()
					switch {
					case out != nil || cmd == nil:
					case cmd.Subtype == pg.AlterTableType_AT_AddInherit:
						if out = s.ddlHit(n.Relation, "INHERIT of"); out == nil {
							out = s.parentHit(cmd.Def.GetRangeVar(), false, "INHERIT from")
						}
					case cmd.Subtype == pg.AlterTableType_AT_AttachPartition:
						if out = s.ddlHit(cmd.Def.GetPartitionCmd().GetName(), "ATTACH PARTITION of"); out == nil {
							out = s.parentHit(n.Relation, true, "ATTACH PARTITION to")
						}
					case cmd.Subtype == pg.AlterTableType_AT_AddConstraint && cmd.Def.GetConstraint().GetContype() == pg.ConstrType_CONSTR_FOREIGN,
						cmd.Subtype == pg.AlterTableType_AT_AddColumn && slices.ContainsFunc(cmd.Def.GetColumnDef().GetConstraints(), func(c *pg.Node) bool {
							return c.GetConstraint().GetContype() == pg.ConstrType_CONSTR_FOREIGN
						}):
						out = s.ddlHit(n.Relation, "ADD FOREIGN KEY to")
					case cmd.Subtype == pg.AlterTableType_AT_EnableRule || cmd.Subtype == pg.AlterTableType_AT_EnableAlwaysRule ||
						cmd.Subtype == pg.AlterTableType_AT_EnableReplicaRule:
						out = s.ruleHit(n.Relation, "ENABLE RULE on")
					case cmd.Subtype == pg.AlterTableType_AT_DisableRule:
						out = s.ruleHit(n.Relation, "DISABLE RULE on")
					case cmd.Subtype == pg.AlterTableType_AT_SetExpression:
						// A generated key computed from other columns.
						out = s.columnsHit(n.Relation, "SET EXPRESSION of")
					}
				}
			case *pg.RuleStmt:
				// CREATE OR REPLACE RULE can turn an INSTEAD rule into
				// an ALSO one; the actions are walked as statements. An
				// ON SELECT rule defines a view, as CREATE VIEW does.
				out = s.ruleHit(n.Relation, "CREATE RULE on")
				if n.Event == pg.CmdType_CMD_SELECT {
					for _, a := range n.Actions {
						visitRangeVars(a.ProtoReflect(), true, func(rv *pg.RangeVar) {
							if out == nil {
								out = s.ddlHit(rv, "an ON SELECT rule (a view) over")
							}
						})
					}
				}
			case *pg.CreateTrigStmt:
				// An INSTEAD OF trigger makes a view write what it reads;
				// a BEFORE UPDATE trigger may change a referenced key.
				out = s.triggerHit(n.Relation, "CREATE TRIGGER on")
			case *pg.DropStmt:
				// Dropping an INSTEAD rule or trigger of a view may leave
				// it auto-updatable.
				if n.RemoveType == pg.ObjectType_OBJECT_RULE || n.RemoveType == pg.ObjectType_OBJECT_TRIGGER {
					for _, o := range n.Objects {
						rv := ownerRangeVar(o.GetList().GetItems())
						switch {
						case rv == nil || out != nil:
						case n.RemoveType == pg.ObjectType_OBJECT_RULE:
							out = s.ruleHit(rv, "DROP RULE on")
						default:
							out = s.triggerHit(rv, "DROP TRIGGER on")
						}
					}
				}
			case *pg.CreateStmt:
				what := "CREATE TABLE ... INHERITS"
				if n.Partbound != nil {
					what = "CREATE TABLE ... PARTITION OF"
				}
				for _, inh := range n.InhRelations {
					if out == nil {
						out = s.parentHit(inh.GetRangeVar(), n.Partbound != nil, what)
					}
				}
			case *pg.TruncateStmt:
				for _, r := range n.Relations {
					if out = s.hit(r.GetRangeVar(), "TRUNCATE", n.Behavior == pg.DropBehavior_DROP_CASCADE, nil); out != nil {
						break
					}
				}
			}
			return out == nil
		})
		if out != nil {
			break
		}
	}
	return out
}

// storedCodeHit returns the refusal of stored code stmt (text its
// statement's text, body its code) that mentions the name of one of the
// set's relations, whatever it does with it: its body may write through
// it, also as dynamic SQL. A name counts as a word of the text (ASCII
// case ignored), or as the stored-code check of protected tables finds
// one (codeCheck: the body compiled and parsed, every string constant
// read as SQL after its escapes, a Unicode escape as any name).
func (s *IndirectSet) storedCodeHit(stmt protoreflect.ProtoMessage, text, body string) *Error {
	if e := storedCodeRefusal(s.byRel, s.code, stmt, text, "writes protected table %s without naming it"); e != nil {
		return e
	}
	// Code that changes a latent relation's rules or triggers may open a
	// path and write through it in the same call. The words are looked
	// for in its body (a function's declaration says RETURNS trigger);
	// a body with escapes may spell them otherwise.
	if sqllex.ContainsAnyWordFold(body, latentDynWords) || strings.Contains(body, `\`) || s.code.unicodeEscape(body) {
		return storedCodeRefusal(s.latent, s.latentCode, stmt, text, "may be given a path to protected table %s by rule or trigger DDL")
	}
	return nil
}

// codeNames returns a rule set whose tables are byRel's relations, for
// codeCheck to find their names in stored code.
func codeNames(byRel map[string][]Indirect) *Rules {
	r := &Rules{byRel: map[string][]*tableRule{}}
	for name, ps := range byRel {
		for _, p := range ps {
			if slices.ContainsFunc(r.byRel[name], func(t *tableRule) bool { return t.schema == p.Schema }) {
				continue
			}
			t := &tableRule{schema: p.Schema, rel: p.Name, display: quoteIdent(p.Schema) + "." + quoteIdent(p.Name)}
			r.byRel[name] = append(r.byRel[name], t)
			r.tables = append(r.tables, t)
		}
	}
	slices.SortFunc(r.tables, func(a, b *tableRule) int { return strings.Compare(a.display, b.display) })
	return r
}

// codeBody returns the source of a CREATE FUNCTION's or DO block's code,
// or "" when it has none to read (a C function's object file). A
// function of the SQL-standard form (BEGIN ATOMIC) has its body parsed:
// it returns the statement's text then.
func codeBody(m protoreflect.ProtoMessage, text string) string {
	var opts []*pg.Node
	switch n := m.(type) {
	case *pg.CreateFunctionStmt:
		if n.SqlBody != nil {
			return text
		}
		opts = n.Options
	case *pg.DoStmt:
		opts = n.Args
	}
	for _, o := range opts {
		if d := o.GetDefElem(); d != nil && d.Defname == "as" {
			if sv := d.Arg.GetString_(); sv != nil {
				return sv.Sval
			}
			if items := d.Arg.GetList().GetItems(); len(items) > 0 {
				return items[0].GetString_().GetSval()
			}
		}
	}
	return ""
}

// storedCodeRefusal is storedCodeHit on the relations of byRel (code:
// codeNames of them); how says what the relation does to its target.
func storedCodeRefusal(byRel map[string][]Indirect, code *Rules, stmt protoreflect.ProtoMessage, sql, how string) *Error {
	if len(byRel) == 0 {
		return nil
	}
	names := make([]string, 0, len(byRel))
	for name := range byRel {
		names = append(names, name)
	}
	slices.Sort(names)
	var c *codeCheck
	for pass := range 2 {
		for _, name := range names {
			mentions := "mentions"
			switch {
			case pass == 0 && mentionsWord(sql, name):
			case pass == 0:
				if c == nil {
					c = &codeCheck{r: code}
					c.stmt(stmt, 0)
				}
				if !slices.ContainsFunc(c.found, func(t *tableRule) bool { return t != nil && t.rel == name }) {
					continue
				}
			case slices.Contains(c.found, nil):
				// A Unicode escape, or text that cannot be read, may
				// spell any name.
				mentions = "may mention (through an escape, or in text that cannot be read)"
			default:
				continue
			}
			return storedCodeError(byRel[name][0], mentions, how)
		}
	}
	return nil
}

// storedCodeError is storedCodeRefusal's refusal for path p.
func storedCodeError(p Indirect, mentions, how string) *Error {
	rel := quoteIdent(p.Schema) + "." + quoteIdent(p.Name)
	return &Error{
		Code:    CodeRefused,
		Message: fmt.Sprintf("fenceproxy: stored code %s %s, which "+how+"; statements inside it cannot be fenced", mentions, rel, p.Target),
		Detail:  p.Via,
		Hint:    "Write the protected table directly, or install the database guard (fenceproxy setup --guard), which fences such writes inside PostgreSQL.",
		Table:   p.Target,
	}
}

// mentionsWord reports whether name appears in sql (ASCII case ignored)
// with no identifier byte on either side.
func mentionsWord(sql, name string) bool {
	for i := 0; i+len(name) <= len(sql); i++ {
		if !hasPrefixFoldASCII(sql[i:], name) {
			continue
		}
		if i > 0 && sqllex.IsIdentCont(sql[i-1]) {
			continue
		}
		if j := i + len(name); j < len(sql) && sqllex.IsIdentCont(sql[j]) {
			continue
		}
		return true
	}
	return false
}

// sameSchema reports whether a statement's schema name (empty when the
// name is unqualified) may be a path's: an unqualified name matches any
// schema, pg_temp any temporary schema.
func sameSchema(named, path string) bool {
	return named == "" || named == path || (named == "pg_temp" && strings.HasPrefix(path, "pg_temp_"))
}

// ddlHit returns the refusal of DDL (what) on rv that would give one of
// the set's relations a new name, place, parent, child or foreign key, or
// a view over it.
func (s *IndirectSet) ddlHit(rv *pg.RangeVar, what string) *Error {
	return ddlRefusal(s.byRel, rv, what)
}

// columnsHit returns the refusal of DDL (what) on rv that changes which
// columns a path of rv's that an UPDATE takes only by setting some columns
// (Indirect.Columns) depends on: of any such path, or, with names given,
// of one whose columns hold one of them.
func (s *IndirectSet) columnsHit(rv *pg.RangeVar, what string, names ...string) *Error {
	if rv == nil {
		return nil
	}
	var keyed []Indirect
	for _, p := range s.byRel[rv.Relname] {
		if len(p.Columns) > 0 && (len(names) == 0 || slices.ContainsFunc(names, func(n string) bool { return slices.Contains(p.Columns, n) })) {
			keyed = append(keyed, p)
		}
	}
	return ddlRefusal(map[string][]Indirect{rv.Relname: keyed}, rv, what)
}

// ruleHit returns the refusal of DDL (what) on rv's rules when rv is
// latent (a relation with rules, or a view, from which a changed rule
// could open a path). A relation with no rules gains one only by CREATE
// RULE, whose actions are checked as writes.
func (s *IndirectSet) ruleHit(rv *pg.RangeVar, what string) *Error {
	return ddlRefusal(s.latent, rv, what)
}

// triggerHit returns the refusal of DDL (what) on rv's triggers when rv
// is latent (an INSTEAD OF trigger makes a view write what it reads) or
// has a path an UPDATE takes by setting some columns (a BEFORE UPDATE
// trigger may change them whatever it sets). Other triggers' writes are
// in their functions' code, which the paths do not follow.
func (s *IndirectSet) triggerHit(rv *pg.RangeVar, what string) *Error {
	if e := ddlRefusal(s.latent, rv, what); e != nil {
		return e
	}
	return s.columnsHit(rv, what)
}

// parentHit returns the refusal of DDL (what) that gives rv a new
// partition (partition) or inheritance child, when the new relation would
// reach a protected table through one of rv's paths.
func (s *IndirectSet) parentHit(rv *pg.RangeVar, partition bool, what string) *Error {
	if rv == nil {
		return nil
	}
	var reach []Indirect
	for _, p := range s.byRel[rv.Relname] {
		if p.NewChildren || (partition && p.NewPartitions) {
			reach = append(reach, p)
		}
	}
	return ddlRefusal(map[string][]Indirect{rv.Relname: reach}, rv, what)
}

// latentHit returns the refusal of DDL (what) on the rules or triggers of
// rv, one of the set's relations or a latent one: it may open a path.
func (s *IndirectSet) latentHit(rv *pg.RangeVar, what string) *Error {
	if e := ddlRefusal(s.byRel, rv, what); e != nil {
		return e
	}
	return ddlRefusal(s.latent, rv, what)
}

// latentWords are the words without which a statement cannot be the DDL
// latentHit refuses: rule and trigger DDL, and renames (RENAME, SET
// SCHEMA) after which such DDL would name the relation otherwise.
var latentWords = []string{"rule", "trigger", "rename", "schema"}

// latentDynWords are latentWords and EXECUTE: dynamic SQL can build the
// words (string continuation, concatenation), so stored code that runs
// any and names a latent relation is refused too.
var latentDynWords = append(slices.Clip(latentWords), "execute")

// schemaHit returns the refusal of ALTER SCHEMA ... RENAME of schema when
// it holds one of the set's relations or a latent one: their paths name
// them by schema.
func (s *IndirectSet) schemaHit(schema string) *Error {
	var in []Indirect
	for _, m := range []map[string][]Indirect{s.byRel, s.latent} {
		for _, ps := range m {
			for _, p := range ps {
				if p.Schema == schema {
					in = append(in, p)
				}
			}
		}
	}
	if len(in) == 0 {
		return nil
	}
	p := slices.MinFunc(in, func(a, b Indirect) int { return strings.Compare(a.Name+"\x00"+a.Target, b.Name+"\x00"+b.Target) })
	return ddlRefusal(map[string][]Indirect{p.Name: {p}}, &pg.RangeVar{Schemaname: schema, Relname: p.Name}, "renaming the schema of")
}

// stmtText returns raw's text in sql (the whole of sql when the parser
// gave no length: the last statement).
func stmtText(sql string, raw *pg.RawStmt) string {
	start := int(raw.StmtLocation)
	if start < 0 || start > len(sql) {
		return sql
	}
	end := len(sql)
	if raw.StmtLen > 0 && start+int(raw.StmtLen) <= len(sql) {
		end = start + int(raw.StmtLen)
	}
	return sql[start:end]
}

// doStatementAt reports whether what follows the word DO, which ends at
// i, is what a DO statement takes next: after spaces and comments, a
// string constant ('...', $tag$...$tag$, E'...', U&'...') or LANGUAGE.
// ON CONFLICT DO NOTHING or DO UPDATE, a rule's DO INSTEAD or DO ALSO,
// and "do" in text data are not.
func doStatementAt(sql string, i int) bool {
	j := skipSpaceAndComments(sql, i)
	if j >= len(sql) {
		return false
	}
	switch c := sql[j]; {
	case c == '\'' || c == '$':
		return true
	case (c == 'e' || c == 'E') && j+1 < len(sql) && sql[j+1] == '\'':
		return true
	case (c == 'u' || c == 'U') && j+1 < len(sql) && sql[j+1] == '&':
		return true
	}
	return hasPrefixFoldASCII(sql[j:], "language") && (j+8 == len(sql) || !sqllex.IsIdentCont(sql[j+8]))
}

// skipSpaceAndComments returns the index of the first byte of sql from i
// on that is not white space or in a comment (-- to the end of the line,
// /* */ nested as PostgreSQL nests them); len(sql) if none.
func skipSpaceAndComments(sql string, i int) int {
	for i < len(sql) {
		switch {
		case sql[i] == ' ' || sql[i] == '\t' || sql[i] == '\n' || sql[i] == '\r' || sql[i] == '\f' || sql[i] == '\v':
			i++
		case strings.HasPrefix(sql[i:], "--"):
			for i < len(sql) && sql[i] != '\n' && sql[i] != '\r' {
				i++
			}
		case strings.HasPrefix(sql[i:], "/*"):
			depth := 0
			for i < len(sql) {
				if strings.HasPrefix(sql[i:], "/*") {
					depth, i = depth+1, i+2
				} else if strings.HasPrefix(sql[i:], "*/") {
					depth, i = depth-1, i+2
					if depth == 0 {
						break
					}
				} else {
					i++
				}
			}
		default:
			return i
		}
	}
	return i
}

// ownerRangeVar returns the relation of a rule or trigger named
// [schema.]table.name, nil when the name has no relation.
func ownerRangeVar(items []*pg.Node) *pg.RangeVar {
	if len(items) < 2 {
		return nil
	}
	rv := &pg.RangeVar{Relname: items[len(items)-2].GetString_().GetSval()}
	if len(items) > 2 {
		rv.Schemaname = items[len(items)-3].GetString_().GetSval()
	}
	return rv
}

// ddlRefusal is ddlHit on the relations of byRel.
func ddlRefusal(byRel map[string][]Indirect, rv *pg.RangeVar, what string) *Error {
	if rv == nil {
		return nil
	}
	for _, p := range byRel[rv.Relname] {
		if !sameSchema(rv.Schemaname, p.Schema) {
			continue
		}
		rel := quoteIdent(p.Schema) + "." + quoteIdent(p.Name)
		how := fmt.Sprintf("%s writes protected table %s without naming it", rel, p.Target)
		if p.Latent {
			how = fmt.Sprintf("it may open a path from %s to protected table %s", rel, p.Target)
		}
		return &Error{
			Code:    CodeRefused,
			Message: fmt.Sprintf("fenceproxy: %s %s is not allowed through the proxy: %s", what, rel, how),
			Detail:  p.Via + ". The statement would open a path to it that the proxy learns of only after the transaction commits.",
			Hint:    "Run the DDL on a direct connection to PostgreSQL, or install the database guard (fenceproxy setup --guard), which fences such writes inside PostgreSQL.",
			Table:   p.Target,
		}
	}
	return nil
}

// hit returns the refusal for a write of kind op to rv, if rv may be one
// of the set's relations (an unqualified name matches any schema). set is
// an UPDATE's SET list (nil otherwise): a path that an UPDATE reaches only
// by setting some Columns is not reached when it sets none of them.
func (s *IndirectSet) hit(rv *pg.RangeVar, op string, cascade bool, set []*pg.Node) *Error {
	if rv == nil {
		return nil
	}
	kind := op
	if op == "COPY" {
		kind = "INSERT" // COPY FROM inserts, and fires no rules
	}
	for _, p := range s.byRel[rv.Relname] {
		if !sameSchema(rv.Schemaname, p.Schema) {
			continue
		}
		if !slices.Contains(p.Ops, kind) || (op == "TRUNCATE" && p.CascadeOnly && !cascade) || (op == "COPY" && p.ByRule) {
			continue
		}
		if op == "UPDATE" && len(p.Columns) > 0 && set != nil && !setsAny(set, p.Columns) {
			continue
		}
		rel := quoteIdent(p.Schema) + "." + quoteIdent(p.Name)
		return &Error{
			Code:    CodeRefused,
			Message: fmt.Sprintf("fenceproxy: %s on %s would write protected table %s without naming it, so it cannot be fenced", op, rel, p.Target),
			Detail:  p.Via,
			Hint:    "Write the protected table directly, or install the database guard (fenceproxy setup --guard), which fences such writes inside PostgreSQL.",
			Table:   p.Target,
		}
	}
	return nil
}
