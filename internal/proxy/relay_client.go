package proxy

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"
	"unsafe"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/sqllex"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/syncx"
)

// copyClientToUpstream relays client messages, passing SQL through the rules.
func (r *requests) copyClientToUpstream() error {
	r.cr.budget = r.messageBudget()
	// A large body's budget is given back after each message; this is for
	// a session that ends while it handles one.
	defer r.cr.release()
	for {
		if !r.cr.buffered() {
			if err := r.uw.Flush(); err != nil {
				return upstreamErr(err)
			}
		}
		typ, n, err := r.cr.header()
		if err != nil {
			if errors.Is(err, errMessageTooLarge) || errors.Is(err, errBadLength) {
				r.sess.terminate(fatal("08P01", "fenceproxy: "+strings.TrimPrefix(err.Error(), "proxy: ")), "bad client message")
				return clientErr(err)
			}
			// The client went away without a Terminate (io.EOF) or its
			// connection failed: close records it as the client's doing,
			// and cancels a statement still running for it.
			return clientErr(err)
		}
		if r.liveSet && runsSomething(typ) {
			if err := r.closeLive(); err != nil {
				return err
			}
		}
		if typ == 'Q' && r.closedSet && r.closed == "" {
			// A Query replaces the unnamed portal: the server would not
			// have it either.
			r.closedSet = false
		}
		switch typ {
		case 'Q', 'P':
			body, err := r.cr.body(n)
			switch {
			case errors.Is(err, errNoBudget):
				err = r.refuseUnheld(typ, body, err)
			case err != nil:
				return clientErr(err)
			default:
				err = r.relaySQL(typ, body)
			}
			r.cr.release()
			if err != nil {
				return err
			}
		case 'B', 'D', 'E', 'C':
			if r.ps == nil {
				if err := r.forwardUnread(typ, n); err != nil {
					return err
				}
				continue
			}
			if typ == 'B' && n > bindStreamBytes {
				// A large Bind: its values are streamed, not held.
				done, err := r.relayLargeBind(n)
				if err != nil {
					return err
				}
				if done {
					continue
				}
			}
			body, err := r.cr.body(n)
			if errors.Is(err, errNoBudget) {
				err = r.sendRefusedInstead(noBudgetRefusal(err))
				r.cr.release()
				if err != nil {
					return err
				}
				continue
			}
			if err != nil {
				return clientErr(err)
			}
			switch typ {
			case 'B':
				err = r.relayBind(body)
			case 'D':
				err = r.relayDescribe(body)
			case 'E':
				err = r.relayExecute(body)
			case 'C':
				err = r.relayClose(body)
			}
			r.cr.release()
			if err != nil {
				return err
			}
		case 'F':
			if err := r.relayFunctionCall(n); err != nil {
				return err
			}
		case 'X':
			// The server closes its end on Terminate: from here on an
			// upstream EOF is the normal end of the session, not a failure.
			r.mu.Lock()
			r.state.finishing = true
			r.mu.Unlock()
			if err := writeHeader(r.uw, typ, 0); err == nil {
				_ = r.uw.Flush()
			}
			return errSessionDone
		default:
			if err := r.forwardUnread(typ, n); err != nil {
				return err
			}
		}
	}
}

// runsSomething reports whether a client message of type typ may run
// code on the server that the proxy does not see (a Query, a FunctionCall,
// a Sync's commit, a copy's triggers), or runs a portal (an Execute, which
// relayExecute checks itself): a live portal is closed before it.
func runsSomething(typ byte) bool {
	switch typ {
	case 'P', 'B', 'D', 'C', 'H':
		return false
	}
	return typ != 'E'
}

// forwardUnread forwards a client message without decoding its body.
func (r *requests) forwardUnread(typ byte, n int) error {
	if !r.track(typ) {
		return errSessionDone
	}
	if err := writeHeader(r.uw, typ, n); err != nil {
		return upstreamErr(err)
	}
	if err := r.cr.copyBody(r.uw, n); err != nil {
		return blame(err, clientErr, upstreamErr)
	}
	return nil
}

