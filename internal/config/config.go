// Package config loads and validates fenceproxy's YAML configuration file.
//
// One struct describes the whole file; every field documents its default.
// Load rejects unknown keys and reports problems by key name, so an operator
// reading "upstream.tls.mode: must be one of disable, require, verify-ca, verify-full; got \"x\""
// knows exactly which line to fix.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"gopkg.in/yaml.v3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Config is the whole configuration file.
type Config struct {
	// Listen is the address clients connect to: host:port for TCP, or an
	// absolute directory (starting with "/") in which the proxy creates
	// the Unix socket .s.PGSQL.<listen_port>, as PostgreSQL and PgBouncer
	// name theirs, so that clients use host=<directory> as with libpq.
	// Default "127.0.0.1:6432", PgBouncer's, so that the proxy drops in
	// where a pooler was.
	Listen string `yaml:"listen"`
	// ListenPort is the port in the socket file's name when Listen is a
	// directory; only used then. Default 6432.
	ListenPort int `yaml:"listen_port"`
	// Upstream is the PostgreSQL server every session is relayed to.
	Upstream Upstream `yaml:"upstream"`
	// TLS configures TLS between clients and the proxy. Default: off
	// (SSLRequest is answered 'N').
	TLS ClientTLS `yaml:"tls"`
	// Auth says who authenticates clients: the server (relayed, the
	// default) or the proxy, by TLS client certificate.
	Auth Auth `yaml:"auth"`
	// Limits bound what a client may cost the proxy.
	Limits Limits `yaml:"limits"`
	// Shutdown controls graceful shutdown.
	Shutdown Shutdown `yaml:"shutdown"`
	// Log configures logging.
	Log Log `yaml:"log"`
	// Admin configures the HTTP listener for /metrics, /healthz, /readyz,
	// /sessions, /rules and optionally /debug/pprof/.
	Admin Admin `yaml:"admin"`
	// Audit configures how the proxy hears about audited writes.
	Audit Audit `yaml:"audit"`
	// TokenSetting is the session variable that carries the fencing token.
	// Default "fence.token".
	TokenSetting string `yaml:"token_setting"`
	// LockSetting is the session variable that carries the name of the
	// lock the session holds (lock fencing).
	LockSetting string `yaml:"lock_setting"`
	// RewriteCacheEntries bounds the per-rule-set cache of rewrite decisions,
	// keyed by statement text. Default 4096; 0 disables the cache.
	RewriteCacheEntries int `yaml:"rewrite_cache_entries"`
	// AutoPrepare, when positive: a simple-protocol statement that the
	// proxy rewrites, sent with the same text for the AutoPrepare-th time
	// in a session, runs from then on as a prepared statement of the
	// proxy's own (named fenceproxy_auto_*), which costs the server less
	// per execution. Default 0: never (opt-in: a prepared statement keeps
	// what PostgreSQL fixed when it analysed it). Read at start only.
	AutoPrepare int `yaml:"auto_prepare"`
	// MaxCheckBytes bounds the size of a statement that may touch a
	// protected table and so has to be parsed and possibly rewritten, which
	// takes memory in proportion to its size; larger ones are refused with
	// FP003 (statements that cannot touch a protected table are not
	// parsed). Default 1048576 (1 MiB).
	MaxCheckBytes int `yaml:"max_check_bytes"`
	// Tables lists the protected tables. Default: none (a pure relay).
	Tables []rules.Table `yaml:"tables"`
	// Guard configures the optional database guard that `fenceproxy setup
	// --guard` installs. The proxy itself does not read it.
	Guard Guard `yaml:"guard"`
	// DDL configures DDL on protected tables through the proxy.
	DDL DDL `yaml:"ddl"`
}

// DDL configures DDL on protected tables through the proxy, which is
// refused unless it is on the allow-list or changes nothing (judged
// against the catalog): migrations at application start-up.
type DDL struct {
	// AllowRoles lists the users (as sent in the startup packet, exact)
	// whose sessions may run any DDL on protected tables through the
	// proxy, such as the role the application's migrations log in as.
	// The proxy logs each such statement and refuses writes to its tables
	// until it has checked the database after the statement's transaction
	// ended. Default: none. Follows a reload.
	AllowRoles []string `yaml:"allow_roles"`
}

