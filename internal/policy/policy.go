// Package policy connects the pure rewriter (package rules) to the relay
// (package proxy): it holds the rule set in force, swaps it on reload, turns
// rules decisions into proxy decisions, translates the errors that
// rewritten statements raise on purpose into fenceproxy errors, and counts
// what happened in the metrics.
package policy

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/metrics"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Policy implements proxy.Policy. The zero value is not usable; use New.
type Policy struct {
	current atomic.Pointer[ruleSet]
	dbGens  dbGenerations // see Generation
	locks   lockLabels
	swapMu  sync.Mutex // orders Swaps, so generations in force only grow
	log     *zap.Logger
	metrics *metrics.Metrics
	auditor Auditor
	// checks, when set, are the database checks: writes to tables whose
	// check failed, and writes through relations that reach protected
	// tables unseen, are refused.
	checks     Checks
	checkWait  time.Duration
	configFile string
	checkCache checkCache
	followers  sync.Map    // database → *catalogFollower (followCatalog)
	migrations *migrations // see SetMigrations; nil: none
}

// ruleSet is a rule set with the lookups the policy needs.
type ruleSet struct {
	gen    uint64 // see Generation
	rules  *rules.Rules
	tables map[string]bool // display names of protected tables
	// notifies: some rewritten statements report through rules.AuditChannel
	// (mode: audit, or missing_token: allow), so a listener must run.
	notifies bool
	// nonASCII: a protected name has bytes >= 0x80, which MayTouch can only
	// find in UTF-8 text.
	nonASCII bool
}

func newRuleSet(rs *rules.Rules, notifies bool) *ruleSet {
	s := &ruleSet{rules: rs, tables: make(map[string]bool), notifies: notifies}
	if rs != nil {
		for _, t := range rs.Tables() {
			s.tables[t] = true
		}
		s.nonASCII = rs.HasNonASCIINames()
	}
	return s
}

// tableLabel returns a metric label for a table named in an upstream error.
// The name comes from text the server sent back, which a client can forge,
// so only configured names are used as label values.
func (s *ruleSet) tableLabel(t string) string {
	if s.tables[t] {
		return t
	}
	return "unknown"
}

// Auditor is what the policy needs of the audit listener (package audit):
// a listener in a database before a statement that reports there runs.
type Auditor interface {
	Ensure(database string) error
	// Ready reports, without waiting, whether Ensure would return nil.
	Ready(database string) bool
}

// Options configure a Policy.
type Options struct {
	// Logger receives a line for every fenced write. Default: none.
	Logger *zap.Logger
	// Metrics, when set, counts stale rejections and missing tokens.
	Metrics *metrics.Metrics
	// Auditor, when set, listens for the events of rewritten statements
	// (see rules.AuditChannel) in each database where they run.
	Auditor Auditor
	// Checks, when set, checks each database the first time a session
	// uses it (the first statement waits for it, up to CheckWait, default
	// 10s); ConfigFile is named in the fixes the refusals suggest.
	Checks     Checks
	CheckWait  time.Duration
	ConfigFile string
}

var _ proxy.Policy = (*Policy)(nil)

// New returns a Policy enforcing rs (nil: forward everything). notifies
// says whether rs has tables in audit mode or with missing_token: allow,
// whose statements report through rules.AuditChannel.
func New(rs *rules.Rules, notifies bool, opts Options) *Policy {
	p := &Policy{log: opts.Logger, metrics: opts.Metrics, auditor: opts.Auditor, checks: opts.Checks, checkWait: opts.CheckWait, configFile: opts.ConfigFile}
	if p.checkWait <= 0 {
		p.checkWait = 10 * time.Second
	}
	if p.configFile == "" {
		p.configFile = "fenceproxy.yaml"
	}
	if p.log == nil {
		p.log = zap.NewNop()
	}
	p.current.Store(newRuleSet(rs, notifies))
	return p
}

// Swap installs a new rule set; statements decided after it returns use it,
// and statements prepared before it are decided again before they next run
// (see Generation).
func (p *Policy) Swap(rs *rules.Rules, notifies bool) {
	set := newRuleSet(rs, notifies)
	p.swapMu.Lock()
	defer p.swapMu.Unlock()
	set.gen = p.current.Load().gen + 1
	p.current.Store(set)
}

// Generation implements proxy.Policy: it counts the Swaps, which every
// database's sessions decide again with, plus the changes of database's
// own check results (catalog paths, objects found gone), which only its
// sessions do.
func (p *Policy) Generation(database string) uint64 {
	return p.current.Load().gen + p.dbGens.get(database)
}

// PreparedOps implements proxy.Policy: the rewriter's.
func (p *Policy) PreparedOps(sql string) ([]proxy.PreparedOp, error) { return rules.PreparedOps(sql) }

