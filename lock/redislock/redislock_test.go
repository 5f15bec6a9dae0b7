package redislock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
	"github.com/fenceproxy/fenceproxy/internal/rediscluster/redistest"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/redislock"
)

func newRedis(t *testing.T, opts rediscluster.Options, poll time.Duration) (*rediscluster.Server, *redis.Client, *redislock.Locker) {
	t.Helper()
	s := redistest.Start(t, opts)
	c := redisClient(t, s)
	return s, c, redislock.New(c, redislock.Options{Poll: poll})
}

func TestRedisKeyLayout(t *testing.T) {
	t.Parallel()
	for name, want := range map[string]string{
		"report":      "redisson_lock_token:{report}",
		"{tenant7}:a": "redisson_lock_token:{tenant7}:a",
	} {
		if got := redislock.TokenKey(name); got != want {
			t.Errorf("TokenKey(%q) = %q, want %q", name, got, want)
		}
	}
	if got := redislock.Channel("report"); got != "redisson_lock__channel:{report}" {
		t.Errorf("Channel = %q", got)
	}
	ctx := testContext(t)
	_, _, r := newRedis(t, rediscluster.Options{}, time.Second)
	for _, bad := range []string{"a{}b", "a{b", ""} {
		if _, err := r.TryAcquire(ctx, bad, lock.Options{}); err == nil {
			t.Errorf("TryAcquire(%q) accepted a name whose counter could hash to another slot", bad)
		}
	}
}

