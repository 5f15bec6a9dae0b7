package dbsetup

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
	"github.com/fenceproxy/fenceproxy/internal/guard"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// target is one protected table of the checked database, with what its
// entries need of it.
type target struct {
	spec     rules.TableSpec // the first entry's names and index
	columns  []string        // fence columns, exact names
	lock     bool            // some entry uses lock fencing
	explicit bool            // some entry's scope.databases names this database
	// users limits the privilege check to these roles when every entry
	// lists users; nil means every login role.
	users    []string
	allUsers bool
}

// targets groups the entries that apply in database db by table, in
// configuration order.
func targets(specs []rules.TableSpec, db string) []*target {
	var out []*target
	byName := map[[2]string]*target{}
	for _, s := range specs {
		if !appliesIn(s, db) {
			continue
		}
		t := byName[[2]string{s.Schema, s.Table}]
		if t == nil {
			t = &target{spec: s}
			byName[[2]string{s.Schema, s.Table}] = t
			out = append(out, t)
		}
		if s.Column != "" && !slices.Contains(t.columns, s.Column) {
			t.columns = append(t.columns, s.Column)
		}
		t.lock = t.lock || s.Lock != rules.LockOff
		t.explicit = t.explicit || len(s.Scope.Databases) > 0
		if len(s.Scope.Users) == 0 {
			t.allUsers = true
		}
		t.users = append(t.users, s.Scope.Users...)
	}
	for _, t := range out {
		if t.allUsers {
			t.users = nil
		} else {
			slices.Sort(t.users)
			t.users = slices.Compact(t.users)
		}
	}
	return out
}

// Check reports, without changing anything, what keeps the database conn
// is connected to from working with specs. Only entries that apply in this
// database (mode not off, scope.databases empty or naming it) are checked:
//
//   - The table exists and is a table. A missing table is a problem only
//     when an entry's scope.databases names this database; an entry without
//     a database scope applies in every database the proxy serves, most of
//     which need not have the table, so there it is a Note.
//   - Each fence column exists, is bigint, NOT NULL and DEFAULT 0 (one
//     problem each).
//   - When an entry uses lock fencing (lock not off): the fenceproxy schema,
//     its tables and the register procedure exist, fenceproxy.meta holds
//     version Version and the procedure's source is objects.sql's, or an
//     older version (with a note) with its own procedure or this one.
//   - Whether the error raisers are current and callable by all
//     (Report.Raisers), with or without lock fencing.
//   - Privileges: every login role that is not a superuser and may SELECT,
//     INSERT, UPDATE or DELETE the table (restricted to the roles an
//     entry's scope.users lists, when every entry lists some) has USAGE on
//     schema fenceproxy and EXECUTE on the register procedure (lock
//     fencing), and the fence-column privileges the rewritten writes use:
//     UPDATE and SELECT for UPDATE (the new watermark is computed from the
//     old), INSERT for INSERT, SELECT for DELETE (its condition reads the
//     column).
//   - The database guard, where it is installed (fenceproxy.meta has its
//     mark, or a table has its triggers): each table it belongs on has its
//     triggers, enabled and with the arguments the configuration gives,
//     calling functions that are this fenceproxy's; no other table has
//     them; the exempt roles are guard.exempt_roles. Report.Guarded lists
//     the tables whose guard is in place.
//   - Whether the catalog watch is in place (Report.Watched), with a note
//     when the fenceproxy schema is there without it and some table in
//     mode enforce is not guarded.
//
// It runs in a read-only transaction. An error means the check could not
// run; problems found are in the Report.
//
// Check compares the guard with the defaults for what specs do not carry
// (the settings, on_stale, strict, missing_token, no exempt roles): use
// CheckWith to give them.
func Check(ctx context.Context, conn *pgx.Conn, specs []rules.TableSpec) (Report, error) {
	return CheckWith(ctx, conn, specs, CheckOptions{})
}

// CheckOptions is what CheckWith takes from the configuration besides its
// entries, to compare the database guard with. The zero value stands for
// the defaults.
type CheckOptions struct {
	// TokenSetting and LockSetting are the configuration's token_setting
	// and lock_setting. Default rules.DefaultTokenSetting and
	// rules.DefaultLockSetting.
	TokenSetting, LockSetting string
	// Tables are the configuration's entries (rules.Config.Tables), which
	// TableSpec.Index indexes. nil: every entry has the default on_stale,
	// strict and missing_token.
	Tables []rules.Table
	// ExemptRoles is guard.exempt_roles.
	ExemptRoles []string
}

