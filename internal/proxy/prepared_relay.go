package proxy

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"unsafe"

	"github.com/fenceproxy/fenceproxy/internal/rules"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
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
	if s.ps.skippedBoundary && !mismatch {
		s.ps.skippedBoundary = false
		s.losePreparedTrack()
	}
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
func refusePrepared(msg, hint string) *rules.Error {
	return &rules.Error{Code: rules.CodeRefused, Message: "fenceproxy: " + msg, Hint: hint}
}

// sendRefusedInstead sends, in place of a client's Bind, Describe or
// Execute, a Parse that fails with e: the client gets e where it expects
// the message's response, and the server skips to the next Sync.
func (r *requests) sendRefusedInstead(e *rules.Error) error {
	r.logger().Info("statement refused", zap.String("sqlstate", e.Code), zap.String("reason", e.Message))
	sql := r.refusalSQL(e)
	if !r.track('P') {
		return errSessionDone
	}
	return upstreamErr(writeMsg(r.uw, &pgproto3.Parse{Name: r.ps.refusedName, Query: sql}))
}

// redecide decides a statement's text again under the rules in force and
// reports whether it would send the same as def, with the decision taken
// and the token's parameter in its text (0: none, tokenparam.go).
func (r *requests) redecide(def *stmtDef) (same bool, d rules.Decision, param int, err error) {
	lexing := r.lexingFor
	if def.sqlLevel {
		lexing = r.lexingNoWait // as in sqlOpDefs
	}
	lex, err := lexing(def.sql)
	if err != nil {
		return false, d, 0, err
	}
	lex.Prepared = def.preparedForm
	start := r.clock()
	d = r.decide(lex, def.sql)
	r.decided(&d, r.clock().Sub(start))
	if def.param > 0 && d.Action == Rewrite {
		// Compared in the form it was sent in; prepared again, it goes
		// in the parameter form if it still has one.
		if pd, k, ok := r.paramDecision(lex, def.sql, len(def.oids)); ok {
			return k == def.param && decisionHash(&pd, def.sql) == def.sent, pd, k, nil
		}
	}
	return decisionHash(&d, def.sql) == def.sent, d, 0, nil
}

