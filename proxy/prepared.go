package proxy

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
)

// Prepared statements and rules reloads.
//
// A statement is decided when its text arrives (Query, Parse). A prepared
// statement (a named or unnamed Parse, or SQL PREPARE) and a portal (Bind)
// keep the text that was sent for them upstream, so after a reload they
// would run under the rules in force when they were prepared. To prevent
// that, the session remembers for each prepared statement and portal the
// rules generation it was decided under and what was sent, and when the
// generation has changed since, decides the client's text again before the
// statement next runs:
//
//   - the same text to send: nothing to do (statements on other tables);
//   - another text: a protocol-level statement is prepared again upstream,
//     transparently (Close and Parse injected before the client's Bind or
//     Describe; their responses are not relayed), so drivers' statement
//     caches keep working;
//   - refused, or a SQL-level statement (EXECUTE) or a portal whose text
//     would change: the client's message fails in-band with FP003.
//
// What the server has under each name is known from the responses: every
// message that can define or remove a statement is matched with its
// response by position (segment = requests between two ReadyForQuery,
// index = completion message within the segment). While an earlier
// segment's changes are unanswered the session waits for them before it
// re-decides; where the bookkeeping cannot tell, it refuses.

// Limits on what a session remembers (names and texts are client data).
const (
	maxTrackedStatements = 10000
	maxTrackedPortals    = 1000
	maxTrackedTextBytes  = 64 << 20
	// nameDataLen is PostgreSQL's NAMEDATALEN: the server keys prepared
	// statements and portals by the first NAMEDATALEN-1 bytes of their
	// names.
	nameDataLen = 64
)

// stmtDef is one definition of a prepared statement, as sent upstream.
// Never modified once shared.
type stmtDef struct {
	sql      string   // the client's text: the Parse's, or the PREPARE statement's
	kept     bool     // sql was kept (memory budget); without it no re-decision
	sent     [32]byte // hash of what was sent (protocol) or decided (SQL-level)
	gen      uint64   // rules generation it was decided under
	oids     []uint32 // the Parse's parameter types
	sqlLevel bool     // defined by SQL PREPARE
	// ops: the SQL-level prepared-statement operations the text performs
	// when it runs (a Parse of "PREPARE x AS ..." or "EXECUTE x").
	ops []PreparedOp
}

// stmtEntry is what the server may have under one name.
type stmtEntry struct {
	confirmed *stmtDef  // per the responses received (nil: nothing)
	pending   []*stmtOp // sent and not answered, in order
}

// stmtOp is a change to a name sent upstream and not yet answered.
type stmtOp struct {
	key string
	def *stmtDef // new definition; nil removes
	seg uint64
	// emptyOnFailure: a failed (not skipped) execution leaves no statement
	// (a Parse of the unnamed statement drops the old one first). A named
	// Parse or PREPARE of a defined name fails and leaves the old one.
	emptyOnFailure bool
}

// portalEntry is a portal bound through the proxy.
type portalEntry struct {
	def       *stmtDef // nil: unknown statement
	gen       uint64
	seg       uint64 // segment of the Bind: gone once a later ReadyForQuery says idle
	uncertain bool   // another portal of that name may still be open
}

// outcome of a message, from the responses.
type outcome uint8

const (
	outcomeOK      outcome = iota
	outcomeFailed          // executed and failed
	outcomeSkipped         // not executed (an earlier error in the segment)
)

// pendingResp is a message whose response the session waits for.
type pendingResp struct {
	seg   uint64
	idx   int
	query bool // idx counts CommandCompletes of a simple Query
	// swallow: an injected message whose response (this type) the client
	// must not see.
	swallow byte
	done    func(outcome)
}

