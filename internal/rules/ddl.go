package rules

import (
	"fmt"
	"strings"
	"unicode"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// DDL on a protected table through the proxy is default-deny: DBAs run it
// on a direct connection. Allowed through the proxy is only what can
// neither weaken fencing nor change the table's data (see ddlAllowList):
// CREATE INDEX and REINDEX, COMMENT, GRANT and REVOKE, ANALYZE, VACUUM and
// CLUSTER (which move or describe rows but keep their values), and ALTER
// TABLE ... ADD COLUMN with no default or a constant one (PostgreSQL stores
// a constant default in the catalog without rewriting a row; a volatile
// one, an identity or a generated column would fill every row, and a
// foreign key could make deletes elsewhere cascade into the table).
//
// Refused, besides every other ALTER TABLE form on a protected table:
// renaming it, its schema or anything on it, SET SCHEMA, DROP TABLE (and
// DROP SCHEMA of its schema), triggers, rules and policies on it (a BEFORE
// UPDATE trigger could pin the fence column), inheritance or partitioning
// that involves it on either side (the parent's writes would reach it
// unfenced), views over it (auto-updatable views are a write path that does
// not name it), and any other statement that names it as a relation
// (CREATE STATISTICS, publications, ...). Creating a table under a
// protected name, or renaming another table to one, is forwarded: it
// creates protection rather than removing it.
//
// Some statements reach a table without naming it: DROP OWNED drops, and
// REASSIGN OWNED gives away, whatever the roles own; DROP EXTENSION drops
// its member objects, which ALTER EXTENSION ... ADD and DROP choose and
// ALTER EXTENSION ... SET SCHEMA moves; an extension's update script may do
// anything to them; CASCADE drops what depends on the object named (a
// table typed by a type, a column of a domain, a default calling a
// function, every object of a schema, an inheritance child); DROP DATABASE
// drops every table in it. Which tables that is depends on the catalog
// (pg_depend, pg_shdepend), which the proxy does not read, so where the
// session fences any table these are refused (see reachesUnnamed). The
// RESTRICT form (the default) of every other DROP fails on the server
// while anything depends on the object, with one exception the text cannot
// show: DROP TABLE of a partitioned table drops its partitions. See
// https://www.postgresql.org/docs/current/ddl-depend.html and the pages of
// DROP OWNED, REASSIGN OWNED and ALTER EXTENSION.

// ddlAllowList is named in every DDL refusal.
const ddlAllowList = "CREATE INDEX, REINDEX, COMMENT, GRANT/REVOKE, ANALYZE, VACUUM, CLUSTER, and ALTER TABLE ... ADD COLUMN with no default or a constant one"

// matchAll returns every rule a DDL statement's relation may name: the
// exact table for a schema-qualified name, every protected table with that
// relation name for an unqualified one (fail closed). Unlike match it never
// reports an ambiguity: the statement is refused whichever table it names.
func (w *walker) matchAll(rv *pg.RangeVar) []*tableRule {
	if rv == nil {
		return nil
	}
	return w.r.relMatches(rv.Schemaname, rv.Relname)
}

// relMatches is matchAll for a relation name and an optional schema.
func (r *Rules) relMatches(schema, rel string) []*tableRule {
	cands := r.byRel[rel]
	if schema == "" {
		return cands
	}
	for _, t := range cands {
		if t.schema == schema {
			return []*tableRule{t}
		}
	}
	return nil
}

// qualifiedMatches is relMatches for a qualified name given as a list of
// String nodes ([catalog.][schema.]name).
func (r *Rules) qualifiedMatches(names []*pg.Node) []*tableRule {
	if len(names) == 0 {
		return nil
	}
	rel := names[len(names)-1].GetString_().GetSval()
	schema := ""
	if len(names) > 1 {
		schema = names[len(names)-2].GetString_().GetSval()
	}
	return r.relMatches(schema, rel)
}

// withColumn returns the rules of tables whose fence column is col.
func withColumn(tables []*tableRule, col string) []*tableRule {
	var out []*tableRule
	for _, t := range tables {
		if t.column == col {
			out = append(out, t)
		}
	}
	return out
}

// refuseDDL refuses a DDL statement on tables (not empty); msg gets the
// way out appended.
func (w *walker) refuseDDL(tables []*tableRule, msg, detail string) {
	w.refuse(tables, msg+" (change the fenceproxy configuration first, and run the DDL without the proxy)", detail,
		"Update the configuration for the new name or column (or stop protecting the table) and reload it, then run the DDL on a direct connection.")
}

// renameStmt refuses ALTER ... RENAME of a protected table, of its fence
// column, or of a schema holding a protected table.
func (w *walker) renameStmt(n *pg.RenameStmt) {
	switch n.RenameType {
	case pg.ObjectType_OBJECT_SCHEMA:
		var in []*tableRule
		for _, t := range w.r.tables {
			if t.schema == n.Subname {
				in = append(in, t)
			}
		}
		if len(in) > 0 {
			names := displays(in)
			w.refuseDDL(in, fmt.Sprintf("fenceproxy: renaming schema %s is not allowed: it holds %s, which would no longer be fenced under the new name",
				quoteIdent(n.Subname), describeTables(names)),
				"fenceproxy protects tables by name; writes to them under the new schema name would not be fenced.")
		}
	case pg.ObjectType_OBJECT_COLUMN, pg.ObjectType_OBJECT_ATTRIBUTE:
		// ALTER TYPE ... RENAME ATTRIBUTE on a table's row type fails on
		// the server; refused alike (fail closed).
		tables := w.matchAll(n.Relation)
		if ts := withColumn(tables, n.Subname); len(ts) > 0 {
			w.refuseDDL(ts, fmt.Sprintf("fenceproxy: renaming fence column %s of %s is not allowed",
				quoteIdent(n.Subname), describeTables(displays(ts))),
				"The fence column holds the table's fencing watermarks; fenceproxy fences writes through the configured column name.")
		} else if len(tables) > 0 {
			w.denyDDL(tables, "renaming a column")
		}
	case pg.ObjectType_OBJECT_TABCONSTRAINT, pg.ObjectType_OBJECT_TRIGGER, pg.ObjectType_OBJECT_POLICY, pg.ObjectType_OBJECT_RULE:
		// Renames something on the table: a trigger's name decides when it
		// fires relative to the others.
		if ts := w.matchAll(n.Relation); len(ts) > 0 {
			what := map[pg.ObjectType]string{pg.ObjectType_OBJECT_TABCONSTRAINT: "a constraint", pg.ObjectType_OBJECT_TRIGGER: "a trigger",
				pg.ObjectType_OBJECT_POLICY: "a policy", pg.ObjectType_OBJECT_RULE: "a rule"}[n.RenameType]
			w.denyDDL(ts, "renaming "+what)
		}
	default:
		// The table itself, whatever the statement calls it: PostgreSQL
		// lets ALTER INDEX ... RENAME rename a table.
		if ts := w.matchAll(n.Relation); len(ts) > 0 {
			w.refuseDDL(ts, fmt.Sprintf("fenceproxy: renaming %s is not allowed: writes under the new name would not be fenced",
				describeTables(displays(ts))),
				"fenceproxy protects tables by name.")
		}
	}
}

// alterObjectSchemaStmt refuses ALTER TABLE ... SET SCHEMA of a protected
// table, and ALTER EXTENSION ... SET SCHEMA, which moves the extension's
// members.
func (w *walker) alterObjectSchemaStmt(n *pg.AlterObjectSchemaStmt) {
	if ts := w.matchAll(n.Relation); len(ts) > 0 {
		w.refuseDDL(ts, fmt.Sprintf("fenceproxy: moving %s to schema %s is not allowed: writes under the new name would not be fenced",
			describeTables(displays(ts)), quoteIdent(n.Newschema)),
			"fenceproxy protects tables by schema-qualified name.")
	}
	w.unnamed(n)
}

// denyDDL refuses DDL on protected tables (not empty) that is not on the
// allow-list; what names the statement or subcommand.
func (w *walker) denyDDL(tables []*tableRule, what string) bool {
	return w.refuse(tables, fmt.Sprintf("fenceproxy: %s on %s is not allowed through the proxy; run DDL on protected tables without the proxy",
		what, describeTables(displays(tables))),
		"DDL on a protected table is refused unless it can neither weaken fencing nor change the table's data.",
		"Run it on a direct connection to PostgreSQL. Allowed through the proxy: "+ddlAllowList+".")
}

// alterTableStmt applies the DDL rules to ALTER TABLE (and ALTER INDEX,
// VIEW, FOREIGN TABLE, ... which share its node): on a protected table only
// ADD COLUMN with a constant default or none is allowed; on any table,
// INHERIT, NO INHERIT, ATTACH PARTITION and DETACH PARTITION naming a
// protected table are refused.
func (w *walker) alterTableStmt(n *pg.AlterTableStmt) {
	tables := w.matchAll(n.Relation)
	for _, c := range n.Cmds {
		cmd := c.GetAlterTableCmd()
		if cmd == nil {
			if len(tables) > 0 && w.denyDDL(tables, "ALTER TABLE") {
				return
			}
			continue
		}
		var other []*tableRule // a protected table the subcommand names
		switch cmd.Subtype {
		case pg.AlterTableType_AT_AddInherit, pg.AlterTableType_AT_DropInherit:
			other = w.matchAll(cmd.Def.GetRangeVar())
		case pg.AlterTableType_AT_AttachPartition, pg.AlterTableType_AT_DetachPartition, pg.AlterTableType_AT_DetachPartitionFinalize:
			other = w.matchAll(cmd.Def.GetPartitionCmd().GetName())
		}
		what := "ALTER TABLE ... " + alterTableWhat(cmd)
		if len(other) > 0 && w.denyDDL(other, what) {
			return
		}
		if len(tables) == 0 {
			continue
		}
		if cmd.Subtype == pg.AlterTableType_AT_AddColumn {
			if constantColumn(cmd.Def.GetColumnDef()) {
				continue
			}
			what = "ALTER TABLE ... ADD COLUMN with a non-constant default, an identity, a generated expression or a constraint"
		}
		if ts := withColumn(tables, cmd.Name); len(ts) > 0 && cmd.Name != "" {
			what += " of fence column " + quoteIdent(cmd.Name)
		}
		if w.denyDDL(tables, what) {
			return
		}
	}
	// DROP COLUMN or DROP CONSTRAINT ... CASCADE of another table, ALTER
	// TYPE ... DROP ATTRIBUTE ... CASCADE (which reaches typed tables).
	w.unnamed(n)
}

// alterTableWhat names an ALTER TABLE subcommand for a refusal.
func alterTableWhat(cmd *pg.AlterTableCmd) string {
	switch cmd.Subtype {
	case pg.AlterTableType_AT_AddInherit:
		return "INHERIT"
	case pg.AlterTableType_AT_DropInherit:
		return "NO INHERIT"
	case pg.AlterTableType_AT_AttachPartition:
		return "ATTACH PARTITION"
	case pg.AlterTableType_AT_DetachPartition, pg.AlterTableType_AT_DetachPartitionFinalize:
		return "DETACH PARTITION"
	case pg.AlterTableType_AT_DropColumn:
		return "DROP COLUMN"
	case pg.AlterTableType_AT_AlterColumnType:
		return "ALTER COLUMN ... TYPE"
	case pg.AlterTableType_AT_AddColumn:
		return "ADD COLUMN"
	case pg.AlterTableType_AT_AddConstraint:
		return "ADD CONSTRAINT"
	case pg.AlterTableType_AT_DropConstraint:
		return "DROP CONSTRAINT"
	case pg.AlterTableType_AT_ColumnDefault:
		return "ALTER COLUMN ... DEFAULT"
	case pg.AlterTableType_AT_SetAccessMethod:
		return "SET ACCESS METHOD"
	case pg.AlterTableType_AT_SetTableSpace:
		return "SET TABLESPACE"
	case pg.AlterTableType_AT_SetLogged:
		return "SET LOGGED"
	case pg.AlterTableType_AT_SetUnLogged:
		return "SET UNLOGGED"
	case pg.AlterTableType_AT_ChangeOwner:
		return "OWNER TO"
	case pg.AlterTableType_AT_EnableTrig, pg.AlterTableType_AT_EnableAlwaysTrig, pg.AlterTableType_AT_EnableReplicaTrig,
		pg.AlterTableType_AT_EnableTrigAll, pg.AlterTableType_AT_EnableTrigUser:
		return "ENABLE TRIGGER"
	case pg.AlterTableType_AT_DisableTrig, pg.AlterTableType_AT_DisableTrigAll, pg.AlterTableType_AT_DisableTrigUser:
		return "DISABLE TRIGGER"
	case pg.AlterTableType_AT_EnableRule, pg.AlterTableType_AT_EnableAlwaysRule, pg.AlterTableType_AT_EnableReplicaRule:
		return "ENABLE RULE"
	case pg.AlterTableType_AT_DisableRule:
		return "DISABLE RULE"
	case pg.AlterTableType_AT_EnableRowSecurity, pg.AlterTableType_AT_DisableRowSecurity,
		pg.AlterTableType_AT_ForceRowSecurity, pg.AlterTableType_AT_NoForceRowSecurity:
		return "ROW LEVEL SECURITY"
	}
	// AT_DropNotNull -> DROP NOT NULL
	var b strings.Builder
	for i, r := range strings.TrimPrefix(cmd.Subtype.String(), "AT_") {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte(' ')
		}
		b.WriteRune(unicode.ToUpper(r))
	}
	return b.String()
}