// TestRedisWakeUpOnRelease: with a 30s poll, only the release's
// announcement can wake the waiter this fast.
func TestRedisWakeUpOnRelease(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	_, _, r := newRedis(t, rediscluster.Options{}, 30*time.Second)
	a, err := r.Acquire(ctx, "locks/wake", lock.Options{TTL: time.Minute, KeepAlive: true})
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan time.Time, 1)
	go func() {
		g, err := r.Acquire(ctx, "locks/wake", lock.Options{})
		if err != nil {
			t.Error(err)
			got <- time.Time{}
			return
		}
		got <- time.Now()
		g.Release(ctx) //nolint:errcheck
	}()
	time.Sleep(200 * time.Millisecond)
	released := time.Now()
	mustReleaseGrant(t, ctx, a)
	select {
	case at := <-got:
		if d := at.Sub(released); d > 2*time.Second {
			t.Errorf("waiter took %v after the release", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("waiter not woken")
	}
}

// TestRedisKeyDeletedClosesDone: a grant notices within the poll interval
// that its key was deleted (FLUSHALL, an operator's DEL) even with
// keep-alive off.
func TestRedisKeyDeletedClosesDone(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	for _, keepAlive := range []bool{false, true} {
		_, c, r := newRedis(t, rediscluster.Options{}, 100*time.Millisecond)
		g, err := r.Acquire(ctx, "locks/del", lock.Options{TTL: time.Minute, KeepAlive: keepAlive})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Del(ctx, "locks/del").Err(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-g.Done():
		case <-time.After(3 * time.Second):
			t.Fatalf("keepAlive %v: Done not closed after the key was deleted", keepAlive)
		}
		if !errors.Is(g.Err(), lock.ErrLost) {
			t.Errorf("Err() = %v", g.Err())
		}
	}
}

// TestRedisKeepAlive: with keep-alive a grant outlives its TTL and the key
// keeps an expiry; the counter has none and is untouched by renewals.
func TestRedisKeepAlive(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	_, c, r := newRedis(t, rediscluster.Options{}, time.Second)
	g, err := r.Acquire(ctx, "locks/ka", lock.Options{TTL: 600 * time.Millisecond, KeepAlive: true})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if err := g.Err(); err != nil {
		t.Fatalf("lost with keep-alive: %v", err)
	}
	if pttl := c.PTTL(ctx, "locks/ka").Val(); pttl <= 0 || pttl > 600*time.Millisecond {
		t.Errorf("lock key PTTL %v", pttl)
	}
	if ttl := c.TTL(ctx, redislock.TokenKey("locks/ka")).Val(); ttl != -1 {
		t.Errorf("counter TTL %v, want none (-1)", ttl)
	}
	if n := c.Get(ctx, redislock.TokenKey("locks/ka")).Val(); n != "1" {
		t.Errorf("counter %q after one grant and renewals, want 1", n)
	}
	mustReleaseGrant(t, ctx, g)
	if n := c.Exists(ctx, "locks/ka").Val(); n != 0 {
		t.Error("lock key left after Release")
	}
}

// TestRedisSetNXHolderExcludes: a lock key taken by a plain SET NX PX
// (the common hand-written Redis lock) keeps this backend waiting.
func TestRedisSetNXHolderExcludes(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	_, c, r := newRedis(t, rediscluster.Options{}, 50*time.Millisecond)
	if err := c.SetNX(ctx, "locks/nx", "someone", 500*time.Millisecond).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := r.TryAcquire(ctx, "locks/nx", lock.Options{}); !errors.Is(err, lock.ErrLocked) {
		t.Fatalf("TryAcquire over a SET NX holder: %v", err)
	}
	start := time.Now()
	g, err := r.Acquire(ctx, "locks/nx", lock.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Errorf("granted after %v, before the SET NX key expired", d)
	}
	mustReleaseGrant(t, ctx, g)
}

// redisson drives the Redis keys the way Redisson's RedissonFencedLock
// does. The scripts are written afresh here from what Redisson's source
// shows (RedissonFencedLock.tryLockInnerAsync, RedissonLock's
// unlockInnerAsync, renewal.LockTask): the lock hash at NAME with field
// "<client UUID>:<thread id>" counting re-entries, the counter
// redisson_lock_token:{NAME} incremented on every grant, the release
// announced on redisson_lock__channel:{NAME} with message 0.
type redisson struct {
	c     *redis.Client
	name  string
	field string // "<uuid>:<thread id>"
}

var redissonLock = redis.NewScript(`
if (redis.call('exists', KEYS[1]) == 0) or (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then
	local token = redis.call('incr', KEYS[2])
	redis.call('hincrby', KEYS[1], ARGV[2], 1)
	redis.call('pexpire', KEYS[1], ARGV[1])
	return {-1, token}
end
return {redis.call('pttl', KEYS[1]), -1}
`)

var redissonUnlock = redis.NewScript(`
if (redis.call('hexists', KEYS[1], ARGV[3]) == 0) then
	return nil
end
local counter = redis.call('hincrby', KEYS[1], ARGV[3], -1)
if (counter > 0) then
	redis.call('pexpire', KEYS[1], ARGV[2])
	return 0
else
	redis.call('del', KEYS[1])
	redis.call('publish', KEYS[2], ARGV[1])
	return 1
end
`)

// tryLock returns the token, or 0 and the holder's remaining TTL.
func (r redisson) tryLock(ctx context.Context, t *testing.T, lease time.Duration) (int64, int64) {
	t.Helper()
	res, err := redissonLock.Run(ctx, r.c, []string{r.name, "redisson_lock_token:{" + r.name + "}"}, lease.Milliseconds(), r.field).Int64Slice()
	if err != nil {
		t.Fatal(err)
	}
	if res[0] == -1 {
		return res[1], 0
	}
	return 0, res[0]
}

func (r redisson) unlock(ctx context.Context, t *testing.T) {
	t.Helper()
	err := redissonUnlock.Run(ctx, r.c, []string{r.name, "redisson_lock__channel:{" + r.name + "}"}, 0, 30000, r.field).Err()
	if err != nil && err != redis.Nil {
		t.Fatal(err)
	}
}

// TestRedisRedissonInterop: a Redisson RFencedLock holder and this
// backend exclude each other, draw from one token sequence, and a
// Redisson unlock wakes this backend's waiter.
func TestRedisRedissonInterop(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	_, c, r := newRedis(t, rediscluster.Options{}, 30*time.Second)
	java := redisson{c: c, name: "locks/shared", field: "6f1c0c2e-6a8e-4b8e-9d2c-0d6b1b2f3a4c:1"}

	t1, _ := java.tryLock(ctx, t, 30*time.Second)
	if t1 != 1 {
		t.Fatalf("Redisson's first token %d", t1)
	}
	// Redisson re-enters its own lock (and draws another token); this
	// backend is kept out.
	t2, _ := java.tryLock(ctx, t, 30*time.Second)
	if t2 != 2 {
		t.Fatalf("Redisson's re-entry token %d", t2)
	}
	if _, err := r.TryAcquire(ctx, "locks/shared", lock.Options{}); !errors.Is(err, lock.ErrLocked) {
		t.Fatalf("TryAcquire while Redisson holds: %v", err)
	}
	java.unlock(ctx, t) // one re-entry left: still held
	if _, err := r.TryAcquire(ctx, "locks/shared", lock.Options{}); !errors.Is(err, lock.ErrLocked) {
		t.Fatalf("TryAcquire while Redisson holds once more: %v", err)
	}

	got := make(chan lock.Grant, 1)
	go func() {
		g, err := r.Acquire(ctx, "locks/shared", lock.Options{TTL: 30 * time.Second, KeepAlive: true})
		if err != nil {
			t.Error(err)
		}
		got <- g
	}()
	time.Sleep(200 * time.Millisecond)
	java.unlock(ctx, t)
	var g lock.Grant
	select {
	case g = <-got:
	case <-time.After(5 * time.Second):
		t.Fatal("Redisson's unlock did not wake the waiter (poll is 30s)")
	}
	if g == nil {
		t.FailNow()
	}
	if g.Token() != 3 {
		t.Errorf("token after Redisson's 1 and 2 = %d, want 3", g.Token())
	}
	// Now Redisson is kept out, and its unlock does not release ours.
	if tok, pttl := java.tryLock(ctx, t, 30*time.Second); tok != 0 || pttl <= 0 {
		t.Fatalf("Redisson tryLock while we hold: token %d, pttl %d", tok, pttl)
	}
	java.unlock(ctx, t)
	if err := g.Renew(ctx); err != nil {
		t.Fatalf("our grant after Redisson's stray unlock: %v", err)
	}
	mustReleaseGrant(t, ctx, g)
	if tok, _ := java.tryLock(ctx, t, 30*time.Second); tok != 4 {
		t.Errorf("Redisson's token after ours = %d, want 4", tok)
	}
}

// TestRedisRestartWithoutPersistence shows the hazard the docs describe:
// Redis restarted without persistence hands out token 1 again, below
// tokens already used; with appendfsync always it does not; and
// SeedToken puts a lost counter back above a known watermark.
func TestRedisRestartWithoutPersistence(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	for _, tc := range []struct {
		fsync     string
		backwards bool
	}{{"", true}, {"always", false}} {
		s, _, r := newRedis(t, rediscluster.Options{AppendFsync: tc.fsync}, 100*time.Millisecond)
		var last int64
		for range 5 {
			g, err := r.Acquire(ctx, "locks/restart", lock.Options{})
			if err != nil {
				t.Fatal(err)
			}
			last = g.Token()
			mustReleaseGrant(t, ctx, g)
		}
		held, err := r.Acquire(ctx, "locks/restart", lock.Options{TTL: time.Minute, KeepAlive: true})
		if err != nil {
			t.Fatal(err)
		}
		s.Crash()
		if err := s.Restart(ctx); err != nil {
			t.Fatal(err)
		}
		g, err := r.TryAcquire(ctx, "locks/restart", lock.Options{})
		switch {
		case tc.backwards:
			// Without persistence the holder's key is gone too: a second
			// holder gets in, with a token below the first's.
			if err != nil {
				t.Fatalf("no persistence: TryAcquire after restart: %v", err)
			}
			if g.Token() > held.Token() {
				t.Errorf("no persistence: token %d after restart, expected a reused smaller one (before: %d)", g.Token(), held.Token())
			}
			t.Logf("no persistence: tokens up to %d before the restart, %d after", held.Token(), g.Token())
			select {
			case <-held.Done():
			case <-time.After(3 * time.Second):
				t.Error("no persistence: the first holder was not told its key is gone")
			}
			mustReleaseGrant(t, ctx, g)
			// Recovery: seed above the watermark.
			if v, err := r.SeedToken(ctx, "locks/restart", last+1000); err != nil || v != last+1000 {
				t.Fatalf("SeedToken = %d, %v", v, err)
			}
			if v, _ := r.SeedToken(ctx, "locks/restart", 1); v != last+1000 {
				t.Errorf("SeedToken lowered the counter to %d", v)
			}
			g2, err := r.Acquire(ctx, "locks/restart", lock.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if g2.Token() != last+1001 {
				t.Errorf("token after seeding %d, want %d", g2.Token(), last+1001)
			}
			mustReleaseGrant(t, ctx, g2)
		default:
			if !errors.Is(err, lock.ErrLocked) {
				t.Fatalf("AOF always: the holder's key did not survive the crash: %v", err)
			}
			if err := held.Renew(ctx); err != nil {
				t.Fatalf("AOF always: holder after the crash: %v", err)
			}
			mustReleaseGrant(t, ctx, held)
			g, err := r.Acquire(ctx, "locks/restart", lock.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if g.Token() <= held.Token() {
				t.Errorf("AOF always: token %d after the crash, not above %d", g.Token(), held.Token())
			}
			mustReleaseGrant(t, ctx, g)
		}
	}
}
