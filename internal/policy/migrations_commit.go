package policy

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// A migration's DDL is forwarded before it runs, and runs in a transaction
// the proxy's check cannot see into until it commits (Rails, Alembic and
// Flyway wrap each migration in BEGIN ... COMMIT). So from the decision
// on, writes through the proxy to the tables it names are refused (FP003),
// until its session's transaction has ended and a check of the database
// that started after that has finished; then the check's results decide,
// as for any write: a failed check refuses writes to the table, naming the
// fix, and a passed one lets them through.
//
// The end of the transaction is the session's next ReadyForQuery with
// status idle, as the relay reports it (MigrationEnded), or, until it
// does, what pg_stat_activity shows of the session's backend, read on a
// connection of the policy's own (the check's settings): the backend
// gone, or idle since a moment read from the server's clock just before
// the statement was forwarded. Where the catalog watch notifies, a
// notification has the sessions of the database looked at at once
// (PollMigrations). A backend whose state the connection may not read
// (it needs pg_read_all_stats or the session's role) ends only with its
// session or with the relay's report.

// migrationPoll is how often the backend of a session with a migration
// running is looked at.
const migrationPoll = 100 * time.Millisecond

// migrationGiveUp is how long the end of a migration's transaction is
// looked for while pg_stat_activity cannot be read: then the database is
// checked again anyway and its results decide (a check that cannot run
// refuses nothing, as at start).
const migrationGiveUp = 30 * time.Second

// runningMigrations are the migrations forwarded whose tables have not
// been checked since their transaction ended.
type runningMigrations struct {
	n    atomic.Int32 // len(all): the write path looks no further at 0
	mu   sync.Mutex
	all  map[*runningMigration]bool
	open map[uint64]*runningMigration // by session, until its transaction ends
}

// runningMigration is one session's migration.
type runningMigration struct {
	info   proxy.SessionInfo
	tables map[string]bool // display names; guarded by runningMigrations.mu
	// seq counts the session's migration statements decided, ended the
	// seq of the last MigrationEnded (both guarded by runningMigrations.mu).
	seq, ended uint64
	wake       chan struct{} // buffered: look now
	done       chan struct{} // closed once the check after it has finished

	mu       sync.Mutex // the connection and since; taken before runningMigrations.mu
	conn     *pgx.Conn
	since    time.Time // the server's clock before statement sinceSeq; zero: not read
	sinceSeq uint64
	unseen   bool      // pg_stat_activity hides the backend's state (logged once)
	lastSeen time.Time // the last successful look
}

// begin records the migration statement of info's session on tables,
// about to be forwarded.
func (r *runningMigrations) begin(p *Policy, info *proxy.SessionInfo, tables []string) {
	r.mu.Lock()
	s := r.open[info.ID]
	if s == nil {
		s = &runningMigration{info: *info, tables: map[string]bool{}, wake: make(chan struct{}, 1), done: make(chan struct{}), lastSeen: time.Now()}
		if r.all == nil {
			r.all, r.open = map[*runningMigration]bool{}, map[uint64]*runningMigration{}
		}
		r.all[s], r.open[info.ID] = true, s
		r.n.Add(1)
		defer func() { go p.awaitMigrationEnd(s) }()
	}
	for _, t := range tables {
		s.tables[t] = true
	}
	s.seq++
	seq := s.seq
	r.mu.Unlock()
	// Before the statement is forwarded: an idle state the backend
	// reports after this moment is after the statement.
	s.mu.Lock()
	defer s.mu.Unlock()
	s.since, s.sinceSeq = time.Time{}, seq
	m := p.migrations
	if m.catalog == nil || info.BackendPID == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.timeout)
	defer cancel()
	if err := s.connect(ctx, m.catalog); err != nil {
		p.log.Warn("migration: cannot read the server's clock; its end is seen when the session ends", zap.Uint64("conn-id", info.ID), zap.Error(err))
		return
	}
	if err := s.conn.QueryRow(ctx, "SELECT pg_catalog.clock_timestamp()").Scan(&s.since); err != nil {
		s.drop()
		p.log.Warn("migration: cannot read the server's clock; its end is seen when the session ends", zap.Uint64("conn-id", info.ID), zap.Error(err))
	}
}

// connect opens s's connection if it has none; s.mu is held.
func (s *runningMigration) connect(ctx context.Context, catalog CatalogConnect) error {
	if s.conn != nil {
		return nil
	}
	c, err := catalog(ctx, s.info.Database)
	if err != nil {
		return err
	}
	s.conn = c
	return nil
}

// drop closes s's connection; s.mu is held.
func (s *runningMigration) drop() {
	if s.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = s.conn.Close(ctx)
		cancel()
		s.conn = nil
	}
}

