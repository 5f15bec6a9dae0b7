package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"time"
	"unsafe"

	"github.com/fenceproxy/fenceproxy/internal/rules"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/syncx"
)

// copyClientToUpstream relays client messages, passing SQL through the rules.
func (s *session) copyClientToUpstream() error {
	s.cr.budget = s.messageBudget()
	// A large body's budget is given back after each message; this is for
	// a session that ends while it handles one.
	defer s.cr.release()
	for {
		if !s.cr.buffered() {
			if err := s.uw.Flush(); err != nil {
				return upstreamErr(err)
			}
		}
		typ, n, err := s.cr.header()
		if err != nil {
			if errors.Is(err, errMessageTooLarge) || errors.Is(err, errBadLength) {
				s.terminate(fatal("08P01", "fenceproxy: "+strings.TrimPrefix(err.Error(), "proxy: ")), "bad client message")
				return clientErr(err)
			}
			// The client went away without a Terminate (io.EOF) or its
			// connection failed: close records it as the client's doing,
			// and cancels a statement still running for it.
			return clientErr(err)
		}
		switch typ {
		case 'Q', 'P':
			body, err := s.cr.body(n)
			switch {
			case errors.Is(err, errNoBudget):
				err = s.refuseUnheld(typ, body, err)
			case err != nil:
				return clientErr(err)
			default:
				err = s.relaySQL(typ, body)
			}
			s.cr.release()
			if err != nil {
				return err
			}
		case 'B', 'D', 'E', 'C':
			if s.ps == nil {
				if err := s.forwardUnread(typ, n); err != nil {
					return err
				}
				continue
			}
			if typ == 'B' && n > bindStreamBytes {
				// A large Bind: its values are streamed, not held.
				done, err := s.relayLargeBind(n)
				if err != nil {
					return err
				}
				if done {
					continue
				}
			}
			body, err := s.cr.body(n)
			if errors.Is(err, errNoBudget) {
				err = s.sendRefusedInstead(noBudgetRefusal(err))
				s.cr.release()
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
				err = s.relayBind(body)
			case 'D':
				err = s.relayDescribe(body)
			case 'E':
				err = s.relayExecute(body)
			case 'C':
				err = s.relayClose(body)
			}
			s.cr.release()
			if err != nil {
				return err
			}
		case 'X':
			// The server closes its end on Terminate: from here on an
			// upstream EOF is the normal end of the session, not a failure.
			s.mu.Lock()
			s.state.finishing = true
			s.mu.Unlock()
			if err := writeHeader(s.uw, typ, 0); err == nil {
				_ = s.uw.Flush()
			}
			return errSessionDone
		default:
			if err := s.forwardUnread(typ, n); err != nil {
				return err
			}
		}
	}
}

// forwardUnread forwards a client message without decoding its body.
func (s *session) forwardUnread(typ byte, n int) error {
	if !s.track(typ) {
		return errSessionDone
	}
	if err := writeHeader(s.uw, typ, n); err != nil {
		return upstreamErr(err)
	}
	if err := s.cr.copyBody(s.uw, n); err != nil {
		return blame(err, clientErr, upstreamErr)
	}
	return nil
}

// track updates the idle bookkeeping for a client message about to be
// forwarded. It returns false if the session is closing.
func (s *session) track(typ byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state.finishing {
		return false
	}
	// In copy-in mode the server ignores Sync and Flush (protocol docs,
	// "COPY Operations"); CopyDone or CopyFail ends it.
	if s.state.copyIn {
		switch typ {
		case 'S', 'H':
			return true
		case 'c', 'f':
			s.state.copyIn = false
		}
	} else if typ == 'c' || typ == 'f' {
		s.state.copyEndSent = true
	}
	switch typ {
	case 'Q', 'F':
		s.state.inFlight++
		s.state.lastWasQuery = true
		s.state.copyEndSent = false
	case 'S':
		s.state.inFlight++
		s.state.unsynced = false
		if !s.state.copyEndSent {
			s.state.syncsSinceExecute++
		}
	case 'E':
		s.state.unsynced = true
		s.state.lastWasQuery = false
		s.state.syncsSinceExecute = 0
		s.state.copyEndSent = false
		s.state.execsSinceIdle++
	case 'P', 'B', 'D', 'C':
		s.state.unsynced = true
	}
	if s.ps != nil {
		s.ps.countSent(typ)
	}
	return true
}

