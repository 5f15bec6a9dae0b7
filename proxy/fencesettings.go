package proxy

import (
	"encoding/binary"
	"strings"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/rules"
)

// The session's fence settings (docs/design.md, "The session's fence
// settings").
//
// The proxy keeps, for each client session, the values of the token and
// lock settings that PostgreSQL holds for it: the defaults from the
// startup packet and the role's and database's settings, then every
// statement that changes them (SettingsPolicy.SettingOps, on PostgreSQL's
// parse), each applied when its response says it ran, with PostgreSQL's
// transaction rules (a rollback undoes SET, SET LOCAL ends with its
// transaction, savepoints). Before each statement on a protected table,
// the session's own values are applied transaction-locally (fencePrelude),
// so the statement never runs with what its server connection carries
// from another client behind a transaction pooler.

// SettingsPolicy is an optional Policy extension: the policy names the
// fence settings and reads what a text does to them.
type SettingsPolicy interface {
	// FenceSettings returns the token and lock settings' names, "" when
	// the rules fence nothing (then the proxy keeps no record).
	FenceSettings() (token, lock string)
	// SettingOps returns what sql does to the fence settings.
	SettingOps(sql string) (rules.SettingText, error)
	// SettingsEverywhere reports whether every statement that may write
	// needs the session's values in this session's database (the database
	// guard reads them on the server for writes the proxy cannot see).
	SettingsEverywhere(info *SessionInfo) bool
}

type fenceValues struct{ token, lock string }

func (v *fenceValues) set(which uint8, val string) {
	if which&rules.SettingToken != 0 {
		v.token = val
	}
	if which&rules.SettingLock != 0 {
		v.lock = val
	}
}

func (v *fenceValues) copyFrom(o fenceValues, which uint8) {
	if which&rules.SettingToken != 0 {
		v.token = o.token
	}
	if which&rules.SettingLock != 0 {
		v.lock = o.lock
	}
}

type fenceSavepoint struct {
	name      string
	pend, cur fenceValues
}

// fenceRecord is the model; guarded by session.mu. Outside a transaction
// pend and cur equal sess. In one, pend is the session-level value a
// commit keeps and cur the value in effect (SET LOCAL changes only cur).
type fenceRecord struct {
	on                    bool
	tokenName             string
	lockName              string
	defaults              fenceValues
	sess, pend, cur       fenceValues
	inTx, failed          bool
	saves                 []fenceSavepoint
	unresolved            int  // operations sent and not yet answered
	startupTok, startupLk bool // the startup packet set them
	// broken: the response bookkeeping lost track; the record is unknown.
	broken bool
	// registered: a lock registration of regLock and regToken succeeded
	// in the open transaction (spareRegistration).
	registered        bool
	regLock, regToken string
}

// spareRegistration reports whether a statement of the open transaction
// needs no lock registration: one for the same lock and token succeeded
// in it, and everything sent since is answered, so that the transaction
// is known to be the same one (an explicit transaction, not failed, no
// rollback to a savepoint since). The registration holds its advisory
// lock until the transaction ends, so no newer holder can register
// meanwhile, and the record says that neither value changed. Callers
// hold session.mu.
func (s *session) spareRegistration() bool {
	f := &s.fence
	return f.on && f.registered && f.regLock == f.cur.lock && f.regToken == f.cur.token &&
		f.unresolved == 0 && !f.failed && !f.broken && s.state.txStatus == 'T' && s.state.inFlight == 0 && !s.state.unsynced
}

// spare is spareRegistration, taking s.mu.
func (s *session) spare() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.spareRegistration()
}

// registered returns the callback for a registration's response (nil
// when it proves nothing: audit mode). Callers hold session.mu.
func (s *session) registeredDone(l *LockRegistration) func(outcome) {
	if !s.fence.on || l == nil || l.Audit {
		return nil
	}
	lk, tok := s.fence.cur.lock, s.fence.cur.token
	return func(o outcome) {
		if o == outcomeOK && s.fence.inTx && !s.fence.failed {
			s.fence.registered, s.fence.regLock, s.fence.regToken = true, lk, tok
		}
	}
}

func (f *fenceRecord) forgetRegistration() { f.registered = false }

