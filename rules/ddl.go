package rules

import (
	"fmt"

	pg "github.com/pganalyze/pg_query_go/v6"
)

// DDL that would silently take a protected table out of fenceproxy's hands
// is refused: renaming the table or moving it to another schema (writes
// under the new name would not be fenced), renaming its schema, and
// renaming, dropping or retyping its fence column (which holds the
// watermarks: a column added back, or converted with USING, starts from
// scratch, and stale tokens would pass). Everything else, including DROP
// TABLE, other ALTER TABLE forms and renaming another table to a protected
// name, is forwarded.

// matchAll returns every rule a DDL statement's relation may name: the
// exact table for a schema-qualified name, every protected table with that
// relation name for an unqualified one (fail closed). Unlike match it never
// reports an ambiguity: the statement is refused whichever table it names.
func (w *walker) matchAll(rv *pg.RangeVar) []*tableRule {
	if rv == nil {
		return nil
	}
	cands := w.r.byRel[rv.Relname]
	if rv.Schemaname == "" {
		return cands
	}
	for _, t := range cands {
		if t.schema == rv.Schemaname {
			return []*tableRule{t}
		}
	}
	return nil
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
		if ts := withColumn(w.matchAll(n.Relation), n.Subname); len(ts) > 0 {
			w.refuseDDL(ts, fmt.Sprintf("fenceproxy: renaming fence column %s of %s is not allowed",
				quoteIdent(n.Subname), describeTables(displays(ts))),
				"The fence column holds the table's fencing watermarks; fenceproxy fences writes through the configured column name.")
		}
	case pg.ObjectType_OBJECT_TABCONSTRAINT, pg.ObjectType_OBJECT_TRIGGER, pg.ObjectType_OBJECT_POLICY, pg.ObjectType_OBJECT_RULE:
		// Renames something on the table, not the table.
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
// table.
func (w *walker) alterObjectSchemaStmt(n *pg.AlterObjectSchemaStmt) {
	if ts := w.matchAll(n.Relation); len(ts) > 0 {
		w.refuseDDL(ts, fmt.Sprintf("fenceproxy: moving %s to schema %s is not allowed: writes under the new name would not be fenced",
			describeTables(displays(ts)), quoteIdent(n.Newschema)),
			"fenceproxy protects tables by schema-qualified name.")
	}
}

// alterTableStmt refuses ALTER TABLE ... DROP COLUMN and ALTER COLUMN ...
// TYPE of a protected table's fence column. Other subcommands (ADD COLUMN,
// defaults, NOT NULL, constraints, ...) are forwarded: a NULL fence value
// is treated as stale, and the proxy always sets the column itself.
func (w *walker) alterTableStmt(n *pg.AlterTableStmt) {
	tables := w.matchAll(n.Relation)
	if len(tables) == 0 {
		return
	}
	for _, c := range n.Cmds {
		cmd := c.GetAlterTableCmd()
		if cmd == nil {
			continue
		}
		var what string
		switch cmd.Subtype {
		case pg.AlterTableType_AT_DropColumn:
			what = "dropping"
		case pg.AlterTableType_AT_AlterColumnType:
			what = "changing the type of"
		default:
			continue
		}
		if ts := withColumn(tables, cmd.Name); len(ts) > 0 {
			w.refuseDDL(ts, fmt.Sprintf("fenceproxy: %s fence column %s of %s is not allowed",
				what, quoteIdent(cmd.Name), describeTables(displays(ts))),
				"The fence column holds the table's fencing watermarks: a column added back, or converted, could lose them and let stale tokens through.")
			return
		}
	}
}
