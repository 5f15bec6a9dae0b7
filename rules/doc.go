// Package rules is fenceproxy's SQL rewriter: a pure function from (SQL text,
// compiled rules) to a Decision — forward the client's bytes unchanged,
// forward rewritten SQL, or refuse with a PostgreSQL-style error. It does no
// I/O and is safe for concurrent use.
//
// Every write to a protected table is rewritten into the atomic
// high-watermark form of DESIGN §4.2: the statement itself checks the row's
// fence column against the session's fencing token and stamps the token, in
// the same step as the write. The token is read on the server, at execution
// time, with current_setting('<token setting>', true); the client's token
// text is never spliced into SQL. Rewrites are made on pg_query's parse tree
// (PostgreSQL's own parser) and printed with its deparser.
//
// # Flow
//
// Decide first runs MayTouch, a cheap allocation-free scan for the protected
// relation names (ASCII case-insensitive) and for "U&" (Unicode-escaped
// identifiers can spell a name in disguise). If it finds nothing the
// statement is forwarded unparsed. Otherwise the decision comes from a
// bounded LRU cache keyed by the statement text, or from a parse, a walk over
// every node of the tree (writable CTEs, PREPARE, EXPLAIN, COPY (query) TO,
// every statement of a multi-statement string) and a rewrite of each
// protected write. A statement that names a protected table and does not
// parse is refused.
//
// In a multi-statement string only the statements that write a protected
// table are replaced by their deparsed rewrite; the others keep their
// original text.
//
// # Token validity
//
// A valid token is a decimal integer 1..9223372036854775807, written as ASCII
// digits only: leading zeros are accepted ("0042" is 42); signs, spaces,
// underscores, hex, exponents and trailing newlines are not. NULL (never set
// in the session) and "" (what a custom setting reads after SET LOCAL ends)
// are invalid. The check, V below, is one regular expression that matches
// exactly those strings (optionally zero-padded), so it needs the setting
// only once, never raises and never returns NULL:
//
//	(s ~ '^0*([1-9][0-9]{0,17}|[1-8][0-9]{18}|9[0-1][0-9]{17}|...|9223372036854775807)$') IS TRUE
//
// with s = pg_catalog.current_setting('fence.token', true).
//
// # Shapes of the rewrite
//
// TOK is s::bigint, F the fence column qualified by the target's alias (or
// relation name), FRESH is F <= TOK (F < TOK with strict: true), TOK? is
// CASE WHEN V THEN TOK END, and RAISE(stale) / RAISE(token) are casts of a
// marker text to bigint (or boolean) that always fail with SQLSTATE 22P02;
// TranslateError turns them into FP001 / FP002:
//
//	RAISE(stale) = pg_catalog.concat('fenceproxy:stale:', TOK, ':', F, ':13:public.config')::bigint
//	RAISE(token) = ('fenceproxy:token:13:public.config:11:fence.token:'
//	                || pg_catalog.quote_nullable(pg_catalog.substr(s, 1, 32)))::boolean
//
// GUARD is CASE WHEN V THEN true ELSE RAISE(token) END, a pseudo-constant that the
// planner evaluates once, before reading any row ("One-Time Filter").
//
// With on_stale: error and missing_token: reject:
//
//	UPDATE t SET ..., F = CASE WHEN FRESH THEN TOK ELSE RAISE(stale) END WHERE (w) AND GUARD
//	DELETE FROM t WHERE (w) AND GUARD AND CASE WHEN FRESH THEN true WHEN (w) THEN RAISE(stale) ELSE false END
//	INSERT INTO t (..., F) VALUES (..., CASE WHEN V THEN TOK ELSE RAISE(token) END)
//	... ON CONFLICT ... DO UPDATE SET ..., F = CASE WHEN FRESH THEN TOK ELSE RAISE(stale) END
//	MERGE ... WHEN MATCHED [AND c] THEN UPDATE SET ..., F = CASE WHEN NOT V THEN RAISE(token) WHEN FRESH THEN TOK ELSE RAISE(stale) END
//	MERGE ... WHEN MATCHED [AND c] AND CASE WHEN V THEN FRESH IS NOT TRUE ELSE true END
//	            THEN UPDATE SET F = CASE WHEN V THEN RAISE(stale) ELSE RAISE(token) END   -- inserted before each DELETE action
//	          WHEN MATCHED [AND c] THEN DELETE
//
// The UPDATE form puts the check in the SET list, which PostgreSQL computes
// only for rows that passed the client's WHERE (so other rows never raise,
// whatever order the quals run in) and recomputes on the newest row version
// after a concurrent update (EvalPlanQual). A DELETE has no SET list, so its
// check repeats the client's condition w; if w calls a function not known to
// be repeatable (volatile or user-defined), the single-evaluation form
// WHERE GUARD AND CASE WHEN (w) THEN <check> ELSE false END is used instead.
// UPDATE ... WHERE CURRENT OF, which admits no other condition, checks V in
// the SET value.
//
// With on_stale: skip, stale rows are filtered out and not counted:
//
//	UPDATE t SET ..., F = TOK WHERE (w) AND GUARD AND F <= TOK?
//	DELETE FROM t WHERE (w) AND GUARD AND F <= TOK?
//	... ON CONFLICT ... DO UPDATE SET ..., F = TOK WHERE (c) AND F <= TOK?
//	MERGE ... WHEN MATCHED AND CASE WHEN V THEN FRESH IS NOT TRUE ELSE RAISE(token) END THEN DO NOTHING  -- first
//
// (TOK? rather than TOK in a WHERE clause: the planner pre-evaluates stable
// expressions when estimating "F <= expr", and a bare cast would fail at plan
// time with a raw error for an invalid token.)
//
// With missing_token: allow, an invalid token lets the write through
// unfenced: the GUARD is left out, UPDATE keeps F unchanged
// (CASE WHEN NOT V THEN F WHEN ...), skip conditions become
// CASE WHEN V THEN FRESH ELSE true END, and new rows get fence value 0, the
// fence column's documented default (a client-supplied value is never used).
//
// The proxy owns the fence column: a client assignment to it is removed
// (a multi-column SET (a, F) = (x, y) is split first) and a client value in
// an INSERT is replaced by the stamp.
//
// # Refusals
//
// Refused (FP003), with a message naming the table: COPY ... FROM into a
// protected table; TRUNCATE of one; INSERT (or MERGE ... INSERT) without a
// column list (there is no catalog to find the columns); DELETE ... WHERE
// CURRENT OF; UPDATE ... WHERE CURRENT OF with on_stale: skip; a fence column
// assigned in a multi-column SET from a sub-SELECT; a fence column listed in
// an INSERT ... SELECT that is not a plain SELECT list of simple
// expressions; a DO block or function/procedure body whose text mentions a
// protected table name; a rule whose actions write a protected table; an
// unqualified name matching protected tables in several schemas that are
// fenced differently; and any statement that mentions a protected table but
// does not parse.
//
// Forwarded unchanged: reads (including SELECT ... FOR UPDATE, SELECT INTO,
// CREATE TABLE AS, COPY ... TO), EXECUTE of a prepared statement (its
// PREPARE was rewritten), DDL (ALTER/DROP/CREATE INDEX/CREATE TRIGGER),
// LOCK TABLE, and everything on other tables.
//
// # Table matching
//
// Configured names follow PostgreSQL identifier rules. A schema-qualified
// reference (schema.table or catalog.schema.table) must match exactly; an
// unqualified one matches every protected table with that relation name,
// since the proxy cannot know the session's search_path (fail closed).
// pg_temp.name is never a configured table.
//
// # Limits
//
// The proxy fences the SQL it sees. Writes it cannot see are not fenced:
// statements inside functions, procedures and triggers that are called (as
// opposed to created) through the proxy, dynamic SQL (EXECUTE in PL/pgSQL,
// dblink), writes through views or to partitions/child tables named
// directly, foreign-key cascades, and sessions that bypass the proxy. The
// token is trusted client input: fencing protects against stale lock
// holders, not malicious ones. User-defined operators in a DELETE condition
// are assumed to be repeatable. The fence column should be NOT NULL; a NULL
// fence value is treated as stale.
//
// # SQLSTATEs
//
//	FP001  stale fencing token: the write's token is older than the row's
//	       stored watermark (newer than or equal to it with strict: true);
//	       the statement fails and the transaction is aborted.
//	       Message: fenceproxy: stale fencing token 41 for table public.config (stored watermark 42)
//	FP002  missing or invalid fencing token for a write to a protected table
//	       with missing_token: reject. Message: fenceproxy: write to protected
//	       table public.config needs a valid fence.token (a decimal integer
//	       1..9223372036854775807); Detail says whether it was unset, empty or
//	       which (truncated) value it had.
//	FP003  statement refused: it writes, or may write, a protected table in a
//	       way fenceproxy cannot fence (see Refusals). Nothing was sent to
//	       the server.
//
// FP001 and FP002 are raised by PostgreSQL while running the rewritten
// statement, as SQLSTATE 22P02 errors carrying a "fenceproxy:" marker; the
// proxy must pass every upstream ErrorResponse through TranslateError to
// give the client the fenceproxy code and message.
package rules
