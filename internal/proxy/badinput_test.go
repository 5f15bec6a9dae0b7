package proxy_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// startupPacket builds a startup-phase packet: length, then code, then
// payload.
func startupPacket(code uint32, payload []byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(8+len(payload)))
	b = binary.BigEndian.AppendUint32(b, code)
	return append(b, payload...)
}

// TestGarbageStartup sends malformed startup packets. Each connection is
// closed, with a FATAL ErrorResponse where PostgreSQL sends one and without
// a word where it does not (TestStartupLikePostgres compares each case with
// the server), and a healthy session on the same proxy is unaffected.
func TestGarbageStartup(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	cases := []struct {
		name string
		data []byte
		code string // SQLSTATE of the expected ErrorResponse; "" for none
	}{
		{"random-bytes", []byte("\xde\xad\xbe\xef\x13\x37\x00\xff garbage \x01\x02\x03"), ""},
		{"huge-length", []byte{0x7f, 0xff, 0xff, 0xff, 0, 3, 0, 0}, ""},
		{"negative-length", []byte{0xff, 0xff, 0xff, 0xf0, 0, 3, 0, 0}, ""},
		{"short-length", []byte{0, 0, 0, 4}, ""},
		{"http-request", []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), ""},
		{"unknown-protocol", startupPacket(0x00070009, []byte("user\x00x\x00\x00")), "0A000"},
		{"protocol-4", startupPacket(0x00040000, make([]byte, 288)), "0A000"},
		{"unterminated-parameters", startupPacket(0x00030000, []byte("user\x00postgres\x00database")), "08P01"},
		{"odd-parameters", startupPacket(0x00030000, []byte("user\x00\x00")), "08P01"},
		{"truncated-packet", []byte{0, 0, 0, 100, 0, 3, 0, 0, 'u'}, ""},
		{"empty", nil, ""},
	}
	for _, withTLS := range []bool{false, true} {
		opts := proxy.Options{}
		name := "plaintext"
		if withTLS {
			// With TLS configured the first byte is peeked, to detect a
			// direct TLS ClientHello.
			opts.ClientTLS = certs.ServerTLSConfig()
			name = "tls-configured"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := startProxy(t, opts)
			healthy := connect(t, superDSN(p))
			selectOne(t, healthy)
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					c := dialRaw(t, p.Addr())
					if _, err := c.Write(tc.data); err != nil {
						t.Fatal(err)
					}
					// Half-close: a proxy waiting for more must see EOF.
					_ = c.(*net.TCPConn).CloseWrite()
					got, err := io.ReadAll(c)
					if err != nil && !isClosed(err) {
						t.Fatalf("connection not closed: %v", err)
					}
					checkFatal(t, got, tc.code)
					selectOne(t, healthy)
				})
			}
			// A TLS handshake with garbage in it.
			if withTLS {
				t.Run("bad-client-hello", func(t *testing.T) {
					c := dialRaw(t, p.Addr())
					_, _ = c.Write(append([]byte{0x16, 3, 1, 0, 40}, bytes.Repeat([]byte{0xee}, 40)...))
					_ = c.(*net.TCPConn).CloseWrite()
					if _, err := io.ReadAll(c); err != nil && !isClosed(err) {
						t.Fatalf("connection not closed: %v", err)
					}
					selectOne(t, healthy)
				})
			}
			waitFor(t, "garbage sessions to end", func() bool { return p.Server.ActiveSessions() == 1 })
			selectOne(t, healthy)
		})
	}
}

