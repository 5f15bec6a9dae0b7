// Package sqllex holds the byte-level pieces of PostgreSQL's lexer
// (scan.l) that the relay, the policy and the rewriter use to look at SQL
// text without parsing it: identifier bytes, white space, quoted strings
// and identifiers, nested comments, dollar quotes. Each function takes
// the text and an index and returns the index after the token; none
// allocates.
//
// It also has the one copy of the small helpers around them: ASCII case
// folding as the lexer folds unquoted identifiers (fold.go), and quoting
// of identifiers and string constants for SQL and of identifiers for
// messages (quote.go).
package sqllex

import (
	"slices"
	"strings"
)

// IsSpace reports whether c is white space to PostgreSQL's lexer (space,
// tab, newline, carriage return, form feed, vertical tab).
func IsSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}

// IsIdentStart reports whether c may start an unquoted identifier
// (letters, underscore, and every byte of a multibyte character).
func IsIdentStart(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '_' || c >= 0x80
}

// IsIdentCont reports whether c may continue an unquoted identifier.
func IsIdentCont(c byte) bool {
	return IsIdentStart(c) || c >= '0' && c <= '9' || c == '$'
}

// SkipQuoted returns the index after the string or quoted identifier whose
// body starts at i, ending at quote; a doubled quote stands for one. With
// backslash, a backslash escapes the next byte (E'…'). An unterminated
// string runs to the end (the parser rejects it).
func SkipQuoted(sql string, i int, quote byte, backslash bool) int {
	for i < len(sql) {
		switch sql[i] {
		case quote:
			if i+1 < len(sql) && sql[i+1] == quote {
				i += 2
				continue
			}
			return i + 1
		case '\\':
			if backslash {
				i++
			}
		}
		i++
	}
	return len(sql)
}

// SkipBlockComment returns the index after the (nested) comment starting
// at i.
func SkipBlockComment(sql string, i int) int {
	depth := 0
	for i < len(sql) {
		switch {
		case sql[i] == '/' && i+1 < len(sql) && sql[i+1] == '*':
			depth++
			i += 2
		case sql[i] == '*' && i+1 < len(sql) && sql[i+1] == '/':
			depth--
			i += 2
			if depth == 0 {
				return i
			}
		default:
			i++
		}
	}
	return len(sql)
}

// SkipLineComment returns the index of the end of the line the comment
// starting at i ends with.
func SkipLineComment(sql string, i int) int {
	for i < len(sql) && sql[i] != '\n' && sql[i] != '\r' {
		i++
	}
	return i
}

// SkipDollar returns the index after the parameter ($1) or dollar-quoted
// string ($tag$…$tag$) starting at i, or after a lone $. (A $ inside an
// identifier is the identifier's: callers scan identifiers first.)
func SkipDollar(sql string, i int) int {
	j := i + 1
	if j < len(sql) && sql[j] >= '0' && sql[j] <= '9' {
		for j < len(sql) && IsIdentCont(sql[j]) {
			j++
		}
		return j
	}
	if j < len(sql) && IsIdentStart(sql[j]) {
		for j < len(sql) && IsIdentCont(sql[j]) && sql[j] != '$' {
			j++
		}
	}
	if j >= len(sql) || sql[j] != '$' {
		return i + 1
	}
	delim := sql[i : j+1]
	end := strings.Index(sql[j+1:], delim)
	if end < 0 {
		return len(sql)
	}
	return j + 1 + end + len(delim)
}

// MaxIdentBytes is the longest identifier PostgreSQL keeps (NAMEDATALEN
// - 1); a longer one is truncated to it at a character's boundary.
const MaxIdentBytes = 63

// IsWordByte reports whether c continues a word of Words: an identifier
// byte other than '$', which continues an unquoted identifier but also
// closes a dollar-quoted body ($$SELECT * FROM v$$).
func IsWordByte(c byte) bool { return c != '$' && IsIdentCont(c) }

// IsWord reports whether s is one word of Words: not empty, and made of
// word bytes only.
func IsWord(s string) bool {
	for i := 0; i < len(s); i++ {
		if !IsWordByte(s[i]) {
			return false
		}
	}
	return s != ""
}

