package dbsetup

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Path kinds: the first step of an IndirectPath.
const (
	PathView        = "view"             // an updatable view (auto-updatable or INSTEAD OF trigger)
	PathRule        = "rule"             // a rewrite rule that writes another relation
	PathInheritance = "inheritance"      // an inheritance parent or child
	PathPartition   = "partition"        // a partitioned ancestor or a partition
	PathForeignKey  = "foreign key"      // an ON DELETE / ON UPDATE action of a foreign key
	PathTruncate    = "truncate cascade" // TRUNCATE ... CASCADE through a foreign key
)

// IndirectPath is a relation through which a statement writes a protected
// table without naming it.
type IndirectPath struct {
	// Schema and Name are the exact names of the relation the statement
	// would name.
	Schema, Name string
	// Kind is the kind of the first step from the relation towards the
	// protected table, one of the Path* constants; later steps may be of
	// other kinds (Via lists them all).
	Kind string
	// Target is the protected table reached, schema.table, quoted where
	// needed as rules.TableSpec.Display quotes it.
	Target string
	// Ops lists the statement kinds that reach Target this way, in the order
	// INSERT, UPDATE, DELETE, MERGE, TRUNCATE. INSERT reaches through an
	// ON UPDATE action too, since INSERT ... ON CONFLICT DO UPDATE updates;
	// TRUNCATE through a foreign key means TRUNCATE ... CASCADE.
	Ops []string
	// Via explains the steps, separated by "; "; of a chain of more than
	// eight, the first and last four.
	Via string
}

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
// objects. Foreign-key steps are per table, not per column: an ON UPDATE
// action is taken to be reachable by any UPDATE of the referenced table.
//
// The protected tables themselves are never listed; names of tables that do
// not exist are ignored. The result is sorted by Schema, Name, Target, Kind
// and Via, one entry per first step and target, with the shortest chain of
// steps after the first. When conn is idle the catalog is read in one
// read-only repeatable-read transaction; inside a transaction, in that one.
func IndirectPaths(ctx context.Context, conn *pgx.Conn, tables []Rel) ([]IndirectPath, error) {
	if conn.PgConn().TxStatus() != 'I' {
		return indirectPaths(ctx, conn, tables)
	}
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, fmt.Errorf("dbsetup: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	return indirectPaths(ctx, tx, tables)
}

// catalogQuerier is what indirectPaths needs of a connection or a
// transaction.
type catalogQuerier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var (
	_ catalogQuerier = (*pgx.Conn)(nil)
	_ catalogQuerier = pgx.Tx(nil)
)

// indirectPaths is IndirectPaths on q, which may be a transaction.
func indirectPaths(ctx context.Context, q catalogQuerier, tables []Rel) ([]IndirectPath, error) {
	g, err := loadPathGraph(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("dbsetup: read catalog for indirect writes: %w", err)
	}
	for _, t := range tables {
		if oid, ok := g.byName[t]; ok {
			g.protected[oid] = true
		}
	}
	return g.paths(), nil
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
	reads       []uint32       // views with INSTEAD OF triggers: relations read
	base        uint32         // auto-updatable views: the FROM relation
	baseInh     bool           // ... without ONLY
	referenced  []*pathFK      // foreign keys referencing this relation
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
	child      uint32 // conrelid, the referencing table
	parent     uint32 // confrelid, the referenced table
	onDelete   byte   // confdeltype: a, r, c, n or d
	onUpdate   byte   // confupdtype
	refClone   bool   // cloned for a partition of the referenced table
	childClone bool   // cloned for a partition of the referencing table
}

// pathGraph is the catalog read by loadPathGraph and the protected tables.
type pathGraph struct {
	rels      map[uint32]*pathRel
	byName    map[Rel]uint32
	protected map[uint32]bool
	version   int // server_version_num
	edgeMemo  map[pathState][]pathEdge
}

// The catalog queries. User relations only: the system schemas and the
// temporary schemas (of other sessions, or objects that vanish with this
// one) are left out.
const (
	pathRelsSQL = `
		SELECT c.oid, n.nspname, c.relname, c.relkind::text, c.relispartition,
			CASE WHEN c.relkind = 'v' THEN pg_catalog.pg_relation_is_updatable(c.oid, false) ELSE 0 END
		FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind IN ('r', 'p', 'f', 'v')
			AND n.nspname NOT IN ('pg_catalog', 'information_schema')
			AND n.nspname !~ '^pg_(toast|temp_|toast_temp_)'`

	// The node tree of each view's SELECT rule and of every other rule.
	pathRewriteSQL = `
		SELECT r.ev_class, r.rulename, r.ev_type::text, r.is_instead, r.ev_enabled::text,
			r.ev_qual::text <> '<>', r.ev_action::text
		FROM pg_catalog.pg_rewrite r JOIN pg_catalog.pg_class c ON c.oid = r.ev_class
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind IN ('r', 'p', 'f', 'v')
			AND n.nspname NOT IN ('pg_catalog', 'information_schema')
			AND n.nspname !~ '^pg_(toast|temp_|toast_temp_)'
		ORDER BY r.ev_class, r.rulename`

	// tgtype bits (pg_trigger.h): 64 INSTEAD, 4 INSERT, 8 DELETE, 16 UPDATE.
	// Views cannot disable triggers, so tgenabled is not read.
	pathTriggersSQL = `
		SELECT t.tgrelid, t.tgname, t.tgtype::int, n.nspname, p.proname
		FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid
		JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		WHERE t.tgtype::int & 64 <> 0
		ORDER BY t.tgrelid, t.tgname`

	pathInheritsSQL = `
		SELECT inhrelid, inhparent FROM pg_catalog.pg_inherits ORDER BY inhparent, inhseqno, inhrelid`

	// A constraint cloned for a partition has conparentid set; it is a
	// clone for the referencing side when its parent constraint is on
	// another table, for the referenced side otherwise.
	pathFKSQL = `
		SELECT c.conname, c.conrelid, c.confrelid, c.confdeltype::text, c.confupdtype::text,
			c.conparentid <> 0 AND p.conrelid = c.conrelid,
			c.conparentid <> 0 AND p.conrelid <> c.conrelid
		FROM pg_catalog.pg_constraint c LEFT JOIN pg_catalog.pg_constraint p ON p.oid = c.conparentid
		WHERE c.contype = 'f'
		ORDER BY c.confrelid, c.conname, c.conrelid`
)

// loadPathGraph reads the relations and the edges between them.
func loadPathGraph(ctx context.Context, q catalogQuerier) (*pathGraph, error) {
	g := &pathGraph{
		rels:      map[uint32]*pathRel{},
		byName:    map[Rel]uint32{},
		protected: map[uint32]bool{},
		edgeMemo:  map[pathState][]pathEdge{},
	}
	var version string
	if err := q.QueryRow(ctx, "SELECT pg_catalog.current_setting('server_version_num')").Scan(&version); err != nil {
		return nil, err
	}
	g.version, _ = strconv.Atoi(version)

	rows, err := q.Query(ctx, pathRelsSQL)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		r := &pathRel{}
		var kind string
		if err := rows.Scan(&r.oid, &r.schema, &r.name, &kind, &r.isPartition, &r.updatable); err != nil {
			rows.Close()
			return nil, err
		}
		r.kind = kind[0]
		r.display = pathRelName(r.schema, r.name)
		g.rels[r.oid] = r
		g.byName[Rel{r.schema, r.name}] = r.oid
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}

	if err := g.loadTriggers(ctx, q); err != nil {
		return nil, err
	}
	if err := g.loadRewrites(ctx, q); err != nil {
		return nil, err
	}

	rows, err = q.Query(ctx, pathInheritsSQL)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var child, parent uint32
		if err := rows.Scan(&child, &parent); err != nil {
			rows.Close()
			return nil, err
		}
		c, p := g.rels[child], g.rels[parent]
		if c == nil || p == nil { // indexes, system relations
			continue
		}
		c.parents = append(c.parents, parent)
		p.children = append(p.children, child)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}

	rows, err = q.Query(ctx, pathFKSQL)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		fk := &pathFK{}
		var del, upd string
		if err := rows.Scan(&fk.name, &fk.child, &fk.parent, &del, &upd, &fk.refClone, &fk.childClone); err != nil {
			rows.Close()
			return nil, err
		}
		fk.onDelete, fk.onUpdate = del[0], upd[0]
		if p := g.rels[fk.parent]; p != nil && g.rels[fk.child] != nil {
			p.referenced = append(p.referenced, fk)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	for _, r := range g.rels {
		g.sortRel(r)
	}
	return g, nil
}