// checkAttempts bounds how many times CheckWith reads the catalog again
// when a table was dropped while it read it.
const checkAttempts = 3

// CheckWith is Check, comparing the database guard with opts.
func CheckWith(ctx context.Context, conn *pgx.Conn, specs []rules.TableSpec, opts CheckOptions) (Report, error) {
	for i := 1; ; i++ {
		// A table dropped and created again on another connection while
		// the check reads it (catalog.ErrChanged): read it all again, in
		// a new snapshot, rather than report what was half gone.
		rep, err := checkOnce(ctx, conn, specs, opts)
		if !errors.Is(err, catalog.ErrChanged) || i == checkAttempts {
			return rep, err
		}
	}
}

// checkOnce is CheckWith's one reading of the catalog, in one snapshot.
func checkOnce(ctx context.Context, conn *pgx.Conn, specs []rules.TableSpec, opts CheckOptions) (Report, error) {
	var rep Report
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return rep, fmt.Errorf("dbsetup: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := tx.QueryRow(ctx, "SELECT pg_catalog.current_database()").Scan(&rep.Database); err != nil {
		return rep, fmt.Errorf("dbsetup: %w", err)
	}
	fail := func(err error) (Report, error) {
		return Report{Database: rep.Database}, fmt.Errorf("dbsetup: check database %q: %w", rep.Database, err)
	}
	ts := targets(specs, rep.Database)
	lock := slices.ContainsFunc(ts, func(t *target) bool { return t.lock })

	obj, err := readObjects(ctx, tx)
	if err != nil {
		return fail(err)
	}
	rep.Version = obj.version
	if lock {
		rep.Problems = append(rep.Problems, objectProblems(obj)...)
	}
	rep.Raisers = obj.raisers && obj.hasVersion && obj.version >= raisersVersion && obj.version <= Version
	rep.StaleAt = rep.Raisers && obj.staleAt && obj.version >= staleAtVersion
	rep.Hold = obj.hold && obj.registerCurrent && obj.version >= holdVersion && obj.version <= Version
	rep.Enter = rep.Hold && obj.enter && obj.version >= enterVersion
	rep.HoldAt = rep.Enter && obj.holdAt && obj.version >= holdAtVersion
	rep.ReholdAt = rep.HoldAt && obj.reholdAt && obj.version >= reholdAtVersion
	if obj.hasVersion && obj.version < Version && obj.version >= lockVersion {
		gain := ""
		if obj.version < nameIndexVersion {
			gain = "with which the read of a lock's watermark compares names byte by byte, not under the database's collation"
		}
		if obj.version < reholdAtVersion {
			gain = "with which a lock registration reads the watermark once, not twice, for a session that registered the same token before"
		}
		if obj.version < holdAtVersion {
			gain = "with which fenceproxy sends one statement of its own, not four, in front of a simple Query that registers a lock"
		}
		if obj.version < enterVersion {
			gain = "with which fenceproxy sends one statement of its own, not three, before a statement of the extended protocol on a protected table"
		}
		if obj.version < holdVersion {
			gain = "whose lock registration costs the server less"
		}
		if obj.version < staleAtVersion {
			gain = "whose lock registration and error raiser for a stale row cost the server less"
		}
		if obj.version < registerV4Version {
			gain = "whose lock registration and error raisers cost the server less"
		}
		if obj.version < raisersVersion {
			gain = "whose error raisers and lock registration make fenced writes cheaper for the server"
		}
		rep.Notes = append(rep.Notes, Note{Text: fmt.Sprintf("the fenceproxy objects are version %d: fenceproxy setup upgrades them to version %d, %s", obj.version, Version, gain)})
	}
	for _, t := range ts {
		ps, notes, err := checkTable(ctx, tx, t, obj, rep.Database)
		if err != nil {
			return fail(err)
		}
		rep.Problems = append(rep.Problems, ps...)
		rep.Notes = append(rep.Notes, notes...)
	}
	gps, guarded, err := guard.Check(ctx, tx, applying(specs, rep.Database), guard.Config{
		TokenSetting: opts.TokenSetting, LockSetting: opts.LockSetting, Tables: opts.Tables, ExemptRoles: opts.ExemptRoles})
	if err != nil {
		return fail(err)
	}
	for _, p := range gps {
		rep.Problems = append(rep.Problems, guardProblem(p))
	}
	rep.Guarded = guarded
	var current bool
	if rep.CheckProc, current, err = readWatch(ctx, tx); err != nil {
		return fail(err)
	}
	rep.Watched = rep.CheckProc != ""
	if rep.Watched && !current {
		rep.Notes = append(rep.Notes, Note{Text: "the catalog watch is of an earlier version: it may not count every change that opens a path " +
			"(a view renamed with ALTER INDEX), and its check may cost writes more; fenceproxy setup, run as a superuser, upgrades it"})
	}
	if !rep.Watched && obj.schema && unguardedEnforced(specs, rep.Database, guarded) {
		rep.Notes = append(rep.Notes, Note{Text: "the catalog watch is not installed: a view, rule, parent or foreign key created " +
			"on another connection is seen by the proxy at its next check only (fenceproxy setup, run as a superuser, installs it)"})
	}
	return rep, nil
}

