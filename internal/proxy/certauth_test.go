package proxy_test

import (
	"context"
	"crypto/md5" //nolint:gosec // PostgreSQL's md5 method
	"crypto/tls"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testcerts"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// The certificate tests share one TLS cluster whose pg_hba.conf has a line
// per role under test: the upstream methods the proxy logs in with after
// certificate authentication (scram-sha-256, md5, cert with a pg_ident
// map for the proxy's own certificate), and hostssl and hostnossl lines
// for the mode that follows the client. The tests that use it do not run
// in parallel: TestCertAuth counts the connections the server received.
const certHBA = `# Written by fenceproxy's certificate tests.
local     all  all        trust
host      all  postgres   127.0.0.1/32  trust
host      all  alice      127.0.0.1/32  scram-sha-256
host      all  nopass     127.0.0.1/32  scram-sha-256
host      all  mdbob      127.0.0.1/32  md5
hostssl   all  certuser   127.0.0.1/32  cert map=proxymap
hostssl   all  tlsonly    127.0.0.1/32  trust
hostnossl all  plainonly  127.0.0.1/32  trust
`

// certIdent maps the proxy's own client certificate (CN fenceproxy) to the
// role it logs in as for a certificate-authenticated client.
const certIdent = "proxymap  fenceproxy  certuser\n"

const (
	alicePassword = "alice's secret"
	bobPassword   = "bob's secret"
)

// clientCerts are client certificates for the tests, written once.
var clientCerts struct {
	once sync.Once
	err  error
	dir  string
	// alice, mallory: signed by certs' CA, CN alice and mallory;
	// otherAlice: CN alice, signed by otherCerts' CA; proxy: CN
	// fenceproxy, the proxy's own upstream certificate.
	alice, mallory, otherAlice, proxy *testcerts.Client
	// Without the cert: a user's certificate for each user the tests log
	// in as, keyed by name.
	byUser map[string]*testcerts.Client
}

func certFiles(t testing.TB) {
	t.Helper()
	c := &clientCerts
	c.once.Do(func() {
		c.dir, c.err = os.MkdirTemp("", "fenceproxy-clientcerts-")
		if c.err != nil {
			return
		}
		c.byUser = map[string]*testcerts.Client{}
		mk := func(f *testcerts.Files, name, cn string) *testcerts.Client {
			if c.err != nil {
				return nil
			}
			var cl *testcerts.Client
			cl, c.err = f.ClientCert(c.dir, name, cn)
			return cl
		}
		c.alice = mk(certs, "alice", "alice")
		c.mallory = mk(certs, "mallory", "mallory")
		c.otherAlice = mk(otherCerts, "other-alice", "alice")
		c.proxy = mk(certs, "proxy", "fenceproxy")
		for _, u := range []string{"mdbob", "nopass", "certuser", "tlsonly", "plainonly"} {
			c.byUser[u] = mk(certs, u, u)
		}
	})
	if c.err != nil {
		t.Fatalf("client certificates: %v", c.err)
	}
}

var certClusterOnce struct {
	once sync.Once
	err  error
}

// certCluster returns the shared TLS cluster with certHBA in force.
func certCluster(t testing.TB) *pgcluster.Cluster {
	t.Helper()
	c := sharedCluster(t, "cert", pgcluster.Options{
		TLS:      &pgcluster.TLSFiles{CertFile: certs.CertFile, KeyFile: certs.KeyFile, CAFile: certs.CAFile},
		Settings: map[string]string{"log_connections": "on"},
	})
	certClusterOnce.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		certClusterOnce.err = setupCertCluster(ctx, c)
	})
	if certClusterOnce.err != nil {
		t.Fatalf("cert cluster: %v", certClusterOnce.err)
	}
	return c
}

