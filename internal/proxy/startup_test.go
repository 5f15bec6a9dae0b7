package proxy_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// The startup phase compared with PostgreSQL's own: the same raw bytes go
// to the server directly and through the proxy, and what comes back is
// summarized and compared. What PostgreSQL does is in ProcessStartupPacket
// (src/backend/tcop/backend_startup.c; postmaster.c before version 17).

// startupMessage builds a protocol 3.0 StartupMessage from name/value
// pairs, as raw bytes.
func startupMessage(kv ...string) []byte {
	var payload []byte
	for _, s := range kv {
		payload = append(payload, s...)
		payload = append(payload, 0)
	}
	return startupPacket(0x00030000, append(payload, 0))
}

// rawAnswer sends steps to addr and summarizes what the server sent until
// it closed. Every step but the last is a negotiation request
// (SSLRequest, GSSENCRequest), whose one-byte answer is read before the
// next step is sent, as clients do; after the last step the connection is
// half-closed. The summary lists the answers, then each message by type
// (its type byte; an ErrorResponse by severity and SQLSTATE; "v2 FATAL" for the old
// protocol's error format), then how the connection ended ("eof" or
// "reset").
func rawAnswer(t testing.TB, addr string, steps ...[]byte) string {
	t.Helper()
	c := dialRaw(t, addr)
	var parts []string
	for i, step := range steps {
		if _, err := c.Write(step); err != nil {
			t.Fatal(err)
		}
		if i == len(steps)-1 {
			break
		}
		var answer [1]byte
		if _, err := io.ReadFull(c, answer[:]); err != nil {
			t.Fatalf("read the answer to step %d: %v", i, err)
		}
		parts = append(parts, string(answer[:]))
	}
	_ = c.(*net.TCPConn).CloseWrite()
	got, err := io.ReadAll(c)
	end := "eof"
	switch {
	case errors.Is(err, syscall.ECONNRESET):
		end = "reset"
	case err != nil:
		t.Fatalf("connection not closed: %v (read %q)", err, got)
	}
	if v2, ok := bytes.CutPrefix(got, []byte("EFATAL:")); ok && bytes.IndexByte(v2, 0) == len(v2)-1 {
		return strings.Join(append(parts, "v2 FATAL", end), ", ")
	}
	for len(got) > 0 {
		if len(got) < 5 || int(binary.BigEndian.Uint32(got[1:5])) < 4 || len(got) < 1+int(binary.BigEndian.Uint32(got[1:5])) {
			parts = append(parts, fmt.Sprintf("undecodable %q", got))
			break
		}
		typ, n := got[0], int(binary.BigEndian.Uint32(got[1:5]))
		body := got[5 : 1+n]
		got = got[1+n:]
		if typ != 'E' {
			parts = append(parts, string(typ))
			continue
		}
		var e pgproto3.ErrorResponse
		if err := e.Decode(body); err != nil {
			parts = append(parts, fmt.Sprintf("undecodable error %q", body))
			continue
		}
		parts = append(parts, "E "+e.Severity+" "+e.Code)
	}
	return strings.Join(append(parts, end), ", ")
}

var (
	sslRequest    = startupPacket(80877103, nil)
	gssencRequest = startupPacket(80877104, nil)
)

