// Package rules is fenceproxy's SQL rewriter: a pure function from (SQL text,
// compiled rules) to a Decision — forward the client's bytes unchanged,
// forward rewritten SQL, or refuse with a PostgreSQL-style error. It does no
// I/O and is safe for concurrent use.
//
// Every write to a protected table is rewritten into an atomic
// high-watermark form: the statement itself checks the row's fence column
// against the session's fencing token and stamps the token, in the same step
// as the write. The token is read on the server, at execution time, with
// current_setting; the client's token text is never spliced into SQL.
//
// Decide first runs MayTouch, a cheap allocation-free scan for the protected
// relation names; a statement it clears is forwarded unparsed. Otherwise the
// statement is bounded in size and nesting depth (refused beyond them),
// parsed with PostgreSQL's own parser (pg_query), walked over every node
// (writable CTEs, PREPARE, EXPLAIN, every statement of a multi-statement
// string), and each protected write is rewritten on the tree. The rewrite
// is then spliced into the client's own text as fragments at token
// boundaries — the client's bytes are never re-printed — and the result is
// parsed again and compared with the rewritten tree before it is returned
// (splice.go). Statements that name a protected table and cannot be parsed,
// fenced or spliced are refused: the package fails closed.
//
// Each table entry has a mode (enforce, audit, off) and may carry a scope
// (databases, users, application_names); ForSession derives the rule set of
// one session, first matching entry first. Stored code and DDL on protected
// tables are judged on their parse trees (body.go, ddl.go).
//
// A proxy calls DecideFor once per text, with what it knows of the session
// (Session: who it is, how the server will tokenize the text, the form the
// rewrite may take); it picks the session's set, makes the refusals that
// need those facts, and decides.
//
// The shapes of the rewrites, and why they are safe under concurrency, are
// described in docs/rewrite.md; the design behind them in docs/design.md.
package rules
