package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/fenceproxy/fenceproxy/config"
	"github.com/fenceproxy/fenceproxy/policy"
	"github.com/fenceproxy/fenceproxy/proxy"
)

func serveMain(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	path := fs.String("c", "fenceproxy.yaml", "config file")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	cfg, err := config.Load(*path)
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy: %v\n", err)
		return 1
	}
	log, err := newLogger(cfg.Log, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy: %v\n", err)
		return 1
	}
	defer func() { _ = log.Sync() }()
	if err := serve(ctx, cfg, *path, log, nil); err != nil {
		log.Error("fenceproxy stopped", zap.Error(err))
		return 1
	}
	return 0
}

// serve runs the proxy until ctx is done, then drains. ready, when non-nil,
// receives the bound listen address once the proxy accepts connections.
func serve(ctx context.Context, cfg *config.Config, path string, log *zap.Logger, ready func(addr string)) error {
	rs, err := cfg.Rules()
	if err != nil {
		return err
	}
	pol := policy.New(rs)

	opts, err := proxyOptions(cfg)
	if err != nil {
		return err
	}
	opts.Logger = log
	opts.Policy = pol
	srv, err := proxy.NewServer(opts)
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	log.Info("fenceproxy listening", zap.String("listen", l.Addr().String()),
		zap.String("upstream", cfg.Upstream.Address), zap.Int("protected-tables", len(cfg.Tables)))
	if ready != nil {
		ready(l.Addr().String())
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(l) }()

	select {
	case err := <-serveErr:
		_ = srv.Close()
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down", zap.Duration("drain-timeout", cfg.Shutdown.DrainTimeout),
		zap.Int("sessions", srv.ActiveSessions()))
	dctx, cancel := context.WithTimeout(context.Background(), cfg.Shutdown.DrainTimeout)
	defer cancel()
	err = srv.Shutdown(dctx)
	if serr := <-serveErr; serr != nil && !errors.Is(serr, proxy.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	log.Info("fenceproxy stopped")
	return err
}

// proxyOptions translates the config into proxy options (TLS files are
// loaded here so that errors name the config key).
func proxyOptions(cfg *config.Config) (proxy.Options, error) {
	opts := proxy.Options{
		UpstreamAddr:     cfg.Upstream.Address,
		ConnectTimeout:   cfg.Upstream.ConnectTimeout,
		MaxConnections:   cfg.Limits.MaxConnections,
		MaxMessageBytes:  cfg.Limits.MaxMessageBytes,
		StartupTimeout:   cfg.Limits.StartupTimeout,
		RequireClientTLS: cfg.TLS.Require,
	}
	if cfg.TLS.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(cfg.TLS.CertFile, cfg.TLS.KeyFile)
		if err != nil {
			return opts, fmt.Errorf("tls.cert_file/tls.key_file: %w", err)
		}
		opts.ClientTLS = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	switch cfg.Upstream.TLS.Mode {
	case "require":
		// Encrypt without verifying, like libpq's sslmode=require.
		opts.UpstreamTLS = &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12} //nolint:gosec // documented mode
	case "verify-full":
		pem, err := os.ReadFile(cfg.Upstream.TLS.CAFile)
		if err != nil {
			return opts, fmt.Errorf("upstream.tls.ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return opts, fmt.Errorf("upstream.tls.ca_file: no PEM certificates in %s", cfg.Upstream.TLS.CAFile)
		}
		name := cfg.Upstream.TLS.ServerName
		if name == "" {
			name, _, _ = net.SplitHostPort(cfg.Upstream.Address)
		}
		opts.UpstreamTLS = &tls.Config{RootCAs: pool, ServerName: name, MinVersion: tls.VersionTLS12}
	}
	return opts, nil
}

func newLogger(lc config.Log, w io.Writer) (*zap.Logger, error) {
	level, err := zapcore.ParseLevel(lc.Level)
	if err != nil {
		return nil, fmt.Errorf("log.level: %w", err)
	}
	ec := zap.NewProductionEncoderConfig()
	ec.EncodeTime = zapcore.ISO8601TimeEncoder
	var enc zapcore.Encoder
	if lc.Format == "console" {
		ec.EncodeLevel = zapcore.CapitalLevelEncoder
		enc = zapcore.NewConsoleEncoder(ec)
	} else {
		enc = zapcore.NewJSONEncoder(ec)
	}
	core := zapcore.NewCore(enc, zapcore.Lock(zapcore.AddSync(w)), level)
	return zap.New(core), nil
}
