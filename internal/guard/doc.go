// Package guard installs, checks and removes the database guard
// (`fenceproxy setup --guard`): on each protected table in mode enforce, a
// BEFORE INSERT OR UPDATE OR DELETE row trigger that applies the table's
// fence inside PostgreSQL (a token is needed, a stale one is refused, rows
// are stamped, the token is registered for the session's lock), and a
// BEFORE TRUNCATE statement trigger on the table and each of its
// partitions that refuses TRUNCATE; and, installed by a superuser, the
// event trigger fenceproxy_guard_ddl, which undoes any command after which
// one of those triggers, as fenceproxy.guard_triggers records them, is
// gone, disabled or changed (record.go). Writes the proxy cannot see —
// functions, dynamic SQL, cascades, sessions that bypass the proxy — are
// then fenced too, and DDL the proxy cannot see cannot drop the table or
// the guard. guard.sql has the SQL.
//
// Install, Remove, Leave and Check work in a transaction of their
// caller's, internal/dbsetup's Setup and Check, on the entries that apply
// in its database; their results go into dbsetup's Report. The guard
// imports internal/catalog for its catalog reads, never internal/dbsetup,
// which imports it. docs/protecting-tables.md says when to install it.
package guard
