package redislock_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/redislock"
)

// TestRedisWaitersFIFO: Redis waiters get the lock in the order they
// joined the line, with increasing tokens, and TryAcquire does not
// overtake them.
func TestRedisWaitersFIFO(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	_, c, r := newRedis(t, rediscluster.Options{}, 200*time.Millisecond)
	const (
		name    = "locks/fifo"
		waiters = 5
	)
	holder, err := r.Acquire(ctx, name, lock.Options{TTL: 10 * time.Second, KeepAlive: true, Holder: "first"})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		order  []int
		tokens []int64
		wg     sync.WaitGroup
	)
	for i := range waiters {
		wg.Go(func() {
			g, err := r.Acquire(ctx, name, lock.Options{TTL: 10 * time.Second, Holder: fmt.Sprintf("waiter-%d", i)})
			if err != nil {
				t.Errorf("waiter %d: %v", i, err)
				return
			}
			mu.Lock()
			order = append(order, i)
			tokens = append(tokens, g.Token())
			mu.Unlock()
			time.Sleep(20 * time.Millisecond)
			if err := g.Release(ctx); err != nil {
				t.Errorf("waiter %d: release: %v", i, err)
			}
		})
		// Queue the next waiter only once this one is in line.
		waitQueue(t, ctx, c, name, int64(i+1))
	}
	mustReleaseGrant(t, ctx, holder)
	// The lock is free for a moment between grants, but a waiter is in
	// line: TryAcquire must not take it ahead of them.
	var barged int
	for range 20 {
		g, err := r.TryAcquire(ctx, name, lock.Options{TTL: time.Second, Holder: "barger"})
		if err == nil {
			barged++
			mustReleaseGrant(t, ctx, g)
		} else if !errors.Is(err, lock.ErrLocked) {
			t.Fatal(err)
		}
		if n, _ := c.ZCard(ctx, redislock.QueueKey(name)).Result(); n == 0 {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	wg.Wait()
	if barged > 0 {
		t.Errorf("TryAcquire took the lock %d times while waiters were in line", barged)
	}
	for i, w := range order {
		if w != i {
			t.Fatalf("waiters got the lock in order %v, want 0..%d", order, waiters-1)
		}
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] || tokens[0] <= holder.Token() {
			t.Fatalf("tokens %v after the holder's %d not increasing", tokens, holder.Token())
		}
	}
	if n, err := c.Exists(ctx, redislock.QueueKey(name)).Result(); err != nil || n != 0 {
		t.Errorf("the line is left behind after every waiter was served (%d, %v)", n, err)
	}
}

// TestRedisDeadWaiterDropped: a waiter that stops trying (its process
// died or was stopped) loses its place after three polls, and the waiter
// behind it gets the lock; a waiter that gives up leaves the line at once.
func TestRedisDeadWaiterDropped(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	const poll = 200 * time.Millisecond
	_, c, r := newRedis(t, rediscluster.Options{}, poll)
	const name = "locks/dead-waiter"
	holder, err := r.Acquire(ctx, name, lock.Options{TTL: 10 * time.Second, KeepAlive: true})
	if err != nil {
		t.Fatal(err)
	}
	// A waiter that gives up leaves the line.
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	if _, err := r.Acquire(wctx, name, lock.Options{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("waiter with a 300ms bound: %v", err)
	}
	cancel()
	if n, _ := c.ZCard(ctx, redislock.QueueKey(name)).Result(); n != 0 {
		t.Fatalf("%d waiters in line after the only one gave up", n)
	}
	// A dead waiter at the head: in line, with a deadline 3 polls away,
	// as Acquire writes it, and never back.
	now := time.Now()
	dead := "dead:waiter"
	if err := c.ZAdd(ctx, redislock.QueueKey(name), redis.Z{Score: 1, Member: dead}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.HSet(ctx, "fenceproxy_lock_queue_deadline:{"+name+"}", dead, now.Add(3*poll).UnixMilli()).Err(); err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		g, err := r.Acquire(ctx, name, lock.Options{})
		if err == nil {
			err = g.Release(ctx)
		}
		got <- err
	}()
	waitQueue(t, ctx, c, name, 2)
	mustReleaseGrant(t, ctx, holder)
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
		if d := time.Since(now); d > 3*poll+2*time.Second {
			t.Errorf("the waiter behind a dead one got the lock after %v", d)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a dead waiter blocks the line")
	}
}

func waitQueue(t *testing.T, ctx context.Context, c *redis.Client, name string, n int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, err := c.ZCard(ctx, redislock.QueueKey(name)).Result()
		if err != nil {
			t.Fatal(err)
		}
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d waiters in line for %q after 5s, want %d", got, name, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
