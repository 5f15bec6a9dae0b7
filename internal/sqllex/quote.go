package sqllex

import "strings"

// QuoteIdent quotes an identifier for SQL, always, so that generated text
// does not depend on the server's list of keywords.
func QuoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// QuoteLiteral quotes s as an SQL string constant that reads the same
// whatever standard_conforming_strings is, as the server's quote_literal
// does: a value with a backslash becomes an E'...' string.
func QuoteLiteral(s string) string {
	q := "'" + strings.ReplaceAll(s, "'", "''") + "'"
	if strings.Contains(s, `\`) {
		q = "E" + strings.ReplaceAll(q, `\`, `\\`)
	}
	return q
}

// DisplayIdent quotes an identifier for display when it would not survive
// being read back unquoted: unquoted when it is lower-case ASCII letters,
// digits, _ and $ not starting with a digit or $, quoted otherwise.
// Keywords are not quoted (there is no keyword list here); the result is
// for messages, never for SQL.
func DisplayIdent(s string) string {
	plain := s != "" && (s[0] >= 'a' && s[0] <= 'z' || s[0] == '_')
	for i := 0; plain && i < len(s); i++ {
		c := s[i]
		plain = c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '$'
	}
	if plain {
		return s
	}
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}
