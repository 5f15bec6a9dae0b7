//go:build linux

package proxy

import (
	"errors"
	"iter"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The relay's scheduler. Once a session is authenticated its two
// directions (client to upstream, upstream to client) run as coroutines
// on an event loop: one OS thread per loop waits for socket readiness with
// epoll and resumes the coroutine that waits on the socket. The relay code
// stays written as blocking reads and writes (loopConn parks the calling
// coroutine instead of blocking), so everything it does — TLS, COPY,
// pipelining, cancel, drain — runs unchanged, but a relayed message costs
// a coroutine switch on the loop's thread instead of a trip through Go's
// scheduler and netpoller (goroutine wake-ups, handoffs between threads),
// which is most of what a goroutine-per-direction relay spends.
//
// The loop makes its socket system calls directly (raw, without telling
// the scheduler: they never block) and waits in epoll_wait through the
// scheduler-aware system call, so that the thread's P can run other
// goroutines while it waits.
//
// Everything a session does once it is on a loop runs on the loop's thread:
// its coroutines, and the functions other goroutines hand it (terminate,
// drain, timers) through post. A coroutine waits for something other than
// its sockets (the other direction's progress, a lock, a timer, a cancel
// request to the upstream) by parking with park, sleep or await, never by
// blocking the thread, which would stall every session on the loop.

// haveEventLoops reports whether the server relays sessions on event loops
// (loop_other.go: not without epoll).
const haveEventLoops = true

// loop is one event loop.
type loop struct {
	ep, efd int
	tid     int // the loop's OS thread
	// now is read once per wake-up (clock reads cost a system call on
	// some VMs); tasks time what they do with it (session.clock).
	now time.Time

	mu      sync.Mutex
	posted  []func()
	woken   bool // efd written and not yet drained
	stopped bool

	// The rest is the loop thread's alone.
	cur      *task
	stopping bool // stop was called: end once no task is left
	ready    []*task
	spare    []*task
	conns    map[int32]*loopConn
	nextID   int32
	events   []unix.EpollEvent
	live     int // tasks not finished
	done     chan struct{}
	yielded  time.Time // the last runtime.Gosched
	yields   int
}

// yieldEvery is how often a busy loop passes through Go's scheduler. The
// loop goroutine never blocks in it otherwise, and to the runtime's
// monitor (sysmon) a goroutine that has not been rescheduled for 10 ms is
// one to preempt: it takes the loop's P away while the loop waits in
// epoll_wait (so the loop must get one back afterwards), and every such
// retake makes the monitor start over polling every 20 µs — a sleep and a
// wake-up each, thousands a second. Yielding a little more often than that
// (a few hand-offs between threads, about a hundred times a second) keeps
// the monitor asleep: at one client, the relay's context switches fell by
// a third and its CPU per transaction by a quarter (pgbench, 2026-12-01).
const yieldEvery = 8 * time.Millisecond

// task is a coroutine on a loop.
type task struct {
	next     func() (struct{}, bool)
	yield    func(struct{}) bool
	queued   bool
	finished bool
	end      func()
}

// wakeID is the epoll data of the loop's eventfd.
const wakeID = 0

func newLoop() (*loop, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		_ = unix.Close(ep)
		return nil, err
	}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, efd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: wakeID}); err != nil {
		_ = unix.Close(ep)
		_ = unix.Close(efd)
		return nil, err
	}
	l := &loop{
		ep: ep, efd: efd,
		conns:  make(map[int32]*loopConn),
		events: make([]unix.EpollEvent, 256),
		done:   make(chan struct{}),
	}
	started := make(chan struct{})
	go l.run(started)
	<-started
	return l, nil
}

// onLoop reports whether the caller runs on the loop's thread: the loop
// goroutine and its coroutines are locked to it, so no other goroutine
// ever does.
func (l *loop) onLoop() bool { return unix.Gettid() == l.tid }

// post has f run on the loop's thread, from any goroutine. f must not
// block; to park, it spawns a task.
func (l *loop) post(f func()) {
	l.mu.Lock()
	if l.stopped {
		l.mu.Unlock()
		return
	}
	l.posted = append(l.posted, f)
	wake := !l.woken
	l.woken = true
	l.mu.Unlock()
	if wake {
		one := uint64(1)
		_, _ = unix.Write(l.efd, (*[8]byte)(unsafe.Pointer(&one))[:])
	}
}

// stop ends the loop once the functions posted before it have run and its
// tasks have finished (a terminate may still be waiting out its bounds),
// and waits for its goroutine to exit. The sessions on it must have ended.
func (l *loop) stop() {
	l.post(func() { l.stopping = true })
	<-l.done
}

// spawn starts body as a task; end, if not nil, runs on the loop once body
// has returned. Loop thread only.
func (l *loop) spawn(body func(), end func()) {
	t := &task{end: end}
	l.live++
	t.next, _ = iter.Pull(func(yield func(struct{}) bool) {
		t.yield = yield
		body()
	})
	l.makeReady(t)
}

// goTask has f run as a task, from any goroutine.
func (l *loop) goTask(f func()) {
	if l.onLoop() {
		l.spawn(f, nil)
		return
	}
	l.post(func() { l.spawn(f, nil) })
}

// makeReady queues t to be resumed. Loop thread only.
func (l *loop) makeReady(t *task) {
	if t.queued || t.finished {
		return
	}
	t.queued = true
	l.ready = append(l.ready, t)
}

// wake queues t to be resumed, from any goroutine.
func (l *loop) wake(t *task) {
	if l.onLoop() {
		l.makeReady(t)
		return
	}
	l.post(func() { l.makeReady(t) })
}

// checkLoopThread has current and inTask also check the calling thread (a
// system call each): they panic off the loop's thread. The tests turn it
// on; in production l.cur alone is read.
var checkLoopThread = false

