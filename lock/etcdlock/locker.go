package etcdlock

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/internal/held"
)

// New returns a lock.Locker that takes locks in etcd through cli, as
// Acquire and TryAcquire do; its grants are *Lease.
func New(cli *clientv3.Client) lock.Locker { return locker{cli} }

type locker struct{ cli *clientv3.Client }

func (e locker) Acquire(ctx context.Context, name string, opts lock.Options) (lock.Grant, error) {
	l, err := Acquire(ctx, e.cli, name, opts)
	if err != nil {
		return nil, err
	}
	return l, nil
}

func (e locker) TryAcquire(ctx context.Context, name string, opts lock.Options) (lock.Grant, error) {
	l, err := TryAcquire(ctx, e.cli, name, opts)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// Renew renews the etcd lease once (as the KeepAlive option does in the
// background) and moves the local expiry that closes Done to the new
// deadline, measured from before the request. It returns Err if the lease
// already ended, and a *lock.LostError if etcd no longer has the lease.
func (l *Lease) Renew(ctx context.Context) error {
	if err := l.Err(); err != nil {
		return err
	}
	before := time.Now()
	ka, err := l.cli.KeepAliveOnce(ctx, l.id)
	if err != nil {
		if ctx.Err() == nil && l.cli.Ctx().Err() == nil && isLeaseNotFound(err) {
			held.Lost(l.State, "lease not found on renewal")
			return l.Err()
		}
		return fmt.Errorf("lock: renew %q: %w", l.Key(), err)
	}
	select {
	case l.renewed <- before.Add(time.Duration(ka.TTL) * time.Second):
	case <-l.Done():
		return l.Err()
	}
	return nil
}

// Check that *Lease is a lock.Grant.
var _ lock.Grant = (*Lease)(nil)
