package dbsetup

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

const (
	// checkTimeout bounds one check run, connecting included.
	checkTimeout = 30 * time.Second
	// checkRetry is how long after a failed run Ensure starts another.
	checkRetry = 30 * time.Second
	// maxCheckedDatabases bounds the databases a Checker keeps results
	// for: database names come from clients (after they authenticated), so
	// the map must not grow without limit.
	maxCheckedDatabases = 256
)

// CheckMetrics receives the outcome of each check run, for metrics.
type CheckMetrics interface {
	// CheckResult is called after each run in database: known is false
	// when the check could not run (problems is then 0).
	CheckResult(database string, problems int, known bool)
}

// Checker runs Check in the background for the proxy: in each database the
// first time a session uses it (Ensure), and again in every such database
// when the configuration changes (Reload). Its methods are safe for
// concurrent use.
type Checker struct {
	connect func(ctx context.Context, database string) (*pgx.Conn, error)
	log     *zap.Logger
	metrics CheckMetrics
	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup

	mu      sync.Mutex
	specs   []rules.TableSpec
	opts    CheckOptions
	loaded  bool // Reload was called: specs is the configuration
	dbs     map[string]*checkedDB
	tooMany bool // the limit was hit (logged once)
}

// checkedDB is the state of one database's checks, guarded by Checker.mu.
type checkedDB struct {
	running  bool // a goroutine is checking it
	again    bool // specs changed during the run: run once more
	done     chan struct{}
	finished bool // done is closed: a first run finished
	known    bool
	result   Result
	failedAt time.Time // end of the last run, if it failed
	endedAt  time.Time // end of the last run
	// recheckDue: Recheck asked for a run that waits for
	// minRecheckInterval to pass.
	recheckDue bool
	// asked counts the requests for a run that starts after them
	// (WaitFresh); ran is the count a run had read when it started, set
	// when it ends; ended is closed and replaced when a run ends.
	asked, ran uint64
	ended      chan struct{}
	stamps     *stampReader
	// periodic: a run is due at UnwatchedRecheck (the database has no
	// catalog watch); quiet: the run asked for is that one, which logs
	// only what changed.
	periodic, quiet bool
}

// minRecheckInterval spaces the runs Recheck starts: the errors that call
// for one come from statements, which a client can repeat (or forge).
const minRecheckInterval = time.Second

// UnwatchedRecheck is how often a database without the catalog watch is
// checked again: no notification tells the proxy of a view, rule, parent
// or foreign key created there on another connection, so its paths (and
// the relations reads go through) are read again this often. A variable
// for tests.
var UnwatchedRecheck = time.Minute

// NewChecker returns a Checker that opens its connections with connect
// (given a context bounded by the check's timeout) and logs to log. m may be
// nil. No check runs before the first Reload, which gives the
// configuration; call Close to stop.
func NewChecker(connect func(ctx context.Context, database string) (*pgx.Conn, error), log *zap.Logger, m CheckMetrics) *Checker {
	if log == nil {
		log = zap.NewNop()
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Checker{connect: connect, log: log, metrics: m, ctx: ctx, cancel: cancel, dbs: map[string]*checkedDB{}}
}

// Ensure starts a check of database if it has not been checked yet, or if
// its last check could not run and a while has passed since. It does not
// wait: see Wait and Problems.
func (c *Checker) Ensure(database string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx.Err() != nil {
		return
	}
	d, ok := c.dbs[database]
	if !ok {
		if len(c.dbs) >= maxCheckedDatabases {
			if !c.tooMany {
				c.tooMany = true
				c.log.Warn("database check skipped: too many databases", zap.String("database", database), zap.Int("limit", maxCheckedDatabases))
			}
			return
		}
		d = &checkedDB{done: make(chan struct{}), ended: make(chan struct{})}
		c.dbs[database] = d
		c.startLocked(database, d)
		return
	}
	if !d.running && !d.known && d.finished && time.Since(d.failedAt) >= checkRetry {
		c.startLocked(database, d)
	}
}

// Reload sets the configuration and checks again every database seen.
// Results of the previous configuration stay until the new ones are in.
func (c *Checker) Reload(specs []rules.TableSpec) { c.ReloadWith(specs, CheckOptions{}) }

// ReloadWith is Reload with the configuration's settings, which the guard
// check compares with (see CheckWith).
func (c *Checker) ReloadWith(specs []rules.TableSpec, opts CheckOptions) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx.Err() != nil {
		return
	}
	c.specs, c.opts, c.loaded = specs, opts, true
	for db, d := range c.dbs {
		if d.running {
			d.again = true
		} else {
			c.startLocked(db, d)
		}
	}
}

