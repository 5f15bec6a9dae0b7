package rules

import (
	"fmt"
	"slices"
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

// unnamedReach describes a statement that can drop a table, move it, or
// change its owner or its extension membership without naming it.
type unnamedReach struct {
	what   string // the statement, for the message
	effect string // what it does to objects it does not name
	hint   string
}

const (
	hintDirect  = "Run it on a direct connection to PostgreSQL as a DBA."
	hintCascade = "Drop the dependent objects by name and use RESTRICT (the default), or run it on a direct connection to PostgreSQL as a DBA."
)

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

// mayReachUnnamed is MayTouch's check for the statements reachesUnnamed
// refuses, which need not name a protected table: it reports whether sql
// has the word "owned" (DROP OWNED, REASSIGN OWNED), or "alter" or "drop"
// with "cascade", "extension" or "database". Words are compared ignoring
// ASCII case wherever they appear (in strings and comments too: a false
// positive only costs a parse); a keyword is always such a word, as the
// lexer ends an identifier or keyword only at a byte that cannot continue
// one. It does not allocate.
func mayReachUnnamed(sql string) bool {
	alterDrop, object := false, false
	for i := 0; i < len(sql); {
		if !isIdentCont(sql[i]) {
			i++
			continue
		}
		j := i + 1
		for j < len(sql) && isIdentCont(sql[j]) {
			j++
		}
		switch w := sql[i:j]; {
		case len(w) < 4 || len(w) > 9:
		case hasPrefixFoldASCII(w, "owned") && len(w) == 5:
			return true
		case len(w) == 5 && hasPrefixFoldASCII(w, "alter"), len(w) == 4 && hasPrefixFoldASCII(w, "drop"):
			alterDrop = true
		case len(w) == 7 && hasPrefixFoldASCII(w, "cascade"), len(w) == 9 && hasPrefixFoldASCII(w, "extension"),
			len(w) == 8 && hasPrefixFoldASCII(w, "database"):
			object = true
		}
		if alterDrop && object {
			return true
		}
		i = j
	}
	return false
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
	return containsWordFoldASCII(sql, "alter") || containsWordFoldASCII(sql, "drop") || containsWordFoldASCII(sql, "trigger")
}

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

// DropDatabaseRefusal refuses, in any session, a DROP DATABASE of a
// database in which some table of the configuration is protected (an
// entry in mode enforce or audit whose scope includes the database, or
// has no database scope): a session the rules do not fence may still drop
// another database that holds protected tables. Call it on the root rule
// set (before ForSession). It parses only texts with the words DROP and
// DATABASE. (A session the rules fence gets the refusal from Decide.)
func (r *Rules) DropDatabaseRefusal(sql string) *Error {
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

// Fences reports whether the set fences some table (in mode enforce or
// audit).
func (r *Rules) Fences() bool { return len(r.tables) > 0 }

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
