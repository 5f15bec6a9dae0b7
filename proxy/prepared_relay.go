package proxy

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"unsafe"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/rules"
)

// The session side of the prepared-statement bookkeeping: what the relay
// does with Bind, Describe, Execute, Close and statements that prepare or
// execute by name (state and response tracking are in prepared.go).

// preparedResponse is called by the upstream-to-client copier for the
// message types the bookkeeping needs. It reports whether to drop it.
func (s *session) preparedResponse(typ byte, status byte) bool {
	s.mu.Lock()
	if typ == 'E' {
		s.fence.failed = true
	}
	drop, mismatch := s.ps.response(typ, status)
	if mismatch {
		s.ps.loseTrack()
		s.fenceLost()
	}
	if mismatch {
		s.wakeIdleLocked()
	}
	s.mu.Unlock()
	if mismatch {
		s.idleCond.Broadcast()
		go s.terminate(fatal("XX000", "fenceproxy: lost track of the responses to prepared statements it re-prepared; reconnect"), "prepared-statement bookkeeping lost")
	}
	return drop
}

// refusePrepared builds an FP003 error.
func refusePrepared(msg, hint string) *pgproto3.ErrorResponse {
	return &pgproto3.ErrorResponse{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "FP003", Message: "fenceproxy: " + msg, Hint: hint}
}

// sendRefusedInstead sends, in place of a client's Bind, Describe or
// Execute, a Parse that fails with e: the client gets e where it expects
// the message's response, and the server skips to the next Sync.
func (s *session) sendRefusedInstead(e *pgproto3.ErrorResponse) error {
	s.logger().Info("statement refused", zap.String("sqlstate", e.Code), zap.String("reason", e.Message))
	sql := s.refusalSQL(e)
	if !s.track('P') {
		return errSessionDone
	}
	return upstreamErr(writeMsg(s.uw, &pgproto3.Parse{Name: s.ps.refusedName, Query: sql}))
}

// redecide decides a statement's text again under the rules in force and
// reports whether it would send the same as def, with the decision taken.
func (s *session) redecide(def *stmtDef) (same bool, d Decision, err error) {
	lexing := s.lexingFor
	if def.sqlLevel {
		lexing = s.lexingNoWait // as in sqlOpDefs
	}
	lex, err := lexing(def.sql)
	if err != nil {
		return false, d, err
	}
	lex.Prepared = def.preparedForm
	start := s.clock()
	d = s.decide(lex, def.sql)
	s.decided(&d, s.clock().Sub(start))
	return decisionHash(&d, def.sql) == def.sent, d, nil
}

