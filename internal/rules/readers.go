package rules

import (
	"fmt"
	"strings"
	"sync/atomic"

	pg "github.com/pganalyze/pg_query_go/v6"
)

// Reads that reach a lock-fenced table without naming it (through a view
// over it, its partitioned or inheritance parent, one of its partitions
// or children) register the session's lock as a read of the table does:
// otherwise a newer holder whose first statements read only through such
// a relation would leave the watermark where it was, and a stale holder's
// later writes would land. The relations come from each database's
// catalog (catalog.Reader); DecideFor adds their registrations to the
// rule set's decision.

// Reader is a relation whose reads reach a protected table's rows
// without naming the table.
type Reader struct {
	Schema, Name string // exact names of the relation a statement names
	Target       string // the protected table reached, display form
	// Function: Schema.Name is a function whose body may read Target; a
	// statement that calls it registers, but only in a session that
	// named a lock (the body was not proven to read it: lock: required
	// does not apply).
	Function bool
}

// Readers finds the statements that read through Reader relations. It is
// safe for concurrent use.
type Readers struct {
	byRel    map[string][]Reader // relations, by name
	byFunc   map[string][]Reader // functions, by name
	names    nameGate            // the relations' names
	nonASCII bool                // a name has a byte >= 0x80
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
	s := &Readers{byRel: make(map[string][]Reader), byFunc: make(map[string][]Reader)}
	for _, x := range list {
		by := s.byRel
		if x.Function {
			by = s.byFunc
		}
		if len(s.byRel[x.Name]) == 0 && len(s.byFunc[x.Name]) == 0 {
			s.names.add(x.Name)
			s.nonASCII = s.nonASCII || strings.ContainsFunc(x.Name, func(c rune) bool { return c >= 0x80 })
		}
		by[x.Name] = append(by[x.Name], x)
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
	return s.names.mayName(sql) || strings.IndexByte(sql, '&') >= 0 && (&Rules{}).unicodeEscape(sql)
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

// targets calls add for each table of r, with lock fencing, that a
// relation (or, function, a function) named schema.name (schema "": any)
// of the set reaches; optional says whether the reader is a function.
func (s *Readers) targets(r *Rules, schema, name string, function bool, add func(t *tableRule, optional bool)) {
	by := s.byRel
	if function {
		by = s.byFunc
	}
	for _, x := range by[name] {
		if schema != "" && schema != x.Schema {
			continue
		}
		for _, t := range r.tables {
			if t.display == x.Target && t.lock != lockOff {
				add(t, function)
			}
		}
	}
}
