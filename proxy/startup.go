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
	s.logger().Debug("session authenticated", zap.String("application-name", s.info.ApplicationName))
	return nil
}
