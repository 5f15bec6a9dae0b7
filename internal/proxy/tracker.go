package proxy

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
)

// tracker is a session's bookkeeping, apart from its I/O: what has been
// sent and answered (relayState), the prepared statements and portals of
// the client and of the proxy (preparedState), the record of the fence
// settings (fenceRecord), how the server reads SQL (Lexing), and the
// refusals whose errors are on their way. Its methods decide and record;
// they send nothing, and wait only for the server to catch up (on the
// session's event loop, if it has one). The session embeds it and does
// the I/O.
type tracker struct {
	srv *Server
	// pol is the server's policy.
	pol  Policy
	info SessionInfo // written during startup only; read by others once state.relaying
	log  *zap.Logger // guarded by mu
	// since is when the connection was accepted.
	since time.Time
	// fenced and refused count the statements the policy rewrote and
	// refused, for Server.Sessions.
	fenced, refused atomic.Uint64

	mu       sync.Mutex
	state    relayState
	refusals map[uint64]*rules.Error
	nextRef  uint64
	// staleAt is the token and the table that an error of
	// fenceproxy.stale_at is for: those of the token forms calling it
	// that were sent and may not be answered yet (staleAtForLocked).
	staleAt staleAtContext
	// bare is the token of the last Bind that went without the session's
	// values (goesBare).
	bare bareToken

	// lockNamed: the session may have named a lock (Policy.NamesLock),
	// from its startup parameters or a statement it sent; from then on
	// statements that need a lock registration get it. Written before the
	// relay starts and then by the client-to-upstream goroutine only.
	lockNamed bool
	// fence is the record of the session's fence settings (settings.go);
	// guarded by mu.
	fence fenceRecord
	// lex is how the server tokenizes SQL, from ParameterStatus; guarded
	// by mu.
	lex Lexing
	// ps tracks prepared statements and portals across rules reloads,
	// when the policy's rules can change (Policy.Generation); guarded by
	// mu. Nil under the default policy, which forwards everything.
	ps *preparedState

	// nonce makes refusal markers unguessable by the client.
	nonce string

	// idleCond is signalled (with mu) at each ReadyForQuery and at close;
	// relaySQL waits on it for the server to catch up (see lexing).
	idleCond *sync.Cond
	// loop is the event loop relaying the session (nil before, or when
	// the connections cannot be on one); set with state.relaying.
	loop *loop
	// idleWaiter is the task parked in waitLocked; guarded by mu.
	idleWaiter *task
}

// staleAtContext is what a token form's stale-row error leaves out
// (rules.TokenForm.StaleTable).
type staleAtContext struct{ token, table string }

// staleAtForLocked reports whether a token form whose stale-row errors are for
// table ("" when they name their own) may be sent with token: its errors
// come back without either, and the session keeps one pair to fill in
// (rules.ExpandStaleAt). The pair is replaced only when every statement
// sent before has been answered, so it is the pair of every form whose
// error may still come back; while an earlier form of another pair may,
// the text goes in the form that reads the token on the server, whose
// errors carry everything. t.mu is held.
func (t *tracker) staleAtForLocked(token, table string) bool {
	if table == "" {
		return true
	}
	want := staleAtContext{token, table}
	if t.staleAt == want {
		return true
	}
	if t.state.inFlight != 0 || t.state.unsynced || t.state.desync {
		return false
	}
	t.staleAt = want
	return true
}

// completeStale completes a stale-row error of a statement the relay
// sent: the token and the table a token form's fenceproxy.stale_at
// leaves out (rules.ExpandStaleAt), or the token fenceproxy.stale read
// from a setting that a Bind without the session's values did not set
// (rules.WithStaleToken, bare.go): the error arrives before the
// ReadyForQuery that ends that Bind's segment, and nothing else in the
// segment raises one.
func (t *tracker) completeStale(e *pgproto3.ErrorResponse) {
	if e.Code != rules.CodeStaleToken {
		return
	}
	t.mu.Lock()
	at, b := t.staleAt, t.bare
	bare := b.tok != "" && t.ps != nil && t.ps.recvSeg == b.seg
	t.mu.Unlock()
	if bare {
		if m, ok := rules.WithStaleToken(e.Message, b.tok); ok {
			e.Message = m
			return
		}
	}
	e.Message, _ = rules.ExpandStaleAt(e.Message, at.token, at.table)
}
