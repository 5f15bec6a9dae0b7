package proxy_test

import (
	"crypto/tls"
	"encoding/binary"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// authTimeoutCluster runs SCRAM authentication with a short
// authentication_timeout, after which PostgreSQL ends a stalled login.
func authTimeoutCluster(t testing.TB) *pgcluster.Cluster {
	return sharedCluster(t, "auth-timeout", pgcluster.Options{
		AuthMethod: "scram-sha-256",
		Settings:   map[string]string{"authentication_timeout": "1s"},
	})
}

// clientFirstMessage is a SCRAM client-first-message with GS2 flag
// (n: no channel binding; y: supported but not offered).
func clientFirstMessage(flag string) []byte {
	return []byte(flag + ",,n=,r=fenceproxy-test-nonce-0123456789")
}

// stallLogin starts a SCRAM login on c and stalls: before the client's first
// SASL message, or after the server's first challenge (midSCRAM). It
// returns the errors the server sent from then until it closed, and how
// long that took.
func stallLogin(t testing.TB, c net.Conn, user string, midSCRAM bool) ([]*pgproto3.ErrorResponse, time.Duration) {
	t.Helper()
	if _, ok := firstAuthRequest(t, c, user).(*pgproto3.AuthenticationSASL); !ok {
		t.Fatal("the server does not ask for SASL")
	}
	fe := newFrontend(c)
	if midSCRAM {
		fe.Send(&pgproto3.SASLInitialResponse{AuthMechanism: "SCRAM-SHA-256", Data: clientFirstMessage("n")})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		msg, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := msg.(*pgproto3.AuthenticationSASLContinue); !ok {
			t.Fatalf("got %T, want AuthenticationSASLContinue", msg)
		}
	}
	start := time.Now()
	errs, err := readUntilClosed(fe)
	if !isClosed(err) {
		t.Fatalf("connection not closed: %v", err)
	}
	return errs, time.Since(start)
}

// TestServerGivesUpDuringAuth: PostgreSQL ends a login that stalls past
// authentication_timeout (1s here). Through the proxy the client must hear
// it at once, with the server's own FATAL if it sent one, not at the
// proxy's much later startup timeout.
func TestServerGivesUpDuringAuth(t *testing.T) {
	t.Parallel()
	c := authTimeoutCluster(t)
	user := newUser(t, c, "scram-sha-256")
	const startupTimeout = 20 * time.Second
	p := proxytest.Start(t, c.Addr(), proxy.Options{StartupTimeout: startupTimeout})
	for _, tc := range []struct {
		name     string
		midSCRAM bool
	}{{"before-first-sasl-message", false}, {"mid-scram", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			direct, directTook := stallLogin(t, dialRaw(t, c.Addr()), user, tc.midSCRAM)
			proxied, proxiedTook := stallLogin(t, dialRaw(t, p.Addr()), user, tc.midSCRAM)
			t.Logf("PostgreSQL: %s after %v; proxy: %s after %v", errorsString(direct), directTook, errorsString(proxied), proxiedTook)
			if errorsString(proxied) != errorsString(direct) {
				t.Errorf("proxy sent %s, PostgreSQL %s", errorsString(proxied), errorsString(direct))
			}
			if proxiedTook >= startupTimeout/2 {
				t.Errorf("the proxy closed after %v, not long after the server gave up (%v) but near its own startup timeout %v", proxiedTook, directTook, startupTimeout)
			}
		})
	}
	waitFor(t, "stalled sessions to end", func() bool { return p.Server.ActiveSessions() == 0 })
}

// oversizedAuthAnswer starts a login on addr as user, answers the first
// authentication request with a header announcing a body of size bytes and
// 1 KiB of it, and returns the errors received until the connection closed
// and how long that took.
func oversizedAuthAnswer(t testing.TB, addr, user string, size int) ([]*pgproto3.ErrorResponse, time.Duration) {
	t.Helper()
	c := dialRaw(t, addr)
	firstAuthRequest(t, c, user)
	start := time.Now()
	msg := append([]byte{'p'}, binary.BigEndian.AppendUint32(nil, uint32(size+4))...)
	msg = append(msg, make([]byte, 1024)...)
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	errs, err := readUntilClosed(newFrontend(c))
	if !isClosed(err) {
		t.Fatalf("connection not closed: %v", err)
	}
	return errs, time.Since(start)
}

// TestOversizedAuthAnswer: before authentication completes, a client
// message is bounded by PostgreSQL's own limit (64 KiB), not by
// MaxMessageBytes. A client that announces a 60 MiB SASL or password
// answer is refused as PostgreSQL refuses it, at once, and the proxy does
// not allocate the announced size. Not parallel, so that the allocation
// count is the proxy's.
func TestOversizedAuthAnswer(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	const size = 60 << 20
	const startupTimeout = 20 * time.Second
	const clients = 3
	for _, tc := range []struct {
		name    string
		cluster func(testing.TB) *pgcluster.Cluster
	}{{"sasl", scramTLSCluster}, {"password", passwordCluster}} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.cluster(t)
			user := newUser(t, c, "scram-sha-256")
			p := proxytest.Start(t, c.Addr(), proxy.Options{StartupTimeout: startupTimeout})
			direct, _ := oversizedAuthAnswer(t, c.Addr(), user, size)

			runtime.GC()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			for range clients {
				proxied, took := oversizedAuthAnswer(t, p.Addr(), user, size)
				if errorsString(proxied) != errorsString(direct) {
					t.Errorf("proxy sent %s, PostgreSQL %s", errorsString(proxied), errorsString(direct))
				}
				if took >= startupTimeout/2 {
					t.Errorf("refused after %v, near the startup timeout %v", took, startupTimeout)
				}
			}
			waitFor(t, "refused sessions to end", func() bool { return p.Server.ActiveSessions() == 0 })
			runtime.ReadMemStats(&after)
			allocated := after.TotalAlloc - before.TotalAlloc
			t.Logf("PostgreSQL: %s; %d clients through the proxy allocated %d KiB in all", errorsString(direct), clients, allocated>>10)
			if allocated > size/4 {
				t.Errorf("%d clients announcing %d MiB each made the process allocate %d MiB", clients, size>>20, allocated>>20)
			}
		})
	}
}

