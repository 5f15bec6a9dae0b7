package policy

import (
	"context"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Checks is what the policy needs of the database checks
// (dbsetup.Checker): per database, the problems found with the protected
// tables and the relations through which writes reach them unseen.
type Checks interface {
	Ensure(database string)
	Wait(ctx context.Context, database string) error
	Result(database string) (dbsetup.Result, bool)
	Recheck(database string)
}

// dbRefresh is how often a database's check results are read again.
const dbRefresh = time.Second

// dbChecks is the state of one database's checks, as the policy uses it.
type dbChecks struct {
	// expired is set dbRefresh after the results were read (a timer: no
	// clock read per statement, which costs a system call on some VMs).
	expired  atomic.Bool
	known    bool
	problems map[string][]dbsetup.Problem
	paths    []catalog.IndirectPath
	indirect *rules.IndirectSet
	// readerList and readers: the relations whose reads reach a table
	// with lock fencing without naming it (rules.Session.Readers).
	readerList []catalog.Reader
	readers    *rules.Readers
	// hierarchy: the relations of paths through inheritance or
	// partitioning, on which DDL is refused (hierarchyRefusal).
	hierarchy *rules.HierarchySet
	// raisers: the database has the error raisers, so rewrites call them
	// (rules.Rules.ServerFunctions).
	raisers bool
	// staleAt: and those of the token form (rules.Rules.StaleAt).
	staleAt bool
	// hold: lock registrations may call fenceproxy.hold
	// (rules.Rules.Hold).
	hold bool
	// enter: the relay may call fenceproxy.enter (rules.LockCall.Enter).
	enter bool
	// holdAt: the relay may call fenceproxy.hold_at
	// (rules.LockCall.HoldAt).
	holdAt bool
	// reholdAt: and fenceproxy.rehold_at (rules.LockCall.ReholdAt).
	reholdAt bool
	// goneAt: when a statement last found one of these objects gone
	// (objectsGone), in Unix nanoseconds.
	goneAt atomic.Int64
	// watched: the catalog watch counts changes here and a table in mode
	// enforce is not guarded, so writes compare stamp, the catalog stamp
	// the results describe, with the stamp now (stamp.go).
	watched bool
	stamp   int64
	// checkProc is the watch's check procedure (dbsetup.CatalogCheckProc,
	// or the legacy one where setup has not run since an upgrade).
	checkProc string
	// guarded: the database guard protects some table here
	// (SettingsEverywhere).
	guarded bool
	// settingsRead: code in the database may read the fence settings, or
	// the check could not tell (CodeReadsSettings).
	settingsRead bool
	// superseded: newer results of the database are in force (or these
	// never were: no room for them), which sessions that keep these
	// (lastForward) must look up.
	superseded atomic.Bool
	// moved: the catalog is known to have changed since stamp (a
	// notification, a failed in-band check), so writes wait for a stamp
	// read instead of checking in their own transaction, until results
	// of another stamp are read.
	moved atomic.Bool
}

type checkCache struct {
	byDB   sync.Map // database → *dbChecks; at most maxCheckedDBs
	mu     sync.Mutex
	n      int // entries in byDB
	waited map[string]bool
}

// maxCheckedDBs bounds the databases whose results the policy keeps
// (database names come from clients).
const maxCheckedDBs = 4096

// dbState returns the check results for database, starting its first
// check if needed. The first statement of the first session of a database
// waits (at most wait) for the first check, so that what it finds applies
// from the start.
func (p *Policy) dbState(database string) *dbChecks {
	if st, ok := p.dbStateNow(database); ok {
		return st
	}
	return p.refreshDBState(database)
}

// dbStateNow returns database's check results when they are known and
// fresh, and false when dbState would have to look (and maybe wait).
func (p *Policy) dbStateNow(database string) (*dbChecks, bool) {
	return p.dbStateKept(nil, database)
}

// dbStateKept is dbStateNow, answered without a lookup where kept, the
// results a session kept (lastForward), are still those in force.
func (p *Policy) dbStateKept(kept *dbChecks, database string) (*dbChecks, bool) {
	if kept != nil && !kept.expired.Load() && !kept.superseded.Load() {
		return kept, true
	}
	if p.checks == nil {
		return nil, true
	}
	if v, ok := p.checkCache.byDB.Load(database); ok {
		if st := v.(*dbChecks); !st.expired.Load() {
			return st, true
		}
	}
	return nil, false
}

// refreshDBState is dbState once the fresh results are not at hand.
func (p *Policy) refreshDBState(database string) *dbChecks {
	if p.checks == nil {
		return nil
	}
	c := &p.checkCache
	var st *dbChecks
	if v, ok := c.byDB.Load(database); ok {
		st = v.(*dbChecks)
	}
	c.mu.Lock()
	first := !c.waited[database]
	if first {
		if c.waited == nil {
			c.waited = map[string]bool{}
		}
		if len(c.waited) < maxCheckedDBs {
			c.waited[database] = true
		}
	}
	c.mu.Unlock()

	p.checks.Ensure(database)
	if first {
		ctx, cancel := context.WithTimeout(context.Background(), p.checkWait)
		if err := p.checks.Wait(ctx, database); err != nil && err != dbsetup.ErrNotChecked {
			p.log.Warn("database check still running; statements go on without its results", zap.String("database", database), zap.Error(err))
		}
		cancel()
	}
	res, known := p.checks.Result(database)
	paths := res.Indirect
	next := &dbChecks{known: known, problems: res.Problems, paths: paths, raisers: res.Raisers, staleAt: res.StaleAt, hold: res.Hold, enter: res.Enter, holdAt: res.HoldAt, reholdAt: res.ReholdAt, watched: known && res.Watched, stamp: res.Stamp, checkProc: res.CheckProc, guarded: res.Guarded,
		settingsRead: !known || res.SettingsRead}
	if !known && st != nil && st.watched {
		// The check failed where the catalog watch ran: the paths found
		// last hold while the stamp reads as it did then, and writes are
		// refused once it does not (freshState).
		next.watched, next.stamp, paths = true, st.stamp, st.paths
		next.paths = paths
	}
	next.readerList = res.Readers
	if !known && st != nil {
		// A failed check found nothing: the readers found last still
		// register (their registration costs a statement; missing one
		// lets a stale holder through).
		next.readerList = st.readerList
	}
	if st != nil {
		next.goneAt.Store(st.goneAt.Load())
	}
	if st != nil && st.moved.Load() && next.stamp == st.stamp {
		next.moved.Store(true)
	}
	if st != nil && (st.raisers && !next.raisers || st.staleAt && !next.staleAt || st.hold && !next.hold || st.enter && !next.enter || st.holdAt && !next.holdAt || st.reholdAt && !next.reholdAt) {
		// An object decisions call is no longer found (dropped, say):
		// statements prepared before are decided again, or they would
		// keep calling what is gone. (One found where it was not leaves
		// them as they are: what they call is still there.)
		p.bumpGeneration(database)
	}
	if st != nil && next.watched && next.stamp != st.stamp {
		// Statements prepared before check the old stamp when they run
		// (their CatalogCheckProc call): decided again, they check this one.
		p.bumpGeneration(database)
	}
	time.AfterFunc(dbRefresh, func() { next.expired.Store(true) })
	if st != nil && samePaths(st.paths, paths) {
		next.indirect = st.indirect
		next.hierarchy = st.hierarchy
	} else {
		next.indirect = rules.NewIndirectSet(indirectRules(paths))
		next.hierarchy = hierarchyDDL(paths)
		if st != nil && !equalPaths(st.paths, paths) {
			// Statements prepared before may write through a new path.
			p.bumpGeneration(database)
		}
	}
	if st != nil && slices.Equal(st.readerList, next.readerList) {
		next.readers = st.readers
	} else {
		next.readers = rules.NewReaders(readerRules(next.readerList))
		if st != nil {
			// Statements prepared before may read through a new reader.
			p.bumpGeneration(database)
		}
	}
	if next.watched {
		if w, ok := p.auditor.(catalogWatcher); ok {
			w.WatchCatalog(database)
		}
	}
	c.mu.Lock()
	if st != nil || c.n < maxCheckedDBs {
		if st == nil {
			c.n++
		}
		if prev, ok := c.byDB.Swap(database, next); ok {
			prev.(*dbChecks).superseded.Store(true)
		}
	} else {
		next.superseded.Store(true) // never the results in force
	}
	c.mu.Unlock()
	return next
}

func samePaths(a, b []catalog.IndirectPath) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

func indirectRules(paths []catalog.IndirectPath) []rules.Indirect {
	out := make([]rules.Indirect, 0, len(paths))
	for _, p := range paths {
		latent := p.Kind == catalog.PathLatent
		if len(p.Ops) == 0 && !latent {
			continue // to a guarded table: DDL only (hierarchyDDL)
		}
		out = append(out, rules.Indirect{
			Schema: p.Schema, Name: p.Name, Ops: p.Ops, Target: p.Target, Via: p.Via,
			CascadeOnly: p.Kind == catalog.PathTruncate, ByRule: p.Kind == catalog.PathRule, Columns: p.Columns, Latent: latent,
			NewPartitions: p.NewPartitions, NewChildren: p.NewChildren,
		})
	}
	return out
}

func readerRules(list []catalog.Reader) []rules.Reader {
	out := make([]rules.Reader, len(list))
	for i, x := range list {
		out[i] = rules.Reader{Schema: x.Schema, Name: x.Name, Target: x.Target, Function: x.Function, Refresh: x.Refresh, Maybe: x.Maybe, EndsTx: x.EndsTx}
	}
	return out
}

// checkRefusal returns the refusal of a statement that writes tables whose
// check failed in this database, or that writes through a relation that
// reaches a protected table. nil when the database is not checked. Where
// the catalog watch runs, a statement that may write is checked against
// the catalog as it is when it runs: by the in-band check it returns, or,
// where that cannot go before it (inBandWrite), or where the catalog is
// known to have moved, and for a named prepared statement, by a stamp
// read before it is forwarded (freshState). Named prepared statements are
// checked at each Bind too, as unnamed ones are.
//
// Quick, it reports false instead of parsing sql or reading the stamp.
func (p *Policy) checkRefusal(st *dbChecks, info *proxy.SessionInfo, sql string, d *rules.Decision, prepared, quick bool) (*rules.Error, stampCheck, bool) {
	if st == nil || (!st.known && !st.watched) {
		return nil, stampCheck{}, true
	}
	if d.Action == rules.Rewrite {
		for _, t := range d.Tables {
			if probs := st.problems[t]; len(probs) > 0 {
				var fixes []string
				for _, pr := range probs {
					fixes = append(fixes, pr.Description+": "+pr.FixFor(p.configFile))
				}
				return &rules.Error{
					Code:    rules.CodeRefused,
					Message: "fenceproxy: protected table " + t + " is not ready for fencing in database " + info.Database + ": " + probs[0].Description,
					Detail:  strings.Join(fixes, "\n"),
					Hint:    "Fix: " + probs[0].FixFor(p.configFile),
					Table:   t,
				}, stampCheck{}, true
			}
		}
	}
	e, ok, stamped := p.hierarchyRefusal(st, info, sql, quick)
	if !ok || e != nil {
		return e, stampCheck{}, ok
	}
	check := stampCheck{stamped: stamped}
	read := false // the stamp was read for this statement
	if st.watched && mayWrite(sql) {
		// A named prepared statement is decided with a stamp read, so
		// that one prepared after a change is decided with its paths
		// rather than refused once at its first Bind, and it runs the
		// check at every Bind too: decided again only when the proxy
		// learns that the stamp moved, it would otherwise run through a
		// path created in between (the notification comes after the
		// change commits).
		// With a lock registration the check runs just before it
		// (rules.LockCall.Pre).
		inBand := inBandWrite(sql)
		if !inBand || prepared || st.moved.Load() {
			if quick {
				return nil, stampCheck{}, false
			}
			fresh, e := p.freshState(info, st, sql)
			if e != nil {
				return e, stampCheck{}, true
			}
			st, read = fresh, true
		}
		// After a stamp read too: a change may commit before the
		// statement runs. A text of several statements gets it in front
		// of them (frontCheck).
		current := st.checkProc == "" || st.checkProc == dbsetup.CatalogCheckProc
		check = stampCheck{on: inBand || !prepared && frontCheck(sql), stamped: true, stamp: st.stamp, proc: st.checkProc,
			enter: st.enter && current, holdAt: st.holdAt && current, reholdAt: st.reholdAt && current}
	}
	if quick {
		if e, ok = st.indirect.CheckCached(sql); !ok || (e != nil && st.watched && !read) {
			return nil, stampCheck{}, false
		}
		return e, check, true
	}
	e = st.indirect.Check(sql)
	if e != nil && st.watched && !read {
		// Refused with paths the catalog may have dropped since: a
		// refusal is rare, so it waits for a stamp read, as a write the
		// check cannot go before does (DDL refused for a path, too: a
		// view replaced on another connection is no longer one).
		check.stamped = true
		fresh, fe := p.freshState(info, st, sql)
		if fe != nil {
			return fe, stampCheck{}, true
		}
		if fresh != st {
			e, check.stamp = fresh.indirect.Check(sql), fresh.stamp
		}
	}
	return e, check, true
}

// hierarchyDDL returns the set that refuses DDL on the relations whose
// first step towards a protected table is through inheritance or
// partitioning: its ancestors and descendants (rules.HierarchySet).
func hierarchyDDL(paths []catalog.IndirectPath) *rules.HierarchySet {
	var hier []rules.Indirect
	for _, p := range paths {
		if p.Kind == catalog.PathPartition || p.Kind == catalog.PathInheritance {
			hier = append(hier, rules.Indirect{Schema: p.Schema, Name: p.Name, Target: p.Target, Via: p.Via})
		}
	}
	return rules.NewHierarchySet(hier)
}

// hierarchyRefusal returns the refusal of DDL on a parent or child of a
// protected table (DROP TABLE of a partitioned parent drops the table,
// ALTER TABLE of a parent changes it). Where the catalog watch runs, DDL
// is checked against the catalog as it is now (freshState), as writes are:
// a partition attached on another connection is seen at once. Quick, it
// reports false instead of parsing or reading the stamp. Stamped: the DDL
// was checked with a stamp read, or would be.
func (p *Policy) hierarchyRefusal(st *dbChecks, info *proxy.SessionInfo, sql string, quick bool) (e *rules.Error, ok, stamped bool) {
	if !rules.MayBeDDL(sql) {
		return nil, true, false
	}
	stamped = st.watched
	if stamped {
		if quick {
			return nil, false, true
		}
		fresh, e := p.freshState(info, st, sql)
		if e != nil {
			return e, true, true
		}
		st = fresh
	}
	if !st.hierarchy.MayApply(sql) {
		return nil, true, stamped
	}
	if quick {
		return nil, false, stamped
	}
	return st.hierarchy.Check(sql), true, stamped
}

// checkedRaisers reports whether the last check of database found the
// error raisers.
func (p *Policy) checkedRaisers(database string) bool {
	if p.checks == nil {
		return false
	}
	r, _ := p.checks.Result(database)
	return r.Raisers
}

// readersOrNil returns st's readers; nil for a nil st.
func (st *dbChecks) readersOrNil() *rules.Readers {
	if st == nil {
		return nil
	}
	return st.readers
}
