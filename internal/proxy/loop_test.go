//go:build linux

package proxy_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestSessionsOnEventLoops checks that authenticated sessions are relayed
// by the event loops, not by the goroutine relay kept for connections
// without a socket, and that sessions spread over several loops work side
// by side.
func TestSessionsOnEventLoops(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{RelayLoops: 2})
	a := connect(t, superDSN(p))
	b := connect(t, superDSN(p))
	c := connect(t, superDSN(p))
	for range 50 {
		selectOne(t, a)
		selectOne(t, b)
		selectOne(t, c)
	}
	if n := proxy.LoopedSessions(p.Server); n != 3 {
		t.Fatalf("%d of 3 sessions on an event loop", n)
	}
	if n := proxy.SessionLoops(p.Server); n != 2 {
		t.Fatalf("sessions spread over %d loops; RelayLoops is 2", n)
	}
}

// slowPolicy blocks its decision on statements that mention
// "slow_decision" until release is closed, and panics on "panic_decision";
// as a quickPolicy it answers the other statements quickly.
type slowPolicy struct {
	proxy.BasePolicy
	entered chan struct{}
	quicks  atomic.Int64

	mu      sync.Mutex
	release chan struct{} // closed to let the blocked decisions return
}

// gate returns the channel a slow decision waits on.
func (p *slowPolicy) gate() chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.release
}

// waitEntered waits until a slow call (what) has started and blocks.
func (p *slowPolicy) waitEntered(t *testing.T, what string) {
	t.Helper()
	select {
	case <-p.entered:
	case <-time.After(15 * time.Second):
		t.Fatalf("%s never started", what)
	}
}

// block makes the next slow decisions wait again, and returns the
// function that lets them go (idempotent, also run when the test ends).
func (p *slowPolicy) block(t *testing.T) func() {
	ch := make(chan struct{})
	p.mu.Lock()
	p.release = ch
	p.mu.Unlock()
	var once sync.Once
	release := func() { once.Do(func() { close(ch) }) }
	t.Cleanup(release) // before the proxy's shutdown, on failure
	return release
}

func (p *slowPolicy) Decide(_ *proxy.SessionInfo, _ proxy.Lexing, sql string) rules.Decision {
	switch {
	case strings.Contains(sql, "slow_decision"):
		p.entered <- struct{}{}
		<-p.gate()
	case strings.Contains(sql, "panic_decision"):
		panic("policy bug")
	}
	return rules.Decision{}
}

func (p *slowPolicy) TranslateError(*proxy.SessionInfo, *pgproto3.ErrorResponse) bool {
	return false
}

// preparedSlowPolicy is a slowPolicy that tracks prepared statements, and
// whose PreparedOps (a parse, in the real policy) blocks like its slow
// decisions on texts that mention "slow_ops".
type preparedSlowPolicy struct{ *slowPolicy }

func (preparedSlowPolicy) Generation(string) uint64 { return 1 }

func (p preparedSlowPolicy) PreparedOps(sql string) ([]proxy.PreparedOp, error) {
	if strings.Contains(sql, "panic_ops") {
		panic("policy bug")
	}
	if strings.Contains(sql, "slow_ops") {
		p.entered <- struct{}{}
		<-p.gate()
	}
	return nil, nil
}

// tookHooks records the longest decision time reported.
type tookHooks struct {
	proxy.NopHooks
	mu      sync.Mutex
	longest time.Duration
}

func (h *tookHooks) Statement(_ *proxy.SessionInfo, _ rules.Decision, took time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.longest = max(h.longest, took)
}

// quickPolicy is a slowPolicy that answers quickly where it can.
type quickPolicy struct{ *slowPolicy }

func (p quickPolicy) DecideQuick(_ *proxy.SessionInfo, _ proxy.Lexing, sql string) (rules.Decision, bool) {
	if strings.Contains(sql, "slow_decision") || strings.Contains(sql, "panic_decision") {
		return rules.Decision{}, false
	}
	if strings.Contains(sql, "panic_quick") {
		panic("policy bug")
	}
	p.quicks.Add(1)
	return rules.Decision{}, true
}

// TestLoopYields: a loop kept busy passes through Go's scheduler every
// few milliseconds (so that the runtime's monitor does not preempt it; see
// yieldEvery in loop.go).
func TestLoopYields(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{RelayLoops: 1})
	conn := connect(t, superDSN(p))
	selectOne(t, conn)
	before := proxy.LoopYields(p.Server)
	start := time.Now()
	for time.Since(start) < 300*time.Millisecond {
		selectOne(t, conn)
	}
	// 300 ms of round trips: over 30 yields at one per 8 ms; at least a
	// few even on a machine that stalls the test now and then.
	if n := proxy.LoopYields(p.Server) - before; n < 5 {
		t.Errorf("the loop yielded %d times in 300 ms of round trips; want one every 8 ms or so", n)
	}
}

