package lock

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

var (
	// ErrLocked is wrapped by the *LockedError TryAcquire returns when
	// another holder has the key.
	ErrLocked = errors.New("lock: held by another holder")
	// ErrNotHeld is returned by Release when the key no longer belongs to
	// the caller's grant: the lease expired, the key was deleted, or the
	// lock was already released.
	ErrNotHeld = errors.New("lock: not held")
	// ErrLost is wrapped by the *LostError Lease.Err returns when the lease
	// was lost.
	ErrLost = errors.New("lock: lease lost")
	// ErrReleased is returned by Lease.Err after Release.
	ErrReleased = errors.New("lock: released")
)

// LockedError reports that another holder has the key. It wraps ErrLocked.
type LockedError struct {
	Key    string
	Holder string // the key's value: the holder's Options.Holder
	Token  int64  // the holder's fencing token
}

func (e *LockedError) Error() string {
	return fmt.Sprintf("%v: key %q, holder %q, token %d", ErrLocked, e.Key, e.Holder, e.Token)
}

func (e *LockedError) Unwrap() error { return ErrLocked }

// LostError reports how a lease was lost. It wraps ErrLost.
type LostError struct {
	Key    string
	Token  int64
	Reason string // e.g. "lease expired after 10s", "key deleted at revision 42"
}

func (e *LostError) Error() string {
	return fmt.Sprintf("%v: key %q, token %d: %s", ErrLost, e.Key, e.Token, e.Reason)
}

func (e *LostError) Unwrap() error { return ErrLost }

// DefaultTTL is the lease TTL when Options.TTL is zero.
const DefaultTTL = 10 * time.Second

// cleanupTimeout bounds the lease revocations done on failure paths, which
// run after the caller's context may already be done.
const cleanupTimeout = 5 * time.Second

// Options configures Acquire and TryAcquire.
type Options struct {
	// TTL is the lease's time to live. etcd counts leases in whole seconds,
	// so TTL is rounded up to a whole number of seconds, at least 1s.
	// Default DefaultTTL. The server may grant more than asked (its minimum
	// is 1.5 election timeouts); Lease.TTL reports what was granted.
	TTL time.Duration
	// KeepAlive renews the lease in the background until Release; a holder
	// whose work may outlast TTL wants it. Without it the lease, and with
	// it the lock, ends TTL after it was granted. Default false.
	KeepAlive bool
	// Holder is stored as the key's value so that operators can see who
	// holds the lock. It plays no part in ownership, which is decided by
	// token and lease. Default "<hostname>/<pid>".
	Holder string
}

func (o Options) ttlSeconds() (int64, error) {
	switch {
	case o.TTL < 0:
		return 0, fmt.Errorf("lock: negative TTL %v", o.TTL)
	case o.TTL == 0:
		return int64(DefaultTTL / time.Second), nil
	}
	return int64(math.Ceil(o.TTL.Seconds())), nil
}

func (o Options) holder() string {
	if o.Holder != "" {
		return o.Holder
	}
	host, err := os.Hostname()
	if err != nil {
		host = "unknown"
	}
	return host + "/" + strconv.Itoa(os.Getpid())
}

// Acquire takes the lock named by key, waiting for as long as another holder
// has it. It returns when the lock is taken, or with an error when ctx is
// done or etcd fails. On failure no lease of this call survives, unless
// etcd was unreachable to revoke it, in which case it expires after its TTL.
//
// ctx bounds only the acquisition: the returned Lease lives until Release
// or until it is lost.
func Acquire(ctx context.Context, cli *clientv3.Client, key string, opts Options) (*Lease, error) {
	return acquire(ctx, cli, key, opts, true)
}

// TryAcquire is Acquire without waiting: if another holder has the key it
// returns a *LockedError, which wraps ErrLocked, at once.
func TryAcquire(ctx context.Context, cli *clientv3.Client, key string, opts Options) (*Lease, error) {
	return acquire(ctx, cli, key, opts, false)
}

func acquire(ctx context.Context, cli *clientv3.Client, key string, opts Options, wait bool) (*Lease, error) {
	if cli == nil {
		return nil, errors.New("lock: nil client")
	}
	if key == "" {
		return nil, errors.New("lock: empty key")
	}
	ttl, err := opts.ttlSeconds()
	if err != nil {
		return nil, err
	}
	holder := opts.holder()
	for {
		l, held, err := attempt(ctx, cli, key, ttl, holder, opts.KeepAlive)
		if err != nil {
			return nil, err
		}
		if l != nil {
			return l, nil
		}
		if !wait {
			return nil, &LockedError{Key: key, Holder: held.holder, Token: held.token}
		}
		if err := waitDeleted(ctx, cli, key, held.rev); err != nil {
			return nil, err
		}
	}
}

// heldBy describes the grant that holds a key.
type heldBy struct {
	holder string // the key's value
	token  int64  // the key's creation revision
	rev    int64  // revision at which it was seen
}

