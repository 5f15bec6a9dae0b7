package proxy

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
)

const (
	ioBufferSize = 32 << 10
	// maxServerMessage bounds the upstream messages the relay reads whole
	// (ErrorResponse, authentication). Larger ones are streamed unmodified.
	maxServerMessage = 1 << 20
)

// session is one client connection and its upstream connection.
type session struct {
	srv  *Server
	log  *zap.Logger
	info SessionInfo

	client   net.Conn
	upstream net.Conn

	cr *msgReader    // client reader
	cw *bufio.Writer // client writer; guarded by cwMu after startup
	ur *msgReader    // upstream reader
	uw *bufio.Writer // upstream writer; used by the client-to-upstream copier
	// cwMu is held by the upstream-to-client copier while it writes a batch,
	// and by terminate when it injects a final error.
	cwMu sync.Mutex

	// nonce makes refusal markers unguessable by the client.
	nonce string
	// backendKey is the upstream's BackendKeyData body (process ID and
	// secret key), to cancel a running statement when the session is
	// terminated. Never logged.
	backendKey []byte

	mu       sync.Mutex
	state    relayState
	refusals map[uint64]*pgproto3.ErrorResponse
	nextRef  uint64

	closeOnce sync.Once
	cause     error // guarded by mu
	closed    bool  // guarded by mu

	// idleCond is signalled (with mu) at each ReadyForQuery and at close;
	// relaySQL waits on it for the server to catch up (see lexing).
	idleCond *sync.Cond
	// lex is how the server tokenizes SQL, from ParameterStatus; guarded
	// by mu.
	lex Lexing
	// ps tracks prepared statements and portals across rules reloads, when
	// the policy's rules can change (PreparedPolicy); guarded by mu.
	ps *preparedState
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
	draining       bool
	finishing      bool // the session is being closed
}

func (st relayState) idle() bool {
	return st.relaying && st.inFlight == 0 && !st.unsynced && st.txStatus == 'I'
}

func newSession(srv *Server, c net.Conn, id uint64) *session {
	var n [8]byte
	_, _ = rand.Read(n[:])
	s := &session{
		srv:      srv,
		client:   c,
		info:     SessionInfo{ID: id, RemoteAddr: c.RemoteAddr().String()},
		nonce:    hex.EncodeToString(n[:]),
		refusals: make(map[uint64]*pgproto3.ErrorResponse),
	}
	s.log = srv.log.With(zap.Uint64("conn-id", id), zap.String("remote-addr", s.info.RemoteAddr))
	if pp, ok := srv.opts.Policy.(PreparedPolicy); ok {
		s.ps = newPreparedState(pp, s.nonce)
	}
	s.idleCond = sync.NewCond(&s.mu)
	// PostgreSQL's defaults; the server reports the session's values in
	// ParameterStatus during startup.
	s.lex = Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}
	return s
}

// refuseTimeout bounds the startup exchange with a client that is refused.
const refuseTimeout = 5 * time.Second

// refuse sends a FATAL error to a client that gets no session. Like
// PostgreSQL, it reads the startup packet first, negotiating TLS as usual:
// a client that opened with SSLRequest expects 'S' or 'N', and libpq does
// not show an error sent in their place ("server sent an error response
// during SSL exchange"). A CancelRequest is relayed, not refused: it is no
// session, and clients must be able to cancel when the proxy is full or
// draining.
func (s *session) refuse(e *pgproto3.ErrorResponse) {
	defer s.client.Close()
	_ = s.client.SetDeadline(time.Now().Add(refuseTimeout))
	tlsDone := false
	for {
		pkt, err := s.readFirstPacket(&tlsDone)
		if err != nil {
			return
		}
		if pkt == nil { // TLS negotiated
			continue
		}
		switch code := startupCode(pkt); {
		case code == codeSSLRequest && !tlsDone && s.srv.opts.ClientTLS != nil:
			if _, err := s.client.Write([]byte{'S'}); err != nil {
				return
			}
			if err := s.startTLS(nil); err != nil {
				return
			}
			tlsDone = true
			continue
		case code == codeSSLRequest, code == codeGSSENCRequest:
			if _, err := s.client.Write([]byte{'N'}); err != nil {
				return
			}
			continue
		case code == codeCancelRequest:
			s.forwardCancel(pkt)
			return
		}
		break
	}
	s.sendFatal(e)
}

func (s *session) run() {
	s.log.Debug("client connected")
	if err := s.startup(); err != nil {
		s.close(err)
		s.logEnd()
		return
	}
	s.mu.Lock()
	s.state.relaying = true
	draining := s.state.draining
	s.mu.Unlock()
	if draining {
		s.drain()
	}

	done := make(chan struct{})
	go func() {
		s.close(s.copyUpstreamToClient())
		close(done)
	}()
	s.close(s.copyClientToUpstream())
	<-done
	s.logEnd()
}

