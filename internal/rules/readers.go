package rules

import (
	"fmt"
	"strings"
	"sync/atomic"

	pg "github.com/pganalyze/pg_query_go/v6"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// Reads that reach a lock-fenced table without naming it (through a view
// over it, its partitioned or inheritance parent, one of its partitions
// or children, a function whose body names it, a table whose rules,
// policies, triggers or defaults read it, a materialized view's refresh)
// register the session's lock as a read of the table does: otherwise a
// newer holder whose first statements read only through such a relation
// would leave the watermark where it was, and a stale holder's later
// writes would land. The readers come from each database's catalog
// (catalog.Reader); DecideFor adds their registrations to the rule set's
// decision.

// Reader is a relation or function whose reads reach a protected table's
// rows without naming the table.
type Reader struct {
	Schema, Name string // exact names of the relation a statement names
	Target       string // the protected table reached, display form
	// Function: Schema.Name is a function whose body may read Target; a
	// statement that calls it registers, but only in a session that
	// named a lock (the body was not proven to read it: lock: required
	// does not apply).
	Function bool
	// Refresh: Schema.Name is a materialized view whose query reads
	// Target: REFRESH MATERIALIZED VIEW of it registers (a read of it
	// reads what the last refresh stored, and does not).
	Refresh bool
	// Maybe: a statement naming it may read Target, but not surely
	// (through a function, the relation's rules, policies, triggers or
	// defaults): it registers, but only in a session that named a lock
	// (lock: required does not apply). Function implies it.
	Maybe bool
	// EndsTx, with Function: a procedure of that name may commit or roll
	// back its transaction, so a CALL of it may go on without the
	// registration made before it (LockCall.EndsTx).
	EndsTx bool
}

// readerKind is what names a Reader: a relation in a statement, a
// function call, a materialized view's REFRESH.
type readerKind uint8

const (
	readRel readerKind = iota
	readFunc
	readRefresh
	readKinds
)

func (x Reader) kind() readerKind {
	switch {
	case x.Function:
		return readFunc
	case x.Refresh:
		return readRefresh
	}
	return readRel
}

// Readers finds the statements that read through Reader relations. It is
// safe for concurrent use.
type Readers struct {
	by       [readKinds]map[string][]Reader // by kind, by name
	byWord   map[string][]Reader            // of all kinds, by ASCII-lowered name (codeTargets)
	names    nameGate                       // the relations' names
	nonASCII bool                           // a name has a byte >= 0x80
	// verdicts caches the decisions DecideFor makes with the set, for the
	// rule sets of one root (a reload starts another cache).
	verdicts atomic.Pointer[readerVerdicts]
}

type readerVerdicts struct {
	root *decisionCache // the rule sets' own cache, which names the root
	d    *decisionCache
}

// NewReaders returns nil when list is empty.
func NewReaders(list []Reader) *Readers {
	if len(list) == 0 {
		return nil
	}
	s := &Readers{byWord: map[string][]Reader{}}
	for k := range s.by {
		s.by[k] = make(map[string][]Reader)
	}
	// A call of one of these may run any reader's name given as text.
	for _, f := range sqlTextFuncs {
		s.names.add(f)
	}
	seen := map[string]bool{}
	for _, x := range list {
		if !seen[x.Name] {
			seen[x.Name] = true
			s.names.add(x.Name)
			s.nonASCII = s.nonASCII || strings.ContainsFunc(x.Name, func(c rune) bool { return c >= 0x80 })
		}
		s.by[x.kind()][x.Name] = append(s.by[x.kind()][x.Name], x)
		s.byWord[asciiLower(x.Name)] = append(s.byWord[asciiLower(x.Name)], x)
	}
	return s
}

// MayApply reports whether sql may name one of the set's relations: it
// holds one's name, ASCII case ignored (nameGate), or a Unicode escape
// (which can spell any name). It does not allocate.
func (s *Readers) MayApply(sql string) bool {
	if s == nil {
		return false
	}
	return s.names.mayName(sql) || strings.IndexByte(sql, '&') >= 0 && (&Rules{}).unicodeEscape(sql) ||
		mayHideName(sql)
}

// applies reports whether DecideFor must look at sql with s, for a
// session whose rule set is r and whose text the server reads as lex.
func (s *Readers) applies(r *Rules, lex Lexing, sql string) bool {
	if s == nil || !r.locks {
		return false
	}
	return s.MayApply(sql) || (s.nonASCII && lex.NonASCII && lex.ClientEncoding != "UTF8")
}

// lexingRefusal is Rules.lexingRefusal for a text that may name one of
// the set's relations (applies).
func (s *Readers) lexingRefusal(lex Lexing) *Error {
	if !lex.Backslash && !lex.NonASCII {
		return nil
	}
	return lexingProblem(lex, "this statement, which may read a lock-fenced table through a view or parent,",
		"statements that may read a lock-fenced table through a view or parent")
}

// cache returns the verdicts for r's root, starting them after a reload;
// nil where the rule set caches nothing (its cache names the root).
func (s *Readers) cache(r *Rules) *decisionCache {
	if r.cache == nil {
		return nil
	}
	v := s.verdicts.Load()
	if v != nil && v.root == r.cache {
		return v.d
	}
	n := &readerVerdicts{root: r.cache, d: newDecisionCache(indirectCacheSize)}
	if s.verdicts.CompareAndSwap(v, n) {
		return n.d
	}
	if v = s.verdicts.Load(); v.root == r.cache {
		return v.d
	}
	return n.d // another root in between: not kept
}

// cached is decide when its answer is cached.
func (s *Readers) cached(r *Rules, sql string) (Decision, bool) {
	if c := s.cache(r); c != nil {
		return c.get(r.cacheSet, sql)
	}
	return Decision{}, false
}

// decide returns d, r's decision on sql, with the lock registration of
// every statement that reads a lock-fenced table of r, by its name or
// through one of the set's relations.
func (s *Readers) decide(r *Rules, sql string, d Decision) Decision {
	if d.Action == Refuse {
		return d
	}
	c := s.cache(r)
	if c != nil {
		if v, ok := c.get(r.cacheSet, sql); ok {
			return v
		}
	}
	sql = strings.Clone(sql) // parts of it may reach the decision (LockCall.Query)
	out := s.withReads(r, sql, d)
	if c != nil {
		c.put(r.cacheSet, sql, out)
	}
	return out
}

// withReads is decide without the cache.
func (s *Readers) withReads(r *Rules, sql string, d Decision) Decision {
	if r.tooLarge(sql) || (&Rules{}).tooDeep(sql) != nil {
		if !s.names.mayName(sql) {
			// Looked at for an escape or a DO block only (mayHideName),
			// as the rule sets do for a text that names no table.
			return d
		}
		return refuse(d.Tables, "fenceproxy: statement too large or too deeply nested to check for reads of lock-fenced tables through views or parents",
			fmt.Sprintf("fenceproxy checks such statements up to %d bytes (max_check_bytes) and %d levels of nesting.", r.maxCheck, maxNestingEstimate),
			"Send it in smaller statements, or name the lock-fenced table in a statement of its own first.")
	}
	tree, err := pg.Parse(sql)
	if err != nil {
		return refuse(d.Tables, "fenceproxy: cannot parse a statement that may read a lock-fenced table through a view or parent", err.Error(), "")
	}
	uses := r.lockUses(tree, s)
	if uses == nil {
		return d
	}
	final := sql
	if d.Action == Rewrite {
		final = d.SQL
	}
	return r.withLock(d, final, tree.Version, uses)
}

// funcTargets is targets for a function or operator named by the
// qualified name name (a list of strings).
func (s *Readers) funcTargets(r *Rules, name []*pg.Node, add func(t *tableRule, optional bool)) {
	if schema, fn, ok := funcName(name); ok {
		s.targets(r, schema, fn, readFunc, add)
	}
}

// funcName splits a function's qualified name (a list of strings) into
// its schema ("" when unqualified) and its name.
func funcName(name []*pg.Node) (schema, fn string, ok bool) {
	if len(name) == 0 {
		return "", "", false
	}
	if len(name) > 1 {
		schema = name[len(name)-2].GetString_().GetSval()
	}
	return schema, name[len(name)-1].GetString_().GetSval(), true
}

// endsTx reports whether a procedure named by the qualified name name (a
// list of strings) that reaches a lock-fenced table of r may end its
// transaction (Reader.EndsTx).
func (s *Readers) endsTx(r *Rules, name []*pg.Node) bool {
	schema, fn, ok := funcName(name)
	if !ok {
		return false
	}
	for _, x := range s.by[readFunc][fn] {
		if !x.EndsTx || !sameSchema(schema, x.Schema) {
			continue
		}
		for _, t := range r.tables {
			if t.display == x.Target && t.lock != lockOff {
				return true
			}
		}
	}
	return false
}

// codeTargets calls add, optional, for each table of r with lock
// fencing that a reader named in code (a DO block's) reaches: a name as
// one of its words (sqllex.Words, ASCII case ignored) or, for a name that
// is no word, as a substring; or any reader where the code holds an
// escape that may spell one (a backslash, a Unicode escape).
func (s *Readers) codeTargets(r *Rules, code string, add func(t *tableRule, optional bool)) {
	reach := func(xs []Reader) {
		for _, x := range xs {
			for _, t := range r.tables {
				if t.display == x.Target && t.lock != lockOff {
					add(t, true)
				}
			}
		}
	}
	if strings.IndexByte(code, '\\') >= 0 || (&Rules{}).unicodeEscape(code) {
		for _, xs := range s.byWord {
			reach(xs)
		}
		return
	}
	sqllex.Words(code, func(w string) bool {
		reach(s.byWord[asciiLower(w)])
		return false
	})
	for _, n := range s.names.needles {
		if indexFoldASCII(code, n) >= 0 {
			reach(s.byWord[strings.ReplaceAll(n, `""`, `"`)])
		}
	}
}

// targets calls add for each table of r, with lock fencing, that a
// reader of kind k named schema.name (schema "": any) of the set
// reaches; optional says whether it reaches it only maybe
// (Reader.Maybe).
func (s *Readers) targets(r *Rules, schema, name string, k readerKind, add func(t *tableRule, optional bool)) {
	for _, x := range s.by[k][name] {
		if !sameSchema(schema, x.Schema) {
			continue
		}
		for _, t := range r.tables {
			if t.display == x.Target && t.lock != lockOff {
				add(t, k == readFunc || x.Maybe)
			}
		}
	}
}
