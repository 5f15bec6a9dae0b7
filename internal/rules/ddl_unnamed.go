package rules

// Statements that reach protected tables they do not name: ownership,
// extensions, dependencies (CASCADE), a table's parents and children, and
// DROP DATABASE.

import (
	"fmt"
	"slices"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
	pg "github.com/pganalyze/pg_query_go/v6"

	"google.golang.org/protobuf/reflect/protoreflect"
)

// unnamedReach describes a statement that can drop a table, move it, or
// change its owner or its extension membership without naming it.
type unnamedReach struct {
	what   string // the statement, for the message
	effect string // what it does to objects it does not name
	hint   string
}

// reachesUnnamed returns how statement m can reach a table it does not
// name, or nil when it cannot. It is decided on m alone: which tables are
// reached depends on the catalog.
func reachesUnnamed(m protoreflect.ProtoMessage) *unnamedReach {
	switch n := m.(type) {
	case *pg.DropOwnedStmt:
		return &unnamedReach{"DROP OWNED", "it drops every object the roles own, which may be a protected table it does not name", hintDirect}
	case *pg.ReassignOwnedStmt:
		return &unnamedReach{"REASSIGN OWNED", "it changes the owner of every object the roles own, which may be a protected table it does not name", hintDirect}
	case *pg.DropdbStmt:
		return &unnamedReach{"DROP DATABASE", "it drops every table in the database, which may hold protected tables", hintDirect}
	case *pg.DropStmt:
		if n.RemoveType == pg.ObjectType_OBJECT_EXTENSION {
			return &unnamedReach{"DROP EXTENSION", "it drops the extension's member objects, which may be a protected table it does not name", hintDirect}
		}
	case *pg.AlterExtensionContentsStmt:
		what := "ALTER EXTENSION ... ADD"
		if n.Action < 0 {
			what = "ALTER EXTENSION ... DROP"
		}
		return &unnamedReach{what, "it changes which objects belong to the extension, whose members DROP EXTENSION drops without naming them", hintDirect}
	case *pg.AlterExtensionStmt:
		return &unnamedReach{"ALTER EXTENSION ... UPDATE", "the extension's update script runs inside the server and may drop, move or change the owner of its member objects, which may be a protected table", hintDirect}
	case *pg.AlterObjectSchemaStmt:
		if n.ObjectType == pg.ObjectType_OBJECT_EXTENSION {
			return &unnamedReach{"ALTER EXTENSION ... SET SCHEMA", "it moves the extension's member objects to another schema, which may take a protected table it does not name out of its fenced name", hintDirect}
		}
	case *pg.TruncateStmt, *pg.GrantStmt, *pg.GrantRoleStmt, *pg.DropSubscriptionStmt:
		// TRUNCATE ... CASCADE empties tables (decided with the catalog's
		// paths, see IndirectSet); REVOKE ... CASCADE revokes privileges;
		// nothing depends on a subscription.
		return nil
	}
	if what := cascadeWhat(m); what != "" {
		return &unnamedReach{what, "CASCADE also drops the objects that depend on what it names, which may be a protected table or one of its columns, defaults or constraints", hintCascade}
	}
	return nil
}

// cascadeWhat names statement m for a refusal if it, or a subcommand of it
// (ALTER TABLE ... DROP COLUMN ... CASCADE), drops with CASCADE; it returns
// "" otherwise. Nested statements are not looked at: the walker reaches
// them on its own.
func cascadeWhat(m protoreflect.ProtoMessage) string {
	top := m.ProtoReflect()
	cascade := false
	walkMessages(top, func(m protoreflect.Message) bool {
		if cascade {
			return false
		}
		if m != top && strings.HasSuffix(string(m.Descriptor().Name()), "Stmt") {
			return false
		}
		fd := m.Descriptor().Fields().ByName("behavior")
		if fd != nil && fd.Enum() != nil && fd.Enum().FullName() == dropBehaviorName &&
			m.Get(fd).Enum() == protoreflect.EnumNumber(pg.DropBehavior_DROP_CASCADE) {
			cascade = true
		}
		return !cascade
	})
	if !cascade {
		return ""
	}
	switch n := m.(type) {
	case *pg.DropStmt:
		return objectWords("DROP ", n.RemoveType) + " ... CASCADE"
	case *pg.AlterTableStmt:
		return objectWords("ALTER ", n.Objtype) + " ... CASCADE"
	case *pg.AlterDomainStmt:
		return "ALTER DOMAIN ... CASCADE"
	}
	return "a statement with CASCADE"
}