// track updates the idle bookkeeping for a client message about to be
// forwarded. It returns false if the session is closing.
func (t *tracker) track(typ byte) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.state.finishing {
		return false
	}
	// In copy-in mode the server ignores Sync and Flush (protocol docs,
	// "COPY Operations"); CopyDone or CopyFail ends it.
	if t.state.copyIn {
		switch typ {
		case 'S', 'H':
			return true
		case 'c', 'f':
			t.state.copyIn = false
		}
	} else if typ == 'c' || typ == 'f' {
		t.state.copyEndSent = true
	}
	switch typ {
	case 'Q', 'F':
		t.state.inFlight++
		t.state.lastWasQuery = true
		t.state.copyEndSent = false
		t.state.segTx = 0
	case 'S':
		t.state.segTx = 0
		if t.ps != nil && t.ps.qHead < len(t.ps.queries) {
			// A Query is unanswered: a COPY FROM STDIN of it (a Query
			// may run several) would ignore this Sync.
			t.ps.syncAfterQuery, t.ps.syncQuerySeg = true, t.ps.queries[len(t.ps.queries)-1].seg
		}
		t.state.inFlight++
		t.state.unsynced = false
		if !t.state.copyEndSent {
			t.state.syncsSinceExecute++
		}
	case 'E':
		t.state.unsynced = true
		t.state.lastWasQuery = false
		t.state.syncsSinceExecute = 0
		t.state.copyEndSent = false
		t.state.execsSinceIdle++
	case 'P', 'B', 'D', 'C':
		t.state.unsynced = true
	}
	if t.ps != nil {
		t.ps.countSent(typ)
	}
	return true
}

// copyInStarted records a CopyInResponse or CopyBothResponse. When an
// extended-protocol Execute started the copy, the Syncs the client sent
// after it were ignored by the server and will get no ReadyForQuery.
func (s *session) copyInStarted() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.state.lastWasQuery && (s.state.execsSinceIdle > 1 || s.state.copyEndSent) || s.ps != nil && s.ps.syncAfterQuery {
		// Which Execute or Query started this copy, and so which Syncs
		// the server ignored, is unknown: never trust inFlight for
		// lexing again.
		s.state.desync = true
		s.losePreparedTrack()
	}
	if !s.state.lastWasQuery {
		s.state.inFlight = max(0, s.state.inFlight-s.state.syncsSinceExecute)
		if s.ps != nil && s.state.syncsSinceExecute > 0 {
			// Those Syncs end no segment: positions recorded after them
			// are wrong.
			s.ps.sentSeg -= uint64(s.state.syncsSinceExecute)
			lose := false
			for _, h := range s.ps.fifo {
				lose = lose || h.seg > s.ps.recvSeg
			}
			for _, q := range s.ps.queries[s.ps.qHead:] {
				lose = lose || q.seg > s.ps.recvSeg
			}
			if lose {
				s.losePreparedTrack()
			}
		}
		s.state.syncsSinceExecute = 0
	}
	if s.state.copyEndSent {
		// The client already ended this copy.
		s.state.copyEndSent = false
	} else {
		s.state.copyIn = true
	}
	// inFlight may have dropped, and the server now waits for the
	// client: wake lexingFor.
	s.idleCond.Broadcast()
	s.wakeIdleLocked()
}

// copyInEnded records an ErrorResponse: a server in copy-in mode leaves it
// on an error, and then answers the client's next Sync.
func (t *tracker) copyInEnded() {
	t.mu.Lock()
	t.state.copyIn = false
	t.mu.Unlock()
}

// noBudgetRefusal is the error a client gets for a message the proxy had
// no memory budget for (MessageBudget).
func noBudgetRefusal(err error) *rules.Error {
	return &rules.Error{
		Code:    "53200",
		Message: "fenceproxy: out of memory for large messages; the message was not executed",
		Detail:  strings.TrimPrefix(err.Error(), "proxy: ") + " (limits.large_message_budget, limits.large_message_wait)",
		Hint:    "Retry later, send smaller messages, or raise limits.large_message_budget.",
	}
}

// refuseUnheld refuses a Query or Parse whose body the proxy had no
// memory budget for (start is its first bytes; the rest was dropped): the
// server gets a statement that fails with the refusal in its place, as
// for a statement the policy refuses.
func (r *requests) refuseUnheld(typ byte, start []byte, err error) error {
	e := noBudgetRefusal(err)
	r.logger().Info("statement refused", zap.String("sqlstate", e.Code), zap.String("reason", e.Message), zap.Error(err))
	return r.refuseInstead(typ, start, e)
}

