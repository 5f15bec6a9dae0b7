package catalog

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// Reader is a relation or function whose reads reach a table's rows
// without naming the table (readers lists the kinds): a view that reads
// it, an ancestor or descendant of it, a function whose body names it, a
// relation whose rules, policies, triggers or defaults read it, a
// materialized view whose refresh does. Lock fencing registers the
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
	// EndsTx, with Function: a procedure that may end its transaction
	// (in PL/pgSQL, a body that sqllex.MayEndTx finds may; in another
	// language but SQL, any; with a SET clause, none): a CALL of it may
	// commit what registered before it and go on without the
	// registration.
	EndsTx bool
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
// included) and check constraints, those of the domains of its columns,
// rules' conditions and triggers' WHEN conditions. Rules' actions are
// read with the rules (loadRewrites), triggers' functions by
// triggerCallsSQL.
const readExtrasSQL = `
	SELECT polrelid, polqual::text FROM pg_catalog.pg_policy WHERE polqual IS NOT NULL
	UNION ALL SELECT polrelid, polwithcheck::text FROM pg_catalog.pg_policy WHERE polwithcheck IS NOT NULL
	UNION ALL SELECT adrelid, adbin::text FROM pg_catalog.pg_attrdef
	UNION ALL SELECT conrelid, conbin::text FROM pg_catalog.pg_constraint WHERE contype = 'c' AND conrelid <> 0
	UNION ALL SELECT a.attrelid, t.typdefaultbin::text
		FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
		WHERE t.typtype = 'd' AND t.typdefaultbin IS NOT NULL AND a.attnum > 0 AND NOT a.attisdropped
	UNION ALL SELECT a.attrelid, c.conbin::text
		FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_constraint c ON c.contypid = a.atttypid
		WHERE c.contype = 'c' AND a.attnum > 0 AND NOT a.attisdropped
	UNION ALL SELECT ev_class, ev_qual::text FROM pg_catalog.pg_rewrite WHERE ev_type <> '1' AND ev_qual::text <> '<>'
	UNION ALL SELECT tgrelid, tgqual::text FROM pg_catalog.pg_trigger WHERE tgqual IS NOT NULL AND NOT tgisinternal`

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

// pathFunc is a user function, aggregate or operator: what a statement
// names to run it, the words of its body, and the functions it calls
// without naming them in its body (an argument's default, an aggregate's
// support functions, an operator's function).
type pathFunc struct {
	oid          uint32
	schema, name string
	body         string   // the source, for names that are not words
	endsTx       bool     // a procedure that may end its transaction
	words        []string // ASCII-lowered, each once (bodyWords)
	calls        []uint32
	// anyName: the body holds a Unicode escape (U&"…"), which may spell
	// any name.
	anyName bool
}

// functionsSQL lists the user functions and procedures whose bodies the
// server keeps as text (SQL, PL/pgSQL and the other procedural
// languages), with PostgreSQL 14's SQL-standard bodies (BEGIN ATOMIC)
// printed, and their arguments' defaults, outside fenceproxy's own
// schema; then the user aggregates with their support functions, and
// the user operators with theirs. The last two columns say whether it is
// a procedure that may control transactions (not in SQL, which cannot,
// and without a SET clause, which forbids it), and whether its language
// is PL/pgSQL (whose COMMIT and ROLLBACK its body must spell out).
func functionsSQL(version int) string {
	return `
		SELECT p.oid, n.nspname, p.proname, ` + functionBodySQL(version) + `, coalesce(p.proargdefaults::text, ''), '{}'::oid[],
			p.prokind = 'p' AND p.proconfig IS NULL AND l.lanname <> 'sql', l.lanname = 'plpgsql'
		FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		JOIN pg_catalog.pg_language l ON l.oid = p.prolang
		WHERE p.oid >= 16384 AND l.lanname NOT IN ('c', 'internal') AND n.nspname <> 'fenceproxy'
		UNION ALL
		SELECT p.oid, n.nspname, p.proname, '', '',
			ARRAY[a.aggtransfn::oid, a.aggfinalfn::oid, a.aggcombinefn::oid, a.aggmtransfn::oid, a.aggminvtransfn::oid, a.aggmfinalfn::oid],
			false, false
		FROM pg_catalog.pg_aggregate a JOIN pg_catalog.pg_proc p ON p.oid = a.aggfnoid
		JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		WHERE p.oid >= 16384
		UNION ALL
		SELECT o.oid, n.nspname, o.oprname, '', '', ARRAY[o.oprcode::oid], false, false
		FROM pg_catalog.pg_operator o JOIN pg_catalog.pg_namespace n ON n.oid = o.oprnamespace
		WHERE o.oid >= 16384`
}

