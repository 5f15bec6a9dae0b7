package rules

import (
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Migrations at application start-up send DDL through the proxy that the
// default-deny of DDL refuses (ddl.go). The policy forwards two kinds of
// it, which need what the rewriter cannot know: DDL that changes nothing,
// judged against the catalog (Sequelize's sync({alter: true}) sends ALTER
// COLUMN ... SET NOT NULL, DROP DEFAULT and TYPE for every column at every
// start), and any DDL of a configured migrations role. Migration describes
// a text for that; the policy looks the catalog up.

// NoopKind is an ALTER TABLE subcommand whose effect the catalog can show
// to be nothing.
type NoopKind uint8

const (
	// NoopAllowed: on the allow-list (ADD COLUMN with a constant default
	// or none): needs no lookup.
	NoopAllowed NoopKind = iota
	// NoopSetNotNull: ALTER COLUMN Column SET NOT NULL, nothing when the
	// column is NOT NULL.
	NoopSetNotNull
	// NoopDropNotNull: nothing when the column is nullable.
	NoopDropNotNull
	// NoopDropDefault: nothing when the column has no default.
	NoopDropDefault
	// NoopSetDefault: nothing when the column's default is Expr
	// (SameExpression).
	NoopSetDefault
	// NoopType: ALTER COLUMN Column TYPE Type without USING or COLLATE,
	// nothing when the column has that type and type modifier.
	NoopType
	// NoopColumnExists: ADD COLUMN IF NOT EXISTS Column, which PostgreSQL
	// skips whatever its definition when the column exists.
	NoopColumnExists
)

// NoopCmd is one ALTER TABLE subcommand for the catalog to judge.
type NoopCmd struct {
	Kind   NoopKind
	Column string // exact (folded) name
	Type   string // NoopType: the type as PostgreSQL reads it (deparsed)
	Expr   string // NoopSetDefault: the expression (deparsed)
}

// TableName is a protected table a statement may name.
type TableName struct {
	Schema, Table string // exact names
	Display       string
}

// MigrationStmt is one DDL statement of a text.
type MigrationStmt struct {
	// Kind names the statement for logs: "ALTER TABLE", "CREATE TABLE".
	Kind string
	// Tables are the protected tables the statement may name (every
	// protected table of that relation name for an unqualified one).
	Tables []TableName
	// Cmds, for an ALTER TABLE of which every subcommand can be judged
	// against the catalog (Judged), are those subcommands.
	Cmds   []NoopCmd
	Judged bool
	// CreatesProtected: a CREATE TABLE of a protected name (a first
	// migration), whose fence column the database check then judges.
	CreatesProtected bool
}

// migrationKinds are the statements a migrations role may run on a
// protected table, with their names for the log. Statements that reach
// tables without naming them (DROP OWNED, REASSIGN OWNED, ALTER
// EXTENSION, DO, functions) are not among them.
var migrationKinds = map[protoreflect.Name]string{
	"AlterTableStmt": "ALTER TABLE", "CreateStmt": "CREATE TABLE", "DropStmt": "DROP",
	"IndexStmt": "CREATE INDEX", "ReindexStmt": "REINDEX", "RenameStmt": "RENAME",
	"AlterObjectSchemaStmt": "SET SCHEMA", "CreateTrigStmt": "CREATE TRIGGER", "CreatePolicyStmt": "CREATE POLICY",
	"AlterPolicyStmt": "ALTER POLICY", "ViewStmt": "CREATE VIEW", "CommentStmt": "COMMENT", "GrantStmt": "GRANT",
	"CreateStatsStmt": "CREATE STATISTICS", "RuleStmt": "CREATE RULE", "CreateSeqStmt": "CREATE SEQUENCE",
	"AlterSeqStmt": "ALTER SEQUENCE", "CreateEnumStmt": "CREATE TYPE", "AlterEnumStmt": "ALTER TYPE",
	"CompositeTypeStmt": "CREATE TYPE", "CreateDomainStmt": "CREATE DOMAIN", "AlterDomainStmt": "ALTER DOMAIN",
	"CreateSchemaStmt": "CREATE SCHEMA",
}

// MayBeMigration reports, without parsing or allocating, whether sql may
// be DDL Migration describes (it has the word ALTER, CREATE, DROP,
// COMMENT, GRANT, REINDEX or TRIGGER, ASCII case ignored).
func MayBeMigration(sql string) bool {
	return sqllex.ContainsAnyWordFold(sql, migrationWords)
}

// migrationWords are the words MayBeMigration looks for.
var migrationWords = []string{"alter", "create", "drop", "comment", "grant", "reindex", "trigger"}

// Migration describes sql when every statement of it is DDL of the kinds a
// migration sends and one names a protected table; ok is false otherwise
// (a query or write among them, a statement that reaches tables without
// naming them, or a text that does not parse).
func (r *Rules) Migration(sql string) (stmts []MigrationStmt, ok bool) {
	tree, err := pg.Parse(sql)
	if err != nil || len(tree.Stmts) == 0 {
		return nil, false
	}
	named := false
	for _, raw := range tree.Stmts {
		m := raw.GetStmt().ProtoReflect()
		node, set := oneofMessage(m)
		if !set {
			return nil, false
		}
		kind, isDDL := migrationKinds[node.Descriptor().Name()]
		if !isDDL || reachesUnnamed(node.Interface()) != nil {
			return nil, false
		}
		s := MigrationStmt{Kind: kind}
		var found []*tableRule
		switch n := node.Interface().(type) {
		case *pg.AlterTableStmt:
			found = r.relMatches(n.GetRelation().GetSchemaname(), n.GetRelation().GetRelname())
			s.Cmds, s.Judged = noopCmds(n)
			for _, c := range n.Cmds {
				if o := c.GetAlterTableCmd(); o != nil {
					if d := o.Def.GetRangeVar(); d != nil {
						found = append(found, r.relMatches(d.Schemaname, d.Relname)...)
					}
					if d := o.Def.GetPartitionCmd().GetName(); d != nil {
						found = append(found, r.relMatches(d.Schemaname, d.Relname)...)
					}
				}
			}
		case *pg.CreateStmt:
			found = r.relMatches(n.GetRelation().GetSchemaname(), n.GetRelation().GetRelname())
			s.CreatesProtected = len(found) > 0
			for _, p := range n.InhRelations {
				found = append(found, r.relMatches(p.GetRangeVar().GetSchemaname(), p.GetRangeVar().GetRelname())...)
			}
		case *pg.DropStmt:
			for _, o := range n.Objects {
				if items := o.GetList().GetItems(); len(items) > 0 {
					found = append(found, r.qualifiedMatches(items)...)
					if len(items) > 1 {
						found = append(found, r.qualifiedMatches(items[:len(items)-1])...)
					}
				}
				if sc := o.GetString_().GetSval(); sc != "" && n.RemoveType == pg.ObjectType_OBJECT_SCHEMA {
					for _, t := range r.tables {
						if t.schema == sc {
							found = append(found, t)
						}
					}
				}
			}
		default:
			visitRangeVars(node, true, func(rv *pg.RangeVar) {
				found = append(found, r.relMatches(rv.Schemaname, rv.Relname)...)
			})
		}
		seen := map[*tableRule]bool{}
		for _, t := range found {
			if !seen[t] {
				seen[t] = true
				s.Tables = append(s.Tables, TableName{Schema: t.schema, Table: t.rel, Display: t.display})
			}
		}
		named = named || len(s.Tables) > 0
		stmts = append(stmts, s)
	}
	return stmts, named
}

// oneofMessage returns the message a Node holds.
func oneofMessage(m protoreflect.Message) (protoreflect.Message, bool) {
	var out protoreflect.Message
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Message() != nil {
			out = v.Message()
			return false
		}
		return true
	})
	return out, out != nil
}

