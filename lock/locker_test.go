package lock_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
	"github.com/fenceproxy/fenceproxy/internal/rediscluster/redistest"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/etcdlock"
	"github.com/fenceproxy/fenceproxy/lock/redislock"
)

// backends returns each lock service, fresh for the test, behind the one
// Locker interface the behavioural tests below run against.
func backends(t *testing.T) map[string]func(t *testing.T) lock.Locker {
	return map[string]func(t *testing.T) lock.Locker{
		"etcd": func(t *testing.T) lock.Locker { return etcdlock.New(newClient(t)) },
		"redis": func(t *testing.T) lock.Locker {
			return redislock.New(redisClient(t, redistest.Start(t, rediscluster.Options{})), redislock.Options{Poll: 200 * time.Millisecond})
		},
	}
}

func forEachBackend(t *testing.T, test func(t *testing.T, ctx context.Context, lk lock.Locker)) {
	for name, start := range backends(t) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := testContext(t)
			test(t, ctx, start(t))
		})
	}
}

func TestLockerContendersNeverOverlap(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, ctx context.Context, lk lock.Locker) {
		const (
			contenders = 4
			rounds     = 10
		)
		var (
			inUse  atomic.Int32
			mu     sync.Mutex
			tokens []int64
			wg     sync.WaitGroup
		)
		for c := range contenders {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range rounds {
					g, err := lk.Acquire(ctx, "locks/contended", lock.Options{TTL: 5 * time.Second, KeepAlive: true})
					if err != nil {
						t.Errorf("contender %d: %v", c, err)
						return
					}
					if !inUse.CompareAndSwap(0, 1) {
						t.Errorf("contender %d got token %d while another held the lock", c, g.Token())
					}
					mu.Lock()
					tokens = append(tokens, g.Token())
					mu.Unlock()
					time.Sleep(2 * time.Millisecond)
					inUse.Store(0)
					if err := g.Release(ctx); err != nil {
						t.Errorf("contender %d: release: %v", c, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		if len(tokens) != contenders*rounds {
			t.Errorf("%d grants, want %d", len(tokens), contenders*rounds)
		}
		for i := 1; i < len(tokens); i++ {
			if tokens[i] <= tokens[i-1] {
				t.Fatalf("tokens not strictly increasing across holders at grant %d: %v", i, tokens)
			}
		}
	})
}

func TestLockerTryAcquire(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, ctx context.Context, lk lock.Locker) {
		a, err := lk.TryAcquire(ctx, "locks/try", lock.Options{Holder: "holder-a"})
		if err != nil {
			t.Fatalf("TryAcquire on a free lock: %v", err)
		}
		start := time.Now()
		_, err = lk.TryAcquire(ctx, "locks/try", lock.Options{Holder: "holder-b"})
		var locked *lock.LockedError
		if !errors.As(err, &locked) || !errors.Is(err, lock.ErrLocked) {
			t.Fatalf("TryAcquire on a held lock: %v, want a *LockedError", err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("TryAcquire waited %v", d)
		}
		if locked.Token != a.Token() {
			t.Errorf("LockedError.Token = %d, want the holder's %d (%v)", locked.Token, a.Token(), err)
		}
		mustReleaseGrant(t, ctx, a)
		b, err := lk.TryAcquire(ctx, "locks/try", lock.Options{Holder: "holder-b"})
		if err != nil {
			t.Fatalf("TryAcquire after release: %v", err)
		}
		if b.Token() <= a.Token() {
			t.Errorf("token %d after %d", b.Token(), a.Token())
		}
		mustReleaseGrant(t, ctx, b)
	})
}

func TestLockerWaitBoundAndWakeUp(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, ctx context.Context, lk lock.Locker) {
		a, err := lk.Acquire(ctx, "locks/wait", lock.Options{TTL: 10 * time.Second, KeepAlive: true})
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		_, err = lk.Acquire(wctx, "locks/wait", lock.Options{})
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Acquire past its wait bound: %v, want DeadlineExceeded", err)
		}
		got := make(chan lock.Grant, 1)
		go func() {
			g, err := lk.Acquire(ctx, "locks/wait", lock.Options{})
			if err != nil {
				t.Error(err)
			}
			got <- g
		}()
		time.Sleep(100 * time.Millisecond)
		mustReleaseGrant(t, ctx, a)
		select {
		case g := <-got:
			if g != nil {
				mustReleaseGrant(t, ctx, g)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("waiter not woken within 5s of the release")
		}
	})
}

// TestLockerLossClosesDone: without keep-alive the grant ends after its
// TTL; Done is closed and Err is a *LostError; the next holder's token is
// larger, and the first holder's late Release reports ErrNotHeld and
// leaves the next holder alone.
func TestLockerLossClosesDone(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, ctx context.Context, lk lock.Locker) {
		a, err := lk.Acquire(ctx, "locks/loss", lock.Options{TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		select {
		case <-a.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("Done not closed 5s after a 1s TTL")
		}
		var lost *lock.LostError
		if !errors.As(a.Err(), &lost) {
			t.Fatalf("Err() = %v, want *LostError", a.Err())
		}
		b, err := lk.Acquire(ctx, "locks/loss", lock.Options{TTL: 10 * time.Second, KeepAlive: true})
		if err != nil {
			t.Fatal(err)
		}
		if b.Token() <= a.Token() {
			t.Errorf("next holder's token %d not above %d", b.Token(), a.Token())
		}
		if err := a.Release(ctx); !errors.Is(err, lock.ErrNotHeld) {
			t.Errorf("late Release = %v, want ErrNotHeld", err)
		}
		if _, err := lk.TryAcquire(ctx, "locks/loss", lock.Options{}); !errors.Is(err, lock.ErrLocked) {
			t.Errorf("after the late Release the lock is not held by the next holder: %v", err)
		}
		if err := b.Renew(ctx); err != nil {
			t.Errorf("next holder's Renew: %v", err)
		}
		mustReleaseGrant(t, ctx, b)
	})
}

// TestLockerRenew: Renew keeps a grant without keep-alive past its TTL.
func TestLockerRenew(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, ctx context.Context, lk lock.Locker) {
		g, err := lk.Acquire(ctx, "locks/renew", lock.Options{TTL: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		for range 4 {
			time.Sleep(time.Second)
			if err := g.Renew(ctx); err != nil {
				t.Fatalf("Renew: %v", err)
			}
		}
		if err := g.Err(); err != nil {
			t.Fatalf("after 4s of renewals of a 2s TTL: %v", err)
		}
		mustReleaseGrant(t, ctx, g)
		if err := g.Renew(ctx); !errors.Is(err, lock.ErrReleased) {
			t.Errorf("Renew after Release = %v, want ErrReleased", err)
		}
	})
}

func mustReleaseGrant(t *testing.T, ctx context.Context, g lock.Grant) {
	t.Helper()
	if err := g.Release(ctx); err != nil {
		t.Fatalf("Release(%q, token %d): %v", g.Key(), g.Token(), err)
	}
	select {
	case <-g.Done():
	case <-time.After(time.Second):
		t.Fatal("Done not closed by Release")
	}
}
