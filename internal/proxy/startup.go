package proxy

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

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
	pkt, err := s.negotiate()
	if err != nil {
		return
	}
	if startupCode(pkt) == codeCancelRequest {
		s.forwardCancel(pkt)
		return
	}
	s.sendFatal(e)
}

func (s *session) startup() error {
	deadline := time.Now().Add(s.srv.opts.StartupTimeout)
	_ = s.client.SetDeadline(deadline)

	pkt, err := s.negotiate()
	if err != nil {
		return err
	}
	switch code := startupCode(pkt); {
	case code == codeCancelRequest:
		s.forwardCancel(pkt)
		return errSessionDone
	case code>>16 == protocolMajor3:
		if s.srv.opts.RequireClientTLS && !s.clientTLS() && !overUnixSocket(s.client) {
			s.sendFatal(fatal("28000", "fenceproxy: TLS is required (use sslmode=require)"))
			return clientErr(errors.New("client did not negotiate TLS"))
		}
		return s.startSession(pkt, deadline)
	default:
		// Also a second SSLRequest or GSSENCRequest: PostgreSQL takes its
		// code for a protocol version it does not support.
		msg := fmt.Sprintf("unsupported frontend protocol %d.%d: fenceproxy supports protocol 3", code>>16, code&0xffff)
		if code>>16 < protocolMajor3 {
			// PostgreSQL answers an older client in the old protocol's
			// error format: 'E', then the text, NUL-terminated.
			_, _ = s.client.Write(append([]byte("EFATAL:  "+msg+"\n"), 0))
		} else {
			s.sendFatal(fatal("0A000", msg))
		}
		return clientErr(fmt.Errorf("unsupported protocol code %d", code))
	}
}

// negotiate answers SSLRequest and GSSENCRequest as PostgreSQL's
// ProcessStartupPacket does, and returns the first other packet: a
// StartupMessage, a CancelRequest, or one the caller refuses.
//
// Each request is answered once: after an SSLRequest has been answered
// (either way) another one is not taken for a request but for an
// unsupported protocol version, and likewise GSSENCRequest; TLS
// established also ends GSSENCRequests, while a GSSENCRequest answered
// 'N' lets the client ask for TLS again (PostgreSQL resets the flag the
// same way). A client that opened with a TLS ClientHello (direct TLS) is
// answered 'N' to an SSLRequest.
func (s *session) negotiate() ([]byte, error) {
	sslDone, gssDone := false, false
	for {
		pkt, err := s.readFirstPacket()
		if err != nil {
			return nil, err
		}
		if pkt == nil { // direct TLS negotiated; read the next packet
			continue
		}
		switch startupCode(pkt) {
		case codeSSLRequest:
			if sslDone {
				return pkt, nil
			}
			if !s.offersTLS() || s.clientTLS() {
				if _, err := s.client.Write([]byte{'N'}); err != nil {
					return nil, clientErr(err)
				}
				sslDone, gssDone = true, false
				continue
			}
			if _, err := s.client.Write([]byte{'S'}); err != nil {
				return nil, clientErr(err)
			}
			if err := s.startTLS(nil); err != nil {
				return nil, err
			}
			sslDone, gssDone = true, true
		case codeGSSENCRequest:
			if gssDone {
				return pkt, nil
			}
			if _, err := s.client.Write([]byte{'N'}); err != nil {
				return nil, clientErr(err)
			}
			sslDone, gssDone = false, true
		default:
			return pkt, nil
		}
	}
}

// offersTLS reports whether the client may negotiate TLS: it is configured,
// and the client is not on a Unix socket, where PostgreSQL answers
// SSLRequest with 'N' (and takes no direct TLS) whatever its ssl setting.
func (s *session) offersTLS() bool {
	return s.srv.opts.ClientTLS != nil && !overUnixSocket(s.client)
}

// overUnixSocket reports whether c is a Unix-domain socket connection.
func overUnixSocket(c net.Conn) bool { return c.LocalAddr().Network() == "unix" }

// remoteAddr names the client's address in logs and SessionInfo: a Unix
// socket's peer has no name, so it is "[local]", as in PostgreSQL's logs.
func remoteAddr(c net.Conn) string {
	if overUnixSocket(c) {
		return "[local]"
	}
	return c.RemoteAddr().String()
}

// clientTLS reports whether the client connection uses TLS.
func (s *session) clientTLS() bool {
	_, ok := s.client.(*tls.Conn)
	return ok
}

// readFirstPacket reads a startup packet. A client may also open with a TLS
// ClientHello directly (PostgreSQL 17's sslnegotiation=direct); then TLS is
// started and nil is returned.
//
// A packet that cannot be framed (end of input, a length below 8 or above
// PostgreSQL's limit, a truncated body) ends the connection without a word,
// as PostgreSQL does: it only logs "invalid length of startup packet" or
// "incomplete startup packet" (COMMERROR, which goes to the server log
// only). A client that sent its Terminate message before its startup packet
// must not receive an error it does not expect.
func (s *session) readFirstPacket() ([]byte, error) {
	var r io.Reader = s.client
	if !s.clientTLS() && s.offersTLS() {
		var first [1]byte
		if _, err := io.ReadFull(s.client, first[:]); err != nil {
			return nil, clientErr(err)
		}
		if first[0] == 0x16 { // TLS handshake record
			if err := s.startTLS(first[:]); err != nil {
				return nil, err
			}
			return nil, nil
		}
		r = io.MultiReader(bytes.NewReader(first[:]), s.client)
	}
	pkt, err := readStartupPacket(r)
	if err != nil {
		if !errors.Is(err, io.EOF) {
			s.logger().Info("invalid startup packet", zap.Error(err))
			discardPending(s.client)
		}
		return nil, clientErr(err)
	}
	return pkt, nil
}

