package lock

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Grant is one holder's grant of a lock, whichever service issued it:
// *Lease (etcd) and *RedisLease implement it.
type Grant interface {
	// Key returns the lock's name.
	Key() string
	// Token returns the fencing token.
	Token() int64
	// Fence returns the token and the lock's name with the setting names
	// s, to carry them to PostgreSQL.
	Fence(s Settings) Fence
	// Done is closed when the grant is lost or released; Err says which.
	Done() <-chan struct{}
	// Err is nil while the grant is held, then ErrReleased or a
	// *LostError.
	Err() error
	// Renew extends the grant by its TTL from now, if it is still this
	// holder's; otherwise it reports a *LostError and ends the grant.
	Renew(ctx context.Context) error
	// Release gives the lock up, removing only this holder's key; it
	// returns ErrNotHeld if the key was no longer this holder's.
	Release(ctx context.Context) error
}

// Locker takes locks from one lock service, so that a program picks the
// service by configuration: Etcd or NewRedis.
type Locker interface {
	// Acquire takes the lock name, waiting while others hold it, until
	// ctx is done: a deadline on ctx is the wait bound.
	Acquire(ctx context.Context, name string, opts Options) (Grant, error)
	// TryAcquire takes the lock only if it is free now; otherwise it
	// returns a *LockedError wrapping ErrLocked.
	TryAcquire(ctx context.Context, name string, opts Options) (Grant, error)
}

// Etcd returns a Locker that takes locks in etcd through cli, as Acquire
// and TryAcquire do.
func Etcd(cli *clientv3.Client) Locker { return etcdLocker{cli} }

type etcdLocker struct{ cli *clientv3.Client }

func (e etcdLocker) Acquire(ctx context.Context, name string, opts Options) (Grant, error) {
	l, err := Acquire(ctx, e.cli, name, opts)
	if err != nil {
		return nil, err
	}
	return l, nil
}

func (e etcdLocker) TryAcquire(ctx context.Context, name string, opts Options) (Grant, error) {
	l, err := TryAcquire(ctx, e.cli, name, opts)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// Renew renews the etcd lease once (as the KeepAlive option does in the
// background) and moves the local expiry that closes Done to the new
// deadline, measured from before the request. It returns Err if the lease
// already ended, and a *LostError if etcd no longer has the lease.
func (l *Lease) Renew(ctx context.Context) error {
	if err := l.Err(); err != nil {
		return err
	}
	before := time.Now()
	ka, err := l.cli.KeepAliveOnce(ctx, l.id)
	if err != nil {
		if ctx.Err() == nil && l.cli.Ctx().Err() == nil && isLeaseNotFound(err) {
			l.lost("lease not found on renewal")
			return l.Err()
		}
		return fmt.Errorf("lock: renew %q: %w", l.name, err)
	}
	select {
	case l.renewed <- before.Add(time.Duration(ka.TTL) * time.Second):
	case <-l.done:
		return l.Err()
	}
	return nil
}
