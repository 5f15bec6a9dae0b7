package pgcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// TLSFiles names the PEM files of the server certificate.
type TLSFiles struct {
	// CertFile is the server certificate (ssl_cert_file). Required.
	CertFile string
	// KeyFile is the server private key (ssl_key_file). Required.
	KeyFile string
	// CAFile, when set, becomes ssl_ca_file: the CAs trusted for client
	// certificates. Optional.
	CAFile string
}

// Options configures Start. The zero value is a trust-authenticated cluster
// without TLS.
type Options struct {
	// AuthMethod is the pg_hba.conf method for TCP connections of roles other
	// than the superuser: "trust" (default), "password", "md5" or
	// "scram-sha-256".
	AuthMethod string
	// TLS, when set, turns on ssl with these files, which are copied into the
	// data directory. Default: no TLS.
	TLS *TLSFiles
	// Settings are extra postgresql.conf settings, e.g. "work_mem": "8MB";
	// they override the harness defaults (fsync=off, max_connections=200…).
	// The listening address, port and directories cannot be set here.
	Settings map[string]string
	// BinDir is the directory with initdb and postgres. Default: discovered,
	// see the package documentation.
	BinDir string
	// Logf receives progress lines. Default (nil): silent.
	Logf func(format string, args ...any)
}

// ErrStopped is returned by StartServer after Stop.
var ErrStopped = errors.New("pgcluster: cluster stopped")

// errAddrInUse marks a postmaster that could not bind its port, which Start
// retries with another port.
var errAddrInUse = errors.New("pgcluster: port already in use")

const (
	host = "127.0.0.1"
	// superuser is the bootstrap superuser created by initdb -U.
	superuser = "postgres"
	// startTimeout bounds the wait for the server to accept connections.
	startTimeout = 30 * time.Second
	// stopTimeout bounds a fast shutdown before immediate shutdown.
	stopTimeout = 30 * time.Second
	// bindAttempts is how many ports Start tries (and how many times
	// StartServer retries its own) before giving up.
	bindAttempts = 5
	// logTailLines is how much of the server log an error carries.
	logTailLines = 20
)

// Cluster is a running (or stopped) throwaway PostgreSQL cluster. Its
// methods are safe for concurrent use.
type Cluster struct {
	binDir     string
	rootDir    string // temporary directory holding everything below
	dataDir    string
	logFile    string
	authMethod string
	runAs      *runAs
	logf       func(format string, args ...any)
	// port is chosen by Start and kept by StartServer, so that clients
	// configured with Addr find the server again after a restart.
	port int

	mu       sync.Mutex
	settings map[string]string // postgresql.conf settings written on each start
	srv      *server           // nil while the postmaster is not running
	stopped  bool
}

// server is one run of the postmaster.
type server struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when the postmaster has exited and been reaped
	err  error         // result of Wait, valid once done is closed
}

// Start creates a cluster in a new temporary directory, starts it and waits
// until it accepts connections. ctx bounds the start-up only; the server
// lives until Stop. On error nothing is left behind.
func Start(ctx context.Context, opts Options) (_ *Cluster, err error) {
	method, err := authMethod(opts.AuthMethod)
	if err != nil {
		return nil, err
	}
	if err := validateSettings(opts.Settings); err != nil {
		return nil, err
	}
	// Read the TLS files now, before anything is created, so a wrong path
	// fails fast.
	tlsFiles, err := readTLSFiles(opts.TLS)
	if err != nil {
		return nil, err
	}
	binDir, err := findBinDir(ctx, opts.BinDir)
	if err != nil {
		return nil, err
	}
	ra, err := lookupRunAs()
	if err != nil {
		return nil, err
	}
	root, err := os.MkdirTemp(baseTempDir(ra), "fenceproxy-pg-")
	if err != nil {
		return nil, fmt.Errorf("pgcluster: %w", err)
	}
	c := &Cluster{
		binDir:     binDir,
		rootDir:    root,
		dataDir:    filepath.Join(root, "data"),
		logFile:    filepath.Join(root, "postgres.log"),
		authMethod: method,
		runAs:      ra,
		logf:       opts.Logf,
	}
	defer func() {
		if err != nil {
			if stopErr := c.Stop(); stopErr != nil {
				err = errors.Join(err, stopErr)
			}
		}
	}()
	if err := ra.chown(root); err != nil {
		return nil, err
	}
	c.log("pgcluster: initdb %s with binaries from %s", c.dataDir, binDir)
	if err := c.initdb(ctx); err != nil {
		return nil, err
	}
	if err := c.configure(opts.Settings, tlsFiles); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.startServerLocked(ctx, true); err != nil {
		return nil, err
	}
	return c, nil
}

