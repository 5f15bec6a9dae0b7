package e2e_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/pgbouncer"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// The lock-fenced torture through a transaction pooler (issue 26): the
// workers of TestTortureLockFenced, each connection through one of three
// fenceproxy instances, all three in front of ONE PgBouncer in transaction
// mode with a pool of poolerTorturePoolSize server connections, in front
// of the stack's PostgreSQL. PgBouncer hands each transaction to whichever
// server connection is free and carries no custom setting between them,
// so what a session set with set_config lands on one server connection and
// the next transaction may run on another, which carries another worker's
// fence.lock and fence.token. The proxy's record of each session's fence
// settings (proxy.Options.DisableSettingsCarry off) applies the session's
// own values before every statement on a protected table; without it the
// checker finds the anomalies the record prevents.

// poolerTorturePoolSize is PgBouncer's default_pool_size.
const poolerTorturePoolSize = 3

// poolerTortureIgnored are the startup parameters PgBouncer 1.18 accepts
// and drops rather than refusing the connection: pgx's, the workers'
// session timeouts, and the fence settings of workers that hand their
// grant over at startup (only the proxy's record carries those).
var poolerTortureIgnored = []string{"options", "extra_float_digits", "lock_timeout", "statement_timeout", "fence.token", "fence.lock"}

// poolerTortureSize: short, few workers, but real: pauses past the lease,
// terminated sessions, paused holders resumed on a newer holder's read.
func poolerTortureSize() tortureSize {
	return tortureSize{duration: 25 * time.Second, workers: 6, keys: 8}
}

// poolerOffAttempt is one run of the control; it is repeated until the
// checker finds what it must, at most poolerOffAttempts times.
const (
	poolerOffAttempt  = 15 * time.Second
	poolerOffAttempts = 3
)

// TestTorturePoolerLockFenced runs the lock-fenced torture through three
// fenceproxy instances (service.Instance, as deployed) in front of one
// PgBouncer in transaction mode: no lost update, no stale write, no
// committed token above its lock's watermark, no write stamped with
// another worker's token.
func TestTorturePoolerLockFenced(t *testing.T) {
	st := getStack(t)
	b := startTortureBouncer(t, st)
	dsns := make([]string, 3)
	for i := range dsns {
		p, err := startProxy(b.Addr(), lockTortureTables, proxyLogger().Named(fmt.Sprintf("p%d", i)))
		if err != nil {
			t.Fatalf("start proxy %d: %v", i, err)
		}
		t.Cleanup(func() {
			if err := p.Shutdown(); err != nil {
				t.Errorf("proxy %d: shutdown: %v", i, err)
			}
		})
		dsns[i] = pooledDSN(proxyDSN(p))
	}
	res := poolerTorture(t, st, dsns, poolerTortureSize(),
		fmt.Sprintf("three fenceproxy instances → one PgBouncer (transaction mode, pool %d) → PostgreSQL, settings carried", poolerTorturePoolSize))
	c := poolerAnomalies(res)
	t.Logf("carrying on: %d anomalies: %v", len(res.Anomalies), c)
	if c.lost != 0 || c.backwards != 0 {
		t.Errorf("carrying on: %v", c)
	}
	res.wantFenced(t, "holder")
}

