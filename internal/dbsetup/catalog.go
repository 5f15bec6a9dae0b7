package dbsetup

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
)

// The catalog queries Setup and Check share. They read pg_catalog rather
// than calling to_regclass and friends, which fail with "permission denied
// for schema" instead of answering when the connecting role lacks USAGE.

// relation is a protected table as the catalog has it.
type relation struct {
	oid         uint32
	kind        string // pg_class.relkind
	isPartition bool
	qualified   string // schema.table quoted for SQL by the server's rules
}

// isTable reports whether the relation can have a fence column added and
// take fenced writes: an ordinary or a partitioned table.
func (r *relation) isTable() bool { return r.kind == "r" || r.kind == "p" }

// kindName names pg_class.relkind values for messages.
var kindName = map[string]string{
	"v": "a view", "m": "a materialized view", "f": "a foreign table", "S": "a sequence",
	"i": "an index", "I": "a partitioned index", "c": "a composite type", "t": "a TOAST table",
}

// lookupTable returns the relation schema.table (exact names), or nil.
func lookupTable(ctx context.Context, tx pgx.Tx, schema, table string) (*relation, error) {
	var r relation
	err := tx.QueryRow(ctx, `
		SELECT c.oid, c.relkind::text, c.relispartition, format('%I.%I', n.nspname, c.relname)
		FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1::text AND c.relname = $2::text`, schema, table).
		Scan(&r.oid, &r.kind, &r.isPartition, &r.qualified)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("look up table %s.%s: %w", schema, table, err)
	}
	return &r, nil
}

// column is a fence column as the catalog has it.
type column struct {
	quoted    string // the name quoted for SQL
	exists    bool
	attnum    int16
	typ       string // format_type
	bigint    bool
	notNull   bool
	def       *string // pg_get_expr of the default; nil without one
	identity  string  // pg_attribute.attidentity: "", "a" or "d"
	generated string  // pg_attribute.attgenerated: "" or "s"
}

// lookupColumn returns the column name of rel; column.exists is false when
// there is none.
func lookupColumn(ctx context.Context, tx pgx.Tx, rel *relation, name string) (*column, error) {
	var c column
	var attnum *int16
	var typ, identity, generated *string
	var bigint, notNull *bool
	err := tx.QueryRow(ctx, `
		SELECT format('%I', $2::text), a.attnum, format_type(a.atttypid, a.atttypmod),
			a.atttypid = 'pg_catalog.int8'::pg_catalog.regtype, a.attnotnull,
			pg_get_expr(d.adbin, d.adrelid), a.attidentity::text, a.attgenerated::text
		FROM (SELECT) AS one
		LEFT JOIN pg_catalog.pg_attribute a
			ON a.attrelid = $1::oid AND a.attname = $2::text AND a.attnum > 0 AND NOT a.attisdropped
		LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum`, rel.oid, name).
		Scan(&c.quoted, &attnum, &typ, &bigint, &notNull, &c.def, &identity, &generated)
	if err != nil {
		return nil, fmt.Errorf("look up column %s of %s: %w", name, rel.qualified, err)
	}
	if attnum == nil {
		return &c, nil
	}
	c.exists, c.attnum, c.typ, c.bigint, c.notNull = true, *attnum, *typ, *bigint, *notNull
	if identity != nil {
		c.identity = *identity
	}
	if generated != nil {
		c.generated = *generated
	}
	return &c, nil
}

// zeroDefaults are the ways pg_get_expr prints a default of zero for a
// bigint column (DEFAULT 0, DEFAULT 0::bigint, DEFAULT '0').
var zeroDefaults = map[string]bool{"0": true, "0::bigint": true, "(0)::bigint": true, "'0'::bigint": true}

// objects is the state of the fenceproxy schema's objects.
type objects struct {
	schema, meta, locks, register bool
	// registerCurrent: the register procedure's source is objects.sql's,
	// and it is declared as there (SECURITY DEFINER, its search_path);
	// registerV1: the same with the source of versions 1 to 3
	// (registerBodyV1).
	registerCurrent, registerV1 bool
	// version is fenceproxy.meta's version, if hasVersion; 0 without the
	// table or the row.
	version    int
	hasVersion bool
	// badVersion is the version text when it is not a version number.
	badVersion *string
	// raisers: the error raisers are objects.sql's and PUBLIC may call
	// them (see Report.Raisers).
	raisers bool
}