// startupCases are malformed (and a few valid) first packets, with what
// PostgreSQL 15 answers to each, as observed ("" where the answer is long
// and only compared).
var startupCases = []struct {
	name  string
	steps [][]byte
	want  string
}{
	{"empty", [][]byte{nil}, "eof"},
	{"partial-length", [][]byte{{0, 0}}, "eof"},
	// A client that ends at once writes Terminate before its startup
	// packet: an invalid length, logged by the server only.
	{"terminate-first", [][]byte{append([]byte("X\x00\x00\x00\x04"), startupMessage("user", "postgres")...)}, "eof"},
	{"terminate-only", [][]byte{[]byte("X\x00\x00\x00\x04")}, "eof"},
	{"random-bytes", [][]byte{[]byte("\xde\xad\xbe\xef\x13\x37\x00\xff garbage \x01\x02\x03")}, "eof"},
	{"huge-length", [][]byte{{0x7f, 0xff, 0xff, 0xff, 0, 3, 0, 0}}, "eof"},
	{"negative-length", [][]byte{{0xff, 0xff, 0xff, 0xf0, 0, 3, 0, 0}}, "eof"},
	{"short-length", [][]byte{{0, 0, 0, 4}}, "eof"},
	{"length-7", [][]byte{{0, 0, 0, 7, 0, 3, 0}}, "eof"},
	{"http-request", [][]byte{[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")}, "eof"},
	{"truncated-packet", [][]byte{{0, 0, 0, 100, 0, 3, 0, 0, 'u'}}, "eof"},
	// MAX_STARTUP_PACKET_LENGTH counts what follows the length word. The
	// server reads ahead 8 KiB and closes with the rest unread: a reset.
	{"length-over-limit", [][]byte{startupMessage("user", "postgres", "application_name", strings.Repeat("a", 10004-8-len("user\x00postgres\x00application_name\x00\x00\x00")+1))}, "reset"},
	{"length-at-limit", [][]byte{startupMessage("user", "postgres", "database", "postgres", "application_name", strings.Repeat("a", 10004-8-len("user\x00postgres\x00database\x00postgres\x00application_name\x00\x00\x00")))}, ""},
	{"unknown-protocol", [][]byte{startupPacket(0x00070009, []byte("user\x00x\x00\x00"))}, "E FATAL 0A000, eof"},
	// Protocol 2 is refused in protocol 2's own error format.
	{"protocol-2", [][]byte{startupPacket(0x00020000, make([]byte, 288))}, "v2 FATAL, eof"},
	{"unterminated-parameters", [][]byte{startupPacket(0x00030000, []byte("user\x00postgres\x00database"))}, "E FATAL 08P01, eof"},
	{"odd-parameters", [][]byte{startupPacket(0x00030000, []byte("user\x00\x00"))}, "E FATAL 08P01, eof"},
	{"no-user", [][]byte{startupMessage("database", "postgres")}, "E FATAL 28000, eof"},
	{"cancel-wrong-length", [][]byte{startupPacket(80877102, []byte{0, 0, 0, 1})}, "eof"},
	{"cancel-unknown-key", [][]byte{startupPacket(80877102, []byte{0, 0, 0, 1, 0, 0, 0, 2})}, "eof"},
	// An SSLRequest is answered once; the second is taken for an
	// unsupported protocol version.
	{"ssl-twice", [][]byte{sslRequest, sslRequest}, "N, E FATAL 0A000, eof"},
	{"ssl-then-garbage", [][]byte{sslRequest, []byte("GET / HTTP/1.1\r\n")}, "N, eof"},
	{"ssl-then-no-user", [][]byte{sslRequest, startupMessage("database", "postgres")}, "N, E FATAL 28000, eof"},
	{"ssl-then-cancel", [][]byte{sslRequest, startupPacket(80877102, []byte{0, 0, 0, 1, 0, 0, 0, 2})}, "N, eof"},
}

// TestStartupLikePostgres sends each startup case to PostgreSQL directly
// and through the proxy (with and without TLS configured for clients, for
// the cases without an SSLRequest): the answers must be the same, and a
// healthy session on the proxy is unaffected.
func TestStartupLikePostgres(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	plain := startProxy(t, proxy.Options{})
	withTLS := startProxy(t, proxy.Options{ClientTLS: certs.ServerTLSConfig()})
	healthy := connect(t, superDSN(plain))
	for _, tc := range startupCases {
		t.Run(tc.name, func(t *testing.T) {
			direct := rawAnswer(t, cluster.Addr(), tc.steps...)
			if tc.want != "" && direct != tc.want {
				t.Errorf("PostgreSQL answered %q, the test expects %q", direct, tc.want)
			}
			if got := rawAnswer(t, plain.Addr(), tc.steps...); got != direct {
				t.Errorf("proxy answered %q, PostgreSQL %q", got, direct)
			}
			if len(tc.steps) == 1 {
				if got := rawAnswer(t, withTLS.Addr(), tc.steps...); got != direct {
					t.Errorf("proxy with client TLS configured answered %q, PostgreSQL %q", got, direct)
				}
			}
			selectOne(t, healthy)
		})
	}
	waitFor(t, "startup sessions to end", func() bool {
		return plain.Server.ActiveSessions() == 1 && withTLS.Server.ActiveSessions() == 0
	})
}

// TestTerminateBeforeStartupNoError: the quick-disconnect case with a real
// socket that does not half-close: nothing comes back, not an error.
func TestTerminateBeforeStartupNoError(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	for _, addr := range []string{cluster.Addr(), p.Addr()} {
		c := dialRaw(t, addr)
		msg := append([]byte("X\x00\x00\x00\x04"), startupMessage("user", "postgres", "database", "postgres")...)
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(c)
		if len(got) != 0 || err != nil {
			t.Errorf("%s: got %q, %v; want nothing and a clean end of the connection", addr, got, err)
		}
	}
}

// TestSecondSSLRequestOverTLS: after TLS, another SSLRequest is refused as
// PostgreSQL refuses it (0A000, an unsupported protocol version).
func TestSecondSSLRequestOverTLS(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	c := scramTLSCluster(t)
	p := startProxy(t, proxy.Options{ClientTLS: certs.ServerTLSConfig()})
	for name, addr := range map[string]string{"postgres": c.Addr(), "proxy": p.Addr()} {
		tc := startTLS(t, dialRaw(t, addr), certs.ClientTLSConfig("127.0.0.1"))
		buf, _ := (&pgproto3.SSLRequest{}).Encode(nil)
		if _, err := tc.Write(buf); err != nil {
			t.Fatal(err)
		}
		errs, err := readUntilClosed(newFrontend(tc))
		if !isClosed(err) || len(errs) != 1 || errs[0].Code != "0A000" || errs[0].Severity != "FATAL" {
			t.Errorf("%s: got %s and %v, want one FATAL 0A000", name, errorsString(errs), err)
		}
	}
}

// TestGSSENCRequestOnce: the proxy answers GSSENCRequest 'N' (it offers
// no GSSAPI encryption) and, like PostgreSQL's ProcessStartupPacket, only
// once; a GSSENCRequest answered 'N' lets the client ask for TLS again, and
// one answered SSLRequest lets it ask for GSSAPI again. The installed
// PostgreSQL is built with GSSAPI and answers 'G', so this is not compared
// with it.
func TestGSSENCRequestOnce(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	for _, tc := range []struct {
		name  string
		steps [][]byte
		want  string
	}{
		{"gss-twice", [][]byte{gssencRequest, gssencRequest}, "N, E FATAL 0A000, eof"},
		{"ssl-gss-ssl-gss", [][]byte{sslRequest, gssencRequest, sslRequest, gssencRequest, startupMessage("database", "postgres")}, "N, N, N, N, E FATAL 28000, eof"},
		{"gss-ssl-ssl", [][]byte{gssencRequest, sslRequest, sslRequest}, "N, N, E FATAL 0A000, eof"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := rawAnswer(t, p.Addr(), tc.steps...); got != tc.want {
				t.Errorf("proxy answered %q, want %q", got, tc.want)
			}
		})
	}
}