// refuseInstead sends, in place of a client's Query or Parse (start is its
// first bytes), a statement that fails with e.
func (r *requests) refuseInstead(typ byte, start []byte, e *rules.Error) error {
	var p pgproto3.Parse
	if typ == 'P' {
		name, _, ok := cstring(start)
		if !ok {
			return r.sess.protocolViolation(errors.New("invalid Parse message"))
		}
		p.Name = name
	}
	d := rules.Decision{Action: Refuse, Err: e}
	if r.ps != nil {
		if err := r.trackPrepared(typ, &p, "", r.ps.generation(), &d, false, 0, prepWords{}, &fenceText{}); err != nil {
			return err
		}
	}
	if !r.track(typ) {
		return errSessionDone
	}
	sql := r.refusalSQL(d.Err)
	var msg encoder = &pgproto3.Query{String: sql}
	if typ == 'P' {
		msg = &pgproto3.Parse{Name: p.Name, Query: sql}
	}
	return upstreamErr(writeMsg(r.uw, msg))
}

// relayFunctionCall forwards a FunctionCall, the protocol's call of a
// function by its OID (libpq's PQfn, which its large-object functions
// use), of n bytes. A function may read or write a lock-fenced table (a
// user's, or one of PostgreSQL's that runs SQL text: query_to_xml), and
// a FunctionCall has no statement that a lock registration could go in
// front of: where the session may register (it names a lock), it is
// refused as a refused Query is (the client gets the error and
// ReadyForQuery, as for a FunctionCall that failed), unless it is one of
// the large-object functions (largeObjectFunc).
func (r *requests) relayFunctionCall(n int) error {
	if n < 4 {
		return r.forwardUnread('F', n)
	}
	named := r.lockNamed
	if r.fence.on {
		var ok bool
		var err error
		if named, ok, err = r.fenceReady(); err != nil {
			return err
		}
		named = named || !ok
	}
	if !named {
		return r.forwardUnread('F', n)
	}
	body, err := r.cr.body(n)
	if errors.Is(err, errNoBudget) {
		err = r.refuseUnheld('Q', nil, err)
		r.cr.release()
		return err
	}
	if err != nil {
		return clientErr(err)
	}
	oid := binary.BigEndian.Uint32(body)
	if largeObjectFunc(oid) {
		if !r.track('F') {
			r.cr.release()
			return errSessionDone
		}
		err = writeRaw(r.uw, 'F', body)
		r.cr.release()
		return upstreamErr(err)
	}
	r.cr.release()
	e := refusePrepared(fmt.Sprintf("a FunctionCall message of function %d, in a session that names a lock: the lock registration cannot go before it; it was not run (only the large-object functions may be called this way there)", oid),
		"Call the function in a statement (SELECT f(...)), which registers the lock first.")
	r.logger().Info("statement refused", zap.String("sqlstate", e.Code), zap.String("reason", e.Message))
	return r.refuseInstead('Q', nil, e)
}

// largeObjectFunc reports whether oid is one of PostgreSQL's large-object
// functions that libpq calls by FunctionCall (lo_open, loread, lowrite and
// the others: their OIDs are fixed in PostgreSQL's catalog, the 64-bit
// ones since 9.3). They touch large objects only, never a table's rows.
func largeObjectFunc(oid uint32) bool {
	switch oid {
	case 715, // lo_create
		952,  // lo_open
		953,  // lo_close
		954,  // loread
		955,  // lowrite
		956,  // lo_lseek
		957,  // lo_creat
		958,  // lo_tell
		964,  // lo_unlink
		1004, // lo_truncate
		3170, // lo_lseek64
		3171, // lo_tell64
		3172: // lo_truncate64
		return true
	}
	return false
}

// Texts whose decision is charged to the large-message budget: every
// text over largeBodyBytes, and a shorter one whose decision may hold more
// than smallDecisionCharge. The policy is asked only for texts over
// decisionCostBytes, so that ordinary statements pay nothing for it: a
// text that short holds less than smallDecisionCharge while decided
// (rules.TestDecisionCostCoversThePeak: 3.5 MB at most, for 512 bytes of
// DELETE statements on a table in audit mode, in the prepared form).
//
// Below smallDecisionCharge a decision is not charged: each session may
// hold that much uncharged, besides its 64 KiB body, as the budget's
// collections (one per 100 ms at most, after releases of 1 MiB or more)
// would otherwise run for every medium-sized statement. It is about what
// a 10 KiB statement with a 2,000-item IN list holds.
const (
	decisionCostBytes   = 512
	smallDecisionCharge = 4 << 20
)

