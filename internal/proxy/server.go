package proxy

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
)

// Options configure a Server. The zero value of each optional field means
// the documented default.
type Options struct {
	// UpstreamAddr is host:port of the PostgreSQL server, or the path of
	// its Unix socket when UpstreamNetwork is "unix". Required.
	UpstreamAddr string
	// UpstreamNetwork is "tcp" or "unix". Default "tcp".
	UpstreamNetwork string
	// UpstreamTLS, when non-nil, is used to negotiate TLS with the upstream
	// (SSLRequest, then a TLS client handshake). nil means plaintext.
	UpstreamTLS *tls.Config
	// UpstreamTLSFollowsClient uses UpstreamTLS only for clients that
	// negotiated TLS with the proxy, and plaintext for the others, so that
	// the server's hostssl and hostnossl lines see what the client chose.
	UpstreamTLSFollowsClient bool
	// ConnectTimeout bounds dialling the upstream, the TLS handshake, and
	// the upstream's first answer after connecting: a stopped postmaster
	// still completes TCP handshakes. Default 5s.
	ConnectTimeout time.Duration
	// ClientTLS, when non-nil, is offered to clients that send SSLRequest.
	ClientTLS *tls.Config
	// RequireClientTLS refuses clients that do not negotiate TLS, except on
	// a Unix socket, which has no TLS (as a hostssl line in pg_hba.conf
	// does not match local connections).
	RequireClientTLS bool
	// ClientCertAuth, when non-nil, has the proxy authenticate clients by
	// TLS client certificate and log in to the upstream for them
	// (certauth.go). Needs ClientTLS. nil: authentication is relayed.
	ClientCertAuth *CertAuth
	// MaxConnections bounds concurrent sessions. Default 1000.
	MaxConnections int
	// RelayLoops is the number of event loops (one OS thread each) that
	// relay the authenticated sessions. Default: half the CPUs Go may use,
	// at least one.
	RelayLoops int
	// MaxMessageBytes bounds the body of any client message after
	// authentication (before it, PostgreSQL's own limits). Default 64 MiB.
	MaxMessageBytes int
	// LargeMessages bounds the memory the sessions hold at once for large
	// client messages, and how long a message waits for room before it is
	// refused (see MessageBudget). nil: one budget of
	// DefaultLargeMessageBudget and DefaultLargeMessageWait, shared by
	// every Server of the process that names none.
	LargeMessages *MessageBudget
	// StartupTimeout bounds accept-to-authenticated. Default 30s.
	StartupTimeout time.Duration
	// AutoPrepare, when positive: a session's simple Query whose exact
	// text the policy rewrites, and marks Preparable, runs from its
	// AutoPrepare-th sighting on as a named prepared statement of the
	// proxy's own (autoprepare.go), which costs the server less per
	// execution but fixes what PostgreSQL fixes when it analyses a
	// statement. 0 (the default): never. Needs a policy that tracks
	// prepared statements (Policy.Generation).
	AutoPrepare int
	// DisableSettingsCarry turns off the record of each session's fence
	// settings and their transaction-local application before statements
	// on protected tables (settings.go). Only for tests that show what
	// the record prevents; never in a deployment.
	DisableSettingsCarry bool
	// Policy decides what happens to each statement and translates the
	// upstream errors it provoked. nil forwards everything unchanged.
	Policy Policy
	// Hooks observe the relay (metrics). Optional.
	Hooks Hooks
	// Logger receives the proxy's logs. Default: no logging.
	Logger *zap.Logger
}

func defaultRelayLoops() int { return max(1, runtime.GOMAXPROCS(0)/2) }

// Server accepts client connections and runs a session for each.
type Server struct {
	opts Options
	log  *zap.Logger

	nextID   atomic.Uint64
	active   atomic.Int64
	draining atomic.Bool

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	sessions  map[*session]struct{}
	wg        sync.WaitGroup // sessions
	serving   sync.WaitGroup // Serve loops
	refusing  sync.WaitGroup // refused connections; Add only from Serve loops

	// loops relay the authenticated sessions (see loop.go); started on
	// first use, stopped by Shutdown. loopErr: they could not start.
	loopMu   sync.Mutex
	loops    []*loop
	loopErr  error
	nextLoop atomic.Uint64
	// offLoop bounds the work running off the loops at once
	// (session.offLoop): each may hold an OS thread (a cgo parse).
	offLoop chan struct{}
	// offLoopWaiting counts the work waiting for room in offLoop.
	offLoopWaiting atomic.Int64
}

// OffLoopTasks returns how many functions run off the event loops now
// (a first-seen statement's parse, a decision waiting for a database's
// check), each holding one of a bounded number of slots, and how many
// wait for a slot: a queue that stays long means sessions wait for their
// decisions (after a reload, say, when every statement is first-seen).
func (s *Server) OffLoopTasks() (running, waiting int) {
	return len(s.offLoop), int(s.offLoopWaiting.Load())
}