func (f *fenceRecord) revert() {
	f.pend, f.cur = f.sess, f.sess
	f.saves, f.failed = nil, false
}

func (f *fenceRecord) commit() {
	f.sess = f.pend
	f.cur = f.pend
	f.saves, f.failed = nil, false
}

// apply records op, which ran (v is the value it set, resolved from the
// Bind's parameters for SetParams).
func (f *fenceRecord) apply(op rules.SettingOp, v string, local, null bool, which uint8) {
	f.inTx = true
	switch op.Kind {
	case rules.SetValue, rules.SetParams:
		if null {
			var d fenceValues
			d.copyFrom(f.defaults, which)
			v = d.token
			if which == rules.SettingLock {
				v = d.lock
			}
		}
		if !local {
			f.pend.set(which, v)
		}
		f.cur.set(which, v)
	case rules.SetDefault:
		if !op.Local {
			f.pend.copyFrom(f.defaults, which)
		}
		f.cur.copyFrom(f.defaults, which)
	case rules.ResetAll:
		f.pend, f.cur = f.defaults, f.defaults
	case rules.SetCurrent:
		f.pend.copyFrom(f.cur, which)
	case rules.TxBegin:
	case rules.TxCommit, rules.TxPrepare:
		f.forgetRegistration()
		if f.failed {
			f.revert() // COMMIT of a failed transaction rolls it back
		} else {
			f.commit()
		}
		f.inTx = op.Chain
	case rules.TxRollback:
		f.forgetRegistration()
		f.revert()
		f.inTx = op.Chain
	case rules.TxSavepoint:
		f.saves = append(f.saves, fenceSavepoint{name: op.Savepoint, pend: f.pend, cur: f.cur})
	case rules.TxRelease:
		if i := f.savepoint(op.Savepoint); i >= 0 {
			f.saves = f.saves[:i]
		}
	case rules.TxRollbackTo:
		// What the savepoint undid may include a registration.
		f.forgetRegistration()
		if i := f.savepoint(op.Savepoint); i >= 0 {
			f.pend, f.cur = f.saves[i].pend, f.saves[i].cur
			f.saves = f.saves[:i+1]
		}
		f.failed = false
	}
}

func (f *fenceRecord) savepoint(name string) int {
	for i := len(f.saves) - 1; i >= 0; i-- {
		if f.saves[i].name == name {
			return i
		}
	}
	return -1
}

// ready records a ReadyForQuery: 'I' ends the transaction (committed
// unless it failed or was rolled back).
func (f *fenceRecord) ready(status byte) {
	if status != 'T' {
		f.forgetRegistration()
	}
	switch status {
	case 'I':
		if f.inTx {
			if f.failed {
				f.revert()
			} else {
				f.commit()
			}
		}
		f.inTx, f.failed = false, false
	case 'T':
		f.inTx, f.failed = true, false
	case 'E':
		f.inTx, f.failed = true, true
	}
}

// ---- startup ----

// startupFenceValues reads the fence settings from the startup packet's
// parameters as PostgreSQL does: first the options parameter (split as
// pg_split_opts does, then -c name=value and --name=value), then every
// other parameter named like a setting, which wins.
func startupFenceValues(params map[string]string, which func(string) uint8) (v fenceValues, tok, lk bool) {
	set := func(name, val string) {
		switch which(name) {
		case rules.SettingToken:
			v.token, tok = val, true
		case rules.SettingLock:
			v.lock, lk = val, true
		}
	}
	for _, o := range startupOptionSettings(params["options"]) {
		set(o[0], o[1])
	}
	for k, val := range params {
		switch k {
		case "user", "database", "options", "replication", "application_name":
			continue
		}
		set(k, val)
	}
	return v, tok, lk
}

// splitOptions splits libpq's options string as the server's
// pg_split_opts does: white space separates arguments, a backslash makes
// the next byte literal.
func splitOptions(s string) []string {
	var out []string
	i := 0
	for i < len(s) {
		for i < len(s) && isCSpace(s[i]) {
			i++
		}
		if i >= len(s) {
			break
		}
		var b strings.Builder
		escaped := false
		for ; i < len(s); i++ {
			c := s[i]
			if isCSpace(c) && !escaped {
				break
			}
			if !escaped && c == '\\' {
				escaped = true
				continue
			}
			escaped = false
			b.WriteByte(c)
		}
		out = append(out, b.String())
	}
	return out
}

func isCSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}

// startupOptionSettings returns the name=value pairs that the server's
// command-line parsing of options sets (getopt with the postgres
// switches: -c and -- take name=value, in which '-' in the name reads as
// '_').
func startupOptionSettings(options string) [][2]string {
	const withArg = "BcCDdfhkNprStvW-"
	args := splitOptions(options)
	var out [][2]string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if len(a) < 2 || a[0] != '-' {
			break // getopt stops at the first non-option
		}
		if a == "--" {
			break
		}
		for j := 1; j < len(a); j++ {
			c := a[j]
			if !strings.ContainsRune(withArg, rune(c)) {
				continue
			}
			arg := a[j+1:]
			if arg == "" {
				if i+1 >= len(args) {
					return out
				}
				i++
				arg = args[i]
			}
			if c == 'c' || c == '-' {
				if name, val, ok := strings.Cut(arg, "="); ok {
					out = append(out, [2]string{strings.ReplaceAll(name, "-", "_"), val})
				}
			}
			break
		}
	}
	return out
}

// defaultsQuery reads the role's and database's settings (ALTER ROLE …
// SET, ALTER DATABASE … SET) from the catalog, not from the server
// connection's current values, which a transaction pooler may have left
// from another client.
const defaultsQuery = `SELECT s.setdatabase <> 0, s.setrole <> 0, c FROM pg_catalog.pg_db_role_setting s, pg_catalog.unnest(s.setconfig) c ` +
	`WHERE s.setrole IN (0, (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = pg_catalog.session_user())) ` +
	`AND s.setdatabase IN (0, (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database()))`

// readFenceDefaults runs defaultsQuery on the upstream before the relay
// starts (after the startup's ReadyForQuery, which the caller holds back)
// and applies what it finds below the startup packet's values, with
// PostgreSQL's precedence: database and role, role, database, all.
func (s *session) readFenceDefaults() error {
	f := &s.fence
	if err := writeMsg(s.uw, &pgproto3.Query{String: defaultsQuery}); err != nil {
		return upstreamErr(err)
	}
	if err := s.uw.Flush(); err != nil {
		return upstreamErr(err)
	}
	type found struct {
		rank int
		val  string
	}
	var best [2]*found
	for {
		typ, n, err := s.ur.header()
		if err != nil {
			return upstreamErr(err)
		}
		body, err := s.ur.body(n)
		if err != nil {
			return upstreamErr(err)
		}
		switch typ {
		case 'D':
			cols, ok := dataRowTexts(body)
			if !ok || len(cols) != 3 {
				continue
			}
			rank := 3
			switch {
			case cols[0] == "t" && cols[1] == "t":
				rank = 0
			case cols[1] == "t":
				rank = 1
			case cols[0] == "t":
				rank = 2
			}
			name, val, ok := strings.Cut(cols[2], "=")
			if !ok {
				continue
			}
			w := s.whichSetting(name)
			for k, bit := range []uint8{rules.SettingToken, rules.SettingLock} {
				if w == bit && (best[k] == nil || rank < best[k].rank) {
					best[k] = &found{rank, val}
				}
			}
		case 'Z':
			if best[0] != nil && !f.startupTok {
				f.defaults.token = best[0].val
			}
			if best[1] != nil && !f.startupLk {
				f.defaults.lock = best[1].val
			}
			f.sess, f.pend, f.cur = f.defaults, f.defaults, f.defaults
			return nil
		case 'E':
			// Unknown defaults read as unset: fenced writes are refused
			// for a missing token, never run with a guessed one.
		}
	}
}

func (s *session) whichSetting(name string) uint8 {
	switch {
	case strings.EqualFold(name, s.fence.tokenName):
		return rules.SettingToken
	case strings.EqualFold(name, s.fence.lockName):
		return rules.SettingLock
	}
	return 0
}

