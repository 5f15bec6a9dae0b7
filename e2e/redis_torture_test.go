package e2e_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
	"github.com/fenceproxy/fenceproxy/internal/rediscluster/redistest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/pgxlock"
	"github.com/fenceproxy/fenceproxy/lock/redislock"
)

// The seed timeline and the lock-fenced torture with tokens from Redis
// (issue 29): the same processes, proxies and checker as the etcd runs,
// the workers taking their locks with redislock.New against a real
// redis-server started by the test (internal/rediscluster). The Redis
// workers are redis_worker_test.go; a worker is told to use Redis by a
// single redis:// URL in workerConfig.Etcd.

// Sizes of the Redis tortures: the lock-fenced torture's workload, a
// little shorter, since there are three runs.
func redisTortureSize() tortureSize {
	size := tortureSize{duration: 40 * time.Second, workers: 12, keys: 32}
	if testing.Short() {
		size.duration = 12 * time.Second
	}
	return size
}

// redisSeedMargin is what the recovery after a lost counter adds to the
// highest watermark in the database: grants drawn before the loss whose
// holders had not yet registered their token are above the watermark, and
// a new grant must not repeat theirs (docs/tokens.md).
const redisSeedMargin = 1000

// TestRedisStaleHolderTimeline is TestStaleHolderTimeline with Redis
// tokens: A takes the lock (no keep-alive), stamps and reads, and is
// stopped until Redis has expired its key; B takes the lock with a larger
// token, stamps, reads and writes; A's stale write is refused (on_stale:
// error) or skipped (on_stale: skip), and the row keeps B's data and
// token.
func TestRedisStaleHolderTimeline(t *testing.T) {
	st := getStack(t)
	srv := redistest.Start(t, rediscluster.Options{AppendFsync: "always"})
	rdb := redisTestClient(t, srv)
	for _, tc := range []struct {
		onStale string
		table   string
	}{
		{"error", "public.timeline_error"},
		{"skip", "public.timeline_skip"},
	} {
		t.Run(tc.onStale, func(t *testing.T) {
			createPayloadTable(t, st, tc.table)
			key := fmt.Sprintf("e2e/redis-timeline/%s/%d", tc.onStale, runSeq.Add(1))
			a := startRedisClient(t, st, srv, "A")
			b := startRedisClient(t, st, srv, "B")

			tokenA, ttlA := a.lock(t, key, leaseTTL, "token")
			t.Logf("A holds %s with Redis token %d (TTL %v, no keep-alive)", key, tokenA, ttlA)
			a.wantRows(t, 1, "stamp %s 1", tc.table)
			if got := a.ok(t, "read %s 1", tc.table); got != "v1" {
				t.Fatalf("A read %q, want v1", got)
			}

			a.pause(t)
			t.Log("A stopped (SIGSTOP); waiting for Redis to expire its lock key")
			waitRedisKeyGone(t, rdb, key)

			tokenB, _ := b.lock(t, key, 30*time.Second, "token")
			t.Logf("B holds %s with Redis token %d", key, tokenB)
			if tokenB <= tokenA {
				t.Fatalf("B's token %d is not larger than A's %d", tokenB, tokenA)
			}
			b.wantRows(t, 1, "stamp %s 1", tc.table)
			if got := b.ok(t, "read %s 1", tc.table); got != "v1" {
				t.Fatalf("B read %q, want v1", got)
			}
			b.wantRows(t, 1, "write %s 1 v1+B", tc.table)

			a.resume(t)
			t.Log("A resumed (SIGCONT); it writes its stale copy")
			reply := a.call(t, "write %s 1 v1+A", tc.table)
			switch tc.onStale {
			case "error":
				code, msg := wantErr(t, reply)
				if code != rules.CodeStaleToken {
					t.Fatalf("A's stale write: got SQLSTATE %s (%s), want %s", code, msg, rules.CodeStaleToken)
				}
				if !strings.Contains(msg, strconv.FormatInt(tokenA, 10)) {
					t.Errorf("FP001 message %q does not mention A's token %d", msg, tokenA)
				}
				t.Logf("A's stale write refused: %s %s", code, msg)
			case "skip":
				if got := wantOK(t, reply); got != "0" {
					t.Fatalf("A's stale write with on_stale: skip updated %s rows, want 0", got)
				}
				t.Log("A's stale write skipped: 0 rows")
			}
			if code, msg := wantErr(t, a.call(t, "release")); code != "notheld" {
				t.Errorf("A's release: got %s %s, want notheld", code, msg)
			}
			b.ok(t, "release")

			payload, fence := readPayloadRow(t, st, tc.table)
			if payload != "v1+B" || fence != tokenB {
				t.Fatalf("row = (%q, last_fence %d), want (%q, %d): B's write was not kept", payload, fence, "v1+B", tokenB)
			}
			t.Logf("row = (%q, last_fence %d): B's data intact", payload, fence)
		})
	}
}

