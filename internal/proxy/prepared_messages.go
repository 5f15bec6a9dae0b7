package proxy

// The extended protocol's messages that run or remove prepared statements
// and portals (Bind, Describe, Execute, Close), checked against the rules
// in force (prepared.go has the overview).

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"go.uber.org/zap"
)

// relayBind handles a Bind: the statement it binds must be decided under
// the rules in force, and the portal remembers under which.
func (r *requests) relayBind(body []byte) error {
	// The names alias the read buffer: what is kept is copied.
	portal, rest, ok := cstringView(body)
	stmt, _, ok2 := cstringView(rest)
	if !ok || !ok2 {
		return r.sess.protocolViolation(fmt.Errorf("malformed Bind"))
	}
	send, tok, err := r.bindHead(portal, stmt, body)
	if err != nil || !send {
		return err
	}
	if tok != "" {
		// The statement's parameter form: the session's token last; the
		// portal must run before anything can change the token.
		r.keepLive(portal, stmt, body)
		out, ok := withTokenParam(r.bindBuf, body, tok)
		if !ok {
			return fmt.Errorf("proxy: a Bind checked for the token's parameter could not take it")
		}
		if cap(out) <= maxReusedBind {
			r.bindBuf = out[:0]
		}
		body = out
	}
	return r.forwardTracked('B', body)
}

// maxReusedBind bounds the buffer a session keeps for the Binds it adds
// the token to.
const maxReusedBind = 16 << 10