// KnownTable reports whether t is a table of the rules in force (for
// metric labels).
func (p *Policy) KnownTable(t string) bool { return p.current.Load().tables[t] }

// Rules returns the rule set in force.
func (p *Policy) Rules() *rules.Rules { return p.current.Load().rules }

// Decide implements proxy.Policy.
func (p *Policy) Decide(info *proxy.SessionInfo, lex proxy.Lexing, sql string) rules.Decision {
	d, _ := p.decide(info, lex, sql, false)
	return d
}

// DecideQuick implements proxy.Policy: Decide when the answer needs
// no parse and no wait for the database or the audit listener.
func (p *Policy) DecideQuick(info *proxy.SessionInfo, lex proxy.Lexing, sql string) (rules.Decision, bool) {
	return p.decide(info, lex, sql, true)
}

// decide is Decide; quick, it reports false instead of parsing or waiting.
func (p *Policy) decide(info *proxy.SessionInfo, lex proxy.Lexing, sql string, quick bool) (rules.Decision, bool) {
	set := p.current.Load()
	rs := set.rules
	if rs == nil {
		return rules.Decision{}, true
	}
	// The database's check results: its problems and indirect paths refuse
	// statements below, and where it has the error raisers the rewrites
	// call them (so they are read before the rules decide, even for a
	// text the rules then refuse without looking at the database).
	var st *dbChecks
	if quick {
		var ok bool
		if st, ok = p.dbStateKept(keptState(info), info.Database); !ok {
			return rules.Decision{}, false
		}
	} else {
		st = p.dbState(info.Database)
	}
	if tables, ok := recall(info, set, st, lex, sql); ok {
		return rules.Decision{Tables: tables}, true
	}
	// The rules' decision for this session (its scope, the server's
	// lexing, the form of the rewrite), in one call.
	d, final, ok := rs.DecideFor(rules.Session{
		Database: info.Database, User: info.User, ApplicationName: info.ApplicationName,
		Lexing:  lex,
		Raisers: st != nil && st.raisers,
		StaleAt: st != nil && st.staleAt,
		Hold:    st != nil && st.hold,
		Readers: st.readersOrNil(),
		Quick:   quick,
	}, sql)
	switch {
	case !ok:
		return rules.Decision{}, false
	case final:
		// Refused before the rules decide (a DROP DATABASE from a session
		// they do not fence, a text the server may read otherwise): no
		// step below may lift it.
		return d, true
	}
	// The migrations judge the text against the session's tables.
	var session *rules.Rules
	if p.migrations != nil {
		session = rs.ForSession(info.Database, info.User, info.ApplicationName)
	}
	ok, judged := p.migration(info, session, sql, &d, quick)
	if !ok {
		return rules.Decision{}, false
	}
	var check stampCheck
	if d.Action != rules.Refuse && st != nil {
		// The paths' check parses as the rules do: a text the server may
		// read otherwise is refused where it may write through a path.
		if e := st.indirect.LexingRefusal(lex, sql); e != nil {
			return rules.Decision{Action: proxy.Refuse, Err: e, Tables: d.Tables}, true
		}
		e, c, ok := p.checkRefusal(st, info, sql, &d, lex.Prepared, quick)
		if !ok {
			return rules.Decision{}, false
		}
		if e != nil {
			return rules.Decision{Action: proxy.Refuse, Err: e, Tables: d.Tables}, true
		}
		check = c
	}
	// A rewrite, and a lock registration, may report to the audit
	// listener: it must be in place first.
	reports := d.Action == rules.Rewrite || (d.Action != rules.Refuse && d.Lock != nil)
	switch {
	case reports && quick:
		// Ready is what Ensure would find at once: nothing more to do.
		if !p.auditorReady(set, info) {
			return rules.Decision{}, false
		}
	case reports:
		p.ensureAuditor(set, info)
	}
	if d.AuditRefusal != nil {
		// Every table involved is in audit mode: the statement enforce would
		// refuse is forwarded as sent, and only the proxy can record it.
		p.recordAuditRefusal(set, info, d.AuditRefusal)
	}
	switch {
	case d.Action == rules.Refuse:
		return rules.Decision{Action: proxy.Refuse, Err: d.Err, Tables: d.Tables}, true
	case check.on && d.Lock != nil:
		// The catalog check goes first, then the lock registration, in
		// the statement's transaction.
		return rules.Decision{Action: d.Action, SQL: d.SQL, Tables: d.Tables, Lock: checkedRegistration(check, d.Lock), Preparable: d.Preparable, Tok: d.Tok}, true
	case check.on && d.Action == rules.Rewrite:
		// The catalog check goes before the statement, in its
		// transaction.
		return rules.Decision{Action: proxy.Rewrite, SQL: d.SQL, Tables: d.Tables, Lock: catalogCheck(check, d.SQL), Preparable: d.Preparable, Tok: d.Tok}, true
	case check.on:
		return rules.Decision{Tables: d.Tables, Lock: catalogCheck(check, sql)}, true
	}
	lock := d.Lock
	if lock != nil && lock.Args != nil && st != nil && st.enter {
		// The relay may send the fence settings and the registration as
		// one call (the rules' LockCall is cached: a copy says so).
		l := *lock
		l.Enter = true
		lock = &l
	}
	if d.Action == rules.Rewrite {
		return rules.Decision{Action: proxy.Rewrite, SQL: d.SQL, Tables: d.Tables, Lock: lock, Preparable: d.Preparable, Tok: d.Tok}, true
	}
	p.remember(info, set, st, lex, sql, &d, judged || check.stamped)
	return rules.Decision{Tables: d.Tables, Lock: lock}, true
}

