package proxy

// The record of a session's fence settings, with PostgreSQL's rules for
// SET, SET LOCAL, transactions and savepoints (settings.go has the
// overview).

import (
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

type fenceValues struct{ token, lock string }

func (v *fenceValues) set(which uint8, val string) {
	if which&rules.SettingToken != 0 {
		v.token = val
	}
	if which&rules.SettingLock != 0 {
		v.lock = val
	}
}

func (v *fenceValues) copyFrom(o fenceValues, which uint8) {
	if which&rules.SettingToken != 0 {
		v.token = o.token
	}
	if which&rules.SettingLock != 0 {
		v.lock = o.lock
	}
}

type fenceSavepoint struct {
	name      string
	pend, cur fenceValues
}

// fenceRecord is the model; guarded by session.mu. Outside a transaction
// pend and cur equal sess. In one, pend is the session-level value a
// commit keeps and cur the value in effect (SET LOCAL changes only cur).
type fenceRecord struct {
	on        bool
	tokenName string
	lockName  string
	// readWords are the words of a text that may read the settings
	// (preludeRead): their names' first parts and settingReadWords.
	readWords             []string
	defaults              fenceValues
	sess, pend, cur       fenceValues
	inTx, failed          bool
	saves                 []fenceSavepoint
	unresolved            int  // operations sent and not yet answered
	startupTok, startupLk bool // the startup packet set them
	// broken: the response bookkeeping lost track; the record is unknown.
	broken bool
	// registered: a lock registration of regLock and regToken succeeded
	// in the open transaction (spareRegistration).
	registered        bool
	regLock, regToken string
	// held is a lock and a token whose registration succeeded in a
	// transaction that committed (ready, apply), whatever the values in
	// effect since: the lock's watermark was then the token, and
	// watermarks only grow, so a registration of the same values can take
	// the lock shared before it reads the watermark (holdAtProc). cand is
	// one that succeeded in the transaction still open (candSet). Being
	// wrong costs no safety: the procedure then takes what register
	// decides, or refuses the statement for a retry (FP003).
	held, cand fenceValues
	candSet    bool
	// regDone is registeredDone's callback for the values regDoneVals,
	// kept for the next registration of the same values.
	regDone     func(outcome)
	regDoneVals fenceValues
	// mayEnd: a statement the client sent since the relay was last idle
	// may end its transaction from stored code (a CALL or DO, which may
	// COMMIT or ROLLBACK outside a transaction block, where the relay
	// does not see it): cand is then not kept.
	mayEnd bool
	// portal follows the portal the relay closed for a Bind's token
	// (requests.closed): whether the server would still have it.
	portal portalLife
}

// portalLife is what became of a portal since its Bind, at savepoint
// depth depth: dead once its transaction ended or a rollback to a
// savepoint set before the Bind undid it (watch: being followed).
// earlier counts the ReadyForQuerys still to come, when the following
// began, for segments sent before the portal's (a pipeline's earlier
// Syncs): what their statements did, the portal's segment came after.
type portalLife struct {
	watch, dead bool
	depth       int
	earlier     int
}

// endPortal records that the followed portal died (its transaction ended,
// or a rollback undid its Bind), unless what ended it belongs to an
// earlier segment.
func (f *fenceRecord) endPortal() {
	if f.portal.earlier == 0 {
		f.portal.dead = true
	}
}

func (f *fenceRecord) forgetRegistration() { f.registered = false }

// mayEndTx reports whether sql may end its transaction from stored code:
// it has the word CALL or DO (keywords, never quoted or escaped), in any
// place (a string or a comment only costs the memory of a registration,
// fenceRecord.held). A procedure or a DO block called outside a
// transaction block may COMMIT or ROLLBACK, even after other statements
// of an extended-protocol pipeline.
func mayEndTx(sql string) bool { return sqllex.ContainsAnyWordFold(sql, endWords) }

var endWords = []string{"call", "do"}

// mayRemember reports whether the session may come to remember a
// registration (fenceRecord.held): it names a lock, or one is pending.
func (r *requests) mayRemember() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	f := &r.fence
	return f.cur.lock != "" || f.sess.lock != "" || f.candSet
}

// noteMayEnd records, before a client's statement that may end its
// transaction from stored code is sent (mayEndTx), that the registration
// of the transaction is not to be remembered. Callers hold session.mu.
func (f *fenceRecord) noteMayEnd() {
	if f.on {
		f.mayEnd = true
	}
}

