package catalog

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Reader is a relation whose reads reach a table's rows without naming
// the table: a view that reads it (or reads another such relation), an
// inheritance or partitioned ancestor of it, or a descendant of it (a
// descendant's rows are the table's rows). Lock fencing registers the
// session's lock for a statement that names one, as for one that names
// the table.
type Reader struct {
	// Schema and Name are the exact names of the relation a statement
	// would name.
	Schema, Name string
	// Target is the table reached, quoted as IndirectPath.Target is.
	Target string
}

// Relation returns Schema.Name for display, quoted as Target is.
func (r Reader) Relation() string { return pathRelName(r.Schema, r.Name) }

// Reach is what Paths finds: the relations through which writes reach the
// written tables, and those through which reads reach the read ones.
type Reach struct {
	Paths   []IndirectPath
	Readers []Reader
}

// Paths is IndirectPaths for written and Readers for read, from one read
// of the catalog (one transaction, as IndirectPaths reads it).
func Paths(ctx context.Context, conn *pgx.Conn, written, read []Rel) (Reach, error) {
	q := Querier(conn)
	if conn.PgConn().TxStatus() == 'I' {
		tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
		if err != nil {
			return Reach{}, fmt.Errorf("catalog: begin: %w", err)
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		q = tx
	}
	g, err := loadPathGraph(ctx, q)
	if err != nil {
		return Reach{}, fmt.Errorf("catalog: read catalog for indirect reads and writes: %w", err)
	}
	var out Reach
	if len(written) > 0 {
		for _, t := range written {
			if oid, ok := g.byName[t]; ok {
				g.protected[oid] = true
			}
		}
		out.Paths = append(g.paths(), g.latentPaths()...)
		sortPaths(out.Paths)
	}
	out.Readers = g.readers(read)
	return out, nil
}

// readers finds, for each of tables, the relations whose reads reach its
// rows:
//
//   - its descendants (inheritance children and partitions, all levels),
//     whose rows are its rows, and every ancestor of it or of one of
//     them: a read of an ancestor without ONLY reads its descendants;
//   - every view that reads one of those relations or the table, or
//     another such view, anywhere in its query (FROM lists, joins,
//     subqueries, CTEs). A view reading a parent with ONLY is listed too:
//     registering for it costs a statement, missing one would let a
//     stale holder through.
//
// Not found: materialized views (a read of one reads what its last
// refresh stored), functions that read the table (SELECT * FROM f()), and
// foreign tables whose server is this database. The table itself is not
// listed. The result is sorted by Schema, Name and Target.
func (g *pathGraph) readers(tables []Rel) []Reader {
	var out []Reader
	for _, t := range tables {
		oid, ok := g.byName[t]
		if !ok {
			continue
		}
		reach := map[uint32]bool{oid: true}
		// Descendants, then ancestors of every one of them.
		rows := []uint32{oid}
		for i := 0; i < len(rows); i++ {
			for _, c := range g.rels[rows[i]].children {
				if !reach[c] {
					reach[c] = true
					rows = append(rows, c)
				}
			}
		}
		up := slices.Clone(rows)
		for i := 0; i < len(up); i++ {
			for _, p := range g.rels[up[i]].parents {
				if !reach[p] {
					reach[p] = true
					up = append(up, p)
				}
			}
		}
		// Views over any of them, to a fixed point (views over views).
		for grew := true; grew; {
			grew = false
			for voids, r := range g.rels {
				if r.kind != 'v' || reach[voids] {
					continue
				}
				if slices.ContainsFunc(r.reads, func(x uint32) bool { return reach[x] }) {
					reach[voids] = true
					grew = true
				}
			}
		}
		target := g.rels[oid].display
		for x := range reach {
			if x != oid {
				r := g.rels[x]
				out = append(out, Reader{Schema: r.schema, Name: r.name, Target: target})
			}
		}
	}
	slices.SortFunc(out, func(a, b Reader) int {
		if c := strings.Compare(a.Schema, b.Schema); c != 0 {
			return c
		}
		if c := strings.Compare(a.Name, b.Name); c != 0 {
			return c
		}
		return strings.Compare(a.Target, b.Target)
	})
	return out
}