// TestRedisTortureLockFenced is TestTortureLockFenced with Redis tokens
// from a redis-server with appendfsync always, killed (SIGKILL) and
// restarted halfway: the restarted server has every grant's key and
// counter from its append-only file, so the checker must find no anomaly,
// and the workers must get on after the restart.
func TestRedisTortureLockFenced(t *testing.T) {
	st := getStack(t)
	srv := redistest.Start(t, rediscluster.Options{AppendFsync: "always", Args: []string{"maxmemory-policy", "noeviction"}})
	rdb := redisTestClient(t, srv)
	var before, after map[string]int64
	res := redisTorture(t, st, srv, "Redis with appendonly yes, appendfsync always; SIGKILL and restart halfway", func() string {
		before = redisCounters(t, rdb)
		took := crashRestart(t, srv)
		after = redisCounters(t, rdb)
		return fmt.Sprintf("redis-server killed and restarted in %v; %d token counters before, %d after", took, len(before), len(after))
	})
	lost := 0
	for name, v := range before {
		if after[name] < v {
			lost++
			t.Errorf("counter of %s was %d before the crash, %d after", name, v, after[name])
		}
	}
	t.Logf("token counters kept across the crash: %d of %d", len(before)-lost, len(before))
	anomalies := perLockAnomalies(res)
	if len(anomalies) > 0 {
		t.Errorf("%d anomalies:\n%s", len(anomalies), strings.Join(anomalies[:min(len(anomalies), 50)], "\n"))
	}
	if res.Fenced == 0 {
		t.Errorf("no operation was fenced: the pauses produced no stale holder, so the run proved nothing")
	}
	if res.ackedAfterMid == 0 {
		t.Errorf("no operation was acknowledged after the Redis restart")
	}
	c := redisCommitOrder(t, st)
	t.Logf("committed tokens per lock, in commit order: %v", c)
	if c.backwards != 0 || c.repeated != 0 {
		t.Errorf("committed tokens: %v, want none backwards or repeated", c)
	}
}