// unguardedEnforced reports whether an entry in mode enforce applies in
// database db to a table that is not in guarded: writes that reach such a
// table through a new path must be refused.
func unguardedEnforced(specs []rules.TableSpec, db string, guarded []string) bool {
	for _, s := range specs {
		if s.Mode == rules.ModeEnforce && appliesIn(s, db) && !slices.Contains(guarded, s.Display) {
			return true
		}
	}
	return false
}

// objectProblems reports missing or outdated fenceproxy objects.
func objectProblems(o objects) []Problem {
	switch {
	case !o.schema:
		return []Problem{setupProblem("", "the fenceproxy schema is missing: lock fencing needs its lock watermarks and register procedure", "", "")}
	case !o.meta || !o.locks || !o.register:
		var missing []string
		for _, m := range []struct {
			ok   bool
			name string
		}{{o.meta, "table fenceproxy.meta"}, {o.locks, "table fenceproxy.locks"}, {o.register, "procedure " + registerSignature}} {
			if !m.ok {
				missing = append(missing, m.name)
			}
		}
		return []Problem{setupProblem("", "the fenceproxy objects are incomplete: missing "+strings.Join(missing, ", "), "", "")}
	case o.badVersion != nil:
		return []Problem{setupProblem("", fmt.Sprintf("fenceproxy.meta holds version %q, not a version number", *o.badVersion), "", "")}
	case !o.hasVersion:
		return []Problem{setupProblem("", "fenceproxy.meta holds no version", "", "")}
	case o.version < lockVersion:
		return []Problem{setupProblem("", fmt.Sprintf("the fenceproxy objects are version %d, older than this fenceproxy's version %d: run fenceproxy setup to upgrade them", o.version, Version), "", "")}
	case o.version <= Version && !o.registerCurrent && !(o.registerV1 && o.version < registerV4Version):
		return []Problem{setupProblem("", fmt.Sprintf("procedure fenceproxy.register is not this fenceproxy's (version %d): it was replaced, or installed by another build", Version), "", "")}
	case o.version > Version:
		return []Problem{{
			Description: fmt.Sprintf("the fenceproxy objects are version %d, newer than this fenceproxy's version %d: this fenceproxy is older than the objects", o.version, Version),
			Fix:         fmt.Sprintf("upgrade fenceproxy to a release that uses objects of version %d", o.version),
		}}
	}
	return nil
}

// kindName names pg_class.relkind values for messages.
var kindName = map[string]string{
	"v": "a view", "m": "a materialized view", "f": "a foreign table", "S": "a sequence",
	"i": "an index", "I": "a partitioned index", "c": "a composite type", "t": "a TOAST table",
}

// zeroDefaults are the ways pg_get_expr prints a default of zero for a
// bigint column (DEFAULT 0, DEFAULT 0::bigint, DEFAULT '0').
var zeroDefaults = map[string]bool{"0": true, "0::bigint": true, "(0)::bigint": true, "'0'::bigint": true}