// refusal returns the refusal of a write to tables in database while a
// migration on one of them has not been checked since it ended.
func (r *runningMigrations) refusal(database string, tables []string) *rules.Error {
	if r.n.Load() == 0 || len(tables) == 0 {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for s := range r.all {
		if s.info.Database != database {
			continue
		}
		for _, t := range tables {
			if s.tables[t] {
				return &rules.Error{
					Code: rules.CodeRefused,
					Message: "fenceproxy: protected table " + t + " is being migrated in database " + database +
						": writes to it are refused until the migration's transaction has ended and the proxy has checked the table again",
					Detail: "The migration runs in the session of user " + s.info.User + ".",
					Hint:   "Retry the statement once the migration has committed.",
					Table:  t,
				}
			}
		}
	}
	return nil
}

// MigrationEnded tells the policy that info's session has no transaction
// open: the relay calls it when it relays a ReadyForQuery with status
// idle ('I') that answers the session's last message sent upstream, and
// when the session ends. A migration of that session is then checked
// again at once. It is cheap when no migration runs.
func (p *Policy) MigrationEnded(info *proxy.SessionInfo) {
	m := p.migrations
	if m == nil || m.running.n.Load() == 0 {
		return
	}
	r := &m.running
	r.mu.Lock()
	s := r.open[info.ID]
	if s != nil {
		s.ended = s.seq
	}
	r.mu.Unlock()
	if s != nil {
		s.poke()
	}
}

// Idle implements proxy.Policy: a migration of info's session has ended
// (MigrationEnded).
func (p *Policy) Idle(info *proxy.SessionInfo) { p.MigrationEnded(info) }

// PollMigrations has the sessions of migrations running in database looked
// at now: the catalog watch notified a change there, which commits with
// the transaction that made it.
func (p *Policy) PollMigrations(database string) {
	m := p.migrations
	if m == nil || m.running.n.Load() == 0 {
		return
	}
	m.running.mu.Lock()
	for _, s := range m.running.open {
		if s.info.Database == database {
			s.poke()
		}
	}
	m.running.mu.Unlock()
}

// WaitMigrations waits until no migration in database awaits its check:
// the writes to its tables are then decided by the check's results.
func (p *Policy) WaitMigrations(ctx context.Context, database string) error {
	m := p.migrations
	if m == nil {
		return nil
	}
	for {
		var done chan struct{}
		m.running.mu.Lock()
		for s := range m.running.all {
			if s.info.Database == database {
				done = s.done
				break
			}
		}
		m.running.mu.Unlock()
		if done == nil {
			return nil
		}
		select {
		case <-done:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (s *runningMigration) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// awaitMigrationEnd waits for the end of s's transaction, then checks the
// database again and lets the check's results decide the writes to its
// tables.
func (p *Policy) awaitMigrationEnd(s *runningMigration) {
	m := p.migrations
	r := &m.running
	log := p.log.With(zap.String("database", s.info.Database), zap.String("user", s.info.User), zap.Uint64("conn-id", s.info.ID))
	tick := time.NewTicker(migrationPoll)
	for {
		select {
		case <-s.wake:
		case <-tick.C:
		}
		r.mu.Lock()
		ended := s.ended == s.seq
		if ended {
			delete(r.open, s.info.ID)
		}
		r.mu.Unlock()
		if ended {
			break
		}
		seq, how := p.lookAtBackend(s, log)
		if how == "" {
			continue
		}
		r.mu.Lock()
		if s.seq != seq {
			// Another statement was decided meanwhile.
			r.mu.Unlock()
			continue
		}
		delete(r.open, s.info.ID)
		r.mu.Unlock()
		if how == "gave up" {
			log.Error("migration: the end of its transaction cannot be seen; checking its tables again anyway")
		}
		break
	}
	tick.Stop()
	s.mu.Lock()
	s.drop()
	s.mu.Unlock()

	// A check that starts now sees what the transaction committed.
	db := s.info.Database
	var err error
	if fc, ok := p.checks.(freshChecks); ok {
		ctx, cancel := context.WithTimeout(context.Background(), p.checkWait)
		err = fc.WaitFresh(ctx, db)
		cancel()
	} else {
		p.checks.Recheck(db)
	}
	res, known := p.checks.Result(db)
	r.mu.Lock()
	tables := make([]string, 0, len(s.tables))
	for t := range s.tables {
		tables = append(tables, t)
	}
	r.mu.Unlock()
	var failed []string
	for _, t := range tables {
		if len(res.Problems[t]) > 0 {
			failed = append(failed, t)
		}
	}
	switch {
	case err != nil && !errors.Is(err, dbsetup.ErrNotChecked), !known:
		log.Error("migration: the check after it could not finish; writes to its tables go by the last results", zap.Strings("tables", tables), zap.Error(err))
	case len(failed) > 0:
		log.Warn("migration: the check after it failed; writes to these tables are refused", zap.Strings("tables", failed))
	default:
		log.Info("migration: checked again after its transaction ended", zap.Strings("tables", tables))
	}
	// The next statement reads the new results.
	p.catalogMoved(db)
	r.mu.Lock()
	delete(r.all, s)
	r.n.Add(-1)
	r.mu.Unlock()
	close(s.done)
}

// lookAtBackend reads pg_stat_activity for s's backend. It returns the
// statement count it judged (the transaction ended after statements up
// to it) and how the transaction was seen to end: "" while it may still
// run, "gone", "idle" or "gave up".
func (p *Policy) lookAtBackend(s *runningMigration, log *zap.Logger) (uint64, string) {
	m := p.migrations
	s.mu.Lock()
	defer s.mu.Unlock()
	seq := s.sinceSeq
	if m.catalog == nil || s.info.BackendPID == 0 {
		return seq, ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.timeout)
	defer cancel()
	var (
		state  *string
		change *time.Time
	)
	err := s.connect(ctx, m.catalog)
	if err == nil {
		err = s.conn.QueryRow(ctx, "SELECT state, state_change FROM pg_catalog.pg_stat_activity WHERE pid = $1", int64(s.info.BackendPID)).
			Scan(&state, &change)
	}
	switch {
	case err == pgx.ErrNoRows:
		return seq, "gone"
	case err != nil:
		s.drop()
		if time.Since(s.lastSeen) > migrationGiveUp {
			return seq, "gave up"
		}
		return seq, ""
	}
	s.lastSeen = time.Now()
	if state == nil {
		if !s.unseen {
			s.unseen = true
			log.Warn("migration: pg_stat_activity hides the state of its session; writes to its tables are refused until the session ends",
				zap.Uint32("backend-pid", s.info.BackendPID))
		}
		return seq, ""
	}
	if *state == "idle" && !s.since.IsZero() && change != nil && change.After(s.since) {
		return seq, "idle"
	}
	return seq, ""
}
