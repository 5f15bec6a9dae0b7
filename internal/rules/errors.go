package rules

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

// SQLSTATEs returned by fenceproxy. Class "FP" is not used by PostgreSQL, so
// clients can tell fenceproxy's refusals from the server's own errors. The
// meaning of each code is documented in doc.go.
const (
	// CodeStaleToken: the write carried a fencing token older than the row's
	// stored watermark (on_stale: error).
	CodeStaleToken = "FP001"
	// CodeMissingToken: a write to a protected table ran without a valid
	// token (missing_token: reject).
	CodeMissingToken = "FP002"
	// CodeRefused: fenceproxy refused to forward the statement because it
	// writes (or may write) a protected table in a way it cannot fence.
	CodeRefused = "FP003"
)

// MaxToken is the largest valid fencing token, 2^63-1 (the bigint range).
const MaxToken = "9223372036854775807"

// Error is an error fenceproxy reports to the client as an ErrorResponse.
// Code is a SQLSTATE; Message, Detail and Hint map to the ErrorResponse
// fields of the same names (Detail and Hint may be empty).
type Error struct {
	Code    string
	Message string
	Detail  string
	Hint    string
	// Table names the protected table concerned, in display form
	// (schema.table), when there is one; for metrics labels. It is not part
	// of the ErrorResponse.
	Table string
}

// Error returns the message and the SQLSTATE, in the style of
// pgconn.PgError.
func (e *Error) Error() string {
	return e.Message + " (SQLSTATE " + e.Code + ")"
}

// markerPrefix starts every error marker the rewritten SQL can raise. The
// rewritten statement raises an error by casting a text that starts with it
// to bigint or boolean, which fails with SQLSTATE 22P02 and a message that
// quotes the text, e.g. (lc_messages=en)
//
//	invalid input syntax for type bigint: "fenceproxy:stale:41:42:13:public.config"
//
// Marker grammar (numbers in decimal; <n>:<bytes> is a length-prefixed
// field, so names may contain any character):
//
//	fenceproxy:stale:<token>:<watermark>:<n>:<table>       (watermark empty when NULL)
//	fenceproxy:token:<n>:<table>:<n>:<setting>:<value>
//	fenceproxy:stale_at:<watermark>                         (the token form's; see ExpandStaleAt)
//
// where <token> is the token setting's text and <value> the setting's value
// as an SQL literal ('abc', E'a\\b') or NULL when it is not set
// (quote_nullable); the proxy echoes at most 32 characters of it.
// Only the marker is parsed, never the words around it, so a translated
// message (lc_messages) is recognised as well.
const markerPrefix = "fenceproxy:"

const (
	markerStale   = "stale"
	markerStaleAt = "stale_at"
	markerToken   = "token"
	// tokenEchoLen bounds how much of an invalid token is carried back into
	// the error, so a huge or binary value cannot flood the client's error.
	tokenEchoLen = 32
)

// TranslateError recognises an upstream ErrorResponse raised by a rewritten
// statement (SQLSTATE 22P02 carrying a fenceproxy marker) and returns the
// fenceproxy error the client should see instead. For every other error it
// returns (nil, false); that path is a string comparison and an index scan,
// cheap enough to run on every upstream error.
//
// The error raisers (Rules.ServerFunctions) raise FP001 and FP002 with the
// marker as their message: those are recognised too.
func TranslateError(code, message string) (*Error, bool) {
	if code != "22P02" && code != CodeStaleToken && code != CodeMissingToken {
		return nil, false
	}
	i := strings.Index(message, markerPrefix)
	if i < 0 {
		return nil, false
	}
	m := message[i+len(markerPrefix):]
	switch {
	case strings.HasPrefix(m, markerStale+":"):
		return translateStale(m[len(markerStale)+1:]), true
	case code == CodeStaleToken && strings.HasPrefix(m, markerStaleAt+":"):
		// Not expanded (ExpandStaleAt): the token and the table are
		// unknown here.
		return translateStale(""), true
	case strings.HasPrefix(m, markerToken+":"):
		return translateToken(m[len(markerToken)+1:]), true
	}
	return nil, false
}

// ExpandStaleAt returns message, an FP001 error's message, with the
// marker fenceproxy.stale_at raises (fenceproxy:stale_at:<watermark>)
// made the full stale marker for token and table: the token form of a
// StaleAt set raises it, and only the relay that sent the form knows which
// token it filled in and which table the form is for
// (TokenForm.StaleTable). It returns false, and message, when message
// holds no such marker or token is not a canonical token.
func ExpandStaleAt(message, token, table string) (string, bool) {
	const at = markerPrefix + markerStaleAt + ":"
	i := strings.Index(message, at)
	if i < 0 || table == "" {
		return message, false
	}
	if c, ok := CanonicalToken(token); !ok || c != token {
		return message, false
	}
	rest := message[i+len(at):]
	j := 0
	if j < len(rest) && rest[j] == '-' {
		j++
	}
	for j < len(rest) && rest[j] >= '0' && rest[j] <= '9' {
		j++
	}
	return message[:i] + markerPrefix + markerStale + ":" + token + ":" + rest[:j] + ":" + sized(table) + rest[j:], true
}