// checkTable checks one protected table.
func checkTable(ctx context.Context, tx pgx.Tx, t *target, obj objects, db string) ([]Problem, []Note, error) {
	s := t.spec
	rel, err := catalog.LookupTable(ctx, tx, s.Schema, s.Table)
	if err != nil {
		return nil, nil, err
	}
	if rel == nil {
		if !t.explicit {
			return nil, []Note{{Table: s.Display, Text: "not present in this database (the entry has no database scope: it applies wherever the table exists)"}}, nil
		}
		return []Problem{sqlProblem(s.Display,
			fmt.Sprintf("the table does not exist, but tables[%d].scope.databases names database %q", s.Index, db),
			fmt.Sprintf("create the table, or remove %q from the entry's scope.databases", db))}, nil, nil
	}
	if !rel.IsTable() {
		kind := kindName[rel.Kind]
		if kind == "" {
			kind = "relkind " + rel.Kind
		}
		return []Problem{sqlProblem(s.Display,
			fmt.Sprintf("%s is %s, not a table: fenceproxy fences tables", rel.Qualified, kind),
			fmt.Sprintf("name the table that holds the data in tables[%d].table", s.Index))}, nil, nil
	}
	var ps []Problem
	var cols []*catalog.Column
	for _, name := range t.columns {
		col, err := catalog.LookupColumn(ctx, tx, rel, name)
		if err != nil {
			return nil, nil, err
		}
		ps = append(ps, columnProblems(s.Display, rel, col)...)
		if col.Exists {
			cols = append(cols, col)
		}
	}
	pp, err := privilegeProblems(ctx, tx, t, rel, cols, obj)
	if err != nil {
		return nil, nil, err
	}
	return append(ps, pp...), nil, nil
}

// columnProblems checks a fence column's type, nullability and default.
func columnProblems(table string, rel *catalog.Relation, col *catalog.Column) []Problem {
	alter := "ALTER TABLE " + rel.Qualified + " ALTER COLUMN " + col.Quoted
	if !col.Exists {
		if rel.IsPartition {
			return []Problem{sqlProblem(table,
				fmt.Sprintf("fence column %s is missing; %s is a partition, which takes its columns from its partitioned table", col.Quoted, rel.Qualified),
				fmt.Sprintf("add the column to the partitioned table: ALTER TABLE <partitioned table> ADD COLUMN %s bigint NOT NULL DEFAULT 0;", col.Quoted))}
		}
		return []Problem{setupProblem(table, fmt.Sprintf("fence column %s is missing", col.Quoted), " --add-columns",
			addColumnSQL(rel, col)+";")}
	}
	var ps []Problem
	if !col.Bigint {
		ps = append(ps, sqlProblem(table,
			fmt.Sprintf("fence column %s is %s, not bigint", col.Quoted, col.Type),
			fmt.Sprintf("%s TYPE bigint USING %s::bigint;", alter, col.Quoted)))
	}
	if !col.NotNull {
		ps = append(ps, sqlProblem(table,
			fmt.Sprintf("fence column %s allows NULL: it must be NOT NULL", col.Quoted),
			fmt.Sprintf("UPDATE %s SET %s = 0 WHERE %s IS NULL; %s SET NOT NULL;", rel.Qualified, col.Quoted, col.Quoted, alter)))
	}
	switch {
	case col.Generated != "":
		ps = append(ps, sqlProblem(table,
			fmt.Sprintf("fence column %s is a generated column: it must be a plain column with DEFAULT 0", col.Quoted),
			fmt.Sprintf("%s DROP EXPRESSION; %s SET DEFAULT 0;", alter, alter)))
	case col.Identity != "":
		ps = append(ps, sqlProblem(table,
			fmt.Sprintf("fence column %s is an identity column: it must be a plain column with DEFAULT 0", col.Quoted),
			fmt.Sprintf("%s DROP IDENTITY; %s SET DEFAULT 0;", alter, alter)))
	case col.Default == nil:
		ps = append(ps, sqlProblem(table,
			fmt.Sprintf("fence column %s has no default: it must be DEFAULT 0", col.Quoted),
			alter+" SET DEFAULT 0;"))
	case !zeroDefaults[*col.Default]:
		ps = append(ps, sqlProblem(table,
			fmt.Sprintf("fence column %s has DEFAULT %s: it must be DEFAULT 0", col.Quoted, *col.Default),
			alter+" SET DEFAULT 0;"))
	}
	return ps
}

