package rules

import (
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// Action is what the proxy does with a statement.
type Action uint8

const (
	// Forward sends the client's original bytes unchanged.
	Forward Action = iota
	// Rewrite sends Decision.SQL instead of the original.
	Rewrite
	// Refuse sends nothing upstream and answers with Decision.Err.
	Refuse
)

func (a Action) String() string {
	switch a {
	case Forward:
		return "FORWARD"
	case Rewrite:
		return "REWRITE"
	case Refuse:
		return "REFUSE"
	}
	return "Action(" + strconv.Itoa(int(a)) + ")"
}

// Decision is the outcome of Rules.Decide. Decisions may be shared through
// the cache: callers must treat them, including Err and Tables, as read-only.
type Decision struct {
	Action Action
	// SQL is the statement text to send instead of the original (Rewrite).
	SQL string
	// Err is the error to answer with (Refuse).
	Err *Error
	// Tables names the protected tables the statement writes (Rewrite), or
	// that the refused statement concerns (Refuse), in display form
	// (schema.table), sorted, without duplicates. For a Forward with an
	// AuditRefusal, it names the audit-mode tables the refusal concerns.
	Tables []string
	// Lock, on a Forward or Rewrite, is the registration of the session's
	// token for its lock that must run before the statement in sessions
	// that name a lock (always when Lock.Required). Nil when the statement
	// reads and writes no lock-fenced table.
	Lock *LockCall
	// AuditRefusal, on a Forward or Rewrite, is the refusal (FP003) that
	// enforce mode would have made: the statement writes audit-mode tables
	// in a way fenceproxy cannot fence (TRUNCATE, COPY FROM, DELETE ...
	// WHERE CURRENT OF, a statement that does not parse, ...). Audit mode
	// never blocks a write, so those writes are forwarded as the client
	// sent them; the proxy should record the refusal as an audit
	// would-reject. Nil otherwise.
	AuditRefusal *Error
	// Preparable, on a Rewrite, says that the text is one INSERT, UPDATE,
	// DELETE or MERGE, without RETURNING, parameters, an audit refusal or
	// constants PostgreSQL reads from the clock or the catalogs when it
	// analyses the statement ('now', 'x'::regclass): executed as a named
	// prepared statement (in the form the Prepared sibling writes), it
	// answers as the simple Query does under the same settings, so a relay
	// may run a text it sees repeatedly that way (see preparable).
	Preparable bool
	// Tok, on a Rewrite, is SQL's token form (tokenform.go), nil when it
	// has none: a relay that knows the session's token may send it
	// instead under the conditions TokenForm documents.
	Tok *TokenForm
}

// Rules is a compiled configuration, or the part of it that applies to one
// session (ForSession). It is safe for concurrent use. A reload builds a new
// *Rules, which starts with an empty cache.
type Rules struct {
	tokenSetting string
	lockSetting  string
	auditTag     string
	tables       []*tableRule // fenced in this set (enforce or audit)
	locks        bool         // some table of the set has lock fencing
	// calls keeps proven registration statements (callText).
	calls  sync.Map
	nCalls atomic.Int64
	byRel  map[string][]*tableRule
	// needles are the relation names (ASCII-lowered) MayTouch looks for;
	// pairs marks the byte pairs that start one (or "alter", "drop"), and
	// short lists the one-byte names, which no pair can start.
	needles []string
	pairs   *[1024]uint64
	short   []string
	// schemas lists the schema names (ASCII-lowered) of the protected
	// tables: MayTouch looks for them in statements that contain "alter"
	// (ALTER SCHEMA ... RENAME).
	schemas []string
	// cache is shared by the root and its derived sets; cacheSet tells
	// their entries apart.
	cache    *decisionCache
	cacheSet uint32
	listed   []string    // Tables(), shared with the root
	audited  []string    // AuditTables(), shared with the root
	scopes   *scopeIndex // nil when no entry has a scope
	nonASCII bool        // HasNonASCIINames, shared with the root
	anyLocks bool        // HasLocks, shared with the root
	maxCheck int         // Config.MaxCheckBytes, shared with the root
	// raisers: rewrites raise their errors by calling the functions
	// fenceproxy setup installs (ServerFunctions); withRaisers is that
	// sibling of a set without them, made on first use.
	raisers     bool
	withRaisers atomic.Pointer[Rules]
	// prepared: a set whose rewrites cost the server less per execution
	// and more per analysis (Prepared); withPrepared is that sibling of a
	// set without it, made on first use.
	prepared     bool
	withPrepared atomic.Pointer[Rules]
	// staleAt: a raisers set whose token forms raise a stale row's error
	// with fenceproxy.stale_at (StaleAt); withStaleAt is that sibling of
	// a set without it, made on first use.
	staleAt     bool
	withStaleAt atomic.Pointer[Rules]
	// hold: lock registrations call HoldProc in place of RegisterProc
	// (Hold); withHold is that sibling of a set without it, made on first
	// use.
	hold     bool
	withHold atomic.Pointer[Rules]
}

// raisersCacheSet marks the decision-cache entries of a ServerFunctions
// set, preparedCacheSet those of its Prepared sibling (derived sets number
// from 1 up, far below them).
const (
	raisersCacheSet  = 1 << 31
	preparedCacheSet = 1 << 30
	staleAtCacheSet  = 1 << 29
	holdCacheSet     = 1 << 28
)

// ServerFunctions returns the set that decides like r, but whose rewrites
// call the functions fenceproxy setup installs in the database (objects
// version 3 or later): the error raisers fenceproxy.stale[_b] and no_token[_b]
// instead of casting a marker text, and the checks fenceproxy.tok[_b] and
// advance instead of the token read, its validation and the CASE, which
// costs PostgreSQL's parse analysis far less. Both forms raise the same
// errors (TranslateError reads both). Use
// it only for a database whose check found the raisers current, and call
// it on the set ForSession returns (ForSession on the result returns sets
// without raisers). The result is made once per set and kept.
func (r *Rules) ServerFunctions() *Rules {
	if r.raisers {
		return r
	}
	return r.sibling(&r.withRaisers, raisersCacheSet)
}

// StaleAt returns the ServerFunctions set that decides like r, but whose
// token forms (Decision.Tok) raise a stale row's error with
// fenceproxy.stale_at[_b](F), which objects version 5 added, in place of
// fenceproxy.stale[_b]('<setting>', F, '<n>:<table>'): its message
// carries the row's watermark only, and the relay that sent the token
// form fills in the token and the table (TokenForm.StaleTable,
// ExpandStaleAt). Its other forms are ServerFunctions'. Call it only for a
// database whose check found those raisers current. The result is made
// once per set and kept.
func (r *Rules) StaleAt() *Rules {
	if r.staleAt {
		return r
	}
	return r.sibling(&r.withStaleAt, raisersCacheSet|staleAtCacheSet)
}

// Prepared returns the set that decides like r but writes the form for
// statements PostgreSQL analyses once and executes many times (a named
// prepared statement). In a ServerFunctions set, the checks a rewrite
// makes in one PL/pgSQL call each are written as expressions, with the
// calls left only where a token is invalid or has 19 significant digits,
// where an error is raised, and where nothing in the statement checks the
// token before a row's fence value (WHERE CURRENT OF, MERGE: advance): analysing those expressions costs the server
// more than the calls, executing them less (docs/rewrite.md, "Two forms
// for two costs"), so the proxy asks for this form only where the
// analysis is paid once. In every set, the token is validated with the
// short pattern before the full one. The result is made once per set and
// kept; ServerFunctions of it is in the prepared form too.
func (r *Rules) Prepared() *Rules {
	if r.prepared {
		return r
	}
	return r.sibling(&r.withPrepared, preparedCacheSet)
}

// Hold returns the set that decides like r, but whose lock registrations
// call HoldProc, which objects version 6 added, in place of RegisterProc:
// the same arguments and outcome, the common case cheaper for the server.
// Call it only for a database whose check found hold current. The result
// is made once per set and kept.
func (r *Rules) Hold() *Rules {
	if r.hold {
		return r
	}
	return r.sibling(&r.withHold, holdCacheSet)
}

// sibling returns the set *p holds, first making it: r with the forms
// that the bits of add (raisersCacheSet, preparedCacheSet,
// staleAtCacheSet, holdCacheSet) name, besides its own. Its decisions are
// cached as set r.cacheSet|add, whose bits are also what it writes.
func (r *Rules) sibling(p *atomic.Pointer[Rules], add uint32) *Rules {
	if s := p.Load(); s != nil {
		return s
	}
	cacheSet := r.cacheSet | add
	s := &Rules{
		tokenSetting: r.tokenSetting, lockSetting: r.lockSetting, auditTag: r.auditTag,
		tables: r.tables, locks: r.locks, byRel: r.byRel,
		needles: r.needles, pairs: r.pairs, short: r.short, schemas: r.schemas,
		cache: r.cache, cacheSet: cacheSet,
		listed: r.listed, audited: r.audited, scopes: r.scopes,
		nonASCII: r.nonASCII, anyLocks: r.anyLocks, maxCheck: r.maxCheck,
		raisers: cacheSet&raisersCacheSet != 0, prepared: cacheSet&preparedCacheSet != 0,
		staleAt: cacheSet&staleAtCacheSet != 0, hold: cacheSet&holdCacheSet != 0,
	}
	if !p.CompareAndSwap(nil, s) {
		return p.Load()
	}
	return s
}

// newSet builds a rule set fencing tables.
func newSet(setting, tag string, tables []*tableRule, cache *decisionCache, cacheSet uint32, scopes *scopeIndex) *Rules {
	r := &Rules{
		tokenSetting: setting,
		auditTag:     tag,
		tables:       tables,
		byRel:        make(map[string][]*tableRule),
		cache:        cache,
		cacheSet:     cacheSet,
		scopes:       scopes,
	}
	for _, t := range tables {
		r.byRel[t.rel] = append(r.byRel[t.rel], t)
		r.locks = r.locks || t.lock != lockOff
	}
	r.buildNeedles()
	return r
}

// TokenSetting is the normalised name of the token session variable.
func (r *Rules) TokenSetting() string { return r.tokenSetting }

// LockSetting is the normalised name of the lock-name session variable.
func (r *Rules) LockSetting() string { return r.lockSetting }

// AuditTag is Config.AuditTag, the "i" field of this rule set's audit
// notifications.
func (r *Rules) AuditTag() string { return r.auditTag }

// Tables lists, in display form and configuration order, every table that
// some entry of the configuration fences (mode enforce or audit) for some
// session: the table names that may appear in decisions, errors,
// notifications and metric labels. A set returned by ForSession returns the
// same list as its root.
func (r *Rules) Tables() []string { return slices.Clone(r.listed) }

// AuditTables lists, like Tables, every table that some entry puts in
// audit mode: the "t" field of a notification of mode "audit" names one of
// them (unless forged; see AuditEvent).
func (r *Rules) AuditTables() []string { return slices.Clone(r.audited) }

func (r *Rules) buildNeedles() {
	r.pairs = new([1024]uint64)
	for _, w := range []string{"alter", "drop", "owned", "cascade", "extension", "database"} {
		r.addPair(w)
	}
	seen := make(map[string]bool)
	add := func(n string) {
		if n == "" || seen[n] {
			return
		}
		seen[n] = true
		r.needles = append(r.needles, n)
		if len(n) == 1 {
			r.short = append(r.short, n)
		} else {
			r.addPair(n)
		}
	}
	seenSchema := make(map[string]bool)
	addSchema := func(n string) {
		if n == "" || seenSchema[n] {
			return
		}
		seenSchema[n] = true
		r.schemas = append(r.schemas, n)
	}
	for _, t := range r.tables {
		n, s := asciiLower(t.rel), asciiLower(t.schema)
		add(n)
		addSchema(s)
		// A name with a double quote can only be written as a quoted
		// identifier, where the quote is doubled.
		if strings.Contains(n, `"`) {
			add(strings.ReplaceAll(n, `"`, `""`))
		}
		if strings.Contains(s, `"`) {
			addSchema(strings.ReplaceAll(s, `"`, `""`))
		}
	}
}

// HasNonASCIINames reports whether a table name, schema name or fence
// column name that some entry of the configuration fences (mode enforce or
// audit, for some session) contains a byte >= 0x80. MayTouch and the
// parser read statements as UTF-8, so such a name can only be recognised
// in UTF-8 text: the proxy should refuse statements with non-ASCII bytes
// from clients using another encoding. A set returned by ForSession
// returns the same as its root.
func (r *Rules) HasNonASCIINames() bool { return r.nonASCII }

func hasNonASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return true
		}
	}
	return false
}

