package proxy_test

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
)

// Raw protocol helpers, for what no well-behaved client does.

// dialRaw opens a TCP connection to addr, closed when the test ends, with
// a deadline so that a hung proxy fails the test instead of blocking it.
func dialRaw(t testing.TB, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	return c
}

// startTLS sends SSLRequest on c and, if the server answers 'S', returns
// the TLS client connection.
func startTLS(t testing.TB, c net.Conn, cfg *tls.Config) net.Conn {
	t.Helper()
	buf, err := (&pgproto3.SSLRequest{}).Encode(nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(buf); err != nil {
		t.Fatalf("write SSLRequest: %v", err)
	}
	var answer [1]byte
	if _, err := io.ReadFull(c, answer[:]); err != nil {
		t.Fatalf("read SSLRequest answer: %v", err)
	}
	if answer[0] != 'S' {
		t.Fatalf("SSLRequest answered %q, want 'S'", answer[0])
	}
	tc := tls.Client(c, cfg)
	if err := tc.Handshake(); err != nil {
		t.Fatalf("TLS handshake: %v", err)
	}
	return tc
}

// sendStartup sends a protocol 3.0 StartupMessage.
func sendStartup(t testing.TB, fe *pgproto3.Frontend, params map[string]string) {
	t.Helper()
	fe.Send(&pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber, Parameters: params})
	if err := fe.Flush(); err != nil {
		t.Fatalf("send startup message: %v", err)
	}
}

// rawSession opens a trust-authenticated session as the superuser on addr
// and reads up to the first ReadyForQuery.
func rawSession(t testing.TB, addr string, params map[string]string) (net.Conn, *pgproto3.Frontend) {
	t.Helper()
	c := dialRaw(t, addr)
	fe := pgproto3.NewFrontend(c, c)
	p := map[string]string{"user": "postgres", "database": "postgres"}
	for k, v := range params {
		p[k] = v
	}
	sendStartup(t, fe, p)
	for {
		msg, err := fe.Receive()
		if err != nil {
			t.Fatalf("startup: %v", err)
		}
		switch m := msg.(type) {
		case *pgproto3.ErrorResponse:
			t.Fatalf("startup refused: %s (SQLSTATE %s)", m.Message, m.Code)
		case *pgproto3.ReadyForQuery:
			return c, fe
		}
	}
}

// readUntilClosed reads messages until the connection ends and returns the
// ErrorResponses seen and the error that ended the reading.
func readUntilClosed(fe *pgproto3.Frontend) ([]*pgproto3.ErrorResponse, error) {
	var errs []*pgproto3.ErrorResponse
	for {
		msg, err := fe.Receive()
		if err != nil {
			return errs, err
		}
		if e, ok := msg.(*pgproto3.ErrorResponse); ok {
			cp := *e
			errs = append(errs, &cp)
		}
	}
}

// isClosed reports whether err means the peer closed the connection (as
// opposed to our read deadline expiring).
func isClosed(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return false
	}
	return err != nil
}

// newFrontend returns a pgproto3 Frontend on c.
func newFrontend(c net.Conn) *pgproto3.Frontend { return pgproto3.NewFrontend(c, c) }
