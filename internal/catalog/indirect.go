package catalog

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// Path kinds: the first step of an IndirectPath.
const (
	PathView        = "view"             // an updatable view (auto-updatable or INSTEAD OF trigger)
	PathRule        = "rule"             // a rewrite rule that writes another relation
	PathInheritance = "inheritance"      // an inheritance parent or child
	PathPartition   = "partition"        // a partitioned ancestor or a partition
	PathForeignKey  = "foreign key"      // an ON DELETE / ON UPDATE action of a foreign key
	PathTruncate    = "truncate cascade" // TRUNCATE ... CASCADE through a foreign key
	// PathLatent: no write through the relation reaches the table as the
	// catalog is, but one would once its rules or INSTEAD OF triggers
	// changed (a disabled rule enabled, an INSTEAD rule dropped, a trigger
	// created on a view). The entry has no Ops: it is for refusing such
	// DDL in a transaction that could then write through the new path
	// before the proxy sees the change.
	PathLatent = "latent"
)

// IndirectPath is a relation through which a statement writes a protected
// table without naming it.
type IndirectPath struct {
	// Schema and Name are the exact names of the relation the statement
	// would name.
	Schema, Name string
	// Kind is the kind of the first step from the relation towards the
	// protected table, one of the Path* constants (from a protected table,
	// of the first step that runs a statement of its own); later steps may
	// be of other kinds (Via lists them all).
	Kind string
	// Target is the protected table reached, schema.table, quoted where
	// needed as rules.TableSpec.Display quotes it.
	Target string
	// Ops lists the statement kinds that reach Target this way, in the order
	// INSERT, UPDATE, DELETE, MERGE, TRUNCATE. INSERT ... ON CONFLICT DO
	// UPDATE updates the relation it names: it takes the paths of INSERT
	// and of UPDATE (a rule action's is followed as both); a plain INSERT
	// runs no foreign key action. TRUNCATE through a foreign key means
	// TRUNCATE ... CASCADE.
	Ops []string
	// Via explains the steps, separated by "; "; of a chain of more than
	// eight, the first and last four.
	Via string
	// Columns, where the first step is a foreign key's ON UPDATE action,
	// are the referenced key's columns: an UPDATE (or the DO UPDATE of an
	// INSERT ... ON CONFLICT) reaches Target this way only when it sets
	// one of them. MERGE is taken to reach it whatever it sets.
	Columns []string
	// NewPartitions: a partition created or attached under the relation
	// would reach Target too (it gets the relation's foreign keys'
	// actions, and its rows are the relation's); NewChildren: so would an
	// inheritance child (its rows are the relation's, which are a
	// protected table's).
	NewPartitions, NewChildren bool
}

// Relation returns Schema.Name for display, quoted as Target is.
func (p IndirectPath) Relation() string { return pathRelName(p.Schema, p.Name) }

// Rel names a protected table by its exact (already folded) names.
type Rel struct{ Schema, Name string }

