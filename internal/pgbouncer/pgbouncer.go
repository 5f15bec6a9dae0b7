// Package pgbouncer runs a throwaway PgBouncer in front of a PostgreSQL
// server, for tests that need a real connection pooler (transaction or
// statement pooling moves a client's transactions between server
// connections, which is what fenceproxy must survive).
//
// Run writes pgbouncer.ini and an auth file into a fresh temporary
// directory, starts the pgbouncer binary on a free 127.0.0.1 port (no Unix
// socket) and returns once the port accepts connections. Start and
// StartOptions do the same for a test and stop it when the test ends; a
// missing binary fails the test, it never skips (but under -short, the
// fast lane, they skip the test without starting anything). PgBouncer refuses to run
// as root, so when the process is root it runs as the "postgres" OS user.
// The binary is found as $FENCEPROXY_PGBOUNCER, then on PATH, then in
// /usr/sbin.
package pgbouncer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// BinaryEnv names the environment variable that overrides where the
// pgbouncer binary is found.
const BinaryEnv = "FENCEPROXY_PGBOUNCER"

// ErrNotInstalled is wrapped by Run's error when there is no pgbouncer
// binary.
var ErrNotInstalled = errors.New("pgbouncer: binary not found (apt-get install pgbouncer, or set " + BinaryEnv + ")")

// Options configures a PgBouncer. The zero value is transaction pooling
// with a pool of 2 server connections per user and database, trust
// authentication for the user "postgres", and the startup parameters
// options and extra_float_digits ignored.
type Options struct {
	// PoolMode is pool_mode: "session", "transaction" or "statement".
	// Default "transaction".
	PoolMode string
	// PoolSize is default_pool_size, the server connections per user and
	// database pair. Default 2.
	PoolSize int
	// MaxClientConn is max_client_conn. Default 200.
	MaxClientConn int
	// IgnoreStartupParameters is ignore_startup_parameters: startup
	// parameters PgBouncer accepts from clients and does not pass on (it
	// refuses any other it does not track). Nil means options and
	// extra_float_digits (pgx sends extra_float_digits, libpq's PGOPTIONS
	// sends options); an empty non-nil slice ignores none.
	IgnoreStartupParameters []string
	// MaxPreparedStatements is max_prepared_statements (PgBouncer 1.21 and
	// later: prepared statements tracked across server connections in
	// transaction mode). Zero leaves PgBouncer's default and writes
	// nothing; a negative value writes 0 (off). PgBouncer before 1.21
	// refuses to start with the setting (see Version).
	MaxPreparedStatements int
	// AuthType is auth_type: "trust" (default; user names must be in
	// Users) or "any" (any user name, every database connects as
	// ServerUser).
	AuthType string
	// Users are the user names the auth file lists, with no password.
	// Default ["postgres"]. Ignored by auth_type any.
	Users []string
	// ServerUser is the user the server connections log in as with
	// auth_type any. Default "postgres".
	ServerUser string
	// Settings are extra [pgbouncer] settings, written last so they
	// override the ones above (e.g. "server_lifetime": "0",
	// "server_reset_query_always": "1"). listen_addr, listen_port,
	// unix_socket_dir, logfile and auth_file cannot be set here.
	Settings map[string]string
	// Logf receives progress lines. Default (nil): silent.
	Logf func(format string, args ...any)
}

// Server is a running PgBouncer. Its methods are safe for concurrent use.
type Server struct {
	dir     string
	logFile string
	port    int
	opts    Options

	stopOnce sync.Once
	stopErr  error
	cmd      *exec.Cmd
	done     chan struct{} // closed when the process has been reaped
}

const (
	host          = "127.0.0.1"
	serverOSUser  = "postgres"
	startTimeout  = 15 * time.Second
	stopTimeout   = 10 * time.Second
	startAttempts = 5
	logTailLines  = 20
)