// TestOffLoopCap checks the bound on decisions running off the loops at
// once: with room for two, a third slow decision waits for a slot (it has
// not started while two are blocked) and starts when one frees, while a
// statement the quick path decides is served meanwhile.
func TestOffLoopCap(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	sp := &slowPolicy{entered: make(chan struct{})}
	p := startProxy(t, proxy.Options{RelayLoops: 1, Policy: quickPolicy{sp}})
	proxy.SetOffLoopCap(p.Server, 2)
	conns := make([]*pgx.Conn, 4)
	for i := range conns {
		conns[i] = connect(t, superDSN(p))
		selectOne(t, conns[i])
	}
	release := sp.block(t)
	done := make(chan error, 3)
	slow := func(c *pgx.Conn) {
		go func() {
			var got string
			err := c.QueryRow(context.Background(), "SELECT 'slow_decision'").Scan(&got)
			if err == nil && got != "slow_decision" {
				err = fmt.Errorf("got %q", got)
			}
			done <- err
		}()
	}
	slow(conns[0])
	slow(conns[1])
	sp.waitEntered(t, "the first slow decision")
	sp.waitEntered(t, "the second slow decision")
	slow(conns[2])
	// The third waits for a slot: its decision does not start.
	deadline := time.Now().Add(15 * time.Second)
	for {
		running, waiting := p.Server.OffLoopTasks()
		if running == 2 && waiting == 1 {
			break
		}
		select {
		case <-sp.entered:
			t.Fatal("a third decision started while two held the two slots")
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("off the loop: %d running, %d waiting; want 2 and 1", running, waiting)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The quick path needs no slot.
	for range 5 {
		selectOne(t, conns[3])
	}
	release()
	// A slot frees: the third decision starts (its gate is open) and all
	// three statements end.
	sp.waitEntered(t, "the third slow decision")
	for range 3 {
		if err := testutil.Recv(t, done, 15*time.Second, "a slow statement did not end once released"); err != nil {
			t.Errorf("slow statement: %v", err)
		}
	}
	if running, waiting := p.Server.OffLoopTasks(); running != 0 || waiting != 0 {
		t.Errorf("off the loop after the statements: %d running, %d waiting", running, waiting)
	}
	for _, c := range conns {
		selectOne(t, c)
	}
}

// TestSlowDecisionOffLoop checks that a decision that takes long (a
// first-seen statement's parse, a wait for the database's check) holds up
// its own session only: the other sessions of its event loop go on.
// Policy panics refuse the statement on either path.
func TestSlowDecisionOffLoop(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	for _, quick := range []bool{false, true} {
		t.Run(fmt.Sprintf("quick=%v", quick), func(t *testing.T) {
			t.Parallel()
			sp := &slowPolicy{entered: make(chan struct{})}
			var pol proxy.Policy = sp
			if quick {
				pol = quickPolicy{sp}
			}
			hooks := &tookHooks{}
			p := startProxy(t, proxy.Options{RelayLoops: 1, Policy: pol, Hooks: hooks})
			release := sp.block(t)
			a := connect(t, superDSN(p))
			b := connect(t, superDSN(p))
			selectOne(t, a)
			selectOne(t, b)
			if n := proxy.LoopedSessions(p.Server); n != 2 {
				t.Fatalf("%d of 2 sessions on the event loop", n)
			}

			done := make(chan error, 1)
			var got string
			go func() { done <- a.QueryRow(context.Background(), "SELECT 'slow_decision'").Scan(&got) }()
			sp.waitEntered(t, "the slow decision")
			// a's decision is under way: b, on the same loop, is served.
			for range 20 {
				selectOne(t, b)
			}
			select {
			case err := <-done:
				t.Fatalf("a's statement ended before its decision was released: %v", err)
			default:
			}
			time.Sleep(50 * time.Millisecond)
			release()
			if err := <-done; err != nil || got != "slow_decision" {
				t.Fatalf("a's statement = %q, %v", got, err)
			}
			// The decision's time, reported to the hooks, counts the wait
			// (the loop's clock is read when it wakes up).
			hooks.mu.Lock()
			longest := hooks.longest
			hooks.mu.Unlock()
			if longest < 50*time.Millisecond {
				t.Errorf("longest decision reported as %v; the slow one took over 50ms", longest)
			}
			selectOne(t, a)

			// A client that leaves while its decision is under way: its
			// session ends once the decision returns, and the loop's other
			// session is not disturbed.
			c := connect(t, superDSN(p))
			selectOne(t, c)
			release2 := sp.block(t)
			cdone := make(chan error, 1)
			go func() { _, err := c.Exec(context.Background(), "SELECT 'slow_decision'"); cdone <- err }()
			sp.waitEntered(t, "the second slow decision")
			_ = c.PgConn().Conn().Close() // the client's socket, under pgx
			if err := <-cdone; err == nil {
				t.Fatal("the statement of a closed connection succeeded")
			}
			selectOne(t, b)
			release2()
			deadline := time.Now().Add(15 * time.Second)
			for p.Server.ActiveSessions() != 2 {
				if time.Now().After(deadline) {
					t.Fatalf("%d sessions active; want 2 once the left client's decision returned", p.Server.ActiveSessions())
				}
				time.Sleep(10 * time.Millisecond)
			}
			selectOne(t, a)
			selectOne(t, b)

			_, err := b.Exec(ctxT(t), "SELECT 'panic_decision'")
			wantSQLState(t, err, "XX000")
			selectOne(t, b)
			if quick {
				_, err = b.Exec(ctxT(t), "SELECT 'panic_quick'")
				wantSQLState(t, err, "XX000")
				selectOne(t, b)
				if sp.quicks.Load() == 0 {
					t.Fatal("no decision was made on the loop")
				}
			}
		})
	}
}

// TestTLSSessionsOnEventLoops checks that TLS sessions, negotiated with an
// SSLRequest or directly, are relayed by the event loops too (crypto/tls
// over the loop's connection), and work there, large results included.
func TestTLSSessionsOnEventLoops(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{ClientTLS: certs.ServerTLSConfig(), RelayLoops: 1})
	var conns []*pgx.Conn
	for _, params := range [][]string{
		{"sslmode", "require"},
		{"sslmode", "require", "sslnegotiation", "direct"},
	} {
		conn, err := pgx.Connect(ctxT(t), withQuery(p.URL("postgres", "", "postgres"), params...))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close(context.Background()) })
		if _, ok := conn.PgConn().Conn().(*tls.Conn); !ok {
			t.Fatalf("%v: not TLS", params)
		}
		conns = append(conns, conn)
	}
	for range 20 {
		for _, c := range conns {
			selectOne(t, c)
		}
	}
	if n := proxy.LoopedSessions(p.Server); n != 2 {
		t.Fatalf("%d of 2 TLS sessions on an event loop", n)
	}
	// A large result crosses the loop in many TLS records.
	var sum int64
	if err := conns[0].QueryRow(ctxT(t), "SELECT sum(length(repeat('x', g))) FROM generate_series(1, 3000) g").Scan(&sum); err != nil {
		t.Fatal(err)
	}
	var rows int
	if err := conns[1].QueryRow(ctxT(t), "SELECT count(*) FROM (SELECT repeat('y', 1000) FROM generate_series(1, 5000)) s").Scan(&rows); err != nil || rows != 5000 {
		t.Fatalf("count = %d, %v", rows, err)
	}
	r, err := conns[1].Query(ctxT(t), "SELECT repeat('z', 500) FROM generate_series(1, 4000)")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for r.Next() {
		n++
	}
	if r.Err() != nil || n != 4000 {
		t.Fatalf("streamed %d rows, %v", n, r.Err())
	}
	if sum != 3000*3001/2 {
		t.Fatalf("sum = %d", sum)
	}
}

// TestPreparedOpsOffLoop checks that listing a text's SQL-level prepared
// statements, a parse in the real policy, holds up its own session only.
func TestPreparedOpsOffLoop(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	sp := &slowPolicy{entered: make(chan struct{})}
	p := startProxy(t, proxy.Options{RelayLoops: 1, Policy: preparedSlowPolicy{sp}})
	release := sp.block(t)
	a := connect(t, superDSN(p))
	b := connect(t, superDSN(p))
	done := make(chan error, 1)
	var got string
	go func() {
		done <- a.QueryRow(context.Background(), "SELECT 'slow_ops, not a prepare'", pgx.QueryExecModeSimpleProtocol).Scan(&got)
	}()
	sp.waitEntered(t, "PreparedOps")
	for range 20 {
		selectOne(t, b)
	}
	release()
	if err := <-done; err != nil || got != "slow_ops, not a prepare" {
		t.Fatalf("a's statement = %q, %v", got, err)
	}
	selectOne(t, a)

	// A panic listing them refuses the statement; the session goes on.
	_, err := b.Exec(ctxT(t), "SELECT 'panic_ops, not a prepare'", pgx.QueryExecModeSimpleProtocol)
	wantSQLState(t, err, "XX000")
	selectOne(t, b)
}