// copyInStarted records a CopyInResponse or CopyBothResponse. When an
// extended-protocol Execute started the copy, the Syncs the client sent
// after it were ignored by the server and will get no ReadyForQuery.
func (s *session) copyInStarted() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.state.lastWasQuery && (s.state.execsSinceIdle > 1 || s.state.copyEndSent) {
		// Which Execute started this copy, and so which Syncs the server
		// ignored, is unknown: never trust inFlight for lexing again.
		s.state.desync = true
		s.losePreparedTrack()
	}
	if !s.state.lastWasQuery {
		s.state.inFlight = max(0, s.state.inFlight-s.state.syncsSinceExecute)
		if s.ps != nil && s.state.syncsSinceExecute > 0 {
			// Those Syncs end no segment: positions recorded after them
			// are wrong.
			s.ps.sentSeg -= uint64(s.state.syncsSinceExecute)
			for _, h := range s.ps.fifo {
				if h.seg > s.ps.recvSeg {
					s.losePreparedTrack()
					break
				}
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
func (s *session) copyInEnded() {
	s.mu.Lock()
	s.state.copyIn = false
	s.mu.Unlock()
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
func (s *session) refuseUnheld(typ byte, start []byte, err error) error {
	e := noBudgetRefusal(err)
	s.logger().Info("statement refused", zap.String("sqlstate", e.Code), zap.String("reason", e.Message), zap.Error(err))
	var p pgproto3.Parse
	if typ == 'P' {
		name, _, ok := cstring(start)
		if !ok {
			return s.protocolViolation(errors.New("invalid Parse message"))
		}
		p.Name = name
	}
	d := rules.Decision{Action: Refuse, Err: e}
	if s.ps != nil {
		if err := s.trackPrepared(typ, &p, "", s.ps.pol.Generation(), &d, false, prepWords{}, &fenceText{}); err != nil {
			return err
		}
	}
	if !s.track(typ) {
		return errSessionDone
	}
	sql := s.refusalSQL(d.Err)
	var msg encoder = &pgproto3.Query{String: sql}
	if typ == 'P' {
		msg = &pgproto3.Parse{Name: p.Name, Query: sql}
	}
	return upstreamErr(writeMsg(s.uw, msg))
}

// chargeDecision charges the budget of the message being handled for
// deciding sql (Policy.DecisionCost: a parse holds many times the text),
// so that the budget bounds the memory of large statements being decided
// too (docs/design.md, "Memory of large messages").
func (s *session) chargeDecision(sql string) error {
	n := s.srv.opts.Policy.DecisionCost(&s.info, sql)
	if n <= 0 {
		return nil
	}
	return s.cr.charge(n)
}

// relaySQL takes the rules decision for a Query or Parse message and
// forwards what it says.
func (s *session) relaySQL(typ byte, body []byte) error {
	var (
		p     pgproto3.Parse
		sql   string
		start = s.clock()
	)
	if typ == 'Q' {
		// The text is read in place, without a copy: it aliases the read
		// buffer, so it must not be kept past this message (what is kept
		// is copied: the policy's cache, prepared-statement definitions).
		if len(body) == 0 || bytes.IndexByte(body, 0) != len(body)-1 {
			return s.protocolViolation(errors.New("invalid Query message"))
		}
		if len(body) > 1 {
			sql = unsafe.String(&body[0], len(body)-1)
		}
	} else {
		// Read in place too (decodeParse): the name, a map key, is copied.
		var err error
		if p, err = decodeParse(body, s.oidBuf[:0]); err != nil {
			return s.protocolViolation(err)
		}
		if cap(p.ParameterOIDs) <= maxReusedOIDs {
			s.oidBuf = p.ParameterOIDs[:0]
		}
		sql = p.Query
	}
	if len(sql) > largeBodyBytes {
		if err := s.chargeDecision(sql); err != nil {
			return s.refuseUnheld(typ, body, err)
		}
	}
	var gen uint64
	if s.ps != nil {
		// Before deciding: a reload during the decision then shows as a
		// change of generation later.
		gen = s.ps.pol.Generation()
	}
	if !s.fence.on && !s.lockNamed && s.srv.opts.Policy.NamesLock(&s.info, sql) {
		s.lockNamed = true
	}
	lex, err := s.lexingFor(sql)
	if err != nil {
		return err
	}
	// The text's prepared-statement words, scanned once: for the form it
	// is decided in and for the bookkeeping after the decision.
	var words prepWords
	if s.ps != nil || typ == 'P' && p.Name != "" {
		words.any, words.execute = mentionsPrepared(sql)
	}
	lex.Prepared = preparedForm(typ, p.Name, words)
	d := s.decide(lex, sql)
	s.decided(&d, s.clock().Sub(start))
	var ft fenceText
	if s.fence.on && d.Action != Refuse {
		if err := s.fenceDecide(typ, &d, &ft, sql, lex, words); err != nil {
			return err
		}
	}
	if typ == 'Q' && d.Action == Rewrite && d.Preparable && s.ps != nil && s.srv.opts.AutoPrepare > 0 && !words.any {
		if done, err := s.autoPrepare(lex, sql, &d); done || err != nil {
			return err
		}
	}
	if s.ps != nil {
		if err := s.trackPrepared(typ, &p, sql, gen, &d, lex.Prepared, words, &ft); err != nil {
			return err
		}
	} else if d.Lock != nil && d.Action != Refuse && typ == 'Q' && len(d.Lock.Calls) > 0 && (s.lockNamed || d.Lock.Required) {
		// The registration's results could not be told apart.
		d = rules.Decision{Action: Refuse, Err: refusePrepared("lock fencing needs a policy that tracks prepared statements", "")}
	}
	if !s.track(typ) {
		return errSessionDone
	}

	var out string
	switch d.Action {
	case Forward:
		if err := writeRaw(s.uw, typ, body); err != nil {
			return upstreamErr(err)
		}
		return nil
	case Rewrite:
		out = d.SQL
		s.mu.Lock()
		s.state.rewrote = true
		s.mu.Unlock()
		if ce := s.logger().Check(zap.DebugLevel, "statement rewritten"); ce != nil {
			ce.Write(zap.String("sql", d.SQL), zap.Strings("tables", d.Tables))
		}
	case Refuse:
		if d.Err == nil {
			d.Err = &rules.Error{Code: "XX000", Message: "fenceproxy: statement refused"}
		}
		out = s.refusalSQL(d.Err)
		s.logger().Info("statement refused", zap.String("sqlstate", d.Err.Code), zap.String("reason", d.Err.Message))
	default:
		return fmt.Errorf("proxy: unknown policy action %d", d.Action)
	}
	var msg encoder
	if typ == 'Q' {
		msg = &pgproto3.Query{String: out}
	} else {
		oids := p.ParameterOIDs
		if d.Action == Refuse {
			oids = nil
		}
		msg = &pgproto3.Parse{Name: p.Name, Query: out, ParameterOIDs: oids}
	}
	if err := writeMsg(s.uw, msg); err != nil {
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
func (s *session) decide(lex Lexing, sql string) rules.Decision {
	if s.loop != nil && s.loop.inTask() {
		if d, ok := s.quickDecide(lex, sql); ok {
			return d
		}
	}
	var d rules.Decision
	s.offLoop(func() { d = s.policyDecide(lex, sql) })
	return d
}

// offLoop runs f, which may block or take long (a parse, a wait for the
// database, a round trip of its own) and must not panic, in a goroutine of
// its own while the session's task parks, when the session is on a loop
// (the caller is its task); otherwise here. At most cap(Server.offLoop)
// such goroutines run f at once: after a reload every session's next
// statement may be first-seen, and each parse holds an OS thread.
func (s *session) offLoop(f func()) {
	if s.loop == nil || !s.loop.inTask() {
		f()
		return
	}
	s.loop.await(func() {
		s.srv.offLoopWaiting.Add(1)
		s.srv.offLoop <- struct{}{}
		s.srv.offLoopWaiting.Add(-1)
		defer func() { <-s.srv.offLoop }()
		f()
	})
}

// quickDecide asks the policy for a quick decision, refusing the
// statement if it panics.
func (s *session) quickDecide(lex Lexing, sql string) (d rules.Decision, ok bool) {
	defer func() {
		if r := recover(); r != nil {
			d, ok = s.policyPanicked(r), true
		}
	}()
	return s.srv.opts.Policy.DecideQuick(&s.info, lex, sql)
}

// policyDecide asks the policy, refusing the statement if it panics.
func (s *session) policyDecide(lex Lexing, sql string) (d rules.Decision) {
	defer func() {
		if r := recover(); r != nil {
			d = s.policyPanicked(r)
		}
	}()
	return s.srv.opts.Policy.Decide(&s.info, lex, sql)
}

// policyPanicked logs a panic of the policy and returns the refusal of the
// statement it was deciding.
func (s *session) policyPanicked(r any) rules.Decision {
	s.logPolicyPanic("policy panicked; statement refused", r)
	return internalRefusal()
}

// logPolicyPanic logs r, recovered from the policy, with the stack.
func (s *session) logPolicyPanic(msg string, r any) {
	s.logger().Error(msg, zap.Any("panic", r), zap.Stack("stack"))
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
func (s *session) lexingFor(sql string) (Lexing, error) {
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
		if !s.srv.opts.Policy.MayTouch(&s.info, sql) {
			sensitive = false
		}
	}
	s.mu.Lock()
	if !sensitive || (s.state.inFlight == 0 && !s.state.unsynced) {
		lex := s.lex
		lex.Backslash, lex.NonASCII = text.Backslash, text.NonASCII
		// After the bookkeeping lost track once, fail closed for good.
		lex.Uncertain = sensitive && s.state.desync
		s.mu.Unlock()
		return lex, nil
	}
	s.mu.Unlock()
	if err := s.uw.Flush(); err != nil {
		return Lexing{}, upstreamErr(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	// Bounded: the bookkeeping can overcount (a Query discarded by a
	// server skipping to Sync), and the server may be waiting for the
	// client (copy-in); never block reading the client forever.
	s.waitLocked(func() bool { return s.state.inFlight > 0 && !s.state.copyIn })
	if s.state.finishing {
		return Lexing{}, errSessionDone
	}
	lex := s.lex
	lex.Backslash, lex.NonASCII = text.Backslash, text.NonASCII
	lex.Uncertain = s.state.unsynced || s.state.inFlight > 0 || s.state.copyIn || s.state.desync
	return lex, nil
}

// lexWaitTimeout bounds how long the relay waits for earlier statements
// (lexingFor, waitEarlier).
var lexWaitTimeout = 5 * time.Second

// waitLocked waits, with s.mu held, while pending reports true and the
// session is not finishing, for at most lexWaitTimeout. The upstream-to-
// client goroutine broadcasts idleCond when responses arrive.
func (s *session) waitLocked(pending func() bool) {
	if s.loop != nil {
		s.waitOnLoop(pending)
		return
	}
	syncx.WaitUntil(s.idleCond, lexWaitTimeout, func() bool { return !pending() || s.state.finishing })
}

// waitOnLoop is waitLocked for a session on a loop: the task parks (s.mu
// released) and the other direction's task wakes it (wakeIdleLocked).
func (s *session) waitOnLoop(pending func() bool) {
	l := s.loop
	me := l.current()
	timedOut := false // the loop thread's
	t := time.AfterFunc(lexWaitTimeout, func() {
		l.post(func() {
			timedOut = true
			l.makeReady(me)
		})
	})
	defer t.Stop()
	for pending() && !s.state.finishing && !timedOut {
		s.idleWaiter = me
		s.mu.Unlock()
		me.park()
		s.mu.Lock()
		s.idleWaiter = nil
	}
}
