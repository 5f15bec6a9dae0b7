package service_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/service"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

var cluster *pgcluster.Cluster

func TestMain(m *testing.M) {
	c, stop := pgtest.StartMain(pgcluster.Options{})
	cluster = c
	code := m.Run()
	stop()
	testutil.ReportSkips()
	os.Exit(code)
}

// writeConfig writes a config file protecting the given tables.
func writeConfig(t *testing.T, path, upstream string, tables ...string) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "listen: 127.0.0.1:0\nupstream:\n  address: %s\nadmin:\n  listen: 127.0.0.1:0\nlog:\n  level: debug\n", upstream)
	if len(tables) > 0 {
		b.WriteString("tables:\n")
		for _, tb := range tables {
			fmt.Fprintf(&b, "  - table: %s\n", tb)
		}
	}
	writeFile(t, path, b.String())
}

// writeFile replaces path atomically, as config managers do.
func writeFile(t *testing.T, path, text string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func startInstance(t *testing.T, path string) (*service.Instance, *observer.ObservedLogs) {
	t.Helper()
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	in, err := service.Start(cfg, path, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = in.Shutdown() })
	return in, logs
}

func connect(t *testing.T, addr, token string) *pgx.Conn {
	t.Helper()
	dsn := "postgres://postgres@" + addr + "/postgres?sslmode=disable"
	if token != "" {
		dsn += "&options=-c%20fence.token%3D" + token
	}
	c, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func sqlstate(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

func createTable(t *testing.T, name string) {
	t.Helper()
	err := cluster.Exec(context.Background(), fmt.Sprintf(`
		DROP TABLE IF EXISTS %[1]s;
		CREATE TABLE %[1]s (id int PRIMARY KEY, v text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
		INSERT INTO %[1]s (id) SELECT g FROM generate_series(1, 10) g;`, name))
	if err != nil {
		t.Fatal(err)
	}
}

// metric returns the value of one sample of /metrics, matched by its full
// name with labels, e.g. `fenceproxy_stale_rejections_total{table="public.a"}`.
func metric(t *testing.T, in *service.Instance, sample string) float64 {
	t.Helper()
	body := get(t, "http://"+in.AdminAddr()+"/metrics", http.StatusOK)
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(sample) + ` ([0-9.e+-]+)$`)
	m := re.FindStringSubmatch(body)
	if m == nil {
		return 0
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func get(t *testing.T, url string, want int) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != want {
		t.Fatalf("GET %s: %d %s, want %d", url, resp.StatusCode, b, want)
	}
	return string(b)
}

func TestMetricsMove(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	createTable(t, "public.metrics_a")
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeConfig(t, path, cluster.Addr(), "public.metrics_a")
	in, _ := startInstance(t, path)
	ctx := context.Background()

	get(t, "http://"+in.AdminAddr()+"/healthz", http.StatusOK)
	get(t, "http://"+in.AdminAddr()+"/readyz", http.StatusOK)
	if got := metric(t, in, "fenceproxy_connections_current"); got != 0 {
		t.Fatalf("connections_current = %v before any client", got)
	}

	c42 := connect(t, in.Addr(), "42")
	c41 := connect(t, in.Addr(), "41")
	noTok := connect(t, in.Addr(), "")
	if got := metric(t, in, "fenceproxy_connections_current"); got != 3 {
		t.Errorf("connections_current = %v, want 3", got)
	}
	if _, err := c42.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c42.Exec(ctx, "UPDATE metrics_a SET v = 'x' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	_, err := c41.Exec(ctx, "UPDATE metrics_a SET v = 'y' WHERE id = 1")
	if sqlstate(err) != rules.CodeStaleToken {
		t.Fatalf("stale write: %v, want %s", err, rules.CodeStaleToken)
	}
	_, err = noTok.Exec(ctx, "UPDATE metrics_a SET v = 'z' WHERE id = 2")
	if sqlstate(err) != rules.CodeMissingToken {
		t.Fatalf("untokened write: %v, want %s", err, rules.CodeMissingToken)
	}
	_, err = c42.Exec(ctx, "TRUNCATE metrics_a")
	if sqlstate(err) != rules.CodeRefused {
		t.Fatalf("truncate: %v, want %s", err, rules.CodeRefused)
	}

	forwarded := metric(t, in, `fenceproxy_statements_total{action="forwarded"}`)
	rewritten := metric(t, in, `fenceproxy_statements_total{action="rewritten"}`)
	checks := map[string]float64{
		"fenceproxy_connections_total":                                                 3,
		`fenceproxy_stale_rejections_total{table="public.metrics_a"}`:                  1,
		`fenceproxy_missing_tokens_total{outcome="rejected",table="public.metrics_a"}`: 1,
		`fenceproxy_statements_total{action="refused"}`:                                1,
		"fenceproxy_statement_decision_duration_seconds_count":                         forwarded + rewritten + 1,
		"fenceproxy_upstream_connect_duration_seconds_count":                           3,
		"fenceproxy_session_duration_seconds_count":                                    0,
	}
	for sample, want := range checks {
		if got := metric(t, in, sample); got != want {
			t.Errorf("%s = %v, want %v", sample, got, want)
		}
	}
	// pgx prepares each statement: decisions count Parse and Query messages.
	if forwarded+rewritten+1 < 5 {
		t.Errorf("statements decided = %v, want >= 5", forwarded+rewritten+1)
	}
	if rewritten < 3 {
		t.Errorf("statements rewritten = %v, want >= 3 (one accepted, one stale, one untokened)", rewritten)
	}
	noTok.Close(ctx)
	waitFor(t, func() bool { return metric(t, in, "fenceproxy_session_duration_seconds_count") == 1 })
}

func TestReadyzFollowsUpstream(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	// A cluster of its own: this test stops it.
	pg := pgtest.Start(t, pgcluster.Options{})
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeConfig(t, path, pg.Addr())
	in, _ := startInstance(t, path)
	get(t, "http://"+in.AdminAddr()+"/readyz", http.StatusOK)
	if err := pg.StopServer(); err != nil {
		t.Fatal(err)
	}
	get(t, "http://"+in.AdminAddr()+"/readyz", http.StatusServiceUnavailable)
	get(t, "http://"+in.AdminAddr()+"/healthz", http.StatusOK)
	// A client now gets a clean error and the failure is counted.
	_, err := pgx.Connect(context.Background(), "postgres://postgres@"+in.Addr()+"/postgres?sslmode=disable")
	if sqlstate(err) != "08006" {
		t.Errorf("connect with upstream down: %v, want 08006", err)
	}
	if got := metric(t, in, "fenceproxy_upstream_connect_errors_total"); got != 1 {
		t.Errorf("upstream_connect_errors = %v, want 1", got)
	}
	if err := pg.StartServer(context.Background()); err != nil {
		t.Fatal(err)
	}
	get(t, "http://"+in.AdminAddr()+"/readyz", http.StatusOK)
}

// TestReloadUnderTraffic keeps clients writing while the rules change: the
// sessions stay connected, statements after a reload follow the new rules,
// and a broken file leaves the running rules in force.
func TestReloadUnderTraffic(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	createTable(t, "public.reload_a")
	dir := t.TempDir()
	path := filepath.Join(dir, "fenceproxy.yaml")
	writeConfig(t, path, cluster.Addr()) // nothing protected yet
	in, logs := startInstance(t, path)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go in.WatchReloads(ctx)

	// Traffic: each worker keeps writing its own row with a fresh token.
	var (
		wg       sync.WaitGroup
		writes   atomic.Int64
		failures atomic.Int64
		firstErr atomic.Value
	)
	for w := 0; w < 4; w++ {
		c := connect(t, in.Addr(), "")
		wg.Add(1)
		go func(id int) {
			defer wg.Done()
			for tok := 1000; ctx.Err() == nil; tok++ {
				if _, err := c.Exec(ctx, "SELECT set_config('fence.token', $1, false)", strconv.Itoa(tok)); err != nil {
					if ctx.Err() == nil {
						failures.Add(1)
						firstErr.CompareAndSwap(nil, err)
					}
					return
				}
				_, err := c.Exec(ctx, "UPDATE reload_a SET v = $1 WHERE id = $2", strconv.Itoa(tok), id+1)
				if err != nil && strings.Contains(err.Error(), "that have since changed") {
					// A reload between this statement's Bind and its
					// Execute (the pipeline pgx sends) refuses it once,
					// with FP003, as documented: a client retries.
					_, err = c.Exec(ctx, "UPDATE reload_a SET v = $1 WHERE id = $2", strconv.Itoa(tok), id+1)
				}
				if err != nil {
					if ctx.Err() == nil {
						failures.Add(1)
						firstErr.CompareAndSwap(nil, err)
					}
					return
				}
				writes.Add(1)
			}
		}(w)
	}

	stale := connect(t, in.Addr(), "1")
	// Unprotected: the stale token is not looked at.
	if _, err := stale.Exec(ctx, "UPDATE reload_a SET v = 'old' WHERE id = 9"); err != nil {
		t.Fatalf("before reload: %v", err)
	}

	// Protect the table by editing the file; the watcher reloads it.
	if err := cluster.Exec(ctx, "UPDATE reload_a SET last_fence = 100 WHERE id = 9"); err != nil {
		t.Fatal(err)
	}
	writeConfig(t, path, cluster.Addr(), "public.reload_a")
	waitFor(t, func() bool { return metric(t, in, `fenceproxy_config_reloads_total{result="ok"}`) >= 1 })
	_, err := stale.Exec(ctx, "UPDATE reload_a SET v = 'old' WHERE id = 9")
	if sqlstate(err) != rules.CodeStaleToken {
		t.Fatalf("after reload: %v, want %s", err, rules.CodeStaleToken)
	}

	// A broken file is rejected, the rules in force stay.
	writeFile(t, path, "listen: 127.0.0.1:0\nupstream:\n  address: "+cluster.Addr()+"\ntables:\n  - table: public.reload_a\n    on_stale: sometimes\n")
	waitFor(t, func() bool { return metric(t, in, `fenceproxy_config_reloads_total{result="failed"}`) >= 1 })
	if n := logs.FilterMessage("config reload failed; keeping the running config").Len(); n == 0 {
		t.Error("no log line for the failed reload")
	} else if e := logs.FilterMessage("config reload failed; keeping the running config").All()[0]; !strings.Contains(fmt.Sprint(e.ContextMap()["error"]), "on_stale") {
		t.Errorf("failed reload log does not name the key: %v", e.ContextMap())
	}
	_, err = stale.Exec(ctx, "UPDATE reload_a SET v = 'old' WHERE id = 9")
	if sqlstate(err) != rules.CodeStaleToken {
		t.Fatalf("after a broken reload: %v, want %s (old rules kept)", err, rules.CodeStaleToken)
	}

	// SIGHUP reloads too: unprotect again and signal.
	writeConfig(t, path, cluster.Addr())
	okBefore := metric(t, in, `fenceproxy_config_reloads_total{result="ok"}`)
	waitFor(t, func() bool { return metric(t, in, `fenceproxy_config_reloads_total{result="ok"}`) > okBefore })
	okBefore = metric(t, in, `fenceproxy_config_reloads_total{result="ok"}`)
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return metric(t, in, `fenceproxy_config_reloads_total{result="ok"}`) > okBefore })
	if _, err := stale.Exec(ctx, "UPDATE reload_a SET v = 'old' WHERE id = 9"); err != nil {
		t.Fatalf("after unprotecting: %v", err)
	}

	before := writes.Load()
	waitFor(t, func() bool { return writes.Load() > before+10 })
	if got := in.Server().ActiveSessions(); got != 5 {
		t.Errorf("active sessions = %d, want 5 (reloads must not drop sessions)", got)
	}
	cancel()
	wg.Wait()
	if n := failures.Load(); n > 0 {
		t.Fatalf("%d traffic failures across reloads; first: %v", n, firstErr.Load())
	}
	t.Logf("%d writes across 3 reloads and 1 rejected file", writes.Load())
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached within 20s")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestReloadKeepsRestartOnlyKeys: a reload applies the new rules but keeps
// the running upstream (and the other start-only sections), says so in the
// log, and /readyz keeps probing the upstream the relay uses.
func TestReloadKeepsRestartOnlyKeys(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	createTable(t, "public.restart_a")
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeConfig(t, path, cluster.Addr())
	in, logs := startInstance(t, path)
	writeConfig(t, path, "127.0.0.1:1", "public.restart_a") // nothing listens on port 1
	if err := in.Reload(); err != nil {
		t.Fatal(err)
	}
	warn := logs.FilterMessage("config keys changed that take effect only after a restart").All()
	if len(warn) != 1 || fmt.Sprint(warn[0].ContextMap()["keys"]) != "[upstream]" {
		t.Fatalf("restart warning = %v, want one naming [upstream]", warn)
	}
	get(t, "http://"+in.AdminAddr()+"/readyz", http.StatusOK)
	if err := cluster.Exec(context.Background(), "UPDATE restart_a SET last_fence = 100 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	_, err := connect(t, in.Addr(), "5").Exec(context.Background(), "UPDATE restart_a SET v = 'x' WHERE id = 1")
	if sqlstate(err) != rules.CodeStaleToken {
		t.Fatalf("new rules not applied after reload: %v", err)
	}
}

// TestFrozenUpstream stops the postmaster with SIGSTOP: TCP connects still
// succeed (the kernel completes them from the listen backlog) but nothing
// answers. /readyz must say so, clients must get 08006 within the connect
// timeout rather than a bare close after the startup timeout, and the
// failure must be counted.
func TestFrozenUpstream(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	pg := pgtest.Start(t, pgcluster.Options{})
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeFile(t, path, "listen: 127.0.0.1:0\nupstream:\n  address: "+pg.Addr()+"\n  connect_timeout: 1s\nadmin:\n  listen: 127.0.0.1:0\n")
	in, _ := startInstance(t, path)
	get(t, "http://"+in.AdminAddr()+"/readyz", http.StatusOK)

	pid := pg.PID()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
				t.Errorf("SIGCONT: %v", err)
			}
		}
	}
	t.Cleanup(resume)

	get(t, "http://"+in.AdminAddr()+"/readyz", http.StatusServiceUnavailable)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := pgx.Connect(ctx, "postgres://postgres@"+in.Addr()+"/postgres?sslmode=disable")
	if sqlstate(err) != "08006" {
		t.Errorf("connect with the upstream stopped: %v, want 08006", err)
	}
	if got := metric(t, in, "fenceproxy_upstream_connect_errors_total"); got != 1 {
		t.Errorf("upstream_connect_errors = %v, want 1", got)
	}

	resume()
	waitFor(t, func() bool {
		resp, err := http.Get("http://" + in.AdminAddr() + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	c := connect(t, in.Addr(), "")
	if err := c.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestShutdownDelay: during shutdown.delay after a shutdown request,
// /readyz answers 503 while new clients are still served; after it, new
// clients are refused.
func TestShutdownDelay(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeConfig(t, path, cluster.Addr())
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	const delay = 2 * time.Second
	cfg.Shutdown.Delay = delay
	in, err := service.Start(cfg, path, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	get(t, "http://"+in.AdminAddr()+"/readyz", http.StatusOK)

	begun := time.Now()
	done := make(chan error, 1)
	go func() { done <- in.Shutdown() }()
	waitFor(t, func() bool {
		resp, err := http.Get("http://" + in.AdminAddr() + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusServiceUnavailable
	})
	// Still accepting: a new client connects and runs a statement.
	c := connect(t, in.Addr(), "")
	var one int
	if err := c.QueryRow(context.Background(), "SELECT 1").Scan(&one); err != nil {
		t.Fatalf("query during the shutdown delay: %v", err)
	}
	c.Close(context.Background())
	if time.Since(begun) >= delay {
		t.Fatal("the test was too slow to check within the delay")
	}

	// After the delay, new clients are refused (57P01 while draining, or
	// no listener).
	time.Sleep(time.Until(begun.Add(delay)))
	waitFor(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, "postgres://postgres@"+in.Addr()+"/postgres?sslmode=disable")
		if err == nil {
			c.Close(ctx)
			return false
		}
		return true
	})
	if err := testutil.Recv(t, done, 30*time.Second, "Shutdown did not return"); err != nil {
		t.Errorf("Shutdown: %v", err)
	}
}