// IndirectPaths lists the relations through which a statement can write one
// of tables without naming it, as the catalog of conn's database has them:
//
//   - views whose writes reach a table: auto-updatable views (a view over
//     ONLY a table does not reach its children), views over views, and
//     views with INSTEAD OF triggers, where the trigger function runs
//     instead of the write and can write anything: such a view is reported
//     when it reads the table, for the operations it has triggers for;
//   - rules (ON INSERT/UPDATE/DELETE, DO ALSO or DO INSTEAD, conditional or
//     not) on any table or view whose actions write a table, including
//     through a data-modifying WITH; disabled rules are left out;
//   - inheritance and partitioned ancestors: UPDATE, DELETE, MERGE and
//     TRUNCATE of an ancestor reach its descendants, INSERT only routes
//     through partitioned tables; and descendants of a protected table,
//     whose rows are the protected table's rows;
//   - foreign keys with an ON DELETE or ON UPDATE action CASCADE, SET NULL
//     or SET DEFAULT: a DELETE or UPDATE of the referenced table writes the
//     referencing one, protected or itself referenced by such a key, and so
//     on down the chain;
//   - TRUNCATE ... CASCADE of a table that a protected table references
//     through any chain of foreign keys, whatever their actions
//     (https://www.postgresql.org/docs/current/sql-truncate.html).
//
// The steps combine: a view over a partitioned parent of a protected
// partition is reported, and so is a rule that writes such a view. Rules
// also fire for the queries that foreign key actions run (they are plain
// DELETE and UPDATE statements), and a child of two inheritance parents
// written through one holds rows of the other.
//
// An INSTEAD OF trigger is a function: IndirectPaths assumes it writes what
// its view reads, with the statement's own kind. Other triggers are left
// out altogether: a trigger on an unprotected table may write a protected
// one, but what it writes is in its function's code, not in the catalog.
// Also not found: writes by functions a view or a rule calls, foreign
// tables whose server is this database, and other sessions' temporary
// objects. An ON UPDATE action as the first step is reached by an UPDATE
// that sets a column of the referenced key (IndirectPath.Columns), or by
// any UPDATE where the referenced table has a BEFORE UPDATE row trigger
// (which may change the key); later in a chain, by any UPDATE.
//
// A protected table is listed only for the paths whose first step that
// runs a statement of its own is a rule, a foreign key action or
// TRUNCATE ... CASCADE, of the table or of a descendant its write
// reaches, to a protected table (itself included): the rewrite fences
// the statement that names it, not the statements its rules and foreign
// keys run. Such a path's Kind is that step's kind, and Via starts with
// the inheritance and partitioning steps that lead to it.
//
// Besides the paths, one PathLatent entry (with no Ops) is listed for
// each relation, other than a protected table, that has rules or is a
// view, and from which a path would open if its rules and triggers
// changed: every rule enabled and none replacing the write, every view
// with INSTEAD OF triggers. Names of tables that do not exist are
// ignored. The result is sorted by Schema, Name, Target, Kind
// and Via, one entry per first step and target, with the shortest chain of
// steps after the first. When conn is idle the catalog is read in one
// read-only repeatable-read transaction; inside a transaction, in that one.
func IndirectPaths(ctx context.Context, conn *pgx.Conn, tables []Rel) ([]IndirectPath, error) {
	if len(tables) == 0 {
		return nil, nil
	}
	r, err := Paths(ctx, conn, tables, nil)
	return r.Paths, err
}

// pathOp is a statement kind, an index into pathOpNames.
type pathOp uint8

const (
	opInsert pathOp = iota
	opUpdate
	opDelete
	opMerge
	opTruncate
	pathOpCount
)

var pathOpNames = [pathOpCount]string{"INSERT", "UPDATE", "DELETE", "MERGE", "TRUNCATE"}

// pathMode says how a relation is reached, which decides what happens
// next.
type pathMode uint8

const (
	// modeNamed: a statement (the client's, a rule action's, a view's
	// rewrite or a foreign key action's query) names the relation; its rules
	// fire and the write reaches its descendants.
	modeNamed pathMode = iota
	// modeNamedOnly: named with ONLY; rules fire, descendants are not
	// reached (INSERT into a partitioned table routes all the same).
	modeNamedOnly
	// modeChild: reached as a descendant of a relation written; its rules
	// do not fire, its own descendants are reached.
	modeChild
	// modeCascaded: truncated by TRUNCATE ... CASCADE; only further
	// cascades follow.
	modeCascaded
	// modeRows: rows written are rows of this ancestor; only its own
	// ancestors follow.
	modeRows
)

// pathState is "a statement of kind op writes rel, reached as mode".
type pathState struct {
	rel  uint32
	op   pathOp
	mode pathMode
}

