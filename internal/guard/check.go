package guard

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Check checks the guard in the database tx is in against specs, the
// entries that apply in this database, and cfg: where it is installed it
// must be as Install leaves it, and once it is installed in the database
// (fenceproxy.meta has its mark, or a table has its triggers) every table
// it belongs on must have it. It changes nothing. It returns the problems
// and the display names (rules.TableSpec.Display) of the tables whose
// guard is in place and current.
func Check(ctx context.Context, tx pgx.Tx, specs []rules.TableSpec, cfg Config) ([]Problem, []string, error) {
	g := newGuardConfig(cfg)
	targets, skipped, err := planGuard(specs, g)
	if err != nil {
		return nil, nil, err
	}
	trigs, err := readGuardTriggers(ctx, tx)
	if err != nil {
		return nil, nil, err
	}
	marked, err := guardInstalled(ctx, tx)
	if err != nil {
		return nil, nil, err
	}
	var anyTrig bool
	for _, t := range trigs {
		anyTrig = anyTrig || t.ours && !t.clone
	}
	if !marked && !anyTrig {
		return nil, nil, nil
	}
	on := guardTriggersOn(trigs)
	var ps []Problem

	// The shared functions and the exempt roles.
	fstate, err := readGuardFunctions(ctx, tx)
	if err != nil {
		return nil, nil, err
	}
	sharedOK := true
	for _, f := range sharedFunctions {
		if st, ok := fstate[f.name]; !ok || !st.is(f) {
			sharedOK = false
			ps = append(ps, setupProblem("", fmt.Sprintf("function fenceproxy.%s of the database guard is missing or not this fenceproxy's", f.name)))
		}
	}
	roles, exemptTable, err := readExempt(ctx, tx)
	if err != nil {
		return nil, nil, err
	}
	switch {
	case !exemptTable:
		sharedOK = false
		ps = append(ps, setupProblem("", "table fenceproxy.guard_exempt of the database guard is missing"))
	case !slices.Equal(roles, g.exemptRoles):
		sharedOK = false
		ps = append(ps, setupProblem("", fmt.Sprintf("the database guard exempts the roles [%s]; guard.exempt_roles lists [%s]",
			strings.Join(roles, ", "), strings.Join(g.exemptRoles, ", "))))
	}
	if missing, err := missingRoles(ctx, tx, g.exemptRoles); err != nil {
		return nil, nil, err
	} else if len(missing) > 0 {
		ps = append(ps, Problem{Description: fmt.Sprintf("guard.exempt_roles lists roles that do not exist: %s", strings.Join(missing, ", ")),
			Fix: "create the roles, or remove them from guard.exempt_roles, then run fenceproxy setup -c FILE --guard"})
	}

	placed, _, err := placeGuard(ctx, tx, targets)
	if err != nil {
		return nil, nil, err
	}
	var guarded []string
	keep := map[uint32]bool{}
	for _, p := range placed {
		keep[p.rel.OID] = true
		var issues []string
		if i := p.rowTriggerIssue(on); i != "" {
			issues = append(issues, i)
		}
		for _, r := range append([]partition{{p.rel.OID, p.rel.Qualified}}, p.parts...) {
			keep[r.oid] = true
			if i := p.truncateTriggerIssue(on, r.oid, r.qualified); i != "" {
				issues = append(issues, i)
			}
		}
		switch st, ok := fstate[p.fn.name]; {
		case !ok:
			issues = append(issues, fmt.Sprintf("function %s is missing", p.fn.qualified()))
		case headerOf(st.body) != p.fn.header:
			issues = append(issues, fmt.Sprintf("function %s was made for an earlier configuration (%s); it now needs %s", p.fn.qualified(), headerOf(st.body), p.fn.header))
		case !st.is(p.fn.def()):
			issues = append(issues, fmt.Sprintf("function %s is not this fenceproxy's (replaced by hand, or installed by another build)", p.fn.qualified()))
		}
		switch {
		case len(on[p.rel.OID]) == 0:
			ps = append(ps, setupProblem(p.spec.Display, "the database guard is installed in this database but not on this table"))
		case len(issues) > 0:
			ps = append(ps, setupProblem(p.spec.Display, "the database guard on this table is not as the configuration needs: "+strings.Join(issues, "; ")))
		case sharedOK:
			guarded = append(guarded, p.spec.Display)
		}
	}
	for _, u := range skipped {
		rel, err := catalog.LookupTable(ctx, tx, u.spec.Schema, u.spec.Table)
		if err != nil {
			return nil, nil, err
		}
		if rel == nil || !slices.ContainsFunc(on[rel.OID], func(t guardTrig) bool { return t.ours && !t.clone }) {
			continue
		}
		keep[rel.OID] = true
		ps = append(ps, setupProblem(u.spec.Display, "the database guard is installed on this table, but "+u.reason))
	}
	for _, t := range targets {
		if rel, err := catalog.LookupTable(ctx, tx, t.spec.Schema, t.spec.Table); err != nil {
			return nil, nil, err
		} else if rel != nil {
			keep[rel.OID] = true
		}
	}
	var stray []string
	for _, t := range trigs {
		if t.ours && !t.clone && !keep[t.rel] && !slices.Contains(stray, t.relName) {
			stray = append(stray, t.relName)
		}
	}
	// The guard against DDL: the record of the triggers and the event
	// trigger. Writes are fenced without them, so the tables stay
	// guarded. The record is compared only where nothing else is for
	// setup to fix: each of those problems leaves it behind too.
	fixable := slices.ContainsFunc(ps, func(p Problem) bool { return p.Fix == "" })
	switch ok, err := recordExists(ctx, tx); {
	case err != nil:
		return nil, nil, err
	case !ok:
		ps = append(ps, setupProblem("", "table fenceproxy.guard_triggers of the database guard is missing"))
	case fixable:
	default:
		current, err := recordCurrent(ctx, tx, guardedRels(placed))
		if err != nil {
			return nil, nil, err
		}
		if !current {
			ps = append(ps, setupProblem("", "fenceproxy.guard_triggers does not record the guard's triggers as they are, so DDL that drops a guarded table or its guard is not refused everywhere"))
		}
	}
	for _, et := range guardEventTriggers {
		if state, ours, err := ddlTriggerState(ctx, tx, et); err != nil {
			return nil, nil, err
		} else if !ours || (state != "O" && state != "A") {
			what := "is missing"
			switch {
			case state != "" && !ours:
				what = "is not the guard's"
			case state != "":
				what = "is disabled"
			}
			ps = append(ps, Problem{Description: "the database guard's event trigger " + et.name + " " + what +
				": stored code that builds DDL at run time, or a direct connection, can drop a guarded table or weaken its guard",
				Fix: "run fenceproxy setup -c FILE --guard as a superuser"})
		}
	}
	for _, name := range stray {
		ps = append(ps, setupProblem("", fmt.Sprintf("the database guard is installed on %s, which no entry in mode enforce protects in this database", name)))
	}
	return ps, guarded, nil
}
