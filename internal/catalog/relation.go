package catalog

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// The catalog reads that setup, check and the guard share. They read
// pg_catalog rather than calling to_regclass and friends, which fail with
// "permission denied for schema" instead of answering when the connecting
// role lacks USAGE.

// Querier is what the catalog reads need of a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var (
	_ Querier = (*pgx.Conn)(nil)
	_ Querier = pgx.Tx(nil)
)

// Relation is a protected table as the catalog has it.
type Relation struct {
	OID         uint32
	Kind        string // pg_class.relkind
	IsPartition bool
	Qualified   string // schema.table quoted for SQL by the server's rules
}

// IsTable reports whether the relation can have a fence column added and
// take fenced writes: an ordinary or a partitioned table.
func (r *Relation) IsTable() bool { return r.Kind == "r" || r.Kind == "p" }

// LookupTable returns the relation schema.table (exact names), or nil.
func LookupTable(ctx context.Context, q Querier, schema, table string) (*Relation, error) {
	var r Relation
	err := q.QueryRow(ctx, `
		SELECT c.oid, c.relkind::text, c.relispartition, format('%I.%I', n.nspname, c.relname)
		FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1::text AND c.relname = $2::text`, schema, table).
		Scan(&r.OID, &r.Kind, &r.IsPartition, &r.Qualified)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("look up table %s.%s: %w", schema, table, err)
	}
	return &r, nil
}

// Column is a fence column as the catalog has it.
type Column struct {
	Quoted    string // the name quoted for SQL
	Exists    bool
	Attnum    int16
	Type      string // format_type
	Bigint    bool
	NotNull   bool
	Default   *string // pg_get_expr of the default; nil without one
	Identity  string  // pg_attribute.attidentity: "", "a" or "d"
	Generated string  // pg_attribute.attgenerated: "" or "s"
}

// ErrChanged reports a relation dropped while a transaction's snapshot
// still shows it: the catalog functions that print definitions read the
// latest catalog, not the snapshot, and found nothing to print. A read in
// a new transaction sees what replaced it.
var ErrChanged = errors.New("the relation was dropped while it was read")

// LookupColumn returns the column name of rel; Column.Exists is false when
// there is none. It returns ErrChanged (wrapped) when rel was dropped since
// q's snapshot was taken.
func LookupColumn(ctx context.Context, q Querier, rel *Relation, name string) (*Column, error) {
	var c Column
	var attnum *int16
	var typ, identity, generated *string
	var bigint, notNull, hasDefault *bool
	err := q.QueryRow(ctx, `
		SELECT format('%I', $2::text), a.attnum, format_type(a.atttypid, a.atttypmod),
			a.atttypid = 'pg_catalog.int8'::pg_catalog.regtype, a.attnotnull,
			pg_get_expr(d.adbin, d.adrelid), d.adbin IS NOT NULL, a.attidentity::text, a.attgenerated::text
		FROM (SELECT) AS one
		LEFT JOIN pg_catalog.pg_attribute a
			ON a.attrelid = $1::oid AND a.attname = $2::text AND a.attnum > 0 AND NOT a.attisdropped
		LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum`, rel.OID, name).
		Scan(&c.Quoted, &attnum, &typ, &bigint, &notNull, &c.Default, &hasDefault, &identity, &generated)
	if err != nil {
		return nil, fmt.Errorf("look up column %s of %s: %w", name, rel.Qualified, err)
	}
	if attnum == nil {
		return &c, nil
	}
	if c.Default == nil && hasDefault != nil && *hasDefault {
		// pg_get_expr prints NULL for a relation the latest catalog no
		// longer has: not a column without a default.
		return nil, fmt.Errorf("look up column %s of %s: %w", name, rel.Qualified, ErrChanged)
	}
	c.Exists, c.Attnum, c.Type, c.Bigint, c.NotNull = true, *attnum, *typ, *bigint, *notNull
	if identity != nil {
		c.Identity = *identity
	}
	if generated != nil {
		c.Generated = *generated
	}
	return &c, nil
}

// SchemaFingerprint describes the objects of schema: its grants, and its
// relations, columns, constraints and routines with their definitions and
// grants, one line each, sorted. Setup compares the fingerprints before
// and after running a script to tell whether it changed anything.
func SchemaFingerprint(ctx context.Context, q Querier, schema string) ([]string, error) {
	rows, err := q.Query(ctx, `
		WITH ns AS (SELECT oid, nspacl FROM pg_catalog.pg_namespace WHERE nspname = $1::text)
		SELECT 'schema ' || coalesce(ns.nspacl::text, '') FROM ns
		UNION ALL
		SELECT format('relation %s %s %s', c.relname, c.relkind, c.relacl)
		FROM pg_catalog.pg_class c JOIN ns ON c.relnamespace = ns.oid
		UNION ALL
		SELECT format('column %s.%s %s %s %s', c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
			a.attnotnull, pg_get_expr(d.adbin, d.adrelid))
		FROM pg_catalog.pg_class c JOIN ns ON c.relnamespace = ns.oid
		JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
		LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
		UNION ALL
		SELECT format('constraint %s %s', co.conname, pg_get_constraintdef(co.oid))
		FROM pg_catalog.pg_constraint co JOIN ns ON co.connamespace = ns.oid
		UNION ALL
		SELECT format('routine %s %s', pg_get_functiondef(p.oid), p.proacl)
		FROM pg_catalog.pg_proc p JOIN ns ON p.pronamespace = ns.oid
		ORDER BY 1`, schema)
	if err != nil {
		return nil, fmt.Errorf("read the %s objects: %w", schema, err)
	}
	fp, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read the %s objects: %w", schema, err)
	}
	return fp, nil
}
