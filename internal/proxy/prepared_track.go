package proxy

// The bookkeeping of a Query's or Parse's prepared-statement operations
// (PREPARE, EXECUTE, DEALLOCATE) and of the statements the proxy inserts
// into a Query.

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/jackc/pgx/v5/pgproto3"
)

// checkExecutes checks the EXECUTEs among ops, skipping names defined
// earlier in the same text (definedHere, updated as ops go). It returns a
// refusal if one runs a statement decided under older rules that the rules
// in force decide differently.
func (r *requests) checkExecutes(ops []PreparedOp, gen uint64) (*rules.Error, error) {
	e, _, err := r.checkExecutesLock(ops, gen)
	return e, err
}

// checkExecutesLock is checkExecutes that also returns the lock
// registration the executed statements need in this session, if any; a
// text that executes several such statements is refused.
func (r *requests) checkExecutesLock(ops []PreparedOp, gen uint64) (*rules.Error, *rules.LockCall, error) {
	var lock *rules.LockCall
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
				if r.lockNamed {
					return refusePrepared(fmt.Sprintf("cannot tell whether prepared statement %q needs a lock registration: it is prepared and executed in one text", op.Name),
						"Send PREPARE and EXECUTE as separate messages."), nil, nil
				}
				continue
			}
			v, err := r.checkStatement(op.Name, gen, true)
			if err != nil {
				return nil, nil, err
			}
			if v.refuse != nil {
				return v.refuse, nil, nil
			}
			if v.def != nil && v.def.param > 0 {
				// Its last parameter is the token a Bind gets: for
				// EXECUTE, it goes in the form that reads the setting.
				nd, e, err := r.settingForm(op.Name, v.def)
				if err != nil || e != nil {
					return e, nil, err
				}
				v.def = nd
			}
			if v.def != nil && v.def.lock != nil && v.def.lock.Call != "" && (r.lockNamed || v.def.lock.Required) {
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
func (t *tracker) sqlOpDefs(ops []PreparedOp, gen uint64) []*stmtDef {
	defs := make([]*stmtDef, len(ops))
	for i, op := range ops {
		if op.Kind != OpPrepare {
			continue
		}
		lex, err := t.lexingNoWait(op.Text)
		sent := hashText("\x00unknown")
		var lock *rules.LockCall
		if err == nil {
			d := t.decide(lex, op.Text)
			sent = decisionHash(&d, op.Text)
			lock = d.Lock
		}
		t.mu.Lock()
		defs[i] = t.ps.newDef(op.Text, sent, gen, nil, true)
		defs[i].lock = lock
		t.mu.Unlock()
	}
	if t.ps.generation() != gen {
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
func (t *tracker) lexingNoWait(text string) (Lexing, error) {
	t.mu.Lock()
	lex := t.lex
	t.mu.Unlock()
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
func (t *tracker) registerSQLOps(ops []PreparedOp, defs []*stmtDef, query bool) {
	t.registerSQLOpsWithCalls(ops, defs, query, nil, nil, regCallbacks{})
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
func (t *tracker) registerSQLOpsWithCalls(ops []PreparedOp, defs []*stmtDef, query bool, calls []int, fence []rules.SettingOp, reg regCallbacks) {
	swallow := func(k int) {
		if k >= reg.skip && reg.done != nil {
			t.ps.push(pendingResp{seg: t.ps.sentSeg, idx: calls[k], query: true, swallow: 'C', done: reg.done})
			return
		}
		t.ps.swallowQuery(calls[k])
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
			t.ps.push(pendingResp{seg: t.ps.sentSeg, idx: sent(f.Stmt), query: true, done: t.fenceDone(knownOp(f))})
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
			t.ps.addStmtOp(op.Name, defs[i], false, 0, query, idx)
		case OpDeallocate:
			t.ps.addStmtOp(op.Name, nil, false, 0, query, idx)
		case OpDeallocateAll:
			for key := range t.ps.stmts {
				t.ps.addStmtOp(key, nil, false, 0, query, idx)
			}
			t.ps.forgetOwn() // the proxy's own statements go too
		}
		if op.Kind != OpExecute {
			t.ps.clientNamed(op.Name)
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

// trackPrepared does the prepared-statement bookkeeping of a Query or
// Parse about to be sent with decision d (which it may turn into a
// refusal): EXECUTEs of statements prepared under older rules are checked,
// and what the text defines or removes is recorded; preparedForm is
// whether d was decided with Lexing.Prepared, param the token's parameter
// in a Parse's parameter form (0: none), words what mentionsPrepared found
// in sql.
func (r *requests) trackPrepared(typ byte, p *pgproto3.Parse, sql string, gen uint64, d *rules.Decision, preparedForm bool, param int, words prepWords, ft *fenceText) error {
	var ops []PreparedOp
	if d.Action != Refuse {
		if words.any {
			var err error
			ops, err = r.preparedOps(sql)
			switch {
			case errors.Is(err, errPolicyPanicked):
				*d = internalRefusal()
			case err != nil && words.execute:
				*d = rules.Decision{Action: Refuse, Err: refusePrepared("cannot tell which prepared statement this text executes: it does not parse", "")}
			case err != nil:
				ops = nil
			case d.Action == Rewrite && len(ops) > 0 && !r.sameOps(ops, d.SQL):
				*d = rules.Decision{Action: Refuse, Err: refusePrepared("cannot track the prepared statements of this text once rewritten", "Send PREPARE, EXECUTE and DEALLOCATE as statements of their own.")}
			}
		}
	}
	// The token form of the rewritten text, if any: d is rebuilt below.
	tf := d.Tok
	var calls []int
	// A text that changes a fence setting runs its statements with what it
	// set, not with the record: its registration is never spared.
	spare := r.fence.on && len(ft.ops) == 0 && r.spare(d.Lock)
	var regLock *rules.LockCall // the registration sent, if any
	checkFirst := 0             // the catalog check in front of the registrations
	// The decided text, before registrations go in front of it (holdAt).
	decided, rewrote := sql, d.Action == Rewrite
	if rewrote {
		decided = d.SQL
	}
	if typ == 'Q' && d.Action != Refuse && d.Lock != nil && len(d.Lock.Calls) > 0 && (r.lockNamed || d.Lock.Required) && !spare {
		regLock = d.Lock
		if d.Lock.Pre != "" {
			checkFirst = 1
		}
		// Send the text with the lock registrations in place.
		calls = d.Lock.Calls
		*d = rules.Decision{Action: Rewrite, SQL: d.Lock.Query, Tables: d.Tables, Lock: d.Lock}
	} else if typ == 'Q' && d.Action != Refuse && d.Lock != nil && d.Lock.Pre != "" {
		// No registration (spared, or none needed): the catalog check
		// still goes first.
		base := sql
		if d.Action == Rewrite {
			base = d.SQL
		}
		calls = []int{0}
		*d = rules.Decision{Action: Rewrite, SQL: d.Lock.Pre + ";" + base, Tables: d.Tables, Lock: d.Lock}
	}
	if typ == 'Q' && d.Action != Refuse && len(ops) > 0 {
		e, lock, err := r.checkExecutesLock(ops, gen)
		if err != nil {
			return err
		}
		switch {
		case e != nil:
			*d = rules.Decision{Action: Refuse, Err: e}
		case lock != nil && (calls != nil || ops[0].Stmts != 1):
			*d = rules.Decision{Action: Refuse, Err: refusePrepared("EXECUTE of a prepared statement on a lock-fenced table must be a statement of its own",
				"Send the EXECUTE alone in its Query, so that the lock registration can precede it.")}
		case lock != nil && r.fence.on && len(ft.ops) == 0 && r.spare(lock):
		case lock != nil:
			regLock = lock
			out := sql
			if d.Action == Rewrite {
				out = d.SQL
			}
			// One statement: the registration goes before it, as the
			// rewriter does for a single statement.
			calls = []int{0}
			*d = rules.Decision{Action: Rewrite, SQL: lock.Call + ";" + out, Tables: d.Tables}
		}
	}
	if typ == 'Q' && d.Action != Refuse && r.fence.on && ft.prelude {
		// The session's own values, transaction-locally, before the
		// text: two statements, whose CommandCompletes are swallowed.
		// The prelude applies the record, and a text that changes no
		// fence setting reads the record's token, which may then be
		// written into it (where its stale-row errors can be told apart:
		// staleAtForLocked).
		useTok := d.Action == Rewrite && tf != nil && len(ft.ops) == 0
		r.mu.Lock()
		// The prelude's values, read with the rest: it is built only
		// where it goes.
		tokenName, lockName, cur := r.fence.tokenName, r.fence.lockName, r.fence.cur
		token, valid := rules.CanonicalToken(r.fence.cur.token)
		useTok = useTok && valid && r.staleAtForLocked(token, tf.StaleTable())
		// No transaction open or pending: nothing later in one may read
		// what the prelude would set (preludeRead).
		idle := r.state.txStatus == 'I' && r.state.inFlight == 0 && !r.state.unsynced && !r.state.desync
		r.mu.Unlock()
		plain := len(ops) == 0 && !words.execute && idle
		// holdAtQuery takes only a registration other than the catalog
		// check alone, which the first case below never does: it goes
		// first, and fills the token form itself.
		s, held := r.holdAtQuery(regLock, calls, sql, decided, rewrote, tf, cur, plain && len(ft.ops) == 0 && useTok == rewrote)
		base := sql
		carried := false // the fences carry the token
		if d.Action == Rewrite && !held {
			base = d.SQL
			if useTok {
				if s, ok := tf.Fill(base, token); ok {
					base, carried = s, true
				}
			}
		}
		if held {
			// One call of the check and the registration with the
			// session's values, and nothing that reads the settings:
			// it stands for the prelude, the check and the registration.
			*d = rules.Decision{Action: Rewrite, SQL: s, Tables: d.Tables, Lock: d.Lock}
			calls, checkFirst = []int{0}, 0
			ft.prelude = false
		} else if carried && (regLock == nil || regLock.Catalog) && plain && !r.preludeRead(sql, base) {
			// Nothing the text runs reads a fence setting (the catalog
			// check, if any, reads none): it goes without the prelude.
			*d = rules.Decision{Action: Rewrite, SQL: base, Tables: d.Tables, Lock: d.Lock}
			ft.prelude = false
		} else {
			*d = rules.Decision{Action: Rewrite, SQL: simplePrelude(tokenName, lockName, cur) + base, Tables: d.Tables, Lock: d.Lock}
			shifted := []int{0, 1}
			for _, c := range calls {
				shifted = append(shifted, c+2)
			}
			calls = shifted
		}
	}
	if d.Action == Refuse {
		ops = nil
		ft.ops = nil
	}
	var defs []*stmtDef
	if typ == 'Q' && len(ops) > 0 {
		defs = r.sqlOpDefs(ops, gen)
	}
	settingFree := typ == 'P' && param > 0 && d.Action == Rewrite && !r.paramReads(sql, d.SQL)
	r.mu.Lock()
	defer r.mu.Unlock()
	if d.Action != Refuse && r.ps.wouldOverflow(typ, p.Name, ops) {
		*d = rules.Decision{Action: Refuse, Err: refusePrepared(fmt.Sprintf("too many prepared statements in this session (limit %d)", maxTrackedStatements),
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
			regDone = r.registeredDone(regLock, ft.ops)
		}
		pre := 0
		if ft.prelude && d.Action != Refuse {
			pre = 2
		}
		r.registerSQLOpsWithCalls(ops, defs, true, calls, ft.ops, regCallbacks{skip: pre + checkFirst, done: regDone})
	case d.Action == Refuse:
		if p.Name == "" {
			// The refused Parse still drops the unnamed statement.
			r.ps.addStmtOp("", nil, true, 0, false, 0)
		}
		// A refused named Parse fails before it would replace anything.
	default:
		r.ps.clientNamed(p.Name)
		def := r.ps.repeatDef(p.Name, sql, d, gen, p.ParameterOIDs, ops)
		if def != nil && def.param != param {
			def = nil
		}
		if def == nil {
			def = r.ps.newDef(sql, decisionHash(d, sql), gen, p.ParameterOIDs, false)
			def.ops = cloneOps(ops) // their texts may alias the Parse's, read in place
			def.lock = d.Lock
			def.plain = plainDecision(d)
			def.forward = d.Action == Forward
			def.preparedForm = preparedForm
			def.fence = ft.ops
			def.param = param
			def.settingFree = settingFree
		}
		r.ps.addStmtOp(p.Name, def, p.Name == "", 0, false, 0)
	}
	return nil
}

// preparedOps asks the policy for the prepared-statement operations of
// sql. It parses: on an event loop, that runs off the loop's thread (as
// slow decisions do, see decide).
func (t *tracker) preparedOps(sql string) (ops []PreparedOp, err error) {
	t.offLoop(func() { ops, err = t.policyPreparedOps(sql) })
	return ops, err
}

// errPolicyPanicked reports a panic of the policy (logged), after which the
// statement is refused.
var errPolicyPanicked = errors.New("policy panicked")

// policyPreparedOps asks the policy, returning errPolicyPanicked if it
// panics.
func (t *tracker) policyPreparedOps(sql string) (ops []PreparedOp, err error) {
	defer func() {
		if r := recover(); r != nil {
			t.logPolicyPanic("policy panicked listing prepared statements; statement refused", r)
			ops, err = nil, errPolicyPanicked
		}
	}()
	return t.ps.pol.PreparedOps(sql)
}

// maxReusedOIDs bounds the parameter-type buffer a session keeps
// (session.oidBuf): a Parse may declare 65535 types.
const maxReusedOIDs = 256

// sameOps reports whether the rewritten text out has the same
// prepared-statement operations at the same statement indexes as ops.
func (t *tracker) sameOps(ops []PreparedOp, out string) bool {
	got, err := t.preparedOps(out)
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

// holdAtQuery returns the text to send for a simple Query (the client's
// text sql) whose decided text (rewritten, and then with the token form
// tf, or not) registers one lock before its first statement, with the
// catalog check in front (calls [0 1]): one call of rules.HoldAtProc (or
// rules.ReholdAtProc: holdAtProc) with the session's values (cur) in
// place of the prelude, the check and the
// registration, where the database has it and nothing else may read the
// fence settings in the transaction. ok (the caller's) says the session
// is idle, the text runs no prepared statement and changes no fence
// setting, and, when rewritten, the token can be written into it; here
// the token form is filled, and neither the client's text nor the filled
// one may name a setting or a reader of settings (preludeRead). The
// call's slow path sets the settings itself for register, which reads
// them.
func (r *requests) holdAtQuery(l *rules.LockCall, calls []int, sql, decided string, rewrote bool, tf *rules.TokenForm, cur fenceValues, ok bool) (string, bool) {
	if !ok || len(calls) != 2 || calls[0] != 0 || calls[1] != 1 || !r.holdAtFits(l) {
		return "", false
	}
	// The call and the text, in one allocation: "CALL proc(stamp, lock,
	// token, rest);" and the text, filled with the token when rewritten.
	size := len(decided)
	token := ""
	if rewrote {
		var valid bool
		token, valid = rules.CanonicalToken(cur.token)
		n, fok := tf.FilledLen(decided, token)
		if !valid || !fok {
			return "", false
		}
		size = n
	}
	proc, rest := r.holdAtProc(l, cur), holdAtRestLen(l.Args)
	var b strings.Builder
	b.Grow(len("CALL (, , , );") + len(proc) + 20 + len(cur.lock) + len(cur.token) + rest + 6 + size)
	b.WriteString("CALL ")
	b.WriteString(proc)
	b.WriteByte('(')
	b.WriteString(strconv.FormatInt(l.Stamp, 10))
	b.WriteString(", ")
	writeFenceValue(&b, cur.lock)
	b.WriteString(", ")
	writeFenceValue(&b, cur.token)
	b.WriteString(", ")
	writeHoldAtRest(&b, l.Args)
	b.WriteString(");")
	head := b.Len()
	if rewrote {
		tf.FillTo(&b, decided, token)
	} else {
		b.WriteString(decided)
	}
	out := b.String()
	if r.preludeRead(sql, out[head:]) {
		return "", false
	}
	return out, true
}