// MayTouch is the cheap conservative pre-check: it reports whether sql might
// refer to a protected table. False means the statement certainly does not
// (so Decide forwards it without parsing); true means it has to be parsed.
// It looks, ignoring ASCII case, for each protected relation name as a
// substring, for U& (a Unicode-escaped identifier can spell a name in
// disguise), and, in a statement that contains "alter" or "drop", for the
// schema names of the protected tables (ALTER SCHEMA ... RENAME, DROP
// SCHEMA), and for stored
// code whose strings may spell a name in disguise (mayHideName). It does
// not allocate.
func (r *Rules) MayTouch(sql string) bool {
	if len(r.tables) == 0 {
		return false
	}
	if strings.IndexByte(sql, '&') >= 0 && r.unicodeEscape(sql) {
		return true
	}
	// One pass over the text: each pair of bytes, ASCII-lowered, is looked
	// up in a bitmap of the pairs that start a needle (a relation name,
	// "alter", "drop", the words of reachWord); only those positions are
	// compared.
	alter := false
	var words reachWords
	if len(sql) > 0 {
		prev := uint32(lowerTab[sql[0]])
		for i := 1; i < len(sql); i++ {
			cur := uint32(lowerTab[sql[i]])
			bg := prev<<8 | cur
			prev = cur
			if r.pairs[bg>>6]&(1<<(bg&63)) == 0 {
				continue
			}
			at := sql[i-1:]
			for _, n := range r.needles {
				if len(n) > 1 && uint32(n[0])<<8|uint32(n[1]) == bg && hasPrefixFoldASCII(at, n) {
					return true
				}
			}
			if !alter && (hasPrefixFoldASCII(at, "alter") || hasPrefixFoldASCII(at, "drop")) {
				alter = true
			}
			if i < 2 || !sqllex.IsIdentCont(sql[i-2]) {
				if words |= reachWord(leadingWord(at)); words.reaches() {
					return true
				}
			}
		}
	}
	for _, n := range r.short {
		if indexFoldASCII(sql, n) >= 0 {
			return true
		}
	}
	if alter {
		for _, s := range r.schemas {
			if indexFoldASCII(sql, s) >= 0 {
				return true
			}
		}
	}
	// Statements that reach tables they do not name (DROP OWNED, REASSIGN
	// OWNED, extensions, CASCADE: ddl.go) are decided too.
	return mayHideName(sql)
}