func authMethod(m string) (string, error) {
	switch m {
	case "":
		return "trust", nil
	case "trust", "password", "md5", "scram-sha-256":
		return m, nil
	}
	return "", fmt.Errorf("pgcluster: unsupported AuthMethod %q (want trust, password, md5 or scram-sha-256)", m)
}

var settingName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_.]*$`)

// managedSettings are decided by the harness: Addr, DataDir and the
// superuser connection depend on them.
var managedSettings = []string{
	"listen_addresses", "port", "unix_socket_directories",
	"data_directory", "config_file", "hba_file", "ident_file",
}

func validateSettings(settings map[string]string) error {
	for k, v := range settings {
		if !settingName.MatchString(k) {
			return fmt.Errorf("pgcluster: invalid setting name %q", k)
		}
		if slices.Contains(managedSettings, strings.ToLower(k)) {
			return fmt.Errorf("pgcluster: setting %q is managed by the harness", k)
		}
		if strings.ContainsAny(v, "\x00\r\n") {
			return fmt.Errorf("pgcluster: setting %q has a line break or NUL in its value", k)
		}
	}
	return nil
}

func (c *Cluster) log(format string, args ...any) {
	if c.logf != nil {
		c.logf(format, args...)
	}
}

func (c *Cluster) initdb(ctx context.Context) error {
	cmd := c.command(ctx, "initdb", syscall.SIGKILL,
		"-D", c.dataDir, "-U", superuser, "--auth=trust",
		"-E", "UTF8", "--locale=C",
		// The cluster is thrown away, durability is pointless.
		"--no-sync")
	// initdb runs postgres in bootstrap mode as a child; kill both.
	cmd.Cancel = func() error { return killGroup(cmd.Process.Pid) }
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("pgcluster: initdb: %w\n%s", err, lastLines(out, logTailLines))
	}
	return nil
}

// tlsFile is a file to copy into the data directory.
type tlsFile struct {
	name    string // in the data directory
	setting string
	data    []byte
}

func readTLSFiles(t *TLSFiles) ([]tlsFile, error) {
	if t == nil {
		return nil, nil
	}
	if t.CertFile == "" || t.KeyFile == "" {
		return nil, errors.New("pgcluster: Options.TLS needs CertFile and KeyFile")
	}
	var files []tlsFile
	for _, f := range []struct{ src, name, setting string }{
		{t.CertFile, "server.crt", "ssl_cert_file"},
		{t.KeyFile, "server.key", "ssl_key_file"},
		{t.CAFile, "root.crt", "ssl_ca_file"},
	} {
		if f.src == "" {
			continue
		}
		data, err := os.ReadFile(f.src)
		if err != nil {
			return nil, fmt.Errorf("pgcluster: TLS file: %w", err)
		}
		files = append(files, tlsFile{f.name, f.setting, data})
	}
	return files, nil
}

// configure writes pg_hba.conf and the TLS files and records the settings;
// startServerLocked writes them with the port.
func (c *Cluster) configure(extra map[string]string, tlsFiles []tlsFile) error {
	// The superuser always gets trust so that the harness needs no
	// password; everyone else meets the method under test. "host" matches
	// both TLS and plain connections.
	hba := fmt.Sprintf(`# Written by fenceproxy pgcluster.
