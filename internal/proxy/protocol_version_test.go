package proxy_test

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Protocol 3.2 (PostgreSQL 18) carries a cancel key of up to 256 bytes in
// BackendKeyData and CancelRequest; a client may ask for any minor version
// of protocol 3, and the server answers NegotiateProtocolVersion with the
// newest it supports. No PostgreSQL 18 is installed for the tests, so a
// scripted server stands in for it; PostgreSQL 15 answers 3.99 itself.

// fakeUpstream is a scripted server that speaks just enough protocol: it
// answers a StartupMessage with NegotiateProtocolVersion (when the client
// asks for more than 3.2), AuthenticationOk, BackendKeyData with a 32-byte
// key and ReadyForQuery, never answers a query, and records the
// CancelRequests it receives.
type fakeUpstream struct {
	l       net.Listener
	key     []byte // process ID and secret key, as sent in BackendKeyData
	cancels chan []byte
	queries chan struct{}
}

func startFakeUpstream(t *testing.T) *fakeUpstream {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeUpstream{
		l:       l,
		key:     binary.BigEndian.AppendUint32(nil, 4242),
		cancels: make(chan []byte, 4),
		queries: make(chan struct{}, 4),
	}
	for i := range 32 {
		f.key = append(f.key, byte(0xa0+i))
	}
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go f.serve(c)
		}
	}()
	return f
}

func (f *fakeUpstream) serve(c net.Conn) {
	defer c.Close()
	var h [8]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return
	}
	n := int(binary.BigEndian.Uint32(h[:4]))
	if n < 8 || n > 10008 {
		return
	}
	rest := make([]byte, n-8)
	if _, err := io.ReadFull(c, rest); err != nil {
		return
	}
	code := binary.BigEndian.Uint32(h[4:])
	if code == 80877102 {
		f.cancels <- append(h[:], rest...)
		return
	}
	var out []byte
	if code>>16 == 3 && code&0xffff > 2 {
		out, _ = (&pgproto3.NegotiateProtocolVersion{NewestMinorProtocol: 3<<16 | 2}).Encode(out)
	}
	out, _ = (&pgproto3.AuthenticationOk{}).Encode(out)
	// pgproto3's BackendKeyData knows only 4-byte keys: frame it by hand.
	out = append(out, 'K')
	out = binary.BigEndian.AppendUint32(out, uint32(4+len(f.key)))
	out = append(out, f.key...)
	out, _ = (&pgproto3.ReadyForQuery{TxStatus: 'I'}).Encode(out)
	if _, err := c.Write(out); err != nil {
		return
	}
	// Read messages; a query is never answered (a long statement).
	for {
		var mh [5]byte
		if _, err := io.ReadFull(c, mh[:]); err != nil {
			return
		}
		body := make([]byte, binary.BigEndian.Uint32(mh[1:])-4)
		if _, err := io.ReadFull(c, body); err != nil {
			return
		}
		if mh[0] == 'Q' {
			f.queries <- struct{}{}
		}
	}
}

// rawStartup sends a startup packet for protocol version code and reads
// the messages up to ReadyForQuery, raw (type byte and body).
func rawStartup(t *testing.T, addr string, code uint32) (net.Conn, map[byte][]byte) {
	t.Helper()
	c := dialRaw(t, addr)
	pkt := startupPacket(code, []byte("user\x00postgres\x00database\x00postgres\x00_pq_.fenceproxy_test\x001\x00\x00"))
	if _, err := c.Write(pkt); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make(map[byte][]byte)
	for {
		var h [5]byte
		if _, err := io.ReadFull(c, h[:]); err != nil {
			t.Fatalf("startup: %v (got %q)", err, got)
		}
		body := make([]byte, binary.BigEndian.Uint32(h[1:])-4)
		if _, err := io.ReadFull(c, body); err != nil {
			t.Fatal(err)
		}
		if h[0] == 'E' {
			var e pgproto3.ErrorResponse
			_ = e.Decode(body)
			t.Fatalf("startup refused: %s (SQLSTATE %s)", e.Message, e.Code)
		}
		got[h[0]] = body
		if h[0] == 'Z' {
			_ = c.SetReadDeadline(time.Time{})
			return c, got
		}
	}
}

