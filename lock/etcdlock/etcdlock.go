package etcdlock

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/internal/held"
)

// cleanupTimeout bounds the lease revocations done on failure paths, which
// run after the caller's context may already be done.
const cleanupTimeout = 5 * time.Second

// ttlSeconds is opts.TTL in etcd's unit, whole seconds, rounded up.
func ttlSeconds(opts lock.Options) (int64, error) {
	switch {
	case opts.TTL < 0:
		return 0, fmt.Errorf("lock: negative TTL %v", opts.TTL)
	case opts.TTL == 0:
		return int64(lock.DefaultTTL / time.Second), nil
	}
	return int64(math.Ceil(opts.TTL.Seconds())), nil
}

// Prefix returns the etcd prefix under which the holder and the waiters of
// the lock name keep their keys: name followed by "/", as in
// concurrency.NewMutex and etcdctl lock.
func Prefix(name string) string { return name + "/" }

// HolderKey returns the key a grant on lease id creates for the lock name:
// Prefix(name) followed by the lease ID in lower-case hexadecimal, the key
// concurrency.Mutex (and so etcdctl lock) uses.
func HolderKey(name string, id clientv3.LeaseID) string {
	return fmt.Sprintf("%s%x", Prefix(name), int64(id))
}

// Acquire takes the lock name, waiting in line for as long as others hold
// it or wait before this call. It returns when the lock is taken, or with
// an error when ctx is done or etcd fails. On failure no lease of this call
// survives, unless etcd was unreachable to revoke it, in which case it
// expires after its TTL.
//
// ctx bounds only the acquisition: the returned Lease lives until Release
// or until it is lost.
func Acquire(ctx context.Context, cli *clientv3.Client, name string, opts lock.Options) (*Lease, error) {
	return acquire(ctx, cli, name, opts, true)
}

// TryAcquire is Acquire without waiting: if another holder has the lock, or
// an earlier waiter is queued for it, it returns a *lock.LockedError,
// which wraps lock.ErrLocked, at once.
func TryAcquire(ctx context.Context, cli *clientv3.Client, name string, opts lock.Options) (*Lease, error) {
	return acquire(ctx, cli, name, opts, false)
}