// functionBodySQL is the text of function p's body: its source, and for
// PostgreSQL 14's SQL-standard bodies (BEGIN ATOMIC), which keep no
// source, the body printed.
func functionBodySQL(version int) string {
	if version >= 140000 {
		return "coalesce(p.prosrc, '') || ' ' || coalesce(pg_catalog.pg_get_function_sqlbody(p.oid), '')"
	}
	return "p.prosrc"
}

// loadFunctions reads the user functions, aggregates and operators.
func loadFunctions(ctx context.Context, q Querier, version int) ([]*pathFunc, error) {
	rows, err := q.Query(ctx, functionsSQL(version))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*pathFunc
	for rows.Next() {
		f := &pathFunc{}
		var defaults string
		var calls []uint32
		var txControl, plpgsql bool
		if err := rows.Scan(&f.oid, &f.schema, &f.name, &f.body, &defaults, &calls, &txControl, &plpgsql); err != nil {
			return nil, err
		}
		f.words = bodyWords(f.body)
		// In another language the body may compute what it calls
		// (plpy.commit by another name).
		f.endsTx = txControl && (!plpgsql || sqllex.MayEndTx(f.body))
		f.anyName = sqllex.HasUnicodeEscape(f.body)
		for _, c := range calls {
			if c >= firstNormalOID && !slices.Contains(f.calls, c) {
				f.calls = append(f.calls, c)
			}
		}
		if defaults != "" {
			tree, err := parseNodeTree(defaults)
			if err != nil {
				return nil, fmt.Errorf("argument defaults of %s: %w", pathRelName(f.schema, f.name), err)
			}
			tree.walk("FUNCEXPR", func(fn *pgNode) {
				if id := fn.field("funcid").oid(); id >= firstNormalOID && !slices.Contains(f.calls, id) {
					f.calls = append(f.calls, id)
				}
			})
		}
		out = append(out, f)
	}
	return out, rows.Err()
}

// bodyWords returns the words of a function's body (sqllex.Words),
// ASCII-lowered, each once.
func bodyWords(body string) []string {
	seen := map[string]bool{}
	var out []string
	sqllex.Words(body, func(w string) bool {
		if w = sqllex.Fold(w); !seen[w] {
			seen[w] = true
			out = append(out, w)
		}
		return false
	})
	return out
}