// loadRewrites reads the views' FROM relations and the rules' writes from
// their node trees (pg_rewrite.ev_action), after loadTriggers.
func (g *pathGraph) loadRewrites(ctx context.Context, q catalogQuerier) error {
	rows, err := q.Query(ctx, pathRewriteSQL)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var (
			relid                         uint32
			name, evType, enabled, action string
			instead, conditional          bool
		)
		if err := rows.Scan(&relid, &name, &evType, &instead, &enabled, &conditional, &action); err != nil {
			return err
		}
		r := g.rels[relid]
		if r == nil || evType == "1" && r.updatable == 0 && len(r.triggers) == 0 {
			continue // a view that cannot be written but by rules
		}
		tree, err := parseNodeTree(action)
		if err != nil {
			return fmt.Errorf("rule %s of %s: %w", name, r.display, err)
		}
		if evType == "1" { // a view's SELECT rule
			g.readView(r, tree)
			continue
		}
		rule := &pathRule{name: name, instead: instead, conditional: conditional, enabled: enabled != "D"}
		switch evType {
		case "2":
			rule.event = opUpdate
		case "3":
			rule.event = opInsert
		case "4":
			rule.event = opDelete
		default:
			continue
		}
		tree.walk("QUERY", func(qn *pgNode) {
			if w, ok := g.queryWrite(qn); ok {
				rule.writes = append(rule.writes, w)
			}
		})
		r.rules = append(r.rules, rule)
	}
	return rows.Err()
}