func setupCertCluster(ctx context.Context, c *pgcluster.Cluster) error {
	if err := c.CreateUserWith(ctx, "alice", alicePassword, "scram-sha-256"); err != nil {
		return err
	}
	if err := c.CreateUserWith(ctx, "mdbob", bobPassword, "md5"); err != nil {
		return err
	}
	for _, u := range []string{"nopass", "certuser", "tlsonly", "plainonly"} {
		if err := c.CreateUserWith(ctx, u, "", "scram-sha-256"); err != nil {
			return err
		}
	}
	// A restart, not a reload: pg_hba.conf is then in force when it
	// returns.
	if err := os.WriteFile(filepath.Join(c.DataDir(), "pg_hba.conf"), []byte(certHBA), 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(c.DataDir(), "pg_ident.conf"), []byte(certIdent), 0o600); err != nil {
		return err
	}
	if err := c.StopServer(); err != nil {
		return err
	}
	return c.StartServer(ctx)
}

// md5Hash is the password as PostgreSQL's md5 method stores it.
func md5Hash(user, password string) string {
	h := md5.Sum([]byte(password + user)) //nolint:gosec // PostgreSQL's md5 method
	return "md5" + hex.EncodeToString(h[:])
}

// certDSN is a connection string for user through p, presenting cert
// (none when nil) and verifying the proxy's certificate.
func certDSN(p *proxytest.Proxy, user string, cert *testcerts.Client) string {
	kv := []string{"sslmode", "verify-full", "sslrootcert", certs.CAFile}
	if cert != nil {
		kv = append(kv, "sslcert", cert.CertFile, "sslkey", cert.KeyFile)
	}
	return withQuery(p.URL(user, "", "postgres"), kv...)
}

// plainDSN is a connection string for user through p with sslmode.
func plainDSN(p *proxytest.Proxy, user, sslmode string) string {
	return withQuery(p.URL(user, "", "postgres"), "sslmode", sslmode)
}

// connectionsReceived counts the server log's "connection received"
// lines (log_connections): one per connection the server accepted.
func connectionsReceived(t testing.TB, c *pgcluster.Cluster) int {
	t.Helper()
	data, err := os.ReadFile(c.LogFile())
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(data), "connection received:")
}

