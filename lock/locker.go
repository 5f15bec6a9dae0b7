package lock

import "context"

// Grant is one holder's grant of a lock, whichever service issued it:
// *etcdlock.Lease and *redislock.Lease implement it.
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
// service by configuration: etcdlock.New or redislock.New.
type Locker interface {
	// Acquire takes the lock name, waiting while others hold it, until
	// ctx is done: a deadline on ctx is the wait bound.
	Acquire(ctx context.Context, name string, opts Options) (Grant, error)
	// TryAcquire takes the lock only if it is free now; otherwise it
	// returns a *LockedError wrapping ErrLocked.
	TryAcquire(ctx context.Context, name string, opts Options) (Grant, error)
}
