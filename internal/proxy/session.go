package proxy

import (
	"crypto/rand"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/rules"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

const (
	ioBufferSize = 32 << 10
	// maxServerMessage bounds the upstream messages the relay reads whole
	// (ErrorResponse, authentication). Larger ones are streamed unmodified.
	maxServerMessage = 1 << 20
)

// session is one client connection and its upstream connection.
type session struct {
	client   net.Conn
	upstream net.Conn

	cw flushWriter // client writer; guarded by cwMu after startup
	ur *msgReader  // upstream reader
	// cwMu is held by the upstream-to-client copier while it writes a batch,
	// and by terminate when it injects a final error.
	cwMu sync.Mutex

	// backendKey is the upstream's BackendKeyData body (process ID and
	// secret key), to cancel a running statement when the session is
	// terminated. Never logged.
	backendKey []byte

	// tracker is the session's bookkeeping (tracker.go), guarded by its mu.
	tracker
	// requests is the client-to-upstream direction (requests.go).
	requests

	closing bool  // close has begun; guarded by mu
	cause   error // guarded by mu
	closed  bool  // guarded by mu

}

// relayState tracks what is needed to know whether a session is idle.
type relayState struct {
	relaying bool // startup finished
	inFlight int  // Query/Sync/FunctionCall sent and not answered by ReadyForQuery
	unsynced bool // extended-protocol messages sent since the last Sync
	txStatus byte // from the last ReadyForQuery: 'I', 'T' or 'E'
	rewrote  bool // a rewritten statement was sent and not yet answered
	// copy-in bookkeeping: the server ignores Sync and Flush in copy-in
	// mode, so they must not be counted as awaiting a ReadyForQuery.
	copyIn            bool
	lastWasQuery      bool // the last request was a simple Query (not Execute)
	syncsSinceExecute int
	// desync: a ReadyForQuery arrived that the bookkeeping did not
	// expect, so inFlight cannot be trusted for lexing any more.
	desync bool
	// copyEndSent: CopyDone/CopyFail sent before the server's
	// CopyInResponse (pipelined); the Syncs after it will be answered.
	copyEndSent bool
	// execsSinceIdle: Executes sent since the session was last seen idle.
	execsSinceIdle int
	// segTx is what the client's Executes since the last Sync did to
	// the transaction block, per their statements' transaction commands:
	// 0 nothing, 'B' began one (BEGIN, START TRANSACTION, AND CHAIN),
	// 'X' ended one (inBlock).
	segTx     byte
	draining  bool
	finishing bool // the session is being closed
}

// inBlock reports whether the server will run the next Execute inside a
// transaction block, where stored code cannot commit: one that this
// segment began, or one that was open when everything sent before the
// segment was answered and that the segment has not ended. Sending
// order makes it certain: if what began the block failed, the server
// skips the rest of the segment.
func (st relayState) inBlock() bool {
	return st.segTx == 'B' || st.segTx == 0 && st.inFlight == 0 && !st.desync && (st.txStatus == 'T' || st.txStatus == 'E')
}

func (st relayState) idle() bool {
	return st.relaying && st.inFlight == 0 && !st.unsynced && st.txStatus == 'I'
}

func newSession(srv *Server, c net.Conn, id uint64) *session {
	var n [8]byte
	_, _ = rand.Read(n[:])
	s := &session{
		client: c,
		tracker: tracker{
			srv:      srv,
			since:    time.Now(),
			pol:      srv.opts.Policy,
			nonce:    hex.EncodeToString(n[:]),
			info:     SessionInfo{ID: id, RemoteAddr: remoteAddr(c), Memo: new(DecisionMemo)},
			refusals: make(map[uint64]*rules.Error),
		},
	}
	s.log = srv.log.With(zap.Uint64("conn-id", id), zap.String("remote-addr", s.info.RemoteAddr))
	if pp := srv.opts.Policy; pp != (forwardAll{}) {
		// The proxy's statement names show in pg_prepared_statements: they
		// get a random part of their own, not the nonce.
		var m [8]byte
		_, _ = rand.Read(m[:])
		s.ps = newPreparedState(pp, hex.EncodeToString(m[:]))
	}
	s.requests = requests{tracker: &s.tracker, sess: s}
	s.idleCond = sync.NewCond(&s.mu)
	// PostgreSQL's defaults; the server reports the session's values in
	// ParameterStatus during startup.
	s.lex = Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}
	return s
}