// pathEdge is one step: writing from writes to.
type pathEdge struct {
	to   pathState
	kind string // Path*
	via  string
	// cols: an ON UPDATE action's, the columns an UPDATE must set to run
	// it (the referenced key).
	cols []string
}

// pathRel is a relation of the catalog.
type pathRel struct {
	oid         uint32
	schema      string
	name        string
	display     string
	kind        byte // pg_class.relkind: r, p, f or v
	isPartition bool
	updatable   uint32 // pg_relation_is_updatable bits, views only
	parents     []uint32
	children    []uint32
	rules       []*pathRule
	triggers    []*pathTrigger // INSTEAD OF triggers
	reads       []uint32       // views: relations read
	calls       []uint32       // views: user functions called (readers)
	base        uint32         // auto-updatable views: the FROM relation
	baseInh     bool           // ... without ONLY
	referenced  []*pathFK      // foreign keys referencing this relation
	// beforeUpdate: a BEFORE UPDATE row trigger may change the key of a
	// row whatever the UPDATE sets, so its ON UPDATE actions are reached
	// by any UPDATE (pathEdge.cols is left empty).
	beforeUpdate bool
	// generatedFrom maps each stored generated column to the columns its
	// expression reads.
	generatedFrom map[string][]string
	// alsoReads and alsoCalls: what a statement naming the relation may
	// read and call besides a view's query (readers): its rules'
	// actions, its row security policies, its triggers' functions, its
	// columns' defaults and check constraints.
	alsoReads, alsoCalls []uint32
}

// pathRule is a rewrite rule other than a view's SELECT rule.
type pathRule struct {
	name        string
	event       pathOp // opInsert, opUpdate or opDelete
	instead     bool
	conditional bool
	enabled     bool
	writes      []ruleWrite
}

// ruleWrite is a data-modifying query of a rule action.
type ruleWrite struct {
	rel uint32
	op  pathOp
	inh bool
}

// pathTrigger is an INSTEAD OF trigger of a view.
type pathTrigger struct {
	name     string
	function string // display name
	ops      []pathOp
}

// pathFK is a foreign key constraint.
type pathFK struct {
	name       string
	child      uint32   // conrelid, the referencing table
	parent     uint32   // confrelid, the referenced table
	onDelete   byte     // confdeltype: a, r, c, n or d
	onUpdate   byte     // confupdtype
	refClone   bool     // cloned for a partition of the referenced table
	childClone bool     // cloned for a partition of the referencing table
	refCols    []string // the referenced table's key columns
}

// pathGraph is the catalog read by loadPathGraph and the protected tables.
type pathGraph struct {
	rels      map[uint32]*pathRel
	byName    map[Rel]uint32
	protected map[uint32]bool
	// matviews are the materialized views (readers only: REFRESH reads
	// their query), kept out of rels, which the paths search.
	matviews []*pathRel
	version  int // server_version_num
	edgeMemo map[pathState][]pathEdge
	// pessimistic: edges as if every rule were enabled and none replaced
	// the write, and every view had INSTEAD OF triggers and were
	// auto-updatable over its FROM relation (latentPaths).
	pessimistic bool
}

