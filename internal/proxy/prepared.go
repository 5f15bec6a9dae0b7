package proxy

import (
	"crypto/sha256"
	"slices"
	"strconv"
	"strings"
	"unsafe"

	"github.com/fenceproxy/fenceproxy/internal/rules"
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
	// mayEnd: the text may end its transaction from stored code
	// (mayEndTx).
	mayEnd bool
	// preparedForm: decided with Lexing.Prepared (preparedForm), as a
	// re-decision must be too.
	preparedForm bool
	// plain: the text was forwarded unchanged, without a lock
	// registration, so sent is the hash of sql itself (repeatDef).
	plain bool
	// forward: the text was forwarded as sent (with or without a lock
	// registration); false when unknown.
	forward bool
	// ops: the SQL-level prepared-statement operations the text performs
	// when it runs (a Parse of "PREPARE x AS ..." or "EXECUTE x").
	ops []PreparedOp
	// lock is the lock registration the statement needs when it runs
	// (for a SQL-level definition, that of the statement it prepares).
	lock *rules.LockCall
	// fence: what the statement does to the fence settings when it runs
	// (set_config with parameters is resolved at each Bind).
	fence []rules.SettingOp
	// param is the number of the parameter the relay binds the session's
	// token to (tokenparam.go), 0 when the statement reads the setting.
	param int
	// settingFree, with param: neither the client's text nor the
	// parameter form sent may read a fence setting, but for the stale-row
	// error's message (paramReads), so that a Bind of it may go without
	// the session's values (goesBare). False when unknown.
	settingFree bool
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
	id        uint64   // which Bind made it (entries are reused)
	def       *stmtDef // nil: unknown statement
	gen       uint64
	seg       uint64 // segment of the Bind: gone once a later ReadyForQuery says idle
	uncertain bool   // another portal of that name may still be open
	// fence: the fence-setting changes its first Execute makes.
	fence []fenceApplied
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
	// op, when set, is resolved by the outcome (resolveStmtOp); else done,
	// if set, is called with it.
	op   *stmtOp
	done func(outcome)
	// trim: a Describe of a statement in the parameter form, whose
	// ParameterDescription loses the token's parameter (tokenparam.go).
	trim bool
}

// querySent is a Query sent: its segment, and the number of
// extended-protocol messages sent before it in the segment.
type querySent struct {
	seg uint64
	ext int
}

// preparedState is guarded by session.mu.
type preparedState struct {
	pol Policy
	db  string // the session's database, for pol.Generation

	stmts     map[string]*stmtEntry
	portals   map[string]*portalEntry
	textBytes int

	sentSeg uint64 // boundaries (Query, Sync, FunctionCall) sent
	sentIdx int    // completion messages sent in the open segment
	recvSeg uint64 // ReadyForQuery received
	recvExt int    // extended-protocol completions received in the segment
	recvCC  int    // CommandCompletes of the segment's Query received
	// queries are the Queries sent and not answered: each ends its
	// segment, after the completions of the ext extended-protocol
	// messages sent before it in the segment (a client may send Bind and
	// Execute, then a Query, with no Sync between).
	queries []querySent
	qHead   int  // queries[:qHead] are answered
	failed  bool // an error was received in the segment
	// extFailed: that error answered an extended-protocol message (not
	// the segment's Query), so the server skips to the next Sync.
	extFailed bool
	// skippedBoundary: a Query or function call the server ignored.
	skippedBoundary bool
	// syncAfterQuery: a Sync was sent while the Query of segment
	// syncQuerySeg (the last sent) was unanswered. A COPY FROM STDIN it
	// runs ignores the Sync, which the segments cannot show: a copy that
	// starts before that Query is answered gives the bookkeeping up
	// (copyInStarted).
	syncAfterQuery bool
	syncQuerySeg   uint64
	idleSeg        uint64 // portals bound in earlier segments are gone
	// portalSeq numbers the Binds (portalEntry.id).
	portalSeq uint64
	fifo      []pendingResp
	// fifoBase is the start of fifo's array, where fifo starts over once
	// empty (push): the queue reuses one array instead of sliding off it.
	fifoBase []pendingResp
	// lost: the response bookkeeping lost track (COPY pipelined with
	// Syncs, an unexpected ReadyForQuery): from then on every re-decision
	// refuses.
	lost bool
	// refusedName names the Parse that stands in for a refused Bind,
	// Describe or Execute; it fails during parse analysis, so it is never
	// created.
	refusedName string
	// registerName names the statement and portal of the proxy's own
	// statements before a Bind (sendOwn: the catalog check, the lock
	// registration, the call of rules.EnterProc).
	registerName string
	// preludeName names the statement and portal of the fence settings'
	// prelude (sendPrelude).
	preludeName string
	// auto is the session's own prepared statements (autoprepare.go).
	auto autoState
}

