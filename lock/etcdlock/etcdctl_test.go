package etcdlock_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/etcdlock"
)

// etcdctlMutex stands in for "etcdctl lock NAME", which is exactly a
// concurrency.Session with the given TTL and concurrency.NewMutex(s, NAME).
func etcdctlMutex(t *testing.T, cli *clientv3.Client, name string) *concurrency.Mutex {
	t.Helper()
	s, err := concurrency.NewSession(cli, concurrency.WithTTL(5))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return concurrency.NewMutex(s, name)
}

// mutexToken is the token of a Mutex holder: its key's creation revision.
func mutexToken(m *concurrency.Mutex) int64 {
	cmp := m.IsOwner()
	return cmp.GetCompare().GetCreateRevision()
}

func createRevision(t *testing.T, ctx context.Context, cli *clientv3.Client, key string) int64 {
	t.Helper()
	resp, err := cli.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 {
		t.Fatalf("key %q does not exist", key)
	}
	return resp.Kvs[0].CreateRevision
}

// TestKeyLayout checks the holder key and the token against what etcdctl
// lock creates and reports.
func TestKeyLayout(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const name = "locks/layout"

	l := mustAcquire(t, ctx, cli, name, lock.Options{Holder: "job-1"})
	if want := fmt.Sprintf("%s/%x", name, int64(l.LeaseID())); l.HolderKey() != want {
		t.Errorf("HolderKey() = %q, want %q", l.HolderKey(), want)
	}
	if l.Key() != name {
		t.Errorf("Key() = %q, want %q", l.Key(), name)
	}
	resp, err := cli.Get(ctx, etcdlock.Prefix(name), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 {
		t.Fatalf("%d keys under %q, want 1", len(resp.Kvs), etcdlock.Prefix(name))
	}
	kv := resp.Kvs[0]
	if string(kv.Key) != l.HolderKey() || kv.CreateRevision != l.Token() ||
		clientv3.LeaseID(kv.Lease) != l.LeaseID() || string(kv.Value) != "job-1" {
		t.Errorf("holder key %q create %d lease %x value %q; want %q, token %d, lease %x, job-1",
			kv.Key, kv.CreateRevision, kv.Lease, kv.Value, l.HolderKey(), l.Token(), l.LeaseID())
	}
	mustRelease(t, ctx, l)

	// etcdctl lock without contention: the revision it reports in
	// ETCD_LOCK_REV (the header of the grant) is its key's creation
	// revision, the token this package would have handed out.
	m := etcdctlMutex(t, cli, name)
	if err := m.Lock(ctx); err != nil {
		t.Fatal(err)
	}
	if rev := createRevision(t, ctx, cli, m.Key()); rev != m.Header().Revision || rev != mutexToken(m) || rev <= l.Token() {
		t.Errorf("etcdctl key created at %d, header %d, IsOwner %d, previous token %d",
			rev, m.Header().Revision, mutexToken(m), l.Token())
	}
	if err := m.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestExcludesEtcdctlLock: a lock held through this package keeps an
// etcdctl lock of the same name out and the other way round, and the
// tokens of successive holders increase whichever client took the lock.
func TestExcludesEtcdctlLock(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const name = "locks/etcdctl"

	m := etcdctlMutex(t, cli, name)
	if err := m.Lock(ctx); err != nil {
		t.Fatal(err)
	}
	_, err := etcdlock.TryAcquire(ctx, cli, name, lock.Options{})
	var locked *lock.LockedError
	if !errors.As(err, &locked) {
		t.Fatalf("TryAcquire while etcdctl holds the lock: err = %v, want *LockedError", err)
	}
	if locked.HolderKey != m.Key() || locked.Token != mutexToken(m) {
		t.Errorf("LockedError names key %q token %d, want %q %d", locked.HolderKey, locked.Token, m.Key(), mutexToken(m))
	}

	got := make(chan *etcdlock.Lease, 1)
	go func() {
		l, err := etcdlock.Acquire(ctx, cli, name, lock.Options{KeepAlive: true})
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	select {
	case <-got:
		t.Fatal("Acquire returned while etcdctl held the lock")
	case <-time.After(300 * time.Millisecond):
	}
	if err := m.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	var l *etcdlock.Lease
	select {
	case l = <-got:
	case <-time.After(5 * time.Second):
		t.Fatal("Acquire did not get the lock after etcdctl released it")
	}
	if l == nil {
		t.FailNow()
	}
	if l.Token() <= mutexToken(m) {
		t.Errorf("token %d not above etcdctl holder's %d", l.Token(), mutexToken(m))
	}

	m2 := etcdctlMutex(t, cli, name)
	if err := m2.TryLock(ctx); !errors.Is(err, concurrency.ErrLocked) {
		t.Fatalf("etcdctl TryLock while fenceproxy holds the lock: err = %v, want ErrLocked", err)
	}
	locks := make(chan error, 1)
	go func() { locks <- m2.Lock(ctx) }()
	select {
	case err := <-locks:
		t.Fatalf("etcdctl Lock returned while fenceproxy held the lock: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	mustRelease(t, ctx, l)
	select {
	case err := <-locks:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("etcdctl Lock did not get the lock after Release")
	}
	if mutexToken(m2) <= l.Token() {
		t.Errorf("etcdctl holder's token %d not above %d", mutexToken(m2), l.Token())
	}
	if err := m2.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestMixedContendersNeverOverlap has this package and etcdctl-style
// mutexes contend for one lock: never two holders at once, and the tokens
// in the order of the grants strictly increase.
func TestMixedContendersNeverOverlap(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const (
		name   = "locks/mixed"
		rounds = 8
	)

	var (
		inUse  atomic.Int32
		mu     sync.Mutex
		tokens []int64
		wg     sync.WaitGroup
	)
	critical := func(who string, token int64) {
		if !inUse.CompareAndSwap(0, 1) {
			t.Errorf("%s got token %d while another contender held the lock", who, token)
		}
		mu.Lock()
		tokens = append(tokens, token)
		mu.Unlock()
		time.Sleep(3 * time.Millisecond)
		inUse.Store(0)
	}
	for c := range 2 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for range rounds {
				l, err := etcdlock.Acquire(ctx, cli, name, lock.Options{KeepAlive: true})
				if err != nil {
					t.Errorf("lock contender %d: %v", c, err)
					return
				}
				critical(fmt.Sprintf("lock contender %d", c), l.Token())
				if err := l.Release(ctx); err != nil {
					t.Errorf("lock contender %d: release: %v", c, err)
					return
				}
			}
		}()
		go func() {
			defer wg.Done()
			m := etcdctlMutex(t, cli, name)
			for range rounds {
				if err := m.Lock(ctx); err != nil {
					t.Errorf("etcdctl contender %d: %v", c, err)
					return
				}
				critical(fmt.Sprintf("etcdctl contender %d", c), mutexToken(m))
				if err := m.Unlock(ctx); err != nil {
					t.Errorf("etcdctl contender %d: unlock: %v", c, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if len(tokens) != 4*rounds {
		t.Errorf("%d grants, want %d", len(tokens), 4*rounds)
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Errorf("tokens out of order at grant %d: %v", i, tokens)
			break
		}
	}
}

// TestWaitersFIFO: waiters get the lock in the order they queued, each
// waiting for its predecessor, whether they use this package or etcdctl.
func TestWaitersFIFO(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const (
		name    = "locks/fifo"
		waiters = 5
	)

	holder := mustAcquire(t, ctx, cli, name, lock.Options{KeepAlive: true, Holder: "first"})
	var (
		mu     sync.Mutex
		order  []int
		tokens []int64
		wg     sync.WaitGroup
	)
	record := func(i int, token int64) {
		mu.Lock()
		order = append(order, i)
		tokens = append(tokens, token)
		mu.Unlock()
		time.Sleep(20 * time.Millisecond)
	}
	for i := range waiters {
		wg.Add(1)
		if i%2 == 1 {
			m := etcdctlMutex(t, cli, name)
			go func() {
				defer wg.Done()
				if err := m.Lock(ctx); err != nil {
					t.Errorf("waiter %d: %v", i, err)
					return
				}
				record(i, mutexToken(m))
				if err := m.Unlock(ctx); err != nil {
					t.Errorf("waiter %d: unlock: %v", i, err)
				}
			}()
		} else {
			go func() {
				defer wg.Done()
				l, err := etcdlock.Acquire(ctx, cli, name, lock.Options{KeepAlive: true, Holder: fmt.Sprintf("waiter-%d", i)})
				if err != nil {
					t.Errorf("waiter %d: %v", i, err)
					return
				}
				record(i, l.Token())
				if err := l.Release(ctx); err != nil {
					t.Errorf("waiter %d: release: %v", i, err)
				}
			}()
		}
		// Queue the next waiter only once this one's key is in line.
		waitKeys(t, ctx, cli, name, i+2)
	}
	mustRelease(t, ctx, holder)
	wg.Wait()
	for i, w := range order {
		if w != i {
			t.Fatalf("waiters got the lock in order %v, want 0..%d", order, waiters-1)
		}
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] || tokens[0] <= holder.Token() {
			t.Fatalf("tokens %v after holder's %d not increasing", tokens, holder.Token())
		}
	}
}

// waitKeys waits until n keys are in line for name.
func waitKeys(t *testing.T, ctx context.Context, cli *clientv3.Client, name string, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := cli.Get(ctx, etcdlock.Prefix(name), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		if resp.Count >= int64(n) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d keys in line for %q after 5s, want %d", resp.Count, name, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestWaiterWithoutKeepAliveKeepsPlace: a waiter without keep-alive waits
// longer than its TTL without losing its place, and once it holds the lock
// its lease runs for about one TTL from then, reported through Done.
func TestWaiterWithoutKeepAliveKeepsPlace(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	const name = "locks/patient"

	holder := mustAcquire(t, ctx, cli, name, lock.Options{KeepAlive: true})
	res := make(chan *etcdlock.Lease, 1)
	go func() {
		l, err := etcdlock.Acquire(ctx, cli, name, lock.Options{TTL: time.Second})
		if err != nil {
			t.Error(err)
		}
		res <- l
	}()
	waitKeys(t, ctx, cli, name, 2)
	time.Sleep(3 * time.Second)
	mustRelease(t, ctx, holder)
	var l *etcdlock.Lease
	select {
	case l = <-res:
	case <-time.After(5 * time.Second):
		t.Fatal("waiter did not get the lock")
	}
	if l == nil {
		t.FailNow()
	}
	acquired := time.Now()
	if err := l.Err(); err != nil {
		t.Fatalf("waiter's lease ended as it got the lock: %v", err)
	}
	waitDone(t, l, l.TTL()+3*time.Second)
	if d := time.Since(acquired); d < l.TTL()/2 {
		t.Errorf("Done after %v, TTL %v", d, l.TTL())
	}
	if err := l.Err(); !errors.Is(err, lock.ErrLost) {
		t.Fatalf("Err() = %v, want ErrLost", err)
	}
	next := mustAcquire(t, ctx, cli, name, lock.Options{})
	if next.Token() <= l.Token() {
		t.Errorf("token %d not above expired holder's %d", next.Token(), l.Token())
	}
	mustRelease(t, ctx, next)
}
