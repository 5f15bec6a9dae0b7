package proxy

import (
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
)

// Authentication request codes (PostgreSQL protocol, AuthenticationXXX).
const (
	authOK       = 0
	authSASL     = 10
	authSASLDone = 12
)

// maxAuthMessage bounds the body of a client message during
// authentication: PostgreSQL's PG_MAX_AUTH_TOKEN_LENGTH (65535, in
// src/backend/libpq/auth.c), its limit for password packets and GSSAPI
// tokens. Its SASL limit is lower (PG_MAX_SASL_MESSAGE_LENGTH, 1024, in
// auth-sasl.c, for SCRAM), so no server accepts more than this.
const maxAuthMessage = 65535

// relayAuth relays the authentication exchange until the upstream's first
// ReadyForQuery. The proxy holds no passwords: every challenge is relayed to
// the client and every answer to the upstream. With login (the proxy
// authenticated the client by certificate) the proxy answers the
// challenges itself, and the client hears only AuthenticationOk.
//
// While it waits for the client, it watches the upstream: a server that
// gives up on a stalled login (authentication_timeout) or shuts down sends
// its FATAL and closes, and the client hears of it at once.
func (s *session) relayAuth(deadline time.Time, login *upstreamLogin) error {
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
			if login != nil && code != authOK {
				if err := s.answerUpstream(login, code, body); err != nil {
					return err
				}
				continue
			}
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
			stop := s.watchUpstream(deadline)
			ctyp, cn, err := s.cr.header()
			var cbody []byte
			if err == nil {
				cbody, err = s.cr.body(cn)
			}
			if stop() {
				// The server spoke or hung up first: relay that.
				continue
			}
			if errors.Is(err, errMessageTooLarge) || errors.Is(err, errBadLength) {
				return s.refuseAuthMessage(err)
			}
			if err != nil {
				return clientErr(err)
			}
			if code == authSASL && plusWithheld && ctyp == 'p' && saslWantsBinding(cbody) {
				s.sendFatal(fatal("28000", s.channelBindingRefusal()))
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
			if s.fence.on {
				// Before the client may send anything: the role's and
				// database's defaults of the fence settings. (body aliases
				// the reader's buffer, which the query's answer reuses.)
				body = append([]byte(nil), body...)
				if err := s.readFenceDefaults(); err != nil {
					return err
				}
			}
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
				// also attributes audit events to sessions. The key's
				// length is the server's: 4 bytes in protocol 3.0, up to
				// 256 in 3.2.
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

// watchUpstream watches the upstream connection while the caller reads the
// client's answer to an authentication request. During authentication the
// server sends nothing until the client answers, unless it gives up; then
// the watch wakes the caller's client read (by its deadline). stop ends the
// watch, restores both read deadlines, and reports whether the upstream
// spoke or closed; the upstream reader is the caller's again after it.
func (s *session) watchUpstream(deadline time.Time) (stop func() bool) {
	var stopping, spoke atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, err := s.ur.peek(1)
		if err != nil && stopping.Load() && isTimeout(err) {
			return
		}
		spoke.Store(true)
		_ = s.client.SetReadDeadline(time.Now())
	}()
	return func() bool {
		stopping.Store(true)
		_ = s.upstream.SetReadDeadline(time.Now())
		<-done
		_ = s.upstream.SetReadDeadline(deadline)
		_ = s.client.SetReadDeadline(deadline)
		return spoke.Load()
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// refuseAuthMessage handles a client message during authentication whose
// length is out of bounds (above maxAuthMessage, or below 4). Its body is
// never read. The header alone goes upstream, where PostgreSQL refuses it by
// the same rule ("invalid message length", its limits being no higher), and
// the server's answer is relayed: FATAL 28P01 after a SASL message, a
// silent close after a password packet, as the client would get directly.
func (s *session) refuseAuthMessage(cause error) error {
	hdr, err := s.cr.peek(5)
	if err != nil {
		return clientErr(err)
	}
	if _, err := s.uw.Write(hdr); err != nil {
		return upstreamErr(err)
	}
	if err := s.uw.Flush(); err != nil {
		return upstreamErr(err)
	}
	// A server that waited for the body would hear the end of input.
	if cw, ok := s.upstream.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	for {
		typ, n, err := s.ur.header()
		if err != nil || n > maxServerMessage {
			break
		}
		body, err := s.ur.body(n)
		if err != nil {
			break
		}
		if typ == 'E' {
			if err := writeRaw(s.cw, typ, body); err == nil {
				_ = s.cw.Flush()
			}
			break
		}
	}
	return clientErr(cause)
}

// channelBindingRefusal words the refusal of a client that announced SCRAM
// channel binding support (GS2 flag "y") to a server that offers
// SCRAM-SHA-256-PLUS over the proxy's TLS connection. Such a server takes
// "y" for a downgrade attack, and the SCRAM proof covers the flag, so the
// proxy cannot change it.
func (s *session) channelBindingRefusal() string {
	const server = "the server offers SCRAM-SHA-256-PLUS over the proxy's TLS connection to it and would take this for a downgrade attack"
	if !s.clientTLS() {
		return "fenceproxy: SCRAM channel binding is not possible on this connection: " +
			"the client connected to the proxy without TLS, so none was offered, but it announced support for it; " +
			server + "; connect with channel_binding=disable, or have the proxy reach the server without TLS where that is acceptable"
	}
	return "fenceproxy: SCRAM channel binding cannot pass through the proxy: " +
		"the client's TLS connection ends at the proxy, which opens its own TLS connection to the server with another certificate, so the binding data cannot match; " +
		server + "; connect with channel_binding=disable, or have the proxy reach the server without TLS where that is acceptable"
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