// Guard configures the database guard: row triggers on the protected
// tables that apply their fence inside PostgreSQL, for the writes the proxy
// does not see (functions, dynamic SQL, cascades, sessions connected
// directly).
type Guard struct {
	// ExemptRoles lists the roles whose sessions may write the guarded
	// tables without a token or a lock name, such as the migration role:
	// a session is exempt when its login role is one of them or a member
	// of one. Exact role names, as in pg_roles (no case folding); each
	// must exist when setup runs. Superusers are exempt only if listed.
	// Default: none.
	ExemptRoles []string `yaml:"exempt_roles"`
}

// maxRoleNameLen is PostgreSQL's NAMEDATALEN-1: a longer name cannot be a
// role's.
const maxRoleNameLen = 63

// validate checks the guard's keys.
func (g *Guard) validate() error {
	seen := map[string]bool{}
	for i, r := range g.ExemptRoles {
		key := fmt.Sprintf("guard.exempt_roles[%d]", i)
		switch {
		case r == "":
			return fmt.Errorf("%s: must not be empty", key)
		case len(r) > maxRoleNameLen:
			return fmt.Errorf("%s: %q is longer than %d bytes, the longest role name PostgreSQL keeps", key, r, maxRoleNameLen)
		case strings.IndexByte(r, 0) >= 0:
			return fmt.Errorf("%s: must not contain NUL bytes", key)
		case seen[r]:
			return fmt.Errorf("%s: %q is listed twice", key, r)
		}
		seen[r] = true
	}
	return nil
}

// Upstream describes the PostgreSQL server.
type Upstream struct {
	// Address is host:port of the PostgreSQL server, or the directory of
	// its Unix socket (starting with "/", as libpq's host), for example
	// /var/run/postgresql for /var/run/postgresql/.s.PGSQL.5432. Required.
	Address string `yaml:"address"`
	// Port is the port in the socket file's name when Address is a
	// directory; only used then. Default 5432.
	Port int `yaml:"port"`
	// ConnectTimeout bounds dialling, the TLS handshake and the upstream's
	// first answer after connecting. Default 5s.
	ConnectTimeout time.Duration `yaml:"connect_timeout"`
	// TLS configures TLS from the proxy to PostgreSQL.
	TLS UpstreamTLS `yaml:"tls"`
}

// UpstreamTLS configures TLS to the upstream server.
type UpstreamTLS struct {
	// Mode is disable (default), require (encrypt, do not verify),
	// verify-ca (verify the chain against CAFile) or verify-full (verify the
	// chain and the host name), as libpq's sslmode.
	Mode string `yaml:"mode"`
	// CAFile is a PEM bundle of trusted CAs; required for verify-ca and
	// verify-full.
	CAFile string `yaml:"ca_file"`
	// ServerName overrides the name verified in verify-full mode. Default:
	// the host part of upstream.address.
	ServerName string `yaml:"server_name"`
	// FollowClient uses TLS (as Mode says) only for clients that
	// negotiated TLS with the proxy, and plaintext for the others, so that
	// the server's hostssl and hostnossl lines see the client's choice.
	// Default false: every upstream connection as Mode says.
	FollowClient bool `yaml:"follow_client"`
	// CertFile and KeyFile are the proxy's own client certificate (PEM),
	// presented to the server, e.g. for a cert line of pg_hba.conf that
	// maps it to the users with pg_ident.conf. Default: none.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
}

// Auth configures client authentication.
type Auth struct {
	// Method is relay (the default: the server authenticates the client,
	// the proxy relays the exchange) or cert (the proxy verifies the
	// client's TLS certificate against tls.client_ca_file, requires its
	// Common Name to be the user name, and logs in to the server as that
	// user itself).
	Method string `yaml:"method"`
	// File is a PgBouncer-style auth file ("user" "password" lines) with
	// the passwords the proxy answers the server with under method cert:
	// the password, or for md5 the md5 hash PostgreSQL stores. Read at
	// start. Default: none (only servers that ask no password, such as a
	// cert line for upstream.tls.cert_file, admit the users).
	File string `yaml:"file"`
}

// ClientTLS configures TLS offered to clients.
type ClientTLS struct {
	// CertFile and KeyFile are PEM files. When both are set, the proxy
	// answers SSLRequest with 'S'. Default: empty (no TLS).
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	// Require refuses clients that do not negotiate TLS. Default false.
	Require bool `yaml:"require"`
	// ClientCAFile is a PEM bundle of the CAs that sign client
	// certificates; required with auth.method cert, only used then.
	ClientCAFile string `yaml:"client_ca_file"`
}

// maxAutoPrepare bounds auto_prepare.
const maxAutoPrepare = 1000