# TYPE  DATABASE  USER      ADDRESS       METHOD
local   all       all                     trust
host    all       %-8s  127.0.0.1/32  trust
host    all       all       127.0.0.1/32  %s
`, superuser, c.authMethod)
	if err := c.writeFile(filepath.Join(c.dataDir, "pg_hba.conf"), []byte(hba)); err != nil {
		return err
	}

	settings := map[string]string{
		"listen_addresses":   host,
		"fsync":              "off",
		"synchronous_commit": "off",
		"full_page_writes":   "off",
		"max_connections":    "200",
	}
	// The socket (and its lock file) lives in the data directory rather
	// than the packaged /var/run/postgresql, which may not exist or be
	// shared with a system server. sun_path holds 107 bytes on Linux; with
	// a very long TMPDIR there is no socket and TCP alone is used.
	if len(c.dataDir)+len("/.s.PGSQL.65535") < 100 {
		settings["unix_socket_directories"] = c.dataDir
	} else {
		settings["unix_socket_directories"] = ""
	}
	if len(tlsFiles) > 0 {
		settings["ssl"] = "on"
	}
	// The server reads the files as the server user and refuses a key that
	// others can read, hence private copies in the data directory.
	for _, f := range tlsFiles {
		if err := c.writeFile(filepath.Join(c.dataDir, f.name), f.data); err != nil {
			return err
		}
		settings[f.setting] = f.name
	}
	for k, v := range extra {
		settings[strings.ToLower(k)] = v // names are case-insensitive
	}
	c.settings = settings

	// Keep initdb's postgresql.conf and pull ours in last, so ours wins.
	conf, err := os.OpenFile(filepath.Join(c.dataDir, "postgresql.conf"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	_, err = io.WriteString(conf, "\ninclude 'pgcluster.conf'\n")
	if closeErr := conf.Close(); err == nil {
		err = closeErr
	}
	if err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	return nil
}

// writeConfLocked writes pgcluster.conf, included by postgresql.conf.
func (c *Cluster) writeConfLocked() error {
	var b strings.Builder
	b.WriteString("# Written by fenceproxy pgcluster on each start.\n")
	fmt.Fprintf(&b, "port = %d\n", c.port)
	for _, k := range slices.Sorted(maps.Keys(c.settings)) {
		fmt.Fprintf(&b, "%s = %s\n", k, quoteConfValue(c.settings[k]))
	}
	return c.writeFile(filepath.Join(c.dataDir, "pgcluster.conf"), []byte(b.String()))
}

// quoteConfValue quotes a postgresql.conf value; any value may be quoted,
// and inside quotes both ' and \ are special.
func quoteConfValue(v string) string {
	v = strings.ReplaceAll(v, `\`, `\\`)
	return "'" + strings.ReplaceAll(v, "'", "''") + "'"
}

// writeFile writes a 0600 file owned by the server user.
func (c *Cluster) writeFile(path string, data []byte) error {
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	// WriteFile keeps the mode of an existing file.
	if err := os.Chmod(path, 0o600); err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	return c.runAs.chown(path)
}

// startServerLocked starts the postmaster; with newPort it picks a fresh port
// for each attempt, otherwise it retries the cluster's port.
func (c *Cluster) startServerLocked(ctx context.Context, newPort bool) error {
	for attempt := 1; ; attempt++ {
		if newPort {
			port, err := reservePort()
			if err != nil {
				return err
			}
			releasePort(c.port)
			c.port = port
		}
		err := c.launchLocked(ctx)
		if err == nil || !errors.Is(err, errAddrInUse) || attempt == bindAttempts {
			return err
		}
		c.log("pgcluster: port %d is taken, retrying", c.port)
		if !newPort {
			select {
			case <-time.After(200 * time.Millisecond):
			case <-ctx.Done():
				return fmt.Errorf("pgcluster: start: %w", ctx.Err())
			}
		}
	}
}

// launchLocked runs one postmaster and waits until it accepts connections;
// on failure the process group is gone when it returns.
func (c *Cluster) launchLocked(ctx context.Context) error {
	if err := c.writeConfLocked(); err != nil {
		return err
	}
	logF, err := os.OpenFile(c.logFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	defer logF.Close()
	if err := c.runAs.chown(c.logFile); err != nil {
		return err
	}
	logStart, err := logF.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}

	// Not tied to ctx: the server outlives the start-up. SIGQUIT on the
	// parent's death is PostgreSQL's immediate shutdown, which still
	// removes shared memory, unlike SIGKILL.
	cmd := c.command(context.Background(), "postgres", syscall.SIGQUIT, "-D", c.dataDir)
	cmd.Stdout, cmd.Stderr = logF, logF
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pgcluster: start postgres: %w", err)
	}
	srv := &server{cmd: cmd, done: make(chan struct{})}
	go func() {
		srv.err = cmd.Wait()
		close(srv.done)
	}()

	if err := c.waitReady(ctx, srv); err != nil {
		exited := false
		select {
		case <-srv.done:
			exited = true
		default:
		}
		stopErr := srv.stop(immediateShutdown)
		tail := c.logTail(logStart)
		if exited && strings.Contains(tail, "could not create any TCP/IP sockets") {
			return fmt.Errorf("%w: %d", errAddrInUse, c.port)
		}
		err = fmt.Errorf("%w\nserver log (%s):\n%s", err, c.logFile, tail)
		if !exited {
			err = errors.Join(err, stopErr)
		}
		return err
	}
	c.srv = srv
	c.log("pgcluster: postgres pid %d accepting connections on %s", cmd.Process.Pid, c.Addr())
	return nil
}

// waitReady polls with real connections, as pg_isready would, until the
// server accepts one, exits or startTimeout passes.
func (c *Cluster) waitReady(ctx context.Context, srv *server) error {
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	// An exiting postmaster ends the wait at once, even mid-attempt: when
	// it failed to bind, the port may belong to a listener that never
	// answers.
	go func() {
		select {
		case <-srv.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	dsn := c.SuperuserDSN("postgres")
	for {
		attemptCtx, cancelAttempt := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgconn.Connect(attemptCtx, dsn)
		cancelAttempt()
		if err == nil {
			return conn.Close(ctx)
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
			continue
		}
		select {
		case <-srv.done:
			return fmt.Errorf("pgcluster: postgres exited during start-up: %v", srv.err)
		default:
			return fmt.Errorf("pgcluster: postgres not accepting connections on %s: %w (last attempt: %v)", c.Addr(), ctx.Err(), err)
		}
	}
}

// logTail returns the last lines the server logged since offset.
func (c *Cluster) logTail(offset int64) string {
	f, err := os.Open(c.logFile)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	defer f.Close()
	const maxRead = 64 << 10
	if fi, err := f.Stat(); err == nil && fi.Size()-offset > maxRead {
		offset = fi.Size() - maxRead
	}
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	return lastLines(data, logTailLines)
}

func lastLines(data []byte, n int) string {
	lines := bytes.Split(bytes.TrimRight(data, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// StopServer shuts the postmaster down (fast shutdown: sessions are
// terminated) and keeps the data directory, so StartServer can bring the
// same cluster back on the same port. Stopping a stopped server is a no-op.
func (c *Cluster) StopServer() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stopServerLocked()
}

func (c *Cluster) stopServerLocked() error {
	srv := c.srv
	if srv == nil {
		return nil
	}
	c.srv = nil
	pid := srv.cmd.Process.Pid
	select {
	case <-srv.done:
		// Crashed or killed from outside. Its backends notice that the
		// postmaster is gone and exit by themselves.
		return fmt.Errorf("pgcluster: postgres pid %d had exited: %v", pid, srv.err)
	default:
	}
	if err := srv.stop(fastShutdown); err != nil {
		return err
	}
	c.log("pgcluster: postgres pid %d stopped", pid)
	return nil
}

// stopStep is a signal to the postmaster and how long to wait for it to exit.
type stopStep struct {
	sig  syscall.Signal
	wait time.Duration
}

// The signals are the shutdown modes of
// https://www.postgresql.org/docs/current/server-shutdown.html: SIGINT is
// fast shutdown (sessions are terminated; SIGTERM would wait for them),
// SIGQUIT immediate shutdown (the postmaster SIGQUITs its children and
// SIGKILLs them after 5 seconds).
var (
	fastShutdown      = []stopStep{{syscall.SIGINT, stopTimeout}, {syscall.SIGQUIT, 10 * time.Second}}
	immediateShutdown = []stopStep{{syscall.SIGQUIT, 10 * time.Second}}
)

// stop takes the steps in turn until the postmaster exits, then SIGKILLs
// its process group. Only the postmaster can reach the backends, which
// call setsid and so are in groups of their own; should it be killed,
// they exit when they notice its death. stop returns nil when the first
// step worked.
func (srv *server) stop(steps []stopStep) error {
	pid := srv.cmd.Process.Pid
	for i, st := range steps {
		// Process.Signal, unlike kill(2) on the pid, cannot hit a reused pid.
		if err := srv.cmd.Process.Signal(st.sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
			return fmt.Errorf("pgcluster: signal postgres pid %d: %w", pid, err)
		}
		timer := time.NewTimer(st.wait)
		select {
		case <-srv.done:
			timer.Stop()
			if i == 0 && srv.err == nil {
				return nil
			}
			return fmt.Errorf("pgcluster: postgres pid %d did not exit cleanly on %v: %v", pid, steps[0].sig, srv.err)
		case <-timer.C:
		}
	}
	killErr := killGroup(pid)
	<-srv.done
	return errors.Join(fmt.Errorf("pgcluster: postgres pid %d ignored %v, killed", pid, steps[len(steps)-1].sig), killErr)
}

// StartServer starts the postmaster again after StopServer, on the same
// port, and waits until it accepts connections. It is a no-op while the
// server runs, and fails with ErrStopped after Stop.
func (c *Cluster) StartServer(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return ErrStopped
	}
	if c.srv != nil {
		return nil
	}
	return c.startServerLocked(ctx, false)
}

// Stop shuts the server down, killing its process group if fast shutdown
// fails, and removes the temporary directory. It is idempotent.
func (c *Cluster) Stop() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return nil
	}
	c.stopped = true
	err := c.stopServerLocked()
	if rmErr := os.RemoveAll(c.rootDir); rmErr != nil {
		err = errors.Join(err, fmt.Errorf("pgcluster: %w", rmErr))
	}
	releasePort(c.port)
	c.log("pgcluster: removed %s", c.rootDir)
	return err
}

// Host returns the address the server listens on, "127.0.0.1".
func (c *Cluster) Host() string { return host }

// Port returns the TCP port; it does not change across StopServer and
// StartServer.
func (c *Cluster) Port() int { return c.port }

// Addr returns "127.0.0.1:PORT".
func (c *Cluster) Addr() string { return net.JoinHostPort(host, strconv.Itoa(c.port)) }

// BinDir returns the directory the server binaries were found in; pgbench
// and psql are there too when installed.
func (c *Cluster) BinDir() string { return c.binDir }

// DataDir returns the data directory, which also holds the Unix socket.
func (c *Cluster) DataDir() string { return c.dataDir }

// LogFile returns the file receiving the server's log.
func (c *Cluster) LogFile() string { return c.logFile }

// AuthMethod returns the pg_hba.conf method for non-superusers.
func (c *Cluster) AuthMethod() string { return c.authMethod }

// PID returns the postmaster's process id, or 0 while it is not running.
func (c *Cluster) PID() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.srv == nil {
		return 0
	}
	return c.srv.cmd.Process.Pid
}

// ports holds the ports of this process's clusters, including stopped
// servers that StartServer will bring back, so that one cluster never takes
// another's port while it is down. Other processes are handled by retrying.
var ports = struct {
	sync.Mutex
	used map[int]bool
}{used: map[int]bool{}}

// reservePort asks the kernel for a free port. The port is free only until
// postgres binds it; a race with another process shows as a bind failure,
// which Start retries.
func reservePort() (int, error) {
	for range 20 {
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return 0, fmt.Errorf("pgcluster: find a free port: %w", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		if err := l.Close(); err != nil {
			return 0, fmt.Errorf("pgcluster: find a free port: %w", err)
		}
		ports.Lock()
		if !ports.used[port] {
			ports.used[port] = true
			ports.Unlock()
			return port, nil
		}
		ports.Unlock()
	}
	return 0, errors.New("pgcluster: no free port found")
}

func releasePort(port int) {
	if port == 0 {
		return
	}
	ports.Lock()
	delete(ports.used, port)
	ports.Unlock()
}
