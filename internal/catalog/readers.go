package catalog

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
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
	// Function: Schema.Name is a function (every function of that name),
	// whose body names the table or another reader, as a word: a call of
	// it in a statement may read the table.
	Function bool
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
	if len(read) > 0 {
		funcs, err := loadFunctions(ctx, q, g.version)
		if err != nil {
			return Reach{}, fmt.Errorf("catalog: read functions for indirect reads: %w", err)
		}
		out.Readers = g.readers(read, funcs)
	}
	return out, nil
}

// pathFunc is a user function, with the words of its body.
type pathFunc struct {
	oid          uint32
	schema, name string
	words        []string // ASCII-lowered, each once
}

// functionsSQL lists the user functions and procedures whose bodies the
// server keeps as text (SQL, PL/pgSQL and the other procedural
// languages), with PostgreSQL 14's SQL-standard bodies (BEGIN ATOMIC)
// printed, outside fenceproxy's own schema.
func functionsSQL(version int) string {
	body := "p.prosrc"
	if version >= 140000 {
		body = "coalesce(p.prosrc, '') || ' ' || coalesce(pg_catalog.pg_get_function_sqlbody(p.oid), '')"
	}
	return `
		SELECT p.oid, n.nspname, p.proname, ` + body + `
		FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		JOIN pg_catalog.pg_language l ON l.oid = p.prolang
		WHERE p.oid >= 16384 AND l.lanname NOT IN ('c', 'internal') AND n.nspname <> 'fenceproxy'`
}

// loadFunctions reads the user functions and the words of their bodies.
func loadFunctions(ctx context.Context, q Querier, version int) ([]*pathFunc, error) {
	rows, err := q.Query(ctx, functionsSQL(version))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*pathFunc
	for rows.Next() {
		f := &pathFunc{}
		var body string
		if err := rows.Scan(&f.oid, &f.schema, &f.name, &body); err != nil {
			return nil, err
		}
		f.words = bodyWords(body)
		out = append(out, f)
	}
	return out, rows.Err()
}

// bodyWords returns the words of a function's body, ASCII-lowered, each
// once: the maximal runs of letters, digits, underscores and bytes >=
// 0x80 ('$' ends one, as it closes a dollar-quoted string).
func bodyWords(body string) []string {
	seen := map[string]bool{}
	var out []string
	for i := 0; i < len(body); {
		if !bodyWordByte(body[i]) {
			i++
			continue
		}
		j := i + 1
		for j < len(body) && bodyWordByte(body[j]) {
			j++
		}
		w := sqllex.Fold(body[i:j])
		i = j
		if !seen[w] {
			seen[w] = true
			out = append(out, w)
		}
	}
	return out
}

func bodyWordByte(c byte) bool { return c != '$' && sqllex.IsIdentCont(c) }

// readers finds, for each of tables, the relations whose reads reach its
// rows:
//
//   - its descendants (inheritance children and partitions, all levels),
//     whose rows are its rows, and every ancestor of it or of one of
//     them: a read of an ancestor without ONLY reads its descendants;
//   - every view that reads one of those relations or the table, or
//     another such view, anywhere in its query (FROM lists, joins,
//     subqueries, CTEs), or calls a function below. A view reading a
//     parent with ONLY is listed too: registering for it costs a
//     statement, missing one would let a stale holder through;
//   - every function of funcs whose body holds, as a word, the name of
//     the table, of one of those relations, or of another such function
//     (a name in a comment or a string counts: the body is not parsed,
//     and dynamic SQL is text).
//
// Not found: materialized views (a read of one reads what its last
// refresh stored), functions whose body computes the name, and foreign
// tables whose server is this database. The table itself is not listed.
// The result is sorted by Schema, Name, Function and Target.
func (g *pathGraph) readers(tables []Rel, funcs []*pathFunc) []Reader {
	var out []Reader
	for _, t := range tables {
		oid, ok := g.byName[t]
		if !ok {
			continue
		}
		reach := map[uint32]bool{oid: true}
		names := map[string]bool{}
		addRel := func(x uint32) {
			reach[x] = true
			names[sqllex.Fold(g.rels[x].name)] = true
		}
		addRel(oid)
		// Descendants, then ancestors of every one of them.
		rows := []uint32{oid}
		for i := 0; i < len(rows); i++ {
			for _, c := range g.rels[rows[i]].children {
				if !reach[c] {
					addRel(c)
					rows = append(rows, c)
				}
			}
		}
		up := slices.Clone(rows)
		for i := 0; i < len(up); i++ {
			for _, p := range g.rels[up[i]].parents {
				if !reach[p] {
					addRel(p)
					up = append(up, p)
				}
			}
		}
		// Views and functions, to a fixed point (views over views,
		// functions calling functions, views calling functions, functions
		// reading views).
		called := map[uint32]bool{}
		for grew := true; grew; {
			grew = false
			for _, f := range funcs {
				if !called[f.oid] && slices.ContainsFunc(f.words, func(w string) bool { return names[w] }) {
					called[f.oid] = true
					names[sqllex.Fold(f.name)] = true
					grew = true
				}
			}
			for x, r := range g.rels {
				if r.kind != 'v' || reach[x] {
					continue
				}
				if slices.ContainsFunc(r.reads, func(y uint32) bool { return reach[y] }) ||
					slices.ContainsFunc(r.calls, func(y uint32) bool { return called[y] }) {
					addRel(x)
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
		for _, f := range funcs {
			if called[f.oid] {
				out = append(out, Reader{Schema: f.schema, Name: f.name, Target: target, Function: true})
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
		if a.Function != b.Function {
			if a.Function {
				return 1
			}
			return -1
		}
		return strings.Compare(a.Target, b.Target)
	})
	return slices.Compact(out)
}
