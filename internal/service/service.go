// Package service runs a whole fenceproxy instance from a configuration:
// the relay, the rule policy, the admin listener with metrics, hot reload of
// the rules (SIGHUP and config file changes) and graceful shutdown.
//
// cmd/fenceproxy calls RunConfig; the demo and tests call Start to get the
// bound addresses and a handle for reloading.
package service

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/admin"
	"github.com/fenceproxy/fenceproxy/internal/audit"
	"github.com/fenceproxy/fenceproxy/internal/authfile"
	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/metrics"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Instance is a running fenceproxy.
type Instance struct {
	log      *zap.Logger
	path     string
	srv      *proxy.Server
	policy   *policy.Policy
	auditor  *audit.Listener
	checker  *dbsetup.Checker
	auditTag string
	metrics  *metrics.Metrics

	listener net.Listener
	adminL   net.Listener

	mu  sync.Mutex
	cfg *config.Config
	// cfgSHA256 and loadedAt describe the rules in force for /rules:
	// the hex SHA-256 of the file they were read from ("" when they did not
	// come from the file) and when they were installed. Guarded by mu.
	cfgSHA256 string
	loadedAt  time.Time

	shutdownDelay time.Duration
	drainTimeout  time.Duration
	// stopping is set when Shutdown begins, before the delay: /readyz
	// fails from then on while the relay still accepts.
	stopping    atomic.Bool
	serveErr    chan error
	adminCancel context.CancelFunc
	adminDone   chan struct{}
	stopOnce    sync.Once
	stopErr     error
}

// Start builds and starts an instance from cfg. path is the config file
// used for reloads ("" disables file reloads).
func Start(cfg *config.Config, path string, log *zap.Logger) (*Instance, error) {
	if log == nil {
		log = zap.NewNop()
	}
	tag := auditTag()
	rs, err := compileRules(cfg, tag)
	if err != nil {
		return nil, err
	}
	m := metrics.New()
	in := &Instance{log: log, path: path, metrics: m, cfg: cfg, auditTag: tag, loadedAt: time.Now()}
	if path != "" {
		// The caller loaded cfg from path; hash the file as it is now.
		if data, err := os.ReadFile(path); err == nil {
			in.cfgSHA256 = sha256Hex(data)
		}
	}
	m.ConfigLastReload.Set(float64(in.loadedAt.UnixNano()) / 1e9)
	var pol *policy.Policy
	aud := audit.New(audit.Options{
		Tag: tag,
		ConnConfig: func(db string) (*pgconn.Config, error) {
			in.mu.Lock()
			c := in.cfg
			in.mu.Unlock()
			return c.AuditConnConfig(db)
		},
		Lookup: func(pid uint32) (proxy.SessionInfo, bool) {
			if in.srv == nil {
				return proxy.SessionInfo{}, false
			}
			return in.srv.SessionByBackendPID(pid)
		},
		KnownTable:     func(t string) bool { return pol.KnownTable(t) },
		Logger:         log,
		Metrics:        m,
		ConnectTimeout: cfg.Upstream.ConnectTimeout,
		// Listeners start once the checker and the policy are in place
		// (Policy.CatalogChanged starts them).
		CatalogChanged: func(db string) {
			in.checker.CatalogChanged(db)
			in.policy.CatalogChanged(db)
			// The change committed: a migration that made it has ended.
			in.policy.PollMigrations(db)
		},
	})
	// The database check's connections, also the policy's catalog
	// lookups (migrations at start-up).
	connect := func(ctx context.Context, db string) (*pgx.Conn, error) {
		in.mu.Lock()
		c := in.cfg
		in.mu.Unlock()
		pc, err := c.AuditConnConfig(db)
		if err != nil {
			return nil, err
		}
		// A pgx configuration must come from ParseConfig; its connection
		// part is the audit connection's.
		cc, err := pgx.ParseConfig("")
		if err != nil {
			return nil, err
		}
		cc.Config = *pc
		cc.RuntimeParams["application_name"] = "fenceproxy-check"
		return pgx.ConnectConfig(ctx, cc)
	}
	checker := dbsetup.NewChecker(connect, log.Named("check"), m)
	specs, err := rules.Specs(cfg.RulesConfig())
	if err != nil {
		aud.Close()
		return nil, err
	}
	checker.ReloadWith(specs, checkOptions(cfg))
	pol = policy.New(rs, cfg.Notifies(), policy.Options{Logger: log, Metrics: m, Auditor: aud, Checks: checker, ConfigFile: path,
		CheckWait: 2 * cfg.Upstream.ConnectTimeout})
	pol.SetMigrations(policy.MigrationOptions{AllowRoles: cfg.DDL.AllowRoles, Catalog: connect})
	in.policy, in.auditor, in.checker = pol, aud, checker
	opts, err := ProxyOptions(cfg)
	if err != nil {
		return nil, err
	}
	opts.Logger = log
	opts.Policy = pol
	opts.Hooks = m.Hooks()
	srv, err := proxy.NewServer(opts)
	if err != nil {
		aud.Close()
		return nil, err
	}
	l, err := listen(cfg)
	if err != nil {
		aud.Close()
		return nil, err
	}
	in.srv, in.listener = srv, l
	m.CountOffLoopTasks(srv.OffLoopTasks)
	in.shutdownDelay = cfg.Shutdown.Delay
	in.drainTimeout, in.serveErr, in.adminDone = cfg.Shutdown.DrainTimeout, make(chan error, 1), make(chan struct{})
	if cfg.AdminEnabled() {
		al, err := net.Listen("tcp", cfg.Admin.Listen)
		if err != nil {
			_ = l.Close()
			aud.Close()
			return nil, fmt.Errorf("admin.listen: %w", err)
		}
		in.adminL = al
		actx, cancel := context.WithCancel(context.Background())
		in.adminCancel = cancel
		h := admin.Handler(in.adminOptions())
		go func() {
			defer close(in.adminDone)
			if err := admin.Serve(actx, al, h); err != nil {
				log.Error("admin listener failed", zap.Error(err))
			}
		}()
	} else {
		close(in.adminDone)
	}
	go func() { in.serveErr <- srv.Serve(l) }()
	log.Info("fenceproxy listening", zap.String("listen", l.Addr().String()),
		zap.String("admin", in.AdminAddr()), zap.String("upstream", cfg.Upstream.Address),
		zap.Int("protected-tables", len(cfg.Tables)))
	return in, nil
}