// maxRelayLoops bounds limits.relay_loops: a loop is an OS thread.
const maxRelayLoops = 256

// Limits bounds client resource use.
type Limits struct {
	// MaxConnections is the maximum number of concurrent client sessions;
	// further clients get SQLSTATE 53300. Default 1000.
	MaxConnections int `yaml:"max_connections"`
	// MaxMessageBytes is the largest message a client may send once
	// authenticated (type byte excluded; before that, PostgreSQL's own
	// limits apply). Larger messages close the session with SQLSTATE 08P01.
	// Default 67108864 (64 MiB).
	MaxMessageBytes int `yaml:"max_message_bytes"`
	// StartupTimeout bounds the time from accept to the end of
	// authentication. Default 30s.
	StartupTimeout time.Duration `yaml:"startup_timeout"`
	// RelayLoops is the number of event loops, one OS thread each, that
	// relay the authenticated sessions. 0 (the default): half the CPUs the
	// process may use, at least one.
	RelayLoops int `yaml:"relay_loops"`
	// LargeMessageBudget bounds the memory, in bytes, that all sessions
	// together hold at once for large client messages (a Query's or a
	// Parse's text, a Bind the proxy tracks, over 64 KiB), their deciding
	// included. A message that would exceed it waits for room. Default
	// 268435456 (256 MiB); at least 1048576.
	LargeMessageBudget int64 `yaml:"large_message_budget"`
	// LargeMessageWait is how long a large message waits for room in
	// large_message_budget; past it, the message is refused with SQLSTATE
	// 53200 and the session goes on. Default 30s.
	LargeMessageWait time.Duration `yaml:"large_message_wait"`
}

// Shutdown controls graceful shutdown.
type Shutdown struct {
	// Delay is how long the proxy keeps accepting new connections after
	// SIGTERM/SIGINT while /readyz already answers 503, so that load
	// balancers and Kubernetes endpoints stop sending clients before it
	// refuses them; the drain starts after it. Delay and DrainTimeout
	// together must fit in the orchestrator's grace period (Docker's
	// stop_grace_period, Kubernetes' terminationGracePeriodSeconds).
	// Default 0s.
	Delay time.Duration `yaml:"delay"`
	// DrainTimeout is how long sessions may finish their transactions after
	// SIGTERM/SIGINT before they are closed. Default 30s.
	DrainTimeout time.Duration `yaml:"drain_timeout"`
}

// Log configures the zap logger.
type Log struct {
	// Format is json (default) or console.
	Format string `yaml:"format"`
	// Level is debug, info (default), warn or error. Rewritten statements are
	// logged at debug.
	Level string `yaml:"level"`
}

// Admin configures the admin HTTP listener.
type Admin struct {
	// Listen is the admin address. Default "127.0.0.1:6438": outside
	// Prometheus' exporter range (9100-9999, where 9187 is
	// postgres_exporter's), and not the default of a tool that commonly
	// runs beside PostgreSQL. "" or "off" disables it.
	Listen string `yaml:"listen"`
	// Pprof serves Go's profiler under /debug/pprof/ on the admin listener.
	// Default false: profiles show memory contents such as statement text.
	Pprof bool `yaml:"pprof"`
}

// Audit configures the connection the proxy uses to LISTEN for the events
// that rewritten statements report with pg_notify: in mode: audit, every
// write that enforce would have rejected; with missing_token: allow, every
// write let through without a token. One connection per database in which
// such statements run; it needs only CONNECT privilege.
type Audit struct {
	// DSN is a libpq-style URL or key=value string; its database is
	// replaced by each audited database. Default: user postgres at
	// upstream.address, with upstream.tls's mode and CA.
	DSN string `yaml:"dsn"`
	// PasswordEnv names the environment variable holding the password, so
	// that it need not be written in the file. Default
	// FENCEPROXY_AUDIT_PASSWORD (unset: no password, or ~/.pgpass).
	PasswordEnv string `yaml:"password_env"`
}