// close tears both connections down; the first cause wins.
func (s *session) close(cause error) {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.cause = cause
		s.closed = true
		s.state.finishing = true
		up := s.upstream
		s.mu.Unlock()
		s.idleCond.Broadcast()
		_ = s.client.Close()
		if up != nil {
			_ = up.Close()
		}
	})
}

// clientSideError marks an error as caused by the client connection.
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

// errSessionDone is the cause for a session that ended normally.
var errSessionDone = errors.New("session ended")

func (s *session) logEnd() {
	s.mu.Lock()
	err := s.cause
	s.mu.Unlock()
	switch {
	case err == nil, errors.Is(err, errSessionDone), errors.Is(err, io.EOF):
		s.log.Info("session closed")
	case errors.Is(err, net.ErrClosed):
		s.log.Info("session closed", zap.String("reason", "connection closed"))
	default:
		s.log.Warn("session failed", zap.Error(err))
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
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

// cancelUpstream asks the upstream to cancel the session's running
// statement, with the key from its BackendKeyData.
func (s *session) cancelUpstream() {
	if len(s.backendKey) < 8 {
		return
	}
	pkt := binary.BigEndian.AppendUint32(nil, uint32(8+len(s.backendKey)))
	pkt = binary.BigEndian.AppendUint32(pkt, codeCancelRequest)
	s.forwardCancel(append(pkt, s.backendKey...))
}

// ---- startup ----

func (s *session) startup() error {
	deadline := time.Now().Add(s.srv.opts.StartupTimeout)
	_ = s.client.SetDeadline(deadline)

	tlsDone := false
	var pkt []byte
	for {
		var err error
		pkt, err = s.readFirstPacket(&tlsDone)
		if err != nil {
			return err
		}
		if pkt == nil { // TLS negotiated; read the next packet
			continue
		}
		code := startupCode(pkt)
		switch {
		case code == codeSSLRequest:
			if tlsDone {
				return clientErr(errors.New("SSLRequest after TLS was negotiated"))
			}
			if s.srv.opts.ClientTLS == nil {
				if _, err := s.client.Write([]byte{'N'}); err != nil {
					return clientErr(err)
				}
				continue
			}
			if _, err := s.client.Write([]byte{'S'}); err != nil {
				return clientErr(err)
			}
			if err := s.startTLS(nil); err != nil {
				return err
			}
			tlsDone = true
		case code == codeGSSENCRequest:
			if _, err := s.client.Write([]byte{'N'}); err != nil {
				return clientErr(err)
			}
		case code == codeCancelRequest:
			s.forwardCancel(pkt)
			return errSessionDone
		case code>>16 == protocolMajor3:
			if s.srv.opts.RequireClientTLS && !tlsDone {
				s.sendFatal(fatal("28000", "fenceproxy: TLS is required (use sslmode=require)"))
				return clientErr(errors.New("client did not negotiate TLS"))
			}
			return s.startSession(pkt, deadline)
		default:
			s.sendFatal(fatal("0A000", fmt.Sprintf("unsupported frontend protocol %d.%d", code>>16, code&0xffff)))
			return clientErr(fmt.Errorf("unsupported protocol code %d", code))
		}
	}
}

// readFirstPacket reads a startup packet. A client may also open with a TLS
// ClientHello directly (PostgreSQL 17's sslnegotiation=direct); then TLS is
// started and nil is returned.
func (s *session) readFirstPacket(tlsDone *bool) ([]byte, error) {
	if !*tlsDone && s.srv.opts.ClientTLS != nil {
		var first [1]byte
		if _, err := io.ReadFull(s.client, first[:]); err != nil {
			return nil, clientErr(err)
		}
		if first[0] == 0x16 { // TLS handshake record
			if err := s.startTLS(first[:]); err != nil {
				return nil, err
			}
			*tlsDone = true
			return nil, nil
		}
		pkt, err := readStartupPacket(io.MultiReader(bytes.NewReader(first[:]), s.client))
		if err != nil {
			s.sendFatal(fatal("08P01", "invalid startup packet"))
			return nil, clientErr(err)
		}
		return pkt, nil
	}
	pkt, err := readStartupPacket(s.client)
	if err != nil {
		if !errors.Is(err, io.EOF) {
			s.sendFatal(fatal("08P01", "invalid startup packet"))
		}
		return nil, clientErr(err)
	}
	return pkt, nil
}

// prefixConn replays bytes already read before reading from the conn.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (c *prefixConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

func (s *session) startTLS(prefix []byte) error {
	var raw net.Conn = s.client
	if len(prefix) > 0 {
		raw = &prefixConn{Conn: s.client, prefix: append([]byte(nil), prefix...)}
	}
	tc := tls.Server(raw, s.srv.opts.ClientTLS)
	if err := tc.Handshake(); err != nil {
		return clientErr(fmt.Errorf("TLS handshake: %w", err))
	}
	s.client = tc
	return nil
}

func (s *session) sendFatal(e *pgproto3.ErrorResponse) {
	if buf, err := e.Encode(nil); err == nil {
		_, _ = s.client.Write(buf)
	}
}

// forwardCancel relays a CancelRequest to the upstream. BackendKeyData was
// relayed unchanged, so the key is the upstream's own.
func (s *session) forwardCancel(pkt []byte) {
	// Over TLS when the upstream connection uses it: the packet carries
	// the backend's secret key.
	c, err := s.srv.dialUpstream()
	if err != nil {
		s.logger().Warn("cancel request not forwarded", zap.Error(err))
		return
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(s.srv.opts.ConnectTimeout))
	if _, err := c.Write(pkt); err != nil {
		s.logger().Warn("cancel request not forwarded", zap.Error(err))
		return
	}
	// PostgreSQL closes the connection without a reply; wait for that so
	// the cancel is delivered before the client hears back.
	_, _ = io.Copy(io.Discard, c)
	s.logger().Debug("cancel request forwarded")
}

func (s *session) startSession(pkt []byte, deadline time.Time) error {
	var sm pgproto3.StartupMessage
	if err := sm.Decode(pkt[4:]); err != nil {
		s.sendFatal(fatal("08P01", "invalid startup packet"))
		return clientErr(err)
	}
	s.info.User = sm.Parameters["user"]
	s.info.Database = sm.Parameters["database"]
	if s.info.Database == "" {
		s.info.Database = s.info.User
	}
	s.info.ApplicationName = sm.Parameters["application_name"]
	log := s.logger().With(zap.String("user", s.info.User), zap.String("database", s.info.Database))
	s.mu.Lock()
	s.log = log
	s.mu.Unlock()

	up, err := s.srv.dialUpstream()
	if err != nil {
		s.srv.opts.Hooks.UpstreamConnectFailed()
		s.sendFatal(fatal("08006", "fenceproxy: cannot connect to the upstream server"))
		return upstreamErr(err)
	}
	s.mu.Lock()
	if s.closed {
		// Closed (drain timeout) while dialling: do not leak the backend.
		s.mu.Unlock()
		_ = up.Close()
		return errSessionDone
	}
	s.upstream = up
	s.mu.Unlock()
	_ = up.SetDeadline(deadline)

	s.cr = newMsgReader(s.client, ioBufferSize, s.srv.opts.MaxMessageBytes)
	s.cw = bufio.NewWriterSize(s.client, ioBufferSize)
	s.ur = newMsgReader(up, ioBufferSize, 1<<30)
	s.uw = bufio.NewWriterSize(up, ioBufferSize)

	// The startup packet goes upstream exactly as the client sent it.
	if _, err := s.uw.Write(pkt); err != nil {
		return upstreamErr(err)
	}
	if err := s.uw.Flush(); err != nil {
		return upstreamErr(err)
	}
	if err := s.relayAuth(); err != nil {
		return err
	}
	_ = s.client.SetDeadline(time.Time{})
	_ = up.SetDeadline(time.Time{})
	s.log.Debug("session authenticated", zap.String("application-name", s.info.ApplicationName))
	return nil
}

// Authentication request codes (PostgreSQL protocol, AuthenticationXXX).
const (
	authOK       = 0
	authSASL     = 10
	authSASLDone = 12
)

// relayAuth relays the authentication exchange until the upstream's first
// ReadyForQuery. The proxy holds no passwords: every challenge is relayed to
// the client and every answer to the upstream.
func (s *session) relayAuth() error {
	// plusWithheld: the upstream offered SCRAM-SHA-256-PLUS and the client
	// was not told. Such an upstream refuses a client that says it supports
	// channel binding but was not offered it (GS2 flag "y"), taking it for
	// a downgrade attack (RFC 5802, section 6); say why before it does.
	plusWithheld := false
	for {
		typ, n, err := s.ur.header()
		if err != nil {
			return upstreamErr(err)
		}
		if n > maxServerMessage {
			return upstreamErr(fmt.Errorf("startup message %q of %d bytes", typ, n))
		}
		body, err := s.ur.body(n)
		if err != nil {
			return upstreamErr(err)
		}
		switch typ {
		case 'R':
			if len(body) < 4 {
				return upstreamErr(errors.New("short authentication message"))
			}
			code := binary.BigEndian.Uint32(body)
			if code == authSASL && !s.channelBindingPassesThrough() {
				body, plusWithheld, err = withoutChannelBinding(body)
				if err != nil {
					return upstreamErr(err)
				}
			}
			if err := writeRaw(s.cw, typ, body); err != nil {
				return clientErr(err)
			}
			if err := s.cw.Flush(); err != nil {
				return clientErr(err)
			}
			if code == authOK || code == authSASLDone {
				continue
			}
			// The client answers every other request with one message.
			ctyp, cn, err := s.cr.header()
			if err != nil {
				return clientErr(err)
			}
			cbody, err := s.cr.body(cn)
			if err != nil {
				return clientErr(err)
			}
			if code == authSASL && plusWithheld && ctyp == 'p' && saslWantsBinding(cbody) {
				s.sendFatal(fatal("28000", "fenceproxy: SCRAM channel binding cannot pass through the proxy, which terminates TLS; connect with channel_binding=disable"))
				return clientErr(errors.New("client wants SCRAM channel binding, which the proxy cannot relay"))
			}
			if err := writeRaw(s.uw, ctyp, cbody); err != nil {
				return upstreamErr(err)
			}
			if err := s.uw.Flush(); err != nil {
				return upstreamErr(err)
			}
			if ctyp == 'X' {
				return errSessionDone
			}
		case 'E':
			if err := writeRaw(s.cw, typ, body); err != nil {
				return clientErr(err)
			}
			_ = s.cw.Flush()
			var e pgproto3.ErrorResponse
			if err := e.Decode(body); err == nil {
				return upstreamErr(fmt.Errorf("startup refused: %s (SQLSTATE %s)", e.Message, e.Code))
			}
			return upstreamErr(errors.New("startup refused"))
		case 'Z':
			if len(body) == 1 {
				s.mu.Lock() // read by drain, from Shutdown
				s.state.txStatus = body[0]
				s.mu.Unlock()
			}
			if err := writeRaw(s.cw, typ, body); err != nil {
				return clientErr(err)
			}
			if err := s.cw.Flush(); err != nil {
				return clientErr(err)
			}
			return nil
		default: // ParameterStatus, BackendKeyData, NegotiateProtocolVersion, notices
			if typ == 'S' {
				// client_encoding, standard_conforming_strings from the
				// startup packet, options, ALTER ROLE/DATABASE ... SET.
				s.parameterStatus(body)
			}
			if typ == 'K' && len(body) >= 4 {
				// The key is kept to cancel a running statement when the
				// session is closed by force (never logged); the process ID
				// also attributes audit events to sessions.
				s.backendKey = append([]byte(nil), body...)
				s.srv.mu.Lock() // read by SessionByBackendPID
				s.info.BackendPID = binary.BigEndian.Uint32(body)
				s.srv.mu.Unlock()
			}
			if err := writeRaw(s.cw, typ, body); err != nil {
				return clientErr(err)
			}
		}
	}
}

// withoutChannelBinding removes SCRAM-SHA-256-PLUS from an
// AuthenticationSASL mechanism list: the proxy terminates TLS, so the
// client's channel binding data could never match the upstream's. It
// reports whether it removed anything.
func withoutChannelBinding(body []byte) ([]byte, bool, error) {
	var m pgproto3.AuthenticationSASL
	if err := m.Decode(body); err != nil {
		return nil, false, err
	}
	kept := m.AuthMechanisms[:0]
	for _, mech := range m.AuthMechanisms {
		if !strings.HasSuffix(mech, "-PLUS") {
			kept = append(kept, mech)
		}
	}
	withheld := len(kept) < len(m.AuthMechanisms)
	m.AuthMechanisms = kept
	buf, err := m.Encode(nil)
	if err != nil {
		return nil, false, err
	}
	return buf[5:], withheld, nil
}

// channelBindingPassesThrough reports whether SCRAM-SHA-256-PLUS can work
// end to end: both legs are TLS and the proxy served the client the very
// certificate the upstream served the proxy, so the tls-server-end-point
// binding data (a hash of that certificate) is the same on both sides.
func (s *session) channelBindingPassesThrough() bool {
	if _, ok := s.client.(*tls.Conn); !ok {
		return false
	}
	up, ok := s.upstream.(*tls.Conn)
	if !ok {
		return false
	}
	cfg := s.srv.opts.ClientTLS
	if cfg == nil || cfg.GetCertificate != nil || cfg.GetConfigForClient != nil ||
		len(cfg.Certificates) != 1 || len(cfg.Certificates[0].Certificate) == 0 {
		return false // which certificate the client saw is not known
	}
	peer := up.ConnectionState().PeerCertificates
	return len(peer) > 0 && bytes.Equal(peer[0].Raw, cfg.Certificates[0].Certificate[0])
}

// saslWantsBinding reports whether a SASLInitialResponse body carries the
// GS2 flag "y": the client supports channel binding but was not offered it.
func saslWantsBinding(body []byte) bool {
	var m pgproto3.SASLInitialResponse
	if err := m.Decode(body); err != nil {
		return false
	}
	return len(m.Data) > 0 && m.Data[0] == 'y'
}

// ---- relay ----

// copyClientToUpstream relays client messages, passing SQL through the rules.
func (s *session) copyClientToUpstream() error {
	for {
		if !s.cr.buffered() {
			if err := s.uw.Flush(); err != nil {
				return upstreamErr(err)
			}
		}
		typ, n, err := s.cr.header()
		if err != nil {
			if errors.Is(err, errMessageTooLarge) || errors.Is(err, errBadLength) {
				s.terminate(fatal("08P01", "fenceproxy: "+strings.TrimPrefix(err.Error(), "proxy: ")), "bad client message")
				return clientErr(err)
			}
			if errors.Is(err, io.EOF) {
				return errSessionDone
			}
			return clientErr(err)
		}
		switch typ {
		case 'Q', 'P':
			body, err := s.cr.body(n)
			if err != nil {
				return clientErr(err)
			}
			if err := s.relaySQL(typ, body); err != nil {
				return err
			}
		case 'B', 'D', 'E', 'C':
			if s.ps == nil {
				if err := s.forwardUnread(typ, n); err != nil {
					return err
				}
				continue
			}
			body, err := s.cr.body(n)
			if err != nil {
				return clientErr(err)
			}
			switch typ {
			case 'B':
				err = s.relayBind(body)
			case 'D':
				err = s.relayDescribe(body)
			case 'E':
				err = s.relayExecute(body)
			case 'C':
				err = s.relayClose(body)
			}
			if err != nil {
				return err
			}
		case 'X':
			// The server closes its end on Terminate: from here on an
			// upstream EOF is the normal end of the session, not a failure.
			s.mu.Lock()
			s.state.finishing = true
			s.mu.Unlock()
			if err := writeHeader(s.uw, typ, 0); err == nil {
				_ = s.uw.Flush()
			}
			return errSessionDone
		default:
			if err := s.forwardUnread(typ, n); err != nil {
				return err
			}
		}
	}
}

// forwardUnread forwards a client message without decoding its body.
func (s *session) forwardUnread(typ byte, n int) error {
	if !s.track(typ) {
		return errSessionDone
	}
	if err := writeHeader(s.uw, typ, n); err != nil {
		return upstreamErr(err)
	}
	if err := s.cr.copyBody(s.uw, n); err != nil {
		return clientErr(err)
	}
	return nil
}

// track updates the idle bookkeeping for a client message about to be
// forwarded. It returns false if the session is closing.
func (s *session) track(typ byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state.finishing {
		return false
	}
	// In copy-in mode the server ignores Sync and Flush (protocol docs,
	// "COPY Operations"); CopyDone or CopyFail ends it.
	if s.state.copyIn {
		switch typ {
		case 'S', 'H':
			return true
		case 'c', 'f':
			s.state.copyIn = false
		}
	} else if typ == 'c' || typ == 'f' {
		s.state.copyEndSent = true
	}
	switch typ {
	case 'Q', 'F':
		s.state.inFlight++
		s.state.lastWasQuery = true
		s.state.copyEndSent = false
	case 'S':
		s.state.inFlight++
		s.state.unsynced = false
		if !s.state.copyEndSent {
			s.state.syncsSinceExecute++
		}
	case 'E':
		s.state.unsynced = true
		s.state.lastWasQuery = false
		s.state.syncsSinceExecute = 0
		s.state.copyEndSent = false
		s.state.execsSinceIdle++
	case 'P', 'B', 'D', 'C':
		s.state.unsynced = true
	}
	if s.ps != nil {
		s.ps.countSent(typ)
	}
	return true
}

// copyInStarted records a CopyInResponse or CopyBothResponse. When an
// extended-protocol Execute started the copy, the Syncs the client sent
// after it were ignored by the server and will get no ReadyForQuery.
func (s *session) copyInStarted() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.state.lastWasQuery && (s.state.execsSinceIdle > 1 || s.state.copyEndSent) {
		// Which Execute started this copy, and so which Syncs the server
		// ignored, is unknown: never trust inFlight for lexing again.
		s.state.desync = true
		s.losePreparedTrack()
	}
	if !s.state.lastWasQuery {
		s.state.inFlight = max(0, s.state.inFlight-s.state.syncsSinceExecute)
		if s.ps != nil && s.state.syncsSinceExecute > 0 {
			// Those Syncs end no segment: positions recorded after them
			// are wrong.
			s.ps.sentSeg -= uint64(s.state.syncsSinceExecute)
			for _, h := range s.ps.fifo {
				if h.seg > s.ps.recvSeg {
					s.losePreparedTrack()
					break
				}
			}
		}
		s.state.syncsSinceExecute = 0
	}
	if s.state.copyEndSent {
		// The client already ended this copy.
		s.state.copyEndSent = false
	} else {
		s.state.copyIn = true
	}
	// inFlight may have dropped, and the server now waits for the
	// client: wake lexingFor.
	s.idleCond.Broadcast()
}

// copyInEnded records an ErrorResponse: a server in copy-in mode leaves it
// on an error, and then answers the client's next Sync.
func (s *session) copyInEnded() {
	s.mu.Lock()
	s.state.copyIn = false
	s.mu.Unlock()
}

// relaySQL takes the rules decision for a Query or Parse message and
// forwards what it says.
func (s *session) relaySQL(typ byte, body []byte) error {
	var (
		q     pgproto3.Query
		p     pgproto3.Parse
		sql   string
		start = time.Now()
	)
	if typ == 'Q' {
		if err := q.Decode(body); err != nil {
			return s.protocolViolation(err)
		}
		sql = q.String
	} else {
		if err := p.Decode(body); err != nil {
			return s.protocolViolation(err)
		}
		sql = p.Query
	}
	var gen uint64
	if s.ps != nil {
		// Before deciding: a reload during the decision then shows as a
		// change of generation later.
		gen = s.ps.pol.Generation()
	}
	lex, err := s.lexingFor(sql)
	if err != nil {
		return err
	}
	d := s.decide(lex, sql)
	s.srv.opts.Hooks.Statement(&s.info, &d, time.Since(start))
	if s.ps != nil {
		if err := s.trackPrepared(typ, &p, sql, gen, &d); err != nil {
			return err
		}
	}
	if !s.track(typ) {
		return errSessionDone
	}

	var out string
	switch d.Action {
	case Forward:
		if err := writeRaw(s.uw, typ, body); err != nil {
			return upstreamErr(err)
		}
		return nil
	case Rewrite:
		out = d.SQL
		s.mu.Lock()
		s.state.rewrote = true
		s.mu.Unlock()
		if ce := s.log.Check(zap.DebugLevel, "statement rewritten"); ce != nil {
			ce.Write(zap.String("sql", d.SQL), zap.Strings("tables", d.Tables))
		}
	case Refuse:
		if d.Refusal == nil {
			d.Refusal = &pgproto3.ErrorResponse{Code: "XX000", Message: "fenceproxy: statement refused"}
		}
		out = s.refusalSQL(d.Refusal)
		s.log.Info("statement refused", zap.String("sqlstate", d.Refusal.Code), zap.String("reason", d.Refusal.Message))
	default:
		return fmt.Errorf("proxy: unknown policy action %d", d.Action)
	}
	var msg encoder
	if typ == 'Q' {
		msg = &pgproto3.Query{String: out}
	} else {
		oids := p.ParameterOIDs
		if d.Action == Refuse {
			oids = nil
		}
		msg = &pgproto3.Parse{Name: p.Name, Query: out, ParameterOIDs: oids}
	}
	if err := writeMsg(s.uw, msg); err != nil {
		return upstreamErr(err)
	}
	return nil
}

// decide asks the policy, failing closed if it panics: a bug in the
// rewriter or the parser must refuse one statement, not crash the proxy.
func (s *session) decide(lex Lexing, sql string) (d Decision) {
	defer func() {
		if r := recover(); r != nil {
			s.logger().Error("policy panicked; statement refused", zap.Any("panic", r), zap.Stack("stack"))
			d = Decision{Action: Refuse, Refusal: &pgproto3.ErrorResponse{
				Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "XX000",
				Message: "fenceproxy: internal error while inspecting the statement; it was not executed",
			}}
		}
	}()
	return s.srv.opts.Policy.Decide(&s.info, lex, sql)
}

// lexingFor returns how the server will tokenize sql. Only backslashes
// (standard_conforming_strings) and bytes >= 0x80 (client_encoding) can be
// read differently, so for SQL with neither the last reported settings do.
// Otherwise the proxy must not decide on stale settings: earlier statements
// still in flight may change them (their ParameterStatus arrives with
// their ReadyForQuery), so it sends what it has and waits for the server to
// answer. Extended-protocol messages not yet followed by a Sync cannot be
// waited for; then Lexing.Uncertain is set and the policy decides.
func (s *session) lexingFor(sql string) (Lexing, error) {
	var text Lexing
	for i := 0; i < len(sql) && !(text.Backslash && text.NonASCII); i++ {
		switch c := sql[i]; {
		case c == '\\':
			text.Backslash = true
		case c >= 0x80:
			text.NonASCII = true
		}
	}
	sensitive := text.Backslash || text.NonASCII
	if sensitive {
		// Only statements the policy may act on need the server's exact
		// reading; the others are forwarded as sent anyway.
		if m, ok := s.srv.opts.Policy.(MayTouchPolicy); ok && !m.MayTouch(&s.info, sql) {
			sensitive = false
		}
	}
	s.mu.Lock()
	if !sensitive || (s.state.inFlight == 0 && !s.state.unsynced) {
		lex := s.lex
		lex.Backslash, lex.NonASCII = text.Backslash, text.NonASCII
		// After the bookkeeping lost track once, fail closed for good.
		lex.Uncertain = sensitive && s.state.desync
		s.mu.Unlock()
		return lex, nil
	}
	s.mu.Unlock()
	if err := s.uw.Flush(); err != nil {
		return Lexing{}, upstreamErr(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	// Bounded: the bookkeeping can overcount (a Query discarded by a
	// server skipping to Sync), and the server may be waiting for the
	// client (copy-in); never block reading the client forever.
	timedOut := false
	t := time.AfterFunc(lexWaitTimeout, func() {
		s.mu.Lock()
		timedOut = true
		s.mu.Unlock()
		s.idleCond.Broadcast()
	})
	defer t.Stop()
	for s.state.inFlight > 0 && !s.state.finishing && !s.state.copyIn && !timedOut {
		s.idleCond.Wait()
	}
	if s.state.finishing {
		return Lexing{}, errSessionDone
	}
	lex := s.lex
	lex.Backslash, lex.NonASCII = text.Backslash, text.NonASCII
	lex.Uncertain = s.state.unsynced || s.state.inFlight > 0 || s.state.copyIn || s.state.desync
	return lex, nil
}

// lexWaitTimeout bounds how long lexingFor waits for earlier statements.
var lexWaitTimeout = 5 * time.Second

// logger returns the session's logger (replaced once the user is known).
func (s *session) logger() *zap.Logger {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.log
}

// refusalMarkerPrefix starts the text of every refusal statement.
const refusalMarkerPrefix = "fenceproxy-refusal:"

// refusalSQL registers a refusal and returns a statement that fails in the
// upstream's parser (the cast of an unknown literal is evaluated during
// parse analysis) and executes nothing. The error comes back in the right
// place of the response stream and is replaced by e there.
func (s *session) refusalSQL(e *pgproto3.ErrorResponse) string {
	s.mu.Lock()
	s.nextRef++
	id := s.nextRef
	// Bound the map: refusals are forgotten at each ReadyForQuery, so only
	// a client pipelining thousands of refused statements reaches this.
	if len(s.refusals) < 10000 {
		s.refusals[id] = e
	}
	s.mu.Unlock()
	return "SELECT '" + refusalMarkerPrefix + s.nonce + ":" + strconv.FormatUint(id, 10) + "'::pg_catalog.int8"
}

// takeRefusal returns the refusal whose marker appears in an upstream error.
func (s *session) takeRefusal(e *pgproto3.ErrorResponse) *pgproto3.ErrorResponse {
	if e.Code != "22P02" {
		return nil
	}
	i := strings.Index(e.Message, refusalMarkerPrefix+s.nonce+":")
	if i < 0 {
		return nil
	}
	rest := e.Message[i+len(refusalMarkerPrefix)+len(s.nonce)+1:]
	// Only the digits are read: what quotes the value depends on
	// lc_messages (" in English, » « in German, « » in French).
	j := 0
	for j < len(rest) && rest[j] >= '0' && rest[j] <= '9' {
		j++
	}
	if j == 0 {
		return nil
	}
	id, err := strconv.ParseUint(rest[:j], 10, 64)
	if err != nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.refusals[id]
	delete(s.refusals, id)
	return r
}

func (s *session) protocolViolation(err error) error {
	s.terminate(fatal("08P01", "fenceproxy: invalid message from client"), "protocol violation")
	return clientErr(err)
}

// copyUpstreamToClient relays server messages, translating fenceproxy
// errors and tracking ReadyForQuery.
func (s *session) copyUpstreamToClient() error {
	locked := false
	defer func() {
		if locked {
			s.cwMu.Unlock()
		}
	}()
	for {
		if !s.ur.buffered() && locked {
			err := s.cw.Flush()
			s.cwMu.Unlock()
			locked = false
			if err != nil {
				return clientErr(err)
			}
			if s.finishing() {
				return errSessionDone
			}
		}
		typ, n, err := s.ur.header()
		if err != nil {
			if errors.Is(err, io.EOF) {
				if s.finishing() {
					return errSessionDone
				}
				return upstreamErr(io.ErrUnexpectedEOF)
			}
			return upstreamErr(err)
		}
		if !locked {
			s.cwMu.Lock()
			locked = true
		}
		if s.ps != nil && (typ == 'E' || isCompletion(typ)) && s.preparedResponse(typ, 0) {
			// The response to a message the proxy injected.
			if err := s.ur.skip(n); err != nil {
				return upstreamErr(err)
			}
			continue
		}
		switch {
		case typ == 'E' && n <= maxServerMessage:
			s.copyInEnded()
			body, err := s.ur.body(n)
			if err != nil {
				return upstreamErr(err)
			}
			if err := s.relayError(body); err != nil {
				return err
			}
		case typ == 'S' && n <= maxServerMessage:
			body, err := s.ur.body(n)
			if err != nil {
				return upstreamErr(err)
			}
			s.parameterStatus(body)
			if err := writeRaw(s.cw, typ, body); err != nil {
				return clientErr(err)
			}
		case typ == 'G' || typ == 'W':
			s.copyInStarted()
			if err := writeHeader(s.cw, typ, n); err != nil {
				return clientErr(err)
			}
			if err := s.ur.copyBody(s.cw, n); err != nil {
				return upstreamErr(err)
			}
		case typ == 'Z':
			body, err := s.ur.body(n)
			if err != nil {
				return upstreamErr(err)
			}
			if err := writeRaw(s.cw, typ, body); err != nil {
				return clientErr(err)
			}
			if s.ps != nil && len(body) == 1 {
				s.preparedResponse(typ, body[0])
			}
			if len(body) == 1 && s.readyForQuery(body[0]) {
				err := s.cw.Flush()
				s.cwMu.Unlock()
				locked = false
				s.terminate(fatal("57P01", "terminating connection due to administrator command"), "shutdown")
				return errors.Join(errSessionDone, clientErr(err))
			}
		default:
			if err := writeHeader(s.cw, typ, n); err != nil {
				return clientErr(err)
			}
			if err := s.ur.copyBody(s.cw, n); err != nil {
				return upstreamErr(err)
			}
		}
	}
}

// parameterStatus records the settings that change how the server reads
// SQL text.
func (s *session) parameterStatus(body []byte) {
	var ps pgproto3.ParameterStatus
	if ps.Decode(body) != nil {
		return
	}
	switch ps.Name {
	case "standard_conforming_strings":
		s.mu.Lock()
		s.lex.StandardConformingStrings = ps.Value == "on"
		s.mu.Unlock()
	case "client_encoding":
		s.mu.Lock()
		s.lex.ClientEncoding = ps.Value
		s.mu.Unlock()
	}
}

func (s *session) finishing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.state.finishing
}

// readyForQuery records a ReadyForQuery and reports whether the session
// should now be closed because the proxy is draining.
func (s *session) readyForQuery(status byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state.inFlight > 0 {
		s.state.inFlight--
	} else {
		s.state.desync = true
		s.losePreparedTrack()
	}
	// The server is not in copy-in mode when it is ready for a query.
	s.state.copyIn = false
	s.state.txStatus = status
	if s.state.inFlight == 0 && !s.state.unsynced {
		// Every refused or rewritten statement sent so far has been
		// answered; one pipelined behind this Sync would still be pending
		// otherwise.
		clear(s.refusals)
		s.state.rewrote = false
		s.state.execsSinceIdle = 0
	}
	s.idleCond.Broadcast()
	if s.state.draining && s.state.idle() && !s.state.finishing {
		s.state.finishing = true
		return true
	}
	return false
}

// relayError forwards an ErrorResponse, replacing it when it is the
// upstream's report of a refusal, or when the policy translates it (the
// error a rewritten statement raised for a stale or missing token).
func (s *session) relayError(body []byte) error {
	// Cheap filter: only errors that mention fenceproxy, or that may point
	// into a rewritten statement, are looked at.
	if !bytes.Contains(body, []byte("fenceproxy")) {
		s.mu.Lock()
		rewrote := s.state.rewrote
		s.mu.Unlock()
		if rewrote {
			return s.relayErrorWithoutPosition(body)
		}
		return clientErr(writeRaw(s.cw, 'E', body))
	}
	var e pgproto3.ErrorResponse
	if err := e.Decode(body); err != nil {
		return clientErr(writeRaw(s.cw, 'E', body))
	}
	if r := s.takeRefusal(&e); r != nil {
		out := *r
		out.Severity, out.SeverityUnlocalized = e.Severity, e.SeverityUnlocalized
		return clientErr(writeMsg(s.cw, &out))
	}
	if !s.srv.opts.Policy.TranslateError(&s.info, &e) {
		return clientErr(writeRaw(s.cw, 'E', body))
	}
	// Positions and context refer to the rewritten SQL, not the client's.
	e.Position, e.InternalPosition, e.InternalQuery, e.Where = 0, 0, "", ""
	s.log.Info("write fenced", zap.String("sqlstate", e.Code), zap.String("reason", e.Message))
	return clientErr(writeMsg(s.cw, &e))
}

// relayErrorWithoutPosition forwards a server error while a rewritten
// statement is in flight: a position in it would point into the SQL the
// proxy sent, not into the client's, so it is dropped.
func (s *session) relayErrorWithoutPosition(body []byte) error {
	var e pgproto3.ErrorResponse
	if err := e.Decode(body); err != nil || (e.Position == 0 && e.InternalPosition == 0) {
		return clientErr(writeRaw(s.cw, 'E', body))
	}
	e.Position, e.InternalPosition, e.InternalQuery = 0, 0, ""
	return clientErr(writeMsg(s.cw, &e))
}