// lowerTab maps each byte to its ASCII lower case.
var lowerTab = func() (t [256]byte) {
	for i := range t {
		t[i] = lowerASCII(byte(i))
	}
	return t
}()

// addPair marks the first two bytes of n (ASCII-lowered) in r.pairs.
func (r *Rules) addPair(n string) {
	bg := uint32(n[0])<<8 | uint32(n[1])
	r.pairs[bg>>6] |= 1 << (bg & 63)
}

// The ASCII folding helpers are sqllex's; these names are the ones the
// rewriter's files use. Needles are in lower case.

func indexFoldASCII(s, n string) int         { return sqllex.IndexFold(s, n) }
func containsWordFoldASCII(s, n string) bool { return sqllex.ContainsWordFold(s, n) }
func hasPrefixFoldASCII(s, n string) bool    { return sqllex.HasPrefixFold(s, n) }
func lowerASCII(c byte) byte                 { return sqllex.FoldByte(c) }

// mayHideName reports whether sql may be stored code (a DO block, a
// function or procedure) whose body spells a name the byte scan cannot
// see: it has a backslash (an escape string, E'con\x66ig') or a string
// continuation ('con' newline 'fig'), and "do", "function" or "procedure"
// as a word.
func mayHideName(sql string) bool {
	hides := strings.IndexByte(sql, '\\') >= 0
	for off := 0; !hides; {
		i := strings.IndexByte(sql[off:], '\'')
		if i < 0 {
			break
		}
		off += i + 1
		hides = continuesString(sql[off:])
	}
	return hides && (containsWordFoldASCII(sql, "do") || containsWordFoldASCII(sql, "function") || containsWordFoldASCII(sql, "procedure"))
}