// dataRowTexts decodes a DataRow of text columns (NULL reads as "").
func dataRowTexts(b []byte) ([]string, bool) {
	if len(b) < 2 {
		return nil, false
	}
	n := int(binary.BigEndian.Uint16(b))
	b = b[2:]
	out := make([]string, 0, n)
	for i := 0; i < n; i++ {
		if len(b) < 4 {
			return nil, false
		}
		l := int(int32(binary.BigEndian.Uint32(b)))
		b = b[4:]
		if l < 0 {
			out = append(out, "")
			continue
		}
		if l > len(b) {
			return nil, false
		}
		out = append(out, string(b[:l]))
		b = b[l:]
	}
	return out, true
}

// ---- the statements that may change the settings ----

// mayChangeFence is the cheap test before a parse: whether sql may hold a
// statement that changes a fence setting or controls a transaction. It
// scans as PostgreSQL's lexer does (comments nest, quoted identifiers,
// strings, dollar quotes) and answers true for a statement that begins
// with SET, RESET, DISCARD, DO, PREPARE or a transaction command, for the
// word set_config anywhere, and whenever it cannot be sure (a backslash,
// a Unicode-escaped identifier). False positives only cost a parse.
func mayChangeFence(sql string) bool {
	if strings.IndexByte(sql, '\\') >= 0 {
		// Escape strings, or strings with standard_conforming_strings
		// off: where a string ends depends on settings.
		return true
	}
	start := true // at the start of a statement
	for i := 0; i < len(sql); {
		c := sql[i]
		switch {
		case isCSpace(c):
			i++
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-':
			for i < len(sql) && sql[i] != '\n' && sql[i] != '\r' {
				i++
			}
		case c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			depth := 0
			for i < len(sql) {
				if sql[i] == '/' && i+1 < len(sql) && sql[i+1] == '*' {
					depth++
					i += 2
				} else if sql[i] == '*' && i+1 < len(sql) && sql[i+1] == '/' {
					depth--
					i += 2
					if depth == 0 {
						break
					}
				} else {
					i++
				}
			}
		case c == ';':
			start = true
			i++
		case c == '\'':
			i = skipQuoted(sql, i, '\'')
			start = false
		case c == '"':
			j := skipQuoted(sql, i, '"')
			if strings.EqualFold(sql[i:j], `"set_config"`) {
				return true
			}
			i, start = j, false
		case c == '$':
			j, ok := dollarQuoteEnd(sql, i)
			if !ok {
				i++ // a parameter ($1) or a lone dollar
			} else {
				i = j
			}
			start = false
		case isIdentStart(c):
			j := i
			for j < len(sql) && isIdentCont(sql[j]) {
				j++
			}
			w := sql[i:j]
			if (len(w) == 1 || len(w) == 2) && (w[0]|0x20 == 'u' || w[0]|0x20 == 'e' || w[0]|0x20 == 'b' || w[0]|0x20 == 'x' || w[0]|0x20 == 'n') && j < len(sql) && (sql[j] == '&' || sql[j] == '\'') {
				if sql[j] == '&' {
					return true // U&"…" or U&'…': escapes the proxy does not decode here
				}
				// E'…', B'…', X'…', N'…': a string constant follows.
			}
			if strings.EqualFold(w, "set_config") {
				return true
			}
			if start && statementWord(w) {
				return true
			}
			i, start = j, false
		default:
			i++
			start = false
		}
	}
	return false
}

func statementWord(w string) bool {
	switch strings.ToLower(w) {
	case "set", "reset", "discard", "do", "prepare", "begin", "start", "commit", "end", "rollback", "abort", "savepoint", "release":
		return true
	}
	return false
}

func isIdentStart(c byte) bool {
	return c == '_' || c >= 0x80 || ('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z')
}

func isIdentCont(c byte) bool { return isIdentStart(c) || c == '$' || ('0' <= c && c <= '9') }

// skipQuoted returns the index after the quoted text at sql[i] (doubled
// quotes stay inside); an unterminated one runs to the end.
func skipQuoted(sql string, i int, q byte) int {
	for j := i + 1; j < len(sql); j++ {
		if sql[j] == q {
			if j+1 < len(sql) && sql[j+1] == q {
				j++
				continue
			}
			return j + 1
		}
	}
	return len(sql)
}

