package rules

import (
	"sort"
	"strconv"
	"strings"
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
	// (schema.table), sorted, without duplicates.
	Tables []string
}

// Rules is a compiled configuration. It is safe for concurrent use. A reload
// builds a new *Rules, which starts with an empty cache.
type Rules struct {
	tokenSetting string
	tables       []*tableRule
	byRel        map[string][]*tableRule
	// byFirst[c] lists the relation names (ASCII-lowered) whose first byte,
	// lowered, is c: the needles MayTouch looks for.
	byFirst [256][]string
	cache   *decisionCache
}

// TokenSetting is the normalised name of the token session variable.
func (r *Rules) TokenSetting() string { return r.tokenSetting }

// Tables lists the protected (mode: enforce) tables in display form.
func (r *Rules) Tables() []string {
	out := make([]string, len(r.tables))
	for i, t := range r.tables {
		out[i] = t.display
	}
	return out
}

func (r *Rules) buildNeedles() {
	seen := make(map[string]bool)
	add := func(n string) {
		if n == "" || seen[n] {
			return
		}
		seen[n] = true
		r.byFirst[n[0]] = append(r.byFirst[n[0]], n)
	}
	for _, t := range r.tables {
		n := asciiLower(t.rel)
		add(n)
		// A name with a double quote can only be written as a quoted
		// identifier, where the quote is doubled.
		if strings.Contains(n, `"`) {
			add(strings.ReplaceAll(n, `"`, `""`))
		}
	}
}

// MayTouch is the cheap conservative pre-check: it reports whether sql might
// refer to a protected table. False means the statement certainly does not
// (so Decide forwards it without parsing); true means it has to be parsed.
// It looks, ignoring ASCII case, for each protected relation name as a
// substring, and for U& (a Unicode-escaped identifier can spell a name in
// disguise). It does not allocate.
func (r *Rules) MayTouch(sql string) bool {
	if len(r.tables) == 0 {
		return false
	}
	for i := 0; i < len(sql); i++ {
		c := lowerASCII(sql[i])
		if c == '&' && i > 0 && lowerASCII(sql[i-1]) == 'u' {
			return true
		}
		for _, n := range r.byFirst[c] {
			if hasPrefixFoldASCII(sql[i:], n) {
				return true
			}
		}
	}
	return false
}

// mentioned lists the protected tables whose relation name appears in s
// (ignoring ASCII case); used to name the tables in a refusal when s cannot
// be parsed.
func (r *Rules) mentioned(s string) []string {
	var out []string
	ls := asciiLower(s)
	for _, t := range r.tables {
		n := asciiLower(t.rel)
		if strings.Contains(ls, n) || strings.Contains(ls, strings.ReplaceAll(n, `"`, `""`)) {
			out = append(out, t.display)
		}
	}
	return sortedUnique(out)
}

func lowerASCII(c byte) byte {
	if c >= 'A' && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

// hasPrefixFoldASCII reports whether s starts with the ASCII-lowered needle
// n, folding only ASCII letters of s.
func hasPrefixFoldASCII(s, n string) bool {
	if len(s) < len(n) {
		return false
	}
	for i := 0; i < len(n); i++ {
		if lowerASCII(s[i]) != n[i] {
			return false
		}
	}
	return true
}

// Decide returns what the proxy must do with sql, a simple-query string (one
// or more statements) or the text of a Parse message. It is a pure function
// of sql and r: no I/O. It is safe for concurrent use.
//
// The cache keeps sql as a key, so it must be an ordinary immutable Go
// string (not one aliasing a reused read buffer).
func (r *Rules) Decide(sql string) Decision {
	if !r.MayTouch(sql) {
		return Decision{Action: Forward}
	}
	if r.cache != nil {
		if d, ok := r.cache.get(sql); ok {
			return d
		}
	}
	d := r.decide(sql)
	if r.cache != nil {
		r.cache.put(sql, d)
	}
	return d
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