// generation is the policy's generation for the session's statements.
func (ps *preparedState) generation() uint64 { return ps.pol.Generation(ps.db) }

// newPreparedState makes a session's state; names is the random part of
// the names of the proxy's own statements.
func newPreparedState(pol Policy, names string) *preparedState {
	return &preparedState{
		pol:          pol,
		stmts:        make(map[string]*stmtEntry),
		portals:      make(map[string]*portalEntry),
		refusedName:  "fenceproxy_refused_" + names,
		registerName: "fenceproxy_register_" + names,
		preludeName:  "fenceproxy_settings_" + names,
		auto:         autoState{prefix: "fenceproxy_auto_" + names + "_"},
	}
}

// clientNamed records that a client's message or statement defines or
// removes the prepared statement name: if it is one of the proxy's own
// (the names show in pg_prepared_statements), the proxy no longer knows
// what the server has under it and prepares its statement again before
// the next use. Callers hold session.mu.
func (ps *preparedState) clientNamed(name string) {
	if serverKey(name) == serverKey(ps.registerName) || serverKey(name) == serverKey(ps.preludeName) || ps.auto.touches(name) {
		ps.forgetOwn()
	}
}

// forgetOwn records that the server may no longer have any of the proxy's
// own statements that are kept (autoprepare.go's; those before a Bind
// are prepared at every use anyway): each is prepared again before its
// next use. Callers hold session.mu.
func (ps *preparedState) forgetOwn() {
	ps.auto.forget()
}

// serverKey is the name as the server stores it.
func serverKey(name string) string {
	if len(name) >= nameDataLen {
		return name[:nameDataLen-1]
	}
	return name
}

func hashText(s string) [32]byte {
	// Sum256 only reads its input: no copy of s.
	return sha256.Sum256(unsafe.Slice(unsafe.StringData(s), len(s)))
}

// decisionHash identifies what a decision sends for sql.
func decisionHash(d *rules.Decision, sql string) [32]byte {
	if d.Action == Refuse {
		return hashText("\x00refused")
	}
	if d.Action == Rewrite {
		sql = d.SQL
	}
	if d.Lock != nil {
		// A change of the registration alone is a change too.
		// Not Enter, how the relay sends the statements before a Bind, nor
		// which of the two registration procedures the call names: they
		// have the same arguments and outcome, so a statement decided with
		// one is decided alike with the other (refreshDef takes the new
		// call).
		call := strings.Replace(d.Lock.Call, rules.HoldProc+"(", rules.RegisterProc+"(", 1)
		sql = "\x00lock\x00" + strconv.FormatBool(d.Lock.Required) + "\x00" + call + "\x00" + d.Lock.Pre + "\x00" + sql
	}
	return hashText(sql)
}

// ---- send side (client-to-upstream goroutine; callers hold s.mu) ----

// countSent updates the positions for a message about to be forwarded.
func (ps *preparedState) countSent(typ byte) {
	switch typ {
	case 'Q', 'F', 'S':
		if typ != 'S' {
			ps.queries = append(ps.queries, querySent{seg: ps.sentSeg, ext: ps.sentIdx})
		}
		ps.sentSeg++
		ps.sentIdx = 0
	case 'P', 'B', 'C', 'D', 'E':
		ps.sentIdx++
	}
}