func (f *fenceRecord) revert() {
	f.pend, f.cur = f.sess, f.sess
	f.saves, f.failed = nil, false
}

func (f *fenceRecord) commit() {
	f.sess = f.pend
	f.cur = f.pend
	f.saves, f.failed = nil, false
}

// apply records op, which ran (v is the value it set, resolved from the
// Bind's parameters for SetParams).
func (f *fenceRecord) apply(op rules.SettingOp, v string, local, null bool, which uint8) {
	f.inTx = true
	switch op.Kind {
	case rules.SetValue, rules.SetParams:
		if null {
			var d fenceValues
			d.copyFrom(f.defaults, which)
			v = d.token
			if which == rules.SettingLock {
				v = d.lock
			}
		}
		if !local {
			f.pend.set(which, v)
		}
		f.cur.set(which, v)
	case rules.SetDefault:
		if !op.Local {
			f.pend.copyFrom(f.defaults, which)
		}
		f.cur.copyFrom(f.defaults, which)
	case rules.ResetAll:
		f.pend, f.cur = f.defaults, f.defaults
	case rules.SetCurrent:
		f.pend.copyFrom(f.cur, which)
	case rules.TxBegin:
	case rules.TxCommit, rules.TxPrepare:
		f.endPortal()
		f.forgetRegistration()
		if op.Kind == rules.TxCommit && !f.failed && f.candSet && !f.mayEnd {
			f.held = f.cand
		}
		f.candSet = false
		if f.failed {
			f.revert() // COMMIT of a failed transaction rolls it back
		} else {
			f.commit()
		}
		f.inTx = op.Chain
	case rules.TxRollback:
		f.endPortal()
		f.forgetRegistration()
		f.candSet = false
		f.revert()
		f.inTx = op.Chain
	case rules.TxSavepoint:
		f.saves = append(f.saves, fenceSavepoint{name: op.Savepoint, pend: f.pend, cur: f.cur})
	case rules.TxRelease:
		if i := f.savepoint(op.Savepoint); i >= 0 {
			f.saves = f.saves[:i]
			f.portal.depth = min(f.portal.depth, i)
		}
	case rules.TxRollbackTo:
		// What the savepoint undid may include a registration.
		f.forgetRegistration()
		f.candSet = false
		if i := f.savepoint(op.Savepoint); i >= 0 {
			f.pend, f.cur = f.saves[i].pend, f.saves[i].cur
			f.saves = f.saves[:i+1]
			if i < f.portal.depth {
				f.endPortal() // bound after the savepoint
			}
		} else {
			f.endPortal()
		}
		f.failed = false
	}
}

func (f *fenceRecord) savepoint(name string) int {
	for i := len(f.saves) - 1; i >= 0; i-- {
		if f.saves[i].name == name {
			return i
		}
	}
	return -1
}

// ready records a ReadyForQuery: 'I' ends the transaction (committed
// unless it failed or was rolled back).
func (f *fenceRecord) ready(status byte) {
	defer func() {
		if f.portal.earlier > 0 {
			f.portal.earlier-- // one earlier segment answered
		}
	}()
	if status != 'T' {
		f.forgetRegistration()
		// 'I': the transaction of a registration that succeeded ended
		// without an error (an explicit rollback cleared cand in apply).
		if status == 'I' && f.candSet && !f.failed && !f.mayEnd {
			f.held = f.cand
		}
		f.candSet = false
	}
	switch status {
	case 'I':
		f.endPortal()
		if f.inTx {
			if f.failed {
				f.revert()
			} else {
				f.commit()
			}
		}
		f.inTx, f.failed = false, false
	case 'T':
		f.inTx, f.failed = true, false
	case 'E':
		f.inTx, f.failed = true, true
	}
}

// simplePrelude is the text put before a simple Query's text on a
// protected table: two statements, each answering one CommandComplete,
// that set the session's values (v, read from the record) transaction-
// locally.
func simplePrelude(tokenName, lockName string, v fenceValues) string {
	return "SET LOCAL " + tokenName + " = " + quoteFenceValue(v.token) + ";SET LOCAL " + lockName + " = " + quoteFenceValue(v.lock) + ";"
}