// auditorReady reports whether ensureAuditor would return at once.
func (p *Policy) auditorReady(set *ruleSet, info *proxy.SessionInfo) bool {
	return !set.notifies || p.auditor == nil || p.auditor.Ready(info.Database)
}

// ensureAuditor puts the audit listener in place, if statements of this
// rule set may report, before a statement that may report can commit.
func (p *Policy) ensureAuditor(set *ruleSet, info *proxy.SessionInfo) {
	if !set.notifies || p.auditor == nil {
		return
	}
	// Audit never blocks a write: a failure is logged.
	if err := p.auditor.Ensure(info.Database); err != nil {
		p.log.Error("audit listener unavailable; audit events of this statement may be lost",
			zap.Uint64("conn-id", info.ID), zap.Error(err))
	}
}

// NamesLock implements proxy.Policy: text mentions the lock setting's
// name (ASCII case ignored), so it may set it.
func (p *Policy) NamesLock(info *proxy.SessionInfo, text string) bool {
	rs := p.current.Load().rules
	if rs == nil || !rs.HasLocks() {
		return false
	}
	return rules.ContainsFold(text, rs.LockSetting())
}

// MayTouch implements proxy.Policy: whether sql may concern a
// protected table for this session, so that its exact lexing matters.
func (p *Policy) MayTouch(info *proxy.SessionInfo, sql string) bool {
	set := p.current.Load()
	if set.rules == nil {
		return false
	}
	if set.nonASCII {
		return true // a name MayTouch cannot find in non-UTF-8 text
	}
	if set.rules.ForSession(info.Database, info.User, info.ApplicationName).MayTouch(sql) {
		return true
	}
	// A read through a view or parent of a lock-fenced table registers
	// too (rules.Session.Readers).
	if !set.rules.HasLocks() || p.checks == nil {
		return false
	}
	v, ok := p.checkCache.byDB.Load(info.Database)
	return ok && v.(*dbChecks).readers.MayApply(sql)
}

// DecisionCost implements proxy.Policy: 0 for a text MayTouch clears,
// otherwise what the rules' decision may hold (rules.DecisionCost).
func (p *Policy) DecisionCost(info *proxy.SessionInfo, sql string) int64 {
	if !p.MayTouch(info, sql) {
		return 0
	}
	return p.current.Load().rules.ForSession(info.Database, info.User, info.ApplicationName).DecisionCost(sql)
}

// TranslateError implements proxy.Policy.
func (p *Policy) TranslateError(info *proxy.SessionInfo, e *pgproto3.ErrorResponse) bool {
	if p.catalogCheckFailed(info, e) || p.lockError(info, e) || p.missingObjectsError(info, e) {
		return true
	}
	fe, ok := rules.TranslateError(e.Code, e.Message)
	if !ok {
		return false
	}
	e.Code, e.Message, e.Detail, e.Hint = fe.Code, fe.Message, fe.Detail, fe.Hint
	if p.metrics != nil {
		table := p.current.Load().tableLabel(fe.Table)
		switch fe.Code {
		case rules.CodeStaleToken:
			p.metrics.StaleRejections.WithLabelValues(table).Inc()
		case rules.CodeMissingToken:
			p.metrics.MissingTokens.WithLabelValues(table, "rejected").Inc()
		}
	}
	return true
}

func (p *Policy) recordAuditRefusal(set *ruleSet, info *proxy.SessionInfo, e *rules.Error) {
	p.log.Warn("audit: enforce mode would have rejected this write",
		zap.String("table", e.Table), zap.String("reason", "refused"), zap.String("mode", "audit"),
		zap.String("sqlstate", e.Code), zap.String("refusal", e.Message),
		zap.Uint64("conn-id", info.ID), zap.String("user", info.User), zap.String("database", info.Database),
		zap.String("application-name", info.ApplicationName), zap.String("remote-addr", info.RemoteAddr))
	if p.metrics != nil {
		p.metrics.AuditWouldReject.WithLabelValues(set.tableLabel(e.Table), "refused").Inc()
	}
}
