package etcdlock_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/internal/etcdcluster"
	"github.com/fenceproxy/fenceproxy/internal/etcdcluster/etcdtest"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/etcdlock"
)

func TestMain(m *testing.M) {
	etcdtest.VerifyTestMain(m)
}

// newClient starts a one-member cluster for the test and returns a client
// for it; both go away when the test ends.
func newClient(t *testing.T) *clientv3.Client {
	t.Helper()
	return clientFor(t, etcdtest.Start(t, 1))
}

func clientFor(t *testing.T, c *etcdcluster.Cluster) *clientv3.Client {
	t.Helper()
	cli, err := c.Client()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func mustAcquire(t *testing.T, ctx context.Context, cli *clientv3.Client, key string, opts lock.Options) *etcdlock.Lease {
	t.Helper()
	l, err := etcdlock.Acquire(ctx, cli, key, opts)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", key, err)
	}
	return l
}

func mustRelease(t *testing.T, ctx context.Context, l *etcdlock.Lease) {
	t.Helper()
	if err := l.Release(ctx); err != nil {
		t.Fatalf("Release(%q, token %d): %v", l.Key(), l.Token(), err)
	}
}

func leaseIDs(t *testing.T, ctx context.Context, cli *clientv3.Client) map[clientv3.LeaseID]bool {
	t.Helper()
	resp, err := cli.Leases(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ids := make(map[clientv3.LeaseID]bool)
	for _, l := range resp.Leases {
		ids[l.ID] = true
	}
	return ids
}

func waitDone(t *testing.T, l *etcdlock.Lease, within time.Duration) {
	t.Helper()
	select {
	case <-l.Done():
	case <-time.After(within):
		t.Fatalf("Done not closed within %v", within)
	}
}

func TestTokensIncreaseAcrossHolders(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const key = "/locks/seq"

	var prev int64
	for i := range 20 {
		l := mustAcquire(t, ctx, cli, key, lock.Options{TTL: 5 * time.Second})
		if l.Token() <= prev {
			t.Fatalf("grant %d: token %d not above previous %d", i, l.Token(), prev)
		}
		prev = l.Token()
		if l.Key() != key {
			t.Errorf("Key() = %q, want %q", l.Key(), key)
		}
		if l.LeaseID() == clientv3.NoLease {
			t.Error("LeaseID() is NoLease")
		}
		// Unrelated writes move the revision too; tokens only need order.
		if _, err := cli.Put(ctx, "/other", "x"); err != nil {
			t.Fatal(err)
		}
		mustRelease(t, ctx, l)
		if err := l.Err(); !errors.Is(err, lock.ErrReleased) {
			t.Fatalf("Err() after Release = %v, want ErrReleased", err)
		}
		waitDone(t, l, time.Second)
	}
	if ids := leaseIDs(t, ctx, cli); len(ids) != 0 {
		t.Errorf("%d leases left after releasing everything", len(ids))
	}
}

func TestContendersNeverOverlap(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const (
		key        = "/locks/contended"
		contenders = 2
		rounds     = 10
	)

	var (
		inUse  atomic.Int32
		mu     sync.Mutex
		tokens []int64
		got    [contenders]int
		wg     sync.WaitGroup
	)
	for c := range contenders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				l, err := etcdlock.Acquire(ctx, cli, key, lock.Options{TTL: 5 * time.Second, KeepAlive: true})
				if err != nil {
					t.Errorf("contender %d: %v", c, err)
					return
				}
				if !inUse.CompareAndSwap(0, 1) {
					t.Errorf("contender %d got token %d while the other held the lock", c, l.Token())
				}
				mu.Lock()
				tokens = append(tokens, l.Token())
				mu.Unlock()
				got[c]++
				time.Sleep(5 * time.Millisecond)
				inUse.Store(0)
				if err := l.Release(ctx); err != nil {
					t.Errorf("contender %d: release: %v", c, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	for c, n := range got {
		if n != rounds {
			t.Errorf("contender %d held the lock %d times, want %d", c, n, rounds)
		}
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Errorf("tokens out of order at grant %d: %v", i, tokens)
			break
		}
	}
}

func TestTryAcquireHeld(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const key = "/locks/try"

	a, err := etcdlock.TryAcquire(ctx, cli, key, lock.Options{Holder: "holder-a"})
	if err != nil {
		t.Fatalf("TryAcquire on a free key: %v", err)
	}
	before := leaseIDs(t, ctx, cli)

	start := time.Now()
	_, err = etcdlock.TryAcquire(ctx, cli, key, lock.Options{Holder: "holder-b"})
	if !errors.Is(err, lock.ErrLocked) {
		t.Fatalf("TryAcquire on a held key: err = %v, want ErrLocked", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("TryAcquire took %v; it must not wait", d)
	}
	t.Logf("error: %v", err)
	if after := leaseIDs(t, ctx, cli); len(after) != len(before) {
		t.Errorf("failed TryAcquire left a lease: %d leases before, %d after", len(before), len(after))
	}
	resp, err := cli.Get(ctx, a.HolderKey())
	if err != nil {
		t.Fatal(err)
	}
	if v := string(resp.Kvs[0].Value); v != "holder-a" {
		t.Errorf("key value = %q, want holder-a", v)
	}
	mustRelease(t, ctx, a)
}

func TestReleaseByNonOwner(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const key = "/locks/owner"

	a := mustAcquire(t, ctx, cli, key, lock.Options{})
	mustRelease(t, ctx, a)
	b := mustAcquire(t, ctx, cli, key, lock.Options{KeepAlive: true})

	if err := a.Release(ctx); !errors.Is(err, lock.ErrNotHeld) {
		t.Fatalf("stale holder's Release: err = %v, want ErrNotHeld", err)
	}
	// b still holds the key.
	if _, err := etcdlock.TryAcquire(ctx, cli, key, lock.Options{}); !errors.Is(err, lock.ErrLocked) {
		t.Fatalf("after stale Release, TryAcquire: err = %v, want ErrLocked", err)
	}
	if err := b.Err(); err != nil {
		t.Fatalf("current holder's lease ended: %v", err)
	}
	mustRelease(t, ctx, b)
	if err := b.Release(ctx); !errors.Is(err, lock.ErrNotHeld) {
		t.Fatalf("second Release: err = %v, want ErrNotHeld", err)
	}
}

func TestLeaseExpiryWithoutKeepAlive(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const key = "/locks/expiry"

	// A holder that never renews stands in for one paused past its lease.
	a := mustAcquire(t, ctx, cli, key, lock.Options{TTL: time.Second})
	granted := time.Now()
	waitDone(t, a, a.TTL()+3*time.Second)
	if d := time.Since(granted); d < a.TTL()-500*time.Millisecond {
		t.Errorf("Done closed after %v, before the %v TTL", d, a.TTL())
	}
	if err := a.Err(); !errors.Is(err, lock.ErrLost) {
		t.Fatalf("Err() = %v, want ErrLost", err)
	}
	t.Logf("lost: %v", a.Err())

	b := mustAcquire(t, ctx, cli, key, lock.Options{})
	if b.Token() <= a.Token() {
		t.Fatalf("new holder's token %d not above expired holder's %d", b.Token(), a.Token())
	}
	if err := a.Release(ctx); !errors.Is(err, lock.ErrNotHeld) {
		t.Fatalf("expired holder's Release: err = %v, want ErrNotHeld", err)
	}
	mustRelease(t, ctx, b)
}

func TestKeepAliveOutlivesTTL(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const key = "/locks/keepalive"

	a := mustAcquire(t, ctx, cli, key, lock.Options{TTL: time.Second, KeepAlive: true})
	select {
	case <-a.Done():
		t.Fatalf("lease ended despite keep-alive: %v", a.Err())
	case <-time.After(a.TTL() + time.Second):
	}
	if _, err := etcdlock.TryAcquire(ctx, cli, key, lock.Options{}); !errors.Is(err, lock.ErrLocked) {
		t.Fatalf("TryAcquire: err = %v, want ErrLocked", err)
	}
	mustRelease(t, ctx, a)
}

func TestDoneWhenKeyTaken(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)

	for _, tc := range []struct {
		name string
		take func(l *etcdlock.Lease) error
	}{
		{"delete", func(l *etcdlock.Lease) error {
			_, err := cli.Delete(ctx, l.HolderKey())
			return err
		}},
		{"revoke", func(l *etcdlock.Lease) error {
			_, err := cli.Revoke(ctx, l.LeaseID())
			return err
		}},
		{"overwrite", func(l *etcdlock.Lease) error {
			_, err := cli.Put(ctx, l.HolderKey(), "intruder")
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := mustAcquire(t, ctx, cli, "/locks/taken/"+tc.name, lock.Options{KeepAlive: true})
			if err := tc.take(l); err != nil {
				t.Fatal(err)
			}
			waitDone(t, l, 2*time.Second)
			if err := l.Err(); !errors.Is(err, lock.ErrLost) {
				t.Fatalf("Err() = %v, want ErrLost", err)
			}
			t.Logf("lost: %v", l.Err())
			if err := l.Release(ctx); !errors.Is(err, lock.ErrNotHeld) {
				t.Fatalf("Release: err = %v, want ErrNotHeld", err)
			}
		})
	}
}

func TestAcquireWakesOnRelease(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const key = "/locks/wake"

	a := mustAcquire(t, ctx, cli, key, lock.Options{TTL: 30 * time.Second, KeepAlive: true})
	type result struct {
		l   *etcdlock.Lease
		err error
		at  time.Time
	}
	res := make(chan result, 1)
	go func() {
		l, err := etcdlock.Acquire(ctx, cli, key, lock.Options{})
		res <- result{l, err, time.Now()}
	}()
	select {
	case r := <-res:
		t.Fatalf("Acquire returned while the key was held: %v", r.err)
	case <-time.After(500 * time.Millisecond):
	}

	released := time.Now()
	mustRelease(t, ctx, a)
	select {
	case r := <-res:
		if r.err != nil {
			t.Fatal(r.err)
		}
		// The waiter reacts to the delete event, well before any polling
		// interval or the 30s TTL would let it in.
		if d := r.at.Sub(released); d > 500*time.Millisecond {
			t.Errorf("waiter took %v after Release", d)
		}
		if r.l.Token() <= a.Token() {
			t.Errorf("waiter's token %d not above %d", r.l.Token(), a.Token())
		}
		mustRelease(t, ctx, r.l)
	case <-time.After(5 * time.Second):
		t.Fatal("waiter did not get the lock after Release")
	}
}

func TestAcquireCanceled(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const key = "/locks/cancel"

	a := mustAcquire(t, ctx, cli, key, lock.Options{KeepAlive: true})
	before := leaseIDs(t, ctx, cli)

	actx, cancel := context.WithCancel(ctx)
	time.AfterFunc(300*time.Millisecond, cancel)
	_, err := etcdlock.Acquire(actx, cli, key, lock.Options{})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire with canceled ctx: err = %v, want context.Canceled", err)
	}
	after := leaseIDs(t, ctx, cli)
	if len(after) != len(before) || !after[a.LeaseID()] {
		t.Errorf("leases before %v, after %v: canceled Acquire left one behind", before, after)
	}
	if err := a.Err(); err != nil {
		t.Errorf("holder's lease ended: %v", err)
	}
	mustRelease(t, ctx, a)

	// A context that is already done fails before touching etcd.
	_, err = etcdlock.Acquire(actx, cli, key, lock.Options{})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire with done ctx: err = %v, want context.Canceled", err)
	}
	if ids := leaseIDs(t, ctx, cli); len(ids) != 0 {
		t.Errorf("%d leases left", len(ids))
	}
}

