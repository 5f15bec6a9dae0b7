package proxy

import (
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Hooks let a caller observe what the relay does without the relay knowing
// about Prometheus. Every method must be safe for concurrent use and cheap.
type Hooks interface {
	SessionOpened()
	SessionClosed()
	UpstreamConnectFailed()
	// Statement is called once for each Query or Parse message with the
	// decision taken for it and the time the decision took. d is passed by
	// value so that no decision escapes to the heap on the relay's path.
	Statement(info *SessionInfo, d Decision, took time.Duration)
}

// AcceptHooks is an optional Hooks extension: AcceptFailed is called for
// each failed Accept that Serve retries (out of file descriptors, for
// instance).
type AcceptHooks interface {
	AcceptFailed(err error)
}

// TimingHooks is an optional Hooks extension for durations.
// UpstreamConnected is called after each successful connection to the
// upstream (dial and TLS negotiation, before the startup packet is sent);
// SessionEnded when a session that SessionOpened announced ends, with the
// time since it was accepted.
type TimingHooks interface {
	UpstreamConnected(took time.Duration)
	SessionEnded(lasted time.Duration)
}

// Action is what the relay does with a statement: the rewriter's own
// (rules.Forward sends the client's message unchanged, rules.Rewrite sends
// Decision.SQL instead, rules.Refuse executes nothing and answers with
// Decision.Refusal).
type Action = rules.Action

// The actions, under the relay's names.
const (
	Forward = rules.Forward
	Rewrite = rules.Rewrite
	Refuse  = rules.Refuse
)

// Decision is a Policy's verdict on one statement.
type Decision struct {
	Action  Action
	SQL     string                  // for Rewrite
	Refusal *pgproto3.ErrorResponse // for Refuse: ERROR severity, with a SQLSTATE
	Tables  []string                // protected tables involved, for logs
	// Lock, on a Forward or Rewrite, is the lock registration the
	// statement needs in sessions that name a lock (see LockPolicy).
	Lock *LockRegistration
	// Preparable, on a Rewrite of a Query's text, says that the text is
	// one statement that returns no rows and has no parameters (nor
	// constants fixed at analysis from the clock or the catalogs), so that
	// a named prepared statement of what the policy decides for the text
	// with Lexing.Prepared answers Bind and Execute as the Query would be
	// answered. The relay then runs a text a session repeats that way
	// (Options.AutoPrepare).
	Preparable bool
}

// LockRegistration is a statement that must run in the same transaction
// just before the client's statement, in sessions that may have named a
// lock (LockPolicy.NamesLock) or always when Required. Its results are not
// relayed; its error, if it fails, is the client's statement's error.
type LockRegistration struct {
	// Call is the statement to run before a single statement (a Parse's,
	// at each Bind of it), without a semicolon.
	Call string
	// Query is the whole text to send instead of a simple Query's, with
	// the registration statements in place, at the indexes Calls of its
	// list of statements; each answers with one CommandComplete. With no
	// Calls the text needs no registration now (it only prepares a
	// statement that needs Call when it is executed).
	Query string
	Calls []int
	// Required: the registration runs in every session.
	Required bool
	// Audit: a registration in audit mode, which may return without
	// registering (so it does not spare a later one, settings.go).
	Audit bool
	// Catalog: not a lock registration but a check of the catalog stamp,
	// which reads no fence setting (the session's values need not go
	// before it).
	Catalog bool
	// Pre, with a lock registration, is the catalog stamp's check: a
	// statement that runs just before it (Query has it in front of the
	// registrations, at Calls[0]) and also where the registration is
	// spared or not needed.
	Pre string
}

// LockPolicy is an optional Policy extension for lock fencing: a session
// registers its lock only once it may have named one, which NamesLock
// tells from the statement texts and startup parameters it sends.
type LockPolicy interface {
	// NamesLock reports, conservatively, whether text may set the
	// session variable holding the lock's name (it mentions its name).
	NamesLock(info *SessionInfo, text string) bool
}

// Policy is the hook where statements are inspected. Implementations must
// be safe for concurrent use; Decide is called for every Query and Parse
// message, so it must be fast for statements it does not care about.
//
// The SQL texts passed to Policy and its extensions (Decide, MayTouch,
// PreparedOps, NamesLock) may alias the relay's read buffer, to spare a
// copy per message: they are valid only during the call, and an
// implementation that keeps one (in a cache, say) must copy it first
// (strings.Clone). PreparedOps' results may alias the text
// (PreparedOp.Text does): the relay copies what it keeps of them. A
// Decision must not: the relay keeps parts of it (the lock registration,
// the refusal) past the message.
type Policy interface {
	// Decide returns the decision for one SQL text (a Query's string,
	// possibly several statements, or a Parse's statement), which the
	// server will tokenize as lex says.
	Decide(info *SessionInfo, lex Lexing, sql string) Decision
	// TranslateError may rewrite an upstream ErrorResponse in place (e.g.
	// the error a rewritten statement raised on purpose) and reports
	// whether it did. It is only called for errors whose raw form mentions
	// "fenceproxy", so it need not be fast.
	TranslateError(info *SessionInfo, e *pgproto3.ErrorResponse) bool
}

// QuickPolicy is an optional Policy extension for sessions relayed on an
// event loop, where one session's wait holds up every session of its loop.
// DecideQuick returns Decide's answer when it costs little (no parse, no
// wait for the network or the database), and false otherwise; then the
// relay runs Decide in a goroutine of its own while the session waits. A
// policy without it has every decision made off the loop.
type QuickPolicy interface {
	DecideQuick(info *SessionInfo, lex Lexing, sql string) (Decision, bool)
}

// MayTouchPolicy is an optional Policy extension: MayTouch reports, cheaply
// and conservatively, whether Decide could do anything but forward sql
// unchanged whatever the Lexing. The relay then does not wait for the
// server's exact lexing settings before deciding on statements that cannot
// matter.
type MayTouchPolicy interface {
	MayTouch(info *SessionInfo, sql string) bool
}

// PreparedPolicy is an optional Policy extension for a policy whose rules
// can change while sessions run (a reload). A statement prepared under
// older rules must not run under them: the relay remembers, per prepared
// statement and portal, the generation of the rules it was decided under,
// and decides again when the generation has changed since.
type PreparedPolicy interface {
	// Generation identifies the rules in force. It changes at every
	// reload and never goes back; a Decide that starts after Generation
	// returned g decides under rules of generation g or later.
	Generation() uint64
	// PreparedOps lists the statements of sql that define, run or remove
	// SQL-level prepared statements (PREPARE, EXECUTE, DEALLOCATE, DISCARD
	// ALL). An error means sql does not parse.
	PreparedOps(sql string) ([]PreparedOp, error)
}

// PreparedOpKind and PreparedOp are the rewriter's: a SQL-level
// prepared-statement operation of a text (PREPARE, EXECUTE, DEALLOCATE),
// found by rules.PreparedOps.
type (
	PreparedOpKind = rules.PreparedOpKind
	PreparedOp     = rules.PreparedOp
)

// The operation kinds, under the relay's names.
const (
	OpPrepare       = rules.OpPrepare
	OpExecute       = rules.OpExecute
	OpDeallocate    = rules.OpDeallocate
	OpDeallocateAll = rules.OpDeallocateAll
)

// Lexing is what decides how PostgreSQL splits SQL text into tokens, as the
// server last reported it for the session, and how it will use the text.
type Lexing struct {
	// StandardConformingStrings: with it off, a backslash escapes in
	// ordinary '...' literals, so the same text holds different tokens.
	StandardConformingStrings bool
	// ClientEncoding is the session's client_encoding: in encodings such
	// as SJIS or GBK a byte >= 0x80 may be followed by an ASCII byte
	// (even a backslash) that belongs to the same character.
	ClientEncoding string
	// Uncertain is set when earlier extended-protocol messages, not yet
	// synced, may change either setting before this statement is parsed.
	Uncertain bool
	// Backslash and NonASCII say whether the SQL text has a backslash or a
	// byte >= 0x80: only those can be read differently by the settings
	// above.
	Backslash, NonASCII bool
	// Prepared is set for the text of a named prepared statement (a Parse
	// with a name): the server analyses it once and may execute it many
	// times, so a policy may choose a rewrite that costs the server more to
	// analyse and less to execute. It does not change what is fenced.
	Prepared bool
}

// forwardAll is the Policy used when none is configured.
type forwardAll struct{}

func (forwardAll) Decide(*SessionInfo, Lexing, string) Decision              { return Decision{} }
func (forwardAll) TranslateError(*SessionInfo, *pgproto3.ErrorResponse) bool { return false }

// DecideQuick implements QuickPolicy: forwarding needs no work.
func (forwardAll) DecideQuick(*SessionInfo, Lexing, string) (Decision, bool) {
	return Decision{}, true
}

// SessionInfo describes a client session for logging and metrics. It is set
// once the startup packet is read and not changed afterwards.
type SessionInfo struct {
	ID              uint64
	RemoteAddr      string
	User            string
	Database        string
	ApplicationName string // as sent in the startup packet
	// BackendPID is the upstream server process serving the session, from
	// BackendKeyData.
	BackendPID uint32
}

type nopHooks struct{}

func (nopHooks) SessionOpened()                                  {}
func (nopHooks) SessionClosed()                                  {}
func (nopHooks) UpstreamConnectFailed()                          {}
func (nopHooks) Statement(*SessionInfo, Decision, time.Duration) {}