// inTask reports whether the caller is a task of l (rather than a
// function posted to it), for relay code of a session on l, which runs on
// l's thread only: cheaper than onLoop (no system call). Under test it
// panics when called from another thread.
func (l *loop) inTask() bool {
	if checkLoopThread && !l.onLoop() {
		panic("proxy: a looped session's relay code ran off its loop")
	}
	return l.cur != nil
}

// current returns the running task. It panics outside of one: a wait on
// the loop's thread that is not in a task would stall the loop for good.
func (l *loop) current() *task {
	if l.cur == nil || (checkLoopThread && !l.onLoop()) {
		panic("proxy: a relay coroutine wait outside of a loop task")
	}
	return l.cur
}

// park suspends t, the running task (from current), until something makes
// it ready. Callers check their condition again when it returns: wake-ups
// may be spurious.
func (t *task) park() { t.yield(struct{}{}) }

// sleep parks the running task for d.
func (l *loop) sleep(d time.Duration) {
	l.parkUntil(func(signal func()) { time.AfterFunc(d, signal) })
}

// await runs f in a goroutine of its own and parks the running task until
// it returns: for what must block (network round trips of its own).
func (l *loop) await(f func()) {
	l.parkUntil(func(signal func()) {
		go func() {
			f()
			signal()
		}()
	})
}

// parkUntil parks the running task until the signal that start was given
// is called, once, from any goroutine.
func (l *loop) parkUntil(start func(signal func())) {
	t := l.current()
	done := false // the loop thread's
	start(func() {
		l.post(func() {
			done = true
			l.makeReady(t)
		})
	})
	for !done {
		t.park()
	}
}

func (l *loop) resume(t *task) {
	t.queued = false
	if t.finished {
		return
	}
	l.cur = t
	_, ok := t.next()
	l.cur = nil
	if !ok {
		t.finished = true
		l.live--
		if t.end != nil {
			t.end()
		}
	}
}

func (l *loop) run(started chan<- struct{}) {
	runtime.LockOSThread()
	l.tid = unix.Gettid()
	l.now = time.Now()
	close(started)
	defer func() {
		// Unlocked, not ended with the loop: the thread may be the one
		// that started a child with a parent-death signal (Pdeathsig is
		// tied to the thread).
		runtime.UnlockOSThread()
		l.mu.Lock()
		l.stopped = true // posts are dropped from now on
		l.mu.Unlock()
		_ = unix.Close(l.ep)
		_ = unix.Close(l.efd)
		close(l.done)
	}()
	for {
		for len(l.ready) > 0 {
			ready := l.ready
			l.ready = l.spare
			for i, t := range ready {
				ready[i] = nil
				l.resume(t)
			}
			l.spare = ready[:0]
		}
		if l.stopping && l.live == 0 {
			return
		}
		n := l.wait()
		l.now = time.Now()
		if l.now.Sub(l.yielded) > yieldEvery {
			// Through the scheduler once in a while: see yieldEvery.
			l.yielded = l.now
			l.yields++
			runtime.Gosched()
		}
		for i := range n {
			ev := &l.events[i]
			if ev.Fd == wakeID {
				l.drainPosted()
				continue
			}
			c := l.conns[ev.Fd]
			if c == nil {
				continue
			}
			if ev.Events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
				c.drained = false
				if ev.Events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
					c.hup = true
				}
				if c.reader != nil {
					l.makeReady(c.reader)
				}
			}
			if ev.Events&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) != 0 && c.writer != nil {
				l.makeReady(c.writer)
			}
		}
	}
}

// drainPosted runs the posted functions.
func (l *loop) drainPosted() {
	var b [8]byte
	_, _ = rawRead(l.efd, b[:])
	l.mu.Lock()
	fns := l.posted
	l.posted = nil
	l.woken = false
	l.mu.Unlock()
	for _, f := range fns {
		f()
	}
}

// wait returns the number of events in l.events: at once if some are
// pending, else after blocking until one comes. It always goes through the
// scheduler-aware system call: a raw poll with a zero timeout first, to skip
// the scheduler's bookkeeping when events are already there, found nothing
// at one client (the answer comes later than the loop's work on the
// request) and so cost a system call per wake-up — 2–4 µs of CPU per
// transaction on this VM — and saved nothing measurable at eight
// (pgbench -S, side by side, 2026-12-01).
func (l *loop) wait() int {
	ev := unsafe.Pointer(&l.events[0])
	n, _, e := unix.Syscall6(unix.SYS_EPOLL_PWAIT, uintptr(l.ep), uintptr(ev), uintptr(len(l.events)), ^uintptr(0), 0, 0)
	if e != 0 {
		if e != unix.EINTR {
			// EBADF, EFAULT, EINVAL: a bug; do not spin on it.
			panic(errors.New("proxy: epoll_wait: " + e.Error()))
		}
		return 0
	}
	return int(n)
}

// register adds c to the loop's epoll set. Loop thread only.
func (l *loop) register(c *loopConn) error {
	for {
		l.nextID++
		if l.nextID <= wakeID {
			l.nextID = wakeID + 1
		}
		if l.conns[l.nextID] == nil {
			break
		}
	}
	c.id = l.nextID
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: c.id}
	if err := unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, c.fd, &ev); err != nil {
		return err
	}
	l.conns[c.id] = c
	return nil
}

func rawRead(fd int, p []byte) (int, unix.Errno) {
	n, _, e := unix.RawSyscall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(n), e
}

func rawSend(fd int, p []byte) (int, unix.Errno) {
	n, _, e := unix.RawSyscall6(unix.SYS_SENDTO, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)), unix.MSG_NOSIGNAL, 0, 0)
	return int(n), e
}