// negotiated decodes a NegotiateProtocolVersion body.
func negotiated(t *testing.T, body []byte) *pgproto3.NegotiateProtocolVersion {
	t.Helper()
	if body == nil {
		t.Fatal("no NegotiateProtocolVersion relayed")
	}
	var m pgproto3.NegotiateProtocolVersion
	if err := m.Decode(body); err != nil {
		t.Fatal(err)
	}
	return &m
}

// TestNewerMinorProtocol: a client asking for protocol 3.99 gets the
// server's NegotiateProtocolVersion and its session, as from PostgreSQL.
func TestNewerMinorProtocol(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	const v3_99 = 3<<16 | 99

	t.Run("postgres-15", func(t *testing.T) {
		p := startProxy(t, proxy.Options{})
		c, got := rawStartup(t, p.Addr(), v3_99)
		m := negotiated(t, got['v'])
		if m.NewestMinorProtocol != 3<<16 || len(m.UnrecognizedOptions) != 1 || m.UnrecognizedOptions[0] != "_pq_.fenceproxy_test" {
			t.Errorf("NegotiateProtocolVersion = %+v, want 3.0 and the _pq_ option", m)
		}
		fe := newFrontend(c)
		fe.Send(&pgproto3.Query{String: "SELECT 1"})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		wantReady(t, fe)
	})

	t.Run("fake-3.2-server", func(t *testing.T) {
		up := startFakeUpstream(t)
		p := proxytest.Start(t, up.l.Addr().String(), proxy.Options{})
		_, got := rawStartup(t, p.Addr(), v3_99)
		if m := negotiated(t, got['v']); m.NewestMinorProtocol != 3<<16|2 {
			t.Errorf("NegotiateProtocolVersion names %#x, want the server's 3.2", m.NewestMinorProtocol)
		}
		if !bytes.Equal(got['K'], up.key) {
			t.Errorf("BackendKeyData %x, want the server's %x", got['K'], up.key)
		}
	})
}

// TestLongCancelKey: a 3.2 server's 32-byte cancel key reaches the client
// whole, and a CancelRequest carrying it reaches the server whole, whether
// the client sends it or the proxy does for a client that went away
// during a statement.
func TestLongCancelKey(t *testing.T) {
	t.Parallel()
	up := startFakeUpstream(t)
	p := proxytest.Start(t, up.l.Addr().String(), proxy.Options{})
	wantCancel := append(binary.BigEndian.AppendUint32(nil, uint32(8+len(up.key))), 0x04, 0xd2, 0x16, 0x2e)
	wantCancel = append(wantCancel, up.key...)
	received := func(who string) {
		t.Helper()
		select {
		case got := <-up.cancels:
			if !bytes.Equal(got, wantCancel) {
				t.Errorf("%s: server received CancelRequest %x, want %x", who, got, wantCancel)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: no CancelRequest reached the server", who)
		}
	}

	c, got := rawStartup(t, p.Addr(), 3<<16|2)
	if !bytes.Equal(got['K'], up.key) {
		t.Fatalf("BackendKeyData %x, want the server's %x", got['K'], up.key)
	}

	// The client cancels, with the key it was given.
	cancel := dialRaw(t, p.Addr())
	if _, err := cancel.Write(wantCancel); err != nil {
		t.Fatal(err)
	}
	received("client's cancel")

	// The client goes away during a statement: the proxy cancels it.
	if _, err := c.Write([]byte("Q\x00\x00\x00\x0dSELECT 1\x00")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-up.queries:
	case <-time.After(10 * time.Second):
		t.Fatal("query did not reach the server")
	}
	_ = c.Close()
	received("proxy's cancel")
}