var dropBehaviorName = pg.DropBehavior_DROP_CASCADE.Descriptor().FullName()

// objectWords is prefix and an object type in words (OBJECT_FOREIGN_TABLE
// -> FOREIGN TABLE).
func objectWords(prefix string, t pg.ObjectType) string {
	return prefix + strings.ReplaceAll(strings.TrimPrefix(t.String(), "OBJECT_"), "_", " ")
}

// unnamed refuses m, where the session fences any table, if it can reach
// a table without naming it (reachesUnnamed).
func (w *walker) unnamed(m protoreflect.ProtoMessage) bool {
	if w.err != nil || len(w.r.tables) == 0 {
		return w.err != nil
	}
	u := reachesUnnamed(m)
	if u == nil {
		return false
	}
	return w.refuseUnnamed(u, "")
}

// refuseUnnamed refuses, where the session fences any table, a statement
// that reaches tables it does not name as u says; code, when not empty,
// is the stored code that would run it ("DO block"). All of the session's
// tables are named, as any of them may be reached: in audit mode the
// statement is forwarded and recorded, as other refusals are.
func (w *walker) refuseUnnamed(u *unnamedReach, code string) bool {
	if w.err != nil || len(w.r.tables) == 0 {
		return w.err != nil
	}
	if w.audit != nil && allAudit(w.r.tables) {
		return false // forwarded and recorded already
	}
	subject, detail := u.what+" is", ""
	if code != "" {
		subject = code + " runs " + u.what + ", which is"
		detail = "Stored code runs inside the server, later and from any statement, where the proxy sees only the call. "
	}
	return w.refuse(w.r.tables, fmt.Sprintf("fenceproxy: %s not allowed through the proxy: %s, and this session fences %s",
		subject, u.effect, describeTables(displays(w.r.tables))),
		detail+"The proxy decides on the statement alone; which tables it reaches depends on ownership, extension membership and dependencies in the catalog, which the proxy does not read, so it refuses the statement (fail closed).",
		u.hint)
}

// HierarchySet finds DDL on relations that are an inheritance or
// partitioned ancestor, or a descendant, of a protected table. It is safe
// for concurrent use.
type HierarchySet struct {
	byRel   map[string][]Indirect
	needles []string // relation names, ASCII-lowered
}

// NewHierarchySet returns the set of the relations of paths (each a first
// step through inheritance or partitioning), nil when paths is empty.
func NewHierarchySet(paths []Indirect) *HierarchySet {
	if len(paths) == 0 {
		return nil
	}
	s := &HierarchySet{byRel: make(map[string][]Indirect)}
	for _, p := range paths {
		if len(s.byRel[p.Name]) == 0 {
			n := asciiLower(p.Name)
			s.needles = append(s.needles, n)
			if strings.Contains(n, `"`) {
				s.needles = append(s.needles, strings.ReplaceAll(n, `"`, `""`))
			}
		}
		s.byRel[p.Name] = append(s.byRel[p.Name], p)
	}
	return s
}

// MayApply reports whether Check could refuse sql: it names one of the
// set's relations (or may, through U&), and has the word ALTER, DROP or
// TRIGGER. It does not parse.
func (s *HierarchySet) MayApply(sql string) bool {
	if s == nil || !MayBeDDL(sql) {
		return false
	}
	return slices.ContainsFunc(s.needles, func(n string) bool { return containsFoldASCII(sql, n) }) ||
		(&Rules{}).unicodeEscape(sql)
}