// discardPending reads what the client has already sent, waiting at most a
// moment, so that closing the connection ends it with a FIN rather than a
// reset (unread input makes the kernel reset it), as with PostgreSQL, which
// reads ahead into an 8 KiB buffer: a client that wrote Terminate and its
// startup packet at once sees the end of the connection, not an error.
// What was sent is normally there already and the read returns at once;
// the deadline only bounds the wait when nothing is, and it must be long
// enough that it has not passed before the read starts on a loaded
// machine (a read whose deadline has passed reads nothing).
func discardPending(c net.Conn) {
	var buf [8 << 10]byte
	_ = c.SetReadDeadline(time.Now().Add(discardWait))
	_, _ = c.Read(buf[:])
}

// discardWait bounds discardPending's wait for input that has not come.
const discardWait = 50 * time.Millisecond

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
	// Always through a prefixConn: once authenticated, the session moves
	// the socket under it to an event loop (session.toLoop).
	raw := &prefixConn{Conn: s.client, prefix: append([]byte(nil), prefix...)}
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
// relayed unchanged, so the key is the upstream's own. The packet goes as
// it came, whatever its length: since protocol 3.2 (PostgreSQL 18) the key
// is variable-length, up to 256 bytes, and the server, which ignores a
// malformed request, is the judge (TestLongCancelKey).
func (s *session) forwardCancel(pkt []byte) {
	// Over TLS when the upstream connection uses it: the packet carries
	// the backend's secret key. (Following the client, over TLS when this
	// connection is: the server takes a cancel either way.)
	c, err := s.srv.dialUpstream(s.clientTLS())
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
	// The packet goes upstream even when its layout is wrong or it names no
	// user: the server's own FATAL (08P01 "invalid startup packet layout",
	// 28000 "no PostgreSQL user name specified") is the answer the client
	// would get without the proxy.
	params := startupParams(pkt)
	s.info.User = params["user"]
	s.info.Database = params["database"]
	if s.info.Database == "" {
		s.info.Database = s.info.User
	}
	if s.ps != nil {
		s.ps.db = s.info.Database
	}
	s.info.ApplicationName = params["application_name"]
	if sp := s.srv.opts.Policy; !s.srv.opts.DisableSettingsCarry {
		if tok, lk := sp.FenceSettings(); tok != "" && s.ps != nil {
			f := &s.fence
			f.on, f.tokenName, f.lockName = true, tok, lk
			f.readWords = append(sqllex.SettingParts(tok, lk), settingReadWords...)
			f.defaults, f.startupTok, f.startupLk = startupFenceValues(params, s.whichSetting)
			f.sess, f.pend, f.cur = f.defaults, f.defaults, f.defaults
		}
	}
	if lp := s.srv.opts.Policy; !s.fence.on {
		// options (-c fence.lock=...), PGOPTIONS, or the setting itself.
		for k, v := range params {
			if lp.NamesLock(&s.info, k) || lp.NamesLock(&s.info, v) {
				s.lockNamed = true
			}
		}
	}
	log := s.logger().With(zap.String("user", s.info.User), zap.String("database", s.info.Database))
	s.mu.Lock()
	s.log = log
	s.mu.Unlock()

	// With certificate authentication the client is judged before the
	// server hears of it.
	var login *upstreamLogin
	if s.srv.opts.ClientCertAuth != nil {
		l, err := s.certLogin()
		if err != nil {
			return err
		}
		login = l
	}

	dialStart := time.Now()
	up, err := s.srv.dialUpstream(s.clientTLS())
	if err != nil {
		s.srv.opts.Hooks.UpstreamConnectFailed()
		s.sendFatal(fatal("08006", "fenceproxy: cannot connect to the upstream server"))
		return upstreamErr(err)
	}
	s.srv.opts.Hooks.UpstreamConnected(time.Since(dialStart))
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

	// Until authentication completes, the client's messages are bounded by
	// PostgreSQL's own limit, not MaxMessageBytes (see maxAuthMessage).
	s.cr = newMsgReader(s.client, ioBufferSize, min(maxAuthMessage, s.srv.opts.MaxMessageBytes))
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
	if err := s.relayAuth(deadline, login); err != nil {
		return err
	}
	s.cr.max = s.srv.opts.MaxMessageBytes
	_ = s.client.SetDeadline(time.Time{})
	_ = up.SetDeadline(time.Time{})
	s.logger().Debug("session authenticated", zap.String("application-name", s.info.ApplicationName))
	return nil
}

// startupParams reads the parameters of a protocol 3 StartupMessage the way
// PostgreSQL's ProcessStartupPacket does: name/value pairs up to an empty
// name, the end of the packet, or a name without a value. It never fails;
// the server judges the layout.
func startupParams(pkt []byte) map[string]string {
	params := make(map[string]string)
	rest := pkt[8:]
	for len(rest) > 0 && rest[0] != 0 {
		name, after, ok := bytes.Cut(rest, []byte{0})
		if !ok || len(after) == 0 {
			break
		}
		value, after, _ := bytes.Cut(after, []byte{0})
		params[string(name)] = string(value)
		rest = after
	}
	return params
}