func acquire(ctx context.Context, cli *clientv3.Client, name string, opts lock.Options, wait bool) (*Lease, error) {
	if cli == nil {
		return nil, errors.New("lock: nil client")
	}
	if name == "" {
		return nil, errors.New("lock: empty name")
	}
	ttl, err := ttlSeconds(opts)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("lock: acquire %q: %w", name, err)
	}

	// The lease's expiry is measured from before the grant request: the
	// server starts its clock somewhere after this instant, so the local
	// deadline never falls after the server's (modulo clock rate drift).
	start := time.Now()
	g, err := cli.Grant(ctx, ttl)
	if err != nil {
		return nil, fmt.Errorf("lock: grant lease for %q: %w", name, err)
	}
	granted := time.Duration(g.TTL) * time.Second
	holderKey := HolderKey(name, g.ID)

	// The session renews the lease while the grant waits in line, in both
	// modes, and after that only with KeepAlive. Its context is the
	// Lease's, so ending the Lease stops the renewals.
	lctx, lcancel := context.WithCancel(context.Background())
	fail := func(err error) (*Lease, error) {
		lcancel()
		// Revoking the lease deletes the holder key with it, whatever
		// state the failed call left it in.
		revoke(ctx, cli, g.ID)
		return nil, err
	}
	s, err := concurrency.NewSession(cli,
		concurrency.WithLease(g.ID), concurrency.WithTTL(int(g.TTL)), concurrency.WithContext(lctx))
	if err != nil {
		return fail(fmt.Errorf("lock: keep-alive for %q: %w", name, err))
	}

	// Create the holder key with the holder's name as its value before the
	// Mutex runs: Mutex only creates the key if it does not exist, and
	// otherwise takes its place in line from the key's creation revision,
	// so the value stays visible to operators while the grant waits and
	// while it holds the lock.
	put, err := cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(holderKey), "=", 0)).
		Then(clientv3.OpPut(holderKey, opts.HolderName(), clientv3.WithLease(g.ID))).
		Commit()
	if err != nil {
		return fail(fmt.Errorf("lock: acquire %q: %w", name, err))
	}
	if !put.Succeeded {
		return fail(fmt.Errorf("lock: acquire %q: key %q of a fresh lease exists", name, holderKey))
	}

	m := concurrency.NewMutex(s, name)
	// WithRequireLeader: a member cut off from the leader would otherwise
	// keep the wait's watch open and silent forever.
	mctx := clientv3.WithRequireLeader(ctx)
	if wait {
		err = m.Lock(mctx)
	} else {
		err = m.TryLock(mctx)
	}
	switch {
	case errors.Is(err, concurrency.ErrLocked):
		locked := owner(ctx, cli, name)
		return fail(locked)
	case err != nil:
		return fail(fmt.Errorf("lock: acquire %q: %w", name, err))
	case m.Key() != holderKey:
		return fail(fmt.Errorf("lock: acquire %q: mutex took key %q, want %q", name, m.Key(), holderKey))
	}
	// The token is the holder key's creation revision, which Mutex
	// compares against to check ownership.
	isOwner := m.IsOwner()
	token := isOwner.GetCompare().GetCreateRevision()
	if token != put.Header.Revision {
		return fail(fmt.Errorf("lock: acquire %q: holder key created at revision %d, mutex says %d", name, put.Header.Revision, token))
	}

	if !opts.KeepAlive {
		s.Orphan()
	}
	expiry := start.Add(granted)
	if time.Since(start) > granted/4 {
		// The grant waited in line while the session renewed the lease,
		// so the lease lives longer than start+TTL. Renew it once more,
		// measured from before the request, for a deadline that is both
		// safe and not needlessly early.
		before := time.Now()
		ka, err := cli.KeepAliveOnce(ctx, g.ID)
		if err != nil {
			return fail(fmt.Errorf("lock: acquire %q: renew lease: %w", name, err))
		}
		expiry = before.Add(time.Duration(ka.TTL) * time.Second)
	}

	l := &Lease{
		State:     held.New(name, token, lcancel),
		cli:       cli,
		holderKey: holderKey,
		id:        g.ID,
		ttl:       granted,
		session:   s,
		ctx:       lctx,
		monitored: make(chan struct{}),
		renewed:   make(chan time.Time),
	}
	go l.monitor(expiry, opts.KeepAlive)
	return l, nil
}

// owner describes the current holder of name for TryAcquire's error. The
// holder may change meanwhile; the error says what was seen.
func owner(ctx context.Context, cli *clientv3.Client, name string) *lock.LockedError {
	e := &lock.LockedError{Key: name}
	resp, err := cli.Get(ctx, Prefix(name), clientv3.WithFirstCreate()...)
	if err == nil && len(resp.Kvs) > 0 {
		kv := resp.Kvs[0]
		e.HolderKey, e.Holder, e.Token = string(kv.Key), string(kv.Value), kv.CreateRevision
	}
	return e
}

// revoke revokes id on a failure path. The caller's context may be done, so
// it runs on its own deadline; if it fails the lease expires after its TTL.
func revoke(ctx context.Context, cli *clientv3.Client, id clientv3.LeaseID) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	cli.Revoke(ctx, id) //nolint:errcheck // best effort, see above
}

// Lease is one holder's grant of a lock: the lock's name, the holder key
// and the etcd lease that keeps it, and the fencing token the grant
// carries. Its methods are safe for concurrent use.
type Lease struct {
	*held.State // the name, the token and how the grant ended
	cli         *clientv3.Client
	holderKey   string
	id          clientv3.LeaseID
	ttl         time.Duration
	session     *concurrency.Session

	ctx       context.Context // canceled (by held.End) to stop the monitor and the session
	monitored chan struct{}   // closed when the monitor has returned
	renewed   chan time.Time  // Renew's new expiry, for the monitor
}

