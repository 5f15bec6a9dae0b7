package proxy_test

import (
	"context"
	"net"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestSessionsSnapshot: Server.Sessions lists each session with its
// startup parameters, its state as pg_stat_activity would name it, and
// the statements the policy rewrote and refused; a session that ends
// leaves the list.
func TestSessionsSnapshot(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{Policy: stubPolicy{}})
	find := func(pred func(proxy.SessionSnapshot) bool) (proxy.SessionSnapshot, bool) {
		for _, s := range p.Server.Sessions() {
			if pred(s) {
				return s, true
			}
		}
		return proxy.SessionSnapshot{}, false
	}

	// A client that has not sent its startup packet yet.
	raw, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	rawAddr := raw.LocalAddr().String()
	waitFor(t, "the unauthenticated session listed", func() bool {
		s, ok := find(func(s proxy.SessionSnapshot) bool { return s.RemoteAddr == rawAddr })
		return ok && s.State == "startup" && s.User == ""
	})

	cfg, err := pgx.ParseConfig(withQuery(p.URL("postgres", "", "postgres"), "application_name", "snap"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	conn := connectConfig(t, cfg)
	ctx := ctxT(t)
	local := conn.PgConn().Conn().LocalAddr().String()
	mine := func() proxy.SessionSnapshot {
		t.Helper()
		s, ok := find(func(s proxy.SessionSnapshot) bool { return s.RemoteAddr == local })
		if !ok {
			t.Fatalf("no session from %s in %+v", local, p.Server.Sessions())
		}
		return s
	}

	_, err = conn.Exec(ctx, "SELECT * FROM forbidden_table")
	wantSQLState(t, err, "42501")
	if _, err := conn.Exec(ctx, "SELECT 'rewrite-me'"); err != nil {
		t.Fatal(err)
	}
	s := mine()
	if s.User != "postgres" || s.Database != "postgres" || s.ApplicationName != "snap" || s.State != "idle" ||
		s.StatementsFenced != 1 || s.StatementsRefused != 1 || s.ID == 0 || s.Since.IsZero() {
		t.Errorf("session = %+v, want postgres/postgres/snap, idle, 1 fenced, 1 refused", s)
	}

	if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := conn.Exec(context.Background(), "SELECT pg_sleep(1)")
		done <- err
	}()
	waitFor(t, "the session active", func() bool { return mine().State == "active" })
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := mine().State; got != "idle in transaction" {
		t.Errorf("state = %q, want idle in transaction", got)
	}
	_, _ = conn.Exec(ctx, "SELECT 1/0")
	if got := mine().State; got != "idle in transaction (aborted)" {
		t.Errorf("state = %q, want idle in transaction (aborted)", got)
	}

	_ = conn.Close(ctx)
	waitFor(t, "the closed session gone", func() bool {
		_, ok := find(func(s proxy.SessionSnapshot) bool { return s.RemoteAddr == local })
		return !ok
	})
}