// Defaults returns a Config with every default filled in and no upstream.
func Defaults() Config {
	return Config{
		Listen:              "127.0.0.1:6432",
		Upstream:            Upstream{ConnectTimeout: 5 * time.Second, TLS: UpstreamTLS{Mode: "disable"}},
		Auth:                Auth{Method: "relay"},
		Limits:              Limits{MaxConnections: 1000, MaxMessageBytes: 64 << 20, StartupTimeout: 30 * time.Second, LargeMessageBudget: 256 << 20, LargeMessageWait: 30 * time.Second},
		Shutdown:            Shutdown{DrainTimeout: 30 * time.Second},
		Log:                 Log{Format: "json", Level: "info"},
		Admin:               Admin{Listen: "127.0.0.1:6438"},
		Audit:               Audit{PasswordEnv: "FENCEPROXY_AUDIT_PASSWORD"},
		TokenSetting:        rules.DefaultTokenSetting,
		LockSetting:         rules.DefaultLockSetting,
		RewriteCacheEntries: rules.DefaultCacheSize,
		MaxCheckBytes:       rules.DefaultMaxCheckBytes,
	}
}

// Load reads, parses and validates the file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	cfg, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return cfg, nil
}

// Parse parses and validates YAML text. Unknown keys are errors.
func Parse(data []byte) (*Config, error) {
	cfg, err := decode(data)
	if err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return cfg, nil
}

// LoadRules reads the file at path for its rules only (token_setting,
// tables, rewrite_cache_entries, max_check_bytes; and guard, for
// `fenceproxy setup`), as `fenceproxy rewrite` needs: the proxy's own keys,
// such as upstream.address, may be missing. Unknown keys are still errors,
// and the rules and the guard's keys are validated.
func LoadRules(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	cfg, err := decode(data)
	if err == nil {
		_, err = cfg.Rules()
	}
	if err == nil {
		err = cfg.Guard.validate()
	}
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return cfg, nil
}

func decode(data []byte) (*Config, error) {
	cfg := Defaults()
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	// An empty file decodes as io.EOF: it means "all defaults".
	if err := dec.Decode(&cfg); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return &cfg, nil
}