// MayBeDDL reports whether sql has one of the words without which it
// cannot be DDL HierarchySet refuses (ALTER, DROP, TRIGGER, ASCII case
// ignored). It does not allocate.
func MayBeDDL(sql string) bool {
	return sqllex.ContainsAnyWordFold(sql, ddlWords)
}

// ddlWords are the words MayBeDDL looks for.
var ddlWords = []string{"alter", "drop", "trigger"}

// Check returns the refusal (FP003) of sql if it drops or alters one of
// the set's relations, renames a column of one, or creates a row trigger
// on one, nil otherwise. ALTER
// TABLE ONLY is forwarded (it does not recurse), and so are the
// subcommands the allow-list has for protected tables, and those that
// change the hierarchy without removing a row (ATTACH and DETACH
// PARTITION, NO INHERIT: a protected table named there is refused by the
// rules). A statement that may apply and cannot be parsed is refused.
func (s *HierarchySet) Check(sql string) *Error {
	if !s.MayApply(sql) {
		return nil
	}
	if len(sql) > DefaultMaxCheckBytes {
		return &Error{Code: CodeRefused, Message: "fenceproxy: statement too large to check for DDL on a parent or child of a protected table"}
	}
	if (&Rules{}).tooDeep(sql) != nil {
		return &Error{Code: CodeRefused, Message: "fenceproxy: statement too deeply nested to check for DDL on a parent or child of a protected table"}
	}
	tree, err := pg.Parse(sql)
	if err != nil {
		return &Error{Code: CodeRefused, Message: "fenceproxy: cannot parse a statement that may be DDL on a parent or child of a protected table", Detail: err.Error()}
	}
	var out *Error
	for _, raw := range tree.Stmts {
		walkMessages(raw.ProtoReflect(), func(m protoreflect.Message) bool {
			if out != nil {
				return false
			}
			switch n := m.Interface().(type) {
			case *pg.DropStmt:
				switch n.RemoveType {
				case pg.ObjectType_OBJECT_TABLE, pg.ObjectType_OBJECT_FOREIGN_TABLE:
					for _, o := range n.Objects {
						items := o.GetList().GetItems()
						if out == nil && len(items) > 0 {
							schema := ""
							if len(items) > 1 {
								schema = items[len(items)-2].GetString_().GetSval()
							}
							out = s.hit(schema, items[len(items)-1].GetString_().GetSval(), objectWords("DROP ", n.RemoveType))
						}
					}
				}
			case *pg.AlterTableStmt:
				if rv := n.Relation; rv != nil && rv.Inh {
					if what := recursingCmd(n); what != "" {
						out = s.hit(rv.Schemaname, rv.Relname, what)
					}
				}
			case *pg.RenameStmt:
				// A column renamed on a parent is renamed in its children:
				// the fence column among them.
				if rv := n.Relation; rv != nil && rv.Inh && n.RenameType == pg.ObjectType_OBJECT_COLUMN {
					out = s.hit(rv.Schemaname, rv.Relname, "ALTER TABLE ... RENAME COLUMN")
				}
			case *pg.CreateTrigStmt:
				if rv := n.Relation; rv != nil && n.Row {
					out = s.hit(rv.Schemaname, rv.Relname, "CREATE TRIGGER ... FOR EACH ROW")
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

// recursingCmd names the first subcommand of n that is not on the
// allow-list and may change the rows or columns of the relation's
// descendants; it returns "" when there is none.
func recursingCmd(n *pg.AlterTableStmt) string {
	for _, c := range n.Cmds {
		cmd := c.GetAlterTableCmd()
		if cmd == nil {
			return "ALTER TABLE"
		}
		switch cmd.Subtype {
		case pg.AlterTableType_AT_AttachPartition, pg.AlterTableType_AT_DetachPartition,
			pg.AlterTableType_AT_DetachPartitionFinalize, pg.AlterTableType_AT_DropInherit,
			pg.AlterTableType_AT_AddInherit, pg.AlterTableType_AT_ChangeOwner, pg.AlterTableType_AT_GenericOptions:
			continue
		case pg.AlterTableType_AT_AddColumn:
			if constantColumn(cmd.Def.GetColumnDef()) {
				continue
			}
		}
		return "ALTER TABLE ... " + alterTableWhat(cmd)
	}
	return ""
}

// hit returns the refusal of what on the relation [schema.]rel, if it may
// be one of the set's (an unqualified name matches any schema).
func (s *HierarchySet) hit(schema, rel, what string) *Error {
	for _, p := range s.byRel[rel] {
		if schema != "" && schema != p.Schema {
			continue
		}
		name := quoteIdent(p.Schema) + "." + quoteIdent(p.Name)
		return &Error{
			Code:    CodeRefused,
			Message: fmt.Sprintf("fenceproxy: %s on %s is not allowed through the proxy: it would reach protected table %s without naming it", what, name, p.Target),
			Detail:  p.Via + ". DROP TABLE of a partitioned table drops its partitions, ALTER TABLE of a parent changes its children, and a row trigger on a partitioned table is created on its partitions.",
			Hint:    "Run the DDL on a direct connection to PostgreSQL, or ALTER TABLE ONLY where it suffices.",
			Table:   p.Target,
		}
	}
	return nil
}

// dropDatabaseRefusal refuses, in any session, a DROP DATABASE of a
// database in which some table of the configuration is protected (an
// entry in mode enforce or audit whose scope includes the database, or
// has no database scope): a session the rules do not fence may still drop
// another database that holds protected tables. Any set of the
// configuration answers alike (the root's or a derived one's). It parses
// only texts with the words DROP and DATABASE. DecideFor calls it for
// sessions the rules do not fence; a session they fence gets the refusal
// from Decide.
func (r *Rules) dropDatabaseRefusal(sql string) *Error {
	if !containsWordFoldASCII(sql, "database") || !containsWordFoldASCII(sql, "drop") {
		return nil
	}
	tree, err := pg.Parse(sql)
	if err != nil {
		return nil // the server refuses it too
	}
	for _, raw := range tree.Stmts {
		d := raw.GetStmt().GetDropdbStmt()
		if d == nil || !r.protectsDatabase(d.Dbname) {
			continue
		}
		return &Error{Code: CodeRefused,
			Message: "fenceproxy: DROP DATABASE " + d.Dbname + " is not allowed through the proxy: the database holds protected tables",
			Hint:    hintDirect}
	}
	return nil
}

// fences reports whether the set fences some table (in mode enforce or
// audit).
func (r *Rules) fences() bool { return len(r.tables) > 0 }

// protectsDatabase reports whether some entry of the configuration
// fences a table in database db.
func (r *Rules) protectsDatabase(db string) bool {
	if r.scopes == nil {
		return len(r.listed) > 0 || len(r.audited) > 0
	}
	for _, g := range r.scopes.groups {
		for _, e := range g.entries {
			if e.rule != nil && listMatches(e.scope.databases, db) {
				return true
			}
		}
	}
	return false
}

const (
	hintDirect  = "Run it on a direct connection to PostgreSQL as a DBA."
	hintCascade = "Drop the dependent objects by name and use RESTRICT (the default), or run it on a direct connection to PostgreSQL as a DBA."
)

// leadingWord returns the run of identifier bytes s starts with, cut after
// ten bytes (longer than any word reachWord knows).
func leadingWord(s string) string {
	n := 0
	for n < len(s) && n < 10 && sqllex.IsIdentCont(s[n]) {
		n++
	}
	return s[:n]
}