// TestRedisTortureRestartNoPersistence runs the same workload against a
// redis-server without persistence, killed and restarted halfway: every
// lock key and token counter is gone, so the restarted server hands out
// tokens from 1 again, below each lock's watermark in the database. It
// shows what docs/tokens.md says happens: a grant after the restart is
// refused by the proxy (FP001) on its first read; after the counters are
// seeded above the watermarks (SeedToken, the documented recovery) grants
// get in again. The checker's anomalies must be the restart's repeated
// tokens, refused; no committed token goes backwards. A lost update is
// tolerated only on a lock where two holders committed with the same
// token, the case the documentation predicts (equal tokens are not told
// apart under strict: false).
func TestRedisTortureRestartNoPersistence(t *testing.T) {
	st := getStack(t)
	srv := redistest.Start(t, rediscluster.Options{})
	rdb := redisTestClient(t, srv)
	locker := redislock.New(rdb, redislock.Options{})
	var probe redisProbe
	res := redisTorture(t, st, srv, "Redis without persistence; SIGKILL and restart halfway, counters seeded 2s later", func() string {
		before := redisCounters(t, rdb)
		took := crashRestart(t, srv)
		after := redisCounters(t, rdb)
		probe = probeAfterLoss(t, st, locker, before)
		time.Sleep(2 * time.Second)
		seeded := seedFromWatermarks(t, st, locker, before)
		probe.afterSeed = probeGrant(t, st, locker, probe.name)
		return fmt.Sprintf("redis-server killed and restarted in %v: %d token counters before, %d after; probe: %s; %d counters seeded to watermark + %d; probe after seeding: %s",
			took, len(before), len(after), probe.afterLoss, seeded, redisSeedMargin, probe.afterSeed)
	})

	if probe.afterLoss.err != rules.CodeStaleToken {
		t.Errorf("after the restart, a grant of %s got token %d (watermark %d) and its read gave %q, want %s",
			probe.name, probe.afterLoss.token, probe.afterLoss.watermark, probe.afterLoss.err, rules.CodeStaleToken)
	}
	if probe.afterSeed.err != "" || probe.afterSeed.token <= probe.afterSeed.watermark {
		t.Errorf("after seeding, a grant of %s: %s, want a token above the watermark and a read", probe.name, probe.afterSeed)
	}

	c := redisCommitOrder(t, st)
	t.Logf("committed tokens per lock, in commit order: %v", c)
	if c.backwards != 0 {
		t.Errorf("committed tokens: %v, want none backwards (the proxy refuses a token below the watermark)", c)
	}
	repeats := 0
	var unexpected []string
	for _, a := range res.Anomalies {
		switch k, ok := sameLockRepeat(a); {
		case ok:
			repeats++
		case k == -2:
			// Two locks' counters: not a repeat.
		case strings.Contains(a, "lost update") && c.repeatedKeys[anomalyKey(a)]:
			t.Logf("predicted (two holders committed with one token): %s", a)
		default:
			unexpected = append(unexpected, a)
		}
	}
	t.Logf("tokens granted twice for one lock (the restart's counters restarting at 1): %d", repeats)
	if repeats == 0 {
		t.Errorf("no token was granted twice: the restart did not lose the counters, or no lock was taken after it")
	}
	if len(unexpected) > 0 {
		t.Errorf("%d anomalies the documentation does not predict:\n%s", len(unexpected), strings.Join(unexpected[:min(len(unexpected), 50)], "\n"))
	}
	if res.ackedAfterMid == 0 {
		t.Errorf("no operation was acknowledged after the restart and the seeding")
	}
}

// redisTorture runs the lock-fenced torture (lockTorture's workload)
// through three proxies with Redis tokens from srv; midRun is the halfway
// event.
func redisTorture(t *testing.T, st *stack, srv *rediscluster.Server, via string, midRun func() string) *tortureResult {
	t.Helper()
	installObjects(t, st, lockTortureTables)
	return torture(t, st, tortureSpec{
		dsns:            startProxies(t, st, 3, lockTortureTables),
		via:             "three fenceproxy instances, lock fencing on, tokens from " + via,
		etcd:            []string{srv.URL()},
		size:            tortureParams(t, redisTortureSize()),
		minThink:        lockTortureMinThink,
		maxThink:        lockTortureMaxThink,
		skipBusyOdds:    lockTortureSkipBusyOdds,
		fenced:          true,
		nameLock:        true,
		historyUnfenced: true,
		watermarks:      true,
		resumeOnRead:    true,
		midRun:          midRun,
	})
}