// attempt makes one try at taking key. It returns the new Lease, or who
// holds the key if someone else does.
//
// A lease is granted per attempt rather than once per Acquire so that a
// lease without keep-alive does not run down while its owner is waiting.
func attempt(ctx context.Context, cli *clientv3.Client, key string, ttl int64, holder string, keepAlive bool) (*Lease, *heldBy, error) {
	// The lease's expiry is measured from before the grant request: the
	// server starts its clock somewhere after this instant, so the local
	// deadline never falls after the server's (modulo clock rate drift).
	start := time.Now()
	g, err := cli.Grant(ctx, ttl)
	if err != nil {
		return nil, nil, fmt.Errorf("lock: grant lease for %q: %w", key, err)
	}
	resp, err := cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, holder, clientv3.WithLease(g.ID))).
		Else(clientv3.OpGet(key)).
		Commit()
	if err != nil {
		// The put may have been applied even though we got no answer;
		// revoking the lease deletes the key with it.
		revoke(ctx, cli, g.ID)
		return nil, nil, fmt.Errorf("lock: acquire %q: %w", key, err)
	}
	if !resp.Succeeded {
		revoke(ctx, cli, g.ID)
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			// The compare saw the key, so the Get in the same transaction
			// must too.
			return nil, nil, fmt.Errorf("lock: acquire %q: key vanished inside a transaction", key)
		}
		return nil, &heldBy{
			holder: string(kvs[0].Value),
			token:  kvs[0].CreateRevision,
			rev:    resp.Header.Revision,
		}, nil
	}
	l := newLease(cli, key, resp.Header.Revision, g.ID, time.Duration(g.TTL)*time.Second)
	go l.monitor(start.Add(l.ttl), keepAlive)
	return l, nil, nil
}

// revoke revokes id on a failure path. The caller's context may be done, so
// it runs on its own deadline; if it fails the lease expires after its TTL.
func revoke(ctx context.Context, cli *clientv3.Client, id clientv3.LeaseID) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	cli.Revoke(ctx, id) //nolint:errcheck // best effort, see above
}

