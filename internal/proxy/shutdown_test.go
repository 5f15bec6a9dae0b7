package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
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
	testutil.SkipSystem(t, "PostgreSQL")
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
	testutil.SkipSystem(t, "PostgreSQL")
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
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	table := newTable(t, "id int")
	stuck := connect(t, superDSN(p))
	ctx := ctxT(t)
	if _, err := stuck.Exec(ctx, "BEGIN; INSERT INTO "+table+" VALUES (1)", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	pid := stuck.PgConn().PID()

	res := waitShutdown(t, p, 300*time.Millisecond)
	if res.err != nil || !res.timedOut {
		t.Fatalf("Shutdown returned %v, timed out %v; want nil after the deadline", res.err, res.timedOut)
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
	waitFor(t, "the upstream session to end", func() bool { return backendAlive(t, pid) == 0 })
	if n, err := pgxQueryDirect(t, "SELECT count(*) FROM "+table); err != nil || n != 0 {
		t.Fatalf("rows = %d, %v; want 0 (rolled back)", n, err)
	}
}

// TestShutdownDrainTimeoutRunningStatement: a session whose statement is
// still running at the drain deadline is told "terminating connection due
// to administrator command" (57P01). That must hold upstream too: the
// statement must not go on to commit after the client was told its
// session was terminated. Closing the upstream socket is not enough, a
// backend notices a closed client only when it next reads or writes.
func TestShutdownDrainTimeoutRunningStatement(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	table := newTable(t, "id int")
	busy := connect(t, superDSN(p))
	pid := busy.PgConn().PID()
	busyErr := make(chan error, 1)
	go func() {
		_, err := busy.Exec(context.Background(), "INSERT INTO "+table+" SELECT 1 FROM pg_sleep(3)", pgx.QueryExecModeSimpleProtocol)
		busyErr <- err
	}()
	waitFor(t, "the statement to run", func() bool {
		n, err := pgxQueryDirect(t, fmt.Sprintf("SELECT count(*) FROM pg_stat_activity WHERE pid = %d AND state = 'active'", pid))
		return err == nil && n == 1
	})

	res := waitShutdown(t, p, 300*time.Millisecond)
	if res.err != nil || !res.timedOut {
		t.Fatalf("Shutdown returned %v, timed out %v; want nil after the deadline", res.err, res.timedOut)
	}
	if err := <-busyErr; err == nil {
		t.Fatal("statement completed although the drain deadline passed while it ran")
	} else if code := sqlState(err); code != "" && code != "57P01" && code != "57014" {
		t.Fatalf("statement: %v, want 57P01, 57014 or a closed connection", err)
	}
	waitFor(t, "the upstream session to end", func() bool { return backendAlive(t, pid) == 0 })
	if n, err := pgxQueryDirect(t, "SELECT count(*) FROM "+table); err != nil || n != 0 {
		t.Fatalf("the statement of a terminated session committed %d rows (err %v); want 0", n, err)
	}
}

// backendAlive returns 1 if the server process pid is still a session.
func backendAlive(t testing.TB, pid uint32) int {
	t.Helper()
	n, err := pgxQueryDirect(t, fmt.Sprintf("SELECT count(*) FROM pg_stat_activity WHERE pid = %d", pid))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestShutdownDuringStartup: a client that is in the middle of its startup
// when the shutdown begins does not get a usable session.
func TestShutdownDuringStartup(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
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

// TestCancelDuringShutdown: while the proxy drains, a client must still be
// able to cancel its running query (PostgreSQL handles cancel requests in
// every shutdown mode), after which its session can end.
func TestCancelDuringShutdown(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	conn := connectConfig(t, cancellingConfig(t, superDSN(p)))
	if _, err := conn.Exec(ctxT(t), "BEGIN"); err != nil {
		t.Fatal(err)
	}
	done := shutdownAsync(p, time.Minute)
	waitRefusing(t, p)
	checkCancelInTx(t, conn)
	if _, err := conn.Exec(ctxT(t), "ROLLBACK"); err != nil {
		t.Fatalf("ROLLBACK during shutdown: %v", err)
	}
	if res := <-done; res.err != nil || res.timedOut {
		t.Fatalf("Shutdown returned %v, timed out %v", res.err, res.timedOut)
	}
}

// checkCancelInTx is checkCancel for a session in a transaction, which the
// cancelled statement aborts.
func checkCancelInTx(t *testing.T, conn *pgx.Conn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	_, err := conn.Exec(ctx, "SELECT pg_sleep(5)")
	wantSQLState(t, err, "57014")
	if conn.IsClosed() {
		t.Fatal("connection closed after cancel")
	}
}

// TestShutdownDrainTimeoutSlowClient: a client that stopped reading in the
// middle of a large result (e.g. a paused process) cannot hold the drain
// deadline up.
func TestShutdownDrainTimeoutSlowClient(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	c, fe := rawSession(t, p.Addr(), map[string]string{"application_name": "slow-client"})
	fe.Send(&pgproto3.Query{String: "SELECT repeat('x', 1000) FROM generate_series(1, 1000000)"})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	// Never read: the socket buffers fill and the relay blocks writing.
	time.Sleep(200 * time.Millisecond)

	res := waitShutdown(t, p, 300*time.Millisecond)
	if res.err != nil || !res.timedOut {
		t.Fatalf("Shutdown returned %v, timed out %v; want nil after the deadline", res.err, res.timedOut)
	}
	_ = c.Close()
	waitFor(t, "the upstream session to end", func() bool { return upstreamSessions(t, "slow-client") == 0 })
}

// TestShutdownDrainTimeoutStalledUpstream: an upstream that stops sending
// in the middle of a message cannot hold the drain deadline up either. The
// upstream is a scripted fake server.
func TestShutdownDrainTimeoutStalledUpstream(t *testing.T) {
	t.Parallel()
	upstream, stalled := stallingUpstream(t)
	p := proxytest.Start(t, upstream, proxy.Options{})
	_, fe := rawSession(t, p.Addr(), nil)
	fe.Send(&pgproto3.Query{String: "SELECT stall"})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	<-stalled
	time.Sleep(100 * time.Millisecond) // for the relay to start reading the DataRow
	res := waitShutdown(t, p, 300*time.Millisecond)
	if res.err != nil || !res.timedOut {
		t.Fatalf("Shutdown returned %v, timed out %v; want nil after the deadline", res.err, res.timedOut)
	}
}

// waitShutdown runs Shutdown with a drain timeout and fails the test if it
// has not returned long after that timeout.
func waitShutdown(t *testing.T, p *proxytest.Proxy, timeout time.Duration) shutdownResult {
	t.Helper()
	select {
	case res := <-shutdownAsync(p, timeout):
		return res
	case <-time.After(timeout + 20*time.Second):
		t.Fatalf("Shutdown with a %v drain timeout has not returned after 20s more", timeout)
		return shutdownResult{}
	}
}

// stallingUpstream starts a fake PostgreSQL server that accepts any
// startup, and answers any Query with a RowDescription and the first bytes
// of a DataRow, then stalls until the connection is closed. The channel is
// closed when the first stall begins.
func stallingUpstream(t *testing.T) (string, <-chan struct{}) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg      sync.WaitGroup
		once    sync.Once
		stalled = make(chan struct{})
	)
	t.Cleanup(func() {
		_ = l.Close()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				serveStalling(c, func() { once.Do(func() { close(stalled) }) })
			}()
		}
	}()
	return l.Addr().String(), stalled
}

