package proxy

// Lexical helpers of the fence settings: the cheap test before a parse,
// the statements that may write, and quoting values for SQL text.

import "strings"

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
		case isCSpace(c):
			i++
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-':
			for i < len(sql) && sql[i] != '\n' && sql[i] != '\r' {
				i++
			}
		case c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			depth := 0
			for i < len(sql) {
				if sql[i] == '/' && i+1 < len(sql) && sql[i+1] == '*' {
					depth++
					i += 2
				} else if sql[i] == '*' && i+1 < len(sql) && sql[i+1] == '/' {
					depth--
					i += 2
					if depth == 0 {
						break
					}
				} else {
					i++
				}
			}
		case c == ';':
			start = true
			i++
		case c == '\'':
			if escapes {
				i = skipEscaped(sql, i, lex.ClientEncoding, mb)
			} else {
				i = skipQuoted(sql, i, '\'')
			}
			start = false
		case c == '"':
			j := skipQuoted(sql, i, '"')
			if strings.EqualFold(sql[i:j], `"set_config"`) {
				return true
			}
			i, start = j, false
		case c == '$':
			j, ok := dollarQuoteEnd(sql, i)
			if !ok {
				i++ // a parameter ($1) or a lone dollar
			} else {
				i = j
			}
			start = false
		case isIdentStart(c):
			j := i
			for j < len(sql) && isIdentCont(sql[j]) {
				j++
			}
			w := sql[i:j]
			if (len(w) == 1 || len(w) == 2) && (w[0]|0x20 == 'u' || w[0]|0x20 == 'e' || w[0]|0x20 == 'b' || w[0]|0x20 == 'x' || w[0]|0x20 == 'n') && j < len(sql) && (sql[j] == '&' || sql[j] == '\'') {
				if sql[j] == '&' {
					if len(w) == 1 && w[0]|0x20 == 'u' && j+1 < len(sql) && sql[j+1] == '\'' {
						// U&'…': a string constant (its escapes are read
						// after the lexer, which ends it at a lone quote).
						i, start = skipQuoted(sql, j+1, '\''), false
						continue
					}
					return true // U&"…": an identifier the proxy does not decode here
				}
				// E'…', B'…', X'…', N'…': a string constant follows; an
				// E'' string has backslash escapes.
				if len(w) == 1 && w[0]|0x20 == 'e' {
					i, start = skipEscaped(sql, j, lex.ClientEncoding, mb), false
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

func statementWord(w string) bool {
	switch strings.ToLower(w) {
	case "set", "reset", "discard", "do", "prepare", "begin", "start", "commit", "end", "rollback", "abort", "savepoint", "release":
		return true
	}
	return false
}

func isIdentStart(c byte) bool {
	return c == '_' || c >= 0x80 || ('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z')
}

func isIdentCont(c byte) bool { return isIdentStart(c) || c == '$' || ('0' <= c && c <= '9') }

// skipQuoted returns the index after the quoted text at sql[i] (doubled
// quotes stay inside); an unterminated one runs to the end.
func skipQuoted(sql string, i int, q byte) int {
	for j := i + 1; j < len(sql); j++ {
		if sql[j] == q {
			if j+1 < len(sql) && sql[j+1] == q {
				j++
				continue
			}
			return j + 1
		}
	}
	return len(sql)
}

// dollarQuoteEnd reports whether a dollar-quoted string starts at sql[i]
// and returns the index after it.
func dollarQuoteEnd(sql string, i int) (int, bool) {
	if i > 0 && isIdentCont(sql[i-1]) {
		return 0, false // part of an identifier (a$b)
	}
	j := i + 1
	if j < len(sql) && isIdentStart(sql[j]) {
		for j < len(sql) && isIdentCont(sql[j]) && sql[j] != '$' {
			j++
		}
	}
	if j >= len(sql) || sql[j] != '$' {
		return 0, false
	}
	tag := sql[i : j+1]
	k := strings.Index(sql[j+1:], tag)
	if k < 0 {
		return len(sql), true
	}
	return j + 1 + k + len(tag), true
}

// quoteFenceValue quotes v as a string constant that reads the same in
// every session: a plain one when it has no quote or backslash, else a
// dollar-quoted one with a tag v does not contain.
func quoteFenceValue(v string) string {
	if !strings.ContainsAny(v, `'\`) {
		return "'" + v + "'"
	}
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
		case isCSpace(c) || c == '(':
			i++
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-':
			for i < len(sql) && sql[i] != '\n' {
				i++
			}
		case c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			depth := 0
			for i < len(sql) {
				if sql[i] == '/' && i+1 < len(sql) && sql[i+1] == '*' {
					depth++
					i += 2
				} else if sql[i] == '*' && i+1 < len(sql) && sql[i+1] == '/' {
					depth--
					i += 2
					if depth == 0 {
						break
					}
				} else {
					i++
				}
			}
		default:
			j := i
			for j < len(sql) && isIdentCont(sql[j]) {
				j++
			}
			switch strings.ToLower(sql[i:j]) {
			case "select", "with", "insert", "update", "delete", "merge", "values", "table", "execute", "copy":
				return true
			}
			return false
		}
	}
	return false
}

// skipEscaped returns the index after the string constant at sql[i] (a
// quote) whose backslashes escape the next byte.
func skipEscaped(sql string, i int, enc string, mb bool) int {
	for j := i + 1; j < len(sql); j++ {
		switch c := sql[j]; {
		case mb && c >= 0x80:
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
