package e2e_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/etcdcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/service"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// The tests share one PostgreSQL cluster, one single-member etcd and one
// in-process fenceproxy, started on first use by getStack and stopped after
// the last test; the lock-fenced torture adds its own three-member etcd and
// three proxies. Worker processes reach them through the addresses passed in
// their environment.

func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		os.Exit(runWorker(role))
	}
	code := m.Run()
	stopStack()
	testutil.ReportSkips()
	if code == 0 {
		if err := findLeaks(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// Protected tables. The proxy's rules are fixed when the stack starts, so
// every table a test uses is declared here; tests create the tables.
var protectedTables = []rules.Table{
	{Table: "public.timeline_error", OnStale: "error"},
	{Table: "public.timeline_skip", OnStale: "skip"},
	{Table: "public.between_stamped", OnStale: "error"},
	{Table: "public.between_unstamped", OnStale: "error"},
	{Table: "public.counters", OnStale: "error"},
	// history is protected too, although only ever inserted into: the proxy
	// then stamps each row's last_fence from the session's fence.token,
	// which the checker compares with the token the worker believes it
	// holds.
	{Table: "public.history", OnStale: "error"},
	// TestLockFencedTimeline: lock fencing with row fencing beside it
	// (lock: optional, the default), and alone (lock: required, no fence
	// column).
	{Table: "public.lock_timeline_optional"},
	{Table: "public.lock_timeline_required", Lock: rules.LockRequired},
}

// stack is the shared PostgreSQL, etcd and proxy.
type stack struct {
	pg      *pgcluster.Cluster
	etcd    *etcdcluster.Cluster
	etcdCli *clientv3.Client
	proxy   *service.Instance
}

var shared struct {
	once sync.Once
	s    *stack
	err  error
}

// getStack returns the shared stack, starting it on first use. A missing
// PostgreSQL installation fails the test with pgcluster's explanation.
func getStack(t testing.TB) *stack {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL, etcd")
	shared.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		shared.s, shared.err = startStack(ctx)
	})
	if shared.err != nil {
		t.Fatalf("start PostgreSQL, etcd and fenceproxy: %v", shared.err)
	}
	return shared.s
}

func startStack(ctx context.Context) (_ *stack, err error) {
	s := &stack{}
	defer func() {
		if err != nil {
			s.stop()
		}
	}()
	if s.pg, err = pgcluster.Start(ctx, pgcluster.Options{}); err != nil {
		return nil, err
	}
	if s.etcd, err = etcdcluster.Start(ctx, etcdcluster.Options{Members: 1}); err != nil {
		return nil, err
	}
	if s.etcdCli, err = s.etcd.Client(); err != nil {
		return nil, err
	}
	if s.proxy, err = startProxy(s.pg.Addr(), protectedTables, proxyLogger()); err != nil {
		return nil, err
	}
	return s, nil
}

// startProxy starts an in-process fenceproxy in front of the PostgreSQL at
// upstream, protecting tables, listening on a free port.
func startProxy(upstream string, tables []rules.Table, log *zap.Logger) (*service.Instance, error) {
	cfg := config.Defaults()
	cfg.Listen = "127.0.0.1:0"
	cfg.Admin.Listen = "off"
	cfg.Upstream.Address = upstream
	cfg.Shutdown.DrainTimeout = 5 * time.Second
	cfg.Tables = tables
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return service.Start(&cfg, "", log)
}

// proxyLogger logs errors to stderr, and everything from info up when
// FENCEPROXY_E2E_PROXY_LOG is set. Not warnings by default: the torture
// test terminates server sessions on purpose, and the proxy warns about
// each one.
func proxyLogger() *zap.Logger {
	level := zapcore.ErrorLevel
	if os.Getenv("FENCEPROXY_E2E_PROXY_LOG") != "" {
		level = zapcore.InfoLevel
	}
	enc := zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig())
	return zap.New(zapcore.NewCore(enc, zapcore.Lock(os.Stderr), level)).Named("proxy")
}

func (s *stack) stop() {
	if s.proxy != nil {
		if err := s.proxy.Shutdown(); err != nil {
			fmt.Fprintf(os.Stderr, "e2e: proxy shutdown: %v\n", err)
		}
	}
	if s.etcdCli != nil {
		s.etcdCli.Close()
	}
	if s.etcd != nil {
		s.etcd.Close()
	}
	if s.pg != nil {
		if err := s.pg.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "e2e: stop PostgreSQL: %v\n", err)
		}
	}
}

func stopStack() {
	if shared.s != nil {
		shared.s.stop()
	}
}

// leakGrace is how long the leak check waits: the embedded etcd's
// connections outlive Close until their read timeout (see etcdtest).
const leakGrace = 10 * time.Second

// stuckVersionHandler is a goroutine that an embedded etcd member of a
// three-member cluster may leave behind when it stops (TestTortureLockFenced
// kills one, and closes the others): its backend closes while its peer
// listener still serves, a peer's /version request then reads the storage
// version from the closed backend and panics with the backend's read lock
// held (net/http recovers the panic), and the next /version request waits
// for that lock forever. It is etcd's, not the code under test's.
const stuckVersionHandler = "go.etcd.io/etcd/server/v3/etcdserver/api/etcdhttp.newPeerHandler.versionHandler.func1"

func findLeaks() error {
	deadline := time.Now().Add(leakGrace)
	for {
		err := goleak.Find(goleak.IgnoreAnyFunction(stuckVersionHandler))
		if err == nil || time.Now().After(deadline) {
			return err
		}
	}
}

// proxyDSN is the superuser's DSN through the proxy. The superuser is
// trusted from 127.0.0.1, so the DSN holds no password.
func (s *stack) proxyDSN() string { return proxyDSN(s.proxy) }

func proxyDSN(p *service.Instance) string {
	return "postgres://postgres@" + p.Addr() + "/postgres?sslmode=disable"
}

// directDSN goes straight to PostgreSQL, bypassing the proxy: for setup,
// for reading results and for the unfenced control run.
func (s *stack) directDSN() string { return s.pg.SuperuserDSN("postgres") }

// etcdEndpoints returns the client URLs workers dial.
func (s *stack) etcdEndpoints() []string { return s.etcd.Endpoints() }

// exec runs sql (one or more statements) directly on PostgreSQL.
func (s *stack) exec(t testing.TB, sql string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.pg.Exec(ctx, sql); err != nil {
		t.Fatalf("exec %q: %v", firstLine(sql), err)
	}
}

// direct opens a connection straight to PostgreSQL, closed when t ends.
func (s *stack) direct(t testing.TB) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.directDSN())
	if err != nil {
		t.Fatalf("connect to PostgreSQL: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// waitKeyGone waits until key no longer exists in etcd: its holder's lease
// has expired and etcd has deleted it. The wait is generous; it asserts
// that the lease ends, not how fast.
func (s *stack) waitKeyGone(t testing.TB, key string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp, err := s.etcdCli.Get(ctx, key)
		cancel()
		if err != nil {
			t.Fatalf("etcd get %q: %v", key, err)
		}
		if len(resp.Kvs) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("lock key %q still exists; the lease did not expire", key)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i] + " …"
	}
	return s
}