// checkFatal checks that got, what the proxy sent before closing, is empty
// when code is "" and one FATAL ErrorResponse with SQLSTATE code otherwise.
func checkFatal(t testing.TB, got []byte, code string) {
	t.Helper()
	if code == "" {
		if len(got) > 0 {
			t.Fatalf("proxy sent %q, want nothing", got)
		}
		return
	}
	fe := pgproto3.NewFrontend(bytes.NewReader(got), io.Discard)
	msg, err := fe.Receive()
	if err != nil {
		t.Fatalf("proxy sent %q, want an ErrorResponse with SQLSTATE %s", got, code)
	}
	e, ok := msg.(*pgproto3.ErrorResponse)
	if !ok {
		t.Fatalf("proxy sent %T, want an ErrorResponse", msg)
	}
	if e.Severity != "FATAL" || e.Code != code {
		t.Fatalf("proxy sent %s %s %q, want FATAL %s", e.Severity, e.Code, e.Message, code)
	}
}

// TestOversizedMessage sends a message above MaxMessageBytes: the client
// gets 08P01 and its connection closes, other sessions carry on, and a
// message just under the limit passes.
func TestOversizedMessage(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	const limit = 64 << 10
	p := startProxy(t, proxy.Options{MaxMessageBytes: limit})
	healthy := connect(t, superDSN(p))
	ctx := ctxT(t)

	// Just under the limit: a Query of limit-1 bytes including its NUL.
	sql := "SELECT '" + strings.Repeat("x", limit-1-len("SELECT ''")) + "'"
	var s string
	if err := healthy.QueryRow(ctx, sql, pgx.QueryExecModeSimpleProtocol).Scan(&s); err != nil || len(s) != limit-1-len("SELECT ''") {
		t.Fatalf("query of %d bytes: len %d, %v", len(sql)+1, len(s), err)
	}

	for _, tc := range []struct {
		name string
		msg  pgproto3.FrontendMessage
	}{
		{"query", &pgproto3.Query{String: "SELECT '" + strings.Repeat("y", 1<<20) + "'"}},
		{"parse", &pgproto3.Parse{Query: "SELECT '" + strings.Repeat("y", 1<<20) + "'"}},
		{"copy-data", &pgproto3.CopyData{Data: bytes.Repeat([]byte("z"), 1<<20)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, fe := rawSession(t, p.Addr(), nil)
			// Write in the background: the proxy may close the connection
			// before reading all of it.
			wrote := make(chan error, 1)
			go func() {
				fe.Send(tc.msg)
				wrote <- fe.Flush()
			}()
			errs, err := readUntilClosed(fe)
			if !isClosed(err) {
				t.Fatalf("connection not closed: %v", err)
			}
			_ = c.Close()
			<-wrote
			if len(errs) != 1 || errs[0].Code != "08P01" || errs[0].Severity != "FATAL" {
				t.Fatalf("got errors %v (connection ended with %v), want one FATAL 08P01", errorsString(errs), err)
			}
			t.Logf("proxy said: %s", errs[0].Message)
			selectOne(t, healthy)
		})
	}

	// Through pgx: the oversized query fails and the connection is gone.
	conn := connect(t, superDSN(p))
	_, err := conn.Exec(ctx, "SELECT '"+strings.Repeat("y", 1<<20)+"'", pgx.QueryExecModeSimpleProtocol)
	if err == nil {
		t.Fatal("1 MiB query passed a 64 KiB limit")
	}
	if code := sqlState(err); code != "08P01" {
		t.Logf("pgx reported %v (no 08P01; the connection may have been reset first)", err)
	}
	waitFor(t, "oversized sessions to end", func() bool { return p.Server.ActiveSessions() == 1 })
	selectOne(t, healthy)
}

func errorsString(errs []*pgproto3.ErrorResponse) string {
	var b strings.Builder
	for _, e := range errs {
		fmt.Fprintf(&b, "[%s %s %s] ", e.Severity, e.Code, e.Message)
	}
	return b.String()
}