// chargeDecision charges the budget of the message being handled for
// deciding sql (Policy.DecisionCost: a parse holds many times the text),
// so that the budget bounds the memory of statements being decided too
// (docs/design.md, "Memory of large messages"): a text over
// largeBodyBytes is charged its cost, a shorter one only when the cost is
// over smallDecisionCharge.
func (r *requests) chargeDecision(sql string) error {
	n := r.srv.opts.Policy.DecisionCost(&r.info, sql)
	if n <= 0 || len(sql) <= largeBodyBytes && n <= smallDecisionCharge {
		return nil
	}
	return r.cr.charge(n)
}

// relaySQL takes the rules decision for a Query or Parse message and
// forwards what it says.
func (r *requests) relaySQL(typ byte, body []byte) error {
	var (
		p     pgproto3.Parse
		sql   string
		start = r.clock()
	)
	if typ == 'Q' {
		// The text is read in place, without a copy: it aliases the read
		// buffer, so it must not be kept past this message (what is kept
		// is copied: the policy's cache, prepared-statement definitions).
		if len(body) == 0 || bytes.IndexByte(body, 0) != len(body)-1 {
			return r.sess.protocolViolation(errors.New("invalid Query message"))
		}
		if len(body) > 1 {
			sql = unsafe.String(&body[0], len(body)-1)
		}
		if r.closedSet && sqllex.ContainsWordFold(sql, "close") {
			// SQL CLOSE (of the portal or ALL) ends a portal the proxy
			// closed as it would have ended it: not bound again (the
			// word in a string or comment only costs it the rebinding).
			r.closedSet = false
		}
	} else {
		// Read in place too (decodeParse): the name, a map key, is copied.
		var err error
		if p, err = decodeParse(body, r.oidBuf[:0]); err != nil {
			return r.sess.protocolViolation(err)
		}
		if cap(p.ParameterOIDs) <= maxReusedOIDs {
			r.oidBuf = p.ParameterOIDs[:0]
		}
		sql = p.Query
	}
	if len(sql) > decisionCostBytes {
		if err := r.chargeDecision(sql); err != nil {
			return r.refuseUnheld(typ, body, err)
		}
	}
	var gen uint64
	if r.ps != nil {
		// Before deciding: a reload during the decision then shows as a
		// change of generation later.
		gen = r.ps.generation()
	}
	if !r.fence.on && !r.lockNamed && r.srv.opts.Policy.NamesLock(&r.info, sql) {
		r.lockNamed = true
	}
	lex, err := r.lexingFor(sql)
	if err != nil {
		return err
	}
	if r.fence.on && r.mayRemember() && mayEndTx(sql) {
		// Before it is sent: its ReadyForQuery then finds the mark.
		r.mu.Lock()
		r.fence.noteMayEnd()
		r.mu.Unlock()
	}
	// The text's prepared-statement words, scanned once: for the form it
	// is decided in and for the bookkeeping after the decision.
	var words prepWords
	if r.ps != nil || typ == 'P' && p.Name != "" {
		words.any, words.execute = mentionsPrepared(sql)
	}
	lex.Prepared = preparedForm(typ, p.Name, words)
	d := r.decide(lex, sql)
	if words.any && r.ps != nil {
		// A text that defines prepared statements records them as decided
		// under gen (sqlOpDefs): when the rules or the database's paths
		// moved while it was decided (its own stamp read may have had the
		// database checked again), it is decided once more, under the
		// results in force, rather than recorded as decided under rules
		// unknown, which refuses every EXECUTE until it is prepared again.
		if g := r.ps.generation(); g != gen {
			gen = g
			d = r.decide(lex, sql)
		}
	}
	r.decided(&d, r.clock().Sub(start))
	var ft fenceText
	if r.fence.on && d.Action != Refuse {
		if err := r.fenceDecide(typ, &d, &ft, sql, lex, words); err != nil {
			return err
		}
	}
	// A Parse of a fenced statement that changes no fence setting: in the
	// parameter form, when it has one (tokenparam.go).
	param := 0
	if typ == 'P' && d.Action == Rewrite && r.ps != nil && r.fence.on && len(ft.ops) == 0 && !words.any {
		if pd, k, ok := r.paramDecision(lex, sql, len(p.ParameterOIDs)); ok {
			d, param = pd, k
		}
	}
	if typ == 'Q' && d.Action == Rewrite && d.Preparable && r.ps != nil && r.srv.opts.AutoPrepare > 0 && !words.any {
		if done, err := r.autoPrepare(lex, sql, &d); done || err != nil {
			return err
		}
	}
	if r.ps != nil {
		if err := r.trackPrepared(typ, &p, sql, gen, &d, lex.Prepared, param, words, &ft); err != nil {
			return err
		}
	} else if d.Lock != nil && d.Action != Refuse && typ == 'Q' && len(d.Lock.Calls) > 0 && (r.lockNamed || d.Lock.Required) {
		// The registration's results could not be told apart.
		d = rules.Decision{Action: Refuse, Err: refusePrepared("lock fencing needs a policy that tracks prepared statements", "")}
	}
	if !r.track(typ) {
		return errSessionDone
	}

	var out string
	switch d.Action {
	case Forward:
		if err := writeRaw(r.uw, typ, body); err != nil {
			return upstreamErr(err)
		}
		return nil
	case Rewrite:
		out = d.SQL
		r.mu.Lock()
		r.state.rewrote = true
		r.mu.Unlock()
		if ce := r.logger().Check(zap.DebugLevel, "statement rewritten"); ce != nil {
			ce.Write(zap.String("sql", d.SQL), zap.Strings("tables", d.Tables))
		}
	case Refuse:
		if d.Err == nil {
			d.Err = &rules.Error{Code: "XX000", Message: "fenceproxy: statement refused"}
		}
		out = r.refusalSQL(d.Err)
		r.logger().Info("statement refused", zap.String("sqlstate", d.Err.Code), zap.String("reason", d.Err.Message))
	default:
		return fmt.Errorf("proxy: unknown policy action %d", d.Action)
	}
	if typ == 'Q' {
		return upstreamErr(writeQuery(r.uw, out))
	}
	oids := p.ParameterOIDs
	switch {
	case d.Action == Refuse:
		oids = nil
	case param > 0:
		oids = tokenOIDs(oids, param)
	}
	if err := writeMsg(r.uw, &pgproto3.Parse{Name: p.Name, Query: out, ParameterOIDs: oids}); err != nil {
		return upstreamErr(err)
	}
	return nil
}

