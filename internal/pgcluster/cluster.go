package pgcluster

import (
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
