package proxy

import (
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"
)

// connectError is a failure to connect to the upstream: the dial, or the
// TLS negotiation that follows it.
type connectError struct{ err error }

func (e *connectError) Error() string { return e.err.Error() }
func (e *connectError) Unwrap() error { return e.err }

// dialUpstreamRaw opens a plain TCP or Unix-socket connection to the upstream. The
// connection must send its first byte within the connect timeout (see
// answerConn).
func (s *Server) dialUpstreamRaw() (*answerConn, error) {
	d := net.Dialer{Timeout: s.opts.ConnectTimeout, KeepAlive: 30 * time.Second}
	c, err := d.Dial(s.opts.UpstreamNetwork, s.opts.UpstreamAddr)
	if err != nil {
		return nil, &connectError{fmt.Errorf("dial upstream: %w", err)}
	}
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
	}
	ac := &answerConn{Conn: c}
	ac.expectAnswer(time.Now().Add(s.opts.ConnectTimeout))
	return ac, nil
}

// dialUpstream connects to the upstream and negotiates TLS when configured:
// always, or, with UpstreamTLSFollowsClient, when clientTLS (the client
// negotiated TLS with the proxy), so that the server's hostssl and
// hostnossl lines see the client's choice.
func (s *Server) dialUpstream(clientTLS bool) (net.Conn, error) {
	c, err := s.dialUpstreamRaw()
	if err != nil {
		return nil, err
	}
	if s.opts.UpstreamTLS == nil || (s.opts.UpstreamTLSFollowsClient && !clientTLS) {
		return c, nil
	}
	_ = c.SetDeadline(time.Now().Add(s.opts.ConnectTimeout))
	var req [8]byte
	binary.BigEndian.PutUint32(req[0:4], 8)
	binary.BigEndian.PutUint32(req[4:8], codeSSLRequest)
	if _, err := c.Write(req[:]); err != nil {
		c.Close()
		return nil, &connectError{fmt.Errorf("upstream SSLRequest: %w", err)}
	}
	var answer [1]byte
	if _, err := io.ReadFull(c, answer[:]); err != nil {
		c.Close()
		return nil, &connectError{fmt.Errorf("upstream SSLRequest: %w", err)}
	}
	if answer[0] != 'S' {
		c.Close()
		return nil, &connectError{errors.New("upstream refused TLS (upstream.tls.mode requires it, or the client negotiated TLS and upstream.tls.follow_client is set)")}
	}
	tc := tls.Client(c, s.opts.UpstreamTLS)
	if err := tc.Handshake(); err != nil {
		c.Close()
		return nil, &connectError{fmt.Errorf("upstream TLS handshake: %w", err)}
	}
	_ = tc.SetDeadline(time.Time{})
	// The startup packet that follows must be answered in time too.
	c.expectAnswer(time.Now().Add(s.opts.ConnectTimeout))
	return tc, nil
}

// errNoAnswer marks a read from the upstream that timed out because the
// upstream did not answer in time after connecting.
var errNoAnswer = errors.New("upstream did not answer within the connect timeout")

// answerConn is an upstream connection that must answer in time. A
// postmaster that is stopped (SIGSTOP, a frozen VM) still completes TCP
// handshakes from its listen backlog, so a successful dial proves little;
// until the upstream has sent a byte after expectAnswer, reads time out at
// that bound, whatever later deadline the caller sets.
type answerConn struct {
	net.Conn
	mu       sync.Mutex
	by       time.Time // zero once the upstream has answered
	deadline time.Time // the read deadline the caller asked for
}

func (c *answerConn) expectAnswer(by time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.by = by
	_ = c.Conn.SetReadDeadline(c.readDeadline())
}

// readDeadline is the earlier of the caller's deadline and the bound;
// c.mu is held.
func (c *answerConn) readDeadline() time.Time {
	if c.by.IsZero() || (!c.deadline.IsZero() && c.deadline.Before(c.by)) {
		return c.deadline
	}
	return c.by
}

func (c *answerConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.by.IsZero() {
		return n, err
	}
	if n > 0 {
		c.by = time.Time{}
		_ = c.Conn.SetReadDeadline(c.deadline)
		return n, err
	}
	if errors.Is(err, os.ErrDeadlineExceeded) && !time.Now().Before(c.by) {
		err = fmt.Errorf("%w: %w", errNoAnswer, err)
	}
	return n, err
}

func (c *answerConn) SetDeadline(t time.Time) error {
	if err := c.Conn.SetWriteDeadline(t); err != nil {
		return err
	}
	return c.SetReadDeadline(t)
}

func (c *answerConn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.deadline = t
	return c.Conn.SetReadDeadline(c.readDeadline())
}