// Start starts a PgBouncer for t in front of upstream ("host:port") with
// the given pool_mode and default_pool_size and the other defaults of
// Options, and stops it when t and its subtests finish.
func Start(t testing.TB, upstream, poolMode string, poolSize int) *Server {
	t.Helper()
	return StartOptions(t, upstream, Options{PoolMode: poolMode, PoolSize: poolSize})
}

// StartOptions is Start with every option. A nil opts.Logf is replaced by
// t.Logf.
func StartOptions(t testing.TB, upstream string, opts Options) *Server {
	t.Helper()
	testutil.SkipSystem(t, "PgBouncer")
	if opts.Logf == nil {
		opts.Logf = t.Logf
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	s, err := Run(ctx, upstream, opts)
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("stop pgbouncer: %v", err)
		}
	})
	return s
}

// Run starts a PgBouncer in front of upstream ("host:port") and waits until
// it accepts connections; ctx bounds the start-up only. The caller must
// call Stop. On error nothing is left behind.
func Run(ctx context.Context, upstream string, opts Options) (*Server, error) {
	uhost, uport, err := net.SplitHostPort(upstream)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: upstream %q: %w", upstream, err)
	}
	if opts.PoolMode == "" {
		opts.PoolMode = "transaction"
	}
	switch opts.PoolMode {
	case "session", "transaction", "statement":
	default:
		return nil, fmt.Errorf("pgbouncer: pool mode %q (want session, transaction or statement)", opts.PoolMode)
	}
	if opts.PoolSize == 0 {
		opts.PoolSize = 2
	}
	if opts.MaxClientConn == 0 {
		opts.MaxClientConn = 200
	}
	if opts.IgnoreStartupParameters == nil {
		opts.IgnoreStartupParameters = []string{"options", "extra_float_digits"}
	}
	if opts.AuthType == "" {
		opts.AuthType = "trust"
	}
	if opts.AuthType != "trust" && opts.AuthType != "any" {
		return nil, fmt.Errorf("pgbouncer: auth type %q (want trust or any)", opts.AuthType)
	}
	if len(opts.Users) == 0 {
		opts.Users = []string{"postgres"}
	}
	if opts.ServerUser == "" {
		opts.ServerUser = "postgres"
	}
	for k := range opts.Settings {
		switch k {
		case "listen_addr", "listen_port", "unix_socket_dir", "logfile", "auth_file", "pidfile":
			return nil, fmt.Errorf("pgbouncer: setting %s is the harness's", k)
		}
	}
	bin, err := findBinary()
	if err != nil {
		return nil, err
	}
	ra, err := lookupRunAs()
	if err != nil {
		return nil, err
	}
	// The server user must be able to reach the directory: os.TempDir may
	// be private to root, /tmp is not.
	base := os.TempDir()
	if ra != nil {
		base = "/tmp"
	}
	dir, err := os.MkdirTemp(base, "fenceproxy-pgbouncer-")
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: %w", err)
	}
	s := &Server{dir: dir, logFile: filepath.Join(dir, "pgbouncer.log"), opts: opts}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(dir)
		}
	}()
	if err := ra.chown(dir); err != nil {
		return nil, err
	}
	authFile := filepath.Join(dir, "users.txt")
	var users strings.Builder
	for _, u := range opts.Users {
		fmt.Fprintf(&users, "%q \"\"\n", u)
	}
	if err := writeFile(ra, authFile, users.String()); err != nil {
		return nil, err
	}
	for attempt := 1; ; attempt++ {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		s.port = port
		ini := s.ini(uhost, uport, authFile)
		if err := writeFile(ra, filepath.Join(dir, "pgbouncer.ini"), ini); err != nil {
			return nil, err
		}
		err = s.launch(ctx, bin, ra)
		if err == nil {
			ok = true
			s.logf("pgbouncer: %s pooling on %s in front of %s", opts.PoolMode, s.Addr(), upstream)
			return s, nil
		}
		if !errors.Is(err, errAddrInUse) || attempt == startAttempts {
			return nil, err
		}
		s.logf("pgbouncer: port %d is taken, retrying", port)
	}
}