// The catalog queries. User relations only: the system schemas' own
// (below the first normal OID) and TOAST tables are left out. Temporary
// relations are read too: another session can write through a temporary
// view (views have no storage), and a superuser can create one in
// information_schema.
const (
	pathRelsSQL = `
		SELECT c.oid, n.nspname, c.relname, c.relkind::text, c.relispartition,
			CASE WHEN c.relkind = 'v' THEN pg_catalog.pg_relation_is_updatable(c.oid, false) ELSE 0 END
		FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind IN ('r', 'p', 'f', 'v')
			AND (n.nspname NOT IN ('pg_catalog', 'information_schema') OR c.oid >= 16384)
			AND n.nspname !~ '^pg_toast'`

	// The node tree of each view's SELECT rule and of every other rule.
	pathRewriteSQL = `
		SELECT r.ev_class, r.rulename, r.ev_type::text, r.is_instead, r.ev_enabled::text,
			r.ev_qual::text <> '<>', r.ev_action::text
		FROM pg_catalog.pg_rewrite r JOIN pg_catalog.pg_class c ON c.oid = r.ev_class
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind IN ('r', 'p', 'f', 'v')
			AND (n.nspname NOT IN ('pg_catalog', 'information_schema') OR c.oid >= 16384)
			AND n.nspname !~ '^pg_toast'
		ORDER BY r.ev_class, r.rulename`

	// tgtype bits (pg_trigger.h): 64 INSTEAD, 4 INSERT, 8 DELETE, 16 UPDATE,
	// 1 ROW, 2 BEFORE. Views cannot disable triggers, so tgenabled is not
	// read. Also the BEFORE UPDATE row triggers of every table, disabled
	// or not (see pathRel.beforeUpdate).
	pathTriggersSQL = `
		SELECT t.tgrelid, t.tgname, t.tgtype::int, n.nspname, p.proname
		FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid
		JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		WHERE t.tgtype::int & 64 <> 0 OR t.tgtype::int & 19 = 19
		ORDER BY t.tgrelid, t.tgname`

	// The columns each stored generated column is computed from
	// (PostgreSQL 12 on): its expression, a pg_attrdef entry, depends on
	// them; older releases record the dependency on the column itself.
	pathGeneratedSQL = `
		SELECT a.attrelid, a.attname::text, b.attname::text
		FROM pg_catalog.pg_attribute a
		JOIN pg_catalog.pg_depend d ON d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
			AND d.refobjid = a.attrelid AND d.refobjsubid > 0 AND d.refobjsubid <> a.attnum
			AND (d.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass AND d.objid IN (
					SELECT ad.oid FROM pg_catalog.pg_attrdef ad WHERE ad.adrelid = a.attrelid AND ad.adnum = a.attnum)
				OR d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.objid = a.attrelid AND d.objsubid = a.attnum)
		JOIN pg_catalog.pg_attribute b ON b.attrelid = a.attrelid AND b.attnum = d.refobjsubid
		WHERE a.attgenerated <> '' AND NOT a.attisdropped AND NOT b.attisdropped
		ORDER BY 1, 2, 3`

	pathInheritsSQL = `
		SELECT inhrelid, inhparent FROM pg_catalog.pg_inherits ORDER BY inhparent, inhseqno, inhrelid`

	// A constraint cloned for a partition has conparentid set; it is a
	// clone for the referencing side when its parent constraint is on
	// another table, for the referenced side otherwise.
	pathFKSQL = `
		SELECT c.conname, c.conrelid, c.confrelid, c.confdeltype::text, c.confupdtype::text,
			c.conparentid <> 0 AND p.conrelid = c.conrelid,
			c.conparentid <> 0 AND p.conrelid <> c.conrelid,
			ARRAY(SELECT a.attname::text FROM pg_catalog.unnest(c.confkey) k
				JOIN pg_catalog.pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k)
		FROM pg_catalog.pg_constraint c LEFT JOIN pg_catalog.pg_constraint p ON p.oid = c.conparentid
		WHERE c.contype = 'f'
		ORDER BY c.confrelid, c.conname, c.conrelid`
)

// startOps are the statement kinds that can name r: MERGE from
// PostgreSQL 15 on, into views from 17 on, never into foreign tables; no
// TRUNCATE of views.
func (g *pathGraph) startOps(r *pathRel) []pathOp {
	merge := g.version >= 150000 && r.kind != 'f' && (r.kind != 'v' || g.version >= 170000)
	ops := []pathOp{opInsert, opUpdate, opDelete}
	if merge {
		ops = append(ops, opMerge)
	}
	if r.kind != 'v' {
		ops = append(ops, opTruncate)
	}
	return ops
}

