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
	// Refresh: Schema.Name is a materialized view whose query reads the
	// table: REFRESH MATERIALIZED VIEW of it reads the table (a read of
	// it does not).
	Refresh bool
	// Maybe: a statement naming the relation may read the table, but
	// not surely: through a function's call, or what only some
	// statements evaluate (its rules' actions, its policies, triggers,
	// defaults and constraints). Lock fencing registers for it, and does
	// not require a lock (lock: required) for it. Functions are Maybe.
	Maybe bool
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
		if err == nil {
			err = g.loadReadExtras(ctx, q)
		}
		if err != nil {
			return Reach{}, fmt.Errorf("catalog: read functions and expressions for indirect reads: %w", err)
		}
		out.Readers = g.readers(read, funcs)
	}
	return out, nil
}

// readExtrasSQL lists the node trees that a statement naming a relation
// may evaluate besides a view's query, by relation: row security
// policies' expressions, column defaults (stored generated columns
// included) and check constraints. Rules' actions are read with the
// rules (loadRewrites), triggers' functions by triggerCallsSQL.
const readExtrasSQL = `
	SELECT polrelid, polqual::text FROM pg_catalog.pg_policy WHERE polqual IS NOT NULL
	UNION ALL SELECT polrelid, polwithcheck::text FROM pg_catalog.pg_policy WHERE polwithcheck IS NOT NULL
	UNION ALL SELECT adrelid, adbin::text FROM pg_catalog.pg_attrdef
	UNION ALL SELECT conrelid, conbin::text FROM pg_catalog.pg_constraint WHERE contype = 'c' AND conrelid <> 0`

// triggerCallsSQL lists the user triggers' functions by relation.
const triggerCallsSQL = `SELECT tgrelid, tgfoid FROM pg_catalog.pg_trigger WHERE NOT tgisinternal AND tgfoid >= 16384`

// matviewsSQL lists the materialized views with their queries.
const matviewsSQL = `
	SELECT c.oid, n.nspname, c.relname, r.ev_action::text
	FROM pg_catalog.pg_rewrite r JOIN pg_catalog.pg_class c ON c.oid = r.ev_class
	JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
	WHERE c.relkind = 'm' AND r.ev_type = '1'`

// loadReadExtras reads what readers needs besides the path graph:
// pathRel.alsoReads and alsoCalls, and the materialized views.
func (g *pathGraph) loadReadExtras(ctx context.Context, q Querier) error {
	rows, err := q.Query(ctx, readExtrasSQL)
	if err != nil {
		return err
	}
	for rows.Next() {
		var relid uint32
		var text string
		if err := rows.Scan(&relid, &text); err != nil {
			rows.Close()
			return err
		}
		r := g.rels[relid]
		if r == nil {
			continue
		}
		tree, err := parseNodeTree(text)
		if err != nil {
			rows.Close()
			return fmt.Errorf("expression of %s: %w", r.display, err)
		}
		r.alsoReads, r.alsoCalls = treeReads(g, tree, r.oid, r.alsoReads, r.alsoCalls)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	rows, err = q.Query(ctx, triggerCallsSQL)
	if err != nil {
		return err
	}
	for rows.Next() {
		var relid, fn uint32
		if err := rows.Scan(&relid, &fn); err != nil {
			rows.Close()
			return err
		}
		if r := g.rels[relid]; r != nil && !slices.Contains(r.alsoCalls, fn) {
			r.alsoCalls = append(r.alsoCalls, fn)
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	rows, err = q.Query(ctx, matviewsSQL)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		m := &pathRel{kind: 'm'}
		var text string
		if err := rows.Scan(&m.oid, &m.schema, &m.name, &text); err != nil {
			return err
		}
		m.display = pathRelName(m.schema, m.name)
		tree, err := parseNodeTree(text)
		if err != nil {
			return fmt.Errorf("materialized view %s: %w", m.display, err)
		}
		m.reads, m.calls = treeReads(g, tree, m.oid, nil, nil)
		g.matviews = append(g.matviews, m)
	}
	return rows.Err()
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
		maybe := map[uint32]bool{} // in reach, but not surely (Reader.Maybe)
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
				switch {
				case (!reach[x] || maybe[x]) && r.kind == 'v' && slices.ContainsFunc(r.reads, func(y uint32) bool { return reach[y] && !maybe[y] }):
					// Its query reads the table's rows.
					addRel(x)
					delete(maybe, x)
					grew = true
				case !reach[x] && readsAny(r, reach, called):
					addRel(x)
					maybe[x] = true
					grew = true
				}
			}
		}
		target := g.rels[oid].display
		for x := range reach {
			if x != oid {
				r := g.rels[x]
				out = append(out, Reader{Schema: r.schema, Name: r.name, Target: target, Maybe: maybe[x]})
			}
		}
		for _, f := range funcs {
			if called[f.oid] {
				out = append(out, Reader{Schema: f.schema, Name: f.name, Target: target, Function: true, Maybe: true})
			}
		}
		for _, m := range g.matviews {
			if readsAny(m, reach, called) {
				out = append(out, Reader{Schema: m.schema, Name: m.name, Target: target, Refresh: true,
					Maybe: !slices.ContainsFunc(m.reads, func(y uint32) bool { return reach[y] && !maybe[y] })})
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
		if c := readerKind(a) - readerKind(b); c != 0 {
			return c
		}
		return strings.Compare(a.Target, b.Target)
	})
	return slices.Compact(out)
}

// readerKind orders relations, functions and materialized views.
func readerKind(x Reader) int {
	switch {
	case x.Function:
		return 1
	case x.Refresh:
		return 2
	}
	return 0
}

// readsAny reports whether r's own query (a view's, a materialized
// view's) or what a statement naming it evaluates (alsoReads, alsoCalls)
// reads a relation of reach or calls a function of called.
func readsAny(r *pathRel, reach, called map[uint32]bool) bool {
	in := func(m map[uint32]bool) func(uint32) bool { return func(x uint32) bool { return m[x] } }
	return slices.ContainsFunc(r.reads, in(reach)) || slices.ContainsFunc(r.alsoReads, in(reach)) ||
		slices.ContainsFunc(r.calls, in(called)) || slices.ContainsFunc(r.alsoCalls, in(called))
}