// continuesString reports whether s starts with whitespace holding a
// newline (and possibly -- comments), then a quote: a string continuation
// if the quote before s closed a string.
func continuesString(s string) bool {
	newline := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '\n' || c == '\r':
			newline = true
		case c == ' ' || c == '\t' || c == '\f' || c == '\v':
		case c == '-' && i+1 < len(s) && s[i+1] == '-':
			for i < len(s) && s[i] != '\n' && s[i] != '\r' {
				i++
			}
			i--
		case c == '\'':
			return newline
		default:
			return false
		}
	}
	return false
}

// containsFoldASCII reports whether s contains the ASCII-lowered needle n,
// folding only ASCII letters of s.
func containsFoldASCII(s, n string) bool {
	for i := 0; i+len(n) <= len(s); i++ {
		if hasPrefixFoldASCII(s[i:], n) {
			return true
		}
	}
	return false
}

// mentioned lists the protected tables whose relation name appears in s
// (ignoring ASCII case); used to name the tables in a refusal when s cannot
// be parsed or is too large to be. s is searched in place, folding as it
// goes: a lowered copy would cost twice its size (issue 27, part 4).
func (r *Rules) mentioned(s string) []*tableRule {
	var out []*tableRule
	for _, t := range r.tables {
		n := asciiLower(t.rel)
		if indexFoldASCII(s, n) >= 0 || strings.Contains(n, `"`) && indexFoldASCII(s, strings.ReplaceAll(n, `"`, `""`)) >= 0 {
			out = append(out, t)
		}
	}
	return out
}