// constantColumn reports whether an added column gets no value but NULL or
// a constant default in every existing row, without a rewrite: no
// volatile or other non-constant default, no identity, no generated
// expression, and no constraint other than NULL / NOT NULL.
func constantColumn(cd *pg.ColumnDef) bool {
	if cd == nil || cd.Identity != "" || cd.Generated != "" || cd.RawDefault != nil || cd.CookedDefault != nil {
		return false
	}
	for _, c := range cd.Constraints {
		k := c.GetConstraint()
		if k == nil {
			return false
		}
		switch k.Contype {
		case pg.ConstrType_CONSTR_NULL, pg.ConstrType_CONSTR_NOTNULL:
		case pg.ConstrType_CONSTR_DEFAULT:
			if !isConstant(k.RawExpr) {
				return false
			}
		default:
			return false
		}
	}
	return true
}

// isConstant reports whether n is a literal, possibly cast.
func isConstant(n *pg.Node) bool {
	for n.GetTypeCast() != nil {
		n = n.GetTypeCast().Arg
	}
	return n.GetAConst() != nil
}

// notDDL lists the statements the catch-all in ddl leaves alone: queries
// and session commands, statements handled elsewhere, and the allow-list.
var notDDL = map[protoreflect.Name]bool{
	"RawStmt": true, "SelectStmt": true, "InsertStmt": true, "UpdateStmt": true, "DeleteStmt": true,
	"MergeStmt": true, "SetOperationStmt": true, "ReturnStmt": true, "PLAssignStmt": true,
	"ExplainStmt": true, "PrepareStmt": true, "ExecuteStmt": true, "DeallocateStmt": true,
	"DeclareCursorStmt": true, "FetchStmt": true, "ClosePortalStmt": true, "TransactionStmt": true,
	"VariableSetStmt": true, "VariableShowStmt": true, "DiscardStmt": true, "ListenStmt": true,
	"NotifyStmt": true, "UnlistenStmt": true, "CheckPointStmt": true, "LoadStmt": true,
	"LockStmt": true, "CallStmt": true, "CreateTableAsStmt": true,
	// Handled in pre.
	"CopyStmt": true, "TruncateStmt": true, "DoStmt": true, "CreateFunctionStmt": true, "RuleStmt": true,
	"RenameStmt": true, "AlterObjectSchemaStmt": true, "AlterTableStmt": true,
	// The allow-list.
	"IndexStmt": true, "ReindexStmt": true, "CommentStmt": true, "GrantStmt": true,
	"VacuumStmt": true, "ClusterStmt": true,
}

