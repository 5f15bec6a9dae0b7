package proxy_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/url"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testcerts"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// testPassword needs quoting in SQL and escaping in a URL, and is unlikely
// to appear in a log by accident.
const testPassword = `Fence'pw \ s3cr@t:w/rd?#%-7f3a`

// passwordForms are the ways testPassword could show up in a log: as is,
// or escaped inside a DSN.
var passwordForms = []string{testPassword, strings.TrimPrefix(url.UserPassword("u", testPassword).String(), "u:")}

// newUser creates a login role with testPassword stored as encryption says
// ("md5" or "scram-sha-256") and returns its name.
func newUser(t testing.TB, c *pgcluster.Cluster, encryption string) string {
	t.Helper()
	name := fmt.Sprintf("user_%d", tableSeq.Add(1))
	if err := c.CreateUserWith(ctxT(t), name, testPassword, encryption); err != nil {
		t.Fatal(err)
	}
	return name
}

// observedLogger returns a logger that records every entry at debug level
// and above, also writing Info and above to the test log. At the end of
// the test (after the proxy registered later has shut down) it fails the
// test if any entry mentions one of the secrets.
func observedLogger(t testing.TB, secrets ...string) *zap.Logger {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	t.Cleanup(func() {
		entries := logs.AllUntimed()
		if len(entries) == 0 {
			t.Error("the proxy logged nothing; the secret check is vacuous")
		}
		for _, e := range entries {
			text := fmt.Sprintf("%s %s %s %v", e.LoggerName, e.Message, e.Stack, e.ContextMap())
			for _, s := range secrets {
				if strings.Contains(text, s) {
					t.Errorf("log entry %q contains a secret: %s", e.Message, text)
				}
			}
		}
	})
	testCore := zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel)).Core()
	return zap.New(zapcore.NewTee(core, testCore)).Named("proxy")
}

// firstAuthRequest sends a StartupMessage for user over c and returns the
// server's first reply (an Authentication* message or an ErrorResponse).
func firstAuthRequest(t testing.TB, c io.ReadWriter, user string) pgproto3.BackendMessage {
	t.Helper()
	fe := pgproto3.NewFrontend(c, c)
	sendStartup(t, fe, map[string]string{"user": user, "database": "postgres"})
	msg, err := fe.Receive()
	if err != nil {
		t.Fatalf("read authentication request: %v", err)
	}
	return msg
}

// TestAuthentication relays each authentication method: the proxy holds no
// password, the right one gets in, a wrong one is refused with 28P01, and
// neither the password nor a DSN with it reaches the proxy's logs.
func TestAuthentication(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	methods := []struct {
		name       string
		cluster    func(testing.TB) *pgcluster.Cluster
		encryption string
		wantAuth   pgproto3.BackendMessage // type of the first request
	}{
		{"trust", func(testing.TB) *pgcluster.Cluster { return cluster }, "scram-sha-256", &pgproto3.AuthenticationOk{}},
		{"password", passwordCluster, "scram-sha-256", &pgproto3.AuthenticationCleartextPassword{}},
		{"md5", md5Cluster, "md5", &pgproto3.AuthenticationMD5Password{}},
		{"scram-sha-256", scramTLSCluster, "scram-sha-256", &pgproto3.AuthenticationSASL{}},
		// A role whose password is an MD5 hash under scram-sha-256 cannot
		// log in at all; one with a SCRAM verifier under md5 uses SCRAM.
		{"md5-with-scram-verifier", md5Cluster, "scram-sha-256", &pgproto3.AuthenticationSASL{}},
	}
	for _, tc := range methods {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := tc.cluster(t)
			user := newUser(t, c, tc.encryption)
			p := proxytest.Start(t, c.Addr(), proxy.Options{Logger: observedLogger(t, passwordForms...)})

			// The method under test is the one the server asks for.
			raw := dialRaw(t, p.Addr())
			got := firstAuthRequest(t, raw, user)
			_ = raw.Close()
			if fmt.Sprintf("%T", got) != fmt.Sprintf("%T", tc.wantAuth) {
				t.Fatalf("first authentication request through the proxy is %T, want %T", got, tc.wantAuth)
			}

			ctx := ctxT(t)
			conn := connect(t, p.DSN(user, testPassword, "postgres"))
			var who string
			if err := conn.QueryRow(ctx, "SELECT current_user").Scan(&who); err != nil || who != user {
				t.Fatalf("current_user = %q, %v; want %q", who, err, user)
			}

			db := openPQ(t, p.DSN(user, testPassword, "postgres"))
			if err := db.QueryRowContext(ctx, "SELECT current_user").Scan(&who); err != nil || who != user {
				t.Fatalf("lib/pq: current_user = %q, %v; want %q", who, err, user)
			}

			if tc.name == "trust" {
				return
			}
			_, err := pgx.Connect(ctx, p.DSN(user, "wrong"+testPassword, "postgres"))
			wantSQLState(t, err, "28P01")
			bad := openPQ(t, p.DSN(user, "wrong"+testPassword, "postgres"))
			if err := bad.PingContext(ctx); pqCode(err) != "28P01" {
				t.Fatalf("lib/pq with a wrong password: %v, want SQLSTATE 28P01", err)
			}
			// No password at all: the client cannot answer the challenge.
			_, err = pgx.Connect(ctx, p.DSN(user, "", "postgres"))
			if err == nil {
				t.Fatal("connected without a password")
			}
			// The failed attempts left nothing behind.
			waitFor(t, "failed sessions to end", func() bool { return p.Server.ActiveSessions() == 2 })
		})
	}
}