// decide asks the policy, failing closed if it panics: a bug in the
// rewriter or the parser must refuse one statement, not crash the proxy.
//
// On an event loop, a decision that may take long (a first-seen statement's
// parse, the first wait for a database's check) is made off the loop's
// thread while the session's task waits, so that the loop's other sessions
// go on.
func (t *tracker) decide(lex Lexing, sql string) rules.Decision {
	if t.loop != nil && t.loop.inTask() {
		if d, ok := t.quickDecide(lex, sql); ok {
			return d
		}
	}
	var d rules.Decision
	t.offLoop(func() { d = t.policyDecide(lex, sql) })
	return d
}

// offLoop runs f, which may block or take long (a parse, a wait for the
// database, a round trip of its own) and must not panic, in a goroutine of
// its own while the session's task parks, when the session is on a loop
// (the caller is its task); otherwise here. At most cap(Server.offLoop)
// such goroutines run f at once: after a reload every session's next
// statement may be first-seen, and each parse holds an OS thread.
func (t *tracker) offLoop(f func()) {
	if t.loop == nil || !t.loop.inTask() {
		f()
		return
	}
	t.loop.await(func() {
		t.srv.offLoopWaiting.Add(1)
		t.srv.offLoop <- struct{}{}
		t.srv.offLoopWaiting.Add(-1)
		defer func() { <-t.srv.offLoop }()
		f()
	})
}

// quickDecide asks the policy for a quick decision, refusing the
// statement if it panics.
func (t *tracker) quickDecide(lex Lexing, sql string) (d rules.Decision, ok bool) {
	defer func() {
		if r := recover(); r != nil {
			d, ok = t.policyPanicked(r), true
		}
	}()
	return t.pol.DecideQuick(&t.info, lex, sql)
}

// policyDecide asks the policy, refusing the statement if it panics.
func (t *tracker) policyDecide(lex Lexing, sql string) (d rules.Decision) {
	defer func() {
		if r := recover(); r != nil {
			d = t.policyPanicked(r)
		}
	}()
	return t.pol.Decide(&t.info, lex, sql)
}