// bindHead does what a Bind of stmt into portal needs before it goes
// upstream: the checks against the rules in force, a statement prepared
// again, the session's fence settings and the lock registration, the
// portal's bookkeeping. It reports whether the Bind is to be sent; if not,
// something failing stands in its place. body is the whole message, or
// nil when its parameter values are streamed past (bindNeedsValues is
// false): then they are not read. tok is the token to append to the Bind
// as its last parameter ("" for none: tokenparam.go).
func (r *requests) bindHead(portal, stmt string, body []byte) (send bool, tok string, err error) {
	refuse := func(e *rules.Error) (bool, string, error) { return false, "", r.sendRefusedInstead(e) }
	if r.liveSet && portal == "" && r.live == "" {
		r.liveSet = false // a Bind of the unnamed portal replaces it
	}
	if r.closedSet && serverKey(portal) == serverKey(r.closed) {
		r.closedSet = false
	}
	gen := r.ps.generation()
	v, err := r.checkStatement(stmt, gen, false)
	if err != nil {
		return false, "", err
	}
	if v.refuse != nil {
		return refuse(v.refuse)
	}
	if r.fence.on && (v.def == nil || v.def.mayEnd) && r.mayRemember() {
		r.mu.Lock()
		r.fence.noteMayEnd()
		r.mu.Unlock()
	}
	if v.reprepare != nil {
		if err := r.reprepare(strings.Clone(stmt), v); err != nil {
			return false, "", err
		}
	}
	var fence []fenceApplied
	prelude := false // the session's values go first (sendPrelude)
	byValue := false // the check and the registration as one call of hold_at (holdAtBind)
	if v.def != nil && v.def.param > 0 && !r.fence.on {
		return refuse(errFenceBroken) // not reached: the form needs the record
	}
	if r.fence.on && v.def != nil {
		var ok bool
		if fence, ok = r.resolveBindOps(v.def.fence, body); !ok {
			return refuse(refuseFenceUnknown("a Bind whose parameters for set_config cannot be read"))
		}
		everywhere := v.def.plain && len(v.def.ops) == 0 && (!v.def.kept || mayWrite(v.def.sql)) &&
			r.srv.opts.Policy.SettingsEverywhere(&r.info)
		if !v.def.plain || len(v.def.ops) > 0 || everywhere {
			// A statement on a protected table: the session's own values
			// first, transaction-locally; the registration follows them.
			named, ok, err := r.fenceReady()
			if err != nil {
				return false, "", err
			}
			if !ok {
				return refuse(errFenceBroken)
			}
			r.lockNamed = named
			if v.def.param > 0 {
				t, e, nd, err := r.tokenBind(strings.Clone(stmt), v.def, body)
				switch {
				case err != nil:
					return false, "", err
				case e != nil:
					return refuse(e)
				case nd != nil:
					v.def = nd
				}
				tok = t
				if tok != "" {
					// One portal at a time is live: another one is
					// closed, as anything else before its Execute would.
					if r.liveSet && serverKey(portal) != serverKey(r.live) {
						if err := r.closeLive(); err != nil {
							return false, "", err
						}
					}
					r.liveDef, r.liveGen = v.def, gen
				}
			}
			prelude = everywhere || !v.def.forward || len(v.def.ops) > 0 || readsSettings(v.def.lock, named)
			switch {
			case prelude && tok != "" && v.def.settingFree && !everywhere && len(v.def.ops) == 0 && !readsSettings(v.def.lock, named) &&
				r.goesBare(portal, tok, body):
				// The token is bound, and nothing else reads a setting
				// (the catalog check, if any, reads none): bare.go.
				prelude = false
			case prelude && tok != "" && v.def.settingFree && !everywhere && len(v.def.ops) == 0 && named && r.holdAtFits(v.def.lock) &&
				r.goesBare(portal, tok, body):
				// The same, but for the lock registration, which reads
				// the settings: it goes by value (holdAtBind).
				prelude, byValue = false, true
			}
		}
	}
	if v.def != nil && v.def.param > 0 && tok == "" {
		return refuse(errFenceBroken) // not reached: the token is bound above
	}
	lock := r.bindLock(v.def, gen)
	if lock.refuse != nil {
		return refuse(lock.refuse)
	}
	// The catalog check runs whether or not the registration does.
	var check *rules.LockCall
	if v.def != nil && v.def.lock != nil && v.def.lock.Pre != "" {
		check = v.def.lock
	}
	if byValue && lock.call != "" && lock.reg == v.def.lock && check != nil {
		if err := r.holdAtBind(check); err != nil {
			return false, "", err
		}
	} else if byValue {
		return refuse(errFenceBroken) // not reached: holdAtFits saw the registration
	} else if lock.call != "" && !(r.fence.on && r.spare(lock.reg)) {
		if err := r.beforeBind(prelude, check, lock); err != nil {
			return false, "", err
		}
	} else if err := r.beforeBind(prelude, check, bindVerdict{}); err != nil {
		return false, "", err
	}
	r.mu.Lock()
	pkey := serverKey(portal)
	old := r.ps.portals[pkey]
	r.ps.portalSeq++
	next := portalEntry{def: v.def, gen: gen, seg: r.ps.sentSeg, id: r.ps.portalSeq, fence: fence}
	if portal != "" && old != nil && old.seg >= r.ps.idleSeg {
		// A named portal cannot be bound twice in a transaction: this
		// Bind fails and the old one stays open.
		next.uncertain = true
		next.gen = min(old.gen, gen)
	}
	pe := old
	if pe != nil {
		*pe = next // reused: the relay allocates nothing per Bind
	} else {
		pe = new(portalEntry)
		*pe = next
		pkey = strings.Clone(pkey) // portal may alias the read buffer
	}
	full := false
	if old == nil && len(r.ps.portals) >= maxTrackedPortals {
		for k, p := range r.ps.portals {
			if p.seg < r.ps.idleSeg {
				delete(r.ps.portals, k)
			}
		}
		full = len(r.ps.portals) >= maxTrackedPortals
	}
	if !full {
		r.ps.portals[pkey] = pe
	}
	r.mu.Unlock()
	if full {
		return refuse(refusePrepared("too many open portals in this session", "Close portals you no longer need, or end the transaction."))
	}
	return true, tok, nil
}

// bindStreamBytes: a Bind longer than this has its parameter values
// streamed upstream instead of held (relayLargeBind); bindNamesBytes is
// how much of it is looked at for the two names.
const (
	bindStreamBytes = 64 << 10
	bindNamesBytes  = 1024
)

