package proxy

import (
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// The token as a parameter (docs/rewrite.md, "The token as a parameter").
//
// A Parse of a rewritten statement that changes no fence setting is sent in
// its parameter form (rules.TokenForm.ParamText): the token form, with the
// token a parameter $k after the client's own. At each Bind the relay
// appends the session's token, the value it applies before the Bind, as
// that parameter, and it strips $k from the ParameterDescription of a
// Describe of the statement, so that the client sees the parameters it
// declared. The server analyses the statement once and executes it with
// what each Bind supplies: nothing of one token stays in it, and stored
// code that runs it by name must supply a token itself, as it could set
// one.
//
// The portal of such a Bind holds the token it was bound with, which the
// session may change before the portal runs (a SET, a set_config, a
// rollback to a savepoint), and SQL or stored code can run a portal by
// name (FETCH, a refcursor) where no Execute shows it. So the portal must
// run at once: the proxy closes it before any client message other than
// its Execute, a Describe or a Flush (closeLive). The first Execute of a
// write runs all of it (PostgreSQL keeps what it returns for later
// Executes), so from then on nothing can run it with another token.
//
// Where the form cannot be used at a Bind (the session's token is not a
// valid one, or its values cannot be read), the statement is prepared again
// in the form that reads the setting, before the Bind, and stays in it.

// paramDecision decides sql, the text of a Parse declaring declared
// parameter types, for its parameter form: the decision with the form's
// text, and k, the token's parameter number; false when it has none.
func (t *tracker) paramDecision(lex Lexing, sql string, declared int) (rules.Decision, int, bool) {
	lex.TokenParam = true
	d := t.decide(lex, sql)
	if d.Action != Rewrite || d.Tok == nil {
		return rules.Decision{}, 0, false
	}
	text, k, ok := d.Tok.ParamText(declared)
	if !ok {
		return rules.Decision{}, 0, false
	}
	d.SQL, d.Tok = text, nil
	return d, k, true
}

// parseOIDs returns the parameter types a Parse of def declares: the
// client's, and for the parameter form, unspecified ones up to the
// statement's own count and bigint for the token.
func (def *stmtDef) parseOIDs() []uint32 {
	if def.param == 0 {
		return def.oids
	}
	return tokenOIDs(def.oids, def.param)
}

// tokenOIDs pads oids with unspecified types to k-1 and adds bigint.
func tokenOIDs(oids []uint32, k int) []uint32 {
	out := make([]uint32, k)
	copy(out, oids)
	out[k-1] = 20 // int8
	return out
}

// bindShape reads a Bind's parameter format codes and values: the offset
// of the format-code count, the number of format codes, the number of
// values and the offset just past them (where the result formats begin).
func bindShape(body []byte) (fmtAt, nFmt, nParams, valuesEnd int, ok bool) {
	_, rest, ok1 := cstringView(body)
	_, rest, ok2 := cstringView(rest)
	if !ok1 || !ok2 || len(rest) < 2 {
		return 0, 0, 0, 0, false
	}
	fmtAt = len(body) - len(rest)
	nFmt = int(binary.BigEndian.Uint16(rest))
	at := fmtAt + 2 + 2*nFmt
	if len(body) < at+2 {
		return 0, 0, 0, 0, false
	}
	nParams = int(binary.BigEndian.Uint16(body[at:]))
	at += 2
	for range nParams {
		if len(body) < at+4 {
			return 0, 0, 0, 0, false
		}
		n := int32(binary.BigEndian.Uint32(body[at:]))
		at += 4
		if n > 0 {
			if len(body)-at < int(n) {
				return 0, 0, 0, 0, false
			}
			at += int(n)
		}
	}
	return fmtAt, nFmt, nParams, at, true
}

// withTokenParam returns the Bind body with tok, a canonical token,
// appended as its last parameter, in buf's array when it is large enough:
// in text format, or in binary where one format code makes every
// parameter binary.
func withTokenParam(buf, body []byte, tok string) ([]byte, bool) {
	fmtAt, nFmt, nParams, valuesEnd, ok := bindShape(body)
	if !ok || nParams >= rules.MaxParams || nFmt != 0 && nFmt != 1 && nFmt != nParams {
		return nil, false
	}
	binaryAll, spread := false, false
	if nFmt == 1 {
		// One code for every parameter, the token's too, unless it is
		// one PostgreSQL rejects: then it is given to each of the
		// client's parameters, for the server's own error, and the
		// token is text.
		switch binary.BigEndian.Uint16(body[fmtAt+2:]) {
		case 0:
		case 1:
			binaryAll = true
		default:
			spread = true
		}
	}
	out := buf[:0]
	fmtEnd := fmtAt + 2 + 2*nFmt
	switch {
	case spread:
		out = append(out, body[:fmtAt]...)
		out = binary.BigEndian.AppendUint16(out, uint16(nParams+1))
		for range nParams {
			out = append(out, body[fmtAt+2:fmtEnd]...)
		}
		out = binary.BigEndian.AppendUint16(out, 0)
	case nFmt > 1:
		// One code per parameter: one more, text.
		out = append(out, body[:fmtAt]...)
		out = binary.BigEndian.AppendUint16(out, uint16(nFmt+1))
		out = append(out, body[fmtAt+2:fmtEnd]...)
		out = binary.BigEndian.AppendUint16(out, 0)
	default:
		out = append(out, body[:fmtEnd]...)
	}
	out = binary.BigEndian.AppendUint16(out, uint16(nParams+1))
	out = append(out, body[fmtEnd+2:valuesEnd]...)
	if binaryAll {
		v, err := strconv.ParseInt(tok, 10, 64)
		if err != nil {
			return nil, false
		}
		out = binary.BigEndian.AppendUint32(out, 8)
		out = binary.BigEndian.AppendUint64(out, uint64(v))
	} else {
		out = binary.BigEndian.AppendUint32(out, uint32(len(tok)))
		out = append(out, tok...)
	}
	out = append(out, body[valuesEnd:]...)
	return out, true
}

// bindCountError is PostgreSQL's error for a Bind with the wrong number of
// parameters, counting the client's parameters only.
func bindCountError(got, want int, stmt string) *rules.Error {
	return &rules.Error{Code: "08P01",
		Message: fmt.Sprintf("bind message supplies %d parameters, but prepared statement \"%s\" requires %d", got, stmt, want)}
}

// tokenBind is what a Bind of a statement in the parameter form needs:
// the token to append, or a refusal, or the statement prepared again in
// the form that reads the setting (then def is that definition). Callers
// have waited for the record (fenceReady).
func (r *requests) tokenBind(stmt string, def *stmtDef, body []byte) (tok string, refuse *rules.Error, nd *stmtDef, err error) {
	// (A Bind whose values cannot be read gets the setting's form.)
	if body != nil {
		// PostgreSQL's checks of the counts, in its order.
		if _, nFmt, n, _, ok := bindShape(body); ok && nFmt > 1 && nFmt != n {
			return "", &rules.Error{Code: "08P01", Message: fmt.Sprintf("bind message has %d parameter formats but %d parameters", nFmt, n)}, nil, nil
		} else if ok && n != def.param-1 {
			return "", bindCountError(n, def.param-1, stmt), nil, nil
		}
	}
	r.mu.Lock()
	tok, valid := rules.CanonicalToken(r.fence.cur.token)
	r.mu.Unlock()
	if valid && body != nil {
		if _, _, n, _, ok := bindShape(body); ok && n < rules.MaxParams {
			return tok, nil, nil, nil
		}
	}
	nd, refuse, err = r.settingForm(stmt, def)
	return "", refuse, nd, err
}

// settingForm prepares def, a statement in the parameter form, again
// under its name stmt in the form that reads the setting, before the
// message about to be relayed, and returns that definition (or a refusal
// when it cannot).
func (r *requests) settingForm(stmt string, def *stmtDef) (*stmtDef, *rules.Error, error) {
	if !def.kept {
		return nil, refusePrepared(fmt.Sprintf("prepared statement %q cannot run without a valid fencing token in the form it was prepared in", stmt), hintPrepareAgain), nil
	}
	lex, err := r.lexingFor(def.sql)
	if err != nil {
		return nil, nil, err
	}
	lex.Prepared = def.preparedForm
	gen := r.ps.generation()
	d := r.decide(lex, def.sql)
	if d.Action == Refuse {
		return nil, d.Err, nil
	}
	out := def.sql
	if d.Action == Rewrite {
		out = d.SQL
	}
	nd := &stmtDef{sql: def.sql, kept: true, sent: decisionHash(&d, def.sql), gen: gen, oids: def.oids, ops: def.ops, preparedForm: def.preparedForm,
		mayEnd: def.mayEnd, lock: d.Lock, plain: plainDecision(&d), forward: d.Action == Forward, fence: def.fence}
	if err := r.reprepare(stmt, stmtVerdict{reprepare: nd, newSQL: out, def: nd, why: "in the form that reads the fencing token"}); err != nil {
		return nil, nil, err
	}
	return nd, nil, nil
}

// expectDescription registers a Describe of a statement in the parameter
// form, about to be sent. Callers hold s.mu.
func (ps *preparedState) expectDescription() {
	ps.push(pendingResp{seg: ps.sentSeg, idx: ps.sentIdx, trim: true})
}

// trimsDescription reports whether the ParameterDescription arriving now
// answers a Describe of expectDescription. Callers hold s.mu.
func (ps *preparedState) trimsDescription() bool {
	if ps.failed {
		return false
	}
	for _, h := range ps.fifo {
		if h.seg != ps.recvSeg {
			return false
		}
		if h.query {
			continue
		}
		if h.idx == ps.recvExt && h.trim {
			return true
		}
		if h.idx > ps.recvExt {
			return false
		}
	}
	return false
}

// trimDescription drops the last parameter type of a ParameterDescription
// body, the token's bigint; false if the body does not end with one.
func trimDescription(body []byte) ([]byte, bool) {
	if len(body) < 2 {
		return nil, false
	}
	n := int(binary.BigEndian.Uint16(body))
	if n == 0 || len(body) != 2+4*n || binary.BigEndian.Uint32(body[len(body)-4:]) != 20 {
		return nil, false
	}
	binary.BigEndian.PutUint16(body, uint16(n-1))
	return body[:len(body)-4], true
}

// closeLive closes the live portal (requests.live) before the message
// about to be relayed: a Close the client does not see the answer to.
func (r *requests) closeLive() error {
	name := r.live
	r.closed, r.closedSet, r.closedBind, r.closedStmt, r.closedDef, r.closedGen = name, true, append(r.closedBind[:0], r.liveBind...), r.liveStmt, r.liveDef, r.liveGen
	if r.liveBind == nil {
		r.closedBind = nil
	}
	r.live, r.liveSet, r.liveDef = "", false, nil
	r.mu.Lock()
	if r.state.finishing {
		r.mu.Unlock()
		return errSessionDone
	}
	r.fence.portal = portalLife{watch: true, depth: r.liveDepth, earlier: r.state.inFlight}
	key := serverKey(name)
	var id uint64
	if pe := r.ps.portals[key]; pe != nil {
		id = pe.id
	}
	r.ps.expect('3', func(o outcome) {
		if pe := r.ps.portals[key]; o == outcomeOK && pe != nil && pe.id == id {
			delete(r.ps.portals, key)
		}
	})
	r.ps.countSent('C')
	r.mu.Unlock()
	return upstreamErr(writeMsg(r.uw, &pgproto3.Close{ObjectType: 'P', Name: name}))
}

// maxKeptBind bounds the Bind kept to bind a closed portal again.
const maxKeptBind = 64 << 10

// keepLive records the Bind of portal, of stmt, just checked with the
// token added: the live portal (bindHead closed any other).
func (r *requests) keepLive(portal, stmt string, body []byte) {
	// The names may point into the read buffer: kept as copies, the last
	// ones again where they are the same (a client binds the same
	// statement over and over).
	if r.live != portal {
		r.live = strings.Clone(portal)
	}
	if r.liveStmt != stmt {
		r.liveStmt = strings.Clone(stmt)
	}
	r.liveSet = true
	r.mu.Lock()
	r.liveDepth = len(r.fence.saves) // the record is resolved (fenceReady)
	r.mu.Unlock()
	// Its own array, reused: closeLive copies it (closedBind).
	if len(body) <= maxKeptBind {
		r.liveBind = append(r.liveBind[:0], body...)
	} else {
		r.liveBind = nil
	}
}

// rebindClosed binds the portal closeLive closed again, before its
// Execute: with the session's token and settings now, as its statement
// would read them if it had stayed open, and through the same checks as
// the client's Bind. The client does not see its BindComplete. It is
// refused when the Bind was not kept or the statement's name was defined
// again since. When the server would no longer have the portal (its
// transaction ended, a rollback to a savepoint undid its Bind, a Query
// replaced the unnamed one), the Execute goes as sent, for the server's
// own answer.
func (r *requests) rebindClosed() error {
	portal, body, stmt, def := r.closed, r.closedBind, r.closedStmt, r.closedDef
	// body is this call's now: closing another live portal (bindHead)
	// keeps that one's Bind in a new array.
	r.closedSet, r.closedBind = false, nil
	if err := r.fenceWait(); err != nil {
		return err
	}
	// Whether the server still has the portal is known once the segments
	// before this one are answered: a ReadyForQuery outside a transaction
	// block ends it.
	r.mu.Lock()
	earlier := r.ps.recvSeg < r.ps.sentSeg
	r.mu.Unlock()
	if earlier {
		if err := r.uw.Flush(); err != nil {
			return upstreamErr(err)
		}
		r.mu.Lock()
		r.waitLocked(func() bool { return r.ps.recvSeg < r.ps.sentSeg && !r.ps.lost })
		finishing, unknown := r.state.finishing, r.ps.recvSeg < r.ps.sentSeg || r.ps.lost
		r.mu.Unlock()
		if finishing {
			return errSessionDone
		}
		if unknown {
			return r.sendRefusedInstead(errPortalClosed(portal))
		}
	}
	r.mu.Lock()
	life, broken := r.fence.portal, r.fence.broken
	r.fence.portal = portalLife{}
	same := false
	if e := r.ps.stmts[serverKey(stmt)]; e != nil {
		same = e.assumed() == def
	}
	r.mu.Unlock()
	if life.dead && !broken {
		return nil
	}
	if body == nil || !same || broken {
		return r.sendRefusedInstead(errPortalClosed(portal))
	}
	if r.ps.generation() != r.closedGen {
		// Bound under rules since reloaded: it runs only if the rules in
		// force decide its statement alike, as an open portal would.
		if same, _, _, err := r.redecide(def); err != nil || !same {
			if err != nil {
				return err
			}
			return r.sendRefusedInstead(refusePrepared(fmt.Sprintf("portal %q was bound under fencing rules or catalog paths that have since changed, and the rules in force treat its statement differently; it was not executed", portal),
				"Bind the statement again (the proxy prepares it again under the rules in force)."))
		}
	}
	send, tok, err := r.bindHead(portal, stmt, body)
	if err != nil || !send {
		return err
	}
	if tok != "" {
		out, ok := withTokenParam(r.bindBuf, body, tok)
		if !ok {
			return fmt.Errorf("proxy: a Bind checked for the token's parameter could not take it")
		}
		if cap(out) <= maxReusedBind {
			r.bindBuf = out[:0]
		}
		r.keepLive(portal, stmt, body)
		body = out
	}
	r.mu.Lock()
	r.ps.expect('2', nil)
	r.mu.Unlock()
	return r.forwardTracked('B', body)
}

// errPortalClosed is the refusal of an Execute of a portal closeLive
// closed that cannot be bound again.
func errPortalClosed(portal string) *rules.Error {
	return refusePrepared(fmt.Sprintf("portal %q was closed: a portal of a write on a protected table runs with the fencing token of its Bind, so the proxy closes it when something runs before its Execute, and could not bind it again", portal),
		"Send its Execute right after its Bind (a Describe or Flush may come between), or bind it again.")
}
