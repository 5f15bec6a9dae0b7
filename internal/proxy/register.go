package proxy

// The lock registration before a Bind (docs/design.md, "Lock fencing").

import (
	"strconv"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/jackc/pgx/v5/pgproto3"
)

// bindVerdict is the lock registration a Bind needs.
type bindVerdict struct {
	call   string
	reg    *rules.LockCall // the registration call is from
	refuse *rules.Error
}

// bindLock returns the lock registration to run before a Bind of def:
// its own, or that of the SQL-level statement it EXECUTEs.
func (r *requests) bindLock(def *stmtDef, gen uint64) bindVerdict {
	if def == nil {
		return bindVerdict{}
	}
	if l := def.lock; l != nil && len(l.Calls) > 0 && (r.lockNamed || l.Required) {
		if l.EndsTx {
			r.mu.Lock()
			in := r.state.inBlock()
			r.mu.Unlock()
			if !in {
				return bindVerdict{refuse: errEndsTxOutsideBlock}
			}
		}
		return bindVerdict{call: l.Call, reg: l}
	}
	if len(def.ops) == 0 {
		return bindVerdict{}
	}
	e, l, err := r.checkExecutesLock(def.ops, gen)
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

// errEndsTxOutsideBlock refuses the Bind of a statement that registers a
// lock and may commit from stored code (rules.LockCall.EndsTx) where the
// server would let it: what it runs after its COMMIT would go without
// the registration. Inside a transaction block the server refuses such a
// COMMIT, and a simple Query's registration makes one.
var errEndsTxOutsideBlock = refusePrepared("this CALL or DO reaches a lock-fenced table and may commit or roll back its transaction, which would end its lock registration; it was not run outside a transaction block",
	"Run it inside BEGIN ... COMMIT, where the server refuses a COMMIT in it, or keep transaction control out of code that writes lock-fenced tables.")

// beforeBind sends what goes before a client's Bind, in this order: the
// session's fence settings (prelude), the catalog check (check.Pre) and
// the lock registration (reg.call, "" for none). Where the database has
// rules.EnterProc and it can stand for all of them, one call of it goes
// in their place.
func (r *requests) beforeBind(prelude bool, check *rules.LockCall, reg bindVerdict) error {
	if prelude {
		if args, l, ok := r.enterCall(check, reg); ok {
			return r.sendOwn(r.ps.registerName, enterSQL, enterOIDs, args, l, false)
		}
		if err := r.sendPrelude(); err != nil {
			return err
		}
	}
	if check != nil {
		if err := r.register(check.Pre, nil); err != nil {
			return err
		}
	}
	if reg.call != "" {
		return r.register(reg.call, reg.reg)
	}
	return nil
}

// enterSQL calls rules.EnterProc with the values of the prelude, the
// catalog check and the registration as parameters (enterCall); enterOIDs
// are their types.
const enterSQL = "CALL " + rules.EnterProc + "($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"

var enterOIDs = []uint32{25, 25, 25, 25, 20, 16, 16, 16, 25, 25}

// enterCall returns the parameters of the call of rules.EnterProc that
// stands for the prelude, check (nil: none) and reg (call "": none), and
// the registration whose outcome its response gives (nil: none). ok is
// false where it cannot stand for them: a database without it, a
// registration that is not a single call of the rule set's (the catalog
// check alone is one: Catalog), or fence settings of other names than the
// registration reads.
func (r *requests) enterCall(check *rules.LockCall, reg bindVerdict) (params [][]byte, l *rules.LockCall, ok bool) {
	var stamp *rules.LockCall
	switch {
	case check != nil:
		stamp = check
	case reg.reg != nil && reg.reg.Catalog:
		stamp, reg = reg.reg, bindVerdict{}
	}
	if stamp == nil && reg.call == "" {
		return nil, nil, false // the prelude alone: as it is
	}
	if stamp != nil && !stamp.Enter {
		return nil, nil, false
	}
	r.mu.Lock()
	vals := r.fence.cur
	tok, lk := r.fence.tokenName, r.fence.lockName
	r.mu.Unlock()
	params = make([][]byte, 10)
	params[0], params[1], params[2], params[3] = []byte(tok), []byte(vals.token), []byte(lk), []byte(vals.lock)
	if stamp != nil {
		params[4] = strconv.AppendInt(nil, stamp.Stamp, 10)
	}
	params[5] = []byte("f")
	params[6], params[7], params[8], params[9] = []byte("f"), []byte("f"), []byte{}, []byte{}
	if reg.call != "" {
		a := reg.reg.Args
		if !reg.reg.Enter || a == nil || a.LockSetting != lk || a.TokenSetting != tok {
			return nil, nil, false
		}
		params[5] = []byte("t")
		params[6], params[7] = boolParam(a.Required), boolParam(a.Audit)
		params[8], params[9] = []byte(a.Tag), []byte(a.Tables)
		l = reg.reg
	}
	return params, l, true
}

// boolText is boolParam as a string.
func boolText(b bool) string {
	if b {
		return "t"
	}
	return "f"
}

func boolParam(b bool) []byte {
	if b {
		return []byte("t")
	}
	return []byte("f")
}

// register sends call, the catalog check or the lock registration l
// (sendOwn).
func (r *requests) register(call string, l *rules.LockCall) error {
	return r.sendOwn(r.ps.registerName, call, nil, nil, l, false)
}

// sendOwn sends, before the client's Bind, a statement of the proxy's own
// under name, its prepared statement and portal, whose responses are not
// relayed: Close of both, Parse, Bind with params, Execute, and Close of
// the statement again when closeAfter (no statement of the proxy's stays
// among the session's). It runs in the same transaction as the client's
// statement: nothing in between ends it. If it fails, its error is the
// first the client sees, and the server skips the client's messages up
// to the Sync. l is the lock registration its success proves
// (registeredDone).
func (r *requests) sendOwn(name, sql string, oids []uint32, params [][]byte, l *rules.LockCall, closeAfter bool) error {
	ps := r.ps
	r.mu.Lock()
	if r.state.finishing {
		r.mu.Unlock()
		return errSessionDone
	}
	// Parsed again every time, in the same pipeline as its Bind: nothing
	// the session runs in between (a DEALLOCATE and PREPARE of the name in
	// a function, which the proxy cannot see) can stand in for it.
	// What an earlier one left (a failed one is not closed: the server
	// skipped the rest); closing what does not exist is not an error.
	ps.expect('3', nil)
	ps.countSent('C')
	// Recorded as a removal: a client's own definition under the name (it
	// can read it from pg_prepared_statements) is gone, and a client Bind
	// or EXECUTE of the name is refused from now on.
	ps.addStmtOp(name, nil, false, '3', false, 0)
	ps.countSent('C')
	ps.expect('1', nil)
	ps.countSent('P')
	ps.expect('2', nil)
	ps.countSent('B')
	ps.expect('C', r.registeredDone(l, nil))
	ps.countSent('E')
	if closeAfter {
		ps.addStmtOp(name, nil, false, '3', false, 0)
		ps.countSent('C')
	}
	r.state.rewrote = true
	r.mu.Unlock()
	// Encoded into one reused buffer and written at once.
	buf, err := ownMessages(r.ownBuf[:0], name, sql, oids, params, closeAfter)
	if err != nil {
		return upstreamErr(err)
	}
	if cap(buf) <= maxReusedBind {
		r.ownBuf = buf
	}
	if _, err := r.uw.Write(buf); err != nil {
		return upstreamErr(err)
	}
	return nil
}

// ownMessages appends sendOwn's messages to buf: the closes of what an
// earlier one left, the Parse, the Bind, the Execute, and, if closeAfter,
// the close of the statement.
func ownMessages(buf []byte, name, sql string, oids []uint32, params [][]byte, closeAfter bool) ([]byte, error) {
	var err error
	if buf, err = (&pgproto3.Close{ObjectType: 'P', Name: name}).Encode(buf); err != nil {
		return nil, err
	}
	if buf, err = (&pgproto3.Close{ObjectType: 'S', Name: name}).Encode(buf); err != nil {
		return nil, err
	}
	if buf, err = (&pgproto3.Parse{Name: name, Query: sql, ParameterOIDs: oids}).Encode(buf); err != nil {
		return nil, err
	}
	if buf, err = (&pgproto3.Bind{DestinationPortal: name, PreparedStatement: name, Parameters: params}).Encode(buf); err != nil {
		return nil, err
	}
	if buf, err = (&pgproto3.Execute{Portal: name}).Encode(buf); err != nil {
		return nil, err
	}
	if closeAfter {
		if buf, err = (&pgproto3.Close{ObjectType: 'S', Name: name}).Encode(buf); err != nil {
			return nil, err
		}
	}
	return buf, nil
}

// holdAtSQL calls rules.HoldAtProc with the catalog check's stamp, the
// session's lock and token, and the registration's other arguments as
// parameters (holdAtBind); holdAtOIDs are their types.
const holdAtSQL = "CALL " + rules.HoldAtProc + "($1, $2, $3, $4)"

// reholdAtSQL is holdAtSQL calling rules.ReholdAtProc (holdAtProc).
const reholdAtSQL = "CALL " + rules.ReholdAtProc + "($1, $2, $3, $4)"

var holdAtOIDs = []uint32{20, 25, 25, 25}

// holdAtFits reports whether the registration l, with the catalog check
// in front (l.Pre), can go as one call of rules.HoldAtProc with the
// session's values, before a Bind (holdAtBind) or in front of a simple
// Query (holdAtQuery), in place of what reads the settings: the database
// has it, l is a single registration of the rule set's procedure reading
// the settings of the record's names, the session names a lock, and the
// settings' names and the audit tag hold no line break (the lines of the
// call's last argument). The caller sees to it that nothing else reads
// the settings before the next Sync (goesBare).
func (r *requests) holdAtFits(l *rules.LockCall) bool {
	if l == nil || !l.HoldAt || l.Catalog || l.Pre == "" || l.Args == nil || len(l.Calls) == 0 || l.Call == "" {
		return false
	}
	a := l.Args
	r.mu.Lock()
	tok, lk, lock := r.fence.tokenName, r.fence.lockName, r.fence.cur.lock
	r.mu.Unlock()
	return lock != "" && a.LockSetting == lk && a.TokenSetting == tok &&
		strings.IndexByte(a.TokenSetting, '\n') < 0 && strings.IndexByte(a.LockSetting, '\n') < 0 && strings.IndexByte(a.Tag, '\n') < 0
}

// holdAtProc is the procedure that registers l with the session's values
// cur: rules.ReholdAtProc, which takes the lock shared before it reads the
// watermark, once, where the database has it and a registration of the
// same values committed in this session before (fenceRecord.held: the
// watermark is then at least the token, so the registration never needs
// the lock exclusively); rules.HoldAtProc otherwise.
func (r *requests) holdAtProc(l *rules.LockCall, cur fenceValues) string {
	if !l.ReholdAt || cur.lock == "" || l.Args.Audit {
		// Audit: a stale registration is reported, not refused, and
		// hold_at's takes no lock for it.
		return rules.HoldAtProc
	}
	r.mu.Lock()
	held := r.fence.held
	r.mu.Unlock()
	if held == cur {
		return rules.ReholdAtProc
	}
	return rules.HoldAtProc
}

// holdAtRest is the last argument of rules.HoldAtProc: register's other
// arguments (holdAtRestParts), one per line (holdAtFits saw that none but
// the last may hold a line break).
func holdAtRest(a *rules.RegArgs) string {
	p := holdAtRestParts(a)
	return strings.Join(p[:], "\n")
}

// holdAtRestParts are the lines of holdAtRest: the token setting's name,
// the lock setting's name, required and audit ('t' or 'f'), the audit tag
// and the table list.
func holdAtRestParts(a *rules.RegArgs) [6]string {
	return [...]string{a.TokenSetting, a.LockSetting, boolText(a.Required), boolText(a.Audit), a.Tag, a.Tables}
}

// appendHoldAtRest appends holdAtRest(a) to b.
func appendHoldAtRest(b []byte, a *rules.RegArgs) []byte {
	for i, p := range holdAtRestParts(a) {
		if i > 0 {
			b = append(b, '\n')
		}
		b = append(b, p...)
	}
	return b
}

// holdAtRestLen is the length of holdAtRest(a).
func holdAtRestLen(a *rules.RegArgs) int {
	n := 0
	for _, p := range holdAtRestParts(a) {
		n += len(p) + 1
	}
	return n - 1
}

// writeHoldAtRest writes quoteFenceValue(holdAtRest(a)) to b, without
// building the argument first where no line needs dollar quotes.
func writeHoldAtRest(b *strings.Builder, a *rules.RegArgs) {
	parts := holdAtRestParts(a)
	for _, p := range parts {
		if strings.ContainsAny(p, `'\`) {
			b.WriteString(quoteFenceValue(holdAtRest(a)))
			return
		}
	}
	b.WriteByte('\'')
	for i, p := range parts {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(p)
	}
	b.WriteByte('\'')
}

// holdAtBind sends, before a Bind that goes without the session's values
// (goesBare), the catalog check and the lock registration l as one call
// of rules.HoldAtProc (or rules.ReholdAtProc: holdAtProc) with the
// session's lock and token: what
// holdAtQuery sends in front of a simple Query, as a statement of the
// proxy's own (sendOwn).
func (r *requests) holdAtBind(l *rules.LockCall) error {
	r.mu.Lock()
	vals := r.fence.cur
	r.mu.Unlock()
	// The parameters, in one reused buffer: the stamp, the lock, the
	// token and the rest (holdAtRest).
	b := strconv.AppendInt(r.ownParams[:0], l.Stamp, 10)
	n0 := len(b)
	b = append(b, vals.lock...)
	n1 := len(b)
	b = append(b, vals.token...)
	n2 := len(b)
	b = appendHoldAtRest(b, l.Args)
	if cap(b) <= maxReusedBind {
		r.ownParams = b
	}
	params := [][]byte{b[:n0:n0], b[n0:n1:n1], b[n1:n2:n2], b[n2:]}
	sql := holdAtSQL
	if r.holdAtProc(l, vals) == rules.ReholdAtProc {
		sql = reholdAtSQL
	}
	return r.sendOwn(r.ps.registerName, sql, holdAtOIDs, params, l, false)
}
