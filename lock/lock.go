package lock

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"
)

var (
	// ErrLocked is wrapped by the *LockedError TryAcquire returns when
	// another holder has the lock.
	ErrLocked = errors.New("lock: held by another holder")
	// ErrNotHeld is returned by Release when the holder's key no longer
	// belongs to the caller's grant: the lease expired, the key was
	// deleted, or the lock was already released.
	ErrNotHeld = errors.New("lock: not held")
	// ErrLost is wrapped by the *LostError a grant's Err returns when the
	// grant was lost.
	ErrLost = errors.New("lock: lease lost")
	// ErrReleased is returned by a grant's Err after Release.
	ErrReleased = errors.New("lock: released")
)

// LockedError reports that another holder has the lock. It wraps ErrLocked.
type LockedError struct {
	Key string // the lock's name
	// HolderKey is the holder's key: NAME/<lease in hex> in etcd, the
	// lock hash NAME in Redis.
	HolderKey string
	Holder    string // who holds it: Options.Holder, empty for etcdctl
	Token     int64  // the holder's fencing token
}

func (e *LockedError) Error() string {
	return fmt.Sprintf("%v: lock %q, holder %q (key %q), token %d", ErrLocked, e.Key, e.Holder, e.HolderKey, e.Token)
}

func (e *LockedError) Unwrap() error { return ErrLocked }

// LostError reports how a grant was lost. It wraps ErrLost.
type LostError struct {
	Key    string // the lock's name
	Token  int64
	Reason string // e.g. "lease expired after 10s", "key deleted at revision 42"
}

func (e *LostError) Error() string {
	return fmt.Sprintf("%v: lock %q, token %d: %s", ErrLost, e.Key, e.Token, e.Reason)
}

func (e *LostError) Unwrap() error { return ErrLost }

// DefaultTTL is the lease TTL when Options.TTL is zero.
const DefaultTTL = 10 * time.Second

// Options configures Acquire and TryAcquire.
type Options struct {
	// TTL is the lease's time to live. Default DefaultTTL. Each service
	// rounds it to its own unit: etcd to whole seconds (at least 1s, and
	// the server may grant more), Redis to milliseconds.
	TTL time.Duration
	// KeepAlive renews the lease in the background until Release; a holder
	// whose work may outlast TTL wants it. Without it the lease, and with
	// it the lock, ends about TTL after the lock was taken. Default false.
	KeepAlive bool
	// Holder names the holder where the service keeps the lock, so that
	// operators can see who holds and who waits for the lock. It plays no
	// part in ownership. Default "<hostname>/<pid>" (HolderName).
	Holder string
}

// HolderName returns Holder, or "<hostname>/<pid>" when Holder is empty.
func (o Options) HolderName() string {
	if o.Holder != "" {
		return o.Holder
	}
	host, err := os.Hostname()
	if err != nil {
		host = "unknown"
	}
	return host + "/" + strconv.Itoa(os.Getpid())
}
