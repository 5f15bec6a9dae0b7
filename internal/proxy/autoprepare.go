package proxy

import (
	"strconv"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/rules"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
)

// Prepared statements of the proxy's own for repeated simple Queries.
//
// PostgreSQL analyses and plans a simple Query's text every time it
// receives it, a named prepared statement's once. A fenced write costs the
// server more to analyse than the client's statement would (the fence is
// an expression of its own), and less to execute in the form the policy
// writes for named statements (Lexing.Prepared). So, when the operator
// turns it on (Options.AutoPrepare: it is opt-in, because a prepared
// statement keeps what PostgreSQL fixed when it analysed it, and some of
// that, such as settings the server does not report, the proxy cannot
// see), a session that sends the same rewritten text again gets, in place
// of its Query:
//
//	Close and Parse of its own statement   (at every use: see below)
//	the lock registration                  (session.register, when the text needs one)
//	Bind of the unnamed portal, Execute, Sync
//
// The responses to Close, Parse and Bind are not relayed; the client gets
// the Execute's CommandComplete or the first error, then ReadyForQuery:
// what the Query would have answered. Only texts the policy marks
// Preparable qualify (one INSERT, UPDATE, DELETE or MERGE without RETURNING,
// parameters or constants read at analysis from the clock or the
// catalogs), and only while nothing is unanswered: no earlier statement
// can then change a reported setting behind the proxy's back
// (forgetOnSetting), and the Sync ends no client's messages.
//
// A session keeps at most maxAutoStatements texts (the least recently sent
// goes first), each under the name of a slot; a slot's statement is closed
// before the slot is prepared again. Which text the server has under a
// slot is known from the ParseComplete of its latest Parse; a DEALLOCATE
// ALL or DISCARD ALL, any statement operation of the client's on a slot's
// name, or a reported change of a setting forgets them all, and the next
// sighting prepares its text again. After a reload, or when the
// database's objects change, the text is decided again at every sighting
// as any Query is: a different decision prepares the slot again.

const (
	// maxAutoStatements bounds the texts (and server statements) a session
	// keeps; maxAutoTextBytes the length of one.
	maxAutoStatements = 32
	maxAutoTextBytes  = 4096
	maxAutoSentBytes  = 4 * maxAutoTextBytes
)

// autoStmt is one text a session sent, and the slot it has.
type autoStmt struct {
	text string // the client's text
	name string // the slot's statement name
	seen int    // sightings
	used uint64 // autoClock at the last sighting
	// prepared is the statement text the server is known to have under
	// name ("": none, or not known yet).
	prepared string
	// parses counts the Parses sent for the entry: only the last one's
	// ParseComplete says what the server has.
	parses uint64
}

// autoState is the session's own prepared statements; guarded by
// session.mu (in preparedState).
type autoState struct {
	byText map[string]*autoStmt
	slots  []*autoStmt
	clock  uint64
	// epoch changes whenever the server may have lost the statements: a
	// ParseComplete for a Parse sent before then proves nothing.
	epoch  uint64
	prefix string
}

// sighting records one more sighting of sql and returns its entry,
// evicting the least recently sent text when every slot is taken.
func (a *autoState) sighting(sql string) *autoStmt {
	a.clock++
	if e := a.byText[sql]; e != nil {
		e.seen++
		e.used = a.clock
		return e
	}
	if a.byText == nil {
		a.byText = make(map[string]*autoStmt, maxAutoStatements)
	}
	slot := len(a.slots)
	if slot < maxAutoStatements {
		a.slots = append(a.slots, nil)
	} else {
		slot = 0
		for i, e := range a.slots {
			if e.used < a.slots[slot].used {
				slot = i
			}
		}
		delete(a.byText, a.slots[slot].text)
	}
	// The slot's old statement, if any, stays on the server until the slot
	// is prepared again: prepared is "", so a Close goes first.
	e := &autoStmt{text: strings.Clone(sql), name: a.prefix + strconv.Itoa(slot), seen: 1, used: a.clock}
	a.slots[slot] = e
	a.byText[e.text] = e
	return e
}

// forget records that the server may no longer have any of the session's
// own statements.
func (a *autoState) forget() {
	a.epoch++
	for _, e := range a.slots {
		e.prepared = ""
	}
}

// forgetOnSetting is called, with s.mu held, when the server reports a
// setting that changes how it reads a statement's text or its constants
// ('2024-01-01 10:00' as a timestamptz, under TimeZone and DateStyle): a
// statement it analysed before may mean something else now, so each text
// is prepared again (a simple Query is analysed under the settings in
// force). ParameterStatus precedes the ReadyForQuery of the statement that
// changed the setting, and the proxy runs its statements only when
// nothing is unanswered.
func (t *tracker) forgetOnSetting() {
	if t.ps != nil {
		t.ps.auto.forget() // the registration's CALL has no such constants
	}
}