// readers finds, for each of tables, the relations whose reads reach its
// rows:
//
//   - its descendants (inheritance children and partitions, all levels),
//     whose rows are its rows, and every ancestor of it or of one of
//     them: a read of an ancestor without ONLY reads its descendants;
//   - every view whose query reads one of those relations or the table,
//     or another such view, anywhere (FROM lists, joins, subqueries,
//     CTEs). A view reading a parent with ONLY is listed too:
//     registering for it costs a statement, missing one would let a
//     stale holder through;
//   - Maybe, every relation that a statement naming it may read through
//     otherwise: a view calling a function below or reading a Maybe
//     relation, a relation whose rules, policies, triggers, defaults or
//     constraints (its columns' domains' too) read one or call one;
//   - every function of funcs whose body holds, as a word (or, for a
//     name that is not one, as a substring), the name of the table, of
//     one of those relations, or of another such function, or whose
//     body holds a Unicode escape; every function, aggregate or operator
//     that calls one (argument defaults, support functions); functions
//     are Maybe (a name in a comment or a string counts: the body is
//     not parsed, and dynamic SQL is text);
//   - a materialized view whose query reads one of them (REFRESH).
//
// Not found: a read of a materialized view (it reads what its last
// refresh stored), bodies that compute the name, casts' functions,
// event triggers, and foreign tables whose server is this database. The
// table itself is not listed. The result is sorted by Schema, Name, kind
// and Target.
func (g *pathGraph) readers(tables []Rel, funcs []*pathFunc) []Reader {
	ix := g.readerIndex(funcs)
	var out []Reader
	for _, t := range tables {
		oid, ok := g.byName[t]
		if !ok {
			continue
		}
		out = append(out, g.readersOf(oid, funcs, ix)...)
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

// readerIndex is what readersOf follows, by what is reached.
type readerIndex struct {
	viewsReading map[uint32][]uint32    // relation → views whose query reads it
	alsoReading  map[uint32][]uint32    // relation → relations that read it otherwise (alsoReads)
	relsCalling  map[uint32][]uint32    // function → relations calling it (calls, alsoCalls)
	funcsCalling map[uint32][]*pathFunc // function → functions calling it (pathFunc.calls)
	byWord       map[string][]*pathFunc // body word → functions
	anyName      []*pathFunc            // pathFunc.anyName
}

func (g *pathGraph) readerIndex(funcs []*pathFunc) *readerIndex {
	ix := &readerIndex{viewsReading: map[uint32][]uint32{}, alsoReading: map[uint32][]uint32{}, relsCalling: map[uint32][]uint32{},
		funcsCalling: map[uint32][]*pathFunc{}, byWord: map[string][]*pathFunc{}}
	for x, r := range g.rels {
		if r.kind == 'v' {
			for _, y := range r.reads {
				ix.viewsReading[y] = append(ix.viewsReading[y], x)
			}
			for _, f := range r.calls {
				ix.relsCalling[f] = append(ix.relsCalling[f], x)
			}
		}
		for _, y := range r.alsoReads {
			ix.alsoReading[y] = append(ix.alsoReading[y], x)
		}
		for _, f := range r.alsoCalls {
			ix.relsCalling[f] = append(ix.relsCalling[f], x)
		}
	}
	for _, f := range funcs {
		for _, w := range f.words {
			ix.byWord[w] = append(ix.byWord[w], f)
		}
		for _, c := range f.calls {
			ix.funcsCalling[c] = append(ix.funcsCalling[c], f)
		}
		if f.anyName {
			ix.anyName = append(ix.anyName, f)
		}
	}
	return ix
}

// readersOf is readers for the table oid: a search from it, each
// relation and function taken once (a relation twice when it is found
// surely after maybe).
func (g *pathGraph) readersOf(oid uint32, funcs []*pathFunc, ix *readerIndex) []Reader {
	const maybe, sure = 1, 2
	state := map[uint32]int{} // relation → maybe or sure
	called := map[uint32]bool{}
	var rels []uint32
	var fns []*pathFunc
	setRel := func(x uint32, s int) {
		if state[x] < s {
			state[x] = s
			rels = append(rels, x)
		}
	}
	reachFunc := func(f *pathFunc) {
		if !called[f.oid] {
			called[f.oid] = true
			fns = append(fns, f)
		}
	}
	byOID := map[uint32]*pathFunc{}
	for _, f := range funcs {
		byOID[f.oid] = f
	}
	// A name reached: the functions whose body names it.
	named := map[string]bool{}
	nameReached := func(name string) {
		n := sqllex.Fold(name)
		if named[n] {
			return
		}
		named[n] = true
		if sqllex.IsWord(n) {
			for _, f := range ix.byWord[n] {
				reachFunc(f)
			}
			return
		}
		doubled := strings.ReplaceAll(n, `"`, `""`)
		for _, f := range funcs {
			if sqllex.IndexFold(f.body, n) >= 0 || sqllex.IndexFold(f.body, doubled) >= 0 {
				reachFunc(f)
			}
		}
	}
	// The table, its descendants, and the ancestors of each of them.
	down := []uint32{oid}
	seen := map[uint32]bool{oid: true}
	for i := 0; i < len(down); i++ {
		for _, c := range g.rels[down[i]].children {
			if !seen[c] {
				seen[c] = true
				down = append(down, c)
			}
		}
	}
	up := slices.Clone(down)
	for i := 0; i < len(up); i++ {
		for _, p := range g.rels[up[i]].parents {
			if !seen[p] {
				seen[p] = true
				up = append(up, p)
			}
		}
	}
	for _, x := range up {
		setRel(x, sure)
	}
	for _, f := range ix.anyName {
		reachFunc(f)
	}
	for len(rels) > 0 || len(fns) > 0 {
		if n := len(rels); n > 0 {
			x := rels[n-1]
			rels = rels[:n-1]
			s := state[x]
			nameReached(g.rels[x].name)
			for _, y := range ix.viewsReading[x] {
				setRel(y, s)
			}
			for _, y := range ix.alsoReading[x] {
				setRel(y, maybe)
			}
			continue
		}
		f := fns[len(fns)-1]
		fns = fns[:len(fns)-1]
		nameReached(f.name)
		for _, y := range ix.relsCalling[f.oid] {
			setRel(y, maybe)
		}
		for _, c := range ix.funcsCalling[f.oid] {
			reachFunc(c)
		}
	}
	target := g.rels[oid].display
	var out []Reader
	for x, s := range state {
		if x != oid {
			r := g.rels[x]
			out = append(out, Reader{Schema: r.schema, Name: r.name, Target: target, Maybe: s == maybe})
		}
	}
	for fo := range called {
		if f := byOID[fo]; f != nil {
			out = append(out, Reader{Schema: f.schema, Name: f.name, Target: target, Function: true, Maybe: true, EndsTx: f.endsTx})
		}
	}
	for _, m := range g.matviews {
		surely := slices.ContainsFunc(m.reads, func(y uint32) bool { return state[y] == sure })
		if surely || slices.ContainsFunc(m.reads, func(y uint32) bool { return state[y] != 0 }) ||
			slices.ContainsFunc(m.calls, func(y uint32) bool { return called[y] }) {
			out = append(out, Reader{Schema: m.schema, Name: m.name, Target: target, Refresh: true, Maybe: !surely})
		}
	}
	return out
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
