// Package logsink is the proxy's log output: a writer that never makes the
// code that logs wait for the output.
//
// The proxy's sessions log from the threads that relay them, an event loop
// relays many sessions on one thread, and the output (a pipe to a container
// runtime, a terminal, a full disk) can stall. A write to the output that
// blocks would stop every session of that loop, including the ones that
// log nothing. So a Writer queues each write in memory and one goroutine
// copies the queue to the output. When more than the limit is waiting, new
// lines are dropped and counted rather than queued: the proxy keeps
// serving, and once the output catches up a notice says how many lines
// were lost (OnDropped), and the count is exported as a metric.
package logsink

import (
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/syncx"
)

// DefaultLimit is the number of bytes a Writer queues before it drops
// lines: a few thousand log lines, a burst the output catches up with.
const DefaultLimit = 1 << 20

// noticeRoom is the room beyond the limit for the writes of the OnDropped
// function, so that the notice of dropped lines is not dropped itself when
// the queue has filled up again.
const noticeRoom = 1024

// Writer queues writes for a goroutine that writes them to the output.
// Each Write is kept or dropped whole (zap writes one entry per call).
// Safe for concurrent use.
type Writer struct {
	out   io.Writer
	limit int

	mu       sync.Mutex
	queue    []byte // waiting to be written
	spare    []byte // the last batch's buffer, for the next queue (nil while it is written)
	closed   bool
	pending  uint64        // lines dropped since the last notice
	noticing bool          // the goroutine is in the OnDropped function
	kick     chan struct{} // wakes the goroutine (capacity 1)
	flushed  *sync.Cond    // signalled when the goroutine has written a batch
	written  uint64        // batches written, for Sync
	queued   uint64        // batches started, for Sync
	done     chan struct{}

	dropped atomic.Uint64 // lines dropped since the start
	notice  atomic.Pointer[func(lines uint64)]
}

// New returns a Writer to out that queues at most limit bytes (DefaultLimit
// if limit ≤ 0), and starts its goroutine; Close stops it.
func New(out io.Writer, limit int) *Writer {
	if limit <= 0 {
		limit = DefaultLimit
	}
	w := &Writer{out: out, limit: limit, kick: make(chan struct{}, 1), done: make(chan struct{})}
	w.flushed = sync.NewCond(&w.mu)
	go w.run()
	return w
}

// OnDropped sets the function the goroutine calls, after the output has
// taken a write again, with the number of lines dropped since the last
// call: typically a log call that writes the notice through this Writer.
func (w *Writer) OnDropped(f func(lines uint64)) { w.notice.Store(&f) }

// Dropped returns the number of lines dropped since the Writer started.
func (w *Writer) Dropped() uint64 { return w.dropped.Load() }

// Write queues a copy of p, or drops it if the queue is full or the Writer
// is closed. It never waits for the output and never fails: a logger has
// nowhere to report a failure to log.
func (w *Writer) Write(p []byte) (int, error) {
	w.mu.Lock()
	room := w.limit
	if w.noticing {
		room += noticeRoom
	}
	if w.closed || len(w.queue)+len(p) > room {
		w.pending++
		w.mu.Unlock()
		w.dropped.Add(1)
		w.wake() // the notice, once the queue is written
		return len(p), nil
	}
	if n := len(w.queue) + len(p); n > cap(w.queue) {
		// Grow within limit+noticeRoom, so that the queue and the batch
		// being written hold at most twice that.
		q := make([]byte, len(w.queue), min(max(2*cap(w.queue), n, 4096), w.limit+noticeRoom))
		copy(q, w.queue)
		w.queue = q
	}
	w.queue = append(w.queue, p...)
	w.mu.Unlock()
	w.wake()
	return len(p), nil
}

// wake makes the goroutine look at the queue.
func (w *Writer) wake() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// Sync waits until what was queued before the call has been written, at
// most timeout, and then syncs the output if it can (an *os.File). It
// reports no error when the output is stalled: the caller (a logger's Sync
// at exit) must not hang on it.
func (w *Writer) Sync() error { return w.SyncTimeout(5 * time.Second) }

// SyncTimeout is Sync with its own bound on the wait.
func (w *Writer) SyncTimeout(timeout time.Duration) error {
	w.mu.Lock()
	target := w.queued
	if len(w.queue) > 0 {
		target++ // the next batch holds what is queued now
	}
	syncx.WaitUntil(w.flushed, timeout, func() bool { return w.written >= target || w.closedAndIdle() })
	ok := w.written >= target
	w.mu.Unlock()
	if s, isSyncer := w.out.(interface{ Sync() error }); ok && isSyncer {
		_ = s.Sync()
	}
	return nil
}

// closedAndIdle reports whether the goroutine has stopped. w.mu held.
func (w *Writer) closedAndIdle() bool {
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

// Close writes what is queued (waiting at most five seconds for the
// output), stops the goroutine and drops later writes.
func (w *Writer) Close() error {
	_ = w.Sync()
	w.mu.Lock()
	w.closed = true
	w.mu.Unlock()
	w.wake()
	return nil
}

func (w *Writer) run() {
	// done first, then the broadcast: a Sync woken by it sees done closed.
	defer w.flushed.Broadcast()
	defer close(w.done)
	for range w.kick {
		for {
			w.mu.Lock()
			if len(w.queue) == 0 {
				// Everything kept is written: report what was dropped.
				lost, f := w.pending, w.notice.Load()
				if lost > 0 && f != nil && !w.closed {
					w.pending = 0
					w.noticing = true
					w.mu.Unlock()
					(*f)(lost)
					w.mu.Lock()
					w.noticing = false
					w.mu.Unlock()
					continue // write the notice
				}
				closed := w.closed
				w.mu.Unlock()
				if closed {
					return
				}
				break
			}
			// The queue becomes the batch; the spare buffer (never the
			// batch's own memory) takes its place.
			batch := w.queue
			w.queue, w.spare = w.spare[:0], nil
			w.queued++
			w.mu.Unlock()

			_, _ = w.out.Write(batch)

			w.mu.Lock()
			w.written++
			w.spare = batch[:0]
			w.mu.Unlock()
			w.flushed.Broadcast()
		}
	}
}
