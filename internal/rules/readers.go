package rules

import (
	"fmt"
	"strings"
	"sync/atomic"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
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
	// Refresh: Schema.Name is a materialized view whose query reads
	// Target: REFRESH MATERIALIZED VIEW of it registers (a read of it
	// reads what the last refresh stored, and does not).
	Refresh bool
	// Maybe: a statement naming it may read Target, but not surely
	// (through a function, the relation's rules, policies, triggers or
	// defaults): it registers, but only in a session that named a lock
	// (lock: required does not apply). Function implies it.
	Maybe bool
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
	s := &Readers{}
	for k := range s.by {
		s.by[k] = make(map[string][]Reader)
	}
	seen := map[string]bool{}
	for _, x := range list {
		if !seen[x.Name] {
			seen[x.Name] = true
			s.names.add(x.Name)
			s.nonASCII = s.nonASCII || strings.ContainsFunc(x.Name, func(c rune) bool { return c >= 0x80 })
		}
		s.by[x.kind()][x.Name] = append(s.by[x.kind()][x.Name], x)
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
		return refuse(d.Tables, "fenceproxy: statement too large or too deeply nested to check for reads of lock-fenced tables through views or parents",
			fmt.Sprintf("fenceproxy checks such statements up to %d bytes (max_check_bytes) and %d levels of nesting.", r.maxCheck, maxNestingEstimate),
			"Send it in smaller statements, or name the lock-fenced table in a statement of its own first.")
	}
	tree, err := pg.Parse(sql)
	if err != nil {
		return refuse(d.Tables, "fenceproxy: cannot parse a statement that may read a lock-fenced table through a view or parent", err.Error(), "")
	}
	if e := s.ddlRefusal(r, sql, tree); e != nil {
		return Decision{Action: Refuse, Err: e, Tables: []string{e.Table}}
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

// ddlRefusal refuses what would read a lock-fenced table of r through
// one of the set's relations or functions later, where no statement the
// proxy decides names it: stored code (CREATE FUNCTION, DO) that mentions
// one, as stored code that mentions the table is refused; and a view, a
// rule, a row security policy or a trigger whose definition reads one
// (through the proxy, where a statement right after it, or later in its
// transaction, would read through it before the proxy learns of it from
// the catalog). Run on a direct connection, they are learned from the
// catalog instead.
func (s *Readers) ddlRefusal(r *Rules, sql string, tree *pg.ParseResult) *Error {
	var out *Error
	for _, raw := range tree.Stmts {
		walkMessages(raw.ProtoReflect(), func(m protoreflect.Message) bool {
			if out != nil {
				return false
			}
			var parts []protoreflect.Message
			what := ""
			switch n := m.Interface().(type) {
			case *pg.CreateFunctionStmt, *pg.DoStmt:
				text := stmtText(sql, raw)
				byRel := s.codeReaders(r)
				if f, ok := m.Interface().(*pg.CreateFunctionStmt); ok && len(f.Funcname) > 0 {
					// Its own name: a function replaced (CREATE OR
					// REPLACE) is checked by what its new body names.
					delete(byRel, f.Funcname[len(f.Funcname)-1].GetString_().GetSval())
				}
				out = storedCodeRefusal(byRel, codeNames(byRel), m.Interface(), text, "reads lock-fenced table %s without naming it")
				if out != nil {
					out.Hint = "Name the lock-fenced table in the statements the proxy sees, or create the code on a direct connection: the proxy then learns it from the catalog, and statements that call a function of it register."
				}
				return false
			case *pg.ViewStmt:
				what, parts = "CREATE VIEW", []protoreflect.Message{n.Query.ProtoReflect()}
			case *pg.RuleStmt:
				what = "CREATE RULE"
				parts = append(parts, n.WhereClause.ProtoReflect())
				for _, a := range n.Actions {
					parts = append(parts, a.ProtoReflect())
				}
			case *pg.CreatePolicyStmt:
				what, parts = "CREATE POLICY", []protoreflect.Message{n.Qual.ProtoReflect(), n.WithCheck.ProtoReflect()}
			case *pg.AlterPolicyStmt:
				what, parts = "ALTER POLICY", []protoreflect.Message{n.Qual.ProtoReflect(), n.WithCheck.ProtoReflect()}
			case *pg.CreateTrigStmt:
				what, parts = "CREATE TRIGGER", []protoreflect.Message{n.WhenClause.ProtoReflect()}
				if x := s.first(r, n.Funcname, readFunc); x != nil {
					out = readerDDLError(what, x)
				}
			default:
				return true
			}
			for _, part := range parts {
				walkMessages(part, func(m protoreflect.Message) bool {
					var x *Reader
					switch n := m.Interface().(type) {
					case *pg.RangeVar:
						x = s.first(r, []*pg.Node{pg.MakeStrNode(n.Schemaname), pg.MakeStrNode(n.Relname)}, readRel)
					case *pg.FuncCall:
						x = s.first(r, n.Funcname, readFunc)
					}
					if x != nil && out == nil {
						out = readerDDLError(what, x)
					}
					return out == nil
				})
			}
			return false
		})
	}
	return out
}

// readerDDLError is ddlRefusal's refusal of DDL what, which reads x.
func readerDDLError(what string, x *Reader) *Error {
	kind := "relation"
	if x.Function {
		kind = "function"
	}
	return &Error{
		Code: CodeRefused,
		Message: fmt.Sprintf("fenceproxy: %s that reads %s %s, which reads lock-fenced table %s, is not allowed through the proxy",
			what, kind, quoteIdent(x.Schema)+"."+quoteIdent(x.Name), x.Target),
		Detail: "A statement right after it, or later in its transaction, could read the table through it before the proxy learns of it, and register no lock.",
		Hint:   "Run it on a direct connection to PostgreSQL: the proxy learns it from the catalog, and statements that read through it register.",
		Table:  x.Target,
	}
}

// first returns the first reader of kind k named by name (a qualified
// name's list of strings; its schema "" or absent: any) that reaches a
// lock-fenced table of r; nil if none.
func (s *Readers) first(r *Rules, name []*pg.Node, k readerKind) *Reader {
	if len(name) == 0 {
		return nil
	}
	var schema string
	if len(name) > 1 {
		schema = name[len(name)-2].GetString_().GetSval()
	}
	rel := name[len(name)-1].GetString_().GetSval()
	by := s.by[k]
	for i, x := range by[rel] {
		if sameSchema(schema, x.Schema) && r.lockFenced(x.Target) && x.refusesDDL() {
			return &by[rel][i]
		}
	}
	return nil
}

// refusesDDL reports whether DDL through the proxy that reads x (or
// code that mentions it) is refused (ddlRefusal): x is a function, or a
// relation whose reads surely reach its target. A relation that reaches
// it only maybe (a table whose trigger reads it, say) does not refuse a
// view over it, which would not fire the trigger.
func (x Reader) refusesDDL() bool { return x.Function || !x.Maybe }

// codeReaders returns the set's relations and functions that reach a
// lock-fenced table of r, as paths for storedCodeRefusal.
func (s *Readers) codeReaders(r *Rules) map[string][]Indirect {
	out := map[string][]Indirect{}
	for _, by := range s.by {
		for name, xs := range by {
			for _, x := range xs {
				if r.lockFenced(x.Target) && x.refusesDDL() {
					out[name] = append(out[name], Indirect{Schema: x.Schema, Name: x.Name, Target: x.Target,
						Via: x.Name + " reads " + x.Target})
				}
			}
		}
	}
	return out
}

// lockFenced reports whether the table of display name target has lock
// fencing in r.
func (r *Rules) lockFenced(target string) bool {
	for _, t := range r.tables {
		if t.display == target && t.lock != lockOff {
			return true
		}
	}
	return false
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
