package proxy

// The lock registration before a Bind (docs/design.md, "Lock fencing").

import (
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

// register sends, before the client's Bind, the lock registration call
// as the proxy's own prepared statement and portal, whose responses are
// not relayed: Bind and Execute when the server is believed to have the
// statement for this call already, else Close and Parse first. It runs in
// the same transaction as the client's statement: nothing in between ends
// it. If it fails, its error is the first the client sees, and the server
// skips the client's messages up to the Sync.
func (r *requests) register(call string, l *rules.LockCall) error {
	ps := r.ps
	r.mu.Lock()
	if r.state.finishing {
		r.mu.Unlock()
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
	ps.expect('C', r.registeredDone(l, nil))
	ps.countSent('E')
	msgs = append(msgs, out{'E', &pgproto3.Execute{Portal: name}})
	if !prepared {
		// Until its ParseComplete says so, do not count on it.
		ps.regPrepared = ""
	}
	r.state.rewrote = true
	r.mu.Unlock()
	for _, m := range msgs {
		if err := writeMsg(r.uw, m.msg); err != nil {
			return upstreamErr(err)
		}
	}
	return nil
}
