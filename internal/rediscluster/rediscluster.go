// Package rediscluster runs a throwaway redis-server on a free 127.0.0.1
// port, for tests and the demo.
//
// Start runs the redis-server binary ($FENCEPROXY_REDIS_SERVER, then PATH,
// then /usr/bin) in the foreground with its data in a fresh temporary
// directory, and returns once it answers PING. Persistence is off unless
// Options.AppendFsync asks for an append-only file; Crash and Restart let a
// test lose (or keep) what the server held. The package never imports
// "testing"; see redistest for the test helper. A missing binary is an
// error wrapping ErrNotInstalled: callers report it, they do not skip.
package rediscluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// BinaryEnv names the environment variable that overrides where
// redis-server is found.
const BinaryEnv = "FENCEPROXY_REDIS_SERVER"

// ErrNotInstalled is wrapped by Start's error when there is no
// redis-server binary.
var ErrNotInstalled = errors.New("rediscluster: redis-server not found (apt-get install redis-server, or set " + BinaryEnv + ")")

// Options configures Start. The zero value is a server without
// persistence.
type Options struct {
	// AppendFsync turns the append-only file on with this appendfsync
	// policy: "always", "everysec" or "no". Empty (default): no AOF and
	// no RDB snapshots, so a restart loses everything.
	AppendFsync string
	// Args are extra redis-server settings as "name value" pairs, e.g.
	// {"maxmemory-policy", "noeviction"}.
	Args []string
	// Logf receives progress lines. Default (nil): silent.
	Logf func(format string, args ...any)
}

const (
	host          = "127.0.0.1"
	startTimeout  = 15 * time.Second
	stopTimeout   = 10 * time.Second
	startAttempts = 5
)

// Server is a redis-server process (running or stopped) with its data
// directory. Its methods are safe for concurrent use.
type Server struct {
	bin  string
	dir  string
	port int
	opts Options

	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{}
	stopped bool
}

// Start starts a server and waits until it answers PING; ctx bounds the
// start-up. The caller must call Stop.
func Start(ctx context.Context, opts Options) (*Server, error) {
	switch opts.AppendFsync {
	case "", "always", "everysec", "no":
	default:
		return nil, fmt.Errorf("rediscluster: appendfsync %q (want always, everysec or no)", opts.AppendFsync)
	}
	if len(opts.Args)%2 != 0 {
		return nil, fmt.Errorf("rediscluster: Args must be name value pairs, got %q", opts.Args)
	}
	bin, err := findBinary()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "fenceproxy-redis-")
	if err != nil {
		return nil, fmt.Errorf("rediscluster: %w", err)
	}
	s := &Server{bin: bin, dir: dir, opts: opts}
	for attempt := 1; ; attempt++ {
		s.port, err = freePort()
		if err == nil {
			s.mu.Lock()
			err = s.launchLocked(ctx)
			s.mu.Unlock()
		}
		if err == nil {
			s.logf("rediscluster: redis-server pid %d on %s", s.PID(), s.Addr())
			return s, nil
		}
		if !errors.Is(err, errAddrInUse) || attempt == startAttempts {
			os.RemoveAll(dir)
			return nil, err
		}
	}
}

var errAddrInUse = errors.New("rediscluster: port in use")

func (s *Server) args() []string {
	a := []string{
		"--bind", host,
		"--port", strconv.Itoa(s.port),
		"--dir", s.dir,
		"--logfile", "redis.log",
		"--daemonize", "no",
		"--protected-mode", "no",
		"--save", "",
	}
	if s.opts.AppendFsync != "" {
		a = append(a, "--appendonly", "yes", "--appendfsync", s.opts.AppendFsync)
	} else {
		a = append(a, "--appendonly", "no")
	}
	for i := 0; i+1 < len(s.opts.Args); i += 2 {
		a = append(a, "--"+s.opts.Args[i], s.opts.Args[i+1])
	}
	return a
}

