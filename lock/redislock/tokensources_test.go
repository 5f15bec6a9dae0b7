package redislock_test

import (
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
	"github.com/fenceproxy/fenceproxy/lock"
)

// A claim of docs/tokens.md about token sources other than this package's
// locks, tested against this package's grant.

// TestIncrAfterSetNXIsUnsafe plays the docs' timeline: A takes a plain
// SET NX lock and pauses past its expiry, B takes it and draws INCR, A
// resumes and draws INCR: the stale holder's token is the larger one.
// The same timeline with this backend's grant cannot happen: the token is
// drawn in the grant, so A's is the smaller.
func TestIncrAfterSetNXIsUnsafe(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	_, c, r := newRedis(t, rediscluster.Options{}, 100*time.Millisecond)
	const ttl = 200 * time.Millisecond
	if ok, err := c.SetNX(ctx, "nx/lock", "a", ttl).Result(); err != nil || !ok {
		t.Fatalf("A: SET NX = %v, %v", ok, err)
	}
	time.Sleep(ttl + 100*time.Millisecond) // A pauses; its key expires
	if ok, err := c.SetNX(ctx, "nx/lock", "b", time.Minute).Result(); err != nil || !ok {
		t.Fatalf("B: SET NX = %v, %v", ok, err)
	}
	tokenB := c.Incr(ctx, "nx/token").Val()
	tokenA := c.Incr(ctx, "nx/token").Val() // A resumes
	if tokenA <= tokenB {
		t.Fatalf("INCR after SET NX: A %d, B %d; the docs say the stale A draws the larger", tokenA, tokenB)
	}
	t.Logf("INCR after SET NX: stale A drew %d, current holder B %d", tokenA, tokenB)

	a, err := r.Acquire(ctx, "grant/lock", lock.Options{TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	<-a.Done()
	b, err := r.Acquire(ctx, "grant/lock", lock.Options{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Release(ctx) //nolint:errcheck
	if a.Token() >= b.Token() {
		t.Fatalf("grant script: A %d, B %d, want A < B", a.Token(), b.Token())
	}
}