// Validate checks every field and names the key of the first problems found.
func (c *Config) Validate() error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", key, fmt.Sprintf(format, args...)))
	}
	if isSocketDir(c.Listen) {
		if err := checkSocketPath(c.Listen, c.ListenPort, DefaultListenPort); err != nil {
			bad("listen", "%v", err)
		}
		if c.ListenPort < 0 || c.ListenPort > 65535 {
			bad("listen_port", "must be a number from 1 to 65535, got %d", c.ListenPort)
		}
		// PostgreSQL answers SSLRequest on a Unix socket with 'N'.
		if c.TLS != (ClientTLS{}) {
			bad("tls", "not used when listen is a Unix socket directory (there is no TLS over a Unix socket)")
		}
	} else {
		if err := checkHostPort(c.Listen); err != nil {
			bad("listen", "%v (or an absolute directory for a Unix socket)", err)
		}
		if c.ListenPort != 0 {
			bad("listen_port", "only used when listen is a Unix socket directory; put the port in listen")
		}
	}
	switch {
	case c.Upstream.Address == "":
		bad("upstream.address", "required (host:port of the PostgreSQL server, or the directory of its Unix socket)")
	case isSocketDir(c.Upstream.Address):
		if err := checkSocketPath(c.Upstream.Address, c.Upstream.Port, DefaultUpstreamPort); err != nil {
			bad("upstream.address", "%v", err)
		}
		if c.Upstream.Port < 0 || c.Upstream.Port > 65535 {
			bad("upstream.port", "must be a number from 1 to 65535, got %d", c.Upstream.Port)
		}
		// libpq never negotiates TLS over a Unix socket, and PostgreSQL
		// refuses it there.
		if c.Upstream.TLS.Mode != "disable" {
			bad("upstream.tls.mode", "must be disable when upstream.address is a Unix socket directory (there is no TLS over a Unix socket)")
		}
	default:
		if err := checkHostPort(c.Upstream.Address); err != nil {
			bad("upstream.address", "%v (or an absolute directory for a Unix socket)", err)
		}
		if c.Upstream.Port != 0 {
			bad("upstream.port", "only used when upstream.address is a Unix socket directory; put the port in upstream.address")
		}
	}
	if c.Upstream.ConnectTimeout <= 0 {
		bad("upstream.connect_timeout", "must be positive, got %v", c.Upstream.ConnectTimeout)
	}
	switch c.Upstream.TLS.Mode {
	case "disable", "require":
		if c.Upstream.TLS.ServerName != "" {
			bad("upstream.tls.server_name", "only used with upstream.tls.mode verify-full")
		}
	case "verify-ca", "verify-full":
		if c.Upstream.TLS.CAFile == "" {
			bad("upstream.tls.ca_file", "required when upstream.tls.mode is %s", c.Upstream.TLS.Mode)
		}
		if c.Upstream.TLS.Mode == "verify-ca" && c.Upstream.TLS.ServerName != "" {
			bad("upstream.tls.server_name", "only used with upstream.tls.mode verify-full")
		}
	default:
		bad("upstream.tls.mode", "must be one of disable, require, verify-ca, verify-full; got %q", c.Upstream.TLS.Mode)
	}
	if c.Upstream.TLS.CAFile != "" {
		if err := checkReadable(c.Upstream.TLS.CAFile); err != nil {
			bad("upstream.tls.ca_file", "%v", err)
		}
	}
	if (c.TLS.CertFile == "") != (c.TLS.KeyFile == "") {
		bad("tls", "cert_file and key_file must be set together")
	}
	for key, f := range map[string]string{"tls.cert_file": c.TLS.CertFile, "tls.key_file": c.TLS.KeyFile} {
		if f != "" {
			if err := checkReadable(f); err != nil {
				bad(key, "%v", err)
			}
		}
	}
	if c.TLS.Require && c.TLS.CertFile == "" {
		bad("tls.require", "needs tls.cert_file and tls.key_file")
	}
	c.validateAuth(bad)
	if c.Limits.MaxConnections <= 0 {
		bad("limits.max_connections", "must be positive, got %d", c.Limits.MaxConnections)
	}
	if c.Limits.MaxMessageBytes < 1024 || c.Limits.MaxMessageBytes > 1<<30 {
		bad("limits.max_message_bytes", "must be between 1024 and 1073741824, got %d", c.Limits.MaxMessageBytes)
	}
	if c.Limits.LargeMessageBudget < 1<<20 {
		bad("limits.large_message_budget", "must be at least 1048576, got %d", c.Limits.LargeMessageBudget)
	}
	if c.Limits.LargeMessageWait <= 0 {
		bad("limits.large_message_wait", "must be positive, got %v", c.Limits.LargeMessageWait)
	}
	if c.Limits.RelayLoops < 0 || c.Limits.RelayLoops > maxRelayLoops {
		bad("limits.relay_loops", "must be between 0 (half the CPUs) and %d, got %d", maxRelayLoops, c.Limits.RelayLoops)
	}
	if c.Limits.StartupTimeout <= 0 {
		bad("limits.startup_timeout", "must be positive, got %v", c.Limits.StartupTimeout)
	}
	if c.Shutdown.Delay < 0 {
		bad("shutdown.delay", "must not be negative, got %v", c.Shutdown.Delay)
	}
	if c.Shutdown.DrainTimeout < 0 {
		bad("shutdown.drain_timeout", "must not be negative, got %v", c.Shutdown.DrainTimeout)
	}
	switch c.Log.Format {
	case "json", "console":
	default:
		bad("log.format", "must be json or console, got %q", c.Log.Format)
	}
	switch c.Log.Level {
	case "debug", "info", "warn", "error":
	default:
		bad("log.level", "must be debug, info, warn or error, got %q", c.Log.Level)
	}
	if c.Admin.Listen != "" && c.Admin.Listen != "off" {
		if err := checkHostPort(c.Admin.Listen); err != nil {
			bad("admin.listen", "%v", err)
		}
	}
	if c.Audit.DSN != "" {
		if _, err := pgconn.ParseConfig(c.Audit.DSN); err != nil {
			// pgconn's error may quote the DSN, password included: do not
			// repeat it.
			bad("audit.dsn", "not a valid connection string")
		}
	}
	if c.MaxCheckBytes < 1024 {
		bad("max_check_bytes", "must be at least 1024, got %d", c.MaxCheckBytes)
	}
	if c.AutoPrepare < 0 || c.AutoPrepare > maxAutoPrepare {
		bad("auto_prepare", "must be between 0 (never) and %d, got %d", maxAutoPrepare, c.AutoPrepare)
	}
	if c.RewriteCacheEntries < 0 {
		bad("rewrite_cache_entries", "must not be negative, got %d", c.RewriteCacheEntries)
	}
	if _, err := c.Rules(); err != nil {
		errs = append(errs, err)
	}
	if err := c.Guard.validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// RulesConfig returns the rewriter's part of the configuration.
func (c *Config) RulesConfig() rules.Config {
	return rules.Config{TokenSetting: c.TokenSetting, LockSetting: c.LockSetting, Tables: c.Tables, CacheSize: c.RewriteCacheEntries, MaxCheckBytes: c.MaxCheckBytes}
}