// maxOffLoop is the capacity of Server.offLoop: room for decisions that
// wait (a database's first check) beside those that parse, and far below
// the runtime's thread limit.
func maxOffLoop() int { return max(64, 8*runtime.GOMAXPROCS(0)) }

// pickLoop returns the event loop for a new session, or nil if the loops
// cannot run here (failed to start, or not built for this system).
func (s *Server) pickLoop() *loop {
	if !haveEventLoops {
		return nil
	}
	s.loopMu.Lock()
	defer s.loopMu.Unlock()
	if s.loops == nil && s.loopErr == nil {
		n := s.opts.RelayLoops
		for range n {
			l, err := newLoop()
			if err != nil {
				s.loopErr = err
				s.log.Error("event loop failed to start; sessions are relayed by goroutines", zap.Error(err))
				break
			}
			s.loops = append(s.loops, l)
		}
	}
	if len(s.loops) == 0 {
		return nil
	}
	return s.loops[s.nextLoop.Add(1)%uint64(len(s.loops))]
}

// stopLoops stops the event loops once no session uses them.
func (s *Server) stopLoops() {
	s.loopMu.Lock()
	loops := s.loops
	s.loops = nil
	s.loopErr = ErrServerClosed
	s.loopMu.Unlock()
	for _, l := range loops {
		l.stop()
	}
}

// ErrServerClosed is returned by Serve after Shutdown.
var ErrServerClosed = errors.New("proxy: server closed")

// NewServer validates opts and returns a Server.
func NewServer(opts Options) (*Server, error) {
	if opts.UpstreamAddr == "" {
		return nil, errors.New("proxy: UpstreamAddr is required")
	}
	switch opts.UpstreamNetwork {
	case "":
		opts.UpstreamNetwork = "tcp"
	case "tcp", "unix":
	default:
		return nil, fmt.Errorf("proxy: UpstreamNetwork must be tcp or unix, got %q", opts.UpstreamNetwork)
	}
	if opts.ConnectTimeout <= 0 {
		opts.ConnectTimeout = 5 * time.Second
	}
	if opts.MaxConnections <= 0 {
		opts.MaxConnections = 1000
	}
	if opts.RelayLoops <= 0 {
		opts.RelayLoops = defaultRelayLoops()
	}
	if opts.MaxMessageBytes <= 0 {
		opts.MaxMessageBytes = 64 << 20
	}
	if opts.StartupTimeout <= 0 {
		opts.StartupTimeout = 30 * time.Second
	}
	if opts.Hooks == nil {
		opts.Hooks = NopHooks{}
	}
	if opts.ClientTLS != nil && len(opts.ClientTLS.NextProtos) == 0 {
		// libpq 17+ with sslnegotiation=direct requires the "postgresql"
		// ALPN protocol.
		opts.ClientTLS = opts.ClientTLS.Clone()
		opts.ClientTLS.NextProtos = []string{"postgresql"}
	}
	if err := prepareCertAuth(&opts); err != nil {
		return nil, err
	}
	if opts.Policy == nil {
		opts.Policy = forwardAll{}
	}
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	return &Server{
		opts:      opts,
		log:       log,
		listeners: make(map[net.Listener]struct{}),
		sessions:  make(map[*session]struct{}),
		offLoop:   make(chan struct{}, maxOffLoop()),
	}, nil
}

// Serve accepts connections on l until Shutdown. It returns
// ErrServerClosed after a shutdown.
func (s *Server) Serve(l net.Listener) error {
	s.mu.Lock()
	if s.draining.Load() {
		s.mu.Unlock()
		_ = l.Close()
		return ErrServerClosed
	}
	s.listeners[l] = struct{}{}
	s.serving.Add(1)
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, l)
		s.mu.Unlock()
		s.serving.Done()
	}()

	var backoff time.Duration
	for {
		c, err := l.Accept()
		if err != nil {
			if s.draining.Load() {
				return ErrServerClosed
			}
			if temporaryAcceptError(err) {
				// Like net/http: back off and try again. The sessions that
				// exist keep running, and when descriptors are freed new
				// clients are served again.
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.log.Warn("accept failed; retrying", zap.Error(err), zap.Duration("backoff", backoff))
				s.opts.Hooks.AcceptFailed(err)
				time.Sleep(backoff)
				continue
			}
			// Serve gives up on l: close it, so that clients are refused at
			// once rather than left waiting in its backlog.
			_ = l.Close()
			return err
		}
		backoff = 0
		s.startSession(c)
	}
}

// temporaryAcceptError reports whether an Accept error is worth retrying:
// the process or the system is out of file descriptors or buffers, or one
// pending connection was reset before it was accepted. Go's listeners
// return none of these as net.Error timeouts.
func temporaryAcceptError(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return true
	}
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.ECONNABORTED, syscall.EINTR} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