// waitEarlier waits until no change to e sent in an earlier segment is
// unanswered, so that e.assumed() is what the server has. It reports false
// if it cannot tell (timeout, lost bookkeeping).
func (s *session) waitEarlier(e *stmtEntry) (bool, error) {
	s.mu.Lock()
	earlier := len(e.pending) > 0 && e.pending[0].seg < s.ps.sentSeg
	lost := s.ps.lost
	s.mu.Unlock()
	if lost {
		return false, nil
	}
	if !earlier {
		return true, nil
	}
	if err := s.uw.Flush(); err != nil {
		return false, upstreamErr(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.waitLocked(func() bool { return len(e.pending) > 0 && e.pending[0].seg < s.ps.sentSeg && !s.ps.lost })
	if s.state.finishing {
		return false, errSessionDone
	}
	return !s.ps.lost && !(len(e.pending) > 0 && e.pending[0].seg < s.ps.sentSeg), nil
}

const hintPrepareAgain = "Prepare the statement again (DEALLOCATE it, then PREPARE it), or reconnect."

// stmtVerdict is what to do with a message that runs a prepared statement.
type stmtVerdict struct {
	refuse    *pgproto3.ErrorResponse
	reprepare *stmtDef // prepare this definition again before the message
	newSQL    string
	def       *stmtDef // the definition the message runs (nil: none known)
}

// checkStatement decides whether a message running the prepared statement
// name (Bind, Describe; SQL EXECUTE when sqlExec) may go ahead under the
// rules of generation gen.
func (s *session) checkStatement(name string, gen uint64, sqlExec bool) (stmtVerdict, error) {
	key := serverKey(name)
	s.mu.Lock()
	e := s.ps.stmts[key]
	if e == nil {
		s.mu.Unlock()
		// PostgreSQL's own answer for a name it does not have (drivers
		// prepare again on 26000). One the server may have without the
		// proxy knowing (prepared in a function) gets it too: the proxy
		// cannot tell what rules it was decided under.
		return stmtVerdict{refuse: &pgproto3.ErrorResponse{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "26000",
			Message: fmt.Sprintf("prepared statement \"%s\" does not exist", name),
			Hint:    "fenceproxy: prepare statements through the proxy (PREPARE or a Parse message), not in functions."}}, nil
	}
	if g, ok := e.minGen(); !ok || g == gen {
		def := e.assumed()
		s.mu.Unlock()
		return stmtVerdict{def: def}, nil
	}
	s.mu.Unlock()

	ok, err := s.waitEarlier(e)
	if err != nil {
		return stmtVerdict{}, err
	}
	stale := refusePrepared(fmt.Sprintf("prepared statement %q was prepared under fencing rules that have since been reloaded, and fenceproxy cannot check it against the rules in force", name), hintPrepareAgain)
	if !ok {
		return stmtVerdict{refuse: stale}, nil
	}
	s.mu.Lock()
	def := e.assumed()
	s.mu.Unlock()
	if def == nil || def.gen == gen {
		return stmtVerdict{def: def}, nil
	}
	if !def.kept {
		return stmtVerdict{refuse: stale}, nil
	}
	same, d, err := s.redecide(def)
	if err != nil {
		return stmtVerdict{}, err
	}
	if same {
		s.refreshDef(e, def, gen)
		return stmtVerdict{def: def}, nil
	}
	if d.Action == Refuse && !def.sqlLevel {
		return stmtVerdict{refuse: d.Refusal}, nil
	}
	if def.sqlLevel || sqlExec {
		return stmtVerdict{refuse: refusePrepared(fmt.Sprintf("prepared statement %q was prepared under fencing rules that have since been reloaded, and the rules in force treat it differently; it was not executed", name), hintPrepareAgain)}, nil
	}
	out := def.sql
	if d.Action == Rewrite {
		out = d.SQL
	}
	nd := &stmtDef{sql: def.sql, kept: true, sent: decisionHash(&d, def.sql), gen: gen, oids: def.oids, ops: def.ops, preparedForm: def.preparedForm}
	return stmtVerdict{reprepare: nd, newSQL: out, def: nd}, nil
}

// refreshDef records that def, the definition the server has under e, is
// still right under generation gen.
func (s *session) refreshDef(e *stmtEntry, def *stmtDef, gen uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(e.pending) == 0 && e.confirmed == def {
		nd := *def
		nd.gen = gen
		e.confirmed = &nd
	}
}

// relayBind handles a Bind: the statement it binds must be decided under
// the rules in force, and the portal remembers under which.
func (s *session) relayBind(body []byte) error {
	// The names alias the read buffer: what is kept is copied.
	portal, rest, ok := cstringView(body)
	stmt, _, ok2 := cstringView(rest)
	if !ok || !ok2 {
		return s.protocolViolation(fmt.Errorf("malformed Bind"))
	}
	gen := s.ps.pol.Generation()
	v, err := s.checkStatement(stmt, gen, false)
	if err != nil {
		return err
	}
	if v.refuse != nil {
		return s.sendRefusedInstead(v.refuse)
	}
	if v.reprepare != nil {
		if err := s.reprepare(strings.Clone(stmt), v); err != nil {
			return err
		}
	}
	var fence []fenceApplied
	if s.fence.on && v.def != nil {
		var ok bool
		if fence, ok = s.resolveBindOps(v.def.fence, body); !ok {
			return s.sendRefusedInstead(refuseFenceUnknown("a Bind whose parameters for set_config cannot be read"))
		}
		everywhere := v.def.plain && len(v.def.ops) == 0 && (!v.def.kept || mayWrite(v.def.sql)) &&
			s.srv.opts.Policy.(SettingsPolicy).SettingsEverywhere(&s.info)
		if !v.def.plain || len(v.def.ops) > 0 || everywhere {
			// A statement on a protected table: the session's own values
			// first, transaction-locally; the registration follows them.
			named, ok, err := s.fenceReady()
			if err != nil {
				return err
			}
			if !ok {
				return s.sendRefusedInstead(errFenceBroken)
			}
			s.lockNamed = named
			if everywhere || !v.def.forward || len(v.def.ops) > 0 || registers(v.def.lock, named) {
				if err := s.sendPrelude(); err != nil {
					return err
				}
			}
		}
	}
	lock := s.bindLock(v.def, gen)
	if lock.refuse != nil {
		return s.sendRefusedInstead(lock.refuse)
	}
	if lock.call != "" && !(s.fence.on && s.spare()) {
		if err := s.register(lock.call, lock.reg); err != nil {
			return err
		}
	}
	s.mu.Lock()
	pkey := serverKey(portal)
	old := s.ps.portals[pkey]
	s.ps.portalSeq++
	next := portalEntry{def: v.def, gen: gen, seg: s.ps.sentSeg, id: s.ps.portalSeq, fence: fence}
	if portal != "" && old != nil && old.seg >= s.ps.idleSeg {
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
	if old == nil && len(s.ps.portals) >= maxTrackedPortals {
		for k, p := range s.ps.portals {
			if p.seg < s.ps.idleSeg {
				delete(s.ps.portals, k)
			}
		}
		full = len(s.ps.portals) >= maxTrackedPortals
	}
	if !full {
		s.ps.portals[pkey] = pe
	}
	s.mu.Unlock()
	if full {
		return s.sendRefusedInstead(refusePrepared("too many open portals in this session", "Close portals you no longer need, or end the transaction."))
	}
	return s.forwardTracked('B', body)
}

// reprepare sends Close and Parse for a statement whose text the rules in
// force decide differently, before the client's message that runs it.
func (s *session) reprepare(name string, v stmtVerdict) error {
	s.mu.Lock()
	s.ps.addStmtOp(name, nil, false, '3', false, 0)
	s.mu.Unlock()
	if !s.track('C') {
		return errSessionDone
	}
	if err := writeMsg(s.uw, &pgproto3.Close{ObjectType: 'S', Name: name}); err != nil {
		return upstreamErr(err)
	}
	s.mu.Lock()
	s.ps.addStmtOp(name, v.reprepare, false, '1', false, 0)
	if v.newSQL != v.reprepare.sql {
		s.state.rewrote = true
	}
	s.mu.Unlock()
	if !s.track('P') {
		return errSessionDone
	}
	s.logger().Info("prepared statement re-prepared under reloaded rules", zap.String("statement", name))
	return upstreamErr(writeMsg(s.uw, &pgproto3.Parse{Name: name, Query: v.newSQL, ParameterOIDs: v.reprepare.oids}))
}

// relayDescribe handles a Describe: a statement described must be the one
// the rules in force decide.
func (s *session) relayDescribe(body []byte) error {
	if len(body) < 1 {
		return s.protocolViolation(fmt.Errorf("malformed Describe"))
	}
	name, _, ok := cstring(body[1:])
	if !ok {
		return s.protocolViolation(fmt.Errorf("malformed Describe"))
	}
	if body[0] == 'S' {
		v, err := s.checkStatement(name, s.ps.pol.Generation(), false)
		if err != nil {
			return err
		}
		if v.refuse != nil {
			return s.sendRefusedInstead(v.refuse)
		}
		if v.reprepare != nil {
			if err := s.reprepare(name, v); err != nil {
				return err
			}
		}
	}
	return s.forwardTracked('D', body)
}

// relayExecute handles an Execute: a portal bound under older rules runs
// only if the rules in force decide its statement the same way.
func (s *session) relayExecute(body []byte) error {
	portal, _, ok := cstring(body)
	if !ok {
		return s.protocolViolation(fmt.Errorf("malformed Execute"))
	}
	gen := s.ps.pol.Generation()
	s.mu.Lock()
	pe := s.ps.portals[serverKey(portal)]
	if pe != nil && pe.seg < s.ps.idleSeg {
		pe = nil // its transaction ended: the server has no such portal
	}
	var (
		def   *stmtDef
		fresh = true
	)
	if pe != nil {
		def, fresh = pe.def, pe.gen == gen
	}
	s.mu.Unlock()
	if !fresh {
		stale := refusePrepared(fmt.Sprintf("portal %q was bound under fencing rules that have since been reloaded, and the rules in force treat its statement differently; it was not executed", portal),
			"Bind the statement again (the proxy prepares it again under the rules in force).")
		if pe.uncertain || def == nil || !def.kept {
			return s.sendRefusedInstead(stale)
		}
		same, _, err := s.redecide(def)
		if err != nil {
			return err
		}
		if !same {
			return s.sendRefusedInstead(stale)
		}
		s.mu.Lock()
		pe.gen = gen
		s.mu.Unlock()
	}
	if pe != nil && len(pe.fence) > 0 {
		// Its fence-setting changes count once it ran.
		s.mu.Lock()
		for _, a := range pe.fence {
			s.ps.expect(0, s.fenceDone(a))
		}
		pe.fence = nil
		s.mu.Unlock()
	}
	if def != nil && len(def.ops) > 0 {
		// The statement prepares, runs or removes SQL-level statements.
		e, err := s.checkExecutes(def.ops, gen)
		if err != nil {
			return err
		}
		if e != nil {
			return s.sendRefusedInstead(e)
		}
		defs := s.sqlOpDefs(def.ops, gen)
		s.mu.Lock()
		overflow := s.ps.wouldOverflow('E', "", def.ops)
		if !overflow {
			s.registerSQLOps(def.ops, defs, false)
		}
		s.mu.Unlock()
		if overflow {
			return s.sendRefusedInstead(refusePrepared(fmt.Sprintf("too many prepared statements in this session (limit %d)", maxTrackedStatements),
				"Deallocate prepared statements you no longer need."))
		}
	}
	return s.forwardTracked('E', body)
}

// relayClose handles a Close of a statement or portal.
func (s *session) relayClose(body []byte) error {
	if len(body) < 1 {
		return s.protocolViolation(fmt.Errorf("malformed Close"))
	}
	name, _, ok := cstring(body[1:])
	if !ok {
		return s.protocolViolation(fmt.Errorf("malformed Close"))
	}
	s.mu.Lock()
	switch body[0] {
	case 'S':
		s.ps.clientNamed(name)
		s.ps.addStmtOp(name, nil, false, 0, false, 0)
	case 'P':
		key := serverKey(name)
		var id uint64
		if pe := s.ps.portals[key]; pe != nil {
			id = pe.id
		}
		s.ps.expect(0, func(o outcome) {
			if pe := s.ps.portals[key]; o == outcomeOK && pe != nil && pe.id == id {
				delete(s.ps.portals, key)
			}
		})
	}
	s.mu.Unlock()
	return s.forwardTracked('C', body)
}

// forwardTracked forwards a client message whose body was read.
func (s *session) forwardTracked(typ byte, body []byte) error {
	if !s.track(typ) {
		return errSessionDone
	}
	return upstreamErr(writeRaw(s.uw, typ, body))
}

// checkExecutes checks the EXECUTEs among ops, skipping names defined
// earlier in the same text (definedHere, updated as ops go). It returns a
// refusal if one runs a statement decided under older rules that the rules
// in force decide differently.
func (s *session) checkExecutes(ops []PreparedOp, gen uint64) (*pgproto3.ErrorResponse, error) {
	e, _, err := s.checkExecutesLock(ops, gen)
	return e, err
}

// checkExecutesLock is checkExecutes that also returns the lock
// registration the executed statements need in this session, if any; a
// text that executes several such statements is refused.
func (s *session) checkExecutesLock(ops []PreparedOp, gen uint64) (*pgproto3.ErrorResponse, *LockRegistration, error) {
	var lock *LockRegistration
	definedHere := make(map[string]bool)
	for _, op := range ops {
		key := serverKey(op.Name)
		switch op.Kind {
		case OpPrepare:
			definedHere[key] = true
		case OpDeallocate:
			definedHere[key] = true // EXECUTE after it fails upstream
		case OpDeallocateAll:
			return nil, lock, nil // every later EXECUTE fails upstream
		case OpExecute:
			if definedHere[key] {
				// Prepared in this very text: its registration is unknown.
				if s.lockNamed {
					return refusePrepared(fmt.Sprintf("cannot tell whether prepared statement %q needs a lock registration: it is prepared and executed in one text", op.Name),
						"Send PREPARE and EXECUTE as separate messages."), nil, nil
				}
				continue
			}
			v, err := s.checkStatement(op.Name, gen, true)
			if err != nil {
				return nil, nil, err
			}
			if v.refuse != nil {
				return v.refuse, nil, nil
			}
			if v.def != nil && v.def.lock != nil && v.def.lock.Call != "" && (s.lockNamed || v.def.lock.Required) {
				if lock != nil {
					return refusePrepared("a text that executes several prepared statements on lock-fenced tables cannot be registered",
						"Execute them in separate statements."), nil, nil
				}
				lock = v.def.lock
			}
		}
	}
	return nil, lock, nil
}

// sqlOpDefs builds the definitions of the PREPAREs among ops, decided
// under generation gen (read before the text was decided). If the rules
// changed meanwhile, the definitions are marked so that they are decided
// again before they run.
func (s *session) sqlOpDefs(ops []PreparedOp, gen uint64) []*stmtDef {
	defs := make([]*stmtDef, len(ops))
	for i, op := range ops {
		if op.Kind != OpPrepare {
			continue
		}
		lex, err := s.lexingNoWait(op.Text)
		sent := hashText("\x00unknown")
		var lock *LockRegistration
		if err == nil {
			d := s.decide(lex, op.Text)
			sent = decisionHash(&d, op.Text)
			lock = d.Lock
		}
		s.mu.Lock()
		defs[i] = s.ps.newDef(op.Text, sent, gen, nil, true)
		defs[i].lock = lock
		s.mu.Unlock()
	}
	if s.ps.pol.Generation() != gen {
		for _, d := range defs {
			if d != nil {
				d.sent = hashText("\x00unknown")
			}
		}
	}
	return defs
}

// lexingNoWait is the lexing for a text decided again later under the
// same settings: the last reported ones.
func (s *session) lexingNoWait(text string) (Lexing, error) {
	s.mu.Lock()
	lex := s.lex
	s.mu.Unlock()
	for i := 0; i < len(text); i++ {
		switch c := text[i]; {
		case c == '\\':
			lex.Backslash = true
		case c >= 0x80:
			lex.NonASCII = true
		}
	}
	return lex, nil
}

// registerSQLOps records the PREPAREs and DEALLOCATEs among ops, about to
// be sent: as statements of a Query (query), or as the effects of the
// Execute about to be sent. defs are from sqlOpDefs. Callers hold s.mu.
func (s *session) registerSQLOps(ops []PreparedOp, defs []*stmtDef, query bool) {
	s.registerSQLOpsWithCalls(ops, defs, query, nil, nil, regCallbacks{})
}

// regCallbacks: the inserted statements from index skip of the calls are
// lock registrations whose responses done records.
type regCallbacks struct {
	skip int
	done func(outcome)
}

// registerSQLOpsWithCalls is registerSQLOps for a Query into which the
// proxy inserted statements, at calls (indexes in the text sent): the
// client's statements move behind them, and their CommandCompletes are
// swallowed. Callers hold s.mu.
func (s *session) registerSQLOpsWithCalls(ops []PreparedOp, defs []*stmtDef, query bool, calls []int, fence []rules.SettingOp, reg regCallbacks) {
	swallow := func(k int) {
		if k >= reg.skip && reg.done != nil {
			s.ps.push(pendingResp{seg: s.ps.sentSeg, idx: calls[k], query: true, swallow: 'C', done: reg.done})
			return
		}
		s.ps.swallowQuery(calls[k])
	}
	// sent maps a client statement index to its index in the text sent.
	sent := func(k int) int {
		for _, c := range calls {
			if c <= k {
				k++
			}
		}
		return k
	}
	next := 0      // calls registered so far (the fifo is kept in order)
	nextFence := 0 // fence operations registered so far
	fenceUpTo := func(idx int) {
		for ; nextFence < len(fence) && sent(fence[nextFence].Stmt) <= idx; nextFence++ {
			f := fence[nextFence]
			for next < len(calls) && calls[next] < sent(f.Stmt) {
				swallow(next)
				next++
			}
			s.ps.push(pendingResp{seg: s.ps.sentSeg, idx: sent(f.Stmt), query: true, done: s.fenceDone(knownOp(f))})
		}
	}
	for i, op := range ops {
		idx := op.Stmt
		if query {
			idx = sent(op.Stmt)
			fenceUpTo(idx)
			for next < len(calls) && calls[next] < idx {
				swallow(next)
				next++
			}
		}
		switch op.Kind {
		case OpPrepare:
			s.ps.addStmtOp(op.Name, defs[i], false, 0, query, idx)
		case OpDeallocate:
			s.ps.addStmtOp(op.Name, nil, false, 0, query, idx)
		case OpDeallocateAll:
			for key := range s.ps.stmts {
				s.ps.addStmtOp(key, nil, false, 0, query, idx)
			}
			s.ps.forgetOwn() // the proxy's own statements go too
		}
		if op.Kind != OpExecute {
			s.ps.clientNamed(op.Name)
		}
	}
	if query {
		fenceUpTo(1 << 30)
	}
	for ; next < len(calls); next++ {
		swallow(next)
	}
}

// preparedForm reports whether a Parse is decided with Lexing.Prepared: it
// names its statement (which the server keeps to execute many times) and
// its text performs no SQL-level prepared-statement operation (words.any
// false: a PREPARE's body is recorded as the SQL-level statement's,
// decided as a Query's text is, so it gets the same form on the server).
func preparedForm(typ byte, name string, words prepWords) bool {
	return typ == 'P' && name != "" && !words.any
}

// prepWords is what mentionsPrepared found in a text, scanned once per
// Query or Parse for both preparedForm and trackPrepared.
type prepWords struct{ any, execute bool }

// mentionsPrepared reports, cheaply and conservatively, whether sql may
// prepare, execute or deallocate a statement, and whether it may execute
// one.
func mentionsPrepared(sql string) (any, execute bool) {
	for i := 0; i+7 <= len(sql); i++ {
		switch sql[i] | 0x20 {
		case 'p':
			if asciiFoldHasPrefix(sql[i:], "prepare") {
				any = true
			}
		case 'e':
			if asciiFoldHasPrefix(sql[i:], "execute") {
				return true, true
			}
		case 'd':
			if asciiFoldHasPrefix(sql[i:], "deallocate") || asciiFoldHasPrefix(sql[i:], "discard") {
				any = true
			}
		}
	}
	return any, false
}

func asciiFoldHasPrefix(s, prefix string) bool {
	if len(s) < len(prefix) {
		return false
	}
	for i := 0; i < len(prefix); i++ {
		if s[i]|0x20 != prefix[i] {
			return false
		}
	}
	return true
}

// cloneOps copies ops and their strings, to be kept past the message they
// were found in.
func cloneOps(ops []PreparedOp) []PreparedOp {
	if len(ops) == 0 {
		return nil
	}
	out := make([]PreparedOp, len(ops))
	for i, op := range ops {
		op.Name, op.Text = strings.Clone(op.Name), strings.Clone(op.Text)
		out[i] = op
	}
	return out
}

// decodeParse decodes a Parse message's body as pgproto3.Parse.Decode
// does, without copying the statement text: Query aliases body and lives
// as long as the message. Name is copied; the parameter types are
// appended to oids.
func decodeParse(body []byte, oids []uint32) (pgproto3.Parse, error) {
	var p pgproto3.Parse
	name, rest, ok := cstringView(body)
	if !ok {
		return p, errors.New("invalid Parse message: unterminated statement name")
	}
	query, rest, ok := cstringView(rest)
	if !ok {
		return p, errors.New("invalid Parse message: unterminated query")
	}
	if len(rest) < 2 {
		return p, errors.New("invalid Parse message: no parameter count")
	}
	n := int(binary.BigEndian.Uint16(rest))
	rest = rest[2:]
	if len(rest) < 4*n {
		return p, errors.New("invalid Parse message: short parameter types")
	}
	for i := range n {
		oids = append(oids, binary.BigEndian.Uint32(rest[4*i:]))
	}
	p.Name, p.Query, p.ParameterOIDs = strings.Clone(name), query, oids
	return p, nil
}

// cstringView splits a NUL-terminated string off b without a copy: the
// string aliases b.
func cstringView(b []byte) (string, []byte, bool) {
	i := bytes.IndexByte(b, 0)
	if i < 0 {
		return "", nil, false
	}
	if i == 0 {
		return "", b[1:], true
	}
	return unsafe.String(&b[0], i), b[i+1:], true
}

// cstring splits a NUL-terminated string off b.
func cstring(b []byte) (string, []byte, bool) {
	i := bytes.IndexByte(b, 0)
	if i < 0 {
		return "", nil, false
	}
	return string(b[:i]), b[i+1:], true
}

// losePreparedTrack is called, with s.mu held, when the relay's
// bookkeeping of responses goes wrong. If an injected message is still
// unanswered, its response would reach the client: the session ends.
func (s *session) losePreparedTrack() {
	if s.ps == nil || s.ps.lost {
		return
	}
	s.fenceLost()
	if s.ps.loseTrack() {
		go s.terminate(fatal("XX000", "fenceproxy: lost track of the responses to prepared statements it re-prepared; reconnect"), "prepared-statement bookkeeping lost")
	}
	s.idleCond.Broadcast()
	s.wakeIdleLocked()
}

// trackPrepared does the prepared-statement bookkeeping of a Query or
// Parse about to be sent with decision d (which it may turn into a
// refusal): EXECUTEs of statements prepared under older rules are checked,
// and what the text defines or removes is recorded; preparedForm is
// whether d was decided with Lexing.Prepared, words what mentionsPrepared
// found in sql.
func (s *session) trackPrepared(typ byte, p *pgproto3.Parse, sql string, gen uint64, d *Decision, preparedForm bool, words prepWords, ft *fenceText) error {
	var ops []PreparedOp
	if d.Action != Refuse {
		if words.any {
			var err error
			ops, err = s.preparedOps(sql)
			switch {
			case errors.Is(err, errPolicyPanicked):
				*d = internalRefusal()
			case err != nil && words.execute:
				*d = Decision{Action: Refuse, Refusal: refusePrepared("cannot tell which prepared statement this text executes: it does not parse", "")}
			case err != nil:
				ops = nil
			case d.Action == Rewrite && len(ops) > 0 && !s.sameOps(ops, d.SQL):
				*d = Decision{Action: Refuse, Refusal: refusePrepared("cannot track the prepared statements of this text once rewritten", "Send PREPARE, EXECUTE and DEALLOCATE as statements of their own.")}
			}
		}
	}
	var calls []int
	spare := s.fence.on && s.spare()
	var regLock *LockRegistration // the registration sent, if any
	if typ == 'Q' && d.Action != Refuse && d.Lock != nil && len(d.Lock.Calls) > 0 && (s.lockNamed || d.Lock.Required) && !spare {
		regLock = d.Lock
		// Send the text with the lock registrations in place.
		calls = d.Lock.Calls
		*d = Decision{Action: Rewrite, SQL: d.Lock.Query, Tables: d.Tables, Lock: d.Lock}
	}
	if typ == 'Q' && d.Action != Refuse && len(ops) > 0 {
		e, lock, err := s.checkExecutesLock(ops, gen)
		if err != nil {
			return err
		}
		switch {
		case e != nil:
			*d = Decision{Action: Refuse, Refusal: e}
		case lock != nil && (calls != nil || ops[0].Stmts != 1):
			*d = Decision{Action: Refuse, Refusal: refusePrepared("EXECUTE of a prepared statement on a lock-fenced table must be a statement of its own",
				"Send the EXECUTE alone in its Query, so that the lock registration can precede it.")}
		case lock != nil && spare:
		case lock != nil:
			regLock = lock
			out := sql
			if d.Action == Rewrite {
				out = d.SQL
			}
			// One statement: the registration goes before it, as the
			// rewriter does for a single statement.
			calls = []int{0}
			*d = Decision{Action: Rewrite, SQL: lock.Call + ";" + out, Tables: d.Tables}
		}
	}
	if typ == 'Q' && d.Action != Refuse && s.fence.on && ft.prelude {
		// The session's own values, transaction-locally, before the
		// text: two statements, whose CommandCompletes are swallowed.
		s.mu.Lock()
		pre := s.fence.simplePrelude()
		s.mu.Unlock()
		base := sql
		if d.Action == Rewrite {
			base = d.SQL
		}
		*d = Decision{Action: Rewrite, SQL: pre + base, Tables: d.Tables, Lock: d.Lock}
		shifted := []int{0, 1}
		for _, c := range calls {
			shifted = append(shifted, c+2)
		}
		calls = shifted
	}
	if d.Action == Refuse {
		ops = nil
		ft.ops = nil
	}
	var defs []*stmtDef
	if typ == 'Q' && len(ops) > 0 {
		defs = s.sqlOpDefs(ops, gen)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if d.Action != Refuse && s.ps.wouldOverflow(typ, p.Name, ops) {
		*d = Decision{Action: Refuse, Refusal: refusePrepared(fmt.Sprintf("too many prepared statements in this session (limit %d)", maxTrackedStatements),
			"Deallocate prepared statements you no longer need.")}
		ops, defs = nil, nil
	}
	switch {
	case typ == 'Q':
		if d.Action == Refuse {
			calls = nil
		}
		var regDone func(outcome)
		if regLock != nil {
			regDone = s.registeredDone(regLock)
		}
		pre := 0
		if ft.prelude && d.Action != Refuse {
			pre = 2
		}
		s.registerSQLOpsWithCalls(ops, defs, true, calls, ft.ops, regCallbacks{skip: pre, done: regDone})
	case d.Action == Refuse:
		if p.Name == "" {
			// The refused Parse still drops the unnamed statement.
			s.ps.addStmtOp("", nil, true, 0, false, 0)
		}
		// A refused named Parse fails before it would replace anything.
	default:
		s.ps.clientNamed(p.Name)
		def := s.ps.repeatDef(p.Name, sql, d, gen, p.ParameterOIDs, ops)
		if def == nil {
			def = s.ps.newDef(sql, decisionHash(d, sql), gen, p.ParameterOIDs, false)
			def.ops = cloneOps(ops) // their texts may alias the Parse's, read in place
			def.lock = d.Lock
			def.plain = plainDecision(d)
			def.forward = d.Action == Forward
			def.preparedForm = preparedForm
			def.fence = ft.ops
		}
		s.ps.addStmtOp(p.Name, def, p.Name == "", 0, false, 0)
	}
	return nil
}

// preparedOps asks the policy for the prepared-statement operations of
// sql. It parses: on an event loop, that runs off the loop's thread (as
// slow decisions do, see decide).
func (s *session) preparedOps(sql string) (ops []PreparedOp, err error) {
	s.offLoop(func() { ops, err = s.policyPreparedOps(sql) })
	return ops, err
}

// errPolicyPanicked reports a panic of the policy (logged), after which the
// statement is refused.
var errPolicyPanicked = errors.New("policy panicked")

// policyPreparedOps asks the policy, returning errPolicyPanicked if it
// panics.
func (s *session) policyPreparedOps(sql string) (ops []PreparedOp, err error) {
	defer func() {
		if r := recover(); r != nil {
			s.logPolicyPanic("policy panicked listing prepared statements; statement refused", r)
			ops, err = nil, errPolicyPanicked
		}
	}()
	return s.ps.pol.PreparedOps(sql)
}

// maxReusedOIDs bounds the parameter-type buffer a session keeps
// (session.oidBuf): a Parse may declare 65535 types.
const maxReusedOIDs = 256

// sameOps reports whether the rewritten text out has the same
// prepared-statement operations at the same statement indexes as ops.
func (s *session) sameOps(ops []PreparedOp, out string) bool {
	got, err := s.preparedOps(out)
	if err != nil || len(got) != len(ops) {
		return false
	}
	for i := range ops {
		if got[i].Kind != ops[i].Kind || got[i].Name != ops[i].Name || got[i].Stmt != ops[i].Stmt {
			return false
		}
	}
	return true
}

// wouldOverflow reports whether a Parse of name (typ 'P') or the PREPAREs
// among ops would track more names than the limit. Callers hold s.mu.
func (ps *preparedState) wouldOverflow(typ byte, name string, ops []PreparedOp) bool {
	n := len(ps.stmts)
	if typ == 'P' && name != "" {
		if _, ok := ps.stmts[serverKey(name)]; !ok {
			n++
		}
	}
	for _, op := range ops {
		if op.Kind == OpPrepare {
			if _, ok := ps.stmts[serverKey(op.Name)]; !ok {
				n++
			}
		}
	}
	return n > maxTrackedStatements
}

// bindVerdict is the lock registration a Bind needs.
type bindVerdict struct {
	call   string
	reg    *LockRegistration // the registration call is from
	refuse *pgproto3.ErrorResponse
}

// bindLock returns the lock registration to run before a Bind of def:
// its own, or that of the SQL-level statement it EXECUTEs.
func (s *session) bindLock(def *stmtDef, gen uint64) bindVerdict {
	if def == nil {
		return bindVerdict{}
	}
	if l := def.lock; l != nil && len(l.Calls) > 0 && (s.lockNamed || l.Required) {
		return bindVerdict{call: l.Call, reg: l}
	}
	if len(def.ops) == 0 {
		return bindVerdict{}
	}
	e, l, err := s.checkExecutesLock(def.ops, gen)
	switch {
	case err != nil:
		return bindVerdict{refuse: refusePrepared("cannot check the prepared statement this statement executes", "")}
	case e != nil:
		return bindVerdict{refuse: e}
	case l != nil:
		return bindVerdict{call: l.Call, reg: l}
	}
	return bindVerdict{}
}

// register sends, before the client's Bind, the lock registration call
// as the proxy's own prepared statement and portal, whose responses are
// not relayed: Bind and Execute when the server is believed to have the
// statement for this call already, else Close and Parse first. It runs in
// the same transaction as the client's statement: nothing in between ends
// it. If it fails, its error is the first the client sees, and the server
// skips the client's messages up to the Sync.
func (s *session) register(call string, l *LockRegistration) error {
	ps := s.ps
	s.mu.Lock()
	if s.state.finishing {
		s.mu.Unlock()
		return errSessionDone
	}
	// Parsed again every time, in the same pipeline as its Bind: nothing
	// the session runs in between (a DEALLOCATE and PREPARE of the name in
	// a function, which the proxy cannot see) can stand in for it.
	name, prepared := ps.registerName, false
	type out struct {
		typ byte
		msg encoder
	}
	var msgs []out
	// What an earlier registration left (a failed one is not closed: the
	// server skipped the rest); closing what does not exist is not an
	// error.
	ps.expect('3', nil)
	ps.countSent('C')
	msgs = append(msgs, out{'C', &pgproto3.Close{ObjectType: 'P', Name: name}})
	if !prepared {
		ps.regPrepared = ""
		// Recorded as a removal: a client's own definition under the name
		// (it can read it from pg_prepared_statements) is gone, and a
		// client Bind or EXECUTE of the name is refused from now on.
		ps.addStmtOp(name, nil, false, '3', false, 0)
		ps.countSent('C')
		msgs = append(msgs, out{'C', &pgproto3.Close{ObjectType: 'S', Name: name}})
		ps.expect('1', func(o outcome) {
			if o == outcomeOK {
				ps.regPrepared = call
			}
		})
		ps.countSent('P')
		msgs = append(msgs, out{'P', &pgproto3.Parse{Name: name, Query: call}})
	}
	ps.expect('2', func(o outcome) {
		if o != outcomeOK && ps.regPrepared == call {
			// Skipped or failed (the statement may be gone: DEALLOCATE
			// ALL in a function, say): prepare it again next time.
			ps.regPrepared = ""
		}
	})
	ps.countSent('B')
	msgs = append(msgs, out{'B', &pgproto3.Bind{DestinationPortal: name, PreparedStatement: name}})
	ps.expect('C', s.registeredDone(l))
	ps.countSent('E')
	msgs = append(msgs, out{'E', &pgproto3.Execute{Portal: name}})
	if !prepared {
		// Until its ParseComplete says so, do not count on it.
		ps.regPrepared = ""
	}
	s.state.rewrote = true
	s.mu.Unlock()
	for _, m := range msgs {
		if err := writeMsg(s.uw, m.msg); err != nil {
			return upstreamErr(err)
		}
	}
	return nil
}