func (s *Server) launchLocked(ctx context.Context) error {
	logFile := filepath.Join(s.dir, "redis.log")
	var offset int64
	if fi, err := os.Stat(logFile); err == nil {
		offset = fi.Size()
	}
	cmd := exec.Command(s.bin, s.args()...)
	cmd.Dir = s.dir
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("rediscluster: start %s: %w", s.bin, err)
	}
	exited := make(chan struct{})
	go func() {
		cmd.Wait() //nolint:errcheck // the exit is reported through the log
		close(exited)
	}()
	s.cmd, s.exited = cmd, exited
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	for {
		if err := ping(ctx, s.Addr()); err == nil {
			return nil
		}
		select {
		case <-exited:
			tail := s.logTail(logFile, offset)
			if strings.Contains(tail, "Address already in use") {
				return errAddrInUse
			}
			return fmt.Errorf("rediscluster: redis-server exited during start-up; log:\n%s", tail)
		case <-ctx.Done():
			s.killLocked()
			return fmt.Errorf("rediscluster: redis-server on %s: %w; log:\n%s", s.Addr(), ctx.Err(), s.logTail(logFile, offset))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// ping sends an inline PING and expects +PONG, or -NOAUTH from a server
// with requirepass, which is up all the same.
func ping(ctx context.Context, addr string) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second)) //nolint:errcheck // a fresh conn
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if !strings.HasPrefix(line, "+PONG") && !strings.HasPrefix(line, "-NOAUTH") {
		return fmt.Errorf("rediscluster: PING answered %q", strings.TrimSpace(line))
	}
	return nil
}

func (s *Server) killLocked() {
	if s.cmd == nil {
		return
	}
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	<-s.exited
	s.cmd = nil
}

// Crash kills the server with SIGKILL: whatever was not yet in the
// append-only file is lost, and without AOF everything is.
func (s *Server) Crash() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLocked()
}

// Restart starts the server again on the same port after Crash (or kills
// and restarts it if it is running), with the same data directory: it
// comes back with what its append-only file held, or empty.
func (s *Server) Restart(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return errors.New("rediscluster: server stopped")
	}
	s.killLocked()
	var err error
	for attempt := 1; attempt <= startAttempts; attempt++ {
		if err = s.launchLocked(ctx); !errors.Is(err, errAddrInUse) {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
	return err
}

// Stop shuts the server down (SIGTERM, then SIGKILL after a timeout) and
// removes its directory. It is idempotent.
func (s *Server) Stop() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return nil
	}
	s.stopped = true
	if s.cmd != nil {
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.exited:
			s.cmd = nil
		case <-time.After(stopTimeout):
			s.killLocked()
		}
	}
	if err := os.RemoveAll(s.dir); err != nil {
		return fmt.Errorf("rediscluster: %w", err)
	}
	return nil
}

// Addr returns "127.0.0.1:PORT"; it does not change across Restart.
func (s *Server) Addr() string { return net.JoinHostPort(host, strconv.Itoa(s.port)) }

// URL returns "redis://127.0.0.1:PORT/0".
func (s *Server) URL() string { return "redis://" + s.Addr() + "/0" }

// Dir returns the data directory.
func (s *Server) Dir() string { return s.dir }

// PID returns the process id, or 0 while the server is not running.
func (s *Server) PID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return 0
	}
	return s.cmd.Process.Pid
}

func (s *Server) logf(format string, args ...any) {
	if s.opts.Logf != nil {
		s.opts.Logf(format, args...)
	}
}

func (s *Server) logTail(path string, offset int64) string {
	data, err := os.ReadFile(path)
	if err != nil || int64(len(data)) < offset {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(data[offset:]), "\n"), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return strings.Join(lines, "\n") + "\n"
}

func findBinary() (string, error) {
	if p := os.Getenv(BinaryEnv); p != "" {
		return p, nil
	}
	if p, err := exec.LookPath("redis-server"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/bin/redis-server"); err == nil {
		return "/usr/bin/redis-server", nil
	}
	return "", ErrNotInstalled
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, fmt.Errorf("rediscluster: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
