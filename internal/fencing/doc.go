// Package fencing holds the system tests of fencing as a client meets it:
// real drivers (pgx, lib/pq, psql) through an in-process proxy running the
// real policy against real PostgreSQL, and sometimes PgBouncer, with the
// data read back from the database. It has no code of its own; the pieces
// under test are internal/proxy (the relay), internal/rules (the rewriter),
// internal/policy (the glue) and internal/dbsetup (the database objects).
package fencing
