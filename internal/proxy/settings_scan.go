package proxy

// Lexical helpers of the fence settings: the cheap test before a parse,
// the statements that may write, and quoting values for SQL text.

import (
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// mayChangeFence is the cheap test before a parse: whether sql may hold a
// statement that changes a fence setting or controls a transaction. It
// scans as PostgreSQL's lexer does (comments nest, quoted identifiers,
// strings with or without backslash escapes as the session's
// standard_conforming_strings says, E” strings, dollar quotes) and
// answers true for a statement that begins with SET, RESET, DISCARD, DO,
// PREPARE or a transaction command, for the word set_config anywhere, and
// whenever it cannot be sure (a Unicode-escaped identifier, a backslash
// in a client encoding whose characters may contain its byte). False
// positives only cost a parse.
func mayChangeFence(sql string, lex Lexing) bool {
	if lex.Uncertain && strings.IndexByte(sql, '\\') >= 0 {
		return true
	}
	escapes := !lex.StandardConformingStrings
	mb := backslashInCharacters(lex.ClientEncoding)
	start := true // at the start of a statement
	for i := 0; i < len(sql); {
		c := sql[i]
		switch {
		case sqllex.IsSpace(c):
			i++
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-':
			i = sqllex.SkipLineComment(sql, i)
		case c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			i = sqllex.SkipBlockComment(sql, i)
		case c == ';':
			start = true
			i++
		case c == '\'':
			i, start = skipString(sql, i, escapes, lex.ClientEncoding, mb), false
		case c == '"':
			j := sqllex.SkipQuoted(sql, i+1, '"', false)
			if strings.EqualFold(sql[i:j], `"set_config"`) {
				return true
			}
			i, start = j, false
		case c == '$':
			i, start = sqllex.SkipDollar(sql, i), false
		case sqllex.IsIdentStart(c):
			j := i
			for j < len(sql) && sqllex.IsIdentCont(sql[j]) {
				j++
			}
			w := sql[i:j]
			if (len(w) == 1 || len(w) == 2) && (w[0]|0x20 == 'u' || w[0]|0x20 == 'e' || w[0]|0x20 == 'b' || w[0]|0x20 == 'x' || w[0]|0x20 == 'n') && j < len(sql) && (sql[j] == '&' || sql[j] == '\'') {
				if sql[j] == '&' {
					if len(w) == 1 && w[0]|0x20 == 'u' && j+1 < len(sql) && sql[j+1] == '\'' {
						// U&'…': a string constant (its escapes are read
						// after the lexer, which ends it at a lone quote).
						i, start = sqllex.SkipQuoted(sql, j+2, '\'', false), false
						continue
					}
					return true // U&"…": an identifier the proxy does not decode here
				}
				// E'…', B'…', X'…', N'…': a string constant follows; an
				// E'' string has backslash escapes.
				if len(w) == 1 && w[0]|0x20 == 'e' {
					i, start = skipString(sql, j, true, lex.ClientEncoding, mb), false
					continue
				}
			}
			if strings.EqualFold(w, "set_config") {
				return true
			}
			if start && statementWord(w) {
				return true
			}
			i, start = j, false
		default:
			if mb && c >= 0x80 {
				i += charLen(lex.ClientEncoding, sql, i)
			} else {
				i++
			}
			start = false
		}
	}
	return false
}

// charLen is the length of the character at sql[i] (a byte >= 0x80) in a
// client encoding whose characters may contain ASCII bytes, as
// PostgreSQL's pg_encoding_mblen reads them.
func charLen(enc string, sql string, i int) int {
	c := sql[i]
	n := 2
	switch strings.ToUpper(enc) {
	case "SJIS", "SHIFT_JIS_2004":
		if !(c >= 0x81 && c <= 0x9f || c >= 0xe0 && c <= 0xfc) {
			n = 1 // single-byte katakana
		}
	case "GB18030":
		if i+1 < len(sql) && sql[i+1] >= 0x30 && sql[i+1] <= 0x39 {
			n = 4
		}
	}
	return min(n, len(sql)-i)
}

// statementWords begin the statements that change the settings or
// control a transaction.
var statementWords = []string{"set", "reset", "discard", "do", "prepare", "begin", "start", "commit", "end", "rollback", "abort", "savepoint", "release"}

// writeWords begin the statements that may write through code the proxy
// does not see (mayWrite).
var writeWords = []string{"select", "with", "insert", "update", "delete", "merge", "values", "table", "execute", "copy"}

// isWord reports whether w is one of words, ASCII case ignored, without
// allocating (this runs for every statement).
func isWord(w string, words []string) bool {
	for _, x := range words {
		if strings.EqualFold(w, x) {
			return true
		}
	}
	return false
}

func statementWord(w string) bool { return isWord(w, statementWords) }

// quoteFenceValue quotes v as a string constant that reads the same in
// every session: a plain one when it has no quote or backslash, else a
// dollar-quoted one with a tag v does not contain.
func quoteFenceValue(v string) string {
	if !strings.ContainsAny(v, `'\`) {
		return "'" + v + "'"
	}
	return dollarQuote(v)
}

// writeFenceValue writes quoteFenceValue(v) to b.
func writeFenceValue(b *strings.Builder, v string) {
	if strings.ContainsAny(v, `'\`) {
		b.WriteString(dollarQuote(v))
		return
	}
	b.WriteByte('\'')
	b.WriteString(v)
	b.WriteByte('\'')
}

// dollarQuote returns v between dollar quotes whose tag v does not hold.
func dollarQuote(v string) string {
	for n := 0; ; n++ {
		tag := "$fp" + strings.Repeat("x", n) + "$"
		// The first occurrence of the tag after the opening one must be
		// the closing one.
		if strings.Index(v+tag, tag) == len(v) {
			return tag + v + tag
		}
	}
}

// mayWrite reports whether a text's first statement may write through
// code the proxy does not see (a function in a query, a trigger): it
// starts with SELECT, WITH, INSERT, UPDATE, DELETE, MERGE, VALUES, TABLE,
// EXECUTE or COPY. CALL and DO are left out: a procedure or DO block may
// commit, which it cannot inside the transaction the settings open.
func mayWrite(sql string) bool {
	i := 0
	for i < len(sql) {
		switch c := sql[i]; {
		case sqllex.IsSpace(c) || c == '(':
			i++
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-':
			i = sqllex.SkipLineComment(sql, i)
		case c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			i = sqllex.SkipBlockComment(sql, i)
		default:
			j := i
			for j < len(sql) && sqllex.IsIdentCont(sql[j]) {
				j++
			}
			return isWord(sql[i:j], writeWords)
		}
	}
	return false
}

// skipString returns the index after the string constant at sql[i] (a
// quote); with escapes its backslashes escape the next byte, read by
// characters in a client encoding whose characters may contain a
// backslash byte (mb).
func skipString(sql string, i int, escapes bool, enc string, mb bool) int {
	if !escapes || !mb {
		return sqllex.SkipQuoted(sql, i+1, '\'', escapes)
	}
	for j := i + 1; j < len(sql); j++ {
		switch c := sql[j]; {
		case c >= 0x80:
			j += charLen(enc, sql, j) - 1
		case c == '\\':
			j++
		case c == '\'':
			if j+1 < len(sql) && sql[j+1] == '\'' {
				j++
				continue
			}
			return j + 1
		}
	}
	return len(sql)
}

// backslashInCharacters reports whether a client encoding has multibyte
// characters whose later bytes may be a backslash (PostgreSQL's
// client-only encodings): there the scan cannot tell an escape from a
// character.
func backslashInCharacters(enc string) bool {
	switch strings.ToUpper(enc) {
	case "SJIS", "SHIFT_JIS_2004", "BIG5", "GBK", "UHC", "GB18030", "JOHAB":
		return true
	}
	return false
}