// Recheck checks database again, e.g. when a statement found fenceproxy's
// objects missing that the last check had found: after the current run if
// one is running, and at least minRecheckInterval after the last one
// ended.
func (c *Checker) Recheck(database string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d, ok := c.dbs[database]
	if !ok || c.ctx.Err() != nil {
		return
	}
	switch wait := minRecheckInterval - time.Since(d.endedAt); {
	case d.running:
		d.again = true
	case d.recheckDue:
	case wait > 0:
		d.recheckDue = true
		time.AfterFunc(wait, func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			d.recheckDue = false
			if c.ctx.Err() != nil {
				return
			}
			if d.running {
				d.again = true
			} else {
				c.startLocked(database, d)
			}
		})
	default:
		c.startLocked(database, d)
	}
}

// Result is what the last check of a database found.
type Result struct {
	// Problems are by table display name ("" for the database as a
	// whole); the map must not be modified.
	Problems map[string][]Problem
	// Indirect are the relations through which writes reach a table in
	// mode enforce without naming it, except those whose target the
	// database guard protects. Of those, the steps through inheritance or
	// partitioning are kept with no Ops: the guard fences the writes, not
	// the DDL (DROP TABLE of a partitioned parent drops its partitions).
	// The slice must not be modified.
	Indirect []catalog.IndirectPath
	// Readers are the relations through which reads reach a table with
	// lock fencing (lock: optional or required, mode enforce or audit)
	// without naming it: views over it, its ancestors and descendants
	// (catalog.Reader). The slice must not be modified.
	Readers []catalog.Reader
	// Raisers: the error raisers are current and callable by all
	// (Report.Raisers), so the rewrites there may call them.
	Raisers bool
	// StaleAt: so are the raisers of the token form (Report.StaleAt).
	StaleAt bool
	// Hold: lock registrations may call fenceproxy.hold (Report.Hold).
	Hold bool
	// Enter: the relay may call fenceproxy.enter (Report.Enter).
	Enter bool
	// HoldAt: the relay may call fenceproxy.hold_at (Report.HoldAt).
	HoldAt bool
	// ReholdAt: the relay may call fenceproxy.rehold_at
	// (Report.ReholdAt).
	ReholdAt bool
	// Watched: the catalog watch is in place and some table in mode
	// enforce is not guarded, so a change of the catalog made after the
	// check may open a path Indirect does not list. Stamp is the catalog
	// stamp read before the paths: while Stamp reads the same, Indirect is
	// current.
	Watched bool
	Stamp   int64
	// CheckProc is the procedure that checks the stamp in a write's
	// transaction (Report.CheckProc), when Watched.
	CheckProc string
	// Guarded: the database guard protects some table here. Its
	// triggers read the fence settings on the server, also for writes
	// the proxy cannot see, so the proxy applies the session's values to
	// every statement that may write (proxy.Policy.SettingsEverywhere).
	Guarded bool
	// SettingsRead: code in the database may read the fence settings
	// (catalog.SettingsReaders; true where the check could not tell), so
	// every statement that reads or writes a protected table gets the
	// session's values applied on the server, even one whose fences carry
	// the token (proxy.Policy.CodeReadsSettings). SettingsReaders names
	// some of that code, for the log.
	SettingsRead    bool
	SettingsReaders []string
}

// Result returns what the last check of database found. known is false
// while the first check runs, when it could not run (the error is
// logged), and for a database Ensure was not called for.
func (c *Checker) Result(database string) (r Result, known bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d, ok := c.dbs[database]
	if !ok || !d.known {
		return Result{}, false
	}
	return d.result, true
}