// edges returns the steps from s, memoized.
func (g *pathGraph) edges(s pathState) []pathEdge {
	if e, ok := g.edgeMemo[s]; ok {
		return e
	}
	e := g.computeEdges(s)
	g.edgeMemo[s] = e
	return e
}

// computeEdges follows PostgreSQL: the rewriter applies rules to the
// relation a query names (an unconditional INSTEAD rule replaces the
// write), then an INSTEAD OF trigger or the automatic update of a view;
// the executor writes the table's rows and those of its descendants, fires
// the foreign key actions of the rows changed, and TRUNCATE ... CASCADE adds
// the referencing tables.
func (g *pathGraph) computeEdges(s pathState) []pathEdge {
	r := g.rels[s.rel]
	var out []pathEdge
	if s.mode == modeRows {
		return g.upEdges(r, s, out)
	}
	if s.mode == modeNamed || s.mode == modeNamedOnly {
		if s.op == opMerge && len(r.rules) > 0 {
			// "MERGE is not supported if the target table ... has any rules
			// defined on it" (https://www.postgresql.org/docs/current/sql-merge.html).
			return nil
		}
		replaced := false
		for _, rule := range r.rules {
			if (!rule.enabled && !g.pessimistic) || rule.event != s.op {
				continue
			}
			if rule.instead && !rule.conditional && !g.pessimistic {
				replaced = true
			}
			for _, w := range rule.writes {
				mode := modeNamedOnly
				if w.inh {
					mode = modeNamed
				}
				out = append(out, pathEdge{
					to:   pathState{rel: w.rel, op: w.op, mode: mode},
					kind: PathRule,
					via:  g.ruleVia(r, rule, w),
				})
			}
		}
		if replaced {
			return out
		}
		if r.kind == 'v' {
			return g.viewEdges(r, s, out)
		}
	}
	if r.kind == 'v' {
		return out
	}

	// Descendants. INSERT routes through partitioned tables only, whatever
	// ONLY says (INSERT has no ONLY).
	descend := s.mode == modeNamed || s.mode == modeChild || (s.op == opInsert && s.mode == modeNamedOnly)
	if s.op == opInsert && r.kind != 'p' {
		descend = false
	}
	if descend {
		for _, c := range r.children {
			child := g.rels[c]
			out = append(out, pathEdge{
				to:   pathState{rel: c, op: s.op, mode: modeChild},
				kind: g.hierarchyKind(child),
				via:  g.hierarchyVia(child, r),
			})
		}
	}

	// Foreign keys referencing r. A clone for a partition of the referenced
	// table is skipped when the partition is reached from its parent, whose
	// own constraint already counts; clones for partitions of the
	// referencing table never count for actions, since the action's query
	// names the partitioned table.
	// A key of r referencing r itself (a tree) counts: its action writes
	// rows the statement's own fence did not check, of a protected r
	// too.
	for _, fk := range r.referenced {
		if fk.refClone && s.mode == modeChild {
			continue
		}
		if s.op == opTruncate {
			if fk.child == fk.parent {
				continue // truncated already
			}
			out = append(out, pathEdge{
				to:   pathState{rel: fk.child, op: opTruncate, mode: modeCascaded},
				kind: PathTruncate,
				via:  fmt.Sprintf("TRUNCATE ... CASCADE truncates %s, whose foreign key %s references %s", g.rels[fk.child].display, sqllex.DisplayIdent(fk.name), r.display),
			})
			continue
		}
		if fk.childClone || s.mode == modeCascaded {
			continue
		}
		deletes := s.op == opDelete || s.op == opMerge
		// Not INSERT: its ON CONFLICT DO UPDATE is an UPDATE of the
		// relation it names, which rules.IndirectSet checks as one.
		updates := s.op == opUpdate || s.op == opMerge
		if deletes {
			out = g.actionEdge(out, fk, "DELETE", fk.onDelete)
		}
		if updates {
			out = g.actionEdge(out, fk, "UPDATE", fk.onUpdate)
		}
		// An UPDATE through a partitioned ancestor that moves a row to
		// another partition deletes it from this one: the ON DELETE
		// action of a key declared on the partition itself (not cloned
		// from the parent's) runs.
		if updates && !deletes && s.mode == modeChild && r.isPartition {
			n := len(out)
			if out = g.actionEdge(out, fk, "DELETE", fk.onDelete); len(out) > n {
				out[n].via += " (an UPDATE through the parent that moves the row to another partition deletes it here)"
			}
		}
	}
	return g.upEdges(r, s, out)
}