func TestBadArguments(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	if _, err := etcdlock.Acquire(ctx, nil, "/k", lock.Options{}); err == nil {
		t.Error("nil client: want error")
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := etcdlock.Acquire(ctx, cli, "", lock.Options{}); err == nil {
		t.Error("empty key: want error")
	}
	if _, err := etcdlock.TryAcquire(ctx, cli, "/k", lock.Options{TTL: -time.Second}); err == nil {
		t.Error("negative TTL: want error")
	}
}

// TestLeaderFailover takes and releases a lock in a loop on a three-member
// cluster and kills the leader midway: acquisition carries on once a new
// leader is elected, and tokens keep increasing.
func TestLeaderFailover(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	c := etcdtest.Start(t, 3)
	cli := clientFor(t, c)
	const (
		key     = "/locks/failover"
		workers = 3
	)

	var (
		inUse     atomic.Int32
		grants    atomic.Int64
		transient atomic.Int64
		mu        sync.Mutex
		last      int64
		stop      = make(chan struct{})
		wg        sync.WaitGroup
	)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				actx, cancel := context.WithTimeout(ctx, 10*time.Second)
				l, err := etcdlock.Acquire(actx, cli, key, lock.Options{TTL: 3 * time.Second, KeepAlive: true})
				cancel()
				if err != nil {
					// Requests in flight when the leader dies fail; retry.
					transient.Add(1)
					t.Logf("worker %d: acquire: %v", w, err)
					time.Sleep(100 * time.Millisecond)
					continue
				}
				if !inUse.CompareAndSwap(0, 1) {
					t.Errorf("worker %d got token %d while another worker held the lock", w, l.Token())
				}
				mu.Lock()
				if l.Token() <= last {
					t.Errorf("token %d not above previous %d", l.Token(), last)
				}
				last = l.Token()
				mu.Unlock()
				grants.Add(1)
				time.Sleep(2 * time.Millisecond)
				inUse.Store(0)
				rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				if err := l.Release(rctx); err != nil {
					// The lock then frees itself when the lease expires.
					transient.Add(1)
					t.Logf("worker %d: release: %v", w, err)
				}
				cancel()
			}
		}()
	}
	defer func() {
		close(stop)
		wg.Wait()
	}()

	waitGrants := func(n int64, within time.Duration) {
		t.Helper()
		deadline := time.Now().Add(within)
		for grants.Load() < n {
			if time.Now().After(deadline) {
				t.Fatalf("only %d grants after %v, want %d", grants.Load(), within, n)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitGrants(20, 10*time.Second)

	leader, err := c.LeaderIndex(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c.KillMember(leader)
	killedAt := grants.Load()
	mu.Lock()
	tokenAtKill := last
	mu.Unlock()
	t.Logf("killed leader m%d after %d grants (token %d)", leader, killedAt, tokenAtKill)

	next, err := c.LeaderIndex(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if next == leader {
		t.Fatalf("leader still m%d", leader)
	}
	waitGrants(killedAt+20, 15*time.Second)
	mu.Lock()
	if last <= tokenAtKill {
		t.Errorf("token %d after failover not above %d", last, tokenAtKill)
	}
	mu.Unlock()
	t.Logf("%d grants, %d transient errors", grants.Load(), transient.Load())
}
