package proxy

import (
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"
)

// Defaults of NewMessageBudget.
const (
	// DefaultLargeMessageBudget is the memory, in bytes, that the sessions
	// sharing a MessageBudget may hold at once for large client messages.
	DefaultLargeMessageBudget = 256 << 20
	// DefaultLargeMessageWait is how long a large message waits for
	// budget before it is refused.
	DefaultLargeMessageWait = 30 * time.Second
)

// Giving memory back: a release of at least collectBytes counts against
// the budget until a garbage collection has freed it; smaller ones are free
// at once and collected once they add up to collectBytes. Collections run
// at most once per collectInterval.
const (
	collectBytes    = 1 << 20
	collectInterval = 100 * time.Millisecond
)

// errNoBudget is returned by msgReader.body when a large body could not
// get memory from the budget within the budget's wait.
var errNoBudget = errors.New("proxy: no memory budget for a large message")

// MessageBudget bounds the memory that sessions hold at once for large
// client messages: the bodies the relay must read whole (a Query's or a
// Parse's text, and a Bind's when the policy tracks prepared statements)
// once they are larger than 64 KiB. A message that would exceed the budget
// waits, in arrival order, until other messages release theirs; past the
// budget's wait it is refused (SQLSTATE 53200) and its bytes are read and
// dropped without being held. A message larger than the whole budget is
// read when no other large message holds any.
//
// Messages the relay streams (COPY data, a Bind the policy does not
// track, results) are never held and never charged.
//
// The memory of a large message is returned to the operating system soon
// after the message is handled, not only to Go's heap: a Go program gives
// freed pages back slowly, so after a burst of large messages the process
// would otherwise keep its peak size for minutes.
//
// One MessageBudget may be shared by several Servers; its methods are
// safe for concurrent use.
type MessageBudget struct {
	limit int64
	wait  time.Duration

	mu         sync.Mutex
	used       int64           // charged, or released and not yet collected
	waiters    []*budgetWaiter // in arrival order
	pending    int64           // released, counted in used until collected
	freed      int64           // released small, not yet collected
	collecting bool            // a collection is running or scheduled
}

type budgetWaiter struct {
	n, own  int64
	granted bool
	ready   chan struct{} // closed when granted
}

// NewMessageBudget returns a budget of limit bytes whose messages wait at
// most wait for room. limit <= 0 means DefaultLargeMessageBudget, wait <= 0
// DefaultLargeMessageWait.
func NewMessageBudget(limit int64, wait time.Duration) *MessageBudget {
	if limit <= 0 {
		limit = DefaultLargeMessageBudget
	}
	if wait <= 0 {
		wait = DefaultLargeMessageWait
	}
	return &MessageBudget{limit: limit, wait: wait}
}

// defaultBudget is the budget of the Servers whose Options name none.
var defaultBudget = NewMessageBudget(0, 0)

// Limit returns the budget's size in bytes.
func (b *MessageBudget) Limit() int64 { return b.limit }

// InUse returns the bytes held now by large messages, and how many
// messages wait for room.
func (b *MessageBudget) InUse() (held int64, waiting int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.used, len(b.waiters)
}

// fitsLocked reports whether n more bytes may be held by a message that
// already holds own.
func (b *MessageBudget) fitsLocked(n, own int64) bool {
	return b.used+n <= b.limit || b.used == own
}

// tryAcquire takes n bytes for a message that holds own already, if they
// are free and no message waits before it.
func (b *MessageBudget) tryAcquire(n, own int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.waiters) == 0 && b.fitsLocked(n, own) {
		b.used += n
		return true
	}
	return false
}

// acquire takes n bytes for a message that holds own already, waiting for
// them at most b.wait; it returns an error wrapping errNoBudget if they did
// not become free in time.
func (b *MessageBudget) acquire(n, own int64) error {
	if b.tryAcquire(n, own) {
		return nil
	}
	b.mu.Lock()
	w := &budgetWaiter{n: n, own: own, ready: make(chan struct{})}
	b.waiters = append(b.waiters, w)
	b.grantLocked()
	b.mu.Unlock()

	t := time.NewTimer(b.wait)
	defer t.Stop()
	select {
	case <-w.ready:
		return nil
	case <-t.C:
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if w.granted {
		return nil
	}
	for i, x := range b.waiters {
		if x == w {
			b.waiters = append(b.waiters[:i], b.waiters[i+1:]...)
			break
		}
	}
	// The head may fit now that it is another message.
	b.grantLocked()
	return fmt.Errorf("%w: %d bytes wanted, %d of %d held by other messages for %s", errNoBudget, n, b.used-own, b.limit, b.wait)
}

// grantLocked grants the waiters at the head of the queue that fit.
func (b *MessageBudget) grantLocked() {
	for len(b.waiters) > 0 {
		w := b.waiters[0]
		if !b.fitsLocked(w.n, w.own) {
			return
		}
		b.used += w.n
		w.granted = true
		close(w.ready)
		b.waiters[0] = nil
		b.waiters = b.waiters[1:]
	}
}

// release gives back n bytes whose memory is no longer referenced.
func (b *MessageBudget) release(n int64) {
	if n <= 0 {
		return
	}
	b.mu.Lock()
	if n >= collectBytes {
		b.pending += n
	} else {
		b.used -= n
		b.freed += n
		b.grantLocked()
	}
	start := !b.collecting && (b.pending > 0 || b.freed >= collectBytes)
	if start {
		b.collecting = true
	}
	b.mu.Unlock()
	if start {
		time.AfterFunc(0, b.collect)
	}
}

// collect frees the memory released since the last collection, returns it
// to the operating system, and then lets waiting messages have its budget:
// so the budget bounds what large messages cost the process, their
// garbage included, not only what they hold.
//
// debug.FreeOSMemory runs a garbage collection, which costs CPU in
// proportion to the live heap (small in a relay), and returns every free
// page at once; Go alone gives pages back over minutes, so a burst of
// large messages would otherwise leave the process at its peak size. It
// runs off the sessions' goroutines, at most once per collectInterval.
//
// The large buffers are ordinary Go memory, neither pooled (a pool would
// keep the peak) nor mapped by hand: a body's text may still be referred
// to after the message (the policy copies what it keeps, but a mistake
// there would then be a crash, not a leak), and Go memory stays valid for
// as long as anything refers to it.
func (b *MessageBudget) collect() {
	b.mu.Lock()
	p := b.pending
	b.pending, b.freed = 0, 0
	b.mu.Unlock()
	debug.FreeOSMemory()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.used -= p
	b.grantLocked()
	if b.pending > 0 || b.freed >= collectBytes {
		time.AfterFunc(collectInterval, b.collect)
		return
	}
	b.collecting = false
}

// messageBudget returns the budget the session's large client messages
// are charged to. On an event loop, a wait for room parks the session's
// task, not the loop.
func (t *tracker) messageBudget() bodyBudget {
	b := t.srv.opts.LargeMessages
	if b == nil {
		b = defaultBudget
	}
	if t.loop != nil {
		return loopBudget{b, t.loop}
	}
	return b
}

// loopBudget is a MessageBudget as seen from a session on an event loop.
type loopBudget struct {
	*MessageBudget
	l *loop
}

func (lb loopBudget) acquire(n, own int64) error {
	if lb.tryAcquire(n, own) {
		return nil
	}
	if !lb.l.inTask() {
		return lb.MessageBudget.acquire(n, own)
	}
	var err error
	lb.l.await(func() { err = lb.MessageBudget.acquire(n, own) })
	return err
}
