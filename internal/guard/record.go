package guard

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// The guard against DDL: fenceproxy.guard_triggers records the guard's
// triggers as setup leaves them, and the event trigger fenceproxy_guard_ddl
// (fenceproxy.guard_ddl(), guard.sql) undoes any command of a session the
// guard does not exempt after which one of them is gone, disabled or
// changed: a drop of the table, of a partition, of the trigger, of what
// owns the table (DROP OWNED, DROP EXTENSION, DROP SCHEMA … CASCADE), in
// whatever spelling, also when stored code builds it at run time, where
// the proxy sees only the call. Setup forgets the triggers of a relation
// before it changes them and records them again at the end, in its own
// transaction, so its own DDL passes.

// guardedRel is a relation whose guard triggers setup records: a guarded
// table or one of its partitions, with the protected table's display
// name.
type guardedRel struct {
	oid     uint32
	display string
	col     string // the fence column; "" for none
}

// guardedRels returns the relations of placed, tables and partitions.
func guardedRels(placed []placedGuard) []guardedRel {
	var out []guardedRel
	for _, p := range placed {
		out = append(out, guardedRel{p.rel.OID, p.spec.Display, p.spec.Column})
		for _, part := range p.parts {
			out = append(out, guardedRel{part.oid, p.spec.Display, p.spec.Column})
		}
	}
	return out
}

// recordExists reports whether fenceproxy.guard_triggers exists.
func recordExists(ctx context.Context, tx pgx.Tx) (bool, error) {
	var ok bool
	err := tx.QueryRow(ctx, `SELECT pg_catalog.to_regclass('fenceproxy.guard_triggers') IS NOT NULL`).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("look up fenceproxy.guard_triggers: %w", err)
	}
	return ok, nil
}

// forgetTriggers removes the record of the triggers on the relations
// oids, before setup changes or drops them.
func forgetTriggers(ctx context.Context, tx pgx.Tx, oids []uint32) error {
	if len(oids) == 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, `WITH r AS (DELETE FROM fenceproxy.guard_relations WHERE relid::pg_catalog.oid = ANY($1::oid[]))
		DELETE FROM fenceproxy.guard_triggers WHERE relid::pg_catalog.oid = ANY($1::oid[])`, oids); err != nil {
		return fmt.Errorf("update fenceproxy.guard_triggers: %w", err)
	}
	return nil
}

// forgetTriggersExcept removes the record of the triggers on every
// relation but those of keep.
func forgetTriggersExcept(ctx context.Context, tx pgx.Tx, keep map[uint32]bool) error {
	oids := make([]uint32, 0, len(keep))
	for oid := range keep {
		oids = append(oids, oid)
	}
	if _, err := tx.Exec(ctx, `WITH r AS (DELETE FROM fenceproxy.guard_relations WHERE relid::pg_catalog.oid <> ALL($1::oid[]))
		DELETE FROM fenceproxy.guard_triggers WHERE relid::pg_catalog.oid <> ALL($1::oid[])`, oids); err != nil {
		return fmt.Errorf("update fenceproxy.guard_triggers: %w", err)
	}
	return nil
}

// wantedRecordSQL selects the record the triggers of the relations $1
// (display names $2) call for: each of the guard's triggers there that
// calls a function of schema fenceproxy. A disabled one is recorded too:
// check reports it on its own, and the event trigger refuses DDL until it
// fires again.
const wantedRecordSQL = `
	SELECT t.tgrelid::pg_catalog.regclass AS relid, t.tgname AS name, p.proname AS fn, t.tgtype AS typ, d.display
	FROM ROWS FROM (pg_catalog.unnest($1::oid[]), pg_catalog.unnest($2::text[])) d(relid, display)
	JOIN pg_catalog.pg_trigger t ON t.tgrelid = d.relid AND t.tgname IN ($3, $4)
	JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid
	JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
	WHERE n.nspname = 'fenceproxy'`

// wantedRelationsSQL selects the record of the relations $1 (display
// names $2, fence columns $3, "" for none) as guard_relations keeps it.
const wantedRelationsSQL = `
	SELECT c.oid::pg_catalog.regclass AS relid, c.relpersistence AS persistence, a.attname AS col, a.attnum AS colnum,
		a.atttypid::pg_catalog.regtype AS coltype,
		ARRAY(SELECT pg_catalog.format('%s %s', t.tgname, t.tgfoid::pg_catalog.regprocedure) FROM pg_catalog.pg_trigger t
			WHERE t.tgrelid = c.oid AND NOT t.tgisinternal AND (t.tgtype & 3) = 3 AND (t.tgtype & 20) <> 0
				AND t.tgname COLLATE "C" > 'fenceproxy_guard'
			ORDER BY 1) AS later,
		d.display
	FROM ROWS FROM (pg_catalog.unnest($1::oid[]), pg_catalog.unnest($2::text[]), pg_catalog.unnest($3::text[])) d(relid, display, col)
	JOIN pg_catalog.pg_class c ON c.oid = d.relid
	LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attname = d.col AND NOT a.attisdropped AND a.attnum > 0`