// Addr is the address clients connect to.
func (in *Instance) Addr() string { return in.listener.Addr().String() }

// AdminAddr is the admin listener's address, or "" when disabled.
func (in *Instance) AdminAddr() string {
	if in.adminL == nil {
		return ""
	}
	return in.adminL.Addr().String()
}

// CountDroppedLogLines makes the metric of dropped log lines report what
// dropped returns (the log output's count, see package logsink).
func (in *Instance) CountDroppedLogLines(dropped func() uint64) {
	in.metrics.CountDroppedLogLines(dropped)
}

// Server returns the relay.
func (in *Instance) Server() *proxy.Server { return in.srv }

func (in *Instance) ready(ctx context.Context) error {
	if in.stopping.Load() || in.srv.Draining() {
		return errors.New("shutting down")
	}
	in.mu.Lock()
	network, addr := in.cfg.Upstream.Dial()
	timeout := in.cfg.Upstream.ConnectTimeout
	in.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := admin.ProbeUpstream(ctx, network, addr); err != nil {
		return fmt.Errorf("upstream unreachable: %w", err)
	}
	return nil
}

// Reload reads the config file again and installs its rules and the
// migrations roles (ddl.allow_roles). An invalid file leaves the running
// ones in force. The keys of restartOnly need a restart; a change to them
// is logged and otherwise ignored.
func (in *Instance) Reload() error {
	if in.path == "" {
		return errors.New("service: no config file to reload")
	}
	// Read once: the hash /rules shows must be of the bytes loaded.
	data, err := os.ReadFile(in.path)
	var cfg *config.Config
	if err == nil {
		cfg, err = config.Parse(data)
		if err != nil {
			err = fmt.Errorf("config %s: %w", in.path, err)
		}
	} else {
		err = fmt.Errorf("config: %w", err)
	}
	if err == nil {
		err = in.apply(cfg, sha256Hex(data))
	}
	if err != nil {
		in.metrics.ConfigReloads.WithLabelValues("failed").Inc()
		in.log.Error("config reload failed; keeping the running config", zap.Error(err))
		return err
	}
	return nil
}