func serveStalling(c net.Conn, stalling func()) {
	be := pgproto3.NewBackend(c, c)
	msg, err := be.ReceiveStartupMessage()
	if err != nil {
		return
	}
	if _, ok := msg.(*pgproto3.StartupMessage); !ok {
		return // e.g. a CancelRequest: close, as PostgreSQL does
	}
	be.Send(&pgproto3.AuthenticationOk{})
	be.Send(&pgproto3.BackendKeyData{ProcessID: 1, SecretKey: []byte{0, 0, 0, 1}})
	be.Send(&pgproto3.ReadyForQuery{TxStatus: 'I'})
	if err := be.Flush(); err != nil {
		return
	}
	for {
		msg, err := be.Receive()
		if err != nil {
			return
		}
		if _, ok := msg.(*pgproto3.Query); !ok {
			continue
		}
		be.Send(&pgproto3.RowDescription{Fields: []pgproto3.FieldDescription{{Name: []byte("x"), DataTypeOID: 25, DataTypeSize: -1, TypeModifier: -1}}})
		if err := be.Flush(); err != nil {
			return
		}
		// DataRow header for 1000 bytes, then 10 of them.
		if _, err := c.Write(append([]byte{'D', 0, 0, 0x03, 0xec}, "0123456789"...)); err != nil {
			return
		}
		// Stall until the proxy goes away.
		stalling()
		_, _ = io.Copy(io.Discard, c)
		return
	}
}
