package proxy_test

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/proxy"
)

// shutdownResult is what Shutdown returned, and whether its context had
// expired by then (i.e. sessions had to be closed by force).
type shutdownResult struct {
	err      error
	timedOut bool
}

// shutdownAsync calls Shutdown with a drain timeout in the background and
// returns a channel that receives its result.
func shutdownAsync(p *proxytest.Proxy, timeout time.Duration) <-chan shutdownResult {
	done := make(chan shutdownResult, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		err := p.Server.Shutdown(ctx)
		done <- shutdownResult{err: err, timedOut: ctx.Err() != nil}
	}()
	return done
}

// waitRefusing waits until the proxy no longer accepts new sessions: a
// connection is refused at the TCP level, or answered with 57P01.
func waitRefusing(t *testing.T, p *proxytest.Proxy) {
	t.Helper()
	waitFor(t, "the proxy to refuse new connections", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, superDSN(p))
		if err == nil {
			conn.Close(ctx)
			return false
		}
		var opErr *net.OpError
		return sqlState(err) == "57P01" || errors.As(err, &opErr)
	})
}

// wantClosedByShutdown checks that conn's session was ended by the proxy:
// its next query fails with 57P01 or a closed connection.
func wantClosedByShutdown(t *testing.T, conn *pgx.Conn) {
	t.Helper()
	_, err := conn.Exec(ctxT(t), "SELECT 1")
	if err == nil {
		t.Fatal("session still works after shutdown")
	}
	if code := sqlState(err); code != "" && code != "57P01" {
		t.Fatalf("query after shutdown: %v, want 57P01 or a closed connection", err)
	}
}

// TestShutdownLetsTransactionFinish starts a graceful shutdown while a
// transaction is open: the transaction can still commit, the session is
// closed at the following ReadyForQuery, and no new session is accepted
// meanwhile.
func TestShutdownLetsTransactionFinish(t *testing.T) {
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	table := newTable(t, "id int")
	conn := connect(t, superDSN(p))
	ctx := ctxT(t)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES (1)"); err != nil {
		t.Fatal(err)
	}

	done := shutdownAsync(p, time.Minute)
	waitRefusing(t, p)

	// Still in the transaction: statements run, and COMMIT succeeds.
	if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES (2)"); err != nil {
		t.Fatalf("statement in the open transaction during shutdown: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit during shutdown: %v", err)
	}
	if res := <-done; res.err != nil || res.timedOut {
		t.Fatalf("Shutdown returned %v, timed out %v; want nil before the deadline, the session became idle", res.err, res.timedOut)
	}
	wantClosedByShutdown(t, conn)
	if n, err := pgxQueryDirect(t, "SELECT count(*) FROM "+table); err != nil || n != 2 {
		t.Fatalf("committed rows = %d, %v; want 2", n, err)
	}
	if n := p.Server.ActiveSessions(); n != 0 {
		t.Errorf("ActiveSessions() = %d after Shutdown, want 0", n)
	}
}

// TestShutdownClosesIdleSessions: idle sessions are closed as soon as the
// shutdown starts, without waiting for the drain deadline.
func TestShutdownClosesIdleSessions(t *testing.T) {
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	idle := []*pgx.Conn{connect(t, superDSN(p)), connect(t, superDSN(p))}
	for _, c := range idle {
		selectOne(t, c)
	}
	// One connected but never used beyond startup, one in failed
	// (aborted-then-rolled-back) state: both idle.
	fresh := connect(t, superDSN(p))
	_, _ = idle[1].Exec(ctxT(t), "SELECT 1/0")

	if res := <-shutdownAsync(p, time.Minute); res.err != nil || res.timedOut {
		t.Fatalf("Shutdown returned %v, timed out %v; want nil before the deadline, all sessions were idle", res.err, res.timedOut)
	}
	for _, c := range append(idle, fresh) {
		wantClosedByShutdown(t, c)
	}
	// After Shutdown nothing is accepted.
	_, err := pgx.Connect(ctxT(t), superDSN(p))
	if err == nil {
		t.Fatal("connected after Shutdown")
	}
}

// TestShutdownDrainTimeout: a session stuck in an open transaction is
// closed with 57P01 when the drain deadline passes, and its transaction is
// rolled back by the server.
func TestShutdownDrainTimeout(t *testing.T) {
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	table := newTable(t, "id int")
	stuck := connect(t, superDSN(p))
	ctx := ctxT(t)
	if _, err := stuck.Exec(ctx, "BEGIN; INSERT INTO "+table+" VALUES (1)", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	// A second stuck session, in the middle of a long query.
	busy := connect(t, superDSN(p))
	busyErr := make(chan error, 1)
	go func() {
		_, err := busy.Exec(context.Background(), "SELECT pg_sleep(60)")
		busyErr <- err
	}()

	res := <-shutdownAsync(p, 500*time.Millisecond)
	if res.err != nil {
		t.Fatalf("Shutdown: %v", res.err)
	}
	if !res.timedOut {
		t.Error("Shutdown returned before its deadline although a transaction was open")
	}
	if n := p.Server.ActiveSessions(); n != 0 {
		t.Errorf("ActiveSessions() = %d after Shutdown, want 0", n)
	}
	_, err := stuck.Exec(ctx, "COMMIT")
	if err == nil {
		t.Fatal("COMMIT succeeded after the drain deadline")
	}
	if code := sqlState(err); code != "" && code != "57P01" {
		t.Fatalf("COMMIT after drain deadline: %v, want 57P01 or a closed connection", err)
	}
	if err := <-busyErr; err == nil {
		t.Fatal("long query survived the drain deadline")
	} else if code := sqlState(err); code != "" && code != "57P01" {
		t.Fatalf("long query: %v, want 57P01 or a closed connection", err)
	}
	waitFor(t, "the server to roll the transaction back", func() bool {
		n, err := pgxQueryDirect(t, "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'BEGIN; INSERT INTO "+table+"%' OR query = 'SELECT pg_sleep(60)'")
		return err == nil && n == 0
	})
	if n, err := pgxQueryDirect(t, "SELECT count(*) FROM "+table); err != nil || n != 0 {
		t.Fatalf("rows = %d, %v; want 0 (rolled back)", n, err)
	}
}

// TestShutdownDuringStartup: a client that is in the middle of its startup
// when the shutdown begins does not get a usable session.
func TestShutdownDuringStartup(t *testing.T) {
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	c := dialRaw(t, p.Addr())
	waitFor(t, "the session to be registered", func() bool { return p.Server.ActiveSessions() == 1 })
	done := shutdownAsync(p, 10*time.Second)
	waitRefusing(t, p)
	// Now complete the startup: the session must end rather than serve.
	fe := newFrontend(c)
	sendStartup(t, fe, map[string]string{"user": "postgres", "database": "postgres"})
	errs, err := readUntilClosed(fe)
	if !isClosed(err) {
		t.Fatalf("connection not closed: %v", err)
	}
	if len(errs) != 1 || errs[0].Code != "57P01" {
		t.Logf("session started during shutdown ended with errors %s", errorsString(errs))
	}
	if res := <-done; res.err != nil {
		t.Fatalf("Shutdown: %v", res.err)
	}
}
