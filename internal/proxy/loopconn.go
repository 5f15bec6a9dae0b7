//go:build linux

package proxy

import (
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// loopConn is a socket owned by a loop: a net.Conn for the relay's tasks,
// whose reads and writes park the calling task until the socket is ready
// instead of blocking. Only the loop's tasks may use it, except Close,
// which any goroutine may call.
type loopConn struct {
	l            *loop
	fd           int
	id           int32
	laddr, raddr net.Addr
	closing      atomic.Bool

	// The loop thread's alone:
	reader, writer *task // parked until the socket is readable, writable
	// drained: the last read took less than it asked for, so the socket
	// was empty then, and edge-triggered epoll will report new bytes; the
	// next read parks first instead of making a system call that would
	// find nothing (one per relayed message). Cleared by readiness events.
	drained bool
	// hup: the peer closed or the socket failed; a read will not block
	// (no new edge would come for it), so drained is not trusted.
	hup      bool
	released bool
	rd, wd   connDeadline
}

// connDeadline is a read or write deadline of a loopConn.
type connDeadline struct {
	timer   *time.Timer
	gen     uint64
	expired bool
}

// detach takes the socket of c (a *net.TCPConn or *net.UnixConn) out of Go's
// netpoller and returns a loopConn for it, to be registered on l. c is
// closed; the socket lives on in the returned descriptor.
func detach(l *loop, c net.Conn) (*loopConn, error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil, errors.New("proxy: connection has no socket")
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil, err
	}
	fd := -1
	var derr error
	if err := rc.Control(func(s uintptr) {
		fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, derr
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		_ = unix.Close(fd)
		return nil, err
	}
	return &loopConn{l: l, fd: fd, laddr: c.LocalAddr(), raddr: c.RemoteAddr()}, nil
}

func (c *loopConn) opError(op string, err error) error {
	return &net.OpError{Op: op, Net: c.laddr.Network(), Source: c.laddr, Addr: c.raddr, Err: err}
}

func (c *loopConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for {
		if c.closing.Load() {
			return 0, c.opError("read", net.ErrClosed)
		}
		if c.rd.expired {
			return 0, c.opError("read", os.ErrDeadlineExceeded)
		}
		if c.drained && !c.hup {
			c.waitFor(&c.reader)
			c.drained = false
			continue
		}
		n, e := rawRead(c.fd, p)
		switch e {
		case 0:
			if n == 0 {
				return 0, io.EOF
			}
			c.drained = n < len(p)
			return n, nil
		case unix.EINTR:
		case unix.EAGAIN:
			c.waitFor(&c.reader)
		default:
			return 0, c.opError("read", os.NewSyscallError("read", e))
		}
	}
}

func (c *loopConn) Write(p []byte) (int, error) {
	total := 0
	for len(p) > 0 {
		if c.closing.Load() {
			return total, c.opError("write", net.ErrClosed)
		}
		if c.wd.expired {
			return total, c.opError("write", os.ErrDeadlineExceeded)
		}
		n, e := rawSend(c.fd, p)
		switch e {
		case 0:
			total += n
			p = p[n:]
		case unix.EINTR:
		case unix.EAGAIN:
			c.waitFor(&c.writer)
		default:
			return total, c.opError("write", os.NewSyscallError("write", e))
		}
	}
	return total, nil
}

// waitFor parks the running task in *slot until the loop reports the
// socket ready, a deadline passes or the connection is closed.
func (c *loopConn) waitFor(slot **task) {
	t := c.l.current()
	*slot = t
	t.park()
	if *slot == t {
		*slot = nil
	}
}

// Close closes the connection; the tasks parked on it wake up with
// net.ErrClosed. The descriptor is closed on the loop, once it has left the
// epoll set, so that its number cannot be reused while the loop knows it.
func (c *loopConn) Close() error {
	if c.closing.Swap(true) {
		return c.opError("close", net.ErrClosed)
	}
	c.l.post(c.release)
	return nil
}

func (c *loopConn) release() {
	if c.released {
		return
	}
	c.released = true
	if c.id != 0 {
		_ = unix.EpollCtl(c.l.ep, unix.EPOLL_CTL_DEL, c.fd, nil)
		delete(c.l.conns, c.id)
	}
	_ = unix.Close(c.fd)
	for _, d := range []*connDeadline{&c.rd, &c.wd} {
		if d.timer != nil {
			d.timer.Stop()
		}
	}
	c.wakeAll()
}

func (c *loopConn) wakeAll() {
	if c.reader != nil {
		c.l.makeReady(c.reader)
	}
	if c.writer != nil {
		c.l.makeReady(c.writer)
	}
}

func (c *loopConn) LocalAddr() net.Addr  { return c.laddr }
func (c *loopConn) RemoteAddr() net.Addr { return c.raddr }

func (c *loopConn) SetDeadline(t time.Time) error {
	c.setDeadline(&c.rd, &c.reader, t)
	c.setDeadline(&c.wd, &c.writer, t)
	return nil
}

func (c *loopConn) SetReadDeadline(t time.Time) error {
	c.setDeadline(&c.rd, &c.reader, t)
	return nil
}

func (c *loopConn) SetWriteDeadline(t time.Time) error {
	c.setDeadline(&c.wd, &c.writer, t)
	return nil
}

// setDeadline sets d (loop thread only): when t passes, the task parked
// in *waiter wakes up and its read or write fails with a timeout.
func (c *loopConn) setDeadline(d *connDeadline, waiter **task, t time.Time) {
	if !c.l.onLoop() {
		panic("proxy: loopConn deadline set outside of its loop")
	}
	d.gen++
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	d.expired = false
	if t.IsZero() {
		return
	}
	wait := time.Until(t)
	if wait <= 0 {
		d.expired = true
		if *waiter != nil {
			c.l.makeReady(*waiter)
		}
		return
	}
	gen := d.gen
	d.timer = time.AfterFunc(wait, func() {
		c.l.post(func() {
			if d.gen != gen {
				return
			}
			d.expired = true
			if *waiter != nil {
				c.l.makeReady(*waiter)
			}
		})
	})
}