// ini is the configuration file for the current port.
func (s *Server) ini(uhost, uport, authFile string) string {
	o := s.opts
	var b strings.Builder
	b.WriteString("[databases]\n")
	if o.AuthType == "any" {
		fmt.Fprintf(&b, "* = host=%s port=%s user=%s\n", uhost, uport, o.ServerUser)
	} else {
		fmt.Fprintf(&b, "* = host=%s port=%s\n", uhost, uport)
	}
	b.WriteString("[pgbouncer]\n")
	set := func(k, v string) { fmt.Fprintf(&b, "%s = %s\n", k, v) }
	set("listen_addr", host)
	set("listen_port", strconv.Itoa(s.port))
	set("unix_socket_dir", "")
	set("logfile", s.logFile)
	set("auth_type", o.AuthType)
	set("auth_file", authFile)
	// The admin console (database "pgbouncer") answers SHOW POOLS,
	// SHOW SERVERS, RECONNECT… for tests that look inside the pooler.
	set("admin_users", strings.Join(o.Users, ","))
	set("stats_users", strings.Join(o.Users, ","))
	set("pool_mode", o.PoolMode)
	set("default_pool_size", strconv.Itoa(o.PoolSize))
	set("max_client_conn", strconv.Itoa(o.MaxClientConn))
	set("ignore_startup_parameters", strings.Join(o.IgnoreStartupParameters, ","))
	switch {
	case o.MaxPreparedStatements > 0:
		set("max_prepared_statements", strconv.Itoa(o.MaxPreparedStatements))
	case o.MaxPreparedStatements < 0:
		set("max_prepared_statements", "0")
	}
	keys := make([]string, 0, len(o.Settings))
	for k := range o.Settings {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		set(k, o.Settings[k])
	}
	return b.String()
}

// errAddrInUse marks a PgBouncer that could not bind its port.
var errAddrInUse = errors.New("pgbouncer: port already in use")

// launch starts the process and waits for its port; on failure the
// process is gone when it returns.
func (s *Server) launch(ctx context.Context, bin string, ra *runAs) error {
	logStart := int64(0)
	if fi, err := os.Stat(s.logFile); err == nil {
		logStart = fi.Size()
	}
	cmd := exec.Command(bin, "-q", filepath.Join(s.dir, "pgbouncer.ini"))
	cmd.Dir = s.dir
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = ra.sysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pgbouncer: start %s: %w", bin, err)
	}
	s.cmd = cmd
	s.done = make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(s.done)
	}()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-s.done:
			tail := s.logTail(logStart) + out.String()
			if strings.Contains(tail, "Address already in use") {
				return errAddrInUse
			}
			return fmt.Errorf("pgbouncer: exited during start-up (%v); log:\n%s", waitErr, tail)
		case <-ctx.Done():
			s.kill()
			return fmt.Errorf("pgbouncer: not accepting connections on %s: %w; log:\n%s", s.Addr(), ctx.Err(), s.logTail(logStart))
		case <-tick.C:
			c, err := net.DialTimeout("tcp", s.Addr(), 200*time.Millisecond)
			if err == nil {
				c.Close()
				return nil
			}
		}
	}
}

func (s *Server) kill() {
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	<-s.done
}

// Stop shuts PgBouncer down (immediate shutdown: clients are disconnected)
// and removes its directory. It is idempotent.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		if err := s.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
			s.stopErr = fmt.Errorf("pgbouncer: stop: %w", err)
		}
		select {
		case <-s.done:
		case <-time.After(stopTimeout):
			s.kill()
		}
		if err := os.RemoveAll(s.dir); err != nil && s.stopErr == nil {
			s.stopErr = fmt.Errorf("pgbouncer: %w", err)
		}
	})
	return s.stopErr
}

// Host returns the address PgBouncer listens on, "127.0.0.1".
func (s *Server) Host() string { return host }

