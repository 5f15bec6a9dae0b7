package proxy_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testcerts"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// The acceptance suite runs real clients (pgx, lib/pq, psql, pgbench)
// through an in-process proxy against real PostgreSQL. Most tests share one
// trust-authenticated cluster started here; the authentication and TLS
// tests share a few more, started on first use by sharedCluster and
// stopped at the end of the run.

// cluster is the trust-authenticated server most tests proxy to.
var cluster *pgcluster.Cluster

// certs is a CA and a server certificate for localhost and 127.0.0.1,
// served by the proxy to clients and by the TLS-enabled cluster; otherCerts
// is an unrelated CA, to be distrusted.
var certs, otherCerts *testcerts.Files

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	dir, err := os.MkdirTemp("", "fenceproxy-proxy-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	if certs, err = generateCerts(filepath.Join(dir, "certs")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if otherCerts, err = generateCerts(filepath.Join(dir, "other")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}

	c, stop := pgtest.StartMain(pgcluster.Options{})
	cluster = c
	code := m.Run()
	stopSharedClusters()
	stop()
	testutil.ReportSkips()
	if code == 0 {
		// pgx, lib/pq and the proxy start no background goroutines that
		// outlive a closed connection or a shut-down server, so no
		// goroutine may be left once every test has cleaned up.
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: errors on successful test run: %v\n", err)
			code = 1
		}
	}
	return code
}

func generateCerts(dir string) (*testcerts.Files, error) {
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, err
	}
	return testcerts.Generate(dir)
}

// sharedCluster returns the cluster named name, starting it with opts on
// first use. It lives until the end of the run.
func sharedCluster(t testing.TB, name string, opts pgcluster.Options) *pgcluster.Cluster {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL")
	shared.mu.Lock()
	e, ok := shared.clusters[name]
	if !ok {
		e = &sharedEntry{}
		shared.clusters[name] = e
	}
	shared.mu.Unlock()
	e.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		e.c, e.err = pgcluster.Start(ctx, opts)
	})
	if e.err != nil {
		t.Fatalf("start %s cluster: %v", name, e.err)
	}
	return e.c
}

var shared = struct {
	mu       sync.Mutex
	clusters map[string]*sharedEntry
}{clusters: make(map[string]*sharedEntry)}

type sharedEntry struct {
	once sync.Once
	c    *pgcluster.Cluster
	err  error
}

func stopSharedClusters() {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	for name, e := range shared.clusters {
		if e.c != nil {
			if err := e.c.Stop(); err != nil {
				fmt.Fprintf(os.Stderr, "stop %s cluster: %v\n", name, err)
			}
		}
	}
}

// The password-authenticated clusters. Each runs one pg_hba method for every
// role but the superuser. The scram-sha-256 cluster also serves TLS, so it
// can show channel binding being withheld.
func passwordCluster(t testing.TB) *pgcluster.Cluster {
	return sharedCluster(t, "password", pgcluster.Options{AuthMethod: "password"})
}

func md5Cluster(t testing.TB) *pgcluster.Cluster {
	return sharedCluster(t, "md5", pgcluster.Options{AuthMethod: "md5"})
}

func scramTLSCluster(t testing.TB) *pgcluster.Cluster {
	return sharedCluster(t, "scram-tls", pgcluster.Options{
		AuthMethod: "scram-sha-256",
		TLS:        &pgcluster.TLSFiles{CertFile: certs.CertFile, KeyFile: certs.KeyFile, CAFile: certs.CAFile},
	})
}

// startProxy starts a proxy in front of the shared trust cluster.
func startProxy(t testing.TB, opts proxy.Options) *proxytest.Proxy {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL")
	return proxytest.Start(t, cluster.Addr(), opts)
}

// superDSN is a DSN for the superuser through p, in database postgres.
func superDSN(p *proxytest.Proxy) string { return p.DSN("postgres", "", "postgres") }

// connect opens a pgx connection and closes it when the test ends.
func connect(t testing.TB, dsn string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatalf("parse config: %v", err)
	}
	return connectConfig(t, cfg)
}

func connectConfig(t testing.TB, cfg *pgx.ConnConfig) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect through the proxy: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// ctxT, sqlState and wantSQLState are the shared test helpers.
var (
	ctxT         = testutil.Ctx
	sqlState     = testutil.SQLState
	wantSQLState = testutil.WantSQLState
)

// selectOne checks that conn still answers a query.
func selectOne(t testing.TB, conn *pgx.Conn) {
	t.Helper()
	var n int
	if err := conn.QueryRow(ctxT(t), "SELECT 1").Scan(&n); err != nil || n != 1 {
		t.Fatalf("SELECT 1 = %d, %v; want 1", n, err)
	}
}

var tableSeq atomic.Int64

// newTable creates a table with the given column definitions in the shared
// cluster's postgres database and returns its unique name.
func newTable(t testing.TB, columns string) string {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL")
	name := fmt.Sprintf("t_%s_%d", sanitize(t.Name()), tableSeq.Add(1))
	if err := cluster.Exec(ctxT(t), "CREATE TABLE "+name+" ("+columns+")"); err != nil {
		t.Fatal(err)
	}
	return name
}

func sanitize(s string) string {
	s = strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			return r
		case r >= 'A' && r <= 'Z':
			return r + 'a' - 'A'
		}
		return '_'
	}, s)
	return s[:min(len(s), 40)]
}

// waitFor polls cond until it holds, failing the test after a generous
// timeout. It asserts eventual behaviour, never speed.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// withQuery returns u with the query parameters in kv (key, value, ...) set.
func withQuery(u *url.URL, kv ...string) string {
	q := u.Query()
	for i := 0; i+1 < len(kv); i += 2 {
		q.Set(kv[i], kv[i+1])
	}
	u.RawQuery = q.Encode()
	return u.String()
}
