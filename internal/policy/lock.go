package policy

import (
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// The lock registration procedure (rules.RegisterProc) raises FP001 and
// FP002 itself, with the lock in the message and, for FP001, a DETAIL of
// the form lock='<name>' token=<n> watermark=<n>. The policy counts and
// logs them; it rewrites only the errors of a database where the
// procedure is missing, to name the fix.

// maxLockLabels bounds the distinct lock names used as metric labels:
// lock names are per resource and may be unbounded.
const maxLockLabels = 100

type lockLabels struct {
	mu   sync.Mutex
	seen map[string]bool
}

func (l *lockLabels) label(name string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen[name] {
		return name
	}
	if len(l.seen) >= maxLockLabels || name == "" {
		return "other"
	}
	if l.seen == nil {
		l.seen = make(map[string]bool)
	}
	l.seen[name] = true
	return name
}

// lockDetail parses the DETAIL of a stale-lock FP001.
func lockDetail(detail string) (lock, token, watermark string, ok bool) {
	rest, ok := strings.CutPrefix(detail, "lock='")
	if !ok {
		return "", "", "", false
	}
	i := strings.LastIndex(rest, "' token=")
	if i < 0 {
		return "", "", "", false
	}
	lock = strings.ReplaceAll(rest[:i], "''", "'")
	token, watermark, ok = strings.Cut(rest[i+len("' token="):], " watermark=")
	return lock, token, watermark, ok
}

// lockError handles the errors of the lock registration. It reports
// whether it rewrote e.
func (p *Policy) lockError(info *proxy.SessionInfo, e *pgproto3.ErrorResponse) bool {
	switch {
	case e.Code == rules.CodeStaleToken && strings.HasPrefix(e.Message, "fenceproxy: stale token ") && strings.Contains(e.Message, " for lock "):
		lock, token, watermark, ok := lockDetail(e.Detail)
		if !ok {
			return false
		}
		p.log.Info("stale lock token refused", zap.String("lock", lock), zap.String("token", token), zap.String("watermark", watermark),
			zap.Uint64("conn-id", info.ID), zap.String("user", info.User), zap.String("database", info.Database))
		if p.metrics != nil {
			p.metrics.LockRejections.WithLabelValues(p.locks.label(lock), "stale").Inc()
		}
	case e.Code == rules.CodeMissingToken && strings.HasPrefix(e.Message, "fenceproxy: no lock name"):
		if p.metrics != nil {
			p.metrics.LockRejections.WithLabelValues("", "missing_lock").Inc()
		}
	case e.Code == rules.CodeMissingToken && strings.HasPrefix(e.Message, "fenceproxy: lock ") && strings.Contains(e.Message, "not a valid fencing token"):
		if p.metrics != nil {
			p.metrics.LockRejections.WithLabelValues("other", "missing_token").Inc()
		}
	}
	return false
}

// raiserMissing reports whether a 42883 message ("function
// fenceproxy.tok_b(unknown, unknown) does not exist", in the server's
// language) names one of the error raisers of fenceproxy setup.
func raiserMissing(msg string) bool {
	for _, name := range dbsetup.RaiserNames() {
		call := "fenceproxy." + name + "("
		for rest, at := msg, 0; ; {
			i := strings.Index(rest, call)
			if i < 0 {
				break
			}
			// Not the end of a longer name (myfenceproxy.tok).
			if at+i == 0 || !sqllex.IsIdentCont(msg[at+i-1]) {
				return true
			}
			at += i + len(call)
			rest = msg[at:]
		}
	}
	return false
}

// objectsGone is called when a statement found gone an object of
// `fenceproxy setup` that database's check had found. The database is
// checked again, and its results are read again at the next decision;
// and, at most once a second (the errors come from statements, which a
// client can repeat or forge), statements prepared before are decided
// again before they next run, so that one that only runs (a kept
// prepared statement) reads the new results too: once they say the
// object is gone, it no longer calls it (refreshDBState).
func (p *Policy) objectsGone(database string) {
	if p.checks != nil {
		p.checks.Recheck(database)
	}
	v, ok := p.checkCache.byDB.Load(database)
	if !ok {
		return
	}
	st := v.(*dbChecks)
	st.expired.Store(true)
	now := time.Now().UnixNano()
	last := st.goneAt.Load()
	if now-last < int64(time.Second) || !st.goneAt.CompareAndSwap(last, now) {
		return
	}
	p.bumpGeneration(database)
}

// missingObjectsError handles the errors of statements that call objects
// of `fenceproxy setup` the database no longer has: the statement did not
// run (fail closed), and the client learns why and the fix. It reports
// whether it rewrote e.
func (p *Policy) missingObjectsError(info *proxy.SessionInfo, e *pgproto3.ErrorResponse) bool {
	schemaGone := e.Code == "3F000" && strings.Contains(e.Message, `"fenceproxy"`)
	var msg, hint string
	switch {
	case e.Code == "42883" && raiserMissing(e.Message),
		schemaGone && p.checkedRaisers(info.Database):
		// The error raisers were removed after the check that found them.
		// A new check finds them missing, and the rewrites go back to the
		// inline form.
		p.objectsGone(info.Database)
		msg = "fenceproxy: the error raisers of fenceproxy setup were removed from database " + info.Database + " since fenceproxy checked it; the statement did not run"
		hint = "Retry it: fenceproxy checks the database again and fences without them meanwhile. Run `fenceproxy setup -c <config file>` to restore them."
	case e.Code == "42883" && strings.Contains(e.Message, rules.HoldProc+"(") && !schemaGone:
		// fenceproxy.hold was removed after the check that found it: a
		// new check finds it missing, and registrations go back to
		// fenceproxy.register.
		p.objectsGone(info.Database)
		msg = "fenceproxy: the lock registration procedure " + rules.HoldProc + " was removed from database " + info.Database + " since fenceproxy checked it; the statement did not run"
		hint = "Retry it: fenceproxy checks the database again and registers with " + rules.RegisterProc + " meanwhile. Run `fenceproxy setup -c <config file>` to restore it."
	case e.Code == "42883" && strings.Contains(e.Message, rules.ReholdAtProc+"(") && !schemaGone:
		// fenceproxy.rehold_at was removed after the check that found
		// it: a new check finds it missing, and the relay calls hold_at.
		p.objectsGone(info.Database)
		msg = "fenceproxy: the procedure " + rules.ReholdAtProc + " was removed from database " + info.Database + " since fenceproxy checked it; the statement did not run"
		hint = "Retry it: fenceproxy checks the database again and does without it meanwhile. Run `fenceproxy setup -c <config file>` to restore it."
	case e.Code == "42883" && strings.Contains(e.Message, rules.HoldAtProc+"(") && !schemaGone:
		// fenceproxy.hold_at was removed after the check that found it:
		// a new check finds it missing, and the relay sends the
		// statements it stood for again.
		p.objectsGone(info.Database)
		msg = "fenceproxy: the procedure " + rules.HoldAtProc + " was removed from database " + info.Database + " since fenceproxy checked it; the statement did not run"
		hint = "Retry it: fenceproxy checks the database again and does without it meanwhile. Run `fenceproxy setup -c <config file>` to restore it."
	case e.Code == "42883" && strings.Contains(e.Message, rules.EnterProc+"(") && !schemaGone:
		// fenceproxy.enter was removed after the check that found it: a
		// new check finds it missing, and the relay sends the statements
		// it stood for again.
		p.objectsGone(info.Database)
		msg = "fenceproxy: the procedure " + rules.EnterProc + " was removed from database " + info.Database + " since fenceproxy checked it; the statement did not run"
		hint = "Retry it: fenceproxy checks the database again and does without it meanwhile. Run `fenceproxy setup -c <config file>` to restore it."
	case schemaGone || (e.Code == "42883" && strings.Contains(e.Message, rules.RegisterProc+"(")):
		msg = "fenceproxy: lock fencing is not set up in database " + info.Database + ": the procedure " + rules.RegisterProc + " is missing"
		hint = "Run `fenceproxy setup -c <config file>` for this database, or set lock: off for the table."
	default:
		return false
	}
	e.Detail = "PostgreSQL: " + e.Message
	e.Message, e.Hint, e.Position = msg, hint, 0
	return true
}