// readView records the FROM relation of view r (when its query has a
// single one, as auto-updatable views do) and every relation it reads.
func (g *pathGraph) readView(r *pathRel, tree *pgNode) {
	var top *pgNode
	if len(tree.list) == 1 && tree.list[0].name == "QUERY" {
		top = tree.list[0]
	}
	if top == nil {
		return
	}
	if from := top.field("jointree").field("fromlist"); from != nil && len(from.list) == 1 {
		if rte := rtEntry(top, from.list[0].field("rtindex").int()); rte != nil && rte.field("rtekind").int() == 0 {
			r.base = rte.field("relid").oid()
			r.baseInh = rte.field("inh").atom == "true"
		}
	}
	tree.walk("RANGETBLENTRY", func(rte *pgNode) {
		relid := rte.field("relid").oid()
		if rte.field("rtekind").int() == 0 && relid != r.oid && g.rels[relid] != nil && !slices.Contains(r.reads, relid) {
			r.reads = append(r.reads, relid)
		}
	})
}

// queryWrite returns the relation a data-modifying query writes.
func (g *pathGraph) queryWrite(qn *pgNode) (ruleWrite, bool) {
	var op pathOp
	// CmdType (nodes.h): 2 UPDATE, 3 INSERT, 4 DELETE, and 5 MERGE from
	// PostgreSQL 15 on (UTILITY before).
	switch qn.field("commandType").int() {
	case 2:
		op = opUpdate
	case 3:
		op = opInsert
	case 4:
		op = opDelete
	case 5:
		if g.version < 150000 {
			return ruleWrite{}, false
		}
		op = opMerge
	default:
		return ruleWrite{}, false
	}
	rte := rtEntry(qn, qn.field("resultRelation").int())
	if rte == nil || g.rels[rte.field("relid").oid()] == nil {
		return ruleWrite{}, false
	}
	return ruleWrite{rel: rte.field("relid").oid(), op: op, inh: rte.field("inh").atom == "true"}, true
}

// rtEntry returns entry i (1-based) of query qn's range table, or nil.
func rtEntry(qn *pgNode, i int) *pgNode {
	rt := qn.field("rtable")
	if rt == nil || i < 1 || i > len(rt.list) {
		return nil
	}
	return rt.list[i-1]
}

// loadTriggers reads the INSTEAD OF triggers.
func (g *pathGraph) loadTriggers(ctx context.Context, q catalogQuerier) error {
	rows, err := q.Query(ctx, pathTriggersSQL)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var (
			relid                uint32
			name, schema, fnName string
			tgtype               int32
		)
		if err := rows.Scan(&relid, &name, &tgtype, &schema, &fnName); err != nil {
			return err
		}
		r := g.rels[relid]
		if r == nil {
			continue
		}
		t := &pathTrigger{name: name, function: pathRelName(schema, fnName)}
		if tgtype&4 != 0 {
			t.ops = append(t.ops, opInsert)
		}
		if tgtype&16 != 0 {
			t.ops = append(t.ops, opUpdate)
		}
		if tgtype&8 != 0 {
			t.ops = append(t.ops, opDelete)
		}
		r.triggers = append(r.triggers, t)
	}
	return rows.Err()
}

