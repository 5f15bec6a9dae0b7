package dbsetup

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
)

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
	// staleAt: so are the raisers added in staleAtVersion.
	staleAt bool
	// hold: the hold procedure is objects.sql's, declared as there (no
	// SECURITY DEFINER, no settings), and PUBLIC may call it and read
	// fenceproxy.locks (it reads them with the caller's rights).
	hold bool
	// enter: so is the enter procedure (it calls hold and the catalog
	// check with the caller's rights).
	enter bool
	// holdAt: so is the hold_at procedure.
	holdAt bool
	// reholdAt: so is the rehold_at procedure.
	reholdAt bool
}

// The argument types of hold (text, text, bool, bool, text, text), of
// enter (text, text, text, text, int8, bool, bool, bool, text, text) and
// of hold_at and rehold_at (int8, text, text, text), as
// pg_proc.proargtypes lists them.
const (
	holdArgs   = "25 25 16 16 25 25"
	enterArgs  = "25 25 25 25 20 16 16 16 25 25"
	holdAtArgs = "20 25 25 25"
)

// callerRights is the SQL that reports whether the procedure
// fenceproxy.name(args) is declared as objects.sql declares those that
// run with the caller's rights: no SECURITY DEFINER, no settings, owned
// by the schema's owner (no one else replaced it), callable by every role
// in a schema every role may use, with fenceproxy.locks readable by every
// role (hold reads the watermarks with the caller's rights). false when
// it is missing.
func callerRights(name, args string) string {
	return `coalesce((SELECT NOT p.prosecdef AND p.proconfig IS NULL AND p.proowner = n.nspowner
					AND (p.proacl IS NULL OR EXISTS (SELECT FROM pg_catalog.aclexplode(p.proacl) a
						WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'))
					AND EXISTS (SELECT FROM pg_catalog.aclexplode(n.nspacl) a
						WHERE a.grantee = 0 AND a.privilege_type = 'USAGE')
					AND EXISTS (SELECT FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
						WHERE c.relnamespace = n.oid AND c.relname = 'locks' AND a.grantee = 0 AND a.privilege_type = 'SELECT')
				FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
				WHERE n.nspname = 'fenceproxy' AND p.proname = '` + name + `' AND p.prokind = 'p'
				AND p.proargtypes = '` + args + `'::pg_catalog.oidvector), false)`
}

func readObjects(ctx context.Context, tx pgx.Tx) (objects, error) {
	var o objects
	var src, holdSrc, enterSrc, holdAtSrc, reholdAtSrc *string
	var declared, holdDeclared, enterDeclared, holdAtDeclared, reholdAtDeclared bool
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
				AND p.proargtypes = '25 25 16 16 25 25'::pg_catalog.oidvector), false),
			(SELECT p.prosrc FROM pg_catalog.pg_proc p JOIN ns ON p.pronamespace = ns.oid
				WHERE p.proname = 'hold' AND p.prokind = 'p'
				AND p.proargtypes = '`+holdArgs+`'::pg_catalog.oidvector),
			-- hold runs with the caller's rights and sets nothing; no one
			-- but the schema's owner may have replaced it, and every role
			-- may call it and read the watermarks it reads.
			`+callerRights("hold", holdArgs)+`,
			(SELECT p.prosrc FROM pg_catalog.pg_proc p JOIN ns ON p.pronamespace = ns.oid
				WHERE p.proname = 'enter' AND p.prokind = 'p'
				AND p.proargtypes = '`+enterArgs+`'::pg_catalog.oidvector),
			`+callerRights("enter", enterArgs)+`,
			(SELECT p.prosrc FROM pg_catalog.pg_proc p JOIN ns ON p.pronamespace = ns.oid
				WHERE p.proname = 'hold_at' AND p.prokind = 'p'
				AND p.proargtypes = '`+holdAtArgs+`'::pg_catalog.oidvector),
			`+callerRights("hold_at", holdAtArgs)+`,
			(SELECT p.prosrc FROM pg_catalog.pg_proc p JOIN ns ON p.pronamespace = ns.oid
				WHERE p.proname = 'rehold_at' AND p.prokind = 'p'
				AND p.proargtypes = '`+holdAtArgs+`'::pg_catalog.oidvector),
			`+callerRights("rehold_at", holdAtArgs)).
		Scan(&o.schema, &o.meta, &o.locks, &src, &declared, &holdSrc, &holdDeclared, &enterSrc, &enterDeclared, &holdAtSrc, &holdAtDeclared, &reholdAtSrc, &reholdAtDeclared)
	if err != nil {
		return o, fmt.Errorf("read the fenceproxy objects: %w", err)
	}
	o.register = src != nil
	o.registerCurrent = src != nil && *src == registerBody && declared
	o.registerV1 = src != nil && *src == registerBodyV1 && declared
	o.hold = holdSrc != nil && (*holdSrc == holdBody || *holdSrc == holdBodyByKey) && holdDeclared
	o.enter = enterSrc != nil && *enterSrc == enterBody && enterDeclared
	o.holdAt = holdAtSrc != nil && (*holdAtSrc == holdAtBody || *holdAtSrc == holdAtBodyByKey) && holdAtDeclared
	o.reholdAt = reholdAtSrc != nil && (*reholdAtSrc == reholdAtBody || *reholdAtSrc == reholdAtBodyByKey) && reholdAtDeclared
	if o.schema {
		if o.raisers, o.staleAt, err = readRaisers(ctx, tx); err != nil {
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
	fp, err := catalog.SchemaFingerprint(ctx, tx, "fenceproxy")
	if err != nil {
		return nil, err
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

// readRaisers reports whether the error raisers are objects.sql's (base:
// those before staleAtVersion; staleAt: all of them), with
// the argument and result types the rewriter calls them with, declared as
// objects.sql declares them (STABLE PL/pgSQL, not STRICT, not SECURITY
// DEFINER, no settings), PUBLIC may
// call them (USAGE on the schema, EXECUTE on each), and only the schema's
// owner can change them (it owns them, and no one else may CREATE in the
// schema).
func readRaisers(ctx context.Context, tx pgx.Tx) (base, staleAt bool, err error) {
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
		return false, false, fmt.Errorf("read the fenceproxy error raisers: %w", err)
	}
	found := map[string]bool{}
	bad := map[string]bool{}
	for rows.Next() {
		var name, src, sig string
		var exec, usable, declared bool
		if err := rows.Scan(&name, &src, &sig, &exec, &usable, &declared); err != nil {
			return false, false, fmt.Errorf("read the fenceproxy error raisers: %w", err)
		}
		if r, known := raiserFuncs[name]; found[name] || !known || src != r.body || sig != r.signature || !exec || !usable || !declared {
			bad[name] = true // an overload, another body or declaration, not callable by all, or changeable by others
		}
		found[name] = true
	}
	if err := rows.Err(); err != nil {
		return false, false, fmt.Errorf("read the fenceproxy error raisers: %w", err)
	}
	base, staleAt = true, true
	for name, r := range raiserFuncs {
		ok := found[name] && !bad[name]
		if r.since < staleAtVersion {
			base = base && ok
		}
		staleAt = staleAt && ok
	}
	return base, staleAt, nil
}