func readObjects(ctx context.Context, tx pgx.Tx) (objects, error) {
	var o objects
	var src *string
	var declared bool
	err := tx.QueryRow(ctx, `
		WITH ns AS (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = 'fenceproxy')
		SELECT EXISTS (SELECT FROM ns),
			EXISTS (SELECT FROM pg_catalog.pg_class c JOIN ns ON c.relnamespace = ns.oid WHERE c.relname = 'meta' AND c.relkind = 'r'),
			EXISTS (SELECT FROM pg_catalog.pg_class c JOIN ns ON c.relnamespace = ns.oid WHERE c.relname = 'locks' AND c.relkind = 'r'),
			(SELECT p.prosrc FROM pg_catalog.pg_proc p JOIN ns ON p.pronamespace = ns.oid
				WHERE p.proname = 'register' AND p.prokind = 'p'
				AND p.proargtypes = '25 25 16 16 25 25'::pg_catalog.oidvector), -- text, text, bool, bool, text, text
			-- Declared as objects.sql declares it: it runs with its owner's
			-- rights (to write the watermarks), and so with a search_path no
			-- session can put its own operators on.
			coalesce((SELECT p.prosecdef AND p.proconfig = ARRAY['search_path=pg_catalog, pg_temp']
				FROM pg_catalog.pg_proc p JOIN ns ON p.pronamespace = ns.oid
				WHERE p.proname = 'register' AND p.prokind = 'p'
				AND p.proargtypes = '25 25 16 16 25 25'::pg_catalog.oidvector), false)`).
		Scan(&o.schema, &o.meta, &o.locks, &src, &declared)
	if err != nil {
		return o, fmt.Errorf("read the fenceproxy objects: %w", err)
	}
	o.register = src != nil
	o.registerCurrent = src != nil && *src == registerBody && declared
	o.registerV1 = src != nil && *src == registerBodyV1 && declared
	if o.schema {
		if o.raisers, err = readRaisers(ctx, tx); err != nil {
			return o, err
		}
	}
	if !o.meta {
		return o, nil
	}
	var v string
	err = tx.QueryRow(ctx, `SELECT value FROM fenceproxy.meta WHERE key = 'version'`).Scan(&v)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return o, nil
	case err != nil:
		return o, fmt.Errorf("read fenceproxy.meta: %w", err)
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		o.badVersion = &v
		return o, nil
	}
	o.version, o.hasVersion = n, true
	return o, nil
}

// fingerprint describes the fenceproxy schema's objects: their definitions,
// owners' grants and the stored version, so that Setup can tell whether
// installing objects.sql changed anything.
func fingerprint(ctx context.Context, tx pgx.Tx) ([]string, error) {
	rows, err := tx.Query(ctx, `
		WITH ns AS (SELECT oid, nspacl FROM pg_catalog.pg_namespace WHERE nspname = 'fenceproxy')
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
		ORDER BY 1`)
	if err != nil {
		return nil, fmt.Errorf("read the fenceproxy objects: %w", err)
	}
	fp, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read the fenceproxy objects: %w", err)
	}
	o, err := readObjects(ctx, tx)
	if err != nil {
		return nil, err
	}
	v := "version none"
	switch {
	case o.badVersion != nil:
		v = fmt.Sprintf("version %q", *o.badVersion)
	case o.hasVersion:
		v = fmt.Sprintf("version %d", o.version)
	}
	return append(fp, v), nil
}

// readRaisers reports whether the error raisers are objects.sql's, with
// the argument and result types the rewriter calls them with, declared as
// objects.sql declares them (STABLE PL/pgSQL, not STRICT, not SECURITY
// DEFINER, no settings), PUBLIC may
// call them (USAGE on the schema, EXECUTE on each), and only the schema's
// owner can change them (it owns them, and no one else may CREATE in the
// schema).
func readRaisers(ctx context.Context, tx pgx.Tx) (bool, error) {
	rows, err := tx.Query(ctx, `
		SELECT p.proname, p.prosrc,
			pg_catalog.pg_get_function_identity_arguments(p.oid) || ' -> ' || p.prorettype::pg_catalog.regtype::pg_catalog.text,
			p.proacl IS NULL OR EXISTS (SELECT FROM pg_catalog.aclexplode(p.proacl) a
				WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'),
			EXISTS (SELECT FROM pg_catalog.aclexplode(n.nspacl) a
				WHERE a.grantee = 0 AND a.privilege_type = 'USAGE')
			-- No one but the schema's owner may add functions (an overload
			-- that wins the call) or replace these.
			AND p.proowner = n.nspowner
			AND NOT EXISTS (SELECT FROM pg_catalog.aclexplode(n.nspacl) a
				WHERE a.privilege_type = 'CREATE' AND a.grantee <> n.nspowner),
			-- Declared as objects.sql declares them: an IMMUTABLE tok_b
			-- with constant arguments would be folded away when the
			-- statement is planned (a prepared statement would keep the
			-- token it was planned with), a STRICT one would return NULL
			-- for a NULL fence instead of raising.
			p.provolatile = 's' AND NOT p.proisstrict AND NOT p.prosecdef AND p.proconfig IS NULL
				AND p.prosupport = 0 AND p.prokind = 'f' AND NOT p.proretset
				AND p.prolang = (SELECT l.oid FROM pg_catalog.pg_language l WHERE l.lanname = 'plpgsql')
		FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		WHERE n.nspname = 'fenceproxy' AND p.proname = ANY($1)`, RaiserNames())
	if err != nil {
		return false, fmt.Errorf("read the fenceproxy error raisers: %w", err)
	}
	found := map[string]bool{}
	ok := true
	for rows.Next() {
		var name, src, sig string
		var exec, usable, declared bool
		if err := rows.Scan(&name, &src, &sig, &exec, &usable, &declared); err != nil {
			return false, fmt.Errorf("read the fenceproxy error raisers: %w", err)
		}
		if r, known := raiserFuncs[name]; found[name] || !known || src != r.body || sig != r.signature || !exec || !usable || !declared {
			ok = false // an overload, another body or declaration, not callable by all, or changeable by others
		}
		found[name] = true
	}
	if err := rows.Err(); err != nil {
		return false, fmt.Errorf("read the fenceproxy error raisers: %w", err)
	}
	return ok && len(found) == len(raiserFuncs), nil
}
