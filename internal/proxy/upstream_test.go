package proxy_test

import (
	"net"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestUpstreamUnavailable: with nothing listening upstream, the client is
// refused with 08006 and the proxy keeps serving.
func TestUpstreamUnavailable(t *testing.T) {
	t.Parallel()
	// A port that was free a moment ago; nothing listens there now.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()

	hooks := &countingHooks{}
	p := proxytest.Start(t, addr, proxy.Options{Hooks: hooks})
	for range 3 {
		_, err := pgx.Connect(ctxT(t), p.DSN("postgres", "", "postgres"))
		wantSQLState(t, err, "08006")
	}
	if n := hooks.failed.Load(); n != 3 {
		t.Errorf("UpstreamConnectFailed called %d times, want 3", n)
	}
	waitFor(t, "refused sessions to end", func() bool { return p.Server.ActiveSessions() == 0 })
}

// TestUpstreamTerminated: when the server ends a session (here
// pg_terminate_backend), the client receives the server's FATAL error and
// the proxy frees the session; other sessions are unaffected.
func TestUpstreamTerminated(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	healthy := connect(t, superDSN(p))
	victim := connect(t, superDSN(p))
	pid := victim.PgConn().PID()
	var ok bool
	if err := healthy.QueryRow(ctxT(t), "SELECT pg_terminate_backend($1)", pid).Scan(&ok); err != nil || !ok {
		t.Fatalf("pg_terminate_backend = %v, %v", ok, err)
	}
	_, err := victim.Exec(ctxT(t), "SELECT 1")
	if err == nil {
		t.Fatal("terminated session still answers")
	}
	if code := sqlState(err); code != "" && code != "57P01" {
		t.Fatalf("query on a terminated session: %v, want 57P01 or a closed connection", err)
	}
	waitFor(t, "the terminated session to end", func() bool { return p.Server.ActiveSessions() == 1 })
	selectOne(t, healthy)
}