// noopCmds lists the subcommands of n for the catalog to judge; false when
// some subcommand cannot be judged (it always changes something, or the
// catalog cannot show that it does not).
func noopCmds(n *pg.AlterTableStmt) ([]NoopCmd, bool) {
	if n.Objtype != pg.ObjectType_OBJECT_TABLE {
		return nil, false
	}
	var out []NoopCmd
	for _, c := range n.Cmds {
		cmd := c.GetAlterTableCmd()
		if cmd == nil {
			return nil, false
		}
		var k NoopCmd
		switch cmd.Subtype {
		case pg.AlterTableType_AT_SetNotNull:
			k = NoopCmd{Kind: NoopSetNotNull, Column: cmd.Name}
		case pg.AlterTableType_AT_DropNotNull:
			k = NoopCmd{Kind: NoopDropNotNull, Column: cmd.Name}
		case pg.AlterTableType_AT_ColumnDefault:
			if cmd.Def == nil {
				k = NoopCmd{Kind: NoopDropDefault, Column: cmd.Name}
				break
			}
			e, ok := deparseMigrationExpr(cmd.Def)
			if !ok {
				return nil, false
			}
			k = NoopCmd{Kind: NoopSetDefault, Column: cmd.Name, Expr: e}
		case pg.AlterTableType_AT_AlterColumnType:
			cd := cmd.Def.GetColumnDef()
			if cd == nil || cd.RawDefault != nil || cd.CollClause != nil || cd.TypeName == nil {
				return nil, false
			}
			e, ok := deparseMigrationExpr(&pg.Node{Node: &pg.Node_TypeCast{TypeCast: &pg.TypeCast{
				Arg: &pg.Node{Node: &pg.Node_AConst{AConst: &pg.A_Const{Isnull: true}}}, TypeName: cd.TypeName}}})
			if !ok || !strings.HasPrefix(e, "NULL::") {
				return nil, false
			}
			k = NoopCmd{Kind: NoopType, Column: cmd.Name, Type: strings.TrimPrefix(e, "NULL::")}
		case pg.AlterTableType_AT_AddColumn:
			cd := cmd.Def.GetColumnDef()
			switch {
			case constantColumn(cd):
				k = NoopCmd{Kind: NoopAllowed}
			case cmd.MissingOk && cd != nil:
				k = NoopCmd{Kind: NoopColumnExists, Column: cd.Colname}
			default:
				return nil, false
			}
		default:
			return nil, false
		}
		out = append(out, k)
	}
	return out, len(out) > 0
}