// TestClientDisconnectMidMessage abandons a message half-way: the proxy
// frees the session and its upstream connection. Query and Parse bodies are
// read whole by the proxy; others (Bind, CopyData) are streamed upstream.
func TestClientDisconnectMidMessage(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	healthy := connect(t, superDSN(p))
	for _, typ := range []byte{'Q', 'P', 'B', 'd'} {
		t.Run(string(typ), func(t *testing.T) {
			app := fmt.Sprintf("mid-message-%c", typ)
			c, _ := rawSession(t, p.Addr(), map[string]string{"application_name": app})
			waitFor(t, "the session to start", func() bool { return upstreamSessions(t, app) == 1 })
			// A header claiming 1000 bytes of body, then 10 bytes, then gone.
			msg := []byte{typ, 0, 0, 0x03, 0xec}
			msg = append(msg, "0123456789"...)
			if _, err := c.Write(msg); err != nil {
				t.Fatal(err)
			}
			_ = c.Close()
			waitFor(t, "the proxy to free the session", func() bool { return p.Server.ActiveSessions() == 1 })
			waitFor(t, "the upstream connection to end", func() bool { return upstreamSessions(t, app) == 0 })
			selectOne(t, healthy)
		})
	}
}

// upstreamSessions counts the server's sessions with application name app.
func upstreamSessions(t testing.TB, app string) int {
	t.Helper()
	n, err := pgxQueryDirect(t, "SELECT count(*) FROM pg_stat_activity WHERE application_name = '"+app+"'")
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestMaxConnections refuses the connection beyond MaxConnections with
// 53300, and accepts one again when a session ends.
func TestMaxConnections(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{MaxConnections: 2})
	ctx := ctxT(t)
	first := connect(t, superDSN(p))
	second := connect(t, superDSN(p))
	for range 3 {
		_, err := pgx.Connect(ctx, superDSN(p))
		wantSQLState(t, err, "53300")
	}
	selectOne(t, first)
	selectOne(t, second)
	if n := p.Server.ActiveSessions(); n != 2 {
		t.Errorf("ActiveSessions() = %d, want 2", n)
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the closed session to end", func() bool { return p.Server.ActiveSessions() == 1 })
	third := connect(t, superDSN(p))
	selectOne(t, third)
	selectOne(t, second)
}

// TestStartupTimeout closes a client that connects and never completes its
// startup.
func TestStartupTimeout(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{StartupTimeout: 300 * time.Millisecond})
	silent := dialRaw(t, p.Addr())
	half := dialRaw(t, p.Addr())
	if _, err := half.Write([]byte{0, 0, 0, 100, 0, 3, 0, 0}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []net.Conn{silent, half} {
		_, err := io.ReadAll(c)
		if err != nil && !isClosed(err) {
			t.Fatalf("connection not closed: %v", err)
		}
	}
	waitFor(t, "stalled sessions to end", func() bool { return p.Server.ActiveSessions() == 0 })
	selectOne(t, connect(t, superDSN(p)))
}

// TestMaxConnectionsClients checks the refusal as real clients see it with
// their default sslmode=prefer, which opens with an SSLRequest.
func TestMaxConnectionsClients(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{MaxConnections: 1, ClientTLS: certs.ServerTLSConfig()})
	first := connect(t, superDSN(p))
	selectOne(t, first)
	t.Run("pgx-prefer", func(t *testing.T) {
		_, err := pgx.Connect(ctxT(t), withQuery(p.URL("postgres", "", "postgres"), "sslmode", "prefer"))
		wantSQLState(t, err, "53300")
	})
	t.Run("psql-prefer", func(t *testing.T) {
		out, err := runClient(t, p, []string{"PGSSLMODE=prefer"}, t.TempDir(), clientBinary(t, "psql"), "-X", "-d", "postgres", "-c", "SELECT 1")
		if err == nil || !strings.Contains(out, "too many clients") {
			t.Fatalf("psql: %v, want the 53300 message in:\n%s", err, out)
		}
	})
	selectOne(t, first)
}

// TestCancelAtMaxConnections: a CancelRequest is not a session; like
// PostgreSQL, the proxy must relay it even when it is at MaxConnections,
// or a client can no longer cancel its own query exactly when the proxy
// is busiest.
func TestCancelAtMaxConnections(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{MaxConnections: 1})
	conn := connectConfig(t, cancellingConfig(t, superDSN(p)))
	checkCancel(t, conn)
}