func (s *session) run() {
	s.logger().Debug("client connected")
	if err := s.startup(); err != nil {
		s.upstreamStartupFailed(err)
		s.close(err)
		s.logEnd()
		return
	}
	// Both writers were flushed at the end of startup. From now on their
	// buffers are held only while a batch is written (relayWriter).
	s.cw = newRelayWriter(s.client)
	s.uw = newRelayWriter(s.upstream)
	l, ok := s.toLoop()
	if !ok {
		s.close(errSessionDone)
		s.logEnd()
		return
	}
	s.mu.Lock()
	draining := s.state.draining
	s.mu.Unlock()
	if draining {
		s.drain()
	}

	if l == nil {
		// A connection without a socket of its own (net.Pipe in tests, a
		// listener of the embedder's): the same relay, each direction in a
		// goroutine.
		done := make(chan struct{})
		go func() {
			s.close(s.copyUpstreamToClient())
			close(done)
		}()
		s.close(s.copyClientToUpstream())
		<-done
		s.logEnd()
		return
	}
	done := make(chan struct{})
	l.post(func() {
		left := 2
		end := func() {
			if left--; left == 0 {
				close(done)
			}
		}
		l.spawn(func() { s.close(s.copyUpstreamToClient()) }, end)
		l.spawn(func() { s.close(s.copyClientToUpstream()) }, end)
	})
	<-done
	s.logEnd()
}

// toLoop moves the session's sockets to one of the server's loops and
// marks the session as relaying. It returns the loop, or nil when the
// connections cannot go on one (they have no socket, or the loop failed to
// start), and false if the session was closed meanwhile.
func (s *session) toLoop() (*loop, bool) {
	l := s.srv.pickLoop()
	var cl, ul *loopConn
	rawClient, setClient := s.rawClient()
	rawUp, setUp := s.rawUpstream()
	if l != nil && rawClient != nil && rawUp != nil {
		var err error
		if cl, err = detach(l, rawClient); err == nil {
			if ul, err = detach(l, rawUp); err != nil {
				_ = unix.Close(cl.fd)
				cl = nil
			}
		}
		if err != nil {
			s.logger().Warn("session relayed without the event loop", zap.Error(err))
		}
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		if cl != nil {
			_ = unix.Close(cl.fd)
			_ = unix.Close(ul.fd)
		}
		return nil, false
	}
	if cl == nil {
		s.state.relaying = true
		s.mu.Unlock()
		return nil, true
	}
	// The originals leave Go's netpoller; the sockets live on in the
	// duplicated descriptors.
	_ = rawClient.Close()
	_ = rawUp.Close()
	setClient(cl)
	setUp(ul)
	s.loop = l
	s.state.relaying = true
	s.mu.Unlock()
	registered := make(chan error, 1)
	l.post(func() {
		err := l.register(cl)
		if err == nil {
			if err = l.register(ul); err != nil {
				cl.release()
			}
		}
		registered <- err
	})
	if err := <-registered; err != nil {
		// The sockets are closed by now; the relay fails on them at once.
		s.logger().Warn("event loop registration failed", zap.Error(err))
	}
	return l, true
}

// rawClient returns the socket under the client connection and how to put
// a loopConn in its place.
func (s *session) rawClient() (net.Conn, func(net.Conn)) {
	if tc, ok := s.client.(*tls.Conn); ok {
		if pc, ok := tc.NetConn().(*prefixConn); ok && len(pc.prefix) == 0 {
			return pc.Conn, func(c net.Conn) { pc.Conn = c }
		}
		return nil, nil
	}
	return s.client, func(c net.Conn) {
		s.client = c
		s.cr.src = c
		s.cw = newRelayWriter(c)
	}
}

// rawUpstream does for the upstream connection what rawClient does for the
// client's.
func (s *session) rawUpstream() (net.Conn, func(net.Conn)) {
	up := s.upstream
	if tc, ok := up.(*tls.Conn); ok {
		if ac, ok := tc.NetConn().(*answerConn); ok {
			return ac.Conn, func(c net.Conn) { ac.Conn = c }
		}
		return nil, nil
	}
	if ac, ok := up.(*answerConn); ok {
		up = ac.Conn // its first-answer bound has passed: drop the wrapper
	}
	return up, func(c net.Conn) {
		s.upstream = c
		s.ur.src = c
		s.uw = newRelayWriter(c)
	}
}

// elsewhere has f run as a task on the session's loop and reports true when
// the caller is not on that loop and the session is on one: then the
// caller must not go on (its connections are the loop's).
func (t *tracker) elsewhere(f func()) bool {
	t.mu.Lock()
	l := t.loop
	t.mu.Unlock()
	if l == nil || l.onLoop() {
		return false
	}
	l.goTask(f)
	return true
}