// ddlNames names statements in refusals.
var ddlNames = map[protoreflect.Name]string{
	"CreateTrigStmt": "CREATE TRIGGER", "CreatePolicyStmt": "CREATE POLICY", "AlterPolicyStmt": "ALTER POLICY",
	"CreateStatsStmt": "CREATE STATISTICS", "CreatePublicationStmt": "CREATE PUBLICATION",
	"AlterPublicationStmt": "ALTER PUBLICATION", "RefreshMatViewStmt": "REFRESH MATERIALIZED VIEW",
	"ImportForeignSchemaStmt": "IMPORT FOREIGN SCHEMA",
}

// ddl applies the DDL rules to statements pre has no case for; it returns
// whether to walk the node's children.
func (w *walker) ddl(m protoreflect.ProtoMessage) bool {
	switch n := m.(type) {
	case *pg.DropStmt:
		w.dropStmt(n)
		w.unnamed(n)
		return false
	case *pg.CreateStmt:
		w.createStmt(n)
		return true
	case *pg.ViewStmt:
		// An auto-updatable view is a write path that never names the
		// table.
		var found []*tableRule
		found = append(found, w.matchAll(n.View)...)
		visitRangeVars(n.Query.ProtoReflect(), true, func(rv *pg.RangeVar) {
			found = append(found, w.matchAll(rv)...)
		})
		if len(found) > 0 {
			w.denyDDL(found, "a view over a protected table")
		}
		return true
	}
	name := m.ProtoReflect().Descriptor().Name()
	if !strings.HasSuffix(string(name), "Stmt") || notDDL[name] {
		return true
	}
	if w.unnamed(m) {
		return false
	}
	// Any other utility statement that names a protected table as a
	// relation (outside the queries it contains, walked as queries).
	var found []*tableRule
	visitRangeVars(m.ProtoReflect(), false, func(rv *pg.RangeVar) {
		found = append(found, w.matchAll(rv)...)
	})
	if len(found) > 0 {
		what, ok := ddlNames[name]
		if !ok {
			what = "this statement"
		}
		w.denyDDL(found, what)
	}
	return true
}

