package guard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// guardTrig is a trigger named like one of the guard's.
type guardTrig struct {
	rel     uint32
	relName string // qualified for SQL
	name    string
	ours    bool   // its function is in schema fenceproxy
	fn      string // the function's name (schema-qualified when not ours)
	typ     int16
	enabled string // pg_trigger.tgenabled
	clone   bool   // inherited from a partitioned table's trigger
	extra   bool   // a WHEN condition or UPDATE OF columns
	args    []string
}

// readGuardTriggers returns every trigger of the database named like one
// of the guard's, with its arguments decoded from pg_trigger.tgargs (each
// NUL-terminated, in the server encoding).
func readGuardTriggers(ctx context.Context, tx pgx.Tx) ([]guardTrig, error) {
	rows, err := tx.Query(ctx, `
		SELECT t.tgrelid, format('%I.%I', n.nspname, c.relname), t.tgname::text,
			pn.nspname = 'fenceproxy', CASE WHEN pn.nspname = 'fenceproxy' THEN p.proname::text ELSE format('%I.%I', pn.nspname, p.proname) END,
			t.tgtype, t.tgenabled::text, t.tgparentid <> 0,
			t.tgqual IS NOT NULL OR pg_catalog.cardinality(t.tgattr::pg_catalog.int2[]) > 0,
			ARRAY(
				WITH RECURSIVE a(i, arg, rest) AS (
					SELECT 0, NULL::bytea, t.tgargs
					UNION ALL
					SELECT i + 1, substring(rest FOR position(nul IN rest) - 1), substring(rest FROM position(nul IN rest) + 1)
					FROM a, (SELECT pg_catalog.decode('00', 'hex') AS nul) z WHERE position(nul IN rest) > 0)
				SELECT pg_catalog.convert_from(arg, pg_catalog.current_setting('server_encoding')) FROM a WHERE i > 0 ORDER BY i)
		FROM pg_catalog.pg_trigger t
		JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid
		JOIN pg_catalog.pg_namespace pn ON pn.oid = p.pronamespace
		WHERE t.tgname IN ($1, $2)
		ORDER BY 2, 3`, guardRowTrigger, guardTruncateTrigger)
	if err != nil {
		return nil, fmt.Errorf("read the guard's triggers: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (guardTrig, error) {
		var g guardTrig
		err := row.Scan(&g.rel, &g.relName, &g.name, &g.ours, &g.fn, &g.typ, &g.enabled, &g.clone, &g.extra, &g.args)
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("read the guard's triggers: %w", err)
	}
	return out, nil
}

// guardTriggersOn indexes triggers by relation.
func guardTriggersOn(trigs []guardTrig) map[uint32][]guardTrig {
	m := map[uint32][]guardTrig{}
	for _, t := range trigs {
		m[t.rel] = append(m[t.rel], t)
	}
	return m
}

func findTrig(ts []guardTrig, name string) *guardTrig {
	for i := range ts {
		if ts[i].name == name {
			return &ts[i]
		}
	}
	return nil
}

// partition is a partition of a protected table, at any depth.
type partition struct {
	oid       uint32
	qualified string
}

func partitionsOf(ctx context.Context, tx pgx.Tx, rel *catalog.Relation) ([]partition, error) {
	if rel.Kind != "p" {
		return nil, nil
	}
	rows, err := tx.Query(ctx, `
		SELECT c.oid, format('%I.%I', n.nspname, c.relname)
		FROM pg_catalog.pg_partition_tree($1::oid::pg_catalog.regclass) t
		JOIN pg_catalog.pg_class c ON c.oid = t.relid
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE t.relid <> $1::oid::pg_catalog.regclass
		ORDER BY t.level, 2`, rel.OID)
	if err != nil {
		return nil, fmt.Errorf("list the partitions of %s: %w", rel.Qualified, err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (partition, error) {
		var p partition
		err := row.Scan(&p.oid, &p.qualified)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("list the partitions of %s: %w", rel.Qualified, err)
	}
	return out, nil
}

// placedGuard is a guard target whose table exists here.
type placedGuard struct {
	*guardTarget
	rel   *catalog.Relation
	parts []partition
}

// placeGuard looks up the targets' tables. A target whose table is
// missing, is not a table, lacks its fence column or is a partition that
// inherits a guard from its partitioned table is left out, with a note
// when setup or check does not already say why.
func placeGuard(ctx context.Context, tx pgx.Tx, targets []*guardTarget) ([]placedGuard, []Note, error) {
	var out []placedGuard
	var notes []Note
	for _, t := range targets {
		rel, err := catalog.LookupTable(ctx, tx, t.spec.Schema, t.spec.Table)
		if err != nil {
			return nil, nil, err
		}
		if rel == nil || !rel.IsTable() {
			continue // noted or reported elsewhere
		}
		if t.spec.Column != "" {
			col, err := catalog.LookupColumn(ctx, tx, rel, t.spec.Column)
			if err != nil {
				return nil, nil, err
			}
			if !col.Exists {
				notes = append(notes, Note{Table: t.spec.Display, Text: fmt.Sprintf("not guarded: its fence column %s is missing", col.Quoted)})
				continue
			}
		}
		if rel.IsPartition {
			var inherited bool
			err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_catalog.pg_trigger WHERE tgrelid = $1 AND tgname = $2 AND tgparentid <> 0)`,
				rel.OID, guardRowTrigger).Scan(&inherited)
			if err != nil {
				return nil, nil, fmt.Errorf("read the triggers of %s: %w", rel.Qualified, err)
			}
			if inherited {
				notes = append(notes, Note{Table: t.spec.Display, Text: "not guarded on its own: it is a partition, and its partitioned table's guard applies to it"})
				continue
			}
		}
		parts, err := partitionsOf(ctx, tx, rel)
		if err != nil {
			return nil, nil, err
		}
		out = append(out, placedGuard{guardTarget: t, rel: rel, parts: parts})
	}
	return out, notes, nil
}

// rowTriggerIssue says what is wrong with the row trigger of p, "" when
// it is as setup installs it.
func (p placedGuard) rowTriggerIssue(on map[uint32][]guardTrig) string {
	tr := findTrig(on[p.rel.OID], guardRowTrigger)
	switch {
	case tr == nil:
		return "trigger " + guardRowTrigger + " is missing"
	case tr.clone:
		return "trigger " + guardRowTrigger + " is inherited from a partitioned table"
	case !tr.ours || tr.fn != p.fn.name:
		return fmt.Sprintf("trigger %s calls %s, not %s", guardRowTrigger, tr.displayFn(), p.fn.qualified())
	case tr.typ != rowGuardType || tr.extra || len(tr.args) > 0:
		return "trigger " + guardRowTrigger + " is not BEFORE INSERT OR UPDATE OR DELETE FOR EACH ROW without arguments or conditions"
	case !enabled(tr.enabled):
		return "trigger " + guardRowTrigger + " is disabled"
	}
	for _, part := range p.parts {
		if c := findTrig(on[part.oid], guardRowTrigger); c == nil || !enabled(c.enabled) {
			return fmt.Sprintf("trigger %s is missing or disabled on partition %s", guardRowTrigger, part.qualified)
		}
	}
	return ""
}

// truncateTriggerIssue says what is wrong with the TRUNCATE trigger of
// relation oid (p's table or one of its partitions), "" when nothing is.
func (p placedGuard) truncateTriggerIssue(on map[uint32][]guardTrig, oid uint32, name string) string {
	what := "trigger " + guardTruncateTrigger
	if oid != p.rel.OID {
		what += " of partition " + name
	}
	tr := findTrig(on[oid], guardTruncateTrigger)
	switch {
	case tr == nil:
		return what + " is missing"
	case tr.clone || !tr.ours || tr.fn != guardTruncateFunc:
		return fmt.Sprintf("%s calls %s, not fenceproxy.%s", what, tr.displayFn(), guardTruncateFunc)
	case tr.typ != truncateGuardType || tr.extra:
		return what + " is not BEFORE TRUNCATE FOR EACH STATEMENT"
	case !slices.Equal(tr.args, []string{p.spec.Display}):
		return fmt.Sprintf("%s has the arguments (%s); the configuration needs (%s)", what, literals(tr.args), literals([]string{p.spec.Display}))
	case !enabled(tr.enabled):
		return what + " is disabled"
	}
	return ""
}

func (t *guardTrig) displayFn() string {
	if t.ours {
		return "fenceproxy." + sqllex.QuoteIdent(t.fn)
	}
	return t.fn
}

// enabled reports whether a trigger fires in ordinary sessions: 'O' (on
// origin, the default) or 'A' (always). 'D' is disabled, 'R' fires only
// under session_replication_role = replica.
func enabled(tgenabled string) bool { return tgenabled == "O" || tgenabled == "A" }

// guardFunctionState is a guard function as the catalog has it.
type guardFunctionState struct {
	body    string
	definer bool
	config  []string
	lang    string
	trigger bool // returns trigger
	nargs   int16
	used    bool // some trigger calls it
}

func readGuardFunctions(ctx context.Context, tx pgx.Tx) (map[string]guardFunctionState, error) {
	rows, err := tx.Query(ctx, `
		SELECT p.proname::text, p.prosrc, p.prosecdef, coalesce(p.proconfig, '{}'), l.lanname::text,
			p.prorettype = 'pg_catalog.trigger'::pg_catalog.regtype, p.pronargs,
			EXISTS (SELECT FROM pg_catalog.pg_trigger t WHERE t.tgfoid = p.oid)
		FROM pg_catalog.pg_proc p
		JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		JOIN pg_catalog.pg_language l ON l.oid = p.prolang
		WHERE n.nspname = 'fenceproxy' AND p.proname LIKE 'guard%'`)
	if err != nil {
		return nil, fmt.Errorf("read the guard's functions: %w", err)
	}
	defer rows.Close()
	m := map[string]guardFunctionState{}
	for rows.Next() {
		var name string
		var f guardFunctionState
		if err := rows.Scan(&name, &f.body, &f.definer, &f.config, &f.lang, &f.trigger, &f.nargs, &f.used); err != nil {
			return nil, fmt.Errorf("read the guard's functions: %w", err)
		}
		if f.nargs == 0 { // overloads with arguments are not the guard's
			m[name] = f
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the guard's functions: %w", err)
	}
	return m, nil
}

// isRowFunction reports whether name is the name of a table's row
// function.
func isRowFunction(name string) bool {
	return strings.HasPrefix(name, guardTableFuncPrefix) && name != guardTruncateFunc && name != guardExemptedFunc && name != guardDDLFunc
}

// is reports whether f is the function setup creates as d (every guard
// function sets search_path).
func (f guardFunctionState) is(d functionDef) bool {
	return f.body == d.body && f.lang == d.lang && f.definer == d.definer && f.trigger == d.trigger &&
		slices.Equal(f.config, []string{guardSearchPath})
}

// guardInstalled reports whether fenceproxy.meta says the guard was
// installed in this database.
func guardInstalled(ctx context.Context, tx pgx.Tx) (bool, error) {
	meta, err := catalog.LookupTable(ctx, tx, "fenceproxy", "meta")
	if err != nil || meta == nil || meta.Kind != "r" {
		return false, err
	}
	var ok bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM fenceproxy.meta WHERE key = 'guard')`).Scan(&ok); err != nil {
		return false, fmt.Errorf("read fenceproxy.meta: %w", err)
	}
	return ok, nil
}

// readExempt returns fenceproxy.guard_exempt's roles, sorted, and whether
// the table exists.
func readExempt(ctx context.Context, tx pgx.Tx) ([]string, bool, error) {
	var exists bool
	err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = 'fenceproxy' AND c.relname = 'guard_exempt' AND c.relkind = 'r')`).Scan(&exists)
	if err != nil || !exists {
		return nil, false, err
	}
	rows, err := tx.Query(ctx, `SELECT role::text FROM fenceproxy.guard_exempt`)
	if err != nil {
		return nil, true, fmt.Errorf("read fenceproxy.guard_exempt: %w", err)
	}
	roles, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, true, fmt.Errorf("read fenceproxy.guard_exempt: %w", err)
	}
	slices.Sort(roles)
	return roles, true, nil
}

// missingRoles returns the roles of names that do not exist, sorted.
func missingRoles(ctx context.Context, tx pgx.Tx, names []string) ([]string, error) {
	if len(names) == 0 {
		return nil, nil
	}
	rows, err := tx.Query(ctx, `SELECT r FROM pg_catalog.unnest($1::text[]) r
		WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r)`, names)
	if err != nil {
		return nil, fmt.Errorf("look up the exempt roles: %w", err)
	}
	missing, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("look up the exempt roles: %w", err)
	}
	slices.Sort(missing)
	return missing, nil
}

// guardFingerprint describes the fenceproxy schema's objects and the
// guard's mark in fenceproxy.meta, so that Install can tell whether
// installing guard.sql changed anything.
func guardFingerprint(ctx context.Context, tx pgx.Tx) ([]string, error) {
	fp, err := catalog.SchemaFingerprint(ctx, tx, "fenceproxy")
	if err != nil {
		return nil, err
	}
	var v *string
	err = tx.QueryRow(ctx, `SELECT value FROM fenceproxy.meta WHERE key = 'guard'`).Scan(&v)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("read fenceproxy.meta: %w", err)
	}
	if v != nil {
		fp = append(fp, "guard "+*v)
	}
	return fp, nil
}