func (s *Server) startSession(c net.Conn) {
	id := s.nextID.Add(1)
	sess := newSession(s, c, id)
	s.mu.Lock()
	if s.draining.Load() {
		s.mu.Unlock()
		s.refuseAsync(sess, fatal("57P01", "fenceproxy: the proxy is shutting down"))
		return
	}
	s.sessions[sess] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	if n := s.active.Add(1); n > int64(s.opts.MaxConnections) {
		s.active.Add(-1)
		s.forget(sess)
		sess.logger().Warn("connection refused: too many clients", zap.Int("max-connections", s.opts.MaxConnections))
		s.refuseAsync(sess, fatal("53300", "fenceproxy: sorry, too many clients already"))
		return
	}
	s.opts.Hooks.SessionOpened()
	go func() {
		defer func() {
			s.active.Add(-1)
			s.opts.Hooks.SessionClosed()
			s.opts.Hooks.SessionEnded(time.Since(sess.since))
			s.forget(sess)
		}()
		sess.run()
	}()
}

// refuseAsync refuses a connection that gets no session, in its own
// goroutine: refusing reads the client's startup packet first.
func (s *Server) refuseAsync(sess *session, e *pgproto3.ErrorResponse) {
	s.refusing.Add(1)
	go func() {
		defer s.refusing.Done()
		sess.refuse(e)
	}()
}

func (s *Server) forget(sess *session) {
	s.mu.Lock()
	delete(s.sessions, sess)
	s.mu.Unlock()
	s.wg.Done()
}

// SessionByBackendPID returns the info of the session served by the given
// upstream process, if it is connected, without its decisions' memory.
func (s *Server) SessionByBackendPID(pid uint32) (SessionInfo, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for sess := range s.sessions {
		if sess.info.BackendPID == pid {
			info := sess.info
			info.Memo = nil // the session's own decisions' alone
			return info, true
		}
	}
	return SessionInfo{}, false
}

// SessionSnapshot describes one client session at a moment, for operators
// (the admin /sessions endpoint), like PgBouncer's SHOW CLIENTS.
type SessionSnapshot struct {
	ID         uint64    `json:"conn_id"`
	RemoteAddr string    `json:"remote_addr"`
	Since      time.Time `json:"since"` // when the connection was accepted
	// State is "startup" until authentication completes, then as
	// pg_stat_activity.state says it: "idle", "active" (a statement or an
	// unsynced extended-protocol batch is in flight), "idle in
	// transaction" or "idle in transaction (aborted)".
	State string `json:"state"`
	// User, Database and ApplicationName are as the client's startup
	// packet gave them; empty during startup.
	User            string `json:"user"`
	Database        string `json:"database"`
	ApplicationName string `json:"application_name"`
	// StatementsFenced and StatementsRefused count the Query and Parse
	// messages the policy rewrote and refused.
	StatementsFenced  uint64 `json:"statements_fenced"`
	StatementsRefused uint64 `json:"statements_refused"`
}

// Sessions returns a snapshot of the sessions being served, oldest first.
func (s *Server) Sessions() []SessionSnapshot {
	s.mu.Lock()
	sessions := make([]*session, 0, len(s.sessions))
	for sess := range s.sessions {
		sessions = append(sessions, sess)
	}
	s.mu.Unlock()
	out := make([]SessionSnapshot, 0, len(sessions))
	for _, sess := range sessions {
		out = append(out, sess.snapshot())
	}
	slices.SortFunc(out, func(a, b SessionSnapshot) int { return cmp.Compare(a.ID, b.ID) })
	return out
}

// Draining reports whether Shutdown has begun.
func (s *Server) Draining() bool { return s.draining.Load() }

// ActiveSessions reports the number of client sessions being served.
func (s *Server) ActiveSessions() int { return int(s.active.Load()) }

// Shutdown stops accepting sessions, lets each session finish its current
// transaction and closes it when it is idle, and when ctx is done closes
// the remaining sessions with an admin-shutdown error. It returns once
// every session has ended. While sessions drain the listeners stay open,
// so that clients can still cancel their queries, as PostgreSQL allows
// during its own shutdown; new clients are refused with 57P01.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.draining.Store(true)
	sessions := make([]*session, 0, len(s.sessions))
	for sess := range s.sessions {
		sessions = append(sessions, sess)
	}
	s.mu.Unlock()

	for _, sess := range sessions {
		sess.drain()
	}
	done := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		s.mu.Lock()
		rest := make([]*session, 0, len(s.sessions))
		for sess := range s.sessions {
			rest = append(rest, sess)
		}
		s.mu.Unlock()
		// Not under s.mu, which a session needs to end (forget), and in
		// parallel, as each may take a moment.
		for _, sess := range rest {
			go sess.terminate(fatal("57P01", "terminating connection due to administrator command"), "drain timeout")
		}
		<-done
	}

	s.stopLoops()
	var errs []error
	s.mu.Lock()
	for l := range s.listeners {
		if err := l.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, err)
		}
	}
	s.mu.Unlock()
	s.serving.Wait() // no refuseAsync after this
	s.refusing.Wait()
	return errors.Join(errs...)
}
