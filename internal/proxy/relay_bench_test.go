package proxy_test

import (
	"bufio"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/metrics"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// The relay's cost per message on a session that only reads, against a
// scripted server whose answers are canned bytes (so that the benchmark
// measures the proxy, not PostgreSQL): allocations per round trip must be
// zero, whatever the number of rows.
//
//	go test ./internal/proxy -run '^$' -bench Relay -benchmem

// benchRows is the number of DataRows per answer.
const benchRows = 10

func msg(typ byte, body []byte) []byte {
	out := []byte{typ, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(out[1:], uint32(len(body)+4))
	return append(out, body...)
}

func cstr(s string) []byte { return append([]byte(s), 0) }

// scriptedServer answers a startup with AuthenticationOk and
// ReadyForQuery, a Query with a canned result, and Parse, Bind, Describe,
// Execute and Sync with their canned answers.
func scriptedServer(tb testing.TB) string {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = l.Close() })
	var rows []byte
	rowDesc := msg('T', append(append([]byte{0, 1}, cstr("v")...), make([]byte, 18)...))
	for range benchRows {
		rows = append(rows, msg('D', []byte{0, 1, 0, 0, 0, 3, 'a', 'b', 'c'})...)
	}
	complete := msg('C', cstr("SELECT 10"))
	ready := msg('Z', []byte{'I'})
	queryAnswer := append(append(append(append([]byte(nil), rowDesc...), rows...), complete...), ready...)
	execAnswer := append(append([]byte(nil), rows...), complete...)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				var n [4]byte
				if _, err := io.ReadFull(r, n[:]); err != nil {
					return
				}
				if _, err := r.Discard(int(binary.BigEndian.Uint32(n[:])) - 4); err != nil {
					return
				}
				start := append(msg('R', []byte{0, 0, 0, 0}), msg('S', append(cstr("client_encoding"), cstr("UTF8")...))...)
				start = append(start, msg('S', append(cstr("standard_conforming_strings"), cstr("on")...))...)
				start = append(start, msg('K', []byte{0, 0, 0, 1, 0, 0, 0, 2})...)
				start = append(start, ready...)
				if _, err := c.Write(start); err != nil {
					return
				}
				var h [5]byte
				var out []byte
				for {
					if _, err := io.ReadFull(r, h[:]); err != nil {
						return
					}
					if _, err := r.Discard(int(binary.BigEndian.Uint32(h[1:])) - 4); err != nil {
						return
					}
					out = out[:0]
					switch h[0] {
					case 'Q':
						out = append(out, queryAnswer...)
					case 'P':
						out = append(out, '1', 0, 0, 0, 4)
					case 'B':
						out = append(out, '2', 0, 0, 0, 4)
					case 'D':
						out = append(out, rowDesc...)
					case 'E':
						out = append(out, execAnswer...)
					case 'S':
						out = append(out, ready...)
					case 'X':
						return
					}
					if r.Buffered() == 0 && len(out) > 0 {
						if _, err := c.Write(out); err != nil {
							return
						}
					} else if len(out) > 0 {
						if _, err := c.Write(out); err != nil {
							return
						}
					}
				}
			}()
		}
	}()
	return l.Addr().String()
}

// benchClient connects to the proxy and completes the startup.
func benchClient(b *testing.B, addr string) (net.Conn, *bufio.Reader) {
	b.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = c.Close() })
	body := binary.BigEndian.AppendUint32(nil, 196608)
	body = append(append(append(body, cstr("user")...), cstr("bench")...), 0)
	pkt := binary.BigEndian.AppendUint32(nil, uint32(len(body)+4))
	if _, err := c.Write(append(pkt, body...)); err != nil {
		b.Fatal(err)
	}
	r := bufio.NewReaderSize(c, 64<<10)
	readUntilReady(b, r)
	return c, r
}