// redisTestClient returns a client of srv for the test process, closed
// when t ends.
func redisTestClient(t *testing.T, srv *rediscluster.Server) *redis.Client {
	t.Helper()
	opt, err := redis.ParseURL(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// crashRestart kills srv with SIGKILL and starts it again on its port and
// data directory; it returns how long that took.
func crashRestart(t *testing.T, srv *rediscluster.Server) time.Duration {
	start := time.Now()
	srv.Crash()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := srv.Restart(ctx); err != nil {
		t.Errorf("restart redis-server: %v", err)
	}
	return time.Since(start).Round(time.Millisecond)
}

// redisCounters returns the token counters in Redis, by lock name.
func redisCounters(t *testing.T, rdb *redis.Client) map[string]int64 {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	counters := make(map[string]int64)
	iter := rdb.Scan(ctx, 0, "redisson_lock_token:*", 1000).Iterator()
	for iter.Next(ctx) {
		k := iter.Val()
		v, err := rdb.Get(ctx, k).Int64()
		if err != nil {
			t.Errorf("counter %s: %v", k, err)
			continue
		}
		name := strings.TrimSuffix(strings.TrimPrefix(k, "redisson_lock_token:{"), "}")
		counters[name] = v
	}
	if err := iter.Err(); err != nil {
		// Right after a restart the scan may meet a server still loading.
		t.Logf("scan the token counters: %v", err)
	}
	return counters
}

// lockWatermarks reads the watermarks of names from fenceproxy.locks.
func lockWatermarks(t *testing.T, st *stack, names []string) map[string]int64 {
	w := make(map[string]int64, len(names))
	for _, n := range names {
		w[n] = lockWatermark(t, st, n)
	}
	return w
}

// redisProbe is what a grant of one lock could do after the counters were
// lost, and after they were seeded.
type redisProbe struct {
	name                 string
	afterLoss, afterSeed probeResult
}

type probeResult struct {
	token, watermark int64
	err              string // SQLSTATE of the read through the proxy, or "" if it succeeded
}

func (p probeResult) String() string {
	what := "read accepted"
	if p.err != "" {
		what = "read refused with " + p.err
	}
	return fmt.Sprintf("token %d, watermark %d, %s", p.token, p.watermark, what)
}

// probeAfterLoss takes the lock with the highest watermark among those
// Redis had counters for, and reads its row through the proxy.
func probeAfterLoss(t *testing.T, st *stack, locker *redislock.Locker, before map[string]int64) redisProbe {
	names := slices.Sorted(func(yield func(string) bool) {
		for n := range before {
			if !yield(n) {
				return
			}
		}
	})
	w := lockWatermarks(t, st, names)
	var best string
	for _, n := range names {
		if best == "" || w[n] > w[best] {
			best = n
		}
	}
	if best == "" {
		t.Errorf("no token counters before the restart")
		return redisProbe{}
	}
	return redisProbe{name: best, afterLoss: probeGrant(t, st, locker, best)}
}

// probeGrant takes lock name from Redis, names it and its token in a
// session through the proxy, and reads the lock's counter row (the lock
// fencing's register happens on that read); it releases the lock after.
func probeGrant(t *testing.T, st *stack, locker *redislock.Locker, name string) probeResult {
	if name == "" {
		return probeResult{err: "no lock"}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	g, err := locker.Acquire(ctx, name, lock.Options{TTL: 10 * time.Second, Holder: "probe"})
	if err != nil {
		t.Errorf("probe: acquire %s: %v", name, err)
		return probeResult{err: "acquire failed"}
	}
	defer g.Release(ctx) //nolint:errcheck // the probe's lock expires anyway
	r := probeResult{token: g.Token(), watermark: lockWatermark(t, st, name)}
	key, err := strconv.Atoi(name[strings.LastIndexByte(name, '/')+1:])
	if err != nil {
		t.Errorf("probe: lock name %q", name)
		return r
	}
	conn, err := connectPG(ctx, workerConfig{Name: "probe"}, st.proxyDSN(), nil)
	if err != nil {
		t.Errorf("probe: connect: %v", err)
		return r
	}
	defer conn.Close(ctx)
	var v int64
	tx, err := pgxlock.BeginTx(ctx, conn, g.Fence(lock.Settings{}), pgx.TxOptions{})
	if err == nil {
		err = tx.QueryRow(ctx, "SELECT value FROM public.counters WHERE id = $1", key).Scan(&v)
		_ = tx.Rollback(ctx)
	}
	if err != nil {
		r.err = sqlState(err)
		if r.err == "" {
			r.err = err.Error()
		}
	}
	return r
}

// seedFromWatermarks raises the token counter of every lock in before to
// its watermark in the database plus redisSeedMargin, the recovery
// docs/tokens.md describes; it returns how many it seeded.
func seedFromWatermarks(t *testing.T, st *stack, locker *redislock.Locker, before map[string]int64) int {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n := 0
	for name := range before {
		w := lockWatermark(t, st, name)
		if _, err := locker.SeedToken(ctx, name, w+redisSeedMargin); err != nil {
			t.Errorf("seed %s: %v", name, err)
			continue
		}
		n++
	}
	return n
}

// perLockAnomalies returns the checker's anomalies less the repeated
// tokens of different locks: the checker holds tokens unique across locks,
// as etcd's revisions are, but each Redis lock has its own counter.
func perLockAnomalies(res *tortureResult) []string {
	var out []string
	for _, a := range res.Anomalies {
		if k, _ := sameLockRepeat(a); k == -2 {
			continue
		}
		out = append(out, a)
	}
	return out
}

// sameLockRepeat parses the checker's "ops A (key 3) and B (key 5) were
// both granted token 7": ok with the key if both ops had one lock, -2 if
// they had different locks; -1 for any other anomaly.
func sameLockRepeat(a string) (int, bool) {
	if !strings.Contains(a, "were both granted token") {
		return -1, false
	}
	var k []int
	for rest := a; ; {
		i := strings.Index(rest, "(key ")
		if i < 0 {
			break
		}
		rest = rest[i+len("(key "):]
		j := strings.IndexByte(rest, ')')
		n, err := strconv.Atoi(rest[:j])
		if err != nil {
			return -1, false
		}
		k = append(k, n)
	}
	if len(k) != 2 {
		return -1, false
	}
	if k[0] != k[1] {
		return -2, false
	}
	return k[0], true
}

// anomalyKey returns the key an anomaly "key N: ..." is about, or 0.
func anomalyKey(a string) int {
	rest, ok := strings.CutPrefix(a, "key ")
	if !ok {
		return 0
	}
	n, _ := strconv.Atoi(rest[:strings.IndexByte(rest+":", ':')])
	return n
}

// commitOrder summarises the tokens of committed increments per counter
// row, in commit order (counter_log's seq; the counters are row-fenced,
// so new_fence is the committing holder's token).
type commitOrder struct {
	commits, increasing, repeated, backwards int
	repeatedKeys                             map[int]bool
}

func (c commitOrder) String() string {
	return fmt.Sprintf("%d commits: %d with a larger token than the lock's previous commit, %d with the same token, %d with a smaller one",
		c.commits, c.increasing, c.repeated, c.backwards)
}

// redisCommitOrder reads counter_log straight from PostgreSQL.
func redisCommitOrder(t *testing.T, st *stack) commitOrder {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type entry struct {
		key   int
		fence int64
	}
	rows, err := collect(ctx, st.direct(t), "SELECT key, new_fence FROM public.counter_log WHERE new_value <> old_value ORDER BY key, seq",
		func(r pgx.CollectableRow) (e entry, err error) { return e, r.Scan(&e.key, &e.fence) })
	if err != nil {
		t.Fatalf("read counter_log: %v", err)
	}
	type dup struct {
		key   int
		token int64
		ops   []string
	}
	dups, err := collect(ctx, st.direct(t), "SELECT key, token, array_agg(op_id ORDER BY op_id) FROM public.history GROUP BY key, token HAVING count(*) > 1 ORDER BY key, token",
		func(r pgx.CollectableRow) (d dup, err error) { return d, r.Scan(&d.key, &d.token, &d.ops) })
	if err != nil {
		t.Fatalf("read history: %v", err)
	}
	for _, d := range dups {
		t.Logf("key %d: token %d committed by %v", d.key, d.token, d.ops)
	}
	c := commitOrder{repeatedKeys: make(map[int]bool)}
	last := make(map[int]int64)
	for _, e := range rows {
		c.commits++
		prev, seen := last[e.key]
		switch {
		case !seen || e.fence > prev:
			c.increasing++
		case e.fence == prev:
			c.repeated++
			c.repeatedKeys[e.key] = true
		default:
			c.backwards++
		}
		last[e.key] = e.fence
	}
	return c
}

// waitRedisKeyGone waits until key no longer exists in Redis: its
// holder's TTL has run out.
func waitRedisKeyGone(t *testing.T, rdb *redis.Client, key string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		n, err := rdb.Exists(ctx, key).Result()
		cancel()
		if err != nil {
			t.Fatalf("redis exists %q: %v", key, err)
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("lock key %q still exists; its TTL did not run out", key)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// startRedisClient starts a scripted client (runClient's protocol) that
// takes its locks from srv.
func startRedisClient(t *testing.T, st *stack, srv *rediscluster.Server, name string) clientProc {
	t.Helper()
	return clientProc{startProc(t, roleClient, workerConfig{
		Name: name,
		DSN:  st.proxyDSN(),
		Etcd: []string{srv.URL()},
	})}
}