// visitRangeVars calls f with every RangeVar under m; unless intoStmts, it
// does not descend into nested statements (other than m itself).
func visitRangeVars(m protoreflect.Message, intoStmts bool, f func(*pg.RangeVar)) {
	top := m
	walkMessages(m, func(m protoreflect.Message) bool {
		if rv, ok := m.Interface().(*pg.RangeVar); ok {
			f(rv)
			return false
		}
		return intoStmts || m == top || !strings.HasSuffix(string(m.Descriptor().Name()), "Stmt")
	})
}

// dropStmt refuses DROP TABLE (VIEW, FOREIGN TABLE, ...) of a protected
// table, DROP TRIGGER, RULE or POLICY on one, and DROP SCHEMA of a schema
// holding one.
func (w *walker) dropStmt(n *pg.DropStmt) {
	var found []*tableRule
	what := "DROP " + strings.ReplaceAll(strings.TrimPrefix(n.RemoveType.String(), "OBJECT_"), "_", " ")
	switch n.RemoveType {
	case pg.ObjectType_OBJECT_TABLE, pg.ObjectType_OBJECT_VIEW, pg.ObjectType_OBJECT_MATVIEW,
		pg.ObjectType_OBJECT_FOREIGN_TABLE, pg.ObjectType_OBJECT_SEQUENCE:
		for _, o := range n.Objects {
			found = append(found, w.r.qualifiedMatches(o.GetList().GetItems())...)
		}
	case pg.ObjectType_OBJECT_TRIGGER, pg.ObjectType_OBJECT_RULE, pg.ObjectType_OBJECT_POLICY:
		// [schema.]table.name
		for _, o := range n.Objects {
			if items := o.GetList().GetItems(); len(items) > 1 {
				found = append(found, w.r.qualifiedMatches(items[:len(items)-1])...)
			}
		}
	case pg.ObjectType_OBJECT_SCHEMA:
		for _, o := range n.Objects {
			s := o.GetString_().GetSval()
			for _, t := range w.r.tables {
				if t.schema == s {
					found = append(found, t)
				}
			}
		}
	}
	if len(found) > 0 {
		w.denyDDL(found, what)
	}
}