// waitEarlier waits until no change to e sent in an earlier segment is
// unanswered, so that e.assumed() is what the server has. It reports false
// if it cannot tell (timeout, lost bookkeeping).
func (r *requests) waitEarlier(e *stmtEntry) (bool, error) {
	r.mu.Lock()
	earlier := len(e.pending) > 0 && e.pending[0].seg < r.ps.sentSeg
	lost := r.ps.lost
	r.mu.Unlock()
	if lost {
		return false, nil
	}
	if !earlier {
		return true, nil
	}
	if err := r.uw.Flush(); err != nil {
		return false, upstreamErr(err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.waitLocked(func() bool { return len(e.pending) > 0 && e.pending[0].seg < r.ps.sentSeg && !r.ps.lost })
	if r.state.finishing {
		return false, errSessionDone
	}
	return !r.ps.lost && !(len(e.pending) > 0 && e.pending[0].seg < r.ps.sentSeg), nil
}

const hintPrepareAgain = "Prepare the statement again (DEALLOCATE it, then PREPARE it), or reconnect."

// stmtVerdict is what to do with a message that runs a prepared statement.
type stmtVerdict struct {
	refuse    *rules.Error
	reprepare *stmtDef // prepare this definition again before the message
	newSQL    string
	def       *stmtDef // the definition the message runs (nil: none known)
	// why the statement is prepared again, for the log ("" : the rules
	// were reloaded).
	why string
}

// checkStatement decides whether a message running the prepared statement
// name (Bind, Describe; SQL EXECUTE when sqlExec) may go ahead under the
// rules of generation gen.
func (r *requests) checkStatement(name string, gen uint64, sqlExec bool) (stmtVerdict, error) {
	key := serverKey(name)
	r.mu.Lock()
	e := r.ps.stmts[key]
	if e == nil {
		r.mu.Unlock()
		// PostgreSQL's own answer for a name it does not have (drivers
		// prepare again on 26000). One the server may have without the
		// proxy knowing (prepared in a function) gets it too: the proxy
		// cannot tell what rules it was decided under.
		return stmtVerdict{refuse: &rules.Error{Code: "26000",
			Message: fmt.Sprintf("prepared statement \"%s\" does not exist", name),
			Hint:    "fenceproxy: prepare statements through the proxy (PREPARE or a Parse message), not in functions."}}, nil
	}
	// A change to the name in an earlier segment may have failed (a Parse
	// of a name in use, a PREPARE after an error in its Query): the
	// definition the message meets is known once it is answered.
	undecided := len(e.pending) > 0 && e.pending[len(e.pending)-1].seg < r.ps.sentSeg
	if g, ok := e.minGen(); !undecided && (!ok || g == gen) {
		def := e.assumed()
		r.mu.Unlock()
		return stmtVerdict{def: def}, nil
	}
	r.mu.Unlock()

	ok, err := r.waitEarlier(e)
	if err != nil {
		return stmtVerdict{}, err
	}
	if !ok && undecided {
		return stmtVerdict{refuse: refusePrepared(fmt.Sprintf("fenceproxy cannot tell which definition of prepared statement %q the server has", name), hintPrepareAgain)}, nil
	}
	stale := refusePrepared(fmt.Sprintf("prepared statement %q was prepared under fencing rules or catalog paths that have since changed, and fenceproxy cannot check it against the rules in force", name), hintPrepareAgain)
	if !ok {
		return stmtVerdict{refuse: stale}, nil
	}
	r.mu.Lock()
	if r.ps.stmts[key] != e {
		// Every change failed and the entry went: the name is not defined.
		r.mu.Unlock()
		return r.checkStatement(name, gen, sqlExec)
	}
	def := e.assumed()
	r.mu.Unlock()
	if def == nil || def.gen == gen {
		return stmtVerdict{def: def}, nil
	}
	if !def.kept {
		return stmtVerdict{refuse: stale}, nil
	}
	same, d, param, err := r.redecide(def)
	if err != nil {
		return stmtVerdict{}, err
	}
	if same {
		return stmtVerdict{def: r.refreshDef(e, def, gen, d.Lock)}, nil
	}
	if d.Action == Refuse && !def.sqlLevel {
		return stmtVerdict{refuse: d.Err}, nil
	}
	if def.sqlLevel || sqlExec {
		return stmtVerdict{refuse: refusePrepared(fmt.Sprintf("prepared statement %q was prepared under fencing rules or catalog paths that have since changed, and the rules in force treat it differently; it was not executed", name), hintPrepareAgain)}, nil
	}
	out := def.sql
	if d.Action == Rewrite {
		out = d.SQL
	}
	// Everything the new decision says: its lock registration (or a
	// re-prepared statement would run without it), whether it is plain.
	nd := &stmtDef{sql: def.sql, kept: true, sent: decisionHash(&d, def.sql), gen: gen, oids: def.oids, ops: def.ops, preparedForm: def.preparedForm,
		mayEnd: def.mayEnd, lock: d.Lock, plain: plainDecision(&d), forward: d.Action == Forward, fence: def.fence, param: param,
		settingFree: param > 0 && !r.paramReads(def.sql, out)}
	return stmtVerdict{reprepare: nd, newSQL: out, def: nd}, nil
}

// refreshDef records that def, the definition the server has under e, is
// still right under generation gen, where its decision's lock
// registration is lock (the same statements: how the relay may send them,
// rules.LockCall.Enter, may differ). It returns the definition to use.
func (t *tracker) refreshDef(e *stmtEntry, def *stmtDef, gen uint64, lock *rules.LockCall) *stmtDef {
	t.mu.Lock()
	defer t.mu.Unlock()
	nd := *def
	nd.gen = gen
	nd.lock = lock
	if len(e.pending) == 0 && e.confirmed == def {
		e.confirmed = &nd
	}
	return &nd
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