func relationArgs(rels []guardedRel) []any {
	oids := make([]uint32, len(rels))
	names := make([]string, len(rels))
	cols := make([]string, len(rels))
	for i, r := range rels {
		oids[i], names[i], cols[i] = r.oid, r.display, r.col
	}
	return []any{oids, names, cols}
}

func recordArgs(rels []guardedRel) []any {
	oids := make([]uint32, len(rels))
	names := make([]string, len(rels))
	for i, r := range rels {
		oids[i], names[i] = r.oid, r.display
	}
	return []any{oids, names, guardRowTrigger, guardTruncateTrigger}
}

// recordTriggers brings fenceproxy.guard_triggers in line with the
// triggers of rels, writing nothing when it already is; it reports
// whether it changed the record.
func recordTriggers(ctx context.Context, tx pgx.Tx, rels []guardedRel) (bool, error) {
	args := recordArgs(rels)
	del, err := tx.Exec(ctx, `WITH want AS (`+wantedRecordSQL+`)
		DELETE FROM fenceproxy.guard_triggers g
		WHERE NOT EXISTS (SELECT FROM want w WHERE (w.relid, w.name, w.fn, w.typ, w.display) = (g.relid, g.name, g.fn, g.typ, g.display))`, args...)
	if err != nil {
		return false, fmt.Errorf("update fenceproxy.guard_triggers: %w", err)
	}
	ins, err := tx.Exec(ctx, `INSERT INTO fenceproxy.guard_triggers (relid, name, fn, typ, display)
		SELECT w.relid, w.name, w.fn, w.typ, w.display FROM (`+wantedRecordSQL+`) w
		WHERE NOT EXISTS (SELECT FROM fenceproxy.guard_triggers g WHERE (g.relid, g.name) = (w.relid, w.name))`, args...)
	if err != nil {
		return false, fmt.Errorf("update fenceproxy.guard_triggers: %w", err)
	}
	rdel, err := tx.Exec(ctx, `WITH want AS (`+wantedRelationsSQL+`)
		DELETE FROM fenceproxy.guard_relations g
		WHERE NOT EXISTS (SELECT FROM want w WHERE (w.relid, w.persistence, w.col, w.colnum, w.coltype, w.later, w.display)
			IS NOT DISTINCT FROM (g.relid, g.persistence, g.col, g.colnum, g.coltype, g.later, g.display))`, relationArgs(rels)...)
	if err != nil {
		return false, fmt.Errorf("update fenceproxy.guard_relations: %w", err)
	}
	rins, err := tx.Exec(ctx, `INSERT INTO fenceproxy.guard_relations (relid, persistence, col, colnum, coltype, later, display)
		SELECT * FROM (`+wantedRelationsSQL+`) w
		WHERE NOT EXISTS (SELECT FROM fenceproxy.guard_relations g WHERE g.relid = w.relid)`, relationArgs(rels)...)
	if err != nil {
		return false, fmt.Errorf("update fenceproxy.guard_relations: %w", err)
	}
	return del.RowsAffected()+ins.RowsAffected()+rdel.RowsAffected()+rins.RowsAffected() > 0, nil
}

// recordCurrent reports whether fenceproxy.guard_triggers is what
// recordTriggers would make it for rels.
func recordCurrent(ctx context.Context, tx pgx.Tx, rels []guardedRel) (bool, error) {
	var differ bool
	err := tx.QueryRow(ctx, `WITH want AS (`+wantedRecordSQL+`),
		have AS (SELECT relid, name, fn, typ, display FROM fenceproxy.guard_triggers)
		SELECT EXISTS (SELECT * FROM want EXCEPT SELECT * FROM have) OR EXISTS (SELECT * FROM have EXCEPT SELECT * FROM want)`,
		recordArgs(rels)...).Scan(&differ)
	if err != nil {
		return false, fmt.Errorf("read fenceproxy.guard_triggers: %w", err)
	}
	if differ {
		return false, nil
	}
	err = tx.QueryRow(ctx, `WITH want AS (`+wantedRelationsSQL+`),
		have AS (SELECT relid, persistence, col, colnum, coltype, later, display FROM fenceproxy.guard_relations)
		SELECT EXISTS (SELECT * FROM want EXCEPT SELECT * FROM have) OR EXISTS (SELECT * FROM have EXCEPT SELECT * FROM want)`,
		relationArgs(rels)...).Scan(&differ)
	if err != nil {
		return false, fmt.Errorf("read fenceproxy.guard_relations: %w", err)
	}
	return !differ, nil
}