// policyPanicked logs a panic of the policy and returns the refusal of the
// statement it was deciding.
func (t *tracker) policyPanicked(r any) rules.Decision {
	t.logPolicyPanic("policy panicked; statement refused", r)
	return internalRefusal()
}

// logPolicyPanic logs r, recovered from the policy, with the stack.
func (t *tracker) logPolicyPanic(msg string, r any) {
	t.logger().Error(msg, zap.Any("panic", r), zap.Stack("stack"))
}

// internalRefusal refuses a statement the policy failed on.
func internalRefusal() rules.Decision {
	return rules.Decision{Action: Refuse, Err: &rules.Error{
		Code:    "XX000",
		Message: "fenceproxy: internal error while inspecting the statement; it was not executed",
	}}
}

// lexingFor returns how the server will tokenize sql. Only backslashes
// (standard_conforming_strings) and bytes >= 0x80 (client_encoding) can be
// read differently, so for SQL with neither the last reported settings do.
// Otherwise the proxy must not decide on stale settings: earlier statements
// still in flight may change them (their ParameterStatus arrives with
// their ReadyForQuery), so it sends what it has and waits for the server to
// answer. Extended-protocol messages not yet followed by a Sync cannot be
// waited for; then Lexing.Uncertain is set and the policy decides.
func (r *requests) lexingFor(sql string) (Lexing, error) {
	var text Lexing
	for i := 0; i < len(sql) && !(text.Backslash && text.NonASCII); i++ {
		switch c := sql[i]; {
		case c == '\\':
			text.Backslash = true
		case c >= 0x80:
			text.NonASCII = true
		}
	}
	sensitive := text.Backslash || text.NonASCII
	if sensitive {
		// Only statements the policy may act on need the server's exact
		// reading; the others are forwarded as sent anyway.
		if !r.srv.opts.Policy.MayTouch(&r.info, sql) {
			sensitive = false
		}
	}
	r.mu.Lock()
	if !sensitive || (r.state.inFlight == 0 && !r.state.unsynced) {
		lex := r.lex
		lex.Backslash, lex.NonASCII = text.Backslash, text.NonASCII
		// After the bookkeeping lost track once, fail closed for good.
		lex.Uncertain = sensitive && r.state.desync
		r.mu.Unlock()
		return lex, nil
	}
	r.mu.Unlock()
	if err := r.uw.Flush(); err != nil {
		return Lexing{}, upstreamErr(err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	// Bounded: the bookkeeping can overcount (a Query discarded by a
	// server skipping to Sync), and the server may be waiting for the
	// client (copy-in); never block reading the client forever.
	r.waitLocked(func() bool { return r.state.inFlight > 0 && !r.state.copyIn })
	if r.state.finishing {
		return Lexing{}, errSessionDone
	}
	lex := r.lex
	lex.Backslash, lex.NonASCII = text.Backslash, text.NonASCII
	lex.Uncertain = r.state.unsynced || r.state.inFlight > 0 || r.state.copyIn || r.state.desync
	return lex, nil
}

// lexWaitTimeout bounds how long the relay waits for earlier statements
// (lexingFor, waitEarlier).
var lexWaitTimeout = 5 * time.Second

// waitLocked waits, with s.mu held, while pending reports true and the
// session is not finishing, for at most lexWaitTimeout. The upstream-to-
// client goroutine broadcasts idleCond when responses arrive.
func (t *tracker) waitLocked(pending func() bool) {
	if t.loop != nil {
		t.waitOnLoop(pending)
		return
	}
	syncx.WaitUntil(t.idleCond, lexWaitTimeout, func() bool { return !pending() || t.state.finishing })
}

// waitOnLoop is waitLocked for a session on a loop: the task parks (s.mu
// released) and the other direction's task wakes it (wakeIdleLocked).
func (t *tracker) waitOnLoop(pending func() bool) {
	l := t.loop
	me := l.current()
	timedOut := false // the loop thread's
	timer := time.AfterFunc(lexWaitTimeout, func() {
		l.post(func() {
			timedOut = true
			l.makeReady(me)
		})
	})
	defer timer.Stop()
	for pending() && !t.state.finishing && !timedOut {
		t.idleWaiter = me
		t.mu.Unlock()
		me.park()
		t.mu.Lock()
		t.idleWaiter = nil
	}
}
