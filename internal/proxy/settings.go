package proxy

import (
	"strings"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// The session's fence settings (docs/design.md, "The session's fence
// settings").
//
// The proxy keeps, for each client session, the values of the token and
// lock settings that PostgreSQL holds for it: the defaults from the
// startup packet and the role's and database's settings, then every
// statement that changes them (Policy.SettingOps, on PostgreSQL's
// parse), each applied when its response says it ran, with PostgreSQL's
// transaction rules (a rollback undoes SET, SET LOCAL ends with its
// transaction, savepoints). Before each statement on a protected table,
// the session's own values are applied transaction-locally (fencePrelude),
// so the statement never runs with what its server connection carries
// from another client behind a transaction pooler.

// spareRegistration reports whether a statement of the open transaction
// needs no lock registration: one for the same lock and token succeeded
// in it, and everything sent since is answered, so that the transaction
// is known to be the same one (an explicit transaction, not failed, no
// rollback to a savepoint since). The registration holds its advisory
// lock until the transaction ends, so no newer holder can register
// meanwhile, and the record says that neither value changed. Callers
// hold session.mu.
func (t *tracker) spareRegistration() bool {
	f := &t.fence
	return f.on && f.registered && f.regLock == f.cur.lock && f.regToken == f.cur.token &&
		f.unresolved == 0 && !f.failed && !f.broken && t.state.txStatus == 'T' && t.state.inFlight == 0 && !t.state.unsynced
}

// spare is spareRegistration, taking s.mu.
func (t *tracker) spare(l *rules.LockCall) bool {
	if l != nil && l.Catalog {
		return false // the catalog check is never spared
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.spareRegistration()
}

// registered returns the callback for a registration's response (nil
// when it proves nothing: audit mode). Callers hold session.mu.
//
// A registration proves something only when it ran with the record's
// values (the text changes no fence setting: ops is empty; a text that
// does runs its registration with what its own statements set) and took
// the lock: a named lock and a valid token (with an invalid one, the
// registration of a table whose lock is optional takes nothing).
func (t *tracker) registeredDone(l *rules.LockCall, ops []rules.SettingOp) func(outcome) {
	if !t.fence.on || l == nil || l.Audit || len(ops) > 0 {
		return nil
	}
	lk, tok := t.fence.cur.lock, t.fence.cur.token
	if _, valid := rules.CanonicalToken(tok); !valid || lk == "" {
		return nil
	}
	// The callback depends on the values alone: the last one serves
	// (one allocation less per registration).
	if t.fence.regDone != nil && t.fence.regDoneVals == t.fence.cur {
		return t.fence.regDone
	}
	done := func(o outcome) {
		if o == outcomeOK && !t.fence.failed {
			// Held once its transaction commits (fenceRecord.held).
			t.fence.cand, t.fence.candSet = fenceValues{lock: lk, token: tok}, true
		} else if o != outcomeOK && t.fence.held == (fenceValues{lock: lk, token: tok}) {
			// Not registered (refused, failed, skipped): the next
			// registration of these values reads the watermark first.
			t.fence.held = fenceValues{}
		}
		if o == outcomeOK && t.fence.inTx && !t.fence.failed {
			t.fence.registered, t.fence.regLock, t.fence.regToken = true, lk, tok
		}
	}
	t.fence.regDone, t.fence.regDoneVals = done, t.fence.cur
	return done
}

// ---- startup ----

// ---- the statements that may change the settings ----

// ---- applying the record ----

// errFenceUnknown refuses a statement whose effect on the settings cannot
// be known.
func refuseFenceUnknown(why string) *rules.Error {
	return refusePrepared("cannot tell what this statement sets the fence settings to: "+why,
		"Set the token and the lock with SET, SET LOCAL, RESET, or SELECT set_config(…) with constants or parameters, in a statement of their own.")
}

// preludeSQL is the extended protocol's: set_config(…, true) of both, in
// a SELECT that returns no row (OFFSET 1 still evaluates the one row's
// target list), so the Execute answers with a CommandComplete alone.
const preludeSQL = "SELECT pg_catalog.set_config($1, $2, true), pg_catalog.set_config($3, $4, true) OFFSET 1"

// textOIDs are the prelude's parameter types.
var textOIDs = []uint32{25, 25, 25, 25}

// settingOps asks the policy what sql does to the fence settings, off the
// event loop; panicked reports a policy that panicked.
func (t *tracker) settingOps(sql string) (st rules.SettingText, panicked bool, err error) {
	t.offLoop(func() {
		defer func() {
			if r := recover(); r != nil {
				t.logPolicyPanic("policy panicked reading fence settings; statement refused", r)
				panicked = true
			}
		}()
		st, err = t.pol.SettingOps(sql)
	})
	return st, panicked, err
}

// ---- the session's side ----

// fenceApplied is an operation with its values known, waiting for its
// statement's response.
type fenceApplied struct {
	op    rules.SettingOp
	value string
	local bool
	null  bool
	which uint8
}

func knownOp(op rules.SettingOp) fenceApplied {
	return fenceApplied{op: op, value: op.Value, local: op.Local, null: op.Null, which: op.Which}
}

// fenceText is what a text does to the settings.
type fenceText struct {
	ops  []rules.SettingOp
	st   rules.SettingText
	lock bool // an operation may set the lock
	// prelude: the session's values go before the text (fenceDecide).
	prelude bool
}

// fenceOps reads what sql does to the fence settings; a refusal when it
// cannot be known.
func (t *tracker) fenceOps(sql string, lex Lexing) (fenceText, *rules.Error) {
	var ft fenceText
	if !t.fence.on || !mayChangeFence(sql, lex) {
		return ft, nil
	}
	if strings.IndexByte(sql, '\\') >= 0 && (!lex.StandardConformingStrings || lex.Uncertain || backslashInCharacters(lex.ClientEncoding)) {
		// The parser reads backslashes as standard_conforming_strings on
		// does, in UTF-8.
		return ft, refuseFenceUnknown("backslashes in a statement that may change them, where the server may read them as escapes (standard_conforming_strings off, or a client encoding whose characters contain the byte)")
	}
	// st, not ft, is what the closure captures: ft stays on the stack of
	// the common path, which returns above.
	st, panicked, err := t.settingOps(sql)
	ft.st = st
	if panicked {
		return ft, refusePrepared("internal error reading the statement's fence settings", "")
	}
	if err != nil {
		// The server may read what the parser could not (another version,
		// another client encoding): fail closed.
		return ft, refuseFenceUnknown("the statement does not parse here (" + err.Error() + ")")
	}
	ft.ops = ft.st.Ops
	for _, op := range ft.ops {
		if op.Kind == rules.SetUnknown {
			return ft, refuseFenceUnknown(op.Why)
		}
		if op.Which&rules.SettingLock != 0 || op.Kind == rules.ResetAll {
			ft.lock = true
		}
	}
	return ft, nil
}

// statementAfterEnd reports whether a statement on a protected table
// follows, in the same text, one that ends a transaction or rolls back to
// a savepoint: the values applied at the text's start would not be in
// force for it.
func (ft *fenceText) statementAfterEnd() bool {
	end := -1
	for _, op := range ft.ops {
		switch op.Kind {
		case rules.TxCommit, rules.TxRollback, rules.TxRollbackTo, rules.TxPrepare:
			if end < 0 {
				end = op.Stmt
			}
		}
	}
	if end < 0 {
		return false
	}
	for i := end + 1; i < len(ft.st.Protected); i++ {
		if ft.st.Protected[i] {
			return true
		}
	}
	return false
}

// writeAfterEnd reports whether a statement that may write a table itself
// follows, in the text, a COMMIT, ROLLBACK, ROLLBACK TO or PREPARE
// TRANSACTION: the catalog check in front of the text (and the
// lock_timeout it may set) does not hold past one.
func (ft *fenceText) writeAfterEnd() bool {
	end := -1
	for _, op := range ft.st.Ops {
		switch op.Kind {
		case rules.TxCommit, rules.TxRollback, rules.TxRollbackTo, rules.TxPrepare:
			if end < 0 {
				end = op.Stmt
			}
		}
	}
	for i := end + 1; end >= 0 && i < len(ft.st.MayWrite); i++ {
		if ft.st.MayWrite[i] {
			return true
		}
	}
	return false
}

// sameTextRefusal refuses a Query text in which a statement on a
// protected table (or an EXECUTE) follows, in the same text, a statement
// after which the server's fence settings may not be the record's: the
// session's values are applied once, in front of the text. Before the
// last such statement, no statement may call a function or procedure or
// run stored code (the call may set them), other than SELECT set_config
// alone and the writes of protected tables, and no RESET, SET … TO
// DEFAULT, RESET ALL or SET … FROM CURRENT of a fence setting (behind a
// transaction pooler the server's default is the pooled connection's,
// not the client's).
func (t *tracker) sameTextRefusal(sql string, ft *fenceText) *rules.Error {
	// One statement, maybe with a semicolon after it (psql sends one):
	// nothing to parse.
	if strings.IndexByte(strings.TrimRight(sql, " \t\r\n;"), ';') < 0 {
		return nil
	}
	st := ft.st
	if st.Stmts == 0 {
		// Parsed as the rewriter parsed it, which decided the text (and
		// refuses what it cannot read as the server would).
		var panicked bool
		var err error
		st, panicked, err = t.settingOps(sql)
		switch {
		case panicked:
			return refusePrepared("internal error reading the statement's fence settings", "")
		case err != nil:
			return refuseFenceUnknown("the statement does not parse here (" + err.Error() + ")")
		case st.Stmts == 0 && len(st.Ops) > 0:
			return refuseSameText("the text is too long to check")
		}
	}
	last := -1
	for i := st.Stmts - 1; i >= 0; i-- {
		if st.Protected[i] || st.Execute[i] {
			last = i
			break
		}
	}
	for i := 0; i < last; i++ {
		if st.Calls[i] && !st.Plain[i] && !(st.Protected[i] && st.Write[i]) {
			return refuseSameText("it follows a statement that may call a function, which may change the fence settings")
		}
	}
	for _, op := range st.Ops {
		if op.Stmt < last && (op.Kind == rules.SetDefault || op.Kind == rules.ResetAll || op.Kind == rules.SetCurrent) {
			return refuseSameText("it follows a RESET (or SET … TO DEFAULT, or SET … FROM CURRENT) of a fence setting, whose value on the server the proxy cannot know behind a pooler")
		}
	}
	return nil
}

// timeoutWords are the words of a text that may change lock_timeout
// without a SET or a set_config (rules.SettingText.LockTimeout).
var timeoutWords = []string{"lock_timeout", "pg_settings"}

// catalogChecked reports whether d runs the catalog check in the write's
// transaction, before it (rules.LockCall's Catalog and Pre).
func catalogChecked(d *rules.Decision) bool {
	return d.Action != Refuse && d.Lock != nil && (d.Lock.Catalog || d.Lock.Pre != "")
}

// timeoutBeforeWrite reports whether a statement of the text may change
// lock_timeout before or in the last statement that may write a table
// itself (rules.SettingText's LockTimeout and MayWrite; a read, FOR
// UPDATE too, waits for a lock but writes through no path).
func (ft *fenceText) timeoutBeforeWrite() bool {
	last := -1
	for i := ft.st.Stmts - 1; i >= 0; i-- {
		if ft.st.MayWrite[i] {
			last = i
			break
		}
	}
	for i := 0; i <= last && i < len(ft.st.LockTimeout); i++ {
		if ft.st.LockTimeout[i] {
			return true
		}
	}
	return false
}

// refuseSameText refuses a statement on a protected table that cannot
// run in its Query text (sameTextRefusal).
func refuseSameText(why string) *rules.Error {
	return refusePrepared("a statement on a protected table cannot run in this Query: "+why,
		"Send the statement on the protected table first in its Query, or in a Query of its own, with the fence settings set by SET or SET LOCAL.")
}

// fenceDone returns the callback that records a's outcome. Callers hold
// s.mu.
func (t *tracker) fenceDone(a fenceApplied) func(outcome) {
	f := &t.fence
	f.unresolved++
	return func(o outcome) {
		f.unresolved--
		if o == outcomeOK {
			f.apply(a.op, a.value, a.local, a.null, a.which)
		}
		if f.unresolved == 0 {
			t.idleCond.Broadcast()
			t.wakeIdleLocked()
		}
	}
}

// fenceLost is called, with s.mu held, when the response bookkeeping gives
// up: the record can no longer be trusted, and statements on protected
// tables are refused.
func (t *tracker) fenceLost() {
	t.fence.unresolved = 0
	t.fence.broken = true
}

// fenceWait waits until every operation on the settings sent so far is
// answered, so that the record is what the server holds. The server may
// hold extended-protocol answers until a Sync or Flush: a Flush is sent.
func (r *requests) fenceWait() error {
	r.mu.Lock()
	pending := r.fence.unresolved > 0
	unsynced := r.state.unsynced
	r.mu.Unlock()
	if !pending {
		return nil
	}
	if unsynced {
		if err := writeRaw(r.uw, 'H', nil); err != nil {
			return upstreamErr(err)
		}
	}
	if err := r.uw.Flush(); err != nil {
		return upstreamErr(err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.waitLocked(func() bool { return r.fence.unresolved > 0 && !r.state.finishing })
	if r.state.finishing {
		return errSessionDone
	}
	return nil
}

// fenceReady waits for the record, then reports the lock name in force and
// whether the record can be used.
func (r *requests) fenceReady() (lockNamed bool, ok bool, err error) {
	if err := r.fenceWait(); err != nil {
		return false, false, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.fence.cur.lock != "", !r.fence.broken, nil
}

var errFenceBroken = refusePrepared("the proxy lost track of this session's fence settings; reconnect", "")

// sendPrelude sends, before a client's Bind of a statement on a protected
// table, the session's own values as transaction-local settings:
// preludeSQL under the proxy's own name, parsed again every time and
// closed after (sendOwn). Its responses are not relayed.
func (r *requests) sendPrelude() error {
	r.mu.Lock()
	vals := r.fence.cur
	tok, lk := r.fence.tokenName, r.fence.lockName
	r.mu.Unlock()
	params := [][]byte{[]byte(tok), []byte(vals.token), []byte(lk), []byte(vals.lock)}
	return r.sendOwn(r.ps.preludeName, preludeSQL, textOIDs, params, nil, true)
}

// resolveBindOps gives the operations of a statement their values from a
// Bind's parameters. ok is false when they cannot be read (the Bind is
// then refused).
func (t *tracker) resolveBindOps(ops []rules.SettingOp, body []byte) ([]fenceApplied, bool) {
	if len(ops) == 0 {
		return nil, true
	}
	params := false
	for _, op := range ops {
		params = params || op.Kind == rules.SetParams
	}
	if !params {
		out := make([]fenceApplied, len(ops))
		for i, op := range ops {
			out[i] = knownOp(op)
		}
		return out, true
	}
	var bind pgproto3.Bind
	if bind.Decode(body) != nil {
		return nil, false
	}
	formats, values := bind.ParameterFormatCodes, bind.Parameters
	param := func(n int) (v []byte, binary bool, ok bool) {
		if n < 1 || n > len(values) {
			return nil, false, false
		}
		f := int16(0)
		switch {
		case len(formats) == 1:
			f = formats[0]
		case len(formats) >= n:
			f = formats[n-1]
		}
		return values[n-1], f == 1, true
	}
	var out []fenceApplied
	for _, op := range ops {
		a := knownOp(op)
		if op.Kind == rules.SetParams {
			if op.NameParam > 0 {
				v, _, ok := param(op.NameParam)
				if !ok || v == nil {
					continue // the server refuses it (no name)
				}
				a.which = t.whichSetting(string(v))
				if a.which == 0 {
					continue
				}
			}
			if op.ValueParam > 0 {
				v, _, ok := param(op.ValueParam)
				if !ok {
					return nil, false
				}
				a.null, a.value = v == nil, string(v)
			}
			if op.LocalParam > 0 {
				v, bin, ok := param(op.LocalParam)
				if !ok {
					return nil, false
				}
				switch {
				case v == nil:
					a.local = false
				case bin:
					a.local = len(v) == 1 && v[0] != 0
				default:
					b, ok := rules.ParseBool(string(v))
					if !ok {
						continue // the server refuses it
					}
					a.local = b
				}
			}
		}
		out = append(out, a)
	}
	return out, true
}

// preludeRead reports whether a simple Query of text on a protected
// table, sent as sent (whose fences carry the session's token: the token
// form) and registering no lock, may still read a fence setting on the
// server, so that the session's values must go before it: the database
// guard reads them for every write, code of the database may read them
// (Policy.CodeReadsSettings), the text or what the proxy made of it may
// (an audit record names the token; settingReadWords, or a spelling
// sqllex.MayName cannot rule out). Where none does, and no transaction is
// open (a value set transaction-locally lasts until its end, and a later
// statement of it may read it: the caller's test), what the server
// connection carries from another client behind a transaction pooler
// reaches nothing, and the two statements of the prelude (about a tenth
// of what the server spends on a fenced UPDATE) are left out.
func (r *requests) preludeRead(text, sent string) bool {
	pol := r.srv.opts.Policy
	return pol.SettingsEverywhere(&r.info) || pol.CodeReadsSettings(&r.info) ||
		sqllex.MayName(text, r.fence.readWords) || sqllex.MayName(sent, r.fence.readWords)
}

// paramReads reports whether a statement in the parameter form (text
// the client's, sent the form) may read a fence setting on the server
// other than for its stale-row error's message, which the relay fills
// in where it left the session's values out (goesBare): the text or the
// form names a setting or a reader of settings (settingReadWords, an
// audit record's read of the token), once the stale raisers' calls are
// set aside. A form whose calls are spelt otherwise keeps the setting's
// name, and counts.
func (r *requests) paramReads(text, sent string) bool {
	if sqllex.MayName(text, r.fence.readWords) {
		return true
	}
	for _, raiser := range [...]string{"fenceproxy.stale('", "fenceproxy.stale_b('"} {
		sent = strings.ReplaceAll(sent, raiser+r.fence.tokenName+"', ", "")
	}
	return sqllex.MayName(sent, r.fence.readWords)
}

// settingReadWords are the words of a text that may read a setting
// whatever its name: the functions and the view that read them, and SHOW.
var settingReadWords = []string{"current_setting", "pg_settings", "pg_show_all_settings", "show"}

// fencedDecision reports whether a text decided d runs something on a
// protected table that reads the fence settings: a rewrite, a lock
// registration, or an EXECUTE of a prepared statement (which may be one).
func fencedDecision(d *rules.Decision, words prepWords) bool {
	return d.Action == Rewrite || (d.Action != Refuse && d.Lock != nil) || words.execute
}

// registers reports whether a decision's lock registration is sent in a
// session that names a lock as lockNamed says.
func registers(l *rules.LockCall, lockNamed bool) bool {
	return l != nil && len(l.Calls) > 0 && (lockNamed || l.Required)
}

// readsSettings reports whether the statement a registration precedes
// runs with the fence settings read: a lock registration does, the
// catalog stamp's check does not.
func readsSettings(l *rules.LockCall, lockNamed bool) bool {
	return registers(l, lockNamed) && !l.Catalog
}

// fenceDecide reads what a Query's or Parse's text does to the fence
// settings (refusing it when that cannot be known), and, for a text on a
// protected table, waits until the record is what the server holds, so
// that the values applied before it and the decision to register the
// lock are the session's own.
func (r *requests) fenceDecide(typ byte, d *rules.Decision, ft *fenceText, sql string, lex Lexing, words prepWords) error {
	var refusal *rules.Error
	*ft, refusal = r.fenceOps(sql, lex)
	fenced := fencedDecision(d, words)
	if refusal == nil && fenced && ft.st.Stmts == 0 && catalogChecked(d) &&
		(sqllex.ContainsAnyWordFold(sql, timeoutWords) || sqllex.HasUnicodeEscape(sql)) {
		// Not parsed for the fence settings, but it may change
		// lock_timeout all the same (an UPDATE of pg_settings).
		if st, panicked, err := r.settingOps(sql); !panicked && err == nil {
			ft.st = st
		}
	}
	switch {
	case refusal != nil:
	case fenced && catalogChecked(d) && ft.timeoutBeforeWrite():
		// The check's lock_timeout keeps the write from waiting for an
		// uncommitted change of the catalog, after which it would run
		// through whatever path the change opened.
		refusal = refusePrepared("a write cannot change lock_timeout in its own Query in a database with the catalog watch: the proxy's catalog check sets it, so that the write cannot wait for an uncommitted change of the catalog and then run through a path it opened",
			"Set lock_timeout in a Query of its own, before the write.")
	case typ == 'Q' && fenced && catalogChecked(d) && ft.writeAfterEnd():
		refusal = refusePrepared("a write follows a COMMIT, ROLLBACK or ROLLBACK TO in the same Query, in a database with the catalog watch: the proxy's catalog check in front of the Query does not hold past it",
			"Send the statements after the end of the transaction in a Query of their own.")
	case typ == 'Q' && fenced && ft.statementAfterEnd():
		refusal = refusePrepared("a statement on a protected table follows a COMMIT, ROLLBACK or ROLLBACK TO in the same Query",
			"Send the statements after the end of the transaction in a Query of their own.")
	case typ == 'Q' && !fenced && mayWrite(sql) && r.srv.opts.Policy.SettingsEverywhere(&r.info):
		_, ok, err := r.fenceReady()
		if err != nil {
			return err
		}
		if !ok {
			refusal = errFenceBroken
		}
		ft.prelude = true
	case fenced && typ == 'Q':
		named, ok, err := r.fenceReady()
		if err != nil {
			return err
		}
		if !ok {
			refusal = errFenceBroken
		} else if r.fence.on {
			refusal = r.sameTextRefusal(sql, ft)
		}
		r.lockNamed = named || ft.lock
		// A read of a lock-fenced table that registers nothing in this
		// session reads no setting: it goes as sent.
		ft.prelude = d.Action == Rewrite || words.execute || readsSettings(d.Lock, r.lockNamed)
	}
	if refusal != nil {
		*d = rules.Decision{Action: Refuse, Err: refusal, Tables: d.Tables}
		*ft = fenceText{}
	}
	return nil
}