// preparedState is guarded by session.mu.
type preparedState struct {
	pol PreparedPolicy

	stmts     map[string]*stmtEntry
	portals   map[string]*portalEntry
	textBytes int

	sentSeg uint64 // boundaries (Query, Sync, FunctionCall) sent
	sentIdx int    // completion messages sent in the open segment
	recvSeg uint64 // ReadyForQuery received
	recvExt int    // extended-protocol completions received in the segment
	recvCC  int    // CommandCompletes received in the segment
	failed  bool   // an error was received in the segment
	idleSeg uint64 // portals bound in earlier segments are gone
	fifo    []*pendingResp
	// lost: the response bookkeeping lost track (COPY pipelined with
	// Syncs, an unexpected ReadyForQuery): from then on every re-decision
	// refuses.
	lost bool
	// refusedName names the Parse that stands in for a refused Bind,
	// Describe or Execute; it fails during parse analysis, so it is never
	// created.
	refusedName string
}

func newPreparedState(pol PreparedPolicy, nonce string) *preparedState {
	return &preparedState{
		pol:         pol,
		stmts:       make(map[string]*stmtEntry),
		portals:     make(map[string]*portalEntry),
		refusedName: "fenceproxy_refused_" + nonce,
	}
}

// serverKey is the name as the server stores it.
func serverKey(name string) string {
	if len(name) >= nameDataLen {
		return name[:nameDataLen-1]
	}
	return name
}

func hashText(s string) [32]byte { return sha256.Sum256([]byte(s)) }

// decisionHash identifies what a decision sends for sql.
func decisionHash(d *Decision, sql string) [32]byte {
	switch d.Action {
	case Rewrite:
		return hashText(d.SQL)
	case Refuse:
		return hashText("\x00refused")
	}
	return hashText(sql)
}

// ---- send side (client-to-upstream goroutine; callers hold s.mu) ----

// countSent updates the positions for a message about to be forwarded.
func (ps *preparedState) countSent(typ byte) {
	switch typ {
	case 'Q', 'F', 'S':
		ps.sentSeg++
		ps.sentIdx = 0
	case 'P', 'B', 'C', 'D', 'E':
		ps.sentIdx++
	}
}

// expect registers a pending response at the open segment's next position.
func (ps *preparedState) expect(swallow byte, done func(outcome)) {
	ps.fifo = append(ps.fifo, &pendingResp{seg: ps.sentSeg, idx: ps.sentIdx, swallow: swallow, done: done})
}

// expectQuery registers a pending CommandComplete of statement idx of the
// Query about to be sent.
func (ps *preparedState) expectQuery(idx int, done func(outcome)) {
	ps.fifo = append(ps.fifo, &pendingResp{seg: ps.sentSeg, idx: idx, query: true, done: done})
}

// minGen is the oldest generation among the definitions the server may
// have under e: the one confirmed and those pending.
func (e *stmtEntry) minGen() (uint64, bool) {
	var g uint64
	any := false
	for _, d := range e.defs() {
		if !any || d.gen < g {
			g, any = d.gen, true
		}
	}
	return g, any
}

func (e *stmtEntry) defs() []*stmtDef {
	var out []*stmtDef
	if e.confirmed != nil {
		out = append(out, e.confirmed)
	}
	for _, op := range e.pending {
		if op.def != nil {
			out = append(out, op.def)
		}
	}
	return out
}

// assumed is the definition a message sent now meets if it runs: the
// pending changes of its own segment succeeded, or it would be skipped.
// Only meaningful once no earlier segment's change is pending.
func (e *stmtEntry) assumed() *stmtDef {
	if n := len(e.pending); n > 0 {
		return e.pending[n-1].def
	}
	return e.confirmed
}