// ErrNotChecked is Wait's error for a database Ensure was not called for
// (or not accepted: too many databases).
var ErrNotChecked = errors.New("dbsetup: database not being checked")

// Wait waits until the first check of database has finished, whether or
// not it could run, or until ctx ends.
func (c *Checker) Wait(ctx context.Context, database string) error {
	c.mu.Lock()
	d, ok := c.dbs[database]
	c.mu.Unlock()
	if !ok {
		return ErrNotChecked
	}
	select {
	case <-d.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close stops the checks in progress and waits for them to end.
func (c *Checker) Close() {
	// Under mu: every start (Ensure, Reload, Recheck) checks the context
	// under mu, so none can add to wg once Wait may have begun.
	c.mu.Lock()
	c.cancel()
	c.mu.Unlock()
	c.wg.Wait()
	c.closeStamps()
}

// startLocked starts a goroutine that checks database, if the
// configuration is known.
func (c *Checker) startLocked(database string, d *checkedDB) {
	if !c.loaded {
		return
	}
	d.running = true
	c.wg.Add(1)
	go c.run(database, d)
}

// run checks database until no Reload asked for another run meanwhile.
func (c *Checker) run(database string, d *checkedDB) {
	defer c.wg.Done()
	log := c.log.With(zap.String("database", database))
	for {
		c.mu.Lock()
		specs, opts := c.specs, c.opts
		asked := d.asked
		quiet, prev := d.quiet, d.result
		d.quiet = false
		c.mu.Unlock()

		rep, reach, watched, stamp, sr, err := c.checkOnce(database, specs, opts)
		indirect := reach.Paths
		// A periodic run logs only what changed.
		same := quiet && err == nil && sameProblems(prev.Problems, rep.Problems) &&
			slices.EqualFunc(prev.Indirect, indirect, func(a, b catalog.IndirectPath) bool {
				return a.Relation() == b.Relation() && a.Target == b.Target && a.Kind == b.Kind && a.Via == b.Via && slices.Equal(a.Ops, b.Ops)
			}) && slices.Equal(prev.Readers, reach.Readers) && prev.SettingsRead == sr.found
		var byTable map[string][]Problem
		switch {
		case err != nil && c.ctx.Err() != nil:
			// Closing: no result, no log line.
		case err != nil:
			// Connection errors name host, user and database, never the
			// password.
			log.Warn("database check could not run; fenceproxy's objects and fence columns are unchecked", zap.Error(err))
		default:
			byTable = map[string][]Problem{}
			for _, p := range rep.Problems {
				byTable[p.Table] = append(byTable[p.Table], p)
				if !same {
					log.Warn("database check: problem", zap.String("table", p.Table),
						zap.String("problem", p.Description), zap.String("fix", p.Fix))
				}
			}
			if len(rep.Problems) == 0 && !same {
				log.Info("database check passed")
			}
		}
		c.mu.Lock()
		d.known = err == nil
		d.result = Result{Problems: byTable, Indirect: indirect, Readers: reach.Readers, Raisers: err == nil && rep.Raisers, StaleAt: err == nil && rep.StaleAt, Hold: err == nil && rep.Hold, Enter: err == nil && rep.Enter, HoldAt: err == nil && rep.HoldAt, ReholdAt: err == nil && rep.ReholdAt, Watched: watched, Stamp: stamp, CheckProc: rep.CheckProc, Guarded: len(rep.Guarded) > 0,
			SettingsRead: err != nil || sr.found, SettingsReaders: sr.names}
		d.ran = asked
		close(d.ended)
		d.ended = make(chan struct{})
		for _, p := range indirect {
			if len(p.Ops) == 0 || same {
				continue // DDL only (a guarded target), or logged before
			}
			log.Info("database check: writes through this relation reach a protected table; they are refused", zap.String("relation", p.Relation()),
				zap.String("table", p.Target), zap.Strings("ops", p.Ops), zap.String("via", p.Via))
		}
		if n := len(reach.Readers); n > 0 && !same {
			log.Info("database check: relations and functions whose reads reach a lock-fenced table; statements that read through them register the lock",
				zap.Int("readers", n))
		}
		if err == nil && sr.found && !same {
			log.Info("database check: code here may read the fence settings; statements on protected tables carry the session's values to the server",
				zap.Strings("code", sr.names))
		}
		d.endedAt = time.Now()
		if err != nil {
			d.failedAt = d.endedAt
		}
		if !d.finished {
			d.finished = true
			close(d.done)
		}
		c.mu.Unlock()
		// Reported after the result is in place and while d.running keeps
		// other runs of this database from reporting out of order.
		if c.metrics != nil && c.ctx.Err() == nil {
			c.metrics.CheckResult(database, len(rep.Problems), err == nil)
		}

		c.mu.Lock()
		again := d.again && c.ctx.Err() == nil
		d.again = false
		d.running = again
		if err == nil && !watched && !d.periodic && c.ctx.Err() == nil && len(applying(specs, database)) > 0 {
			c.schedulePeriodicLocked(database, d)
		}
		c.mu.Unlock()
		if !again {
			return
		}
	}
}

// sameProblems reports whether a run found the problems the run before
// found (by table and description).
func sameProblems(before map[string][]Problem, now []Problem) bool {
	n := 0
	for _, ps := range before {
		n += len(ps)
	}
	if n != len(now) {
		return false
	}
	for _, p := range now {
		if !slices.ContainsFunc(before[p.Table], func(q Problem) bool { return q.Description == p.Description }) {
			return false
		}
	}
	return true
}

// schedulePeriodicLocked asks for a quiet run of database (which has no
// catalog watch) in UnwatchedRecheck, unless one is due already; where
// the Checker has checked more than 100 databases, in as many times
// UnwatchedRecheck as it has hundreds, so that the runs stay under about
// two a second.
func (c *Checker) schedulePeriodicLocked(database string, d *checkedDB) {
	d.periodic = true
	time.AfterFunc(UnwatchedRecheck*time.Duration(1+len(c.dbs)/100), func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		d.periodic = false
		if c.ctx.Err() != nil || d.result.Watched {
			return
		}
		d.quiet = true
		c.askLocked(database, d)
	})
}

// checkOnce connects to database and runs Check, then finds the indirect
// paths to the tables in mode enforce there, within checkTimeout. watched
// and stamp are Result's.
func (c *Checker) checkOnce(database string, specs []rules.TableSpec, opts CheckOptions) (rep Report, reach catalog.Reach, watched bool, stamp int64, sr settingsRead, err error) {
	ctx, cancel := context.WithTimeout(c.ctx, checkTimeout)
	defer cancel()
	conn, err := c.connect(ctx, database)
	if err != nil {
		return Report{}, catalog.Reach{}, false, 0, settingsRead{}, err
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	// The stamp first: a change committed between it and the catalog
	// reads below is in the paths found, and moves the stamp past this
	// one, which only checks again.
	stamp, stampErr := ReadStamp(ctx, conn)
	rep, err = CheckWith(ctx, conn, specs, opts)
	if err != nil {
		return rep, catalog.Reach{}, false, 0, settingsRead{}, err
	}
	watched = stampErr == nil && rep.Watched && unguardedEnforced(specs, rep.Database, rep.Guarded)
	if !watched {
		stamp = 0
	}
	reach, err = c.paths(ctx, conn, database, specs, rep)
	if err != nil {
		return rep, reach, watched, stamp, settingsRead{}, err
	}
	sr, err = settingsReaders(ctx, conn, opts)
	if err != nil && ctx.Err() == nil {
		// The rest of the check stands: statements keep the session's
		// values, as where code reads them.
		c.log.Warn("database check: could not read the code that may read the fence settings; statements on protected tables carry the session's values",
			zap.String("database", database), zap.Error(err))
		sr, err = settingsRead{found: true}, nil
	}
	return rep, reach, watched, stamp, sr, err
}

// settingsRead is what catalog.SettingsReaders found.
type settingsRead struct {
	found bool
	names []string
}

// settingsReaders finds the code of the database that may read the
// fence settings (Result.SettingsRead), naming up to five objects.
func settingsReaders(ctx context.Context, conn *pgx.Conn, opts CheckOptions) (settingsRead, error) {
	tok, lk := opts.TokenSetting, opts.LockSetting
	if tok == "" {
		tok = rules.DefaultTokenSetting
	}
	if lk == "" {
		lk = rules.DefaultLockSetting
	}
	names, found, err := catalog.SettingsReaders(ctx, conn, []string{tok, lk}, ownFunctions, 5)
	return settingsRead{found: found, names: names}, err
}

// lockCovered reports whether p, a foreign key action or TRUNCATE ...
// CASCADE from a protected table, writes only what lock fencing fences
// alone, after lock fencing fenced the statement: every session's
// statement on its start registered the session's lock, and no entry for
// its target has a fence column, so that registration is all a direct
// write of it would need. For every session to register, the entries
// of the start that can apply in database, read in order as a session's
// are, must all be enforce with lock: required, down to one that every
// session matches (no scope of users or application names): a session
// that an entry in mode off or audit, with a lock not required, or no
// entry at all matches writes the start with no registration. A
// row-fenced target is not covered (the action's query skips its rows'
// fence).
func lockCovered(p catalog.IndirectPath, specs []rules.TableSpec, database string) bool {
	if p.Kind != catalog.PathForeignKey && p.Kind != catalog.PathTruncate {
		return false
	}
	start, target := false, false
	for _, s := range specs {
		if len(s.Scope.Databases) > 0 && !slices.Contains(s.Scope.Databases, database) {
			continue
		}
		if s.Schema == p.Schema && s.Table == p.Name && !start {
			if s.Mode != rules.ModeEnforce || s.Lock != rules.LockRequired {
				return false
			}
			start = len(s.Scope.Users) == 0 && len(s.Scope.ApplicationNames) == 0
		}
		if s.Display == p.Target && s.Mode != rules.ModeOff {
			if s.Column != "" {
				return false
			}
			target = true
		}
	}
	return start && target
}

// paths finds the indirect paths to the tables in mode enforce of
// database whose target the guard does not protect, and those through
// inheritance or partitioning to the tables it does, with no Ops; and the
// relations through which reads reach the tables with lock fencing.
func (c *Checker) paths(ctx context.Context, conn *pgx.Conn, database string, specs []rules.TableSpec, rep Report) (catalog.Reach, error) {
	var rels, locked []catalog.Rel
	for _, s := range specs {
		if !appliesIn(s, database) {
			continue
		}
		rel := catalog.Rel{Schema: s.Schema, Name: s.Table}
		if s.Mode == rules.ModeEnforce && !slices.Contains(rels, rel) {
			rels = append(rels, rel)
		}
		if s.Lock != rules.LockOff && !slices.Contains(locked, rel) {
			locked = append(locked, rel)
		}
	}
	if len(rels) == 0 && len(locked) == 0 {
		return catalog.Reach{}, nil
	}
	reach, err := catalog.Paths(ctx, conn, rels, locked)
	if err != nil {
		return catalog.Reach{}, err
	}
	paths := reach.Paths
	// The guard fences writes to its tables inside PostgreSQL, whatever
	// path they take: those paths need no refusal. Its triggers do not
	// stop DDL on a parent or partition, which the policy refuses
	// (HierarchySet) from the paths through inheritance or partitioning.
	guarded := make(map[string]bool, len(rep.Guarded))
	for _, g := range rep.Guarded {
		guarded[g] = true
	}
	kept := paths[:0]
	for _, p := range paths {
		switch {
		case lockCovered(p, specs, database):
		case !guarded[p.Target]:
			kept = append(kept, p)
		case p.Kind == catalog.PathPartition || p.Kind == catalog.PathInheritance:
			p.Ops = nil
			kept = append(kept, p)
		}
	}
	reach.Paths = kept
	return reach, nil
}
