package catalog

// Loading the path graph from the catalog: relations, views and rules,
// triggers, foreign keys.

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// loadPathGraph reads the relations and the edges between them.
func loadPathGraph(ctx context.Context, q Querier) (*pathGraph, error) {
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

	if g.version >= 120000 {
		if err := g.loadGenerated(ctx, q); err != nil {
			return nil, err
		}
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
		if err := rows.Scan(&fk.name, &fk.child, &fk.parent, &del, &upd, &fk.refClone, &fk.childClone, &fk.refCols); err != nil {
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
func (g *pathGraph) loadRewrites(ctx context.Context, q Querier) error {
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
		if r == nil {
			continue
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
		r.alsoReads, r.alsoCalls = treeReads(g, tree, r.oid, r.alsoReads, r.alsoCalls)
		tree.walk("QUERY", func(qn *pgNode) {
			if w, ok := g.queryWrite(qn); ok {
				rule.writes = append(rule.writes, w)
				// INSERT ... ON CONFLICT DO UPDATE (OnConflictAction 2)
				// updates the relation too.
				if w.op == opInsert && qn.field("onConflict").field("action").int() == 2 {
					w.op = opUpdate
					rule.writes = append(rule.writes, w)
				}
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
	r.reads, r.calls = treeReads(g, tree, r.oid, r.reads, r.calls)
}

// treeReads adds to reads the relations of g that node tree reads (its
// range table entries of relations, other than self) and to calls the
// user functions it calls, each once.
func treeReads(g *pathGraph, tree *pgNode, self uint32, reads, calls []uint32) ([]uint32, []uint32) {
	tree.walk("RANGETBLENTRY", func(rte *pgNode) {
		relid := rte.field("relid").oid()
		if rte.field("rtekind").int() == 0 && relid != self && g.rels[relid] != nil && !slices.Contains(reads, relid) {
			reads = append(reads, relid)
		}
	})
	tree.walk("FUNCEXPR", func(fn *pgNode) {
		if id := fn.field("funcid").oid(); id >= firstNormalOID && !slices.Contains(calls, id) {
			calls = append(calls, id)
		}
	})
	return reads, calls
}

// firstNormalOID is the first OID of objects users create (FirstNormal-
// ObjectId): the system's functions read no user table.
const firstNormalOID = 16384

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

// loadTriggers reads the INSTEAD OF triggers, and which tables have
// BEFORE UPDATE row triggers.
func (g *pathGraph) loadTriggers(ctx context.Context, q Querier) error {
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
		if tgtype&64 == 0 {
			r.beforeUpdate = true
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

// loadGenerated reads the columns stored generated columns are computed
// from (pathRel.generatedFrom).
func (g *pathGraph) loadGenerated(ctx context.Context, q Querier) error {
	rows, err := q.Query(ctx, pathGeneratedSQL)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var (
			relid     uint32
			col, from string
		)
		if err := rows.Scan(&relid, &col, &from); err != nil {
			return err
		}
		r := g.rels[relid]
		if r == nil {
			continue
		}
		if r.generatedFrom == nil {
			r.generatedFrom = map[string][]string{}
		}
		r.generatedFrom[col] = append(r.generatedFrom[col], from)
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
