package proxytest_test

import (
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		testutil.ReportSkips()
		os.Exit(code)
	}))
}

func TestStart(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	c := pgtest.Start(t, pgcluster.Options{})
	p := proxytest.Start(t, c.Addr(), proxy.Options{})
	if p.Options.UpstreamAddr != c.Addr() {
		t.Errorf("UpstreamAddr = %q, want %q", p.Options.UpstreamAddr, c.Addr())
	}
	if p.Host() != "127.0.0.1" || p.Port() == 0 {
		t.Errorf("proxy listens on %s, want 127.0.0.1 and a port", p.Addr())
	}
	conn, err := pgx.Connect(t.Context(), p.DSN("postgres", "", "postgres"))
	if err != nil {
		t.Fatalf("connect through the proxy: %v", err)
	}
	var port int
	if err := conn.QueryRow(t.Context(), "SELECT current_setting('port')::int").Scan(&port); err != nil {
		t.Fatal(err)
	}
	if port != c.Port() {
		t.Errorf("server port = %d, want the upstream's %d", port, c.Port())
	}
	if n := p.Server.ActiveSessions(); n != 1 {
		t.Errorf("ActiveSessions() = %d with one client, want 1", n)
	}
	// The connection is left open: cleanup must close it.
}