// TestTorturePoolerCarryOff is the control: the same topology and workload
// with proxies whose record of the session's fence settings is switched
// off (proxy.Options.DisableSettingsCarry, which the service layer does
// not expose, so the proxies are built with proxytest and the policy the
// service builds from the same rules). The checker must find lost updates
// or writes stamped with another worker's token.
func TestTorturePoolerCarryOff(t *testing.T) {
	st := getStack(t)
	b := startTortureBouncer(t, st)
	cfg := config.Defaults()
	cfg.Upstream.Address = b.Addr()
	cfg.Tables = lockTortureTables
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	dsns := make([]string, 3)
	for i := range dsns {
		rs, err := rules.Compile(cfg.RulesConfig())
		if err != nil {
			t.Fatal(err)
		}
		p := proxytest.Start(t, b.Addr(), proxy.Options{
			Policy:               policy.New(rs, cfg.Notifies(), policy.Options{}),
			DisableSettingsCarry: true,
			Logger:               proxyLogger().Named(fmt.Sprintf("p%d", i)),
		})
		dsns[i] = pooledDSN(p.DSN("postgres", "", "postgres"))
	}
	size := poolerTortureSize()
	size.duration = poolerOffAttempt
	total, sum := 0, poolerCounts{}
	for attempt := 1; attempt <= poolerOffAttempts; attempt++ {
		res := poolerTorture(t, st, dsns, size,
			fmt.Sprintf("three fenceproxy instances → one PgBouncer (transaction mode, pool %d) → PostgreSQL, settings NOT carried (attempt %d)", poolerTorturePoolSize, attempt))
		c := poolerAnomalies(res)
		total, sum = total+len(res.Anomalies), sum.add(c)
		t.Logf("carrying off, attempt %d: %d anomalies: %v:\n%s", attempt, len(res.Anomalies), c, res.details(20))
		if c.any() {
			break
		}
	}
	t.Logf("carrying off: %d anomalies in all: %v", total, sum)
	if !sum.any() {
		t.Errorf("with carrying off the checker found no lost update and no write stamped with another worker's token in %d runs", poolerOffAttempts)
	}
}

// startTortureBouncer starts one PgBouncer in transaction mode in front of
// the stack's PostgreSQL and installs the fenceproxy objects directly.
func startTortureBouncer(t *testing.T, st *stack) *pgbouncer.Server {
	t.Helper()
	installObjects(t, st, lockTortureTables)
	return pgbouncer.StartOptions(t, st.pg.Addr(), pgbouncer.Options{
		PoolMode:                "transaction",
		PoolSize:                poolerTorturePoolSize,
		IgnoreStartupParameters: poolerTortureIgnored,
	})
}

// pooledDSN makes pgx's extended protocol use unnamed statements
// (QueryExecModeExec) for the workers that do not use the simple protocol:
// PgBouncer 1.18 in transaction mode cannot carry named prepared
// statements between server connections, with or without the proxy.
func pooledDSN(dsn string) string {
	return dsn + "&default_query_exec_mode=exec"
}

// poolerTorture runs the stamp-less lock-fenced torture (lockTorture's
// workload, without the etcd leader kill: the shared etcd) through dsns.
func poolerTorture(t *testing.T, st *stack, dsns []string, size tortureSize, via string) *tortureResult {
	t.Helper()
	return torture(t, st, tortureSpec{
		dsns:            dsns,
		via:             via,
		etcd:            st.etcdEndpoints(),
		size:            tortureParams(t, size),
		minThink:        lockTortureMinThink,
		maxThink:        lockTortureMaxThink,
		skipBusyOdds:    lockTortureSkipBusyOdds,
		fenced:          true,
		nameLock:        true,
		historyUnfenced: true,
		watermarks:      true,
		resumeOnRead:    true,
	})
}

// poolerCounts are the anomalies the control must show, by kind.
type poolerCounts struct {
	lost      int // lost updates
	backwards int // stale writes accepted: a token older than the row's, or the watermark moved back
	foreign   int // a write stamped with a token that is not its worker's, or above its lock's watermark
}

func (c poolerCounts) String() string {
	return fmt.Sprintf("%d lost updates, %d backwards tokens, %d writes stamped with another worker's token", c.lost, c.backwards, c.foreign)
}

func (c poolerCounts) add(o poolerCounts) poolerCounts {
	return poolerCounts{c.lost + o.lost, c.backwards + o.backwards, c.foreign + o.foreign}
}

func (c poolerCounts) any() bool { return c.lost+c.backwards+c.foreign > 0 }

// poolerAnomalies sorts the checker's anomalies into poolerCounts.
func poolerAnomalies(res *tortureResult) poolerCounts {
	var c poolerCounts
	for _, a := range res.Anomalies {
		switch {
		case strings.Contains(a, "lost update"):
			c.lost++
		case strings.Contains(a, "stale write accepted"):
			c.backwards++
		case strings.Contains(a, "history has tokens"), strings.Contains(a, "differs from the worker's token"),
			strings.Contains(a, "above the lock's watermark"):
			c.foreign++
		}
	}
	return c
}