// guardEventTrigger is one of the guard's event triggers, both calling
// fenceproxy.guard_ddl().
type guardEventTrigger struct{ name, event string }

var guardEventTriggers = []guardEventTrigger{{guardDDLTrigger, "ddl_command_end"}, {guardRewriteTrigger, "table_rewrite"}}

// ddlTriggerState returns the event trigger's pg_event_trigger.evtenabled
// ("" when it is missing) and whether it calls fenceproxy.guard_ddl() on
// its event, for every command.
func ddlTriggerState(ctx context.Context, tx pgx.Tx, et guardEventTrigger) (enabled string, ours bool, err error) {
	err = tx.QueryRow(ctx, `
		SELECT coalesce(max(e.evtenabled::text), ''),
			coalesce(bool_and(e.evtfoid = pg_catalog.to_regprocedure('fenceproxy.guard_ddl()') AND e.evtevent = $2
				AND e.evttags IS NULL), false)
		FROM pg_catalog.pg_event_trigger e WHERE e.evtname = $1`, et.name, et.event).Scan(&enabled, &ours)
	if err != nil {
		return "", false, fmt.Errorf("read event trigger %s: %w", et.name, err)
	}
	return enabled, ours, nil
}

// isSuperuser reports whether the connecting role is a superuser.
func isSuperuser(ctx context.Context, tx pgx.Tx) (bool, error) {
	var super bool
	if err := tx.QueryRow(ctx, `SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user`).Scan(&super); err != nil {
		return false, fmt.Errorf("read the connecting role: %w", err)
	}
	return super, nil
}

// ddlTriggerNote is the note of a guard without its event trigger.
const ddlTriggerNote = "the database guard's event triggers " + guardDDLTrigger + " and " + guardRewriteTrigger + " need a superuser and are not installed: " +
	"without it, stored code that builds its DDL at run time (EXECUTE 'DROP ' || ...), DROP OWNED or DROP EXTENSION in it, " +
	"or a direct connection can drop a guarded table or its guard; run fenceproxy setup --guard as a superuser once"

// installDDLTrigger creates or enables the event triggers, as a
// superuser; otherwise it notes that they are missing.
func installDDLTrigger(ctx context.Context, tx pgx.Tx, rep *Result) error {
	noted := false
	var created []string
	defer func() {
		if len(created) > 0 {
			rep.Actions = append(rep.Actions, "installed the guard's event triggers ("+strings.Join(created, ", ")+"), which refuse DDL that drops a guarded table or weakens its guard")
		}
	}()
	for _, et := range guardEventTriggers {
		state, ours, err := ddlTriggerState(ctx, tx, et)
		if err != nil {
			return err
		}
		if ours && (state == "O" || state == "A") {
			continue
		}
		super, err := isSuperuser(ctx, tx)
		if err != nil {
			return err
		}
		if !super {
			if !noted {
				rep.Notes = append(rep.Notes, Note{Text: ddlTriggerNote})
				noted = true
			}
			continue
		}
		create := `CREATE EVENT TRIGGER ` + et.name + ` ON ` + et.event + ` EXECUTE FUNCTION fenceproxy.` + guardDDLFunc + `()`
		switch {
		case state == "":
			if _, err := tx.Exec(ctx, create); err != nil {
				return fmt.Errorf("create event trigger %s: %w", et.name, err)
			}
			created = append(created, et.name)
		case !ours:
			if _, err := tx.Exec(ctx, `DROP EVENT TRIGGER `+et.name+`; `+create); err != nil {
				return fmt.Errorf("replace event trigger %s: %w", et.name, err)
			}
			rep.Actions = append(rep.Actions, "replaced the event trigger "+et.name+", which was not the guard's")
		default:
			if _, err := tx.Exec(ctx, `ALTER EVENT TRIGGER `+et.name+` ENABLE`); err != nil {
				return fmt.Errorf("enable event trigger %s: %w", et.name, err)
			}
			rep.Actions = append(rep.Actions, "enabled the guard's event trigger "+et.name)
		}
	}
	return nil
}