// Apply installs the rules of cfg (already validated).
func (in *Instance) Apply(cfg *config.Config) error { return in.apply(cfg, "") }

// apply installs the rules of cfg, read from a file whose hex SHA-256 is
// sum ("" when they were not read from the file).
func (in *Instance) apply(cfg *config.Config, sum string) error {
	rs, err := compileRules(cfg, in.auditTag)
	if err != nil {
		return err
	}
	in.mu.Lock()
	// Keys that need a restart keep their running values, so that /readyz
	// and new audit listeners keep using the upstream the relay uses.
	running := *cfg
	var changed []string
	for _, k := range restartOnly {
		if k.keep(&running, in.cfg) {
			changed = append(changed, k.key)
		}
	}
	in.cfg = &running
	in.cfgSHA256, in.loadedAt = sum, time.Now()
	loadedAt := in.loadedAt
	in.mu.Unlock()
	if len(changed) > 0 {
		in.log.Warn("config keys changed that take effect only after a restart", zap.Strings("keys", changed))
	}
	in.policy.Swap(rs, cfg.Notifies())
	in.policy.SetMigrationRoles(cfg.DDL.AllowRoles)
	if specs, err := rules.Specs(cfg.RulesConfig()); err == nil {
		in.checker.ReloadWith(specs, checkOptions(cfg)) // the databases seen are checked again
	}
	in.metrics.ConfigReloads.WithLabelValues("ok").Inc()
	in.metrics.ConfigLastReload.Set(float64(loadedAt.UnixNano()) / 1e9)
	in.log.Info("config reloaded", zap.Int("protected-tables", len(cfg.Tables)))
	return nil
}

// restartOnly lists the config sections read only at start. keep puts the
// running value back into a reloaded config and reports whether the file
// asked for a change.
var restartOnly = []struct {
	key  string
	keep func(reloaded, running *config.Config) bool
}{
	{"listen", func(r, o *config.Config) bool { return keep(&r.Listen, o.Listen) }},
	{"listen_port", func(r, o *config.Config) bool { return keep(&r.ListenPort, o.ListenPort) }},
	{"upstream", func(r, o *config.Config) bool { return keep(&r.Upstream, o.Upstream) }},
	{"tls", func(r, o *config.Config) bool { return keep(&r.TLS, o.TLS) }},
	{"auth", func(r, o *config.Config) bool { return keep(&r.Auth, o.Auth) }},
	{"limits", func(r, o *config.Config) bool { return keep(&r.Limits, o.Limits) }},
	{"log", func(r, o *config.Config) bool { return keep(&r.Log, o.Log) }},
	{"admin", func(r, o *config.Config) bool { return keep(&r.Admin, o.Admin) }},
	{"shutdown", func(r, o *config.Config) bool { return keep(&r.Shutdown, o.Shutdown) }},
	{"auto_prepare", func(r, o *config.Config) bool { return keep(&r.AutoPrepare, o.AutoPrepare) }},
}

func keep[T any](dst *T, running T) bool {
	changed := !reflect.DeepEqual(*dst, running)
	*dst = running
	return changed
}

// Wait blocks until the relay stops by itself (a listener failure).
func (in *Instance) Wait() <-chan error { return in.serveErr }

// Shutdown first waits for the shutdown delay, during which /readyz fails
// but new clients are still served, so that load balancers and
// Kubernetes endpoints (which act on readiness, not on the signal) stop
// sending clients before the proxy refuses them. Then it drains: stop
// accepting, let sessions finish their transaction, and close what
// remains after the drain timeout.
func (in *Instance) Shutdown() error { return in.stop(in.shutdownDelay) }

