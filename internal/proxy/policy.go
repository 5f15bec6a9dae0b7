package proxy

import (
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Hooks let a caller observe what the relay does without the relay knowing
// about Prometheus. Every method must be safe for concurrent use and cheap.
// NopHooks implements them all; embed it to observe only some.
type Hooks interface {
	SessionOpened()
	SessionClosed()
	// SessionEnded is called when a session that SessionOpened announced
	// ends, with the time since it was accepted.
	SessionEnded(lasted time.Duration)
	// UpstreamConnected is called after each successful connection to the
	// upstream (dial and TLS negotiation, before the startup packet is
	// sent); UpstreamConnectFailed after each failed one.
	UpstreamConnected(took time.Duration)
	UpstreamConnectFailed()
	// AcceptFailed is called for each failed Accept that Serve retries
	// (out of file descriptors, for instance).
	AcceptFailed(err error)
	// Statement is called once for each Query or Parse message with the
	// decision taken for it and the time the decision took. d is passed by
	// value so that no decision escapes to the heap on the relay's path.
	Statement(info *SessionInfo, d rules.Decision, took time.Duration)
}

// NopHooks observes nothing.
type NopHooks struct{}

func (NopHooks) SessionOpened()                                        {}
func (NopHooks) SessionClosed()                                        {}
func (NopHooks) SessionEnded(time.Duration)                            {}
func (NopHooks) UpstreamConnected(time.Duration)                       {}
func (NopHooks) UpstreamConnectFailed()                                {}
func (NopHooks) AcceptFailed(error)                                    {}
func (NopHooks) Statement(*SessionInfo, rules.Decision, time.Duration) {}

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

// A Policy's verdict on one statement is the rewriter's rules.Decision:
// the relay sends the client's message (Forward), Decision.SQL instead
// (Rewrite), or executes nothing and answers with Decision.Err (Refuse).
// Its Lock, on a Forward or Rewrite, is the registration (rules.LockCall)
// the statement needs in sessions that may have named a lock, or always
// when Required: a statement that runs in the same transaction just before
// the client's, whose results are not relayed and whose error, if it
// fails, is the client's statement's error. Preparable, on a Rewrite of a
// Query's text, lets the relay run a text a session repeats as a named
// prepared statement of what the policy decides for it with
// Lexing.Prepared (Options.AutoPrepare). Decisions may be shared: the
// relay never changes one it is given, and keeps parts of it (the
// registration, the refusal) past the message.

// Policy is the hook where statements are inspected. Implementations must
// be safe for concurrent use; Decide is called for every Query and Parse
// message, so it must be fast for statements it does not care about.
// BasePolicy answers every method but Decide conservatively: embed it to
// write a policy that only decides.
//
// The SQL texts passed to a Policy may alias the relay's read buffer, to
// spare a copy per message: they are valid only during the call, and an
// implementation that keeps one (in a cache, say) must copy it first
// (strings.Clone). PreparedOps' results may alias the text (PreparedOp.Text
// does): the relay copies what it keeps of them. A Decision must not: the
// relay keeps parts of it (the lock registration, the refusal) past the
// message.
type Policy interface {
	// Decide returns the decision for one SQL text (a Query's string,
	// possibly several statements, or a Parse's statement), which the
	// server will tokenize as lex says. It may keep in info.Memo what lets
	// it answer the same text again at less cost, and must then answer as
	// it would without it.
	Decide(info *SessionInfo, lex Lexing, sql string) rules.Decision
	// DecideQuick returns Decide's answer when it costs little (no parse,
	// no wait for the network or the database), and false otherwise. On an
	// event loop, where one session's wait holds up every session of its
	// loop, the relay then runs Decide in a goroutine of its own while the
	// session waits.
	DecideQuick(info *SessionInfo, lex Lexing, sql string) (rules.Decision, bool)
	// MayTouch reports, cheaply and conservatively, whether Decide could
	// do anything but forward sql unchanged whatever the Lexing. The relay
	// does not wait for the server's exact lexing settings before deciding
	// on statements that cannot matter.
	MayTouch(info *SessionInfo, sql string) bool
	// DecisionCost returns the memory, in bytes, that deciding sql may
	// hold at once while it is decided: 0 for a text it forwards without
	// a look, up to thousands of times its size for one it parses. It
	// must be cheap (no parse, no allocation). The relay asks for it for
	// texts over 512 bytes and charges it to the large-message budget for
	// texts over 64 KiB, and for shorter ones when it is over 4 MiB; so
	// deciding a text of at most 512 bytes must hold less than 4 MiB.
	DecisionCost(info *SessionInfo, sql string) int64
	// TranslateError may rewrite an upstream ErrorResponse in place (e.g.
	// the error a rewritten statement raised on purpose) and reports
	// whether it did. It is only called for errors whose raw form mentions
	// "fenceproxy", so it need not be fast.
	TranslateError(info *SessionInfo, e *pgproto3.ErrorResponse) bool

	// Generation identifies the rules in force, for rules that can change
	// while sessions run (a reload). It changes at every reload and never
	// goes back; a Decide that starts after Generation returned g decides
	// under rules of generation g or later. A statement prepared under
	// older rules must not run under newer ones: the relay remembers, per
	// prepared statement and portal, the generation it was decided under,
	// and decides again when it has changed since. database is the
	// session's: a change that concerns one database's sessions only (its
	// catalog) need not move the others' generation.
	Generation(database string) uint64
	// PreparedOps lists the statements of sql that define, run or remove
	// SQL-level prepared statements (PREPARE, EXECUTE, DEALLOCATE, DISCARD
	// ALL). An error means sql does not parse.
	PreparedOps(sql string) ([]PreparedOp, error)

	// NamesLock reports, conservatively, whether text may set the session
	// variable holding the lock's name (it mentions its name): a session
	// registers its lock only once it may have named one.
	NamesLock(info *SessionInfo, text string) bool
	// FenceSettings returns the token and lock settings' names, "" when
	// the rules fence nothing (then the proxy keeps no record of them).
	FenceSettings() (token, lock string)
	// SettingOps returns what sql does to the fence settings.
	SettingOps(sql string) (rules.SettingText, error)
	// SettingsEverywhere reports whether every statement that may write
	// needs the session's values in this session's database (the database
	// guard reads them on the server for writes the proxy cannot see).
	SettingsEverywhere(info *SessionInfo) bool
	// CodeReadsSettings reports whether code in this session's database
	// may read the fence settings on the server (a trigger, a default, a
	// function): where it does not, a simple Query whose fences carry the
	// session's token and that registers nothing reads no setting, and
	// goes without the session's values in front of it.
	CodeReadsSettings(info *SessionInfo) bool

	// Idle is called when the session has no transaction open and nothing
	// in flight: at a ReadyForQuery with status idle that answers the last
	// message sent upstream, and once when the session ends. It must be
	// cheap: it runs once per transaction.
	Idle(info *SessionInfo)
}

// BasePolicy forwards everything and answers the other methods of Policy
// conservatively: nothing is quick, every text may matter, the rules never
// change, no text prepares statements, names a lock or sets a fence
// setting.
type BasePolicy struct{}

func (BasePolicy) Decide(*SessionInfo, Lexing, string) rules.Decision { return rules.Decision{} }
func (BasePolicy) DecideQuick(*SessionInfo, Lexing, string) (rules.Decision, bool) {
	return rules.Decision{}, false
}
func (BasePolicy) MayTouch(*SessionInfo, string) bool                        { return true }
func (BasePolicy) DecisionCost(_ *SessionInfo, sql string) int64             { return int64(len(sql)) }
func (BasePolicy) TranslateError(*SessionInfo, *pgproto3.ErrorResponse) bool { return false }
func (BasePolicy) Generation(string) uint64                                  { return 0 }
func (BasePolicy) PreparedOps(string) ([]PreparedOp, error)                  { return nil, nil }
func (BasePolicy) NamesLock(*SessionInfo, string) bool                       { return false }
func (BasePolicy) FenceSettings() (token, lock string)                       { return "", "" }
func (BasePolicy) SettingOps(string) (rules.SettingText, error)              { return rules.SettingText{}, nil }
func (BasePolicy) Idle(*SessionInfo)                                         {}
func (BasePolicy) SettingsEverywhere(*SessionInfo) bool                      { return false }
func (BasePolicy) CodeReadsSettings(*SessionInfo) bool                       { return true }

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

// Lexing is what decides how PostgreSQL splits a text into tokens, as the
// server last reported it for the session, and how it will use the text:
// the rewriter's own type.
type Lexing = rules.Lexing

// forwardAll is the Policy used when none is configured: it forwards
// everything at once, and a session under it keeps no record of prepared
// statements or settings.
type forwardAll struct{ BasePolicy }

// DecideQuick: forwarding needs no work.
func (forwardAll) DecideQuick(*SessionInfo, Lexing, string) (rules.Decision, bool) {
	return rules.Decision{}, true
}

// MayTouch: nothing is ever changed.
func (forwardAll) MayTouch(*SessionInfo, string) bool { return false }

// DecisionCost: nothing is looked at.
func (forwardAll) DecisionCost(*SessionInfo, string) int64 { return 0 }

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
	// Memo is the session's own place for the policy to keep what it may
	// reuse from one of the session's decisions in the next (Policy.Decide
	// says what): set when the session starts, nil where the caller keeps
	// none.
	Memo *DecisionMemo
}

// DecisionMemo holds what a policy keeps for one session between its
// decisions, which the relay makes one at a time: only the session's own
// calls of Decide and DecideQuick read or write it, so it needs no lock.
type DecisionMemo struct {
	V any
}