// Decide returns what the proxy must do with sql, a simple-query string (one
// or more statements) or the text of a Parse message. It is a pure function
// of sql and r: no I/O. It is safe for concurrent use.
//
// sql may alias memory the caller reuses once Decide returns: nothing
// returned or cached refers to it. A statement that may touch a protected
// table is copied before it is decided if it is to be cached or parsed
// (parts of a parsed text can reach the decision: Lock.Query may be the
// text itself); one over Config.MaxCheckBytes is decided in place, its
// decision made of its length and the protected tables' names only, so
// that deciding it costs no memory in proportion to its size.
func (r *Rules) Decide(sql string) Decision {
	if d, ok := r.decideCached(sql); ok {
		return d
	}
	cache := r.cache != nil && len(sql) <= maxCachedSQLLen
	if cache || !r.tooLarge(sql) {
		sql = strings.Clone(sql)
	}
	d := r.decide(sql)
	if cache {
		r.cache.put(r.cacheSet, sql, d)
	}
	return d
}

// decideCached is Decide when its answer costs no parse: the statement
// cannot touch a protected table, or its decision is cached. It reports
// false otherwise, leaving the work to Decide (DecideFor with
// Session.Quick).
func (r *Rules) decideCached(sql string) (Decision, bool) {
	if !r.MayTouch(sql) {
		return Decision{Action: Forward}, true
	}
	if r.cache != nil {
		if d, ok := r.cache.get(r.cacheSet, sql); ok {
			return d, true
		}
	}
	return Decision{}, false
}

func sortedUnique(s []string) []string {
	if len(s) < 2 {
		return s
	}
	sort.Strings(s)
	out := s[:1]
	for _, v := range s[1:] {
		if v != out[len(out)-1] {
			out = append(out, v)
		}
	}
	return out
}
