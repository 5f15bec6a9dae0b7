// Package held is what a grant of lock/etcdlock and lock/redislock keeps
// alike: the lock's name and token, and how the grant ended. Each
// package's Lease embeds a *State, which gives it the lock.Grant methods
// that only read these; End and Lost, which end the grant, are functions
// here so that they are not part of Lease's API.
package held

import (
	"context"
	"fmt"
	"sync"

	"github.com/fenceproxy/fenceproxy/lock"
)

// State is a grant's name, token and ending. Its methods are safe for
// concurrent use.
type State struct {
	name   string
	token  int64
	cancel context.CancelFunc // stops the grant's monitor and renewals
	done   chan struct{}
	once   sync.Once
	err    error // set before done is closed
}

// New returns the state of a grant of lock name with token; End calls
// cancel.
func New(name string, token int64, cancel context.CancelFunc) *State {
	return &State{name: name, token: token, cancel: cancel, done: make(chan struct{})}
}

// Key returns the lock's name, as passed to Acquire; the value for the
// lock setting.
func (s *State) Key() string { return s.name }

// Token returns the fencing token the grant carries, larger than every
// earlier holder's token of the same lock.
func (s *State) Token() int64 { return s.token }

// Fence returns the token and the lock's name with the setting names set.
func (s *State) Fence(set lock.Settings) lock.Fence {
	return lock.Fence{Token: s.token, Lock: s.name, Settings: set}
}

// RuntimeParams returns the token and the lock's name keyed by the setting
// names in set, for a connection's startup parameters
// (lock.Fence.RuntimeParams).
func (s *State) RuntimeParams(set lock.Settings) map[string]string {
	return s.Fence(set).RuntimeParams()
}

// PGOptions returns the token and the lock's name as libpq command-line
// options for PGOPTIONS (lock.Fence.PGOptions).
func (s *State) PGOptions(set lock.Settings) string { return s.Fence(set).PGOptions() }

// Done returns a channel that is closed when the grant is lost or
// released. Err then says which.
func (s *State) Done() <-chan struct{} { return s.done }

// Err returns nil while the grant is held; after Done is closed,
// lock.ErrReleased after Release, or a *lock.LostError (wrapping
// lock.ErrLost) that says how the grant was lost.
func (s *State) Err() error {
	select {
	case <-s.done:
		return s.err
	default:
		return nil
	}
}

// End records why the grant ended, closes Done and cancels the grant's
// context. The first cause wins.
func End(s *State, err error) {
	s.once.Do(func() {
		s.err = err
		close(s.done)
		s.cancel()
	})
}

// Lost ends the grant with a *lock.LostError whose reason is formatted
// from format and args.
func Lost(s *State, format string, args ...any) {
	End(s, &lock.LostError{Key: s.name, Token: s.token, Reason: fmt.Sprintf(format, args...)})
}