// WithStaleToken returns message, an FP001 error's message, with token
// in place of the token its stale marker (fenceproxy:stale:<token>:...)
// carries: the marker of fenceproxy.stale, which reads the token setting,
// raised where the setting may not hold the token the statement was run
// with. The token ends at the first ':' where what follows is a
// watermark and a sized table that end the message (a valid token, an
// empty or unset setting: the first ':'). Where none does, the setting's
// text held a ':', and the last ':' after which they do is taken (a
// table's name may hold what reads as such an end too; a setting and a
// name both built to mislead may misplace the split, in the message
// only). It returns false, and message, when there is no such marker or
// token is not a canonical token.
func WithStaleToken(message, token string) (string, bool) {
	const at = markerPrefix + markerStale + ":"
	i := strings.Index(message, at)
	if i < 0 {
		return message, false
	}
	if c, ok := CanonicalToken(token); !ok || c != token {
		return message, false
	}
	rest := message[i+len(at):]
	if j := strings.IndexByte(rest, ':'); j >= 0 && staleTail(rest[j+1:]) {
		return message[:i] + at + token + rest[j:], true
	}
	for j := len(rest) - 1; j >= 0; j-- {
		if rest[j] == ':' && staleTail(rest[j+1:]) {
			return message[:i] + at + token + rest[j:], true
		}
	}
	return message, false
}

// staleTail reports whether m is "<watermark>:<n>:<table>" and nothing
// more: the end of a stale marker after its token.
func staleTail(m string) bool {
	w, m, ok := cutField(m)
	if !ok || w != "" && !isDigits(strings.TrimPrefix(w, "-")) {
		return false
	}
	_, rest, ok := cutSized(m)
	return ok && rest == "" && !strings.HasSuffix(m, ":")
}

func translateStale(m string) *Error {
	e := &Error{
		Code:   CodeStaleToken,
		Detail: "A newer lock holder has written this row; the write was rejected so that its data is not overwritten.",
		Hint:   "Acquire the lock again to get a new fencing token, read the row again, then retry the write.",
	}
	token, m, ok1 := cutField(m)
	fence, m, ok2 := cutField(m)
	table, _, ok3 := cutSized(m)
	if !ok1 || !ok2 || !ok3 || !isDigits(token) {
		// The message was mangled (e.g. a client_encoding conversion changed
		// a length): still report a stale token, without the details.
		e.Message = "fenceproxy: stale fencing token"
		return e
	}
	if fence == "" {
		fence = "NULL"
	}
	// The token is the setting's text, valid (digits) but maybe zero-padded.
	if t := strings.TrimLeft(token, "0"); t != "" {
		token = t
	}
	e.Message = "fenceproxy: stale fencing token " + token + " for table " + table + " (stored watermark " + fence + ")"
	e.Table = table
	return e
}

func translateToken(m string) *Error {
	e := &Error{
		Code: CodeMissingToken,
	}
	table, m, ok1 := cutSized(m)
	setting, m, ok2 := cutSized(m)
	if !ok1 || !ok2 {
		e.Message = "fenceproxy: write to a protected table needs a valid fencing token (a decimal integer 1.." + MaxToken + ")"
		return e
	}
	e.Message = "fenceproxy: write to protected table " + table + " needs a valid " + setting + " (a decimal integer 1.." + MaxToken + ")"
	e.Table = table
	e.Hint = "Set it after acquiring the lock, e.g. SET " + setting + " = '42' (or SET LOCAL inside the transaction)."
	switch value, ok := unquoteLiteral(m); {
	case strings.HasPrefix(m, "NULL"):
		e.Detail = setting + " is not set."
	case ok && value == "":
		// Through the proxy an unset token reaches the server as '' (the
		// session's values are applied with SET LOCAL, which cannot unset).
		e.Detail = setting + " is not set (or empty)."
	case ok && utf8.RuneCountInString(value) >= tokenEchoLen:
		e.Detail = setting + " starts with " + strconv.Quote(firstRunes(value, tokenEchoLen)) + "."
	case ok:
		e.Detail = setting + " is " + strconv.Quote(value) + "."
	}
	return e
}

// unquoteLiteral reads the SQL string literal at the start of m, as
// quote_literal writes it: '...' with quotes doubled, or E'...' with
// backslashes doubled as well.
func unquoteLiteral(m string) (string, bool) {
	escaped := strings.HasPrefix(m, "E'")
	if escaped {
		m = m[1:]
	}
	if !strings.HasPrefix(m, "'") {
		return "", false
	}
	var b strings.Builder
	for i := 1; i < len(m); i++ {
		switch c := m[i]; {
		case c == '\'' && i+1 < len(m) && m[i+1] == '\'':
			b.WriteByte('\'')
			i++
		case c == '\'':
			return b.String(), true
		case c == '\\' && escaped && i+1 < len(m):
			b.WriteByte(m[i+1])
			i++
		default:
			b.WriteByte(c)
		}
	}
	return "", false
}

// cutField returns the text up to the next ':' and the rest after it.
func cutField(m string) (field, rest string, ok bool) {
	field, rest, ok = strings.Cut(m, ":")
	return field, rest, ok
}

// cutSized parses "<n>:<n bytes>" and an optional ':' after it.
func cutSized(m string) (field, rest string, ok bool) {
	ns, rest, ok := strings.Cut(m, ":")
	if !ok || !isDigits(ns) || len(ns) > 6 {
		return "", m, false
	}
	n, err := strconv.Atoi(ns)
	if err != nil || n > len(rest) {
		return "", m, false
	}
	field, rest = rest[:n], rest[n:]
	rest = strings.TrimPrefix(rest, ":")
	return field, rest, true
}

func isDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// firstRunes returns the first n runes of s.
func firstRunes(s string, n int) string {
	for i := range s {
		if n == 0 {
			return s[:i]
		}
		n--
	}
	return s
}