// TestCertAuth authenticates clients by certificate at the proxy, which
// then logs in to PostgreSQL as the certificate's user with a password
// from its auth file (scram-sha-256 and md5 lines of pg_hba.conf). Wrong
// certificates are refused with 28000 before the server hears of them.
func TestCertAuth(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	c := certCluster(t)
	certFiles(t)
	cc := &clientCerts
	p := startProxyTo(t, c, proxy.Options{
		ClientTLS:      certs.ServerTLSConfig(),
		UpstreamTLS:    certs.ClientTLSConfig("127.0.0.1"),
		ClientCertAuth: &proxy.CertAuth{CAs: certs.CAPool, Passwords: map[string]string{"alice": alicePassword, "mdbob": md5Hash("mdbob", bobPassword)}},
	})

	t.Run("scram-sha-256", func(t *testing.T) {
		conn := connect(t, certDSN(p, "alice", cc.alice))
		var user string
		if err := conn.QueryRow(ctxT(t), "SELECT current_user").Scan(&user); err != nil {
			t.Fatal(err)
		}
		if user != "alice" {
			t.Errorf("current_user = %q, want alice", user)
		}
		// BackendKeyData came from the server: cancelling works.
		checkCancel(t, connectConfig(t, cancellingConfig(t, certDSN(p, "alice", cc.alice))))
	})
	t.Run("md5-hash", func(t *testing.T) {
		conn := connect(t, certDSN(p, "mdbob", cc.byUser["mdbob"]))
		selectOne(t, conn)
	})
	t.Run("no-password-in-auth-file", func(t *testing.T) {
		_, err := pgx.Connect(ctxT(t), certDSN(p, "nopass", cc.byUser["nopass"]))
		wantSQLState(t, err, "28000")
	})

	t.Run("refused", func(t *testing.T) {
		// Each refusal is FATAL 28000 and no connection reaches the
		// server: its log counts one connection received, the successful
		// one that follows the refusals (the log is written in order).
		before := connectionsReceived(t, c)
		cases := []struct {
			name, dsn, want string
		}{
			{"wrong-cn", certDSN(p, "alice", cc.mallory), `certificate authentication failed for user "alice"`},
			{"other-ca", certDSN(p, "alice", cc.otherAlice), `certificate authentication failed for user "alice"`},
			{"no-cert", certDSN(p, "alice", nil), "connection requires a valid client certificate"},
			{"no-tls", plainDSN(p, "alice", "disable"), "needs TLS"},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				_, err := pgx.Connect(ctxT(t), tc.dsn)
				wantSQLState(t, err, "28000")
				if err != nil && !strings.Contains(err.Error(), tc.want) {
					t.Errorf("error %q does not say %q", err, tc.want)
				}
			})
		}
		selectOne(t, connect(t, certDSN(p, "alice", cc.alice)))
		waitFor(t, "the server to log the connection", func() bool { return connectionsReceived(t, c) > before })
		if n := connectionsReceived(t, c) - before; n != 1 {
			t.Errorf("the server received %d connections, want 1 (the refused clients must not reach it)", n)
		}
	})

	t.Run("libpq", func(t *testing.T) {
		db := openPQ(t, certDSN(p, "alice", cc.alice))
		var user string
		if err := db.QueryRowContext(ctxT(t), "SELECT current_user").Scan(&user); err != nil {
			t.Fatal(err)
		}
		if user != "alice" {
			t.Errorf("current_user = %q, want alice", user)
		}
		db = openPQ(t, certDSN(p, "alice", cc.mallory))
		if err := db.PingContext(ctxT(t)); pqCode(err) != "28000" {
			t.Errorf("lib/pq with a certificate for mallory: %v, want SQLSTATE 28000", err)
		}
	})

	t.Run("psql", func(t *testing.T) {
		psql := clientBinary(t, "psql")
		env := func(cert *testcerts.Client) []string {
			return []string{"PGUSER=alice", "PGSSLMODE=verify-full", "PGSSLROOTCERT=" + certs.CAFile,
				"PGSSLCERT=" + cert.CertFile, "PGSSLKEY=" + cert.KeyFile}
		}
		out, err := runClient(t, p, env(cc.alice), t.TempDir(), psql, "-X", "-At", "-d", "postgres", "-c", "SELECT current_user")
		if err != nil {
			t.Fatalf("psql: %v\n%s", err, out)
		}
		if strings.TrimSpace(out) != "alice" {
			t.Errorf("psql printed %q, want alice", out)
		}
		out, err = runClient(t, p, env(cc.mallory), t.TempDir(), psql, "-X", "-At", "-d", "postgres", "-c", "SELECT 1")
		if err == nil || !strings.Contains(out, `certificate authentication failed for user "alice"`) {
			t.Errorf("psql with mallory's certificate: %v\n%s", err, out)
		}
	})
}

// TestCertAuthUpstreamCert: after certificate authentication the proxy
// logs in with its own client certificate, which the server's cert line
// maps to the user with pg_ident.conf; without it the server refuses.
func TestCertAuthUpstreamCert(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	c := certCluster(t)
	certFiles(t)
	cc := &clientCerts
	upTLS := certs.ClientTLSConfig("127.0.0.1")
	upTLS.Certificates = []tls.Certificate{cc.proxy.Cert}
	p := startProxyTo(t, c, proxy.Options{
		ClientTLS:      certs.ServerTLSConfig(),
		UpstreamTLS:    upTLS,
		ClientCertAuth: &proxy.CertAuth{CAs: certs.CAPool},
	})
	conn := connect(t, certDSN(p, "certuser", cc.byUser["certuser"]))
	var user string
	if err := conn.QueryRow(ctxT(t), "SELECT current_user").Scan(&user); err != nil {
		t.Fatal(err)
	}
	if user != "certuser" {
		t.Errorf("current_user = %q, want certuser", user)
	}

	// The same proxy without its certificate: the server's cert line
	// refuses, and the client hears the server's FATAL.
	q := startProxyTo(t, c, proxy.Options{
		ClientTLS:      certs.ServerTLSConfig(),
		UpstreamTLS:    certs.ClientTLSConfig("127.0.0.1"),
		ClientCertAuth: &proxy.CertAuth{CAs: certs.CAPool},
	})
	_, err := pgx.Connect(ctxT(t), certDSN(q, "certuser", cc.byUser["certuser"]))
	wantSQLState(t, err, "28000")
}