// sortRel orders r's children and foreign keys by name, so that the search,
// and the shortest chain it keeps, do not depend on OIDs.
func (g *pathGraph) sortRel(r *pathRel) {
	byName := func(a, b uint32) int { return strings.Compare(g.rels[a].display, g.rels[b].display) }
	slices.SortFunc(r.children, byName)
	slices.SortFunc(r.parents, byName)
	slices.SortFunc(r.reads, byName)
	slices.SortStableFunc(r.referenced, func(a, b *pathFK) int {
		if c := strings.Compare(a.name, b.name); c != 0 {
			return c
		}
		return byName(a.child, b.child)
	})
}

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
			if !rule.enabled || rule.event != s.op {
				continue
			}
			if rule.instead && !rule.conditional {
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
	for _, fk := range r.referenced {
		if fk.child == fk.parent || (fk.refClone && s.mode == modeChild) {
			continue
		}
		if s.op == opTruncate {
			out = append(out, pathEdge{
				to:   pathState{rel: fk.child, op: opTruncate, mode: modeCascaded},
				kind: PathTruncate,
				via:  fmt.Sprintf("TRUNCATE ... CASCADE truncates %s, whose foreign key %s references %s", g.rels[fk.child].display, pathIdent(fk.name), r.display),
			})
			continue
		}
		if fk.childClone || s.mode == modeCascaded {
			continue
		}
		deletes := s.op == opDelete || s.op == opMerge
		updates := s.op == opUpdate || s.op == opMerge || s.op == opInsert
		if deletes {
			out = g.actionEdge(out, fk, "DELETE", fk.onDelete)
		}
		if updates {
			out = g.actionEdge(out, fk, "UPDATE", fk.onUpdate)
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
	if triggered {
		var names []string
		for _, t := range r.triggers {
			var ops []string
			for _, op := range t.ops {
				ops = append(ops, pathOpNames[op])
			}
			names = append(names, fmt.Sprintf("%s (%s, function %s)", pathIdent(t.name), strings.Join(ops, ", "), t.function))
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
	return append(out, pathEdge{
		to:   pathState{rel: fk.child, op: op, mode: mode},
		kind: PathForeignKey,
		via: fmt.Sprintf("ON %s %s of foreign key %s of %s, which references %s",
			event, name, pathIdent(fk.name), child.display, g.rels[fk.parent].display),
	})
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
		pathIdent(rule.name), r.display, pathOpNames[rule.event], cond, how, pathOpNames[w.op], g.rels[w.rel].display)
}

// paths searches the graph from every statement that can name an
// unprotected relation.
func (g *pathGraph) paths() []IndirectPath {
	if len(g.protected) == 0 {
		return nil
	}
	useful := g.usefulStates()

	type key struct {
		rel, target uint32
		via         string
	}
	found := map[key]*IndirectPath{}
	ops := map[key][pathOpCount]bool{}
	var order []key
	for oid, r := range g.rels {
		if g.protected[oid] {
			continue
		}
		for _, op := range g.startOps(r) {
			start := pathState{rel: oid, op: op, mode: modeNamed}
			if !useful[start] {
				continue
			}
			for _, first := range g.edges(start) {
				if !useful[first.to] {
					continue
				}
				for target, chain := range g.shortestChains(first, useful) {
					k := key{rel: oid, target: target, via: joinSteps(chain)}
					if found[k] == nil {
						found[k] = &IndirectPath{Schema: r.schema, Name: r.name, Kind: first.kind, Target: g.rels[target].display, Via: k.via}
						order = append(order, k)
					}
					o := ops[k]
					o[op] = true
					ops[k] = o
				}
			}
		}
	}
	out := make([]IndirectPath, 0, len(order))
	for _, k := range order {
		p := found[k]
		for op, ok := range ops[k] {
			if ok {
				p.Ops = append(p.Ops, pathOpNames[op])
			}
		}
		out = append(out, *p)
	}
	slices.SortFunc(out, func(a, b IndirectPath) int {
		for _, c := range [...]int{
			strings.Compare(a.Schema, b.Schema), strings.Compare(a.Name, b.Name),
			strings.Compare(a.Target, b.Target), strings.Compare(a.Kind, b.Kind), strings.Compare(a.Via, b.Via),
		} {
			if c != 0 {
				return c
			}
		}
		return 0
	})
	return out
}

// usefulStates returns the states from which a protected table is reached:
// it explores every state reachable from a statement naming a relation,
// then walks the steps backwards from the protected tables.
func (g *pathGraph) usefulStates() map[pathState]bool {
	back := map[pathState][]pathState{}
	seen := map[pathState]bool{}
	var queue []pathState
	for oid, r := range g.rels {
		if g.protected[oid] {
			continue
		}
		for _, op := range g.startOps(r) {
			s := pathState{rel: oid, op: op, mode: modeNamed}
			if !seen[s] {
				seen[s] = true
				queue = append(queue, s)
			}
		}
	}
	var targets []pathState
	for len(queue) > 0 {
		s := queue[0]
		queue = queue[1:]
		if g.protected[s.rel] {
			targets = append(targets, s)
		}
		for _, e := range g.edges(s) {
			back[e.to] = append(back[e.to], s)
			if !seen[e.to] {
				seen[e.to] = true
				queue = append(queue, e.to)
			}
		}
	}
	useful := map[pathState]bool{}
	for _, t := range targets {
		useful[t] = true
	}
	for len(targets) > 0 {
		s := targets[0]
		targets = targets[1:]
		for _, p := range back[s] {
			if !useful[p] {
				useful[p] = true
				targets = append(targets, p)
			}
		}
	}
	return useful
}

// shortestChains searches breadth-first from first's destination, through
// useful states, and returns for each protected table reached the
// explanations of the shortest chain of steps, first included.
func (g *pathGraph) shortestChains(first pathEdge, useful map[pathState]bool) map[uint32][]string {
	type visit struct {
		prev *visit
		via  string
	}
	chain := func(v *visit) []string {
		var out []string
		for ; v != nil; v = v.prev {
			out = append(out, v.via)
		}
		slices.Reverse(out)
		return out
	}
	result := map[uint32][]string{}
	visits := map[pathState]*visit{first.to: {via: first.via}}
	queue := []pathState{first.to}
	for len(queue) > 0 {
		s := queue[0]
		queue = queue[1:]
		v := visits[s]
		if g.protected[s.rel] {
			if _, ok := result[s.rel]; !ok {
				result[s.rel] = chain(v)
			}
		}
		for _, e := range g.edges(s) {
			if !useful[e.to] || visits[e.to] != nil {
				continue
			}
			visits[e.to] = &visit{prev: v, via: e.via}
			queue = append(queue, e.to)
		}
	}
	return result
}

// maxViaSteps bounds the steps Via spells out: a long chain of foreign
// keys keeps its first and last steps.
const maxViaSteps = 8

// joinSteps joins the explanations of a chain of steps.
func joinSteps(chain []string) string {
	if len(chain) > maxViaSteps {
		head, tail := chain[:maxViaSteps/2], chain[len(chain)-maxViaSteps/2:]
		mid := "... 1 more step ..."
		if n := len(chain) - len(head) - len(tail); n > 1 {
			mid = fmt.Sprintf("... %d more steps ...", n)
		}
		chain = slices.Concat(head, []string{mid}, tail)
	}
	return strings.Join(chain, "; ")
}

// pathRelName is schema.name for display.
func pathRelName(schema, name string) string {
	return pathIdent(schema) + "." + pathIdent(name)
}

// pathIdent quotes an identifier for display as rules does (and
// rules.TableSpec.Display shows): unquoted when it is lower-case letters,
// digits, _ and $ not starting with a digit or $, quoted otherwise. Keywords
// are not quoted. The result is for messages, never for SQL.
func pathIdent(s string) string {
	plain := s != "" && (s[0] >= 'a' && s[0] <= 'z' || s[0] == '_')
	for i := 0; plain && i < len(s); i++ {
		c := s[i]
		plain = c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '$'
	}
	if plain {
		return s
	}
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}

// pgNode is a value of a pg_node_tree as nodeToString writes it
// (outfuncs.c) and stringToNode reads it (read.c): a node {NAME :field
// value ...}, a list (value ...), or a token. The format is internal to
// PostgreSQL, but the few fields read here (Query's commandType,
// resultRelation, rtable and jointree; RangeTblEntry's rtekind, relid and
// inh; FromExpr's fromlist; RangeTblRef's rtindex) have kept their names
// and meaning for many releases.
type pgNode struct {
	name   string             // node type for a node: "QUERY", "RANGETBLENTRY", ...
	fields map[string]*pgNode // a node's fields; a field with several tokens keeps the first
	list   []*pgNode          // a list's items, or a node's fields in order
	atom   string             // a token
	isList bool
}

// field returns field name of node n, nil when n is nil or lacks it.
func (n *pgNode) field(name string) *pgNode {
	if n == nil {
		return nil
	}
	return n.fields[name]
}

// int returns n's token as an integer, -1 when it is not one.
func (n *pgNode) int() int {
	if n == nil {
		return -1
	}
	v, err := strconv.Atoi(n.atom)
	if err != nil {
		return -1
	}
	return v
}

// oid returns n's token as an OID, 0 when it is not one.
func (n *pgNode) oid() uint32 {
	if n == nil {
		return 0
	}
	v, err := strconv.ParseUint(n.atom, 10, 32)
	if err != nil {
		return 0
	}
	return uint32(v)
}

// walk calls fn for every node named name in n, n included, outermost
// first.
func (n *pgNode) walk(name string, fn func(*pgNode)) {
	if n == nil {
		return
	}
	if n.name == name {
		fn(n)
	}
	for _, c := range n.list {
		c.walk(name, fn)
	}
}

// parseNodeTree parses the text of a pg_node_tree.
func parseNodeTree(s string) (*pgNode, error) {
	p := &nodeTreeParser{s: s}
	n, err := p.value()
	if err != nil {
		return nil, err
	}
	if tok := p.next(); tok != "" {
		return nil, fmt.Errorf("node tree: unexpected %q after the end", tok)
	}
	return n, nil
}

// nodeTreeParser splits tokens as pg_strtok does: (, ), { and } alone,
// anything else up to white space or one of those, a backslash escaping the
// next character.
type nodeTreeParser struct {
	s   string
	pos int
	tok string // a token read ahead, if any
}

func (p *nodeTreeParser) next() string {
	if p.tok != "" {
		t := p.tok
		p.tok = ""
		return t
	}
	for p.pos < len(p.s) && (p.s[p.pos] == ' ' || p.s[p.pos] == '\n' || p.s[p.pos] == '\t') {
		p.pos++
	}
	if p.pos >= len(p.s) {
		return ""
	}
	start := p.pos
	switch p.s[p.pos] {
	case '(', ')', '{', '}':
		p.pos++
		return p.s[start:p.pos]
	}
	for p.pos < len(p.s) {
		switch p.s[p.pos] {
		case ' ', '\n', '\t', '(', ')', '{', '}':
			return p.s[start:p.pos]
		case '\\':
			p.pos++
		}
		p.pos++
	}
	if p.pos > len(p.s) {
		p.pos = len(p.s)
	}
	return p.s[start:p.pos]
}

func (p *nodeTreeParser) peek() string {
	if p.tok == "" {
		p.tok = p.next()
	}
	return p.tok
}

// value parses a node, a list or a token.
func (p *nodeTreeParser) value() (*pgNode, error) {
	switch tok := p.next(); tok {
	case "":
		return nil, fmt.Errorf("node tree: unexpected end")
	case ")", "}":
		return nil, fmt.Errorf("node tree: unexpected %q", tok)
	case "(":
		n := &pgNode{isList: true}
		for p.peek() != ")" {
			if p.peek() == "" {
				return nil, fmt.Errorf("node tree: unterminated list")
			}
			item, err := p.value()
			if err != nil {
				return nil, err
			}
			n.list = append(n.list, item)
		}
		p.next()
		return n, nil
	case "{":
		n := &pgNode{name: p.next(), fields: map[string]*pgNode{}}
		// Every field label is followed by at least one token, which may
		// itself start with ':' (a string); a datum takes several tokens.
		label := ""
		for p.peek() != "}" {
			tok := p.peek()
			if tok == "" {
				return nil, fmt.Errorf("node tree: unterminated %s node", n.name)
			}
			if strings.HasPrefix(tok, ":") && (label == "" || n.fields[label] != nil) {
				label = p.next()[1:]
				continue
			}
			item, err := p.value()
			if err != nil {
				return nil, err
			}
			if label != "" && n.fields[label] == nil {
				n.fields[label] = item
			}
			n.list = append(n.list, item)
		}
		p.next()
		return n, nil
	default:
		return &pgNode{atom: tok}, nil
	}
}