func readUntilReady(b *testing.B, r *bufio.Reader) {
	for {
		h, err := r.Peek(5)
		if err != nil {
			b.Fatal(err)
		}
		typ, n := h[0], int(binary.BigEndian.Uint32(h[1:]))+1
		if _, err := r.Discard(n); err != nil {
			b.Fatal(err)
		}
		if typ == 'Z' {
			return
		}
	}
}

func benchProxy(b *testing.B) string {
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config"}}, CacheSize: rules.DefaultCacheSize})
	if err != nil {
		b.Fatal(err)
	}
	// The production policy and metrics hooks.
	m := metrics.New()
	p := proxytest.Start(b, scriptedServer(b), proxy.Options{Policy: policy.New(rs, false, policy.Options{Metrics: m}), Hooks: m.Hooks()})
	return p.Addr()
}

// BenchmarkRelaySimpleQuery: one simple Query (a read that names no
// protected table) and its answer of benchRows rows per op.
func BenchmarkRelaySimpleQuery(b *testing.B) { benchSimpleQuery(b, benchProxy(b)) }

// benchSimpleQuery runs the simple Query of BenchmarkRelaySimpleQuery
// through the proxy at addr.
func benchSimpleQuery(b *testing.B, addr string) {
	c, r := benchClient(b, addr)
	benchRoundTrips(b, c, r, msg('Q', cstr("SELECT v FROM items WHERE id = 1")), benchRows+4)
}

// benchRoundTrips sends batch and reads the answer up to ReadyForQuery b.N
// times, and reports the time per message (messages per round trip, both
// ways).
func benchRoundTrips(b *testing.B, c net.Conn, r *bufio.Reader, batch []byte, messages int) {
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if _, err := c.Write(batch); err != nil {
			b.Fatal(err)
		}
		readUntilReady(b, r)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(messages), "ns/message")
}

// BenchmarkRelayExtended: Bind, Execute and Sync of a statement prepared
// once (as pgx's statement cache does) and its answer per op.
func BenchmarkRelayExtended(b *testing.B) {
	c, r := benchClient(b, benchProxy(b))
	prep := append(msg('P', append(append(cstr("s1"), cstr("SELECT v FROM items WHERE id = $1")...), 0, 0)), msg('S', nil)...)
	if _, err := c.Write(prep); err != nil {
		b.Fatal(err)
	}
	readUntilReady(b, r)
	bind := msg('B', append(append(cstr(""), cstr("s1")...), 0, 0, 0, 1, 0, 0, 0, 1, '1', 0, 0))
	exec := msg('E', append(cstr(""), 0, 0, 0, 0))
	batch := append(append(bind, exec...), msg('S', nil)...)
	benchRoundTrips(b, c, r, batch, benchRows+6)
}

// BenchmarkRelayParseEach: an unnamed Parse, Bind, Describe, Execute and
// Sync per op, as pgbench -M extended sends: every op carries a statement
// to decide (a cached decision) and to track as a prepared statement.
func BenchmarkRelayParseEach(b *testing.B) {
	c, r := benchClient(b, benchProxy(b))
	parse := msg('P', append(append(cstr(""), cstr("SELECT v FROM items WHERE id = $1")...), 0, 1, 0, 0, 0, 23))
	bind := msg('B', append(append(cstr(""), cstr("")...), 0, 0, 0, 1, 0, 0, 0, 1, '1', 0, 0))
	desc := msg('D', append([]byte{'P'}, cstr("")...))
	exec := msg('E', append(cstr(""), 0, 0, 0, 0))
	batch := append(append(append(append(parse, bind...), desc...), exec...), msg('S', nil)...)
	benchRoundTrips(b, c, r, batch, benchRows+10)
}

// BenchmarkRelayNoPolicy is BenchmarkRelaySimpleQuery through a proxy
// without a policy (an embedder's plain relay): no allocation either.
func BenchmarkRelayNoPolicy(b *testing.B) {
	benchSimpleQuery(b, proxytest.Start(b, scriptedServer(b), proxy.Options{}).Addr())
}
