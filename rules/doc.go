// Package rules is fenceproxy's SQL rewriter: a pure function from (SQL text,
// compiled rules) to a Decision — forward the client's bytes unchanged,
// forward rewritten SQL, or refuse with a PostgreSQL-style error. It does no
// I/O and is safe for concurrent use.
//
// Every write to a protected table is rewritten into the atomic
// high-watermark form of docs/rewrite.md: the statement itself checks the row's
// fence column against the session's fencing token and stamps the token, in
// the same step as the write. The token is read on the server, at execution
// time, with current_setting('<token setting>', true); the client's token
// text is never spliced into SQL. Rewrites are made on pg_query's parse tree
// (PostgreSQL's own parser) and printed with its deparser.
//
// # Flow
//
// Decide first runs MayTouch, a cheap allocation-free scan for the protected
// relation names (ASCII case-insensitive), for "U&" (Unicode-escaped
// identifiers can spell a name in disguise) and, in a statement containing
// "alter", for the protected tables' schema names (ALTER SCHEMA ... RENAME).
// If it finds nothing the statement is forwarded unparsed. Otherwise the decision comes from a
// bounded LRU cache keyed by the statement text, or from a parse, a walk over
// every node of the tree (writable CTEs, PREPARE, EXPLAIN, COPY (query) TO,
// every statement of a multi-statement string) and a rewrite of each
// protected write. A statement that names a protected table and does not
// parse is refused, and so is one that nests too deeply to parse safely:
// before parsing, the text's nesting is bounded in one linear pass (chains
// of operators, UNIONs and JOINs and nested brackets count; lists do not),
// because libpg_query recurses without a stack check and a deep enough
// tree would crash the process.
//
// In a multi-statement string only the statements that write a protected
// table are replaced by their deparsed rewrite; the others keep their
// original text.
//
// # Modes and scopes
//
// Each `tables:` entry has a mode: enforce (the default) fences writes as
// described below; audit never blocks a write or changes its outcome as the
// client sees it (rows affected, RETURNING rows, errors), keeps the
// watermark moving when the token is valid (never backwards), and records
// every write enforce would have rejected; off leaves the table alone.
// One statement may write tables in different modes; each write is
// rewritten by its own table's rule.
//
// An entry may carry a scope: lists of databases, users and
// application_names, each empty for "any", compared exactly with the values
// of the client's startup packet. A table may be listed several times with
// different scopes: for a session, the first entry (in list order) whose
// scope matches decides how the table is fenced, and a table no entry
// matches is not protected in that session. For example
//
//	tables:
//	  - table: public.config
//	    scope: {application_names: [billing]}
//	  - table: public.config
//	    mode: audit
//
// enforces fencing for the billing service and audits everyone else.
// Compile rejects an entry that can never apply because an earlier entry for
// the same table matches every session it matches (identical scopes
// included). Scopes serve staged rollout; they are not a security boundary
// (a client picks its own application_name).
//
// Rules.ForSession(database, user, applicationName) returns the rule set of
// a session, with the same API. It is meant to be called for every
// statement: without scoped entries it returns its receiver; otherwise it
// computes which entries match (no allocation) and returns a memoized set,
// keyed by that match pattern (never by client strings) and bounded to a
// few hundred sets, beyond which it builds a set without a cache. The sets
// share the root's bounded decision cache. The root itself decides for
// sessions that match no scoped entry. Tables and AuditTables list every
// table the configuration fences for some session (for metric labels),
// whichever set they are called on.
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
// unfenced, and records it (mode "enforce", reason "missing_token", see
// Audit records): the raising GUARD becomes the recording
//
//	RECORD = CASE WHEN V THEN true ELSE NOTIFY(missing_token, true) END
//
// (also a pseudo-constant, evaluated once per statement, never false),
// UPDATE keeps F unchanged (CASE WHEN NOT V THEN F WHEN ...), skip
// conditions become CASE WHEN V THEN FRESH ELSE true END, and new rows get
// fence value 0, the fence column's documented default (a client-supplied
// value is never used), recorded: CASE WHEN V THEN TOK ELSE
// NOTIFY(missing_token, 0) END. Where there is no WHERE clause to carry
// RECORD, the value records it itself: UPDATE ... WHERE CURRENT OF and MERGE
// UPDATE actions assign CASE WHEN NOT V THEN NOTIFY(missing_token, F) ...,
// and a MERGE DELETE action's condition c becomes
// CASE WHEN (c) THEN RECORD ELSE false END. In a multi-row VALUES list only
// the first row records (every row is computed when any is; one sub-select
// per row would cost the server a sub-plan per row).
//
// With mode: audit (on_stale and missing_token do not matter; strict does):
//
//	UPDATE t SET ..., F = CASE WHEN NOT V THEN F WHEN FRESH THEN TOK ELSE NOTIFY(stale, F) END WHERE (w) AND RECORD
//	UPDATE t SET ..., F = CASE WHEN NOT V THEN NOTIFY(missing_token, F) WHEN FRESH THEN TOK ELSE NOTIFY(stale, F) END WHERE CURRENT OF c
//	DELETE FROM t WHERE (w) AND RECORD AND CASE WHEN NOT V THEN true WHEN FRESH THEN true WHEN (w) THEN NOTIFY(stale, true) ELSE true END
//	DELETE FROM t WHERE RECORD AND CASE WHEN (w) THEN CASE WHEN NOT V THEN true WHEN FRESH THEN true ELSE NOTIFY(stale, true) END ELSE false END  -- w not repeatable
//	INSERT INTO t (..., F) VALUES (..., CASE WHEN V THEN TOK ELSE NOTIFY(missing_token, 0) END)
//	... ON CONFLICT ... DO UPDATE SET ..., F = CASE WHEN NOT V THEN F WHEN FRESH THEN TOK ELSE NOTIFY(stale, F) END
//	MERGE ... WHEN MATCHED [AND c] THEN UPDATE SET ..., F = CASE WHEN NOT V THEN NOTIFY(missing_token, F) WHEN FRESH THEN TOK ELSE NOTIFY(stale, F) END
//	MERGE ... WHEN MATCHED AND CASE WHEN (c) THEN CASE WHEN NOT V THEN NOTIFY(missing_token, true)
//	            WHEN FRESH THEN true ELSE NOTIFY(stale, true) END ELSE false END THEN DELETE
//
// A stale row keeps its watermark and is written anyway; the added
// conditions are never false for a row the client's own condition selects,
// so the same rows are written, counted and returned. An invalid token is
// recorded once per UPDATE or DELETE, whether or not a row matches (enforce
// raises FP002 then too), and by INSERT and MERGE when they write a row
// (when enforce raises it); a stale write once per stale row (identical
// notifications are merged, see below). The ON CONFLICT
// branch does not record an invalid token: the proposed row's stamp, which
// is computed for every proposed row, already did. A MERGE DELETE condition
// evaluates c once and records only for rows the action takes.
//
// # Audit records
//
// NOTIFY(reason, val) sends a notification and yields val:
//
//	(SELECT val FROM pg_catalog.pg_notify('fenceproxy_audit', PAYLOAD) AS n)                -- stale
//	(SELECT val FROM pg_catalog.pg_notify('fenceproxy_audit', PAYLOAD) AS n WHERE NOT V)    -- missing_token
//	PAYLOAD = pg_catalog.json_build_object('v', 1, 'i', <audit tag>, 'm', <mode>, 'r', <reason>,
//	            't', <table>, 'tok', pg_catalog.substr(s, 1, 32), 'w', F or NULL)::pg_catalog.text
//
// (the alias is n_ when the target's own alias is n). pg_notify is volatile,
// so the planner never evaluates it ahead of time, and a CASE branch is
// evaluated only when taken; a sub-select whose value and payload do not
// depend on the row becomes an InitPlan, run at most once per statement.
// The WHERE NOT V of a missing_token record matters when a concurrent
// update makes PostgreSQL re-check a row (EvalPlanQual): that runs every
// InitPlan of the plan, taken branch or not, and the record must then send
// nothing for a valid token.
// The payload, as a listener receives it:
//
//	{"v" : 1, "i" : "proxy-a", "m" : "audit", "r" : "stale", "t" : "public.config", "tok" : "41", "w" : 42}
//
//	v    payload format version, 1
//	i    Config.AuditTag of the proxy that rewrote the statement
//	m    "audit" (mode: audit) or "enforce" (missing_token: allow)
//	r    "stale" (the token was older than the row's watermark, or not
//	     newer with strict: true) or "missing_token" (unset, empty or
//	     not a valid token)
//	t    the table's display name (the bare relation name when an
//	     unqualified reference matched alike-fenced tables in several schemas)
//	tok  the token setting's first 32 characters; null when unset
//	w    the row's stored watermark (bigint) for "stale"; null for
//	     "missing_token"
//
// AuditEvent and ParseAuditEvent decode it. PostgreSQL delivers
// notifications when the transaction commits (none on rollback, nor for a
// subtransaction rolled back to a savepoint) to the sessions of the same
// database that LISTEN on the channel, and delivers identical payloads sent
// in one transaction once: a statement recording stale rows with N
// distinct watermarks sends N notifications, and a transaction repeating
// the same stale write sends one.
//
// A statement that enforce mode would refuse (see Refusals) is, when every
// table the refusal concerns is in audit mode, forwarded as the client sent
// it (or, in a multi-statement string or a statement with several writes,
// that write is left as sent and the others are still rewritten), and the
// refusal is returned in Decision.AuditRefusal for the proxy to record: a
// refusal cannot be recorded by the server. A statement that does not parse
// is treated so when every protected table it mentions is audited, unless
// it contains a Unicode escape (U&), which could name any table.
//
// The proxy owns the fence column: a client assignment to it is removed
// (a multi-column SET (a, F) = (x, y) is split first) and a client value in
// an INSERT is replaced by the stamp.
//
// # Refusals
//
// Refused (FP003, or in audit mode forwarded and recorded as
// Decision.AuditRefusal), with a message naming the table: COPY ... FROM into a
// protected table; TRUNCATE of one; INSERT (or MERGE ... INSERT) without a
// column list (there is no catalog to find the columns); DELETE ... WHERE
// CURRENT OF; UPDATE ... WHERE CURRENT OF with on_stale: skip; a fence column
// assigned in a multi-column SET from a sub-SELECT; a fence column listed in
// an INSERT ... SELECT that is not a plain SELECT list of simple
// expressions; a DO block or function/procedure whose code refers to a
// protected table (judged on the parsed body by identifier tokens, string
// constants read as SQL for dynamic SQL; see body.go); a rule whose actions write a protected table; an
// unqualified name matching protected tables in several schemas that are
// fenced differently; and any statement that mentions a protected table but
// does not parse, or nests too deeply to be parsed or printed safely.
//
// DDL on a protected table is default-deny (see ddl.go): allowed are only
// CREATE INDEX, REINDEX, COMMENT, GRANT/REVOKE, ANALYZE, VACUUM, CLUSTER and
// ALTER TABLE ... ADD COLUMN with no default or a constant one. Everything
// else naming a protected table is refused, including DROP TABLE, triggers,
// rules and policies on it, and inheritance or partitioning with it on
// either side. Renaming a protected table (ALTER TABLE, or ALTER
// INDEX/VIEW/..., which PostgreSQL also lets rename a table), moving it,
// renaming its schema or its fence column get a message saying to change
// the configuration first. A schema or column name counts only for the
// tables that configure it; an unqualified table name matches every
// protected table with that relation name, however fenced.
//
// Forwarded unchanged: reads (including SELECT ... FOR UPDATE, SELECT INTO,
// CREATE TABLE AS, COPY ... TO), EXECUTE of a prepared statement (its
// PREPARE was rewritten), the allowed DDL, creating a table under a
// protected name or renaming another table to one, LOCK TABLE, and
// everything on other tables.
//
// # Table matching
//
// Configured names follow PostgreSQL identifier rules. A schema-qualified
// reference (schema.table or catalog.schema.table) must match exactly; an
// unqualified one matches every protected table with that relation name,
// since the proxy cannot know the session's search_path (fail closed).
// pg_temp.name is never a configured table.
//
// Statements are read as UTF-8, so a name with non-ASCII bytes can only be
// recognised in UTF-8 text; Rules.HasNonASCIINames reports whether a
// protected table, schema or fence column name has any, for the proxy to
// refuse statements with non-ASCII bytes from clients using another
// client_encoding.
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
// Audit records are notifications, with their limits: anyone connected to
// the database can send a forged one (a listener must use only configured
// table names as labels); they are scoped to one database; a transaction
// that sent one cannot be prepared for two-phase commit (PREPARE
// TRANSACTION fails, where enforce would have failed the write itself); if
// the server's notification queue fills up (a listener not reading),
// committing a transaction that sent one fails. Under concurrent updates
// PostgreSQL may evaluate a row's check twice (EvalPlanQual), which can
// record a stale write against a row version that is then not written.
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
