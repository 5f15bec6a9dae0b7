package rules

import (
	"encoding/binary"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
)

// maxSessionSets bounds the rule sets ForSession keeps. Their number is
// bounded by the configuration (it is the number of distinct combinations
// of matching entries), not by client input, but a configuration with many
// overlapping scopes could still have very many; past this bound a session
// gets a fresh set without a decision cache.
const maxSessionSets = 256

// entry is one compiled `tables:` entry.
type entry struct {
	index int        // position in Config.Tables, for messages
	rule  *tableRule // nil for mode: off
	scope scope
}

// group gathers the entries of one table, in configuration order.
type group struct {
	display string
	entries []*entry
	scoped  bool // some entry has a scope
}

// scope is a validated Scope: sorted lists without duplicates, each empty
// for "any".
type scope struct {
	databases, users, apps []string
}

func compileScope(key string, s Scope) (scope, error) {
	var out scope
	var err error
	if out.databases, err = compileScopeList(key+".databases", s.Databases); err != nil {
		return out, err
	}
	if out.users, err = compileScopeList(key+".users", s.Users); err != nil {
		return out, err
	}
	if out.apps, err = compileScopeList(key+".application_names", s.ApplicationNames); err != nil {
		return out, err
	}
	return out, nil
}

func compileScopeList(key string, list []string) ([]string, error) {
	if len(list) == 0 {
		return nil, nil
	}
	for i, v := range list {
		if v == "" {
			// An empty list means "any"; an empty value would only ever
			// match a session that sent an empty string, which is surely
			// not what was meant.
			return nil, fmt.Errorf("%s[%d]: must not be empty", key, i)
		}
	}
	out := slices.Clone(list)
	slices.Sort(out)
	return slices.Compact(out), nil
}

func (s *scope) any() bool {
	return len(s.databases) == 0 && len(s.users) == 0 && len(s.apps) == 0
}

func (s *scope) matches(database, user, app string) bool {
	return listMatches(s.databases, database) && listMatches(s.users, user) && listMatches(s.apps, app)
}

func listMatches(list []string, v string) bool {
	if len(list) == 0 {
		return true
	}
	for _, x := range list {
		if x == v {
			return true
		}
	}
	return false
}

// covers reports whether s matches every session o matches.
func (s *scope) covers(o *scope) bool {
	return listCovers(s.databases, o.databases) && listCovers(s.users, o.users) && listCovers(s.apps, o.apps)
}

func listCovers(a, b []string) bool {
	if len(a) == 0 {
		return true
	}
	if len(b) == 0 {
		return false
	}
	for _, v := range b {
		if _, ok := slices.BinarySearch(a, v); !ok {
			return false
		}
	}
	return true
}

func (s *scope) equal(o *scope) bool { return s.covers(o) && o.covers(s) }

// scopeIndex picks and memoizes the rule set of a session. It is shared by
// the root *Rules and every set derived from it.
type scopeIndex struct {
	root   *Rules
	groups []*group // every table, in configuration order
	// rootKey is the key of a session that matches no scoped entry, which
	// the root set serves.
	rootKey string

	memo atomic.Pointer[map[string]*Rules] // copy on write, under mu
	mu   sync.Mutex
	next uint32 // last cache set id handed out, under mu
}

// newRoot builds the root rule set from the tables' entry groups.
func newRoot(setting, tag string, groups []*group, cache *decisionCache) *Rules {
	var listed, audited []string
	hasScopes, nonASCII, anyLocks := false, false, false
	for _, g := range groups {
		fenced, audit := false, false
		for _, e := range g.entries {
			g.scoped = g.scoped || !e.scope.any()
			if t := e.rule; t != nil {
				fenced = true
				anyLocks = anyLocks || t.lock != lockOff
				audit = audit || t.audit
				nonASCII = nonASCII || hasNonASCII(t.schema) || hasNonASCII(t.rel) || hasNonASCII(t.column)
			}
		}
		hasScopes = hasScopes || g.scoped
		if fenced {
			listed = append(listed, g.display)
		}
		if audit {
			audited = append(audited, g.display)
		}
	}
	var x *scopeIndex
	if hasScopes {
		x = &scopeIndex{groups: groups}
	}
	// The root serves sessions that match no scoped entry: the first
	// unscoped entry of each table applies.
	r := newSet(setting, tag, pickRules(groups, func(e *entry) bool { return e.scope.any() }), cache, 0, x)
	r.listed, r.audited, r.nonASCII, r.anyLocks = listed, audited, nonASCII, anyLocks
	if x != nil {
		x.root = r
		x.rootKey = string(x.key(nil, func(e *entry) bool { return e.scope.any() }))
	}
	return r
}