// HolderKey returns the etcd key this grant created: Prefix(Key()) followed
// by the lease ID in hexadecimal. It exists while the grant waits and holds.
func (l *Lease) HolderKey() string { return l.holderKey }

// LeaseID returns the etcd lease the holder key is attached to.
func (l *Lease) LeaseID() clientv3.LeaseID { return l.id }

// TTL returns the lease TTL the server granted.
func (l *Lease) TTL() time.Duration { return l.ttl }

// Release gives the lock up. In one transaction it deletes the holder key
// if the key still carries this grant (creation revision equal to the token
// and this lease), so it never deletes a key that is not its own, unlike
// concurrency.Mutex.Unlock; then it revokes the lease. It returns
// lock.ErrNotHeld if the key no longer belongs to this grant.
//
// Release stops keep-alive whatever the outcome, so even when it fails
// (etcd unreachable, ctx done) the lock frees itself within the TTL.
func (l *Lease) Release(ctx context.Context) error {
	held.End(l.State, lock.ErrReleased)
	<-l.monitored
	l.session.Orphan()

	resp, txnErr := l.cli.Txn(ctx).
		If(
			clientv3.Compare(clientv3.CreateRevision(l.holderKey), "=", l.Token()),
			clientv3.Compare(clientv3.LeaseValue(l.holderKey), "=", l.id),
		).
		Then(clientv3.OpDelete(l.holderKey)).
		Commit()
	_, revokeErr := l.cli.Revoke(ctx, l.id)

	switch {
	case txnErr == nil && resp.Succeeded:
		// The lock is free. A failed revoke leaves only a lease with no
		// key, which expires on its own.
		return nil
	case txnErr == nil:
		return fmt.Errorf("%w: lock %q, token %d", lock.ErrNotHeld, l.Key(), l.Token())
	case revokeErr == nil:
		// The delete's outcome is unknown, but revoking the lease deletes
		// every key attached to it, so the lock is free either way.
		return nil
	case errors.Is(revokeErr, rpctypes.ErrLeaseNotFound):
		return fmt.Errorf("%w: lock %q, token %d: lease gone", lock.ErrNotHeld, l.Key(), l.Token())
	default:
		return fmt.Errorf("lock: release %q: %w", l.Key(), txnErr)
	}
}

func isLeaseNotFound(err error) bool { return errors.Is(err, rpctypes.ErrLeaseNotFound) }