// upstreamStartupFailed tells the client, with 08006, that the upstream
// failed it during startup, for the failures startup does not report
// itself: the upstream connected but did not answer (a stopped
// postmaster) or went silent mid-handshake. The failure is counted with
// the connect errors.
func (s *session) upstreamStartupFailed(err error) {
	var ce *connectError
	if sideOf(err) != "upstream" || errors.As(err, &ce) || !errors.Is(err, os.ErrDeadlineExceeded) {
		return
	}
	s.srv.opts.Hooks.UpstreamConnectFailed()
	msg := "fenceproxy: the upstream server did not complete the connection handshake in time"
	if errors.Is(err, errNoAnswer) {
		msg = "fenceproxy: the upstream server accepted the connection but did not answer in time"
	}
	// The startup deadline may have passed for the client too.
	_ = s.client.SetWriteDeadline(time.Now().Add(time.Second))
	if s.cw != nil {
		_ = s.cw.Flush()
	}
	s.sendFatal(fatal("08006", msg))
}

// close tears both connections down; the first cause wins. When the client
// is the cause (it went away, or its connection failed) while a statement
// is in flight, the statement is cancelled first: a backend notices a
// closed socket only when it next does I/O, so it would otherwise run to
// its end, holding its locks.
func (s *session) close(cause error) {
	if s.elsewhere(func() { s.close(cause) }) {
		return
	}
	// Not a sync.Once: a second caller on a loop must not block its thread
	// while the first one, parked, is still closing.
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return
	}
	s.closing = true
	func() {
		s.cause = cause
		s.closed = true
		busy := s.state.relaying && !s.state.finishing && (s.state.inFlight > 0 || s.state.unsynced)
		s.state.finishing = true
		up, client, relaying := s.upstream, s.client, s.state.relaying
		s.wakeIdleLocked()
		s.mu.Unlock()
		s.idleCond.Broadcast()
		if busy && sideOf(cause) == "client" {
			_ = client.Close() // stop relaying to it while cancelling
			s.logger().Info("client went away during a statement; cancelling it")
			s.cancelUpstream()
		}
		_ = client.Close()
		if up != nil {
			_ = up.Close()
		}
		if relaying {
			s.pol.Idle(&s.info) // no transaction of the session is open now
		}
	}()
}

// sideError marks an error with the side of the session that caused it
// ("client" or "upstream"), for the log line that ends the session.
type sideError struct {
	side string
	err  error
}

func (e *sideError) Error() string { return e.side + ": " + e.err.Error() }
func (e *sideError) Unwrap() error { return e.err }

func clientErr(err error) error {
	if err == nil {
		return nil
	}
	return &sideError{"client", err}
}

func upstreamErr(err error) error {
	if err == nil {
		return nil
	}
	return &sideError{"upstream", err}
}

// sideOf returns the side an error was attributed to, or "".
func sideOf(err error) string {
	var se *sideError
	if errors.As(err, &se) {
		return se.side
	}
	return ""
}

// blame attributes an error from copyBody: a failed write to the side
// written to, anything else to the side read from.
func blame(err error, from, to func(error) error) error {
	var we *writeError
	if errors.As(err, &we) {
		return to(we.err)
	}
	return from(err)
}

// errSessionDone is the cause for a session that ended normally.
var errSessionDone = errors.New("session ended")

func (s *session) logEnd() {
	s.mu.Lock()
	err := s.cause
	s.mu.Unlock()
	switch {
	case err == nil, errors.Is(err, errSessionDone), errors.Is(err, io.EOF):
		s.logger().Info("session closed")
	case errors.Is(err, net.ErrClosed):
		s.logger().Info("session closed", zap.String("reason", "connection closed"))
	default:
		s.logger().Warn("session failed", zap.String("side", sideOf(err)), zap.Error(err))
	}
}

// drain marks the session for closing once it is idle, and closes it now if
// it already is.
func (s *session) drain() {
	s.mu.Lock()
	s.state.draining = true
	idle := s.state.idle() && !s.state.finishing
	if idle {
		s.state.finishing = true
	}
	s.mu.Unlock()
	if idle {
		s.terminate(fatal("57P01", "terminating connection due to administrator command"), "shutdown")
	}
}

