package proxy

import (
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// dialUpstreamRaw opens a plain TCP connection to the upstream.
func (s *Server) dialUpstreamRaw() (net.Conn, error) {
	d := net.Dialer{Timeout: s.opts.ConnectTimeout, KeepAlive: 30 * time.Second}
	c, err := d.Dial("tcp", s.opts.UpstreamAddr)
	if err != nil {
		return nil, fmt.Errorf("dial upstream: %w", err)
	}
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
	}
	return c, nil
}

// dialUpstream connects to the upstream and negotiates TLS when configured.
func (s *Server) dialUpstream() (net.Conn, error) {
	c, err := s.dialUpstreamRaw()
	if err != nil {
		return nil, err
	}
	if s.opts.UpstreamTLS == nil {
		return c, nil
	}
	_ = c.SetDeadline(time.Now().Add(s.opts.ConnectTimeout))
	var req [8]byte
	binary.BigEndian.PutUint32(req[0:4], 8)
	binary.BigEndian.PutUint32(req[4:8], codeSSLRequest)
	if _, err := c.Write(req[:]); err != nil {
		c.Close()
		return nil, fmt.Errorf("upstream SSLRequest: %w", err)
	}
	var answer [1]byte
	if _, err := io.ReadFull(c, answer[:]); err != nil {
		c.Close()
		return nil, fmt.Errorf("upstream SSLRequest: %w", err)
	}
	if answer[0] != 'S' {
		c.Close()
		return nil, errors.New("upstream refused TLS (upstream.tls.mode requires it)")
	}
	tc := tls.Client(c, s.opts.UpstreamTLS)
	if err := tc.Handshake(); err != nil {
		c.Close()
		return nil, fmt.Errorf("upstream TLS handshake: %w", err)
	}
	_ = tc.SetDeadline(time.Time{})
	return tc, nil
}