// deparseMigrationExpr prints an expression as PostgreSQL reads it.
func deparseMigrationExpr(n *pg.Node) (string, bool) {
	sel := &pg.SelectStmt{TargetList: []*pg.Node{{Node: &pg.Node_ResTarget{ResTarget: &pg.ResTarget{Val: n}}}},
		LimitOption: pg.LimitOption_LIMIT_OPTION_DEFAULT, Op: pg.SetOperation_SETOP_NONE}
	out, err := pg.Deparse(&pg.ParseResult{Version: parserVersion(), Stmts: []*pg.RawStmt{{Stmt: &pg.Node{Node: &pg.Node_SelectStmt{SelectStmt: sel}}}}})
	if err != nil || !strings.HasPrefix(out, "SELECT ") {
		return "", false
	}
	return strings.TrimPrefix(out, "SELECT "), true
}

// SameExpression reports whether the default expression client, as an
// ALTER ... SET DEFAULT sends it, is the default catalog (pg_get_expr of
// the column's default, which carries the cast to the column's type that
// PostgreSQL adds to an untyped literal): their parse trees are equal, or
// equal once that one outer cast is taken off the catalog's.
func SameExpression(client, catalog string) bool {
	a, ok1 := parseExpr(client)
	b, ok2 := parseExpr(catalog)
	if !ok1 || !ok2 {
		return false
	}
	if proto.Equal(a, b) {
		return true
	}
	if c := b.GetTypeCast(); c != nil && a.GetAConst() != nil && c.Arg.GetAConst() != nil {
		return proto.Equal(a, c.Arg)
	}
	return false
}

// parseExpr parses one expression with its locations cleared.
func parseExpr(e string) (*pg.Node, bool) {
	tree, err := pg.Parse("SELECT " + e)
	if err != nil || len(tree.Stmts) != 1 {
		return nil, false
	}
	sel := tree.Stmts[0].GetStmt().GetSelectStmt()
	if sel == nil || len(sel.TargetList) != 1 || sel.FromClause != nil {
		return nil, false
	}
	n := sel.TargetList[0].GetResTarget().GetVal()
	if n == nil {
		return nil, false
	}
	clearLocations(n.ProtoReflect())
	return n, true
}

func clearLocations(m protoreflect.Message) {
	walkMessages(m, func(m protoreflect.Message) bool {
		if fd := m.Descriptor().Fields().ByName("location"); fd != nil {
			m.Clear(fd)
		}
		return true
	})
}