// terminate sends a final error to the client (if the relay is running),
// tells the upstream goodbye and closes the session.
func (s *session) terminate(e *pgproto3.ErrorResponse, why string) {
	if s.elsewhere(func() { s.terminate(e, why) }) {
		return
	}
	s.mu.Lock()
	relaying := s.state.relaying
	busy := s.state.inFlight > 0 || s.state.unsynced
	s.state.finishing = true
	s.mu.Unlock()
	if relaying && busy {
		// The client is told its session is terminated, so a statement
		// still running upstream must not go on, and commit, after that:
		// a backend notices a closed socket only when it next does I/O.
		s.cancelUpstream()
	}
	if relaying {
		// Unblock a copier stuck writing to a slow client, then inject the
		// error between batches.
		_ = s.client.SetWriteDeadline(time.Now().Add(time.Second))
		// The upstream-to-client copier holds cwMu while it relays a
		// message, and may be stuck on an upstream that stopped in the
		// middle of one: wait a bounded time, then close without the error.
		if s.lockClientWriter(time.Second) {
			_ = writeMsg(s.cw, e)
			_ = s.cw.Flush()
			s.cwMu.Unlock()
		}
	}
	s.logger().Info("closing session", zap.String("reason", why))
	s.close(errSessionDone)
}

// lockClientWriter tries to lock cwMu for up to d.
func (s *session) lockClientWriter(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for !s.cwMu.TryLock() {
		s.mu.Lock()
		closing := s.closing
		s.mu.Unlock()
		if closing || time.Now().After(deadline) {
			return false
		}
		s.pause(5 * time.Millisecond)
	}
	return true
}

// lockCW locks cwMu. On a loop the holder may be a parked task: wait by
// parking too, never by blocking the loop's thread.
func (s *session) lockCW() {
	if s.loop == nil {
		s.cwMu.Lock()
		return
	}
	for !s.cwMu.TryLock() {
		s.pause(time.Millisecond)
	}
}

// clock is time.Now, or, in a task of the session's loop, the time the
// loop last woke up: a duration measured with it counts the waits that
// parked the task, and reads as zero for work done within one wake-up.
func (t *tracker) clock() time.Time {
	if t.loop != nil && t.loop.inTask() {
		return t.loop.now
	}
	return time.Now()
}

// pause sleeps for d, parking the task when the session is on a loop.
func (t *tracker) pause(d time.Duration) {
	if t.loop != nil && t.loop.onLoop() {
		t.loop.sleep(d)
		return
	}
	time.Sleep(d)
}

// wakeIdleLocked wakes a task waiting for the session's bookkeeping to
// change (waitLocked); s.mu is held. The goroutine relay waits on idleCond.
func (t *tracker) wakeIdleLocked() {
	if t.idleWaiter != nil {
		t.loop.wake(t.idleWaiter)
	}
}

// cancelUpstream asks the upstream to cancel the session's running
// statement, with the key from its BackendKeyData.
func (s *session) cancelUpstream() {
	if len(s.backendKey) < 8 {
		return
	}
	pkt := binary.BigEndian.AppendUint32(nil, uint32(8+len(s.backendKey)))
	pkt = binary.BigEndian.AppendUint32(pkt, codeCancelRequest)
	pkt = append(pkt, s.backendKey...)
	// A connection and a round trip of its own: off the loop's thread.
	s.offLoop(func() { s.forwardCancel(pkt) })
}

// decided counts a decision for the session's snapshot and reports it to
// the hooks.
func (t *tracker) decided(d *rules.Decision, took time.Duration) {
	switch d.Action {
	case Rewrite:
		t.fenced.Add(1)
	case Refuse:
		t.refused.Add(1)
	}
	t.srv.opts.Hooks.Statement(&t.info, *d, took)
}

// snapshot describes the session for Server.Sessions.
func (t *tracker) snapshot() SessionSnapshot {
	snap := SessionSnapshot{
		ID: t.info.ID, RemoteAddr: t.info.RemoteAddr, Since: t.since,
		StatementsFenced: t.fenced.Load(), StatementsRefused: t.refused.Load(),
	}
	t.mu.Lock()
	st := t.state
	t.mu.Unlock()
	if !st.relaying {
		// The startup fields are still being written.
		snap.State = "startup"
		return snap
	}
	snap.User, snap.Database, snap.ApplicationName = t.info.User, t.info.Database, t.info.ApplicationName
	switch {
	case st.inFlight > 0 || st.unsynced:
		snap.State = "active"
	case st.txStatus == 'T':
		snap.State = "idle in transaction"
	case st.txStatus == 'E':
		snap.State = "idle in transaction (aborted)"
	default:
		snap.State = "idle"
	}
	return snap
}

// logger returns the session's logger (replaced once the user is known).
func (t *tracker) logger() *zap.Logger {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.log
}