// viewEdges are the steps from view r named by a statement of kind s.op:
// the INSTEAD OF triggers for s.op if it has any, else the automatic
// update.
func (g *pathGraph) viewEdges(r *pathRel, s pathState, out []pathEdge) []pathEdge {
	ops := []pathOp{s.op}
	if s.op == opMerge { // MERGE uses the triggers or updatability of its actions
		ops = []pathOp{opInsert, opUpdate, opDelete}
	}
	var triggered, auto bool
	for _, op := range ops {
		if slices.ContainsFunc(r.triggers, func(t *pathTrigger) bool { return slices.Contains(t.ops, op) }) {
			triggered = true
		} else if r.updatable&viewUpdatableBit(op) != 0 {
			auto = true
		}
	}
	if g.pessimistic && len(r.triggers) == 0 {
		for _, read := range r.reads {
			out = append(out, pathEdge{
				to:   pathState{rel: read, op: s.op, mode: modeNamed},
				kind: PathView,
				via:  fmt.Sprintf("view %s reads %s: an INSTEAD OF trigger created on it would run instead of the write and could write anything", r.display, g.rels[read].display),
			})
		}
	}
	if g.pessimistic {
		// Updatable for some statement kind: auto-updatable, or by
		// unconditional INSTEAD rules (which pg_relation_is_updatable
		// counts), which may hide that it is auto-updatable too.
		triggered, auto = triggered || len(r.triggers) > 0, r.updatable != 0
	}
	if triggered {
		var names []string
		for _, t := range r.triggers {
			var ops []string
			for _, op := range t.ops {
				ops = append(ops, pathOpNames[op])
			}
			names = append(names, fmt.Sprintf("%s (%s, function %s)", sqllex.DisplayIdent(t.name), strings.Join(ops, ", "), t.function))
		}
		for _, read := range r.reads {
			out = append(out, pathEdge{
				to:   pathState{rel: read, op: s.op, mode: modeNamed},
				kind: PathView,
				via: fmt.Sprintf("view %s reads %s and has INSTEAD OF trigger %s, which runs instead of the write and can write anything",
					r.display, g.rels[read].display, strings.Join(names, ", ")),
			})
		}
	}
	if auto && r.base != 0 && g.rels[r.base] != nil {
		mode := modeNamedOnly
		if r.baseInh {
			mode = modeNamed
		}
		out = append(out, pathEdge{
			to:   pathState{rel: r.base, op: s.op, mode: mode},
			kind: PathView,
			via:  fmt.Sprintf("auto-updatable view %s writes %s", r.display, g.rels[r.base].display),
		})
	}
	return out
}

// viewUpdatableBit is op's bit in pg_relation_is_updatable's result
// (1 << CmdType).
func viewUpdatableBit(op pathOp) uint32 {
	switch op {
	case opUpdate:
		return 1 << 2
	case opInsert:
		return 1 << 3
	case opDelete:
		return 1 << 4
	}
	return 0
}