// monitor watches for the end of the lease until the lease ends. expiry is
// the local deadline of the lease as granted; with keepAlive it moves on
// with every renewal.
func (l *Lease) monitor(expiry time.Time, keepAlive bool) {
	defer close(l.monitored)
	ctx := l.ctx

	timer := time.NewTimer(time.Until(expiry))
	defer timer.Stop()

	var renewals <-chan *clientv3.LeaseKeepAliveResponse
	if keepAlive {
		// The session renews the lease; this subscribes to the same
		// keep-alive (clientv3 sends one request for both) to see each
		// renewal's TTL, which the session does not expose.
		ch, err := l.cli.KeepAlive(ctx, l.id)
		if err != nil {
			held.Lost(l.State, "keep-alive: %v", err)
			return
		}
		renewals = ch
	}

	// The watch starts after the holder key's creation, so it sees every
	// later change to the key even though it is set up after the grant.
	w := keyWatch{l: l, from: l.Token() + 1}
	w.start(ctx)
	defer w.stop()
	// While the watch is broken, resync fires to re-read the key and watch
	// again; the lease timer and renewals keep being served meanwhile.
	var resync <-chan time.Time
	backoff := minBackoff

	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
			held.Lost(l.State, "lease expired after %v", l.ttl)
			return
		case e := <-l.renewed:
			if e.After(expiry) {
				expiry = e
				timer.Reset(time.Until(expiry))
			}
		case r, ok := <-renewals:
			if !ok {
				if ctx.Err() == nil {
					held.Lost(l.State, "keep-alive stopped")
				}
				return
			}
			// The server counts the renewed TTL from when it handled the
			// request, which was before now, so now+TTL is a little late;
			// clientv3 measures it the same way. Done is advisory: the
			// token is what protects the data.
			expiry = time.Now().Add(time.Duration(r.TTL) * time.Second)
			timer.Reset(time.Until(expiry))
		case resp, ok := <-w.events:
			if !ok || resp.Err() != nil {
				if ctx.Err() != nil {
					return
				}
				if l.cli.Ctx().Err() != nil {
					held.Lost(l.State, "etcd client closed")
					return
				}
				w.stop()
				resync = time.After(backoff)
				continue
			}
			for _, ev := range resp.Events {
				if why, gone := l.lostBy(ev); gone {
					held.Lost(l.State, "%s", why)
					return
				}
			}
		case <-resync:
			// Never wait past the lease's own deadline for an answer.
			timeout := min(time.Second, time.Until(expiry))
			why, gone, err := w.restart(ctx, timeout)
			switch {
			case gone:
				held.Lost(l.State, "%s", why)
				return
			case err != nil:
				backoff = min(2*backoff, maxBackoff)
				resync = time.After(backoff)
			default:
				backoff = minBackoff
				resync = nil
			}
		}
	}
}

const (
	minBackoff = 50 * time.Millisecond
	maxBackoff = time.Second
)

// lostBy reports whether a change to the holder key means this grant no
// longer holds it.
func (l *Lease) lostBy(ev *clientv3.Event) (string, bool) {
	switch {
	case ev.Type == mvccpb.DELETE:
		return fmt.Sprintf("key %q deleted at revision %d", l.holderKey, ev.Kv.ModRevision), true
	case ev.Kv.CreateRevision != l.Token() || clientv3.LeaseID(ev.Kv.Lease) != l.id:
		return fmt.Sprintf("key %q overwritten at revision %d", l.holderKey, ev.Kv.ModRevision), true
	}
	return "", false
}

// keyWatch is the monitor's watch on the holder key.
type keyWatch struct {
	l      *Lease
	from   int64 // first revision of interest
	events clientv3.WatchChan
	cancel context.CancelFunc
}

func (w *keyWatch) start(ctx context.Context) {
	// WithRequireLeader: a member cut off from the leader would otherwise
	// keep the watch open and silent.
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	w.cancel = cancel
	w.events = w.l.cli.Watch(wctx, w.l.holderKey, clientv3.WithRev(w.from))
}

// stop cancels the watch. Receiving from the nil channel it leaves blocks,
// which takes the watch out of the monitor's select.
func (w *keyWatch) stop() {
	if w.cancel != nil {
		w.cancel()
		w.cancel = nil
	}
	w.events = nil
}

// restart re-reads the holder key after the watch broke (compacted history,
// leader loss, connection trouble) and watches again from there. It
// reports whether the key no longer belongs to the grant, or an error if
// etcd did not answer within timeout.
func (w *keyWatch) restart(ctx context.Context, timeout time.Duration) (string, bool, error) {
	gctx, cancel := context.WithTimeout(ctx, timeout)
	resp, err := w.l.cli.Get(gctx, w.l.holderKey)
	cancel()
	if err != nil {
		return "", false, err
	}
	if len(resp.Kvs) == 0 {
		return fmt.Sprintf("key %q deleted", w.l.holderKey), true, nil
	}
	kv := resp.Kvs[0]
	if kv.CreateRevision != w.l.Token() || clientv3.LeaseID(kv.Lease) != w.l.id {
		return fmt.Sprintf("key %q taken over at revision %d", w.l.holderKey, kv.ModRevision), true, nil
	}
	w.from = resp.Header.Revision + 1
	w.start(ctx)
	return "", false, nil
}