// dollarQuoteEnd reports whether a dollar-quoted string starts at sql[i]
// and returns the index after it.
func dollarQuoteEnd(sql string, i int) (int, bool) {
	if i > 0 && isIdentCont(sql[i-1]) {
		return 0, false // part of an identifier (a$b)
	}
	j := i + 1
	if j < len(sql) && isIdentStart(sql[j]) {
		for j < len(sql) && isIdentCont(sql[j]) && sql[j] != '$' {
			j++
		}
	}
	if j >= len(sql) || sql[j] != '$' {
		return 0, false
	}
	tag := sql[i : j+1]
	k := strings.Index(sql[j+1:], tag)
	if k < 0 {
		return len(sql), true
	}
	return j + 1 + k + len(tag), true
}

// ---- applying the record ----

// errFenceUnknown refuses a statement whose effect on the settings cannot
// be known.
func refuseFenceUnknown(why string) *pgproto3.ErrorResponse {
	return refusePrepared("cannot tell what this statement sets the fence settings to: "+why,
		"Set the token and the lock with SET, SET LOCAL, RESET, or SELECT set_config(…) with constants or parameters, in a statement of their own.")
}

// quoteFenceValue quotes v as a string constant that reads the same in
// every session: a plain one when it has no quote or backslash, else a
// dollar-quoted one with a tag v does not contain.
func quoteFenceValue(v string) string {
	if !strings.ContainsAny(v, `'\`) {
		return "'" + v + "'"
	}
	for n := 0; ; n++ {
		tag := "$fp" + strings.Repeat("x", n) + "$"
		// The first occurrence of the tag after the opening one must be
		// the closing one.
		if strings.Index(v+tag, tag) == len(v) {
			return tag + v + tag
		}
	}
}

// simplePrelude is the text put before a simple Query's text on a
// protected table: two statements, each answering one CommandComplete.
func (f *fenceRecord) simplePrelude() string {
	return "SET LOCAL " + f.tokenName + " = " + quoteFenceValue(f.cur.token) + ";SET LOCAL " + f.lockName + " = " + quoteFenceValue(f.cur.lock) + ";"
}

// preludeSQL is the extended protocol's: set_config(…, true) of both, in
// a SELECT that returns no row (OFFSET 1 still evaluates the one row's
// target list), so the Execute answers with a CommandComplete alone.
const preludeSQL = "SELECT pg_catalog.set_config($1, $2, true), pg_catalog.set_config($3, $4, true) OFFSET 1"

// textOIDs are the prelude's parameter types.
var textOIDs = []uint32{25, 25, 25, 25}

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
func (s *session) fenceOps(sql string) (fenceText, *pgproto3.ErrorResponse) {
	var ft fenceText
	if !s.fence.on || !mayChangeFence(sql) {
		return ft, nil
	}
	sp := s.srv.opts.Policy.(SettingsPolicy)
	var err error
	var panicked bool
	s.offLoop(func() {
		defer func() {
			if r := recover(); r != nil {
				s.logPolicyPanic("policy panicked reading fence settings; statement refused", r)
				panicked = true
			}
		}()
		ft.st, err = sp.SettingOps(sql)
	})
	if panicked {
		return ft, refusePrepared("internal error reading the statement's fence settings", "")
	}
	if err != nil {
		// It does not parse: the server refuses it, and nothing changes.
		return fenceText{}, nil
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

// fenceDone returns the callback that records a's outcome. Callers hold
// s.mu.
func (s *session) fenceDone(a fenceApplied) func(outcome) {
	f := &s.fence
	f.unresolved++
	return func(o outcome) {
		f.unresolved--
		if o == outcomeOK {
			f.apply(a.op, a.value, a.local, a.null, a.which)
		}
		if f.unresolved == 0 {
			s.idleCond.Broadcast()
			s.wakeIdleLocked()
		}
	}
}

// fenceLost is called, with s.mu held, when the response bookkeeping gives
// up: the record can no longer be trusted, and statements on protected
// tables are refused.
func (s *session) fenceLost() {
	s.fence.unresolved = 0
	s.fence.broken = true
}

// fenceWait waits until every operation on the settings sent so far is
// answered, so that the record is what the server holds. The server may
// hold extended-protocol answers until a Sync or Flush: a Flush is sent.
func (s *session) fenceWait() error {
	s.mu.Lock()
	pending := s.fence.unresolved > 0
	unsynced := s.state.unsynced
	s.mu.Unlock()
	if !pending {
		return nil
	}
	if unsynced {
		if err := writeRaw(s.uw, 'H', nil); err != nil {
			return upstreamErr(err)
		}
	}
	if err := s.uw.Flush(); err != nil {
		return upstreamErr(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.waitLocked(func() bool { return s.fence.unresolved > 0 && !s.state.finishing })
	if s.state.finishing {
		return errSessionDone
	}
	return nil
}

// fenceReady waits for the record, then reports the lock name in force and
// whether the record can be used.
func (s *session) fenceReady() (lockNamed bool, ok bool, err error) {
	if err := s.fenceWait(); err != nil {
		return false, false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fence.cur.lock != "", !s.fence.broken, nil
}

var errFenceBroken = refusePrepared("the proxy lost track of this session's fence settings; reconnect", "")

// sendPrelude sends, before a client's Bind of a statement on a protected
// table, the session's own values as transaction-local settings: Close of
// what an earlier prelude left, then Parse, Bind and Execute of preludeSQL
// under the proxy's own name, parsed again every time so that nothing the
// session did in between (a DEALLOCATE and PREPARE of the name in a
// function) can stand in for it. Its responses are not relayed.
func (s *session) sendPrelude() error {
	ps := s.ps
	s.mu.Lock()
	if s.state.finishing {
		s.mu.Unlock()
		return errSessionDone
	}
	name := ps.preludeName
	vals := s.fence.cur
	tok, lk := s.fence.tokenName, s.fence.lockName
	ps.expect('3', nil)
	ps.countSent('C')
	ps.addStmtOp(name, nil, false, '3', false, 0)
	ps.countSent('C')
	ps.expect('1', nil)
	ps.countSent('P')
	ps.expect('2', nil)
	ps.countSent('B')
	ps.expect('C', nil)
	ps.countSent('E')
	// Closed again at once: the session's statements stay the client's.
	ps.addStmtOp(name, nil, false, '3', false, 0)
	ps.countSent('C')
	s.state.rewrote = true
	s.mu.Unlock()
	msgs := []encoder{
		&pgproto3.Close{ObjectType: 'P', Name: name},
		&pgproto3.Close{ObjectType: 'S', Name: name},
		&pgproto3.Parse{Name: name, Query: preludeSQL, ParameterOIDs: textOIDs},
		&pgproto3.Bind{DestinationPortal: name, PreparedStatement: name,
			Parameters: [][]byte{[]byte(tok), []byte(vals.token), []byte(lk), []byte(vals.lock)}},
		&pgproto3.Execute{Portal: name},
		&pgproto3.Close{ObjectType: 'S', Name: name},
	}
	for _, m := range msgs {
		if err := writeMsg(s.uw, m); err != nil {
			return upstreamErr(err)
		}
	}
	return nil
}

// bindParams decodes a Bind's parameters: their formats and values (nil:
// NULL). The values alias body.
func bindParams(body []byte) (formats []int16, values [][]byte, ok bool) {
	_, rest, ok1 := cstringView(body)
	_, rest, ok2 := cstringView(rest)
	if !ok1 || !ok2 || len(rest) < 2 {
		return nil, nil, false
	}
	nf := int(binary.BigEndian.Uint16(rest))
	rest = rest[2:]
	if len(rest) < 2*nf+2 {
		return nil, nil, false
	}
	for i := 0; i < nf; i++ {
		formats = append(formats, int16(binary.BigEndian.Uint16(rest[2*i:])))
	}
	rest = rest[2*nf:]
	np := int(binary.BigEndian.Uint16(rest))
	rest = rest[2:]
	for i := 0; i < np; i++ {
		if len(rest) < 4 {
			return nil, nil, false
		}
		l := int(int32(binary.BigEndian.Uint32(rest)))
		rest = rest[4:]
		if l < 0 {
			values = append(values, nil)
			continue
		}
		if l > len(rest) {
			return nil, nil, false
		}
		values = append(values, rest[:l:l])
		rest = rest[l:]
	}
	return formats, values, true
}

// resolveBindOps gives the operations of a statement their values from a
// Bind's parameters. ok is false when they cannot be read (the Bind is
// then refused).
func (s *session) resolveBindOps(ops []rules.SettingOp, body []byte) ([]fenceApplied, bool) {
	if len(ops) == 0 {
		return nil, true
	}
	formats, values, ok := bindParams(body)
	if !ok {
		return nil, false
	}
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
				a.which = s.whichSetting(string(v))
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

// fencedDecision reports whether a text decided d runs something on a
// protected table that reads the fence settings: a rewrite, a lock
// registration, or an EXECUTE of a prepared statement (which may be one).
func fencedDecision(d *Decision, words prepWords) bool {
	return d.Action == Rewrite || (d.Action != Refuse && d.Lock != nil) || words.execute
}

// registers reports whether a decision's lock registration is sent in a
// session that names a lock as lockNamed says.
func registers(l *LockRegistration, lockNamed bool) bool {
	return l != nil && len(l.Calls) > 0 && (lockNamed || l.Required)
}

// fenceDecide reads what a Query's or Parse's text does to the fence
// settings (refusing it when that cannot be known), and, for a text on a
// protected table, waits until the record is what the server holds, so
// that the values applied before it and the decision to register the
// lock are the session's own.
func (s *session) fenceDecide(typ byte, d *Decision, ft *fenceText, sql string, words prepWords) error {
	var refusal *pgproto3.ErrorResponse
	*ft, refusal = s.fenceOps(sql)
	fenced := fencedDecision(d, words)
	switch {
	case refusal != nil:
	case typ == 'Q' && fenced && ft.statementAfterEnd():
		refusal = refusePrepared("a statement on a protected table follows a COMMIT, ROLLBACK or ROLLBACK TO in the same Query",
			"Send the statements after the end of the transaction in a Query of their own.")
	case typ == 'Q' && !fenced && mayWrite(sql) && s.srv.opts.Policy.(SettingsPolicy).SettingsEverywhere(&s.info):
		_, ok, err := s.fenceReady()
		if err != nil {
			return err
		}
		if !ok {
			refusal = errFenceBroken
		}
		ft.prelude = true
	case fenced && typ == 'Q':
		named, ok, err := s.fenceReady()
		if err != nil {
			return err
		}
		if !ok {
			refusal = errFenceBroken
		}
		s.lockNamed = named || ft.lock
		// A read of a lock-fenced table that registers nothing in this
		// session reads no setting: it goes as sent.
		ft.prelude = d.Action == Rewrite || words.execute || registers(d.Lock, s.lockNamed)
	}
	if refusal != nil {
		*d = Decision{Action: Refuse, Refusal: refusal, Tables: d.Tables}
		*ft = fenceText{}
	}
	return nil
}

// mayWrite reports whether a text's first statement may write through
// code the proxy does not see (a function in a query, a trigger): it
// starts with SELECT, WITH, INSERT, UPDATE, DELETE, MERGE, VALUES, TABLE,
// EXECUTE or COPY. CALL and DO are left out: a procedure or DO block may
// commit, which it cannot inside the transaction the settings open.
func mayWrite(sql string) bool {
	i := 0
	for i < len(sql) {
		switch c := sql[i]; {
		case isCSpace(c) || c == '(':
			i++
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-':
			for i < len(sql) && sql[i] != '\n' {
				i++
			}
		case c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			depth := 0
			for i < len(sql) {
				if sql[i] == '/' && i+1 < len(sql) && sql[i+1] == '*' {
					depth++
					i += 2
				} else if sql[i] == '*' && i+1 < len(sql) && sql[i+1] == '/' {
					depth--
					i += 2
					if depth == 0 {
						break
					}
				} else {
					i++
				}
			}
		default:
			j := i
			for j < len(sql) && isIdentCont(sql[j]) {
				j++
			}
			switch strings.ToLower(sql[i:j]) {
			case "select", "with", "insert", "update", "delete", "merge", "values", "table", "execute", "copy":
				return true
			}
			return false
		}
	}
	return false
}