// addStmtOp records a change to name sent at the next position (or as
// statement idx of a Query). swallow is for an injected message.
func (ps *preparedState) addStmtOp(name string, def *stmtDef, emptyOnFailure bool, swallow byte, query bool, idx int) {
	key := serverKey(name)
	e := ps.stmts[key]
	if e == nil {
		if def == nil && !emptyOnFailure {
			// Removing what the proxy never saw.
			if swallow != 0 {
				ps.expect(swallow, nil)
			}
			return
		}
		e = &stmtEntry{}
		ps.stmts[key] = e
	}
	op := &stmtOp{key: key, def: def, seg: ps.sentSeg, emptyOnFailure: emptyOnFailure}
	e.pending = append(e.pending, op)
	done := func(o outcome) { ps.resolveStmtOp(op, o) }
	if query {
		ps.expectQuery(idx, done)
	} else {
		ps.expect(swallow, done)
	}
}

// keepText reports whether n more bytes of statement text fit the budget.
func (ps *preparedState) keepText(n int) bool {
	if ps.textBytes+n <= maxTrackedTextBytes {
		ps.textBytes += n
		return true
	}
	// Recount what is still referenced, then try again.
	seen := make(map[*stmtDef]bool)
	total := 0
	count := func(d *stmtDef) {
		if d != nil && d.kept && !seen[d] {
			seen[d] = true
			total += len(d.sql)
		}
	}
	for _, e := range ps.stmts {
		for _, d := range e.defs() {
			count(d)
		}
	}
	for _, p := range ps.portals {
		count(p.def)
	}
	ps.textBytes = total
	if ps.textBytes+n <= maxTrackedTextBytes {
		ps.textBytes += n
		return true
	}
	return false
}

// newDef builds a definition, keeping sql if the budget allows.
func (ps *preparedState) newDef(sql string, sent [32]byte, gen uint64, oids []uint32, sqlLevel bool) *stmtDef {
	d := &stmtDef{sent: sent, gen: gen, sqlLevel: sqlLevel}
	if len(oids) > 0 {
		d.oids = append([]uint32(nil), oids...)
	}
	if ps.keepText(len(sql)) {
		d.sql, d.kept = sql, true
	}
	return d
}

// ---- response side (upstream-to-client goroutine; callers hold s.mu) ----

func (ps *preparedState) resolveStmtOp(op *stmtOp, o outcome) {
	e := ps.stmts[op.key]
	if e == nil || len(e.pending) == 0 || e.pending[0] != op {
		ps.lost = true
		return
	}
	e.pending = e.pending[1:]
	switch {
	case o == outcomeOK:
		e.confirmed = op.def
	case o == outcomeFailed && op.emptyOnFailure:
		e.confirmed = nil
	}
	if e.confirmed == nil && len(e.pending) == 0 {
		delete(ps.stmts, op.key)
	}
}

// isCompletion reports whether a server message type ends the response to
// one extended-protocol message.
func isCompletion(typ byte) bool {
	switch typ {
	case '1', '2', '3', 'T', 'n', 'C', 'I', 's':
		return true
	}
	return false
}

// response records one server message and reports whether the client must
// not see it (the response to an injected message). mismatch reports that
// an injected message's response was not what was expected.
func (ps *preparedState) response(typ byte, status byte) (drop, mismatch bool) {
	switch {
	case typ == 'Z':
		ps.recvSeg++
		ps.recvExt, ps.recvCC, ps.failed = 0, 0, false
		for len(ps.fifo) > 0 && ps.fifo[0].seg < ps.recvSeg {
			if ps.fifo[0].swallow != 0 {
				mismatch = true
			}
			ps.pop(outcomeSkipped)
		}
		if status == 'I' {
			ps.idleSeg = ps.recvSeg
		}
	case typ == 'E':
		if ps.failed {
			return false, false
		}
		ps.failed = true
		for len(ps.fifo) > 0 && ps.fifo[0].seg == ps.recvSeg {
			h := ps.fifo[0]
			o := outcomeSkipped
			if (!h.query && h.idx == ps.recvExt) || (h.query && h.idx == ps.recvCC) {
				o = outcomeFailed
			}
			ps.pop(o)
		}
		ps.recvExt++
	case isCompletion(typ):
		if ps.failed {
			return false, false
		}
		for len(ps.fifo) > 0 && ps.fifo[0].seg == ps.recvSeg && !ps.fifo[0].query && ps.fifo[0].idx == ps.recvExt {
			h := ps.fifo[0]
			if h.swallow != 0 {
				if h.swallow != typ {
					mismatch = true
				}
				drop = true
			}
			ps.pop(outcomeOK)
		}
		ps.recvExt++
		if typ == 'C' {
			for len(ps.fifo) > 0 && ps.fifo[0].seg == ps.recvSeg && ps.fifo[0].query && ps.fifo[0].idx == ps.recvCC {
				ps.pop(outcomeOK)
			}
			ps.recvCC++
		}
	}
	return drop, mismatch
}