// privilegeProblems checks what the login roles that may use the table
// need for fenced statements.
func privilegeProblems(ctx context.Context, tx pgx.Tx, t *target, rel *catalog.Relation, cols []*catalog.Column, obj objects) ([]Problem, error) {
	attnums := make([]int16, len(cols))
	for i, c := range cols {
		attnums[i] = c.Attnum
	}
	// The schema and procedure checks are skipped (true) when the objects
	// are missing: objectProblems reports that once.
	rows, err := tx.Query(ctx, `
		WITH ns AS (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = 'fenceproxy'),
		reg AS (SELECT p.oid FROM pg_catalog.pg_proc p JOIN ns ON p.pronamespace = ns.oid
			WHERE p.proname = 'register' AND p.prokind = 'p' AND p.proargtypes = '25 25 16 16 25 25'::pg_catalog.oidvector)
		SELECT r.rolname::text, format('%I', r.rolname),
			has_any_column_privilege(r.oid, $1::oid, 'SELECT'),
			has_any_column_privilege(r.oid, $1::oid, 'INSERT'),
			has_any_column_privilege(r.oid, $1::oid, 'UPDATE'),
			has_table_privilege(r.oid, $1::oid, 'DELETE'),
			coalesce(has_schema_privilege(r.oid, (SELECT oid FROM ns), 'USAGE'), true),
			coalesce(has_function_privilege(r.oid, (SELECT oid FROM reg), 'EXECUTE'), true),
			ARRAY(SELECT has_column_privilege(r.oid, $1::oid, a, 'SELECT') FROM unnest($2::int2[]) WITH ORDINALITY AS u(a, i) ORDER BY i),
			ARRAY(SELECT has_column_privilege(r.oid, $1::oid, a, 'INSERT') FROM unnest($2::int2[]) WITH ORDINALITY AS u(a, i) ORDER BY i),
			ARRAY(SELECT has_column_privilege(r.oid, $1::oid, a, 'UPDATE') FROM unnest($2::int2[]) WITH ORDINALITY AS u(a, i) ORDER BY i)
		FROM pg_catalog.pg_roles r
		WHERE r.rolcanlogin AND NOT r.rolsuper AND ($3::text[] IS NULL OR r.rolname = ANY ($3::text[]))
		ORDER BY r.rolname`, rel.OID, attnums, t.users)
	if err != nil {
		return nil, fmt.Errorf("read privileges on %s: %w", rel.Qualified, err)
	}
	defer rows.Close()
	var ps []Problem
	for rows.Next() {
		var role, quoted string
		var sel, ins, upd, del, usage, execute bool
		var colSel, colIns, colUpd []bool
		if err := rows.Scan(&role, &quoted, &sel, &ins, &upd, &del, &usage, &execute, &colSel, &colIns, &colUpd); err != nil {
			return nil, fmt.Errorf("read privileges on %s: %w", rel.Qualified, err)
		}
		var may []string
		for _, p := range []struct {
			ok   bool
			name string
		}{{sel, "SELECT"}, {ins, "INSERT"}, {upd, "UPDATE"}, {del, "DELETE"}} {
			if p.ok {
				may = append(may, p.name)
			}
		}
		if len(may) == 0 {
			continue
		}
		var lacks, grants []string
		if t.lock && obj.schema && !usage {
			lacks = append(lacks, "USAGE on schema fenceproxy")
			grants = append(grants, "GRANT USAGE ON SCHEMA fenceproxy TO "+quoted+";")
		}
		if t.lock && obj.register && !execute {
			lacks = append(lacks, "EXECUTE on procedure fenceproxy.register")
			grants = append(grants, "GRANT EXECUTE ON PROCEDURE "+registerSignature+" TO "+quoted+";")
		}
		for i, c := range cols {
			var privs []string
			if (upd || del) && !colSel[i] {
				privs = append(privs, "SELECT")
			}
			if ins && !colIns[i] {
				privs = append(privs, "INSERT")
			}
			if upd && !colUpd[i] {
				privs = append(privs, "UPDATE")
			}
			if len(privs) == 0 {
				continue
			}
			lacks = append(lacks, strings.Join(privs, ", ")+" on fence column "+c.Quoted)
			for j := range privs {
				privs[j] += " (" + c.Quoted + ")"
			}
			grants = append(grants, "GRANT "+strings.Join(privs, ", ")+" ON "+rel.Qualified+" TO "+quoted+";")
		}
		if len(lacks) == 0 {
			continue
		}
		ps = append(ps, sqlProblem(t.spec.Display,
			fmt.Sprintf("login role %s may %s the table but lacks %s", quoted, strings.Join(may, ", "), strings.Join(lacks, " and ")),
			strings.Join(grants, " ")))
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read privileges on %s: %w", rel.Qualified, err)
	}
	return ps, nil
}