// Rules compiles the protected-table rules.
func (c *Config) Rules() (*rules.Rules, error) {
	return rules.Compile(c.RulesConfig())
}

// Notifies reports whether some table's statements report through
// pg_notify, so that an audit listener is needed (see rules.Config.Notifies).
func (c *Config) Notifies() bool { return c.RulesConfig().Notifies() }

// AuditConnConfig returns the audit listener's connection settings for one
// database.
func (c *Config) AuditConnConfig(database string) (*pgconn.Config, error) {
	dsn := c.Audit.DSN
	if dsn == "" {
		// The upstream's own address and TLS settings: TLS is set below
		// from UpstreamTLSConfig, the one the relay uses.
		u := url.URL{Scheme: "postgres", User: url.User("postgres"), Path: "/", RawQuery: "sslmode=disable"}
		if dir, port, ok := c.Upstream.socketDir(); ok {
			// pgconn, like libpq, takes a host starting with "/" for the
			// directory of a Unix socket.
			u.RawQuery = url.Values{"host": {dir}, "port": {strconv.Itoa(port)}, "sslmode": {"disable"}}.Encode()
		} else {
			host, port, _ := net.SplitHostPort(c.Upstream.Address)
			u.Host = net.JoinHostPort(host, port)
		}
		dsn = u.String()
	}
	pc, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return nil, errors.New("audit.dsn: not a valid connection string")
	}
	pc.Database = database
	if c.Audit.DSN == "" {
		tc, err := c.UpstreamTLSConfig()
		if err != nil {
			return nil, err
		}
		pc.TLSConfig, pc.Fallbacks = tc, nil
	}
	if pw := os.Getenv(c.Audit.PasswordEnv); pw != "" && c.Audit.PasswordEnv != "" {
		pc.Password = pw
	}
	if pc.RuntimeParams == nil {
		pc.RuntimeParams = map[string]string{}
	}
	pc.RuntimeParams["application_name"] = "fenceproxy-audit"
	return pc, nil
}

// AdminEnabled reports whether the admin listener is configured.
func (c *Config) AdminEnabled() bool {
	return c.Admin.Listen != "" && c.Admin.Listen != "off"
}

// Ports in the names of Unix sockets when listen_port and upstream.port
// are not set.
const (
	DefaultListenPort   = 6432
	DefaultUpstreamPort = 5432
)

// ListenNetwork returns the network and address to listen on: "tcp" and
// host:port, or "unix" and the socket file's path.
func (c *Config) ListenNetwork() (network, address string) {
	if isSocketDir(c.Listen) {
		return "unix", socketPath(c.Listen, c.ListenPort, DefaultListenPort)
	}
	return "tcp", c.Listen
}

// Dial returns the network and address to dial the upstream at: "tcp" and
// host:port, or "unix" and the socket file's path.
func (u *Upstream) Dial() (network, address string) {
	if dir, port, ok := u.socketDir(); ok {
		return "unix", socketPath(dir, port, DefaultUpstreamPort)
	}
	return "tcp", u.Address
}

// socketDir returns the socket directory and port when Address names one.
func (u *Upstream) socketDir() (dir string, port int, ok bool) {
	if !isSocketDir(u.Address) {
		return "", 0, false
	}
	port = u.Port
	if port == 0 {
		port = DefaultUpstreamPort
	}
	return u.Address, port, true
}

// isSocketDir reports whether an address is a Unix socket directory, as
// libpq decides for host: it starts with "/".
func isSocketDir(s string) bool { return strings.HasPrefix(s, "/") }

// socketPath is libpq's and PostgreSQL's name for the socket of a port.
func socketPath(dir string, port, def int) string {
	if port == 0 {
		port = def
	}
	return filepath.Join(dir, ".s.PGSQL."+strconv.Itoa(port))
}

// maxSocketPath is the longest path a Unix socket may have: sun_path holds
// 108 bytes on Linux (104 on the BSDs), including the terminating NUL.
const maxSocketPath = 103

func checkSocketPath(dir string, port, def int) error {
	if p := socketPath(dir, port, def); len(p) > maxSocketPath {
		return fmt.Errorf("socket path %q is longer than %d bytes, the limit of a Unix socket's name", p, maxSocketPath)
	}
	return nil
}

func checkHostPort(s string) error {
	_, port, err := net.SplitHostPort(s)
	if err != nil {
		return fmt.Errorf("must be host:port, got %q", s)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("port must be a number from 0 to 65535, got %q", s)
	}
	return nil
}

func checkReadable(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	return f.Close()
}