// actionEdge appends the step of foreign key fk's ON event action, if it
// writes: CASCADE deletes (ON DELETE) or updates the referencing rows, SET
// NULL and SET DEFAULT update them. The action's query names the
// referencing table with ONLY unless it is partitioned (ri_triggers.c).
func (g *pathGraph) actionEdge(out []pathEdge, fk *pathFK, event string, action byte) []pathEdge {
	var op pathOp
	var name string
	switch action {
	case 'c':
		op, name = opUpdate, "CASCADE"
		if event == "DELETE" {
			op = opDelete
		}
	case 'n':
		op, name = opUpdate, "SET NULL"
	case 'd':
		op, name = opUpdate, "SET DEFAULT"
	default:
		return out
	}
	child := g.rels[fk.child]
	mode := modeNamedOnly
	if child.kind == 'p' {
		mode = modeNamed
	}
	e := pathEdge{
		to:   pathState{rel: fk.child, op: op, mode: mode},
		kind: PathForeignKey,
		via: fmt.Sprintf("ON %s %s of foreign key %s of %s, which references %s",
			event, name, sqllex.DisplayIdent(fk.name), child.display, g.rels[fk.parent].display),
	}
	if event == "UPDATE" {
		e.cols = g.keyColumns(fk)
	}
	return append(out, e)
}

// keyColumns returns the columns an UPDATE of fk's referenced table
// must set to change its key: the key's columns and, for a stored
// generated key column, the columns it is computed from, in the table
// and in each of its descendants (whose rows the UPDATE reaches). None
// (any UPDATE) when the table or a descendant has a BEFORE UPDATE row
// trigger, which may change the key whatever the UPDATE sets: a
// partition's own trigger runs for rows updated through the parent.
func (g *pathGraph) keyColumns(fk *pathFK) []string {
	cols := slices.Clone(fk.refCols)
	seen := map[uint32]bool{}
	var walk func(oid uint32) bool
	walk = func(oid uint32) bool {
		r := g.rels[oid]
		if r == nil || seen[oid] {
			return true
		}
		seen[oid] = true
		if r.beforeUpdate {
			return false
		}
		for _, k := range fk.refCols {
			for _, c := range r.generatedFrom[k] {
				if !slices.Contains(cols, c) {
					cols = append(cols, c)
				}
			}
		}
		for _, c := range r.children {
			if !walk(c) {
				return false
			}
		}
		return true
	}
	if !walk(fk.parent) {
		return nil
	}
	return cols
}

// upEdges appends the steps to r's parents: rows written in r are rows of
// its inheritance and partitioned ancestors. A relation reached as a child
// was reached from its parent, which has its own steps up; only a child of
// several parents (multiple inheritance) has others to reach.
func (g *pathGraph) upEdges(r *pathRel, s pathState, out []pathEdge) []pathEdge {
	if s.mode == modeChild && len(r.parents) < 2 {
		return out
	}
	for _, p := range r.parents {
		out = append(out, pathEdge{
			to:   pathState{rel: p, op: s.op, mode: modeRows},
			kind: g.hierarchyKind(r),
			via:  g.hierarchyVia(r, g.rels[p]),
		})
	}
	return out
}

func (g *pathGraph) hierarchyKind(child *pathRel) string {
	if child.isPartition {
		return PathPartition
	}
	return PathInheritance
}

func (g *pathGraph) hierarchyVia(child, parent *pathRel) string {
	if child.isPartition {
		return fmt.Sprintf("%s is a partition of %s", child.display, parent.display)
	}
	return fmt.Sprintf("%s inherits from %s", child.display, parent.display)
}

func (g *pathGraph) ruleVia(r *pathRel, rule *pathRule, w ruleWrite) string {
	how := "ALSO"
	if rule.instead {
		how = "INSTEAD"
	}
	cond := ""
	if rule.conditional {
		cond = " WHERE ..."
	}
	return fmt.Sprintf("rule %s on %s (ON %s%s DO %s) runs %s on %s",
		sqllex.DisplayIdent(rule.name), r.display, pathOpNames[rule.event], cond, how, pathOpNames[w.op], g.rels[w.rel].display)
}