func (ps *preparedState) pop(o outcome) {
	h := ps.fifo[0]
	ps.fifo[0] = nil
	ps.fifo = ps.fifo[1:]
	if !ps.lost && h.done != nil {
		h.done(o)
	}
}

// loseTrack gives up matching responses. Pending changes stay pending, so
// every name they touch keeps its oldest generation and fails closed. It
// reports whether an injected message is still unanswered: its response
// would then reach the client.
func (ps *preparedState) loseTrack() (injected bool) {
	ps.lost = true
	for _, h := range ps.fifo {
		if h.swallow != 0 {
			injected = true
		}
	}
	ps.fifo = nil
	return injected
}

// ---- session glue ----

// preparedResponse is called by the upstream-to-client copier for the
// message types the bookkeeping needs. It reports whether to drop it.
func (s *session) preparedResponse(typ byte, status byte) bool {
	s.mu.Lock()
	drop, mismatch := s.ps.response(typ, status)
	if mismatch {
		s.ps.loseTrack()
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
	s.log.Info("statement refused", zap.String("sqlstate", e.Code), zap.String("reason", e.Message))
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
	start := time.Now()
	d = s.decide(lex, def.sql)
	s.srv.opts.Hooks.Statement(&s.info, &d, time.Since(start))
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
	timedOut := false
	t := time.AfterFunc(lexWaitTimeout, func() {
		s.mu.Lock()
		timedOut = true
		s.mu.Unlock()
		s.idleCond.Broadcast()
	})
	defer t.Stop()
	for len(e.pending) > 0 && e.pending[0].seg < s.ps.sentSeg && !s.ps.lost && !s.state.finishing && !timedOut {
		s.idleCond.Wait()
	}
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
		return stmtVerdict{refuse: refusePrepared(fmt.Sprintf("prepared statement %q was not prepared through this proxy session, so the rules it was decided under are unknown", name),
			"Prepare statements through the proxy (PREPARE or a Parse message), not in functions.")}, nil
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
	nd := &stmtDef{sql: def.sql, kept: true, sent: decisionHash(&d, def.sql), gen: gen, oids: def.oids, ops: def.ops}
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
	portal, rest, ok := cstring(body)
	stmt, _, ok2 := cstring(rest)
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
		if err := s.reprepare(stmt, v); err != nil {
			return err
		}
	}
	s.mu.Lock()
	pkey := serverKey(portal)
	old := s.ps.portals[pkey]
	pe := &portalEntry{def: v.def, gen: gen, seg: s.ps.sentSeg}
	if portal != "" && old != nil && old.seg >= s.ps.idleSeg {
		// A named portal cannot be bound twice in a transaction: this
		// Bind fails and the old one stays open.
		pe.uncertain = true
		pe.gen = min(old.gen, gen)
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
	s.log.Info("prepared statement re-prepared under reloaded rules", zap.String("statement", name))
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
		s.ps.addStmtOp(name, nil, false, 0, false, 0)
	case 'P':
		key := serverKey(name)
		pe := s.ps.portals[key]
		s.ps.expect(0, func(o outcome) {
			if o == outcomeOK && s.ps.portals[key] == pe {
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
	definedHere := make(map[string]bool)
	for _, op := range ops {
		key := serverKey(op.Name)
		switch op.Kind {
		case OpPrepare:
			definedHere[key] = true
		case OpDeallocate:
			definedHere[key] = true // EXECUTE after it fails upstream
		case OpDeallocateAll:
			return nil, nil // every later EXECUTE fails upstream
		case OpExecute:
			if definedHere[key] {
				continue
			}
			v, err := s.checkStatement(op.Name, gen, true)
			if err != nil {
				return nil, err
			}
			if v.refuse != nil {
				return v.refuse, nil
			}
		}
	}
	return nil, nil
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
		if err == nil {
			d := s.decide(lex, op.Text)
			sent = decisionHash(&d, op.Text)
		}
		s.mu.Lock()
		defs[i] = s.ps.newDef(op.Text, sent, gen, nil, true)
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
	for i, op := range ops {
		switch op.Kind {
		case OpPrepare:
			s.ps.addStmtOp(op.Name, defs[i], false, 0, query, op.Stmt)
		case OpDeallocate:
			s.ps.addStmtOp(op.Name, nil, false, 0, query, op.Stmt)
		case OpDeallocateAll:
			for key := range s.ps.stmts {
				s.ps.addStmtOp(key, nil, false, 0, query, op.Stmt)
			}
		}
	}
}

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
	if s.ps.loseTrack() {
		go s.terminate(fatal("XX000", "fenceproxy: lost track of the responses to prepared statements it re-prepared; reconnect"), "prepared-statement bookkeeping lost")
	}
	s.idleCond.Broadcast()
}

// trackPrepared does the prepared-statement bookkeeping of a Query or
// Parse about to be sent with decision d (which it may turn into a
// refusal): EXECUTEs of statements prepared under older rules are checked,
// and what the text defines or removes is recorded.
func (s *session) trackPrepared(typ byte, p *pgproto3.Parse, sql string, gen uint64, d *Decision) error {
	var ops []PreparedOp
	if d.Action != Refuse {
		if anyOp, exec := mentionsPrepared(sql); anyOp {
			var err error
			ops, err = s.ps.pol.PreparedOps(sql)
			switch {
			case err != nil && exec:
				*d = Decision{Action: Refuse, Refusal: refusePrepared("cannot tell which prepared statement this text executes: it does not parse", "")}
			case err != nil:
				ops = nil
			case d.Action == Rewrite && len(ops) > 0 && !sameOps(s.ps.pol, ops, d.SQL):
				*d = Decision{Action: Refuse, Refusal: refusePrepared("cannot track the prepared statements of this text once rewritten", "Send PREPARE, EXECUTE and DEALLOCATE as statements of their own.")}
			}
		}
	}
	if typ == 'Q' && d.Action != Refuse && len(ops) > 0 {
		e, err := s.checkExecutes(ops, gen)
		if err != nil {
			return err
		}
		if e != nil {
			*d = Decision{Action: Refuse, Refusal: e}
		}
	}
	if d.Action == Refuse {
		ops = nil
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
		s.registerSQLOps(ops, defs, true)
	case d.Action == Refuse:
		if p.Name == "" {
			// The refused Parse still drops the unnamed statement.
			s.ps.addStmtOp("", nil, true, 0, false, 0)
		}
		// A refused named Parse fails before it would replace anything.
	default:
		def := s.ps.newDef(sql, decisionHash(d, sql), gen, p.ParameterOIDs, false)
		def.ops = ops
		s.ps.addStmtOp(p.Name, def, p.Name == "", 0, false, 0)
	}
	return nil
}

// sameOps reports whether the rewritten text out has the same
// prepared-statement operations at the same statement indexes as ops.
func sameOps(pol PreparedPolicy, ops []PreparedOp, out string) bool {
	got, err := pol.PreparedOps(out)
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