// expect registers a pending response at the open segment's next position.
func (ps *preparedState) expect(swallow byte, done func(outcome)) {
	ps.push(pendingResp{seg: ps.sentSeg, idx: ps.sentIdx, swallow: swallow, done: done})
}

// maxReusedFifo bounds the response queue's array kept once it is empty.
const maxReusedFifo = 1024

// push appends h to the response queue.
func (ps *preparedState) push(h pendingResp) {
	if len(ps.fifo) == 0 {
		if cap(ps.fifoBase) > maxReusedFifo {
			ps.fifoBase = nil
		}
		ps.fifo = ps.fifoBase[:0]
	}
	before := cap(ps.fifo)
	ps.fifo = append(ps.fifo, h)
	if cap(ps.fifo) != before {
		ps.fifoBase = ps.fifo[:0] // a new array, which fifo starts
	}
}

// swallowQuery registers the CommandComplete of statement idx of the Query
// about to be sent, which the proxy inserted: the client must not see it.
func (ps *preparedState) swallowQuery(idx int) {
	ps.push(pendingResp{seg: ps.sentSeg, idx: idx, query: true, swallow: 'C'})
}

// minGen is the oldest generation among the definitions the server may
// have under e: the one confirmed and those pending.
func (e *stmtEntry) minGen() (uint64, bool) {
	var g uint64
	any := false
	see := func(d *stmtDef) {
		if d != nil && (!any || d.gen < g) {
			g, any = d.gen, true
		}
	}
	see(e.confirmed)
	for _, op := range e.pending {
		see(op.def)
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
	if query {
		ps.push(pendingResp{seg: ps.sentSeg, idx: idx, query: true, op: op})
	} else {
		ps.push(pendingResp{seg: ps.sentSeg, idx: ps.sentIdx, swallow: swallow, op: op})
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

// repeatDef returns the definition name is assumed to have when a Parse
// of the same text, decided alike under the same rules, would build an
// equal one, and nil otherwise. Definitions do not change once recorded,
// so that one is recorded again: a client that parses the same unnamed
// statement for every execution (pgbench -M extended, drivers without a
// statement cache) costs no new definition.
func (ps *preparedState) repeatDef(name, sql string, dec *rules.Decision, gen uint64, oids []uint32, ops []PreparedOp) *stmtDef {
	e := ps.stmts[serverKey(name)]
	if e == nil || len(ops) > 0 {
		return nil
	}
	d := e.assumed()
	if d == nil || !d.kept || d.sqlLevel || len(d.ops) > 0 || d.gen != gen || d.sql != sql ||
		!slices.Equal(d.oids, oids) || !sameLock(d.lock, dec.Lock) {
		return nil
	}
	if plainDecision(dec) && d.plain {
		return d // both sent the text itself: no need to hash it
	}
	if d.sent != decisionHash(dec, sql) {
		return nil
	}
	return d
}

// plainDecision reports whether d forwards the text unchanged without a
// lock registration (decisionHash is then the text's own hash).
func plainDecision(d *rules.Decision) bool { return d.Action == Forward && d.Lock == nil }

func sameLock(a, b *rules.LockCall) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Call == b.Call && a.Query == b.Query && a.Required == b.Required && a.Pre == b.Pre && a.Enter == b.Enter && slices.Equal(a.Calls, b.Calls)
}

// newDef builds a definition, keeping sql if the budget allows.
func (ps *preparedState) newDef(sql string, sent [32]byte, gen uint64, oids []uint32, sqlLevel bool) *stmtDef {
	d := &stmtDef{sent: sent, gen: gen, sqlLevel: sqlLevel, mayEnd: mayEndTx(sql)}
	if len(oids) > 0 {
		d.oids = append([]uint32(nil), oids...)
	}
	if ps.keepText(len(sql)) {
		// A Query's text may alias the read buffer (relaySQL): copy it.
		d.sql, d.kept = strings.Clone(sql), true
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
	if len(e.pending) <= 8 {
		// Shifted down rather than sliced off, so that the array is
		// reused: an entry rarely has more than a few pending changes.
		n := copy(e.pending, e.pending[1:])
		e.pending[n] = nil
		e.pending = e.pending[:n]
	} else {
		e.pending[0] = nil
		e.pending = e.pending[1:]
	}
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
		// The segment ending failed: the server skipped what followed the
		// error, so what the proxy sent into it after the error had
		// arrived (the 'E' case popped what was queued before) has no
		// answer, as expected.
		failedSeg := ps.recvSeg
		if !ps.failed {
			failedSeg = ^uint64(0)
		}
		q := ps.queries[ps.qHead:]
		if ps.extFailed && len(q) > 0 && q[0].seg == ps.recvSeg {
			// An error in an extended-protocol message makes the server
			// ignore everything up to a Sync, a Query or function call
			// too: this ReadyForQuery is not that Query's, and the
			// segments counted from here are wrong (the session gives up
			// the bookkeeping: preparedResponse).
			ps.skippedBoundary = true
		}
		for ps.qHead < len(ps.queries) && ps.queries[ps.qHead].seg <= ps.recvSeg {
			ps.qHead++
		}
		if ps.syncAfterQuery && ps.syncQuerySeg <= ps.recvSeg {
			ps.syncAfterQuery = false // that Query is answered: its copies ended
		}
		if ps.qHead == len(ps.queries) {
			// Empty: start over in the same array.
			ps.queries, ps.qHead = ps.queries[:0], 0
			if cap(ps.queries) > maxReusedFifo {
				ps.queries = nil
			}
		}
		ps.recvSeg++
		ps.recvExt, ps.recvCC, ps.failed, ps.extFailed = 0, 0, false, false
		for len(ps.fifo) > 0 && ps.fifo[0].seg < ps.recvSeg {
			if ps.fifo[0].swallow != 0 && ps.fifo[0].seg != failedSeg {
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
		inQuery := ps.inQuery()
		ps.extFailed = !inQuery
		for len(ps.fifo) > 0 && ps.fifo[0].seg == ps.recvSeg {
			h := ps.fifo[0]
			o := outcomeSkipped
			if (!h.query && !inQuery && h.idx == ps.recvExt) || (h.query && inQuery && h.idx == ps.recvCC) {
				o = outcomeFailed
			}
			ps.pop(o)
		}
		ps.recvExt++
	case isCompletion(typ):
		if ps.failed {
			return false, false
		}
		inQuery := ps.inQuery()
		for len(ps.fifo) > 0 && ps.fifo[0].seg == ps.recvSeg && !ps.fifo[0].query && !inQuery && ps.fifo[0].idx == ps.recvExt {
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
		if typ == 'C' && inQuery {
			for len(ps.fifo) > 0 && ps.fifo[0].seg == ps.recvSeg && ps.fifo[0].query && ps.fifo[0].idx == ps.recvCC {
				if ps.fifo[0].swallow != 0 {
					drop = true
				}
				ps.pop(outcomeOK)
			}
			ps.recvCC++
		}
	}
	return drop, mismatch
}

// inQuery reports whether the response arriving now is the segment's
// Query's: the segment ends with a Query, and the completions of the
// extended-protocol messages before it have all arrived.
func (ps *preparedState) inQuery() bool {
	if ps.qHead == len(ps.queries) {
		return false
	}
	q := ps.queries[ps.qHead]
	return q.seg == ps.recvSeg && ps.recvExt >= q.ext
}

func (ps *preparedState) pop(o outcome) {
	h := ps.fifo[0]
	ps.fifo[0] = pendingResp{}
	ps.fifo = ps.fifo[1:]
	switch {
	case ps.lost:
	case h.op != nil:
		ps.resolveStmtOp(h.op, o)
	case h.done != nil:
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