// createStmt refuses CREATE TABLE ... INHERITS or PARTITION OF a protected
// table (the parent's writes reach the child without naming it), and the
// same with a protected table as the child.
func (w *walker) createStmt(n *pg.CreateStmt) {
	var found []*tableRule
	for _, p := range n.InhRelations {
		found = append(found, w.matchAll(p.GetRangeVar())...)
	}
	if len(n.InhRelations) > 0 || n.Partbound != nil {
		found = append(found, w.matchAll(n.Relation)...)
	}
	if len(found) > 0 {
		what := "CREATE TABLE ... INHERITS"
		if n.Partbound != nil {
			what = "CREATE TABLE ... PARTITION OF"
		}
		w.denyDDL(found, what)
	}
}

// DDL on a relation whose inheritance or partition hierarchy holds a
// protected table reaches the table without naming it: DROP TABLE of a
// partitioned parent drops its partitions (RESTRICT or not), ALTER TABLE
// of a parent recurses to its children (DROP COLUMN, ALTER COLUMN ...
// TYPE, a volatile default, constraints, triggers, ...), and a row trigger
// created on a partitioned table is cloned onto its partitions. Which
// relations those are comes from the catalog (the policy's database
// checks), so HierarchySet is built from their paths of kind partition or
// inheritance, as NewIndirectSet is from all of them. See
// https://www.postgresql.org/docs/current/ddl-inherit.html and
// https://www.postgresql.org/docs/current/ddl-partitioning.html.