// relayLargeBind relays a Bind of n bytes whose header was read, holding
// only its names: the values are copied upstream as they arrive. It
// reports false, having read nothing, when the Bind must be read whole
// (names longer than bindNamesBytes, or values the fence settings need).
func (r *requests) relayLargeBind(n int) (bool, error) {
	head, err := r.cr.peek(min(n, bindNamesBytes))
	if err != nil {
		return true, clientErr(err)
	}
	portal, rest, ok := cstringView(head)
	stmt, _, ok2 := cstringView(rest)
	if !ok || !ok2 {
		return false, nil
	}
	// peek's bytes last until the next read; the checks below may wait.
	portal, stmt = strings.Clone(portal), strings.Clone(stmt)
	if r.bindNeedsValues(stmt) {
		return false, nil
	}
	send, tok, err := r.bindHead(portal, stmt, nil)
	if err != nil {
		return true, err
	}
	if tok != "" {
		return true, fmt.Errorf("proxy: a streamed Bind of a statement that takes the token")
	}
	if !send {
		if err := r.cr.skip(n); err != nil {
			return true, clientErr(err)
		}
		return true, nil
	}
	return true, r.forwardUnread('B', n)
}

// bindNeedsValues reports whether a Bind of stmt must be read whole: the
// statement calls set_config with bound parameters, whose values the
// record of the fence settings needs. Unknown statements are read whole.
func (t *tracker) bindNeedsValues(stmt string) bool {
	if !t.fence.on {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.ps.stmts[serverKey(stmt)]
	if e == nil {
		return true
	}
	for _, d := range e.defs() {
		if d.param > 0 {
			return true // the token is added to it
		}
		for _, op := range d.fence {
			if op.Kind == rules.SetParams {
				return true
			}
		}
	}
	return false
}

// reprepare sends Close and Parse for a statement whose text the rules in
// force decide differently, before the client's message that runs it.
func (r *requests) reprepare(name string, v stmtVerdict) error {
	r.mu.Lock()
	r.ps.addStmtOp(name, nil, false, '3', false, 0)
	r.mu.Unlock()
	if !r.track('C') {
		return errSessionDone
	}
	if err := writeMsg(r.uw, &pgproto3.Close{ObjectType: 'S', Name: name}); err != nil {
		return upstreamErr(err)
	}
	r.mu.Lock()
	r.ps.addStmtOp(name, v.reprepare, false, '1', false, 0)
	if v.newSQL != v.reprepare.sql {
		r.state.rewrote = true
	}
	r.mu.Unlock()
	if !r.track('P') {
		return errSessionDone
	}
	why := v.why
	if why == "" {
		why = "under reloaded rules"
	}
	r.logger().Info("prepared statement re-prepared "+why, zap.String("statement", name))
	return upstreamErr(writeMsg(r.uw, &pgproto3.Parse{Name: name, Query: v.newSQL, ParameterOIDs: v.reprepare.parseOIDs()}))
}

// relayDescribe handles a Describe: a statement described must be the one
// the rules in force decide.
func (r *requests) relayDescribe(body []byte) error {
	if len(body) < 1 {
		return r.sess.protocolViolation(fmt.Errorf("malformed Describe"))
	}
	name, _, ok := cstring(body[1:])
	if !ok {
		return r.sess.protocolViolation(fmt.Errorf("malformed Describe"))
	}
	if body[0] == 'S' {
		v, err := r.checkStatement(name, r.ps.generation(), false)
		if err != nil {
			return err
		}
		if v.refuse != nil {
			return r.sendRefusedInstead(v.refuse)
		}
		if v.reprepare != nil {
			if err := r.reprepare(name, v); err != nil {
				return err
			}
		}
		if v.def != nil && v.def.param > 0 {
			r.mu.Lock()
			r.ps.expectDescription()
			r.mu.Unlock()
		}
	}
	return r.forwardTracked('D', body)
}

// relayExecute handles an Execute: a portal bound under older rules runs
// only if the rules in force decide its statement the same way.
func (r *requests) relayExecute(body []byte) error {
	portal, _, ok := cstring(body)
	if !ok {
		return r.sess.protocolViolation(fmt.Errorf("malformed Execute"))
	}
	if r.closedSet && serverKey(portal) == serverKey(r.closed) {
		if err := r.rebindClosed(); err != nil {
			return err
		}
	}
	if r.liveSet {
		if serverKey(portal) == serverKey(r.live) {
			r.liveSet = false // its write runs now, with its Bind's token
		} else if err := r.closeLive(); err != nil {
			return err
		}
	}
	gen := r.ps.generation()
	r.mu.Lock()
	pe := r.ps.portals[serverKey(portal)]
	if pe != nil && pe.seg < r.ps.idleSeg {
		pe = nil // its transaction ended: the server has no such portal
	}
	var (
		def   *stmtDef
		fresh = true
	)
	if pe != nil {
		def, fresh = pe.def, pe.gen == gen
	}
	r.mu.Unlock()
	if !fresh {
		stale := refusePrepared(fmt.Sprintf("portal %q was bound under fencing rules or catalog paths that have since changed, and the rules in force treat its statement differently; it was not executed", portal),
			"Bind the statement again (the proxy prepares it again under the rules in force).")
		if pe.uncertain || def == nil || !def.kept {
			return r.sendRefusedInstead(stale)
		}
		same, _, _, err := r.redecide(def)
		if err != nil {
			return err
		}
		if !same {
			return r.sendRefusedInstead(stale)
		}
		r.mu.Lock()
		pe.gen = gen
		r.mu.Unlock()
	}
	if pe != nil && len(pe.fence) > 0 {
		// Its fence-setting changes count once it ran.
		r.mu.Lock()
		for _, a := range pe.fence {
			r.ps.expect(0, r.fenceDone(a))
			switch {
			case a.op.Kind == rules.TxBegin || a.op.Chain && (a.op.Kind == rules.TxCommit || a.op.Kind == rules.TxRollback):
				r.state.segTx = 'B'
			case a.op.Kind == rules.TxCommit || a.op.Kind == rules.TxRollback || a.op.Kind == rules.TxPrepare:
				r.state.segTx = 'X'
			}
		}
		pe.fence = nil
		r.mu.Unlock()
	}
	if def != nil && len(def.ops) > 0 {
		// The statement prepares, runs or removes SQL-level statements.
		e, err := r.checkExecutes(def.ops, gen)
		if err != nil {
			return err
		}
		if e != nil {
			return r.sendRefusedInstead(e)
		}
		defs := r.sqlOpDefs(def.ops, gen)
		r.mu.Lock()
		overflow := r.ps.wouldOverflow('E', "", def.ops)
		if !overflow {
			r.registerSQLOps(def.ops, defs, false)
		}
		r.mu.Unlock()
		if overflow {
			return r.sendRefusedInstead(refusePrepared(fmt.Sprintf("too many prepared statements in this session (limit %d)", maxTrackedStatements),
				"Deallocate prepared statements you no longer need."))
		}
	}
	return r.forwardTracked('E', body)
}

// relayClose handles a Close of a statement or portal.
func (r *requests) relayClose(body []byte) error {
	if len(body) < 1 {
		return r.sess.protocolViolation(fmt.Errorf("malformed Close"))
	}
	name, _, ok := cstring(body[1:])
	if !ok {
		return r.sess.protocolViolation(fmt.Errorf("malformed Close"))
	}
	if body[0] == 'P' && r.liveSet && serverKey(name) == serverKey(r.live) {
		r.liveSet = false
	}
	if body[0] == 'P' && r.closedSet && serverKey(name) == serverKey(r.closed) {
		r.closedSet = false // the client's Close: its Execute gets the server's answer
	}
	r.mu.Lock()
	switch body[0] {
	case 'S':
		r.ps.clientNamed(name)
		r.ps.addStmtOp(name, nil, false, 0, false, 0)
	case 'P':
		key := serverKey(name)
		var id uint64
		if pe := r.ps.portals[key]; pe != nil {
			id = pe.id
		}
		r.ps.expect(0, func(o outcome) {
			if pe := r.ps.portals[key]; o == outcomeOK && pe != nil && pe.id == id {
				delete(r.ps.portals, key)
			}
		})
	}
	r.mu.Unlock()
	return r.forwardTracked('C', body)
}

// forwardTracked forwards a client message whose body was read.
func (r *requests) forwardTracked(typ byte, body []byte) error {
	if !r.track(typ) {
		return errSessionDone
	}
	return upstreamErr(writeRaw(r.uw, typ, body))
}
