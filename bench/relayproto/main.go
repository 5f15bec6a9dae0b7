//go:build linux

// Command relayproto is a measuring prototype, not part of fenceproxy: the
// cheapest relays Go can build, to tell how much of fenceproxy's relay cost
// is the goroutine-per-direction model itself. It forwards bytes between
// each client and a new upstream connection and understands nothing of the
// protocol (no parsing, no fencing, no TLS, no cancel).
//
//	-mode copy:  two goroutines per connection, each an io.Copy (the model
//	             fenceproxy's relay used before its event loops, minus
//	             everything it does)
//	-mode epoll: one OS thread running an epoll loop over non-blocking
//	             sockets (golang.org/x/sys/unix), as PgBouncer does with
//	             libevent
//	-mode raw:   the same loop making its system calls without telling
//	             Go's scheduler (raw syscalls; epoll_wait with a 10 ms
//	             timeout, so that a garbage collection's stop-the-world
//	             never waits long for the loop)
//
// bench/main.go starts the raw and copy modes beside fenceproxy and
// PgBouncer and prints their throughput and CPU per transaction in the
// select-only table (epoll mode, close to what fenceproxy's loop now does,
// is left to run by hand).
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	upstream := flag.String("upstream", "", "PostgreSQL address (host:port)")
	mode := flag.String("mode", "epoll", "copy or epoll")
	flag.Parse()
	var err error
	switch *mode {
	case "copy":
		err = runCopy(*listen, *upstream)
	case "epoll":
		err = runEpoll(*listen, *upstream, false)
	case "raw":
		err = runEpoll(*listen, *upstream, true)
	default:
		err = fmt.Errorf("unknown -mode %q", *mode)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "relayproto:", err)
		os.Exit(1)
	}
}

func runCopy(listen, upstream string) error {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		go func() {
			u, err := net.Dial("tcp", upstream)
			if err != nil {
				c.Close()
				return
			}
			go func() { _, _ = io.Copy(u, c); u.Close() }()
			_, _ = io.Copy(c, u)
			c.Close()
		}()
	}
}

// side is one socket of a relayed pair.
type side struct {
	fd      int
	peer    *side
	pending []byte // read from peer, not yet written to fd
}

// The system calls of the loop: through the scheduler, or raw.
type calls struct {
	wait  func(ep int, events []unix.EpollEvent) (int, error)
	read  func(fd int, p []byte) (int, error)
	write func(fd int, p []byte) (int, error)
}

var schedCalls = calls{
	wait:  func(ep int, ev []unix.EpollEvent) (int, error) { return unix.EpollWait(ep, ev, -1) },
	read:  unix.Read,
	write: unix.Write,
}

var rawCalls = calls{
	wait: func(ep int, ev []unix.EpollEvent) (int, error) {
		n, _, e := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(ep), uintptr(unsafe.Pointer(&ev[0])), uintptr(len(ev)), 10, 0, 0)
		return int(n), errnoErr(e)
	},
	read: func(fd int, p []byte) (int, error) {
		n, _, e := unix.RawSyscall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
		return int(n), errnoErr(e)
	},
	write: func(fd int, p []byte) (int, error) {
		n, _, e := unix.RawSyscall(unix.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
		return int(n), errnoErr(e)
	},
}

func errnoErr(e unix.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

func runEpoll(listen, upstream string, raw bool) error {
	sys := schedCalls
	if raw {
		sys = rawCalls
	}
	runtime.LockOSThread()
	laddr, err := sockaddr(listen)
	if err != nil {
		return err
	}
	uaddr, err := sockaddr(upstream)
	if err != nil {
		return err
	}
	lfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	_ = unix.SetsockoptInt(lfd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	if err := unix.Bind(lfd, laddr); err != nil {
		return err
	}
	if err := unix.Listen(lfd, 1024); err != nil {
		return err
	}
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return err
	}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, lfd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(lfd)}); err != nil {
		return err
	}
	sides := map[int]*side{}
	buf := make([]byte, 64<<10)
	events := make([]unix.EpollEvent, 128)

	closePair := func(s *side) {
		for _, x := range []*side{s, s.peer} {
			if _, ok := sides[x.fd]; ok {
				delete(sides, x.fd)
				_ = unix.Close(x.fd) // also leaves the epoll set
			}
		}
	}
	// watch sets what the loop waits for on s: its input while its peer
	// has nothing pending, its output while it has.
	watch := func(s *side, ev uint32) {
		_ = unix.EpollCtl(ep, unix.EPOLL_CTL_MOD, s.fd, &unix.EpollEvent{Events: ev, Fd: int32(s.fd)})
	}
	// send writes p to s, keeping what the socket does not take.
	send := func(s *side, p []byte) error {
		for len(p) > 0 {
			n, err := sys.write(s.fd, p)
			if errors.Is(err, unix.EAGAIN) {
				s.pending = append(s.pending[:0], p...)
				watch(s, unix.EPOLLOUT)
				watch(s.peer, 0) // stop reading until s drains
				return nil
			}
			if err != nil {
				return err
			}
			p = p[n:]
		}
		return nil
	}
	for {
		n, err := sys.wait(ep, events)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		for _, ev := range events[:n] {
			fd := int(ev.Fd)
			if fd == lfd {
				for {
					cfd, _, err := unix.Accept4(lfd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
					if err != nil {
						break
					}
					ufd, err := dialBlocking(uaddr)
					if err != nil {
						_ = unix.Close(cfd)
						continue
					}
					_ = unix.SetsockoptInt(cfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
					c, u := &side{fd: cfd}, &side{fd: ufd}
					c.peer, u.peer = u, c
					sides[cfd], sides[ufd] = c, u
					_ = unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, cfd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(cfd)})
					_ = unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, ufd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(ufd)})
				}
				continue
			}
			s, ok := sides[fd]
			if !ok {
				continue
			}
			if ev.Events&unix.EPOLLOUT != 0 && len(s.pending) > 0 {
				p := s.pending
				s.pending = nil
				if err := send(s, p); err != nil {
					closePair(s)
					continue
				}
				if len(s.pending) == 0 {
					watch(s, unix.EPOLLIN)
					watch(s.peer, unix.EPOLLIN)
				}
				continue
			}
			if ev.Events&(unix.EPOLLIN|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
				r, err := sys.read(fd, buf)
				if errors.Is(err, unix.EAGAIN) {
					continue
				}
				if err != nil || r == 0 {
					closePair(s)
					continue
				}
				if err := send(s.peer, buf[:r]); err != nil {
					closePair(s)
				}
			}
		}
	}
}

// dialBlocking connects to addr (a local PostgreSQL: the connect is quick),
// then makes the socket non-blocking.
func dialBlocking(addr unix.Sockaddr) (int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if err := unix.Connect(fd, addr); err != nil {
		_ = unix.Close(fd)
		return -1, err
	}
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	if err := unix.SetNonblock(fd, true); err != nil {
		_ = unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

func sockaddr(hostport string) (unix.Sockaddr, error) {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, err
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return nil, err
	}
	ip := net.ParseIP(host).To4()
	if ip == nil {
		return nil, fmt.Errorf("%s: IPv4 addresses only", hostport)
	}
	sa := &unix.SockaddrInet4{Port: p}
	copy(sa.Addr[:], ip)
	return sa, nil
}
