package proxy

// Lexical helpers of the fence settings: the cheap test before a parse,
// the statements that may write, and quoting values for SQL text.

import "strings"

// mayChangeFence is the cheap test before a parse: whether sql may hold a
// statement that changes a fence setting or controls a transaction. It
// scans as PostgreSQL's lexer does (comments nest, quoted identifiers,
// strings, dollar quotes) and answers true for a statement that begins
// with SET, RESET, DISCARD, DO, PREPARE or a transaction command, for the
// word set_config anywhere, and whenever it cannot be sure (a backslash,
// a Unicode-escaped identifier). False positives only cost a parse.
func mayChangeFence(sql string) bool {
	if strings.IndexByte(sql, '\\') >= 0 {
		// Escape strings, or strings with standard_conforming_strings
		// off: where a string ends depends on settings.
		return true
	}
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
			i = skipQuoted(sql, i, '\'')
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
					return true // U&"…" or U&'…': escapes the proxy does not decode here
				}
				// E'…', B'…', X'…', N'…': a string constant follows.
			}
			if strings.EqualFold(w, "set_config") {
				return true
			}
			if start && statementWord(w) {
				return true
			}
			i, start = j, false
		default:
			i++
			start = false
		}
	}
	return false
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