// saslMechanisms reads the AuthenticationSASL mechanisms offered on c.
func saslMechanisms(t testing.TB, c io.ReadWriter, user string) []string {
	t.Helper()
	msg := firstAuthRequest(t, c, user)
	sasl, ok := msg.(*pgproto3.AuthenticationSASL)
	if !ok {
		t.Fatalf("first authentication request is %T, want AuthenticationSASL", msg)
	}
	return sasl.AuthMechanisms
}

// TestSCRAMOverTLS authenticates with SCRAM-SHA-256 with the client
// connected over TLS, for each kind of upstream leg. SCRAM-SHA-256-PLUS
// binds the exchange to the certificate the client saw, which is the
// proxy's: the proxy must not offer it unless that is also the upstream's
// certificate. Clients that support channel binding but are not offered it
// (pgx and libpq by default over TLS) then send the GS2 flag "y", which a
// TLS-enabled server takes for a downgrade attack (RFC 5802, section 6);
// that must either work or end with a clear fenceproxy error.
func TestSCRAMOverTLS(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	c := scramTLSCluster(t)
	user := newUser(t, c, "scram-sha-256")

	// The upstream itself offers channel binding over TLS.
	direct := startTLS(t, dialRaw(t, c.Addr()), certs.ClientTLSConfig("localhost"))
	if mechs := saslMechanisms(t, direct, user); !slices.Contains(mechs, "SCRAM-SHA-256-PLUS") {
		t.Fatalf("upstream offers %v over TLS, want SCRAM-SHA-256-PLUS among them; the test proves nothing", mechs)
	}

	legs := []struct {
		name        string
		clientCerts *testcerts.Files    // what the proxy serves to clients
		upstreamTLS *tls.Config         // nil: plaintext upstream leg
		wantMechs   func([]string) bool // what the proxy may offer
		// bindable: the proxy serves the upstream's own certificate, so
		// channel binding can work end to end.
		bindable bool
	}{
		{
			name:        "plaintext-upstream",
			clientCerts: certs,
			wantMechs:   func(m []string) bool { return slices.Equal(m, []string{"SCRAM-SHA-256"}) },
		},
		{
			name:        "tls-upstream-other-certificate",
			clientCerts: otherCerts,
			upstreamTLS: certs.ClientTLSConfig("localhost"),
			wantMechs:   func(m []string) bool { return slices.Equal(m, []string{"SCRAM-SHA-256"}) },
		},
		{
			name:        "tls-upstream-same-certificate",
			clientCerts: certs,
			upstreamTLS: certs.ClientTLSConfig("localhost"),
			wantMechs: func(m []string) bool {
				return len(m) == 2 && slices.Contains(m, "SCRAM-SHA-256") && slices.Contains(m, "SCRAM-SHA-256-PLUS")
			},
			bindable: true,
		},
	}
	for _, leg := range legs {
		t.Run(leg.name, func(t *testing.T) {
			t.Parallel()
			p := proxytest.Start(t, c.Addr(), proxy.Options{
				ClientTLS:   leg.clientCerts.ServerTLSConfig(),
				UpstreamTLS: leg.upstreamTLS,
				Logger:      observedLogger(t, passwordForms...),
			})
			raw := startTLS(t, dialRaw(t, p.Addr()), leg.clientCerts.ClientTLSConfig("127.0.0.1"))
			if mechs := saslMechanisms(t, raw, user); !leg.wantMechs(mechs) {
				t.Errorf("proxy offers %v over TLS", mechs)
			}
			_ = raw.Close()

			ctx := ctxT(t)
			dsn := func(pw string, kv ...string) string {
				return withQuery(p.URL(user, pw, "postgres"), append([]string{"sslrootcert", leg.clientCerts.CAFile}, kv...)...)
			}
			// Channel binding disabled always works, and a CancelRequest
			// over TLS is relayed.
			t.Run("pgx-channel-binding-disable", func(t *testing.T) {
				conn := connectConfig(t, cancellingConfig(t, dsn(testPassword, "sslmode", "verify-full", "channel_binding", "disable")))
				if _, ok := conn.PgConn().Conn().(*tls.Conn); !ok {
					t.Errorf("client connection is %T, want TLS", conn.PgConn().Conn())
				}
				var upstreamSSL bool
				if err := conn.QueryRow(ctx, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&upstreamSSL); err != nil {
					t.Fatal(err)
				}
				if upstreamSSL != (leg.upstreamTLS != nil) {
					t.Errorf("upstream connection ssl = %v", upstreamSSL)
				}
				checkCancel(t, conn)
			})
			t.Run("libpq-require", func(t *testing.T) {
				db := openPQ(t, dsn(testPassword, "sslmode", "require"))
				var who string
				if err := db.QueryRowContext(ctx, "SELECT current_user").Scan(&who); err != nil || who != user {
					t.Fatalf("current_user = %q, %v; want %q", who, err, user)
				}
			})
			t.Run("pgx-wrong-password", func(t *testing.T) {
				_, err := pgx.Connect(ctx, dsn("nope", "sslmode", "require", "channel_binding", "disable"))
				wantSQLState(t, err, "28P01")
			})
			// pgx's default, channel_binding=prefer.
			for _, sslmode := range []string{"require", "verify-full"} {
				t.Run("pgx-default-"+sslmode, func(t *testing.T) {
					conn, err := pgx.Connect(ctx, dsn(testPassword, "sslmode", sslmode))
					if err == nil {
						selectOne(t, conn)
						conn.Close(ctx)
						return
					}
					if leg.upstreamTLS == nil || leg.bindable {
						t.Fatalf("pgx with default channel binding: %v", err)
					}
					// Binding cannot work: the client must be told why.
					if sqlState(err) != "28000" || !strings.Contains(err.Error(), "fenceproxy") {
						t.Fatalf("pgx with default channel binding: %v; want it to work or a fenceproxy error with SQLSTATE 28000", err)
					}
				})
			}
			t.Run("pgx-channel-binding-require", func(t *testing.T) {
				conn, err := pgx.Connect(ctx, dsn(testPassword, "sslmode", "require", "channel_binding", "require"))
				switch {
				case err == nil && !leg.bindable:
					conn.Close(ctx)
					t.Fatal("channel binding reported through a proxy that cannot bind")
				case err == nil:
					selectOne(t, conn)
					conn.Close(ctx)
				case leg.bindable:
					t.Fatalf("channel binding with the upstream's own certificate: %v", err)
				}
			})
			t.Run("psql-default", func(t *testing.T) {
				psql := clientBinary(t, "psql")
				out, err := runClient(t, p, []string{"PGPASSWORD=" + testPassword}, t.TempDir(), psql, "-X", "-A", "-t", "-d",
					"dbname=postgres sslmode=require user="+user, "-c", "SELECT 'ok'")
				if err == nil {
					return
				}
				if leg.upstreamTLS == nil || leg.bindable || !strings.Contains(out, "fenceproxy") {
					t.Fatalf("psql: %v\n%s", err, out)
				}
			})
		})
	}
}

