package proxy_test

import (
	"crypto/tls"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestClientTLS serves TLS to clients with the test certificate, which is
// valid for 127.0.0.1, in front of the plaintext trust cluster.
func TestClientTLS(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{ClientTLS: certs.ServerTLSConfig()})
	cases := []struct {
		name    string
		params  []string
		wantTLS bool
		ok      bool
	}{
		{"disable", []string{"sslmode", "disable"}, false, true},
		{"prefer", []string{"sslmode", "prefer"}, true, true},
		{"require", []string{"sslmode", "require"}, true, true},
		{"verify-ca", []string{"sslmode", "verify-ca", "sslrootcert", certs.CAFile}, true, true},
		{"verify-full", []string{"sslmode", "verify-full", "sslrootcert", certs.CAFile}, true, true},
		// PostgreSQL 17's direct TLS negotiation: a ClientHello first.
		{"direct", []string{"sslmode", "require", "sslnegotiation", "direct"}, true, true},
		{"verify-full-other-ca", []string{"sslmode", "verify-full", "sslrootcert", otherCerts.CAFile}, true, false},
	}
	for _, tc := range cases {
		t.Run("pgx-"+tc.name, func(t *testing.T) {
			ctx := ctxT(t)
			conn, err := pgx.Connect(ctx, withQuery(p.URL("postgres", "", "postgres"), tc.params...))
			if !tc.ok {
				if err == nil {
					conn.Close(ctx)
					t.Fatal("connected although the client distrusts the proxy's certificate")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			_, isTLS := conn.PgConn().Conn().(*tls.Conn)
			if isTLS != tc.wantTLS {
				t.Errorf("TLS = %v, want %v", isTLS, tc.wantTLS)
			}
			selectOne(t, conn)
		})
	}
	t.Run("pgx-cancel-over-tls", func(t *testing.T) {
		conn := connectConfig(t, cancellingConfig(t, withQuery(p.URL("postgres", "", "postgres"), "sslmode", "require")))
		checkCancel(t, conn)
	})
	for _, sslmode := range []string{"require", "verify-full"} {
		t.Run("libpq-"+sslmode, func(t *testing.T) {
			db := openPQ(t, withQuery(p.URL("postgres", "", "postgres"), "sslmode", sslmode, "sslrootcert", certs.CAFile))
			var n int
			if err := db.QueryRowContext(ctxT(t), "SELECT 1").Scan(&n); err != nil {
				t.Fatal(err)
			}
		})
	}
	t.Run("psql-verify-full", func(t *testing.T) {
		psql := clientBinary(t, "psql")
		out, err := runClient(t, p, nil, t.TempDir(), psql, "-X", "-d",
			"dbname=postgres sslmode=verify-full sslrootcert="+certs.CAFile, "-c", `\conninfo`)
		if err != nil {
			t.Fatalf("psql: %v\n%s", err, out)
		}
		if !strings.Contains(out, "SSL connection") {
			t.Errorf("psql \\conninfo does not report TLS:\n%s", out)
		}
	})
}

// TestRequireClientTLS refuses clients that do not negotiate TLS with
// 28000 and serves those that do.
func TestRequireClientTLS(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{ClientTLS: certs.ServerTLSConfig(), RequireClientTLS: true})
	ctx := ctxT(t)

	_, err := pgx.Connect(ctx, p.DSN("postgres", "", "postgres"))
	wantSQLState(t, err, "28000")
	db := openPQ(t, p.DSN("postgres", "", "postgres"))
	if err := db.PingContext(ctx); pqCode(err) != "28000" {
		t.Errorf("lib/pq with sslmode=disable: %v, want SQLSTATE 28000", err)
	}

	conn := connect(t, withQuery(p.URL("postgres", "", "postgres"), "sslmode", "verify-full", "sslrootcert", certs.CAFile))
	selectOne(t, conn)
	db = openPQ(t, withQuery(p.URL("postgres", "", "postgres"), "sslmode", "require"))
	if err := db.PingContext(ctx); err != nil {
		t.Errorf("lib/pq with sslmode=require: %v", err)
	}
	waitFor(t, "refused sessions to end", func() bool { return p.Server.ActiveSessions() == 2 })
}

// TestNoClientTLS: a proxy without ClientTLS answers SSLRequest with 'N',
// so sslmode=prefer falls back to plaintext and sslmode=require fails.
func TestNoClientTLS(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	conn := connect(t, withQuery(p.URL("postgres", "", "postgres"), "sslmode", "prefer"))
	if _, isTLS := conn.PgConn().Conn().(*tls.Conn); isTLS {
		t.Error("TLS negotiated with a proxy that has no certificate")
	}
	selectOne(t, conn)
	if _, err := pgx.Connect(ctxT(t), withQuery(p.URL("postgres", "", "postgres"), "sslmode", "require")); err == nil {
		t.Fatal("sslmode=require connected to a proxy without TLS")
	}
	waitFor(t, "the refused session to end", func() bool { return p.Server.ActiveSessions() == 1 })
}