// pickRules returns the rules that apply when exactly the entries for
// which match is true match the session: the first matching entry of each
// table (no rule when that entry is mode: off, or when none matches).
func pickRules(groups []*group, match func(*entry) bool) []*tableRule {
	var out []*tableRule
	for _, g := range groups {
		for _, e := range g.entries {
			if match(e) {
				if e.rule != nil {
					out = append(out, e.rule)
				}
				break
			}
		}
	}
	return out
}

// key appends to b which entry applies to each table that has scoped
// entries (its position in the table's entries, or their number when none
// matches), for the session described by match.
func (x *scopeIndex) key(b []byte, match func(*entry) bool) []byte {
	for _, g := range x.groups {
		if !g.scoped {
			continue
		}
		n := len(g.entries)
		for i, e := range g.entries {
			if match(e) {
				n = i
				break
			}
		}
		b = binary.AppendUvarint(b, uint64(n))
	}
	return b
}

// ForSession returns the rule set for a session that connected to database
// as user with applicationName, as sent in its startup packet (PostgreSQL
// takes the user name as the database name when the packet has none; pass
// the name it uses). It has the same API as r, with its own decisions, and
// is meant to be called for every statement, so it is cheap: without any
// scoped entry it returns r itself, and otherwise a memoized set (at most a
// few hundred are kept, keyed by which entries match, never by the client's
// strings) without allocating. A session that matches no scoped entry gets
// the root set. Calling ForSession on a derived set is the same as calling
// it on the root.
func (r *Rules) ForSession(database, user, applicationName string) *Rules {
	x := r.scopes
	if x == nil {
		return r
	}
	match := func(e *entry) bool { return e.scope.matches(database, user, applicationName) }
	var buf [64]byte
	key := x.key(buf[:0], match)
	if string(key) == x.rootKey {
		return x.root
	}
	if m := x.memo.Load(); m != nil {
		if s, ok := (*m)[string(key)]; ok {
			return s
		}
	}
	return x.derive(key, match)
}

func (x *scopeIndex) derive(key []byte, match func(*entry) bool) *Rules {
	x.mu.Lock()
	defer x.mu.Unlock()
	var old map[string]*Rules
	if m := x.memo.Load(); m != nil {
		old = *m
	}
	if s, ok := old[string(key)]; ok {
		return s
	}
	root := x.root
	tables := pickRules(x.groups, match)
	if len(old) >= maxSessionSets {
		return x.newDerived(tables, nil, 0)
	}
	x.next++
	s := x.newDerived(tables, root.cache, x.next)
	m := make(map[string]*Rules, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[string(key)] = s
	x.memo.Store(&m)
	return s
}

func (x *scopeIndex) newDerived(tables []*tableRule, cache *decisionCache, id uint32) *Rules {
	s := newSet(x.root.tokenSetting, x.root.auditTag, tables, cache, id, x)
	s.listed, s.audited, s.nonASCII, s.maxCheck, s.lockSetting, s.anyLocks = x.root.listed, x.root.audited, x.root.nonASCII, x.root.maxCheck, x.root.lockSetting, x.root.anyLocks
	return s
}

// sessionSets reports how many derived sets are memoized (for tests).
func (r *Rules) sessionSets() int {
	if r.scopes == nil {
		return 0
	}
	if m := r.scopes.memo.Load(); m != nil {
		return len(*m)
	}
	return 0
}
