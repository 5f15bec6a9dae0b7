package rules

// Session is what DecideFor needs to know of the session a text comes
// from, beyond the text itself: who it is (which entries' scopes match),
// how the server will tokenize the text, and what the database and the
// message allow the rewrite to be.
type Session struct {
	// Database, User and ApplicationName are as sent in the startup
	// packet (PostgreSQL takes the user name as the database name when the
	// packet has none; pass the name it uses). See ForSession.
	Database, User, ApplicationName string
	// Lexing is how the server will read the text.
	Lexing Lexing
	// Raisers: the database has the error raisers fenceproxy setup
	// installs, current, so rewrites call them (ServerFunctions).
	Raisers bool
	// StaleAt: it has those of the token form too, fenceproxy.stale_at
	// and stale_at_b (StaleAt): with Raisers, the token form calls them.
	StaleAt bool
	// Hold: it has the cheaper lock registration of objects version 6:
	// registrations call it (Hold).
	Hold bool
	// Readers: the database's relations and functions whose reads reach
	// a protected table without naming it (views over it, its parents
	// and children, functions whose body names it...: Reader): a
	// statement that names one registers the session's lock for the
	// tables it reaches, as one that names them does. nil: none.
	Readers *Readers
	// Quick: answer only what costs no parse of the rule set's decision
	// (it is forwarded unlooked at, cached, or refused before it); report
	// false instead of deciding.
	Quick bool
}

// Lexing is how the server will tokenize a text (pg_query always reads it
// as UTF-8 with standard_conforming_strings on) and how it will use it.
// The relay fills it from what the server last reported for the session.
type Lexing struct {
	// StandardConformingStrings: with it off, a backslash escapes in
	// ordinary '...' literals, so the same text holds different tokens.
	StandardConformingStrings bool
	// ClientEncoding is the session's client_encoding: in encodings such
	// as SJIS or GBK a byte >= 0x80 may be followed by an ASCII byte (even
	// a backslash) that belongs to the same character.
	ClientEncoding string
	// Uncertain: earlier extended-protocol messages, not yet synced, may
	// change either setting before the text is parsed.
	Uncertain bool
	// Backslash and NonASCII say whether the text has a backslash or a
	// byte >= 0x80: only those can be read differently by the settings
	// above.
	Backslash, NonASCII bool
	// Prepared: the text is a named prepared statement's (a Parse with a
	// name), analysed once and executed many times, so the decision may
	// choose a rewrite that costs more to analyse and less to execute
	// (Prepared). It does not change what is fenced.
	Prepared bool
	// TokenParam: the relay would bind the session's token as the
	// statement's last parameter (TokenForm.ParamText), so the decision
	// is taken in the set whose token forms have a parameter form: the
	// ServerFunctions set without StaleAt (the stale-row error reads the
	// setting the relay applies before the Bind), not Prepared (the
	// token form has none of the checks Prepared writes differently).
	TokenParam bool
}

// DecideFor returns the decision on sql, a simple-query string or the text
// of a Parse message, for session s. It is what a proxy calls for each
// text, in place of ForSession, ServerFunctions, Prepared and Decide:
//
//  1. It picks the rule set of the session (ForSession).
//  2. In a session that set does not fence, it refuses a DROP DATABASE of
//     a database in which the configuration protects tables: such a
//     session may still drop another database that holds them.
//  3. It refuses a text the server may tokenize differently from pg_query
//     (see lexingRefusal).
//  4. It decides with the set's ServerFunctions sibling when s.Raisers,
//     its Prepared sibling when s.Lexing.Prepared, its Hold sibling when
//     s.Hold, and from the decision cache
//     only when s.Quick.
//  5. Where the text may name one of s.Readers and the set has lock
//     fencing, it adds the registrations of the reads through them to
//     the decision (refusing, as in step 3, a text the server may
//     tokenize differently).
//
// final is set on the refusals of steps 2 and 3, made before the rule set
// decides: nothing the caller knows of the database (migrations, say) may
// lift them. ok is false only when s.Quick and the decision needs a
// parse. r may be the root set or any set derived from it; the result is
// the same. Like Decide, it is a pure function of its arguments and r, and
// does not allocate for a text it forwards unlooked at or finds in the
// cache.
func (r *Rules) DecideFor(s Session, sql string) (d Decision, final, ok bool) {
	rs := r.ForSession(s.Database, s.User, s.ApplicationName)
	if !rs.fences() {
		if e := r.dropDatabaseRefusal(sql); e != nil {
			return Decision{Action: Refuse, Err: e}, true, true
		}
	}
	if e := rs.lexingRefusal(s.Lexing, sql); e != nil {
		return Decision{Action: Refuse, Err: e}, true, true
	}
	readers := s.Readers
	if !readers.applies(rs, s.Lexing, sql) {
		readers = nil
	} else if e := readers.lexingRefusal(s.Lexing); e != nil {
		return Decision{Action: Refuse, Err: e}, true, true
	}
	if s.Raisers {
		rs = rs.ServerFunctions()
		if s.StaleAt && !s.Lexing.TokenParam {
			rs = rs.StaleAt()
		}
	}
	if s.Lexing.Prepared && !s.Lexing.TokenParam {
		rs = rs.Prepared()
	}
	if s.Hold {
		rs = rs.Hold()
	}
	if s.Quick {
		if d, ok = rs.decideCached(sql); ok && readers != nil {
			d, ok = readers.cached(rs, sql)
		}
		return d, false, ok
	}
	d = rs.Decide(sql)
	if readers != nil {
		d = readers.decide(rs, sql, d)
	}
	return d, false, true
}

// lexingRefusal fails closed when the server may tokenize sql differently
// from pg_query, which always reads it as UTF-8 with
// standard_conforming_strings on. Only backslashes and bytes >= 0x80 can be
// read differently, and only texts that may touch a protected table
// matter, or, where a protected name has a byte >= 0x80 (which MayTouch can
// only find in UTF-8 text), any text with such bytes in another encoding.
func (r *Rules) lexingRefusal(lex Lexing, sql string) *Error {
	backslash, high := lex.Backslash, lex.NonASCII // scanned once by the relay
	if !backslash && !high {
		return nil
	}
	utf8 := lex.ClientEncoding == "UTF8"
	if !r.MayTouch(sql) && !(high && !utf8 && r.nonASCII) {
		return nil
	}
	return lexingProblem(lex, "this statement on a protected table", "statements on protected tables")
}

// lexingProblem is the refusal of a text with backslashes or non-ASCII
// bytes (lex) that the server may read otherwise than pg_query, nil if it
// reads it alike; this and these name what is refused, in the singular
// and the plural.
func lexingProblem(lex Lexing, this, these string) *Error {
	switch {
	case lex.Uncertain:
		return lexingError("cannot tell how the server will read "+this+": earlier messages of the pipeline, not yet synced, may change standard_conforming_strings or client_encoding",
			"Send a Sync before this statement, or avoid backslashes and non-ASCII bytes in its text (use parameters).")
	case lex.Backslash && !lex.StandardConformingStrings:
		return lexingError(these+" with backslashes need standard_conforming_strings = on",
			"SET standard_conforming_strings = on (PostgreSQL's default), or pass the value as a parameter.")
	case lex.NonASCII && lex.ClientEncoding != "UTF8":
		return lexingError(these+" with non-ASCII bytes need client_encoding UTF8, got "+lex.ClientEncoding,
			"SET client_encoding = 'UTF8', or pass the value as a parameter.")
	}
	return nil
}

func lexingError(why, hint string) *Error {
	return &Error{Code: CodeRefused, Message: "fenceproxy: " + why, Hint: hint}
}