// waitDeleted blocks until key is deleted at a revision after rev, or the
// watch breaks (compaction, leader loss), after which the caller simply
// tries again.
func waitDeleted(ctx context.Context, cli *clientv3.Client, key string, rev int64) error {
	// WithRequireLeader: a member cut off from the leader would otherwise
	// keep the watch open and silent forever.
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for resp := range cli.Watch(wctx, key, clientv3.WithRev(rev+1), clientv3.WithFilterPut()) {
		if resp.Err() != nil {
			break
		}
		for _, ev := range resp.Events {
			if ev.Type == mvccpb.DELETE {
				return nil
			}
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("lock: acquire %q: %w", key, err)
	}
	// The watch broke. Back off a little so that a cluster without a leader
	// does not turn the retry into a busy loop.
	select {
	case <-time.After(100 * time.Millisecond):
		return nil
	case <-ctx.Done():
		return fmt.Errorf("lock: acquire %q: %w", key, ctx.Err())
	}
}

// Lease is one holder's grant of a lock: the key, the etcd lease that keeps
// it, and the fencing token the grant carries. Its methods are safe for
// concurrent use.
type Lease struct {
	cli   *clientv3.Client
	key   string
	token int64
	id    clientv3.LeaseID
	ttl   time.Duration

	ctx       context.Context // canceled to stop the monitor
	cancel    context.CancelFunc
	monitored chan struct{} // closed when the monitor has returned

	done    chan struct{}
	endOnce sync.Once
	err     error // set before done is closed
}

func newLease(cli *clientv3.Client, key string, token int64, id clientv3.LeaseID, ttl time.Duration) *Lease {
	ctx, cancel := context.WithCancel(context.Background())
	return &Lease{
		cli:       cli,
		key:       key,
		token:     token,
		id:        id,
		ttl:       ttl,
		ctx:       ctx,
		cancel:    cancel,
		monitored: make(chan struct{}),
		done:      make(chan struct{}),
	}
}

// Token returns the fencing token: the etcd revision at which this grant
// was made. It is positive and larger than every earlier holder's token.
func (l *Lease) Token() int64 { return l.token }

// Key returns the lock's key.
func (l *Lease) Key() string { return l.key }

// LeaseID returns the etcd lease the key is attached to.
func (l *Lease) LeaseID() clientv3.LeaseID { return l.id }

// TTL returns the lease TTL the server granted.
func (l *Lease) TTL() time.Duration { return l.ttl }

// Done returns a channel that is closed when the lease is lost or released.
// Err then says which.
func (l *Lease) Done() <-chan struct{} { return l.done }

// Err returns nil while the lease is held. After Done is closed it returns
// ErrReleased after Release, or a *LostError (wrapping ErrLost) that says
// how the lease was lost.
func (l *Lease) Err() error {
	select {
	case <-l.done:
		return l.err
	default:
		return nil
	}
}

// end records why the lease ended, closes Done and stops the monitor. The
// first cause wins.
func (l *Lease) end(err error) {
	l.endOnce.Do(func() {
		l.err = err
		close(l.done)
		l.cancel()
	})
}

func (l *Lease) lost(format string, args ...any) {
	l.end(&LostError{Key: l.key, Token: l.token, Reason: fmt.Sprintf(format, args...)})
}

// Release gives the lock up. In one transaction it deletes the key if the
// key still carries this grant (creation revision equal to the token and
// this lease); then it revokes the lease. It returns ErrNotHeld if the key
// no longer belongs to this grant.
//
// Release stops keep-alive whatever the outcome, so even when it fails
// (etcd unreachable, ctx done) the lock frees itself within the TTL.
func (l *Lease) Release(ctx context.Context) error {
	l.end(ErrReleased)
	<-l.monitored

	resp, txnErr := l.cli.Txn(ctx).
		If(
			clientv3.Compare(clientv3.CreateRevision(l.key), "=", l.token),
			clientv3.Compare(clientv3.LeaseValue(l.key), "=", l.id),
		).
		Then(clientv3.OpDelete(l.key)).
		Commit()
	_, revokeErr := l.cli.Revoke(ctx, l.id)

	switch {
	case txnErr == nil && resp.Succeeded:
		// The lock is free. A failed revoke leaves only a lease with no
		// key, which expires on its own.
		return nil
	case txnErr == nil:
		return fmt.Errorf("%w: key %q, token %d", ErrNotHeld, l.key, l.token)
	case revokeErr == nil:
		// The delete's outcome is unknown, but revoking the lease deletes
		// every key attached to it, so the lock is free either way.
		return nil
	case errors.Is(revokeErr, rpctypes.ErrLeaseNotFound):
		return fmt.Errorf("%w: key %q, token %d: lease gone", ErrNotHeld, l.key, l.token)
	default:
		return fmt.Errorf("lock: release %q: %w", l.key, txnErr)
	}
}

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
		ch, err := l.cli.KeepAlive(ctx, l.id)
		if err != nil {
			l.lost("keep-alive: %v", err)
			return
		}
		renewals = ch
	}

	// The watch starts after the grant's revision, so it sees every later
	// change to the key even though it is set up after the grant.
	w := keyWatch{l: l, from: l.token + 1}
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
			l.lost("lease expired after %v", l.ttl)
			return
		case r, ok := <-renewals:
			if !ok {
				if ctx.Err() == nil {
					l.lost("keep-alive stopped")
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
					l.lost("etcd client closed")
					return
				}
				w.stop()
				resync = time.After(backoff)
				continue
			}
			for _, ev := range resp.Events {
				if why, gone := l.lostBy(ev); gone {
					l.lost("%s", why)
					return
				}
			}
		case <-resync:
			// Never wait past the lease's own deadline for an answer.
			timeout := min(time.Second, time.Until(expiry))
			why, gone, err := w.restart(ctx, timeout)
			switch {
			case gone:
				l.lost("%s", why)
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

// lostBy reports whether a change to the key means this grant no longer
// holds it.
func (l *Lease) lostBy(ev *clientv3.Event) (string, bool) {
	switch {
	case ev.Type == mvccpb.DELETE:
		return fmt.Sprintf("key deleted at revision %d", ev.Kv.ModRevision), true
	case ev.Kv.CreateRevision != l.token || clientv3.LeaseID(ev.Kv.Lease) != l.id:
		return fmt.Sprintf("key overwritten at revision %d", ev.Kv.ModRevision), true
	}
	return "", false
}

// keyWatch is the monitor's watch on the lock key.
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
	w.events = w.l.cli.Watch(wctx, w.l.key, clientv3.WithRev(w.from))
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

// restart re-reads the key after the watch broke (compacted history, leader
// loss, connection trouble) and watches again from there. It reports
// whether the key no longer belongs to the grant, or an error if etcd did
// not answer within timeout.
func (w *keyWatch) restart(ctx context.Context, timeout time.Duration) (string, bool, error) {
	gctx, cancel := context.WithTimeout(ctx, timeout)
	resp, err := w.l.cli.Get(gctx, w.l.key)
	cancel()
	if err != nil {
		return "", false, err
	}
	if len(resp.Kvs) == 0 {
		return "key deleted", true, nil
	}
	kv := resp.Kvs[0]
	if kv.CreateRevision != w.l.token || clientv3.LeaseID(kv.Lease) != w.l.id {
		return fmt.Sprintf("key taken over at revision %d", kv.ModRevision), true, nil
	}
	w.from = resp.Header.Revision + 1
	w.start(ctx)
	return "", false, nil
}