// TestUpstreamTLSFollowsClient: with UpstreamTLSFollowsClient the proxy
// reaches the server over TLS exactly when the client reached the proxy
// over TLS, so a hostssl line admits only TLS clients and a hostnossl
// line only plain ones; libpq's sslmode=prefer and allow retry the other
// way when refused, and get in where PostgreSQL says.
func TestUpstreamTLSFollowsClient(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	c := certCluster(t)
	p := startProxyTo(t, c, proxy.Options{
		ClientTLS:                certs.ServerTLSConfig(),
		UpstreamTLS:              certs.ClientTLSConfig("127.0.0.1"),
		UpstreamTLSFollowsClient: true,
	})
	// serverSSL asks the server whether the session's connection is TLS.
	const serverSSL = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
	for _, tc := range []struct {
		user, sslmode string
		ok            bool
	}{
		{"tlsonly", "require", true},
		{"tlsonly", "disable", false},
		{"plainonly", "disable", true},
		{"plainonly", "require", false},
	} {
		t.Run(tc.user+"-"+tc.sslmode, func(t *testing.T) {
			conn, err := pgx.Connect(ctxT(t), plainDSN(p, tc.user, tc.sslmode))
			if !tc.ok {
				// PostgreSQL's own refusal: no pg_hba.conf entry.
				wantSQLState(t, err, "28000")
				if err != nil && !strings.Contains(err.Error(), "pg_hba.conf") {
					t.Errorf("error %q is not the server's pg_hba.conf refusal", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctxT(t))
			var ssl bool
			if err := conn.QueryRow(ctxT(t), serverSSL).Scan(&ssl); err != nil {
				t.Fatal(err)
			}
			if want := tc.sslmode == "require"; ssl != want {
				t.Errorf("server-side ssl = %v, want %v", ssl, want)
			}
		})
	}
	t.Run("cancel", func(t *testing.T) {
		checkCancel(t, connectConfig(t, cancellingConfig(t, plainDSN(p, "tlsonly", "require"))))
		checkCancel(t, connectConfig(t, cancellingConfig(t, plainDSN(p, "plainonly", "disable"))))
	})
	t.Run("psql", func(t *testing.T) {
		// prefer tries TLS first, allow plaintext first; each retries the
		// other way when the server refuses.
		psql := clientBinary(t, "psql")
		for _, tc := range []struct{ user, sslmode, want string }{
			{"plainonly", "prefer", "f"},
			{"tlsonly", "prefer", "t"},
			{"tlsonly", "allow", "t"},
			{"plainonly", "allow", "f"},
		} {
			out, err := runClient(t, p, []string{"PGUSER=" + tc.user, "PGSSLMODE=" + tc.sslmode}, t.TempDir(), psql, "-X", "-At", "-d", "postgres", "-c", serverSSL)
			if err != nil {
				t.Errorf("psql as %s with sslmode=%s: %v\n%s", tc.user, tc.sslmode, err, out)
				continue
			}
			if got := strings.TrimSpace(out); got != tc.want {
				t.Errorf("psql as %s with sslmode=%s: server-side ssl %q, want %q", tc.user, tc.sslmode, got, tc.want)
			}
		}
	})
}

// startProxyTo starts a proxy in front of c.
func startProxyTo(t testing.TB, c *pgcluster.Cluster, opts proxy.Options) *proxytest.Proxy {
	t.Helper()
	return proxytest.Start(t, c.Addr(), opts)
}
