package guard

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// rowTriggerSQL creates or replaces the row trigger of p (and so its
// partitions' clones, enabled).
func rowTriggerSQL(p placedGuard) string {
	return "CREATE OR REPLACE TRIGGER " + guardRowTrigger + " BEFORE INSERT OR UPDATE OR DELETE ON " + p.rel.Qualified +
		" FOR EACH ROW EXECUTE FUNCTION " + p.fn.qualified() + "()"
}

// truncateTriggerSQL creates or replaces the TRUNCATE trigger of the
// relation qualified, a protected table or one of its partitions.
func truncateTriggerSQL(qualified, display string) string {
	return "CREATE OR REPLACE TRIGGER " + guardTruncateTrigger + " BEFORE TRUNCATE ON " + qualified +
		" FOR EACH STATEMENT EXECUTE FUNCTION fenceproxy." + guardTruncateFunc + "(" + sqllex.QuoteLiteral(display) + ")"
}

// Install brings the guard of the database tx is in in line with specs,
// the entries that apply in this database, and cfg: it installs guard.sql
// and the row functions the tables need, sets the exempt roles, creates or
// replaces the triggers that differ, and removes the guard from tables it
// no longer belongs on and the functions no table uses. The fenceproxy
// objects (internal/dbsetup's objects.sql) must be in place.
func Install(ctx context.Context, tx pgx.Tx, specs []rules.TableSpec, cfg Config) (Result, error) {
	var rep Result
	err := install(ctx, tx, specs, newGuardConfig(cfg), &rep)
	return rep, err
}