// stop shuts down after delay (see Shutdown).
func (in *Instance) stop(delay time.Duration) error {
	in.stopOnce.Do(func() {
		in.stopping.Store(true)
		if delay > 0 {
			in.log.Info("shutdown requested; not ready, still accepting", zap.Duration("delay", delay))
			time.Sleep(delay)
		}
		in.log.Info("shutting down", zap.Duration("drain-timeout", in.drainTimeout),
			zap.Int("sessions", in.srv.ActiveSessions()))
		ctx, cancel := context.WithTimeout(context.Background(), in.drainTimeout)
		defer cancel()
		err := in.srv.Shutdown(ctx)
		if in.adminCancel != nil {
			in.adminCancel()
		}
		<-in.adminDone
		in.auditor.Close()
		in.checker.Close()
		select {
		case serr := <-in.serveErr:
			if serr != nil && !errors.Is(serr, proxy.ErrServerClosed) {
				err = errors.Join(err, serr)
			}
		case <-time.After(time.Second):
		}
		in.stopErr = err
		in.log.Info("fenceproxy stopped")
	})
	return in.stopErr
}

// compileRules compiles the rules of cfg for an instance whose audit
// events carry tag.
func compileRules(cfg *config.Config, tag string) (*rules.Rules, error) {
	rc := cfg.RulesConfig()
	rc.AuditTag = tag
	return rules.Compile(rc)
}

// auditTag returns a random identifier for this instance's audit events.
func auditTag() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// ProxyOptions translates the config into relay options; TLS files are
// loaded here so that errors name the config key.
func ProxyOptions(cfg *config.Config) (proxy.Options, error) {
	network, addr := cfg.Upstream.Dial()
	opts := proxy.Options{
		UpstreamNetwork:  network,
		UpstreamAddr:     addr,
		ConnectTimeout:   cfg.Upstream.ConnectTimeout,
		MaxConnections:   cfg.Limits.MaxConnections,
		MaxMessageBytes:  cfg.Limits.MaxMessageBytes,
		StartupTimeout:   cfg.Limits.StartupTimeout,
		RelayLoops:       cfg.Limits.RelayLoops,
		RequireClientTLS: cfg.TLS.Require,
		AutoPrepare:      cfg.AutoPrepare,
		LargeMessages:    proxy.NewMessageBudget(cfg.Limits.LargeMessageBudget, cfg.Limits.LargeMessageWait),
	}
	if cfg.TLS.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(cfg.TLS.CertFile, cfg.TLS.KeyFile)
		if err != nil {
			return opts, fmt.Errorf("tls.cert_file/tls.key_file: %w", err)
		}
		opts.ClientTLS = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	up, err := cfg.UpstreamTLSConfig()
	if err != nil {
		return opts, err
	}
	opts.UpstreamTLS = up
	opts.UpstreamTLSFollowsClient = cfg.Upstream.TLS.FollowClient
	if cfg.Auth.Method == "cert" {
		if opts.ClientCertAuth, err = certAuth(cfg); err != nil {
			return opts, err
		}
	}
	return opts, nil
}

// certAuth loads tls.client_ca_file and auth.file for auth.method cert.
func certAuth(cfg *config.Config) (*proxy.CertAuth, error) {
	pem, err := os.ReadFile(cfg.TLS.ClientCAFile)
	if err != nil {
		return nil, fmt.Errorf("tls.client_ca_file: %w", err)
	}
	ca := &proxy.CertAuth{CAs: x509.NewCertPool()}
	if !ca.CAs.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("tls.client_ca_file: no PEM certificates in %s", cfg.TLS.ClientCAFile)
	}
	if cfg.Auth.File != "" {
		if ca.Passwords, err = authfile.Load(cfg.Auth.File); err != nil {
			return nil, fmt.Errorf("auth.file: %w", err)
		}
	}
	return ca, nil
}

// checkOptions are the settings of cfg the database check compares the
// guard with.
func checkOptions(cfg *config.Config) dbsetup.CheckOptions {
	return dbsetup.CheckOptions{TokenSetting: cfg.TokenSetting, LockSetting: cfg.LockSetting, Tables: cfg.Tables, ExemptRoles: cfg.Guard.ExemptRoles}
}