// Words calls fn with each word of s that may name a relation or a
// function: each maximal run of word bytes (an unquoted identifier, a
// quoted one's body, a name in a function's body) of at most
// MaxIdentBytes, and, for a longer one, its first MaxIdentBytes down to
// MaxIdentBytes-3 bytes (what the server may truncate it to). It stops
// at the first call that returns true, and reports whether one did.
func Words(s string, fn func(w string) bool) bool {
	for i := 0; i < len(s); {
		if !IsWordByte(s[i]) {
			i++
			continue
		}
		j := i + 1
		for j < len(s) && IsWordByte(s[j]) {
			j++
		}
		w := s[i:j]
		i = j
		if len(w) <= MaxIdentBytes {
			if fn(w) {
				return true
			}
			continue
		}
		for k := MaxIdentBytes; k >= MaxIdentBytes-3; k-- {
			if fn(w[:k]) {
				return true
			}
		}
	}
	return false
}

// MayName reports whether text may spell one of words (each
// ASCII-lowered): it holds one as a word of Words (case ignored, Unicode
// folding included, which only finds more),
// a Unicode escape (U&" or U&'), which may spell any name, or a
// backslash, which an escape string or a string read with
// standard_conforming_strings off may turn into any character. It reads
// text as bytes, not as SQL: a word in a comment or a string counts.
func MayName(text string, words []string) bool {
	if strings.IndexByte(text, '\\') >= 0 || HasUnicodeEscape(text) {
		return true
	}
	first, lens, all := firstBytes(words)
	return Words(text, func(w string) bool {
		// An ASCII word cannot be one of another length, or whose first
		// byte none begins with (case ignored). A word with a multi-byte
		// character may fold to ASCII letters (the Kelvin sign to k, the
		// long s to s), whatever its length: those are compared.
		if !all && (!first[w[0]] || len(w) >= 64 || lens&(1<<len(w)) == 0) && isASCII(w) {
			return false
		}
		for _, x := range words {
			if strings.EqualFold(w, x) {
				return true
			}
		}
		return false
	})
}

// firstBytes returns the first bytes of words in both ASCII cases and
// their lengths (bit n for n bytes), for MayName to pass over ASCII words
// that begin with none of those bytes or have none of those lengths; all
// when a word holds a multi-byte character, which ASCII letters may fold
// to, or is too long for the mask: then nothing is passed over.
func firstBytes(words []string) (first [256]bool, lens uint64, all bool) {
	for _, x := range words {
		if x == "" {
			continue
		}
		if len(x) >= 64 || !isASCII(x) {
			return first, 0, true
		}
		lens |= 1 << len(x)
		c := x[0]
		first[c] = true
		switch {
		case 'a' <= c && c <= 'z':
			first[c-'a'+'A'] = true
		case 'A' <= c && c <= 'Z':
			first[c-'A'+'a'] = true
		}
	}
	return first, lens, false
}

// isASCII reports whether s holds no byte of a multi-byte character.
func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}

// HasUnicodeEscape reports whether s holds U&" or U&' (ASCII case
// ignored): a Unicode-escaped identifier or string, which may spell any
// name.
func HasUnicodeEscape(s string) bool {
	for i := strings.IndexByte(s, '&'); i >= 0; {
		if i > 0 && (s[i-1] == 'u' || s[i-1] == 'U') && i+1 < len(s) && (s[i+1] == '"' || s[i+1] == '\'') {
			return true
		}
		j := strings.IndexByte(s[i+1:], '&')
		if j < 0 {
			break
		}
		i += 1 + j
	}
	return false
}

// SettingParts returns the first parts (before the first dot) of the
// names of settings, ASCII-lowered, each once: the word any spelling of
// a custom setting's name in SQL holds ("fence" for fence.token), unless
// it computes the name or escapes it (MayName).
func SettingParts(names ...string) []string {
	var out []string
	for _, n := range names {
		first, _, _ := strings.Cut(Fold(n), ".")
		if first != "" && !slices.Contains(out, first) {
			out = append(out, first)
		}
	}
	return out
}