// Port returns the TCP port PgBouncer listens on.
func (s *Server) Port() int { return s.port }

// Addr returns "127.0.0.1:PORT".
func (s *Server) Addr() string { return net.JoinHostPort(host, strconv.Itoa(s.port)) }

// PoolMode returns the pool_mode in force.
func (s *Server) PoolMode() string { return s.opts.PoolMode }

// DSN returns a libpq URL for user and database through PgBouncer, with
// sslmode=disable (the harness configures no TLS).
func (s *Server) DSN(user, database string) string {
	return fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", user, s.Addr(), database)
}

// AdminDSN returns a libpq URL for PgBouncer's admin console (database
// "pgbouncer") as the first of Options.Users. The console speaks only the
// simple query protocol: with pgx use QueryExecModeSimpleProtocol.
func (s *Server) AdminDSN() string { return s.DSN(s.opts.Users[0], "pgbouncer") }

// LogFile returns PgBouncer's log file; it is removed by Stop.
func (s *Server) LogFile() string { return s.logFile }

// PID returns the process id of PgBouncer.
func (s *Server) PID() int { return s.cmd.Process.Pid }

func (s *Server) logf(format string, args ...any) {
	if s.opts.Logf != nil {
		s.opts.Logf(format, args...)
	}
}

// logTail returns the last lines written to the log since offset.
func (s *Server) logTail(offset int64) string {
	data, err := os.ReadFile(s.logFile)
	if err != nil || int64(len(data)) < offset {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(data[offset:]), "\n"), "\n")
	if len(lines) > logTailLines {
		lines = lines[len(lines)-logTailLines:]
	}
	return strings.Join(lines, "\n") + "\n"
}

func findBinary() (string, error) {
	if p := os.Getenv(BinaryEnv); p != "" {
		return p, nil
	}
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/sbin/pgbouncer"); err == nil {
		return "/usr/sbin/pgbouncer", nil
	}
	return "", ErrNotInstalled
}

// Version returns the version of the pgbouncer binary, such as "1.18.0".
func Version(ctx context.Context) (string, error) {
	bin, err := findBinary()
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, bin, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("pgbouncer: %s --version: %w", bin, err)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	v, ok := strings.CutPrefix(strings.TrimSpace(first), "PgBouncer ")
	if !ok {
		return "", fmt.Errorf("pgbouncer: %s --version printed %q", bin, first)
	}
	return v, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, fmt.Errorf("pgbouncer: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// runAs is the identity PgBouncer runs under; nil means the current user.
type runAs struct{ uid, gid uint32 }

// lookupRunAs returns nil unless the process is root, which PgBouncer
// refuses to run as ("PgBouncer should not run as root").
func lookupRunAs() (*runAs, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup(serverOSUser)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: running as root, which PgBouncer refuses, and there is no %q OS user to run it as: %w", serverOSUser, err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: OS user %q has uid %q: %w", serverOSUser, u.Uid, err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: OS user %q has gid %q: %w", serverOSUser, u.Gid, err)
	}
	return &runAs{uid: uint32(uid), gid: uint32(gid)}, nil
}

func (r *runAs) chown(path string) error {
	if r == nil {
		return nil
	}
	if err := os.Lchown(path, int(r.uid), int(r.gid)); err != nil {
		return fmt.Errorf("pgbouncer: %w", err)
	}
	return nil
}

// sysProcAttr gives PgBouncer its own process group, under the server
// user's identity, killed if the thread that started it dies (so a test
// binary killed by -timeout takes it along).
func (r *runAs) sysProcAttr() *syscall.SysProcAttr {
	attr := &syscall.SysProcAttr{Setpgid: true}
	if r != nil {
		attr.Credential = &syscall.Credential{Uid: r.uid, Gid: r.gid}
	}
	setParentDeathSignal(attr)
	return attr
}

func writeFile(r *runAs, path, text string) error {
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		return fmt.Errorf("pgbouncer: %w", err)
	}
	return r.chown(path)
}