// saslAnswerWithFlag logs in as user on c (plain or TLS), answers
// AuthenticationSASL with a SCRAM-SHA-256 client-first-message with GS2 flag
// "y" (the client supports channel binding, none was offered) and returns
// the server's next message.
func saslAnswerWithFlag(t testing.TB, c io.ReadWriter, user string) pgproto3.BackendMessage {
	t.Helper()
	mechs := saslMechanisms(t, c, user)
	for _, m := range mechs {
		if strings.HasSuffix(m, "-PLUS") {
			t.Fatalf("offered %v; a client offered PLUS would use it", mechs)
		}
	}
	fe := pgproto3.NewFrontend(c, c)
	fe.Send(&pgproto3.SASLInitialResponse{AuthMechanism: "SCRAM-SHA-256", Data: clientFirstMessage("y")})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	msg, err := fe.Receive()
	if err != nil {
		t.Fatalf("after the client-first-message: %v", err)
	}
	if e, ok := msg.(*pgproto3.ErrorResponse); ok {
		cp := *e
		return &cp
	}
	return msg
}

// TestChannelBindingRefusalWording: a client that announces channel
// binding support ("y") without being offered SCRAM-SHA-256-PLUS. PostgreSQL
// accepts that over plain TCP and refuses it over TLS (a downgrade). The
// proxy refuses it when its upstream leg is TLS (the server offered PLUS
// there and the flag is covered by the proof), with a message that fits
// the client's leg and names both ways out; with a plaintext upstream leg
// it passes, as it would directly.
func TestChannelBindingRefusalWording(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	c := scramTLSCluster(t)
	user := newUser(t, c, "scram-sha-256")

	t.Run("postgres", func(t *testing.T) {
		if msg := saslAnswerWithFlag(t, dialRaw(t, c.Addr()), user); !isSASLContinue(msg) {
			t.Errorf("PostgreSQL over plain TCP answered %#v, want AuthenticationSASLContinue", msg)
		}
		tc := startTLS(t, dialRaw(t, c.Addr()), certs.ClientTLSConfig("localhost"))
		mechs := saslMechanisms(t, tc, user)
		_ = tc.Close()
		if len(mechs) != 2 {
			t.Fatalf("PostgreSQL over TLS offers %v", mechs)
		}
	})

	for _, leg := range []struct {
		name        string
		clientTLS   bool
		upstreamTLS *tls.Config
		want        []string // phrases of the refusal; nil: no refusal
	}{
		{"plain-client-plain-upstream", false, nil, nil},
		{"tls-client-plain-upstream", true, nil, nil},
		{"plain-client-tls-upstream", false, certs.ClientTLSConfig("localhost"),
			[]string{"without TLS", "channel_binding=disable", "without TLS where that is acceptable"}},
		{"tls-client-tls-upstream", true, certs.ClientTLSConfig("localhost"),
			[]string{"TLS connection ends at the proxy", "channel_binding=disable", "without TLS where that is acceptable"}},
	} {
		t.Run(leg.name, func(t *testing.T) {
			t.Parallel()
			opts := proxy.Options{UpstreamTLS: leg.upstreamTLS}
			if leg.clientTLS {
				// Another certificate than the server's: binding cannot
				// pass through.
				opts.ClientTLS = otherCerts.ServerTLSConfig()
			}
			p := proxytest.Start(t, c.Addr(), opts)
			var conn net.Conn = dialRaw(t, p.Addr())
			if leg.clientTLS {
				conn = startTLS(t, conn, otherCerts.ClientTLSConfig("127.0.0.1"))
			}
			msg := saslAnswerWithFlag(t, conn, user)
			if leg.want == nil {
				if !isSASLContinue(msg) {
					t.Fatalf("proxy answered %#v, want the server's AuthenticationSASLContinue", msg)
				}
				return
			}
			e, ok := msg.(*pgproto3.ErrorResponse)
			if !ok || e.Code != "28000" || e.Severity != "FATAL" {
				t.Fatalf("proxy answered %#v, want FATAL 28000", msg)
			}
			t.Logf("refusal: %s", e.Message)
			for _, phrase := range leg.want {
				if !strings.Contains(e.Message, phrase) {
					t.Errorf("refusal %q does not say %q", e.Message, phrase)
				}
			}
			if leg.clientTLS == strings.Contains(e.Message, "without TLS, so") {
				t.Errorf("refusal %q misdescribes the client's leg", e.Message)
			}
		})
	}
}

func isSASLContinue(msg pgproto3.BackendMessage) bool {
	_, ok := msg.(*pgproto3.AuthenticationSASLContinue)
	return ok
}