// TestUpstreamTLS connects the proxy to a TLS-enabled server with full
// verification, and checks that a certificate it must not trust makes the
// client's connection fail with 08006.
func TestUpstreamTLS(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	c := scramTLSCluster(t)
	user := newUser(t, c, "scram-sha-256")
	cases := []struct {
		name     string
		upstream string
		tls      *tls.Config
		ok       bool
	}{
		{"verify-full-localhost", c.Addr(), certs.ClientTLSConfig("localhost"), true},
		{"verify-full-ip", c.Addr(), certs.ClientTLSConfig("127.0.0.1"), true},
		{"wrong-ca", c.Addr(), otherCerts.ClientTLSConfig("localhost"), false},
		{"wrong-name", c.Addr(), certs.ClientTLSConfig("db.example.com"), false},
		{"server-without-tls", cluster.Addr(), certs.ClientTLSConfig("localhost"), false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := proxytest.Start(t, tc.upstream, proxy.Options{UpstreamTLS: tc.tls})
			ctx := ctxT(t)
			u, pw := user, testPassword
			if tc.upstream == cluster.Addr() {
				u, pw = "postgres", ""
			}
			conn, err := pgx.Connect(ctx, p.DSN(u, pw, "postgres"))
			if !tc.ok {
				if err == nil {
					conn.Close(ctx)
				}
				wantSQLState(t, err, "08006")
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(context.Background())
			var ssl bool
			var version string
			if err := conn.QueryRow(ctx, "SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl, &version); err != nil || !ssl {
				t.Fatalf("upstream connection ssl = %v, %v; want true", ssl, err)
			}
			t.Logf("upstream TLS version %s", version)
		})
	}
}