// touches reports whether a client's statement operation on name concerns
// a slot (the names are the proxy's, but a client may learn them from
// pg_prepared_statements).
func (a *autoState) touches(name string) bool {
	return strings.HasPrefix(serverKey(name), a.prefix)
}

// autoPrepare runs the Query text sql, decided d (a Preparable Rewrite), as
// the session's own prepared statement once the session has sent it
// often enough. It reports whether it did; if not, the caller sends the
// Query.
func (r *requests) autoPrepare(lex Lexing, sql string, d *rules.Decision) (bool, error) {
	if len(sql) > maxAutoTextBytes || lex.Uncertain {
		return false, nil
	}
	ps := r.ps
	r.mu.Lock()
	// Nothing may be unanswered: an earlier statement may change a setting
	// the server applied when it analysed the statement it has (TimeZone,
	// DateStyle: see forgetOnSetting), and the Sync would end extended-
	// protocol messages of the client's.
	ready := r.state.inFlight == 0 && !r.state.unsynced && !r.state.copyIn && !r.state.desync && !ps.lost && !r.state.finishing
	var e *autoStmt
	if ready {
		e = ps.auto.sighting(sql)
		ready = e.seen >= r.srv.opts.AutoPrepare
	}
	r.mu.Unlock()
	if !ready {
		return false, nil
	}
	plex := lex
	plex.Prepared = true
	pd := r.decide(plex, sql)
	// The registration the Query would have run, the statement runs too.
	needs := func(l *rules.LockCall) bool { return l != nil && len(l.Calls) > 0 && (r.lockNamed || l.Required) }
	if pd.Action != Rewrite || !pd.Preparable || needs(pd.Lock) != needs(d.Lock) || len(pd.SQL) > maxAutoSentBytes {
		return false, nil
	}
	var call string
	if needs(pd.Lock) && !(r.fence.on && r.spare(pd.Lock)) {
		call = pd.Lock.Call
	}

	r.mu.Lock()
	if r.state.finishing {
		r.mu.Unlock()
		return true, errSessionDone
	}
	// What track does for a Query: one more ReadyForQuery to come.
	r.state.inFlight++
	r.state.lastWasQuery = true
	r.state.copyEndSent = false
	r.state.rewrote = true
	// Parsed again at every use, in the same pipeline as its Bind: a
	// function the session ran since could have put a statement of its
	// own under the name (DEALLOCATE and PREPARE in stored code, which
	// the proxy cannot see).
	e.prepared = "" // until its ParseComplete says so
	e.parses++
	epoch, seq, out := ps.auto.epoch, e.parses, pd.SQL
	// Recorded as a removal: a client's own definition under the name
	// (see touches) is gone, and a client Bind or EXECUTE of the name is
	// refused from now on.
	ps.addStmtOp(e.name, nil, false, '3', false, 0)
	ps.countSent('C')
	ps.expect('1', func(o outcome) {
		if o == outcomeOK && ps.auto.epoch == epoch && e.parses == seq {
			e.prepared = out
		}
	})
	ps.countSent('P')
	r.mu.Unlock()
	if err := writeMsg(r.uw, &pgproto3.Close{ObjectType: 'S', Name: e.name}); err != nil {
		return true, upstreamErr(err)
	}
	if err := writeMsg(r.uw, &pgproto3.Parse{Name: e.name, Query: pd.SQL}); err != nil {
		return true, upstreamErr(err)
	}
	if r.fence.on {
		if err := r.sendPrelude(); err != nil {
			return true, err
		}
	}
	if pd.Lock != nil && pd.Lock.Pre != "" {
		if err := r.register(pd.Lock.Pre, nil); err != nil {
			return true, err
		}
	}
	if call != "" {
		if err := r.register(call, pd.Lock); err != nil {
			return true, err
		}
	}
	r.mu.Lock()
	ps.expect('2', func(o outcome) {
		if o == outcomeFailed {
			// The statement is gone (DEALLOCATE in a function, say):
			// prepare it again next time.
			e.prepared = ""
		}
	})
	ps.countSent('B')
	ps.countSent('E')
	ps.countSent('S')
	// The server's unnamed portal is now this one, whatever a client's
	// Bind made of it.
	delete(ps.portals, "")
	r.mu.Unlock()
	if ce := r.logger().Check(zap.DebugLevel, "statement rewritten, run as the session's own prepared statement"); ce != nil {
		ce.Write(zap.String("sql", pd.SQL), zap.String("statement", e.name))
	}
	if err := writeMsg(r.uw, &pgproto3.Bind{PreparedStatement: e.name}); err != nil {
		return true, upstreamErr(err)
	}
	if err := writeMsg(r.uw, &pgproto3.Execute{}); err != nil {
		return true, upstreamErr(err)
	}
	return true, upstreamErr(writeMsg(r.uw, &pgproto3.Sync{}))
}