func install(ctx context.Context, tx pgx.Tx, specs []rules.TableSpec, g guardConfig, rep *Result) error {
	targets, skipped, err := planGuard(specs, g)
	if err != nil {
		return err
	}
	placed, notes, err := placeGuard(ctx, tx, targets)
	if err != nil {
		return err
	}
	rep.Notes = append(rep.Notes, notes...)
	for _, u := range skipped {
		rel, err := catalog.LookupTable(ctx, tx, u.spec.Schema, u.spec.Table)
		if err != nil {
			return err
		}
		if rel != nil {
			rep.Notes = append(rep.Notes, Note{Table: u.spec.Display, Text: "not guarded: " + u.reason})
		}
	}
	if missing, err := missingRoles(ctx, tx, g.exemptRoles); err != nil {
		return err
	} else if len(missing) > 0 {
		return fmt.Errorf("guard.exempt_roles: no such role: %s", strings.Join(missing, ", "))
	}

	// The shared objects: rolled back when they were already in place, as
	// dbsetup does with objects.sql.
	before, err := guardFingerprint(ctx, tx)
	if err != nil {
		return err
	}
	had := slices.ContainsFunc(before, func(s string) bool { return strings.HasPrefix(s, "guard ") })
	if _, err := tx.Exec(ctx, "SAVEPOINT fenceproxy_guard"); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, guardSharedSQL); err != nil {
		return fmt.Errorf("install the guard: %w", err)
	}
	after, err := guardFingerprint(ctx, tx)
	if err != nil {
		return err
	}
	if slices.Equal(before, after) {
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT fenceproxy_guard"); err != nil {
			return err
		}
	} else {
		if _, err := tx.Exec(ctx, "RELEASE SAVEPOINT fenceproxy_guard"); err != nil {
			return err
		}
		if had {
			rep.Actions = append(rep.Actions, "updated the database guard's shared functions and table")
		} else {
			rep.Actions = append(rep.Actions, "installed the database guard (its functions and table fenceproxy.guard_exempt)")
		}
	}

	roles, _, err := readExempt(ctx, tx)
	if err != nil {
		return err
	}
	if !slices.Equal(roles, g.exemptRoles) {
		if _, err := tx.Exec(ctx, `DELETE FROM fenceproxy.guard_exempt`); err != nil {
			return fmt.Errorf("set the exempt roles: %w", err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO fenceproxy.guard_exempt (role) SELECT pg_catalog.unnest($1::text[])`, g.exemptRoles); err != nil {
			return fmt.Errorf("set the exempt roles: %w", err)
		}
		if len(g.exemptRoles) == 0 {
			rep.Actions = append(rep.Actions, "cleared the roles the guard exempts")
		} else {
			rep.Actions = append(rep.Actions, "set the roles the guard exempts to "+strings.Join(g.exemptRoles, ", "))
		}
	}

	trigs, err := readGuardTriggers(ctx, tx)
	if err != nil {
		return err
	}
	fstate, err := readGuardFunctions(ctx, tx)
	if err != nil {
		return err
	}
	on := guardTriggersOn(trigs)
	keep := map[uint32]bool{}
	for _, p := range placed {
		keep[p.rel.OID] = true
		fresh := len(on[p.rel.OID]) == 0
		var did bool
		// The record of p's triggers is forgotten before the first
		// change, so that the event trigger lets setup make it.
		forgotten := false
		forget := func() error {
			if forgotten {
				return nil
			}
			forgotten = true
			oids := []uint32{p.rel.OID}
			for _, part := range p.parts {
				oids = append(oids, part.oid)
			}
			return forgetTriggers(ctx, tx, oids)
		}
		if st, ok := fstate[p.fn.name]; !ok || !st.is(p.fn.def()) {
			if err := forget(); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, p.fn.createSQL()); err != nil {
				return fmt.Errorf("create the guard's function %s: %w", p.fn.qualified(), err)
			}
			did = true
		}
		if p.rowTriggerIssue(on) != "" {
			if err := forget(); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, rowTriggerSQL(p)); err != nil {
				return fmt.Errorf("create the guard's row trigger on %s: %w", p.rel.Qualified, err)
			}
			did = true
		}
		rels := append([]partition{{p.rel.OID, p.rel.Qualified}}, p.parts...)
		for _, r := range rels {
			keep[r.oid] = true
			if p.truncateTriggerIssue(on, r.oid, r.qualified) == "" {
				continue
			}
			if err := forget(); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, truncateTriggerSQL(r.qualified, p.spec.Display)); err != nil {
				return fmt.Errorf("create the guard's TRUNCATE trigger on %s: %w", r.qualified, err)
			}
			did = true
		}
		switch {
		case did && fresh:
			rep.Actions = append(rep.Actions, "installed the guard on "+p.rel.Qualified)
		case did:
			rep.Actions = append(rep.Actions, "updated the guard on "+p.rel.Qualified)
		}
	}
	// The guard leaves only the tables the configuration does not guard
	// here: a target that could not be placed (its fence column is
	// missing) keeps its guard until that is fixed.
	for _, t := range targets {
		if rel, err := catalog.LookupTable(ctx, tx, t.spec.Schema, t.spec.Table); err != nil {
			return err
		} else if rel != nil {
			keep[rel.OID] = true
		}
	}
	if err := forgetTriggersExcept(ctx, tx, keep); err != nil {
		return err
	}
	removed, err := dropGuardTriggers(ctx, tx, trigs, func(oid uint32) bool { return !keep[oid] })
	if err != nil {
		return err
	}
	for _, name := range removed {
		rep.Actions = append(rep.Actions, "removed the guard from "+name+": the configuration does not guard it in this database")
	}
	if changed, err := recordTriggers(ctx, tx, guardedRels(placed)); err != nil {
		return err
	} else if changed && len(rep.Actions) == 0 {
		rep.Actions = append(rep.Actions, "recorded the guard's triggers in fenceproxy.guard_triggers")
	}
	if err := installDDLTrigger(ctx, tx, rep); err != nil {
		return err
	}

	if fstate, err = readGuardFunctions(ctx, tx); err != nil {
		return err
	}
	var unused []string
	for name, f := range fstate {
		if !f.used && isRowFunction(name) {
			unused = append(unused, name)
		}
	}
	slices.Sort(unused)
	for _, name := range unused {
		q := "fenceproxy." + sqllex.QuoteIdent(name)
		if _, err := tx.Exec(ctx, "DROP FUNCTION "+q+"()"); err != nil {
			return fmt.Errorf("drop the unused guard function %s: %w", q, err)
		}
		rep.Actions = append(rep.Actions, "dropped "+q+"(), which no trigger uses any more")
	}
	return nil
}

// dropGuardTriggers drops the guard's triggers (not inherited ones) on the
// relations drop selects, and returns those relations' names.
func dropGuardTriggers(ctx context.Context, tx pgx.Tx, trigs []guardTrig, drop func(oid uint32) bool) ([]string, error) {
	var names []string
	for _, t := range trigs {
		if !t.ours || t.clone || !drop(t.rel) {
			continue
		}
		if _, err := tx.Exec(ctx, "DROP TRIGGER "+sqllex.QuoteIdent(t.name)+" ON "+t.relName); err != nil {
			return nil, fmt.Errorf("drop the guard's trigger %s on %s: %w", t.name, t.relName, err)
		}
		if !slices.Contains(names, t.relName) {
			names = append(names, t.relName)
		}
	}
	return names, nil
}

// Remove drops every trigger, function and table of the guard in the
// database tx is in.
func Remove(ctx context.Context, tx pgx.Tx) (Result, error) {
	var rep Result
	err := remove(ctx, tx, &rep)
	return rep, err
}

func remove(ctx context.Context, tx pgx.Tx, rep *Result) error {
	trigs, err := readGuardTriggers(ctx, tx)
	if err != nil {
		return err
	}
	// The event triggers first: they would refuse the drops below.
	var dropped []string
	for _, et := range guardEventTriggers {
		if state, _, err := ddlTriggerState(ctx, tx, et); err != nil {
			return err
		} else if state != "" {
			if _, err := tx.Exec(ctx, `DROP EVENT TRIGGER `+et.name); err != nil {
				return fmt.Errorf("drop event trigger %s (as a superuser): %w", et.name, err)
			}
			dropped = append(dropped, et.name)
		}
	}
	if len(dropped) > 0 {
		rep.Actions = append(rep.Actions, "removed the guard's event triggers ("+strings.Join(dropped, ", ")+")")
	}
	if ok, err := recordExists(ctx, tx); err != nil {
		return err
	} else if ok {
		if err := forgetTriggersExcept(ctx, tx, nil); err != nil {
			return err
		}
	}
	removed, err := dropGuardTriggers(ctx, tx, trigs, func(uint32) bool { return true })
	if err != nil {
		return err
	}
	for _, name := range removed {
		rep.Actions = append(rep.Actions, "removed the guard from "+name)
	}
	fstate, err := readGuardFunctions(ctx, tx)
	if err != nil {
		return err
	}
	var names []string
	for name := range fstate {
		if isRowFunction(name) || name == guardTruncateFunc || name == guardExemptedFunc || name == guardDDLFunc {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	_, exempt, err := readExempt(ctx, tx)
	if err != nil {
		return err
	}
	var marked bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM fenceproxy.meta WHERE key = 'guard')`).Scan(&marked); err != nil {
		return fmt.Errorf("read fenceproxy.meta: %w", err)
	}
	if len(names) == 0 && !exempt && !marked {
		return nil
	}
	for _, name := range names {
		if _, err := tx.Exec(ctx, "DROP FUNCTION fenceproxy."+sqllex.QuoteIdent(name)+"()"); err != nil {
			return fmt.Errorf("drop guard function %s: %w", name, err)
		}
	}
	if _, err := tx.Exec(ctx, `DROP TABLE IF EXISTS fenceproxy.guard_exempt, fenceproxy.guard_triggers, fenceproxy.guard_relations; DELETE FROM fenceproxy.meta WHERE key = 'guard'`); err != nil {
		return fmt.Errorf("remove the guard: %w", err)
	}
	rep.Actions = append(rep.Actions, "removed the database guard's functions and its table of exempt roles")
	return nil
}

// Leave changes nothing; for a setup without --guard, it notes where a
// guard installed earlier was left as it is.
func Leave(ctx context.Context, tx pgx.Tx) (Result, error) {
	var rep Result
	trigs, err := readGuardTriggers(ctx, tx)
	if err != nil {
		return rep, err
	}
	var tables []string
	for _, t := range trigs {
		if t.ours && !t.clone && t.name == guardRowTrigger {
			tables = append(tables, t.relName)
		}
	}
	if len(tables) == 0 {
		return rep, nil
	}
	rep.Notes = append(rep.Notes, Note{Text: fmt.Sprintf("the database guard is installed on %s and was left as it is: setup --guard brings it in line with the configuration, --remove-guard removes it",
		strings.Join(tables, ", "))})
	return rep, nil
}
